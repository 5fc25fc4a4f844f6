"""FeatureCache on CPU: every fetch equals ``rows[ids]`` bit for bit, for the four compress_cache x
compress_host combinations and every policy, on real data (Cora, MiniLM), with skewed and uniform ids,
duplicates, empty batches, no slab and oversized budgets; plus input validation and the stats contract."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cache_helpers import assert_same_rows, id_batches, uniform, zipf

from ibpcache.cache.feature_cache import FeatureCache, mode_name
from ibpcache.errors import CapacityError, IbpcacheError, InvalidArgumentError, InvalidIdsError, InvalidTypeError

COMBOS = [(False, False), (False, True), (True, False), (True, True)]
POLICIES = ["static", "lru", "lfu"]
STAT_KEYS = {"hits", "misses", "host_bytes_read", "raw_bytes_equivalent", "effective_gbps", "ratio",
             "capacity_rows", "capacity_rows_raw", "budget_bytes", "used_bytes", "policy"}


def _cache(rows: torch.Tensor, codec: Any, combo: tuple[bool, bool], **kw: Any) -> FeatureCache:
    cc, ch = combo
    return FeatureCache(rows, kw.pop("budget_bytes", 0.02), device="cpu", codec=codec if (cc or ch) else None,
                        compress_cache=cc, compress_host=ch, **kw)


def _check_invariants(fc: FeatureCache, n_requests: int) -> dict[str, Any]:
    st = fc.stats()
    assert STAT_KEYS <= set(st)
    assert st["requests"] == n_requests and st["hits"] + st["misses"] == n_requests
    assert st["used_bytes"] <= st["budget_bytes"] and fc.slab.nbytes <= fc.budget_bytes
    assert st["raw_bytes_equivalent"] == n_requests * fc.row_bytes
    assert st["kernel_status"] == 0
    assert st["mode"] == mode_name(fc.compress_cache, fc.compress_host)
    return st


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("combo", COMBOS, ids=[mode_name(*c) for c in COMBOS])
def test_cora_fetch_is_bit_exact(cora_x, cora_codec, cora_degrees, combo, policy) -> None:
    fc = _cache(cora_x, cora_codec, combo, hotness=cora_degrees, policy=policy)
    total = 0
    for ids in id_batches(cora_x.shape[0]):
        assert_same_rows(fc.fetch(ids), cora_x, ids)
        total += ids.numel()
    st = _check_invariants(fc, total)
    assert st["hits"] > 0  # Zipf batches repeat hot rows
    if combo[1]:
        assert st["host_bytes_read"] < st["misses"] * fc.row_bytes / 5  # Cora compresses ~25x
    else:
        assert st["host_bytes_read"] == st["misses"] * fc.row_bytes


@pytest.mark.parametrize("policy", ["static", "lru"])
@pytest.mark.parametrize("combo", COMBOS, ids=[mode_name(*c) for c in COMBOS])
def test_minilm_fetch_is_bit_exact(minilm_x, minilm_codec, combo, policy) -> None:
    fc = _cache(minilm_x, minilm_codec, combo, policy=policy, budget_bytes=0.05)
    for seed in range(3):
        ids = zipf(minilm_x.shape[0], 2000, seed)
        assert_same_rows(fc.fetch(ids), minilm_x, ids)
    _check_invariants(fc, 6000)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("combo", COMBOS, ids=[mode_name(*c) for c in COMBOS])
def test_no_slab_serves_everything_from_host(cora_x, cora_codec, combo, policy) -> None:
    fc = _cache(cora_x, cora_codec, combo, policy=policy, budget_bytes=None)
    ids = zipf(cora_x.shape[0], 500, 3)
    assert_same_rows(fc.fetch(ids), cora_x, ids)
    st = _check_invariants(fc, 500)
    assert st["capacity_rows"] == 0 and st["hits"] == 0 and st["used_bytes"] == 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("combo", COMBOS, ids=[mode_name(*c) for c in COMBOS])
def test_budget_larger_than_data(cora_x, cora_codec, combo, policy) -> None:
    raw = cora_x.numel() * 4
    fc = _cache(cora_x, cora_codec, combo, policy=policy, budget_bytes=3 * raw)
    assert fc.capacity_rows == cora_x.shape[0]
    ids = torch.arange(cora_x.shape[0])
    assert_same_rows(fc.fetch(ids), cora_x, ids)  # dynamic: all admitted now
    assert_same_rows(fc.fetch(ids.flip(0)), cora_x, ids.flip(0))
    fc.reset_stats()
    assert_same_rows(fc.fetch(ids), cora_x, ids)
    st = _check_invariants(fc, ids.numel())
    assert st["hits"] == ids.numel()
    if combo[0]:  # compressed: static packs rows back to back, dynamic slots fit the longest row
        assert st["used_bytes"] <= raw / (20 if policy == "static" else 10)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_one_slot_cache_churns_correctly(cora_x, cora_codec, policy) -> None:
    """A cache of exactly one raw row: every batch evicts (GraphBolt's capacity-1 case)."""
    one_row = -(-cora_x.shape[1] * 4 // 16) * 16  # slabs are allocated in 16-byte units
    fc = _cache(cora_x, cora_codec, (False, True), policy=policy, budget_bytes=one_row)
    assert fc.capacity_rows == 1
    for seed in range(6):
        ids = uniform(cora_x.shape[0], 50, seed)
        assert_same_rows(fc.fetch(ids), cora_x, ids)
    _check_invariants(fc, 300)


def test_more_distinct_ids_than_slots_are_served(cora_x, cora_codec) -> None:
    fc = _cache(cora_x, cora_codec, (True, True), policy="lru", budget_bytes=2000)
    ids = torch.randperm(cora_x.shape[0])
    assert fc.capacity_rows < ids.numel()
    assert_same_rows(fc.fetch(ids), cora_x, ids)
    assert_same_rows(fc.fetch(ids), cora_x, ids)


def test_forced_hash_index_with_dynamic_churn(cora_x, cora_codec) -> None:
    """Many evictions through a hash index: tombstones pile up and trigger rebuilds; results stay exact."""
    fc = _cache(cora_x, cora_codec, (True, True), policy="lru", budget_bytes=0.005, index="hash")
    assert fc.index.status()["kind"] == "hash"
    for seed in range(12):
        ids = uniform(cora_x.shape[0], 400, seed)
        assert_same_rows(fc.fetch(ids), cora_x, ids)
    _check_invariants(fc, 12 * 400)


def test_compressed_cache_holds_ratio_times_more_rows(cora_x, cora_codec) -> None:
    """Paper Table 7: capacity grows with the compression ratio (Cora-SU 25.9x)."""
    raw = _cache(cora_x, cora_codec, (False, True), budget_bytes=0.01)
    comp = _cache(cora_x, cora_codec, (True, True), budget_bytes=0.01)
    st = comp.stats()
    assert raw.capacity_rows == st["capacity_rows_raw"] == int(0.01 * cora_x.numel() * 4) // 16 * 16 // (1433 * 4)
    assert st["capacity_rows"] / st["capacity_rows_raw"] > 0.8 * st["ratio"] > 15


def test_static_hit_rate_grows_with_capacity(cora_x, cora_codec, cora_degrees) -> None:
    """With the same hotness, the compressed static cache holds a superset of the raw one's hot rows."""
    hits = {}
    for combo in [(False, False), (True, False)]:
        fc = _cache(cora_x, cora_codec, combo, hotness=cora_degrees, budget_bytes=0.01)
        for seed in range(3):
            fc.fetch(zipf(cora_x.shape[0], 2000, seed))
        hits[combo] = fc.stats()["hits"]
    assert hits[(True, False)] > hits[(False, False)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.int64, torch.uint8, torch.bfloat16, torch.bool])
def test_dtypes_and_row_shapes_are_preserved(cora_x, dtype) -> None:
    rows = cora_x[:512].to(dtype).contiguous()
    if dtype == torch.int64:
        rows = rows * torch.arange(1433)  # word ids where present: wider values, still real structure
    ids = zipf(512, 300, 0)
    for combo in [(False, False), (True, True), (True, False)]:
        fc = FeatureCache(rows, 0.1, device="cpu", compress_cache=combo[0], compress_host=combo[1])
        assert_same_rows(fc.fetch(ids), rows, ids)


def test_multidim_and_1d_rows(minilm_x) -> None:
    rows3 = minilm_x[:256].reshape(256, 12, 32)
    ids = zipf(256, 200, 1)
    fc = FeatureCache(rows3, 0.2, device="cpu", policy="lru")
    assert_same_rows(fc.fetch(ids), rows3, ids)
    rows1 = minilm_x[:256, 0].contiguous()  # one float per row: 4-byte rows
    fc = FeatureCache(rows1, 0.2, device="cpu")
    assert_same_rows(fc.fetch(ids), rows1, ids)


def test_codec_auto_and_compressed_rows_input(cora_x, cora_codec) -> None:
    rows = cora_x[:600].contiguous()
    ids = zipf(600, 400, 5)
    fc = FeatureCache(rows, 0.05, device="cpu", codec="auto")
    assert fc.codec is not None and fc.stats()["ratio"] > 10
    assert_same_rows(fc.fetch(ids), rows, ids)
    packed = cora_codec.compress(rows, layout="packed")
    for ch in (True, False):
        fc = FeatureCache(packed, 0.05, device="cpu", compress_host=ch, policy="lfu")
        assert_same_rows(fc.fetch(ids), rows, ids)
        assert_same_rows(fc.fetch(ids), rows, ids)


def test_empty_batch_and_out_argument(cora_x, cora_codec) -> None:
    fc = _cache(cora_x, cora_codec, (True, True))
    empty = fc.fetch(torch.empty(0, dtype=torch.int64))
    assert empty.shape == (0, 1433) and empty.dtype == torch.float32
    ids = zipf(cora_x.shape[0], 100, 0)
    out = torch.empty(100, 1433)
    assert fc.fetch(ids, out=out) is out
    assert_same_rows(out, cora_x, ids)
    assert_same_rows(fc.fetch(ids.to(torch.int32)), cora_x, ids)
    with pytest.raises(ValueError, match="shape"):
        fc.fetch(ids, out=torch.empty(99, 1433))
    with pytest.raises(ValueError, match="float32"):
        fc.fetch(ids, out=torch.empty(100, 1433, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        fc.fetch(ids, out=torch.empty(1433, 100).t())


@pytest.mark.parametrize("bad, err", [
    (torch.tensor([0, -1]), InvalidIdsError),
    (torch.tensor([2708]), InvalidIdsError),
    (torch.tensor([0.0, 1.0]), InvalidIdsError),
    (torch.tensor([True, False]), InvalidIdsError),
    (torch.zeros(2, 2, dtype=torch.int64), InvalidIdsError),
    ([0, 1], TypeError),
])
def test_bad_ids_raise(cora_x, cora_codec, bad, err) -> None:
    fc = _cache(cora_x, cora_codec, (True, True))
    with pytest.raises(err):
        fc.fetch(bad)
    assert fc.stats()["requests"] == 0


@pytest.mark.parametrize("budget, err, match", [
    (-1, InvalidArgumentError, "budget_bytes=-1: an int budget is a byte count and must be >= 1"),
    (0, InvalidArgumentError, "budget_bytes=0: an int budget"),
    (1.5, InvalidArgumentError, "budget_bytes=1.5: a float budget is a fraction"),
    (0.0, InvalidArgumentError, "budget_bytes=0.0: a float budget is a fraction"),
    (float("nan"), InvalidArgumentError, "budget_bytes=nan"),
    (-0.5, InvalidArgumentError, "must be in \\(0, 1\\]"),
    (True, InvalidTypeError, "budget_bytes: .* got bool True"),
    ("1GB", InvalidTypeError, "budget_bytes: .* got str '1GB'"),
])
def test_bad_budgets_raise(cora_x, cora_codec, budget, err, match) -> None:
    with pytest.raises(err, match=match) as info:
        FeatureCache(cora_x, budget, device="cpu", codec=cora_codec)
    assert isinstance(info.value, IbpcacheError)


@pytest.mark.parametrize("compress_cache", [False, True])
@pytest.mark.parametrize("policy", ["static", "lru"])
def test_budget_below_one_row_raises_with_the_smallest_valid_budget(cora_x, cora_codec, policy,
                                                                     compress_cache) -> None:
    """An int is bytes: ``budget_bytes=1`` used to build a silent cache of 0 rows. The error names the smallest
    budget that holds a stored row, and that budget (as bytes and as the named fraction) then holds one."""
    kw = dict(device="cpu", codec=cora_codec, policy=policy, compress_cache=compress_cache)
    for tiny in (1, 15, 0.0000001):
        with pytest.raises(CapacityError, match=f"budget_bytes={tiny!r}.*too small to cache one row"):
            FeatureCache(cora_x, tiny, **kw)
    smallest = -(-int(cora_codec.stored_lengths(cora_x).min()) // 16) * 16 if compress_cache else 5744
    with pytest.raises(CapacityError, match=f"smallest valid budget is {smallest} bytes") as info:
        FeatureCache(cora_x, smallest - 1, **kw)
    frac = float(str(info.value).split("fraction >= ")[1].split(" ")[0])
    for ok in (smallest, frac):
        fc = FeatureCache(cora_x, ok, **kw)
        assert fc.capacity_rows >= 1
        ids = zipf(cora_x.shape[0], 200, 0)
        assert_same_rows(fc.fetch(ids), cora_x, ids)
    assert FeatureCache(cora_x, 1.0, **kw).capacity_rows == cora_x.shape[0]  # 1.0 is the whole table


def test_explicit_slot_bytes_that_hold_no_row_raise(cora_x, cora_codec) -> None:
    kw = dict(device="cpu", codec=cora_codec, policy="lru")
    with pytest.raises(CapacityError, match="slot_bytes=1: smaller than every stored row"):
        FeatureCache(cora_x, 0.01, slot_bytes=1, **kw)
    with pytest.raises(CapacityError, match="holds no slot of 5732 bytes"):
        FeatureCache(cora_x, 4096, slot_bytes=5732, **kw)


def test_bad_constructor_arguments(cora_x, cora_codec, minilm_codec) -> None:
    with pytest.raises(ValueError, match="policy must be one of"):
        FeatureCache(cora_x, 0.01, device="cpu", policy="fifo", codec=cora_codec)
    with pytest.raises(ValueError, match="codec is for"):
        FeatureCache(cora_x, 0.01, device="cpu", codec=minilm_codec)
    with pytest.raises(ValueError, match="at least one row"):
        FeatureCache(cora_x[:0], 0.01, device="cpu")
    with pytest.raises(TypeError, match="rows"):
        FeatureCache(cora_x.numpy(), 0.01, device="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slot_bytes"):
        FeatureCache(cora_x, 0.01, device="cpu", policy="lru", codec=cora_codec, slot_bytes=0)
    with pytest.raises(CapacityError, match="2\\*\\*20 - 1"):
        FeatureCache(torch.zeros(2, 2**18 + 1), 0.5, device="cpu", compress_cache=False, compress_host=False)


def test_stats_reset_and_timing(cora_x, cora_codec) -> None:
    fc = _cache(cora_x, cora_codec, (True, True))
    assert fc.stats()["effective_gbps"] is None
    ids = zipf(cora_x.shape[0], 1000, 0)
    fc.fetch(ids)
    st = fc.stats()
    assert st["effective_gbps"] is not None and st["effective_gbps"] > 0
    assert st["transfer_ratio"] is None or st["transfer_ratio"] > 5
    fc.reset_stats()
    st = fc.stats()
    assert st["requests"] == 0 and st["effective_gbps"] is None


@pytest.mark.parametrize("policy", POLICIES)
def test_concurrent_fetches_from_threads_are_exact(cora_x, cora_codec, cora_degrees, policy) -> None:
    """Issue 10: 4 threads x 40 fetches of 2,000 skewed ids on Cora (budget 5%) returned wrong rows for lru/lfu.
    Every batch of every thread must equal rows[ids], and the counters must add up to what was asked."""
    from cache_helpers import fetch_from_threads

    fc = FeatureCache(cora_x, 0.05, hotness=cora_degrees, policy=policy, device="cpu", codec=cora_codec)
    bad = fetch_from_threads(fc, cora_x, n_threads=4, n_fetches=40, batch=2000)
    assert bad == [], f"{len(bad)} of 160 concurrent batches differ: {bad[:5]}"
    st = fc.stats()
    assert st["requests"] == 4 * 40 * 2000 and st["hits"] + st["misses"] == st["requests"]
    assert st["hits"] > 0


def test_fetch_blocks_per_sm_is_checked_and_reported(cora_x) -> None:
    """The lookup's grid bound: None is the full grid (16 blocks per multiprocessor), 1..16 are kept, anything else
    is refused naming the value; rows_grid never exceeds the bound and never launches an empty grid."""
    from ibpcache.kernels.lookup import ROWS_BLOCKS_PER_SM, rows_grid

    x = cora_x[:300].contiguous()
    assert FeatureCache(x, 0.1, device="cpu").stats()["fetch_blocks_per_sm"] == ROWS_BLOCKS_PER_SM == 16
    assert FeatureCache(x, 0.1, device="cpu", fetch_blocks_per_sm=2).stats()["fetch_blocks_per_sm"] == 2
    for bad in (0, 17, -1, True, 2.5, "4"):
        with pytest.raises(InvalidArgumentError, match="fetch_blocks_per_sm"):
            FeatureCache(x, 0.1, device="cpu", fetch_blocks_per_sm=bad)
    assert rows_grid(10**6, 132) == 132 * 16 and rows_grid(10**6, 132, 1) == 132
    assert rows_grid(9, 132, 1) == 2 and rows_grid(1, 132) == 1 and rows_grid(0, 132) == 1
