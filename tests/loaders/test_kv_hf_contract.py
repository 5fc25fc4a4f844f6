# Adapted from huggingface/transformers (Apache License 2.0, Copyright 2023 The HuggingFace Inc. team):
#   tests/utils/test_cache_utils.py at commit 00b1f96ad09c1137cfe75e453c4b2bc1dd2abe1e (CacheTest,
#   CacheIntegrationTest, CacheHardIntegrationTest; SyntheticCacheTest.test_dynamic_cache from the same file)
#   and the custom-cache cases of tests/generation/test_utils.py (assisted / prompt-lookup decoding, beam search).
# Changed: run against ibpcache's IBPOffloadedCache (dense and sparse) with the SmolLM2 GGUF on CPU; expected
# texts replaced by token equality with DynamicCache under the same settings; pytest instead of unittest.
"""transformers' cache contract, checked on :class:`~ibpcache.loaders.kv.IBPOffloadedCache`.

Every upstream test that applies to any cache implementation, adapted. ``dense`` must reproduce
``DynamicCache`` exactly (tokens, and K/V bits where the test reads them); ``sparse`` selects tokens, so it is
held to exactness only with ``alpha=inf`` (every token selected) and otherwise must run, reorder and keep shapes.

Upstream tests run here (name -> test below):
  CacheTest.test_reorder_cache_retrocompatibility     -> test_reorder_cache_matches_index_select
  CacheTest.test_static_cache_mha_mqa_gqa              -> test_update_shapes_mha_gqa_mqa (dynamic length)
  SyntheticCacheTest.test_dynamic_cache                -> test_dynamic_cache_scenarios
  CacheIntegrationTest.test_cache_batched              -> test_cache_batched
  CacheIntegrationTest.test_cache_beam_search          -> test_cache_beam_search
  CacheIntegrationTest.test_cache_extra_left_padding   -> test_cache_extra_left_padding
  CacheHardIntegrationTest.test_dynamic_cache_hard     -> test_sampling_scores_equal (short, seeded)
  CacheHardIntegrationTest.test_static_cache_greedy_decoding_pad_left (eager, sdpa) -> test_greedy_pad_left
  CacheHardIntegrationTest.test_offloaded_cache_uses_less_memory_than_dynamic_cache -> test_gpu_beam_peak_memory
  generation: assisted decoding == greedy (draft model), prompt lookup decoding (crop), beam search with
  num_return_sequences -> test_assisted_decoding_equals_greedy, test_prompt_lookup_crops_and_equals_greedy
  Cache API differential (reorder_cache, crop, batch_repeat_interleave, batch_select_indices, reset against
  DynamicCache on the same calls) -> test_cache_api_matches_dynamic_cache (CPU and GPU).

Skipped upstream tests and why:
  test_dynamic_cache_retrocompatibility: the legacy tuple format (to_/from_legacy_cache) is gone in transformers 5.
  test_quantized_cache_generation: quanto/HQQ quantized caches only.
  test_static_cache_*, test_sliding_window_cache, test_hybrid_*, test_hybrid_chunked_*: fixed-size or sliding
    layers; IBPOffloadedCache is a growing full-attention cache (it rejects sliding configs).
  test_cache_copy: deep-copies a prefilled cache; ours holds pinned host memory, a CUDA stream and model hooks,
    which ``copy.deepcopy`` does not duplicate (continuing from a returned cache is covered in test_kv.py).
  test_data_parallel_dynamic_cache, test_static_cache_multi_accelerator: several GPUs / DataParallel rebuild a
    DynamicCache by type.
  test_static_cache_no_cuda_graph_skips, CacheExportIntegrationTest: torch.compile / torch.export; the cache is
    not compileable (host round trips by design).
  test_cache_gptj_model: a hub-only GPT-J test model (no network in CI).
  contrastive search: removed from transformers 5 (a hub ``custom_generate`` repo now), nothing to run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

MODES = ["dense", "sparse"]


# -- the model: all knowledge of where SmolLM2 comes from is in this one helper --------------------------------
def _load_smollm2(attn: str) -> Any:
    pytest.importorskip("gguf")
    from scripts.lib.models import ModelNotFoundError, load_smollm2

    try:
        return load_smollm2(torch.float32, "cpu", attn_implementation=attn)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def smollm2() -> Any:
    """(model, tokenizer), fp32, eager attention: the reference setting for exact comparisons."""
    return _load_smollm2("eager")


def _ibp(model: Any, mode: str, device: str = "cpu", **kw: Any) -> Any:
    from ibpcache.loaders.kv import IBPOffloadedCache

    if mode == "sparse":
        return IBPOffloadedCache(model.config, mode="sparse", model=model, **kw)
    return IBPOffloadedCache(model.config, mode="dense", **kw)


def _exact_kw(mode: str) -> dict:
    """Sparse mode with every token selected is exact attention; dense is exact as is."""
    return {"alpha": float("inf"), "max_num_kv": 10**6} if mode == "sparse" else {}


def _dyn(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _gen(model: Any, inputs: dict, cache: Any, **kw: Any) -> Any:
    kw.setdefault("max_new_tokens", 6)
    kw.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(**inputs, past_key_values=cache, pad_token_id=model.config.eos_token_id,
                              disable_compile=True, **kw)


def _close(cache: Any) -> None:
    if hasattr(cache, "close"):
        cache.close()


# -- synthetic: no model ---------------------------------------------------------------------------------------
def _config(layers: int, kv_heads: int, head_dim: int, heads: "int | None" = None) -> Any:
    from transformers import LlamaConfig

    heads = heads or kv_heads
    return LlamaConfig(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, hidden_size=heads * head_dim, intermediate_size=8, vocab_size=16)


def _ibp_cfg(config: Any, **kw: Any) -> Any:
    from ibpcache.loaders.kv import IBPOffloadedCache

    return IBPOffloadedCache(config, mode="dense", **kw)


def _layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cache holds for ``layer`` (IBP: decoded from the store; DynamicCache: its tensors)."""
    if hasattr(cache, "manager"):
        return cache.manager.fetch_all(layer)
    return cache.layers[layer].keys, cache.layers[layer].values


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu())


