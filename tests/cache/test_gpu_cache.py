"""GPU cache: the hash kernels against their Numba twins, the probe kernel's decode descriptors, and
FeatureCache on CUDA (bit-exact fetches for every compress combination and policy, edge cases, streams,
no hidden syncs). Run with ``pytest -m gpu tests/cache``; skipped where no GPU exists."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from cache_helpers import assert_same_rows, id_batches, uniform, zipf

from ibpcache.cache.entry import EMPTY_ENTRY, entry_compressed, entry_lengths, entry_offsets
from ibpcache.cache.feature_cache import FeatureCache, mode_name
from ibpcache.cache.hashmap import HashIndex
from ibpcache.errors import CapacityError, InvalidIdsError

pytestmark = pytest.mark.gpu

COMBOS = [(False, False), (False, True), (True, False), (True, True)]
POLICIES = ["static", "lru", "lfu"]
CUDA = torch.device("cuda")


def _cache(rows: torch.Tensor, codec: Any, combo: tuple[bool, bool], **kw: Any) -> FeatureCache:
    cc, ch = combo
    return FeatureCache(rows, kw.pop("budget_bytes", 0.02), device="cuda", codec=codec if (cc or ch) else None,
                        compress_cache=cc, compress_host=ch, **kw)


def _ok(fc: FeatureCache, n: int) -> dict[str, Any]:
    st = fc.stats()
    assert st["kernel_status"] == 0
    assert st["requests"] == n and st["hits"] + st["misses"] == n
    assert st["used_bytes"] <= st["budget_bytes"] and fc.slab.nbytes <= fc.budget_bytes
    return st


# ---- hash kernels ------------------------------------------------------------------------------


def test_hash_kernels_agree_with_cpu_twin() -> None:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randperm(5 * 10**6, generator=gen)[:100_000]
    vals = ids * 5 + 1
    probe = torch.cat([ids[::3], torch.arange(5 * 10**6, 5 * 10**6 + 50_000)])
    probe = probe[torch.randperm(probe.numel(), generator=gen)]
    gpu, cpu = HashIndex(ids.numel(), CUDA), HashIndex(ids.numel(), torch.device("cpu"))
    gpu.build(ids, vals)
    cpu.build(ids, vals)
    assert torch.equal(gpu.lookup(probe).cpu(), cpu.lookup(probe))
    # erase a third, insert new keys (reusing tombstones), compare again
    gone, new = ids[::3], torch.arange(6 * 10**6, 6 * 10**6 + 20_000)
    for idx in (gpu, cpu):
        idx.erase(gone)
        idx.insert(new, new + 7)
    everything = torch.cat([ids, new])
    assert torch.equal(gpu.lookup(everything).cpu(), cpu.lookup(everything))
    assert bool((gpu.lookup(gone) == EMPTY_ENTRY).all())


def test_hash_kernel_reports_full_and_duplicates() -> None:
    from ibpcache.kernels.hashmap_cpu import hash_key_cpu

    idx = HashIndex(8, CUDA, max_probes=1)
    mask = idx.capacity - 1
    home = [k for k in range(100000) if int(hash_key_cpu(k)) & mask == 5][:2]
    with pytest.raises(CapacityError, match="max_probes=1"):
        idx.build(torch.tensor(home), torch.tensor([1, 2]))
    idx = HashIndex(8, CUDA)
    with pytest.raises(ValueError, match="duplicate"):
        idx.build(torch.tensor([4, 4]), torch.tensor([1, 2]))


# ---- probe kernel ------------------------------------------------------------------------------


@pytest.mark.parametrize("index", ["hash", "direct"])
def test_probe_writes_correct_descriptors(cora_x, cora_codec, cora_degrees, index) -> None:
    fc = _cache(cora_x, cora_codec, (True, True), hotness=cora_degrees, index=index)
    ids = zipf(cora_x.shape[0], 5000, 0).to(CUDA)
    entries = fc._probe(ids).clone()
    torch.cuda.synchronize()
    ws = fc._ws
    src, lens, comp = ws["src"][: ids.numel()].cpu(), ws["len"][: ids.numel()].cpu(), ws["comp"][: ids.numel()].cpu()
    e, ids_c = entries.cpu(), ids.cpu()
    assert torch.equal(e, fc.index.lookup(ids).cpu())
    hit = e != EMPTY_ENTRY
    assert 0 < int(hit.sum()) < ids.numel()
    # hits: slab address + offset, entry length and flag
    assert torch.equal(src[hit], fc.slab.base_ptr + entry_offsets(e[hit]))
    assert torch.equal(lens[hit], entry_lengths(e[hit]))
    assert torch.equal(comp[hit], entry_compressed(e[hit]))
    # misses: in-place host layout, per-row lengths and flags
    miss_ids = ids_c[~hit]
    assert torch.equal(src[~hit], fc.host.data.data_ptr() + miss_ids * fc.row_bytes)
    assert torch.equal(lens[~hit], fc.host.lengths_cpu[miss_ids])
    assert torch.equal(comp[~hit], fc.host.compressed_cpu[miss_ids])
    st = fc.stats()
    assert st["requests"] == ids.numel() and st["hits"] == int(hit.sum())
    assert st["host_bytes_read"] == int(lens[~hit].sum()) and st["slab_bytes_read"] == int(lens[hit].sum())


def test_probe_with_raw_host_and_packed_layout(cora_x, cora_codec) -> None:
    fc = _cache(cora_x, cora_codec, (True, False), budget_bytes=0.01)
    ids = uniform(cora_x.shape[0], 3000, 0).to(CUDA)
    e = fc._probe(ids).cpu()
    miss = e == EMPTY_ENTRY
    assert bool((fc._ws["len"][: ids.numel()].cpu()[miss] == fc.row_bytes).all())
    assert bool((fc._ws["comp"][: ids.numel()].cpu()[miss] == 0).all())
    packed = cora_codec.compress(cora_x, layout="packed")
    fc = FeatureCache(packed, 0.01, device="cuda", compress_host=True)
    e = fc._probe(ids).cpu()
    miss = e == EMPTY_ENTRY
    assert torch.equal(fc._ws["src"][: ids.numel()].cpu()[miss], fc.host.data.data_ptr() + packed.offsets[ids.cpu()[miss]])


# ---- FeatureCache on CUDA ----------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("combo", COMBOS, ids=[mode_name(*c) for c in COMBOS])
def test_cora_fetch_is_bit_exact_on_cuda(cora_x, cora_codec, cora_degrees, combo, policy) -> None:
    fc = _cache(cora_x, cora_codec, combo, hotness=cora_degrees, policy=policy)
    assert fc.host.data.is_pinned()
    total = 0
    for ids in id_batches(cora_x.shape[0]):
        got = fc.fetch(ids.to(CUDA))
        assert got.is_cuda
        assert_same_rows(got, cora_x, ids)
        total += ids.numel()
    _ok(fc, total)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("combo", COMBOS, ids=[mode_name(*c) for c in COMBOS])
def test_minilm_fetch_is_bit_exact_on_cuda(minilm_x, minilm_codec, combo, policy) -> None:
    fc = _cache(minilm_x, minilm_codec, combo, policy=policy, budget_bytes=0.05)
    for seed in range(4):
        ids = zipf(minilm_x.shape[0], 3000, seed)
        assert_same_rows(fc.fetch(ids.to(CUDA)), minilm_x, ids)
    _ok(fc, 12000)


@pytest.mark.parametrize("combo", COMBOS, ids=[mode_name(*c) for c in COMBOS])
def test_fetch_with_a_bounded_grid_is_bit_exact(cora_x, cora_codec, cora_degrees, minilm_x, minilm_codec,
                                                combo) -> None:
    """One block per multiprocessor walks many rows per warp (the grid-stride loop): the same bytes as the full
    grid, for batches far larger than the grid and for one smaller than it."""
    for x, codec, hot in ((cora_x, cora_codec, cora_degrees), (minilm_x, minilm_codec, None)):
        full = _cache(x, codec, combo, hotness=hot)
        small = _cache(x, codec, combo, hotness=hot, fetch_blocks_per_sm=1)
        assert small.stats()["fetch_blocks_per_sm"] == 1 and full.stats()["fetch_blocks_per_sm"] == 16
        for n, seed in ((40_000, 1), (40_000, 2), (5, 3)):
            ids = zipf(x.shape[0], n, seed).to(CUDA)
            a, b = full.fetch(ids), small.fetch(ids)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            assert_same_rows(b, x, ids.cpu())
        _ok(small, 80_005)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_dynamic_hash_index_churn_on_cuda(cora_x, cora_codec, policy) -> None:
    fc = _cache(cora_x, cora_codec, (True, True), policy=policy, budget_bytes=0.005, index="hash")
    for seed in range(15):
        ids = uniform(cora_x.shape[0], 500, seed)
        assert_same_rows(fc.fetch(ids.to(CUDA)), cora_x, ids)
    _ok(fc, 15 * 500)


def test_static_cuda_matches_cpu_counters(cora_x, cora_codec, cora_degrees) -> None:
    caches = {dev: FeatureCache(cora_x, 0.01, hotness=cora_degrees, device=dev, codec=cora_codec)
              for dev in ("cpu", "cuda")}
    for seed in range(3):
        ids = zipf(cora_x.shape[0], 4000, seed)
        for fc in caches.values():
            fc.fetch(ids)
    a, b = caches["cpu"].stats(), caches["cuda"].stats()
    for k in ("hits", "misses", "host_bytes_read", "slab_bytes_read", "capacity_rows", "used_bytes"):
        assert a[k] == b[k], k


@pytest.mark.parametrize("combo", COMBOS, ids=[mode_name(*c) for c in COMBOS])
def test_edge_budgets_on_cuda(cora_x, cora_codec, combo) -> None:
    ids = zipf(cora_x.shape[0], 800, 2)
    for budget in (None, 3 * cora_x.numel() * 4):  # None: no slab
        for policy in POLICIES:
            fc = _cache(cora_x, cora_codec, combo, policy=policy, budget_bytes=budget)
            assert_same_rows(fc.fetch(ids), cora_x, ids)
            assert_same_rows(fc.fetch(ids), cora_x, ids)
            st = _ok(fc, 1600)
            if budget is None:
                assert st["hits"] == 0


def test_inputs_and_errors_on_cuda(cora_x, cora_codec) -> None:
    fc = _cache(cora_x, cora_codec, (True, True))
    empty = fc.fetch(torch.empty(0, dtype=torch.int64, device=CUDA))
    assert empty.shape == (0, 1433) and empty.is_cuda
    ids = zipf(cora_x.shape[0], 300, 0)
    assert_same_rows(fc.fetch(ids.to(torch.int32)), cora_x, ids)  # CPU int32 ids
    out = torch.empty(300, 1433, device=CUDA)
    assert fc.fetch(ids.to(CUDA), out=out) is out
    assert_same_rows(out, cora_x, ids)
    for bad in (torch.tensor([-1], device=CUDA), torch.tensor([2708], device=CUDA),
                torch.tensor([1.0], device=CUDA)):
        with pytest.raises(InvalidIdsError):
            fc.fetch(bad)
    assert fc.stats()["kernel_status"] == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.uint8])
def test_dtypes_on_cuda(cora_x, minilm_x, dtype) -> None:
    rows = (minilm_x[:1024] * 100).to(dtype).contiguous() if dtype != torch.uint8 else cora_x[:1024].to(dtype)
    ids = zipf(1024, 700, 3)
    for combo in COMBOS:
        fc = FeatureCache(rows, 0.1, device="cuda", compress_cache=combo[0], compress_host=combo[1], policy="lru")
        assert_same_rows(fc.fetch(ids), rows, ids)
        assert_same_rows(fc.fetch(ids), rows, ids)


def test_fetch_on_a_side_stream(cora_x, cora_codec) -> None:
    fc = _cache(cora_x, cora_codec, (True, True), policy="lru")
    s = torch.cuda.Stream()
    ids = zipf(cora_x.shape[0], 2000, 4).to(CUDA)
    with torch.cuda.stream(s):
        got1 = fc.fetch(ids)
        got2 = fc.fetch(ids)
    s.synchronize()
    assert_same_rows(got1, cora_x, ids)
    assert_same_rows(got2, cora_x, ids)


def test_static_fetch_syncs_only_for_the_id_check(cora_x, cora_codec) -> None:
    fc = _cache(cora_x, cora_codec, (True, True))
    ids = zipf(cora_x.shape[0], 2000, 5).to(CUDA)
    fc.fetch(ids)  # builds kernels and workspaces
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fc.fetch(ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= 2, [str(w.message) for w in syncs]  # the min/max of the range check


@pytest.mark.parametrize("combo", COMBOS, ids=[mode_name(*c) for c in COMBOS])
def test_lazy_static_fetch_never_syncs(cora_x, cora_codec, cora_degrees, combo) -> None:
    """Issue 11: a lookup step with lazy validation runs under set_sync_debug_mode('error')."""
    fc = _cache(cora_x, cora_codec, combo, hotness=cora_degrees, validate="lazy")
    batches = [zipf(cora_x.shape[0], 2000, s).to(CUDA) for s in range(5)]
    out = torch.empty(2000, 1433, device=CUDA)
    fc.fetch(batches[0], out=out)  # builds the kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [fc.fetch(ids).clone() for ids in batches]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for ids, g in zip(batches, got):
        assert_same_rows(g, cora_x, ids)
    st = _ok(fc, 6 * 2000)
    assert st["hits"] > 0


def test_lazy_validation_reports_bad_ids_later_and_keeps_the_context(cora_x, cora_codec) -> None:
    fc = _cache(cora_x, cora_codec, (True, True), validate="lazy")
    ids = torch.tensor([5, 2708, 7, -3], device=CUDA)
    got = fc.fetch(ids)  # no exception yet: no sync was allowed
    with pytest.raises(InvalidIdsError, match="outside"):
        fc.check_errors()
    assert torch.equal(got[1].cpu(), torch.zeros(1433)) and torch.equal(got[3].cpu(), torch.zeros(1433))
    assert_same_rows(got[[0, 2]], cora_x, torch.tensor([5, 7]))
    fc.fetch(torch.tensor([1 << 40], device=CUDA))
    torch.cuda.synchronize()
    with pytest.raises(InvalidIdsError):
        fc.fetch(torch.tensor([3], device=CUDA))  # the next fetch raises what the last one saw
    good = zipf(cora_x.shape[0], 500, 9)
    assert_same_rows(fc.fetch(good), cora_x, good)  # reported once; the cache and the context still work
    fc.check_errors()


@pytest.mark.parametrize("combo", [(True, True), (False, True)], ids=["IBP(C/M)", "IBP(M)"])
def test_static_fetch_is_captured_in_a_cuda_graph(cora_x, cora_codec, cora_degrees, combo) -> None:
    """Issue 11: a whole lookup step captured with torch.cuda.graph and replayed with new ids, outputs exact."""
    fc = _cache(cora_x, cora_codec, combo, hotness=cora_degrees, validate="lazy")
    ids = zipf(cora_x.shape[0], 1024, 0).to(CUDA)
    out = torch.empty(1024, 1433, device=CUDA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fc.fetch(ids, out=out)  # warm up outside the capture (kernel build, module load)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fc.fetch(ids, out=out)
    for seed in range(1, 4):
        new = zipf(cora_x.shape[0], 1024, seed)
        ids.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_same_rows(out, cora_x, new)
    fc.check_errors()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("combo", [(True, True), (False, False)], ids=["IBP(C/M)", "baseline"])
def test_concurrent_fetches_on_streams_are_exact(cora_x, cora_codec, cora_degrees, policy, combo) -> None:
    """Issue 10: 4 threads, each on its own CUDA stream (a prefetch thread beside an eval loop), on Cora rows x40
    with a 5% budget returned wrong rows (static) or tripped a device-side assert (lru). Now every batch is exact
    and the CUDA context stays healthy."""
    from cache_helpers import fetch_from_threads

    rows = cora_x.repeat(40, 1)
    hot = cora_degrees.repeat(40)
    fc = _cache(rows, cora_codec, combo, budget_bytes=0.05, hotness=hot, policy=policy)
    bad = fetch_from_threads(fc, rows, n_threads=4, n_fetches=40, batch=2000, streams=True)
    torch.cuda.synchronize()
    assert bad == [], f"{len(bad)} of 160 concurrent batches differ: {bad[:5]}"
    _ok(fc, 4 * 40 * 2000)
    ids = zipf(rows.shape[0], 500, 7)
    assert_same_rows(fc.fetch(ids), rows, ids)  # the context still works