@pytest.mark.parametrize("compress", [True, False])
def test_dynamic_cache_scenarios(compress: bool) -> None:
    """SyntheticCacheTest.test_dynamic_cache: prefill + single-token updates, one layer and two layers."""
    cfg = _config(layers=2, kv_heads=1, head_dim=8)

    def tok(*vals: float) -> torch.Tensor:
        return torch.tensor(vals)[None, None, :, None].expand(1, 1, len(vals), 8).contiguous()

    cache = _ibp_cfg(cfg, compress=compress)
    cache.update(tok(1.0, 2.0), tok(1.0, 2.0), 0)
    keys, _ = cache.update(tok(3.0), tok(3.0), 0)
    assert keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0]
    keys, _ = cache.update(tok(4.0), tok(4.0), 0)
    assert keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert _layer_kv(cache, 0)[0][0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0]

    cache = _ibp_cfg(cfg, compress=compress)
    cache.update(tok(1.0, 2.0), tok(1.0, 2.0), 0)
    cache.update(tok(10.0, 20.0), tok(10.0, 20.0), 1)
    for a, b in ((3.0, 30.0), (4.0, 40.0)):
        cache.update(tok(a), tok(a), 0)
        cache.update(tok(b), tok(b), 1)
    assert _layer_kv(cache, 0)[0][0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert _layer_kv(cache, 1)[0][0, 0, :, 0].tolist() == [10.0, 20.0, 30.0, 40.0]
    assert cache.get_seq_length(0) == cache.get_seq_length(1) == 4


@pytest.mark.parametrize("compress", [True, False])
def test_reorder_cache_matches_index_select(compress: bool) -> None:
    """CacheTest.test_reorder_cache_retrocompatibility: reorder_cache == index_select on the batch (the legacy
    ``_reorder_cache``), here also chained with appends, and without rewriting a single stored byte."""
    gen = torch.Generator().manual_seed(0)
    cfg = _config(layers=10, kv_heads=4, head_dim=16)
    cache = _ibp_cfg(cfg, compress=compress)
    ref = []
    for layer in range(10):
        k, v = torch.rand((4, 4, 8, 16), generator=gen), torch.rand((4, 4, 8, 16), generator=gen)
        cache.update(k, v, layer)
        ref.append((k, v))
    written = cache.manager.stats()["pcie_write_bytes"]
    for step in range(3):
        beam_idx = torch.randint(0, 4, (4,), generator=gen)
        cache.reorder_cache(beam_idx)
        ref = [(k.index_select(0, beam_idx), v.index_select(0, beam_idx)) for k, v in ref]
        assert cache.manager.stats()["pcie_write_bytes"] == written, "a reorder must not re-encode rows"
        for layer in range(10):
            got_k, got_v = _layer_kv(cache, layer)
            assert _same_bits(got_k, ref[layer][0]) and _same_bits(got_v, ref[layer][1])
        for layer in range(10):  # a decode step after the reorder
            k, v = torch.rand((4, 4, 1, 16), generator=gen), torch.rand((4, 4, 1, 16), generator=gen)
            keys, values = cache.update(k, v, layer)
            ref[layer] = (torch.cat([ref[layer][0], k], 2), torch.cat([ref[layer][1], v], 2))
            assert _same_bits(keys, ref[layer][0]) and _same_bits(values, ref[layer][1])
        written = cache.manager.stats()["pcie_write_bytes"]


def test_update_shapes_mha_gqa_mqa() -> None:
    """CacheTest.test_static_cache_mha_mqa_gqa: the cache keeps num_key_value_heads heads (MHA, GQA, MQA)."""
    for kv_heads in (32, 4, 1):
        cfg = _config(layers=2, kv_heads=kv_heads, head_dim=128, heads=32)
        cache = _ibp_cfg(cfg)
        k = torch.rand((1, kv_heads, 1, 128))
        keys, values = cache.update(k, k.clone(), 0)
        assert keys.shape == values.shape == (1, kv_heads, 1, 128)


@pytest.mark.parametrize("compress", [True, False])
def test_cache_api_matches_dynamic_cache(compress: bool, device: str = "cpu", transfer: str = "auto") -> None:
    """The same calls on DynamicCache and IBPOffloadedCache (updates, reorder_cache, crop, batch_repeat_interleave,
    batch_select_indices, reset) leave the same K/V bits, layer by layer, and the updates return the same."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(1)
    cfg = _config(layers=3, kv_heads=2, head_dim=16)
    dtype = torch.float16 if device == "cuda" else torch.float32
    ibp = _ibp_cfg(cfg, compress=compress, transfer=transfer)
    dyn = DynamicCache(config=cfg)
    batch = [3]

    def update(n: int) -> None:
        for layer in range(3):
            k = torch.randn((batch[0], 2, n, 16), generator=gen).to(device=device, dtype=dtype)
            v = torch.randn((batch[0], 2, n, 16), generator=gen).to(device=device, dtype=dtype)
            got, want = ibp.update(k, v, layer), dyn.update(k, v, layer)
            assert _same_bits(got[0], want[0]) and _same_bits(got[1], want[1])

    def check() -> None:
        t = dyn.get_seq_length()
        assert ibp.get_seq_length() == t
        for layer in range(3):
            want_k, want_v = dyn.layers[layer].keys, dyn.layers[layer].values
            got = _layer_kv(ibp, layer)
            assert _same_bits(got[0], want_k) and _same_bits(got[1], want_v)
            if t:  # chosen tokens per (batch, head), the sparse path's read, through the same slot table
                idx = torch.randint(0, t, (want_k.shape[0], 2, 5), generator=gen).to(device)
                got = ibp.manager.fetch(layer, idx)
                pick = idx[..., None].expand(-1, -1, -1, 16)
                assert _same_bits(got[0], want_k.gather(2, pick)) and _same_bits(got[1], want_v.gather(2, pick))

    def both(name: str, *args: Any) -> None:
        getattr(ibp, name)(*args)
        getattr(dyn, name)(*args)
        check()

    update(5)
    update(1)
    both("reorder_cache", torch.tensor([2, 0, 0], device=device))
    update(1)
    both("reorder_cache", torch.tensor([1, 2, 1], device=device))
    both("crop", -2)
    update(3)  # a multi-token append after a crop (assisted decoding's verification step)
    both("batch_repeat_interleave", 2)
    batch[0] = 6
    update(1)
    both("batch_select_indices", torch.tensor([5, 0, 3, 3], device=device))
    batch[0] = 4
    update(2)
    both("reorder_cache", torch.tensor([3, 3, 0, 1], device=device))
    both("crop", -4)
    update(1)
    check()
    assert ibp.batch_size == 4
    ibp.reset()
    dyn.reset()
    assert ibp.get_seq_length() == 0
    # A new request with another batch size reuses our cache object. transformers <= 5.17's DynamicCache.reset keeps
    # its lazily-initialised tensors (and so the old batch size), so the reference for this part is a new one.
    dyn = DynamicCache(config=cfg)
    batch[0] = 2
    update(4)
    check()
    _close(ibp)


def test_crop_follows_installed_convention() -> None:
    """crop(-n) removes n tokens; crop(n > 0) does what the installed DynamicLayer does with it."""
    from transformers import DynamicCache

    cfg = _config(layers=1, kv_heads=1, head_dim=8)
    ibp, dyn = _ibp_cfg(cfg), DynamicCache(config=cfg)
    x = torch.rand((1, 1, 5, 8))
    ibp.update(x, x, 0)
    dyn.update(x, x, 0)
    ibp.crop(-1)
    dyn.crop(-1)
    assert ibp.get_seq_length() == dyn.get_seq_length() == 4
    try:
        dyn.crop(2)
    except ValueError:
        with pytest.raises(ValueError, match="positive"):
            ibp.crop(2)
    else:
        ibp.crop(2)
    assert ibp.get_seq_length() == dyn.get_seq_length()
    assert ibp.is_croppable
    with pytest.raises(TypeError):
        ibp.crop(1.5)
    with pytest.raises(TypeError):
        ibp.crop(torch.tensor(1.0))
    before = ibp.get_seq_length()
    ibp.crop(torch.tensor(0))  # transformers 5.17's prompt lookup passes a 0-d integer tensor: 0 removes nothing
    assert ibp.get_seq_length() == before
    with pytest.raises(ValueError, match="beam_idx"):
        ibp.reorder_cache(torch.tensor([0, 0]))  # batch of 1


# -- with the model ----------------------------------------------------------------------------------------------
def _prompts(tok: Any, texts: list[str], **kw: Any) -> dict:
    tok.padding_side = "left"
    return dict(tok(texts, return_tensors="pt", padding=True, **kw))


@pytest.mark.parametrize("mode", MODES)
def test_cache_batched(smollm2: Any, mode: str) -> None:
    """CacheIntegrationTest.test_cache_batched: a padded batch, greedy, return_dict_in_generate."""
    model, tok = smollm2
    inputs = _prompts(tok, ["A sequence: 1, 2, 3, 4, 5", "A sequence: A, B, C"])
    ref = _gen(model, inputs, _dyn(model), max_new_tokens=8)
    cache = _ibp(model, mode, **_exact_kw(mode))
    out = _gen(model, inputs, cache, max_new_tokens=8, return_dict_in_generate=True)
    assert out.past_key_values is cache
    assert torch.equal(out.sequences, ref)
    _close(cache)


@pytest.mark.parametrize("mode,compress", [("dense", True), ("sparse", True)])
def test_cache_beam_search(smollm2: Any, mode: str, compress: bool) -> None:
    """CacheIntegrationTest.test_cache_beam_search: reorder_cache is used (a sequence switches beams) and the
    beams equal DynamicCache's (eager attention, exact)."""
    model, tok = smollm2
    inputs = _prompts(tok, ["Blue is"])
    kw = dict(max_new_tokens=8, num_beams=2, num_return_sequences=2, return_dict_in_generate=True,
              output_scores=True)
    ref = _gen(model, inputs, _dyn(model), **kw)
    cache = _ibp(model, mode, compress=compress, **_exact_kw(mode))
    out = _gen(model, inputs, cache, **kw)
    assert out.past_key_values is cache
    assert any(len(set(b.tolist())) > 1 for b in out.beam_indices), "no beam switch: reorder_cache untested"
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(out.sequences_scores, ref.sequences_scores)
    _close(cache)


def test_beam_search_batch_of_prompts(smollm2: Any) -> None:
    """Beam search over a padded batch (num_beams 3): every (prompt, beam) row is reordered independently.
    Dense equals DynamicCache; sparse with InfiniGen's selection (not exact attention) must run and return
    well-formed beams."""
    model, tok = smollm2
    inputs = _prompts(tok, ["The capital of France is", "Two plus two"])
    kw = dict(max_new_tokens=5, num_beams=3)
    ref = _gen(model, inputs, _dyn(model), **kw)
    assert torch.equal(_gen(model, inputs, _ibp(model, "dense"), **kw), ref)
    cache = _ibp(model, "sparse", max_num_kv=4)
    out = _gen(model, inputs, cache, **kw)
    assert out.shape == ref.shape and torch.equal(out[:, : inputs["input_ids"].shape[1]], inputs["input_ids"])
    assert max(cache.stats()["selected_k_last"]) <= 4
    _close(cache)


def test_cache_extra_left_padding(smollm2: Any) -> None:
    """CacheIntegrationTest.test_cache_extra_left_padding: extra left padding changes nothing (dense)."""
    model, tok = smollm2
    inputs = _prompts(tok, ["The cat"])
    padded = _prompts(tok, ["The cat"], pad_to_multiple_of=16)
    assert inputs["input_ids"].shape[1] < padded["input_ids"].shape[1]
    out = _gen(model, inputs, _ibp(model, "dense"))
    out_padded = _gen(model, padded, _ibp(model, "dense"))
    assert torch.equal(out, _gen(model, inputs, _dyn(model)))
    n = inputs["input_ids"].shape[1]
    assert tok.batch_decode(out[:, n:]) == tok.batch_decode(out_padded[:, padded["input_ids"].shape[1]:])


def test_sampling_scores_equal(smollm2: Any) -> None:
    """CacheHardIntegrationTest.test_dynamic_cache_hard, short: seeded sampling, same tokens and scores."""
    from transformers import set_seed

    model, tok = smollm2
    inputs = _prompts(tok, ["Here's everything I know about cats. Cats"])
    kw = dict(do_sample=True, max_new_tokens=8, return_dict_in_generate=True, output_scores=True)
    set_seed(0)
    ref = _gen(model, inputs, _dyn(model), **kw)
    set_seed(0)
    out = _gen(model, inputs, _ibp(model, "dense"), **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_greedy_pad_left(smollm2: Any, attn: str) -> None:
    """CacheHardIntegrationTest.test_static_cache_greedy_decoding_pad_left, eager and SDPA attention."""
    model, tok = smollm2
    model.set_attn_implementation(attn)
    try:
        inputs = _prompts(tok, ["The best color is", "We should not undermind the issues at hand"])
        assert torch.equal(_gen(model, inputs, _ibp(model, "dense")), _gen(model, inputs, _dyn(model)))
    finally:
        model.set_attn_implementation("eager")


def _count_crops(cache: Any) -> list:
    """Record the arguments of every ``cache.crop`` call (to prove a test exercised it)."""
    calls: list = []
    crop = cache.crop

    def spy(n: int) -> None:
        calls.append(n)
        crop(n)

    cache.crop = spy
    return calls


@pytest.mark.parametrize("mode", MODES)
def test_prompt_lookup_crops_and_equals_greedy(smollm2: Any, mode: str) -> None:
    """generation tests' prompt lookup decoding: candidate tokens from the prompt, rejected ones cropped away;
    the output equals greedy decoding with DynamicCache."""
    model, tok = smollm2
    inputs = _prompts(tok, ["one two three four, one two three four, one two five six, one two"])
    ref = _gen(model, inputs, _dyn(model), max_new_tokens=10)
    cache = _ibp(model, mode, **_exact_kw(mode))
    calls = _count_crops(cache)
    out = _gen(model, inputs, cache, max_new_tokens=10, prompt_lookup_num_tokens=3)
    assert torch.equal(out, ref)
    assert any(n < 0 for n in calls), f"no candidate was rejected (crop calls {calls}): crop untested"
    _close(cache)


@pytest.mark.parametrize("mode,prefill", [("dense", "sync"), ("dense", "async"), ("sparse", "async")])
def test_chunked_prefill_equals_dynamic_cache(smollm2: Any, mode: str, prefill: str, monkeypatch: Any) -> None:
    """transformers' chunked prefill (``prefill_chunk_size``): each piece attends to the stored ones (take + append
    into); tokens and scores equal DynamicCache's under the same chunking. ``async``: the prefill worker stores every
    piece (the size threshold lowered so small pieces go to it too)."""
    from transformers import GenerationConfig

    from ibpcache.cache import kv_manager

    if not hasattr(GenerationConfig(), "prefill_chunk_size"):
        pytest.skip("this transformers has no chunked prefill")
    monkeypatch.setattr(kv_manager, "_ASYNC_MIN_BYTES", 1)
    model, tok = smollm2
    inputs = _prompts(tok, ["The quick brown fox jumps over the lazy dog, and then the dog", "Count: 1, 2, 3, 4"])
    kw = dict(max_new_tokens=6, prefill_chunk_size=5, return_dict_in_generate=True, output_scores=True)
    ref = _gen(model, inputs, _dyn(model), **kw)
    cache = _ibp(model, mode, prefill=prefill, **_exact_kw(mode))
    out = _gen(model, inputs, cache, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores))
    assert cache.stats()["prefill"] == prefill
    _close(cache)


def test_assisted_decoding_equals_greedy(smollm2: Any) -> None:
    """generation tests' assisted decoding with a draft model (a second SmolLM2 copy in bfloat16, so its
    candidates are sometimes rejected): the output equals greedy decoding with DynamicCache."""
    import copy

    model, tok = smollm2
    draft = copy.deepcopy(model).to(torch.bfloat16)
    inputs = _prompts(tok, ["Write a short poem about the sea."])
    ref = _gen(model, inputs, _dyn(model), max_new_tokens=10)
    cache = _ibp(model, "dense")
    calls = _count_crops(cache)
    out = _gen(model, inputs, cache, max_new_tokens=10, assistant_model=draft)
    assert torch.equal(out, ref)
    assert calls, "assisted decoding did not crop the cache"


# -- GPU ------------------------------------------------------------------------------------------------------------
GPU_PATHS = [("zero_copy", True), ("zero_copy", False), ("cpu_gather", False)]


@pytest.mark.gpu
@pytest.mark.parametrize("transfer,compress", GPU_PATHS)
def test_gpu_cache_api_matches_dynamic_cache(transfer: str, compress: bool) -> None:
    """The differential API test on CUDA: the fetch kernel reads through the slot table (row0)."""
    test_cache_api_matches_dynamic_cache(compress, device="cuda", transfer=transfer)


@pytest.fixture(scope="module")
def smollm2_gpu(smollm2: Any) -> Any:
    import copy

    model, tok = smollm2
    return copy.deepcopy(model).to(device="cuda", dtype=torch.float16), tok


@pytest.mark.gpu
@pytest.mark.parametrize("transfer,compress", GPU_PATHS)
def test_gpu_beam_search_equals_dynamic_cache(smollm2_gpu: Any, transfer: str, compress: bool) -> None:
    model, tok = smollm2_gpu
    inputs = {k: v.cuda() for k, v in _prompts(tok, ["The capital of France is", "Two plus two"]).items()}
    kw = dict(max_new_tokens=12, num_beams=4)
    ref = _gen(model, inputs, _dyn(model), **kw)
    cache = _ibp(model, "dense", compress=compress, transfer=transfer)
    assert torch.equal(_gen(model, inputs, cache, **kw), ref)
    _close(cache)
    cache = _ibp(model, "sparse", compress=compress, transfer=transfer, **_exact_kw("sparse"))
    assert torch.equal(_gen(model, inputs, cache, **kw), ref)
    _close(cache)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_chunked_prefill_equals_dynamic_cache(smollm2_gpu: Any, mode: str) -> None:
    """Chunked prefill on CUDA: every piece of >= 1 MiB goes to the prefill worker (its own stream, staged encode and
    DMA copies), smaller ones are appended by the caller; tokens equal DynamicCache's under the same chunking."""
    from transformers import GenerationConfig

    if not hasattr(GenerationConfig(), "prefill_chunk_size"):
        pytest.skip("this transformers has no chunked prefill")
    model, tok = smollm2_gpu
    text = " ".join(["Fun fact: the ocean covers most of the planet and holds most of its water."] * 40)
    inputs = {k: v.cuda() for k, v in _prompts(tok, [text] * 8).items()}
    kw = dict(max_new_tokens=8, prefill_chunk_size=256)
    ref = _gen(model, inputs, _dyn(model), **kw)
    cache = _ibp(model, mode, **_exact_kw(mode))
    assert torch.equal(_gen(model, inputs, cache, **kw), ref)
    _close(cache)


@pytest.mark.gpu
def test_gpu_prompt_lookup_equals_greedy(smollm2_gpu: Any) -> None:
    model, tok = smollm2_gpu
    inputs = {k: v.cuda() for k, v in _prompts(tok, ["one two three four, one two three four, one two"]).items()}
    ref = _gen(model, inputs, _dyn(model), max_new_tokens=10)
    cache = _ibp(model, "dense")
    calls = _count_crops(cache)
    assert torch.equal(_gen(model, inputs, cache, max_new_tokens=10, prompt_lookup_num_tokens=3), ref)
    assert calls
    _close(cache)
    # sparse, with graphs (the default): after a crop the store rewrites slots, so that step appends eagerly
    cache = _ibp(model, "sparse", **_exact_kw("sparse"))
    calls = _count_crops(cache)
    assert torch.equal(_gen(model, inputs, cache, max_new_tokens=10, prompt_lookup_num_tokens=3), ref)
    assert calls
    _close(cache)


@pytest.mark.gpu
def test_gpu_beam_peak_memory(smollm2_gpu: Any) -> None:
    """CacheHardIntegrationTest.test_offloaded_cache_uses_less_memory_than_dynamic_cache, beam search (4 beams):
    peak GPU memory with IBPOffloadedCache is below DynamicCache's (same tokens)."""
    model, tok = smollm2_gpu
    text = " ".join(["Fun fact: the ocean covers most of the planet and holds most of its water."] * 60)
    inputs = {k: v.cuda() for k, v in _prompts(tok, [text]).items()}
    kw = dict(max_new_tokens=16, num_beams=4, num_return_sequences=4)
    peaks, outs = [], []
    # prefill="sync": each layer's prompt goes to host memory before the next layer runs (the default prefill worker
    # trades GPU memory held for a layer or more in flight for a first token that never waits for the store)
    for make in (lambda: _dyn(model), lambda: _ibp(model, "dense", prefill="sync")):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        cache = make()
        outs.append(_gen(model, inputs, cache, **kw))
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        _close(cache)
        del cache
    assert torch.equal(outs[0], outs[1])
    assert peaks[1] < peaks[0], f"peak GPU bytes: IBP {peaks[1]} vs DynamicCache {peaks[0]}"
