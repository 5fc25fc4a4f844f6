"""Cache policies: the registry, the static greedy fill, slot sizing, the frequency sketch, and LRU/LFU admission and
eviction under the read-cache contract (FeatureCache's record + plan) and the row cache's (make_room + admit + touch);
the hash functions the device kernels share with the torch code, checked against plain unsigned arithmetic and against
the constants in ``admit.cu``. Convergence on real traces: tests/cache/test_convergence.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ibpcache.cache.policy import (
    FREE,
    EvictionStrategy,
    FrequencySketch,
    LFUPolicy,
    LRUPolicy,
    POLICIES,
    PolicyKind,
    PriorityPolicy,
    StaticPolicy,
    choose_slot_bytes,
    greedy_fill,
    make_policy,
    row_policy,
)
from ibpcache.errors import InvalidArgumentError

CPU = torch.device("cpu")
NONE = torch.empty(0, dtype=torch.int64)


def test_registry_and_from_str() -> None:
    assert PolicyKind.from_str("LRU") is PolicyKind.LRU
    assert PolicyKind.from_str(PolicyKind.LFU) is PolicyKind.LFU
    assert set(POLICIES) == set(PolicyKind)
    with pytest.raises(InvalidArgumentError, match="policy must be one of"):
        PolicyKind.from_str("fifo")
    assert isinstance(make_policy("lru", n_slots=4, n_rows=10), LRUPolicy)
    assert isinstance(make_policy("static"), StaticPolicy)


def _greedy_reference(order: list[int], lengths: list[int], budget: int) -> list[int]:
    taken, left = [], budget
    for pos, i in enumerate(order):
        if lengths[i] <= left:
            taken.append(pos)
            left -= lengths[i]
    return taken


@pytest.mark.parametrize("seed", range(20))
def test_greedy_fill_equals_the_sequential_walk(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = 200
    lengths = torch.randint(1, 300, (n,), generator=gen, dtype=torch.int32)
    order = torch.randperm(n, generator=gen)
    budget = int(torch.randint(0, 20000, (1,), generator=gen))
    got = greedy_fill(order, lengths, budget, max_passes=64).tolist()
    assert got == _greedy_reference(order.tolist(), lengths.tolist(), budget)
    assert int(lengths[order[got]].sum()) <= budget


def test_static_select_is_hottest_first_and_fits() -> None:
    lengths = torch.tensor([100, 10, 50, 10, 40], dtype=torch.int32)
    hot = torch.tensor([5.0, 1.0, 4.0, 3.0, 2.0])
    got = StaticPolicy(hot).select(lengths, 165)
    assert got.tolist() == [0, 2, 3]  # 100 + 50 + 10; row 4 (40) no longer fits; row 1 (10) would not fit either
    got = StaticPolicy(hot).select(lengths, 175)
    assert got.tolist() == [0, 2, 3, 1]
    assert StaticPolicy(None).select(lengths, 160).tolist() == [0, 1, 2]
    assert StaticPolicy(hot).select(lengths, 0).tolist() == []
    with pytest.raises(InvalidArgumentError, match="one score per row"):
        StaticPolicy(torch.ones(3)).select(lengths, 10)


def test_choose_slot_bytes() -> None:
    raw = torch.full((100,), 64, dtype=torch.int32)
    assert choose_slot_bytes(raw, 6400, 64) == 64
    # 90 short rows (10 B) and 10 long ones (60 B): 10-byte slots hold 90 rows, 60-byte slots 16
    mixed = torch.tensor([10] * 90 + [60] * 10, dtype=torch.int32)
    assert choose_slot_bytes(mixed, 1000, 64) == 10
    # with room for everything, the larger slot wins the tie (all rows eligible)
    assert choose_slot_bytes(mixed, 100 * 60, 64) == 60
    assert choose_slot_bytes(mixed, 0, 64) == 64
    assert choose_slot_bytes(mixed, 1000, 64, align=16) == 16  # 16-byte slots: 62 of them, all 90 short rows fit


@pytest.mark.parametrize("seed", range(6))
def test_choose_slot_bytes_maximises_the_rows_held(seed: int) -> None:
    """Against the definition: over every candidate size, min(budget // s, rows no longer than s), ties larger."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(40, 129, (500,), generator=gen, dtype=torch.int32)
    budget = int(torch.randint(1000, 60000, (1,), generator=gen))
    for align in (1, 16):
        best, best_held = None, -1
        for s in sorted({min(-(-int(x) // align) * align, 128) for x in lengths}):
            held = min(budget // s, int((lengths <= s).sum()))
            if held >= best_held:
                best, best_held = s, held
        assert choose_slot_bytes(lengths, budget, 128, align) == best


# ------------------------------------------------------------------------------------------------
# the frequency sketch and the shared hash functions
# ------------------------------------------------------------------------------------------------

_M = (1 << 64) - 1


def _sketch_slot_reference(x: int, d: int, width: int) -> int:
    """admit.cu's ibp_adm_sketch_slot in Python's unbounded integers, reduced mod 2**64 (unsigned)."""
    from ibpcache.kernels.admit import SKETCH_MUL

    h = (x * SKETCH_MUL[d]) & _M
    h ^= h >> 31
    h = (h * SKETCH_MUL[(d + 1) % 4]) & _M
    return ((h >> 24) & (width - 1)) + d * width


def _sample_reference(x: int, stamp: int, t: int, lo: int, hi: int) -> int:
    from ibpcache.kernels.admit import MIX_MUL, SAMPLE_MUL

    h = ((x * SAMPLE_MUL[0]) & _M) ^ ((stamp * SAMPLE_MUL[1]) & _M) ^ (((t + 1) * SAMPLE_MUL[2]) & _M)
    h ^= h >> 32
    h = (h * MIX_MUL) & _M
    h ^= h >> 32
    return lo + (h & ((1 << 63) - 1)) % (hi - lo)


def test_hashes_equal_unsigned_64_bit_arithmetic() -> None:
    from ibpcache.kernels.admit import sample_slots, sketch_index

    ids = torch.tensor([0, 1, 2, 7, 12345, 2**31 + 5, 2**40 - 3, 987654321987])
    got = sketch_index(ids, 1 << 14)
    want = [[_sketch_slot_reference(int(x), d, 1 << 14) for d in range(4)] for x in ids.tolist()]
    assert got.tolist() == want
    stamp = torch.tensor(77, dtype=torch.int64)
    got = sample_slots(ids, stamp, 4, 3, 1003)
    assert got.tolist() == [[_sample_reference(int(x), 77, t, 3, 1003) for t in range(4)] for x in ids.tolist()]
    assert not torch.equal(sample_slots(ids, stamp + 1, 4, 3, 1003), got)  # each step looks elsewhere


def test_device_constants_match_admit_cu() -> None:
    """admit.cu mirrors the multipliers, keys, flags and counters of kernels/admit.py."""
    from ibpcache.kernels import admit

    text = (Path(admit.__file__).parent / "admit.cu").read_text()
    defs = {m.group(1): m.group(2) for m in re.finditer(r"#define (IBP_ADM_\w+) ([^\n/]+)", text)}

    def val(name: str) -> int:
        return int(eval(defs[name].replace("ULL", "").replace("LL", "")))  # noqa: S307 - our own source

    assert [val(f"IBP_ADM_MUL{d}") for d in range(4)] == list(admit.SKETCH_MUL)
    assert [val(f"IBP_ADM_SMUL{d}") for d in range(3)] == list(admit.SAMPLE_MUL)
    assert val("IBP_ADM_MIX") == admit.MIX_MUL and val("IBP_ADM_DEPTH") == admit.SKETCH_DEPTH
    for name in ("FREE_KEY", "PROTECTED_KEY", "FLAG_OK", "FLAG_HIT", "FLAG_MISS", "FLAG_CAND", "STAT_REQUESTS",
                 "STAT_HITS", "STAT_ADMITTED", "STAT_STAGED", "STAT_HOST_BYTES", "WS_LIST", "WS_STAGED"):
        assert val(f"IBP_ADM_{name}") == getattr(admit, name), name


def test_sketch_counts_estimates_and_halves() -> None:
    sk = FrequencySketch(100, CPU, sample=64)
    assert sk.width == 1 << 12 and sk.nbytes == 4 * 4 * (1 << 12)
    ids = torch.tensor([5] * 9 + [6] * 3 + [7])
    assert not sk.add(ids)
    assert sk.estimate(torch.tensor([5, 6, 7, 8])).tolist() == [9, 3, 1, 0]  # few rows: no collision in 4 x 4096
    assert sk.add(torch.tensor([6]), weights=torch.tensor([2])) is False
    assert int(sk.estimate(torch.tensor([6]))) == 5
    assert sk.add(torch.arange(1000, 1060))  # 14 + 60 >= 64: halved
    assert sk.halvings == 1 and sk.estimate(torch.tensor([5, 6])).tolist() == [4, 2]
    assert FrequencySketch(5000, CPU).width == 1 << 15 and FrequencySketch(5000, CPU).sample == 32 * 5000


@pytest.mark.parametrize("seed", range(3))
def test_sketch_never_underestimates(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    sk = FrequencySketch(16, CPU, width=64, sample=1 << 30)  # a small sketch: collisions on purpose
    ids = torch.randint(0, 400, (3000,), generator=gen)
    sk.add(ids)
    true = torch.bincount(ids, minlength=400)
    est = sk.estimate(torch.arange(400))
    assert bool((est >= true).all()) and int((est > true).sum()) > 0


_EDGE_IDS = [0, 1, -1, -(1 << 63), (1 << 63) - 1, 1 << 40, 7, 7, 7]


@pytest.mark.gpu
@settings(max_examples=25, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0, 5000), st.sampled_from(_EDGE_IDS)), min_size=0, max_size=300),
       weighted=st.booleans(), width=st.sampled_from([64, 4096]))
def test_cuda_sketch_kernels_equal_the_torch_expressions(ids: list, weighted: bool, width: int) -> None:
    """The sketch's one-launch CUDA kernels (count, estimate, touch) leave the counters, estimates, frequencies and
    stamps the torch expressions (the CPU's code, run on the same device) leave, bit for bit: duplicates, zero
    weights, negative and extreme ids, a small sketch whose counters collide."""
    dev = torch.device("cuda")
    t = torch.tensor(ids, dtype=torch.int64, device=dev)
    w = (torch.arange(t.numel(), device=dev) % 3) if weighted else None  # zero weights included
    got, want = (FrequencySketch(16, dev, width=width, sample=1 << 30) for _ in range(2))
    base = torch.randint(0, 50, (got.table.numel(),), dtype=torch.int32, device=dev)  # counters already in use
    got.table.copy_(base)
    want.table.copy_(base)
    got.add(t, w)
    want._add_torch(t, w)
    assert torch.equal(got.table, want.table)
    probe = torch.cat([t, torch.arange(100, device=dev)])
    assert torch.equal(got.estimate(probe), want._estimate_torch(probe))
    # touch: a policy whose slots hold some of those rows, touched with duplicates
    lfu = LFUPolicy(8, 1 << 20, dev)
    lfu.sketch = got
    held = torch.tensor([3, 7, -1, 4999, 1 << 40, 0, 1, 2], device=dev)
    lfu._ids[:8] = held
    lfu.clock = 9
    slots = torch.tensor([0, 1, 1, 5, 7, 3, 3], device=dev)
    ref_last, ref_freq = lfu._last.clone(), lfu._freq.clone()
    ref_last.index_fill_(0, slots, 9)
    ref_freq.index_copy_(0, slots, lfu.sketch._estimate_torch(lfu._ids.index_select(0, slots)))
    lfu.touch(slots)
    assert torch.equal(lfu._last, ref_last) and torch.equal(lfu._freq, ref_freq)


# ------------------------------------------------------------------------------------------------
# read-cache contract (FeatureCache)
# ------------------------------------------------------------------------------------------------


def test_lru_admits_only_rows_requested_more_than_the_least_recent() -> None:
    p = LRUPolicy(3, 100, CPU)
    p.record(torch.tensor([1, 2, 3]), NONE)
    a = p.plan(torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]))
    assert sorted(a.ids.tolist()) == [1, 2, 3] and a.evicted.numel() == 0  # free slots take anything requested
    slot_of = {int(i): int(s) for i, s in zip(a.ids, a.slots)}
    # batch 2: 1 and 3 hit; 7 misses once: as frequent as 2 (the least recent): a one-off row does not get in
    p.record(torch.tensor([1, 3, 7]), torch.tensor([slot_of[1], slot_of[3]]))
    assert p.plan(torch.tensor([7]), torch.tensor([1])).empty
    # batch 3: 7 again (twice now): it replaces 2, the least recently used row, requested once
    p.record(torch.tensor([1, 7]), torch.tensor([slot_of[1]]))
    a = p.plan(torch.tensor([7]), torch.tensor([1]))
    assert a.ids.tolist() == [7] and a.evicted.tolist() == [2] and a.slots.tolist() == [slot_of[2]]
    slot_of[7] = slot_of.pop(2)
    # batch 4: every resident row is used by this batch: nothing may be evicted, however hot the candidate
    p.record(torch.tensor([1, 3, 7] + [9] * 20), torch.tensor([slot_of[1], slot_of[3], slot_of[7]]))
    assert p.plan(torch.tensor([9]), torch.tensor([20])).empty


def test_lru_more_candidates_than_slots_prefers_frequent() -> None:
    p = LRUPolicy(2, 100, CPU)
    ids = torch.tensor([4, 5, 5, 6, 6, 6])
    p.record(ids, NONE)
    a = p.plan(torch.tensor([4, 5, 6]), torch.tensor([1, 2, 3]))
    assert a.ids.tolist() == [6, 5]
    assert a.picks.tolist() == [2, 1]


def test_lfu_admits_only_strictly_more_frequent() -> None:
    p = LFUPolicy(1, 10, CPU)
    p.record(torch.tensor([1, 1, 1]), NONE)
    assert p.plan(torch.tensor([1]), torch.tensor([3])).ids.tolist() == [1]
    p.record(torch.tensor([2, 2]), NONE)
    assert p.plan(torch.tensor([2]), torch.tensor([2])).empty  # freq 2 < 3: row 1 stays
    p.record(torch.tensor([2, 2]), NONE)
    a = p.plan(torch.tensor([2]), torch.tensor([2]))  # freq 4 > 3
    assert a.ids.tolist() == [2] and a.evicted.tolist() == [1]
    assert p.resident()[1].tolist() == [2]


def test_zero_slots_admits_nothing() -> None:
    p = LRUPolicy(0, 10, CPU)
    p.record(torch.tensor([1]), NONE)
    assert p.plan(torch.tensor([1]), torch.tensor([1])).empty


def test_lfu_slot_frequencies_follow_the_sketch() -> None:
    """FeatureCache's LFU ranks slots by the request frequency of the rows they hold, as the sketch estimated it at
    their last use; a halving of the sketch halves them too, so old and new estimates stay comparable."""
    p = LFUPolicy(4, 50, CPU)
    p.sketch.sample = 1 << 30
    gen = torch.Generator().manual_seed(0)
    slot_of: dict[int, int] = {}
    for _ in range(30):
        ids = torch.randint(0, 12, (20,), generator=gen)
        hit_slots = torch.tensor([slot_of[i] for i in ids.tolist() if i in slot_of], dtype=torch.int64)
        p.record(ids, hit_slots)
        missed = torch.tensor(sorted({i for i in ids.tolist() if i not in slot_of}), dtype=torch.int64)
        counts = torch.tensor([int((ids == i).sum()) for i in missed.tolist()], dtype=torch.int64)
        a = p.plan(missed, counts)
        for e in a.evicted.tolist():
            slot_of.pop(e)
        slot_of.update(zip(a.ids.tolist(), a.slots.tolist()))
        slots, held = p.resident()
        used = p.last[slots] == p.clock
        assert torch.equal(p.freq[slots][used], p.sketch.estimate(held)[used])
        assert bool((p.freq[slots] <= p.sketch.estimate(held)).all())
    assert sorted(slot_of) == sorted(p.resident()[1].tolist())
    before = p.freq.clone()
    p.sketch.sample = 1
    p.count(torch.tensor([1]))
    assert torch.equal(p.freq, before >> 1)


# ------------------------------------------------------------------------------------------------
# row-cache contract
# ------------------------------------------------------------------------------------------------


def test_make_room_free_first_then_lowest_never_protected_or_pinned() -> None:
    p = LFUPolicy(6, 100, CPU, n_pinned=1)
    p.admit(torch.tensor([0, 1, 2, 3]), torch.tensor([50, 10, 11, 12]), torch.tensor([1, 5, 2, 9]))
    assert p.score.tolist()[:4] == [1, 5, 2, 9]
    # free slots 4, 5 first, then slot 2 (score 2): slot 0 is pinned (score 1), slot 3 is protected
    room = p.make_room(3, torch.tensor([3, -1])).tolist()
    assert sorted(room[:2]) == [4, 5] and room[2] == 2  # free ones (in any order), then the lowest score
    assert sorted(p.make_room(2, torch.tensor([-1])).tolist()) == [4, 5]
    assert p.victim_scores().tolist()[4:] == [FREE, FREE]


def test_row_policies_worth_and_touch() -> None:
    """The row cache's rules: LFU ranks by the sketch's frequency (refreshed at every use), LRU by the clock of the
    last use, DATASET by the id's priority whatever happens."""
    lfu = row_policy("lfu", 3, 10, CPU)
    assert isinstance(lfu, LFUPolicy) and lfu.sketch is not None
    lfu.count(torch.tensor([4, 4, 4, 7]))
    lfu.admit(torch.tensor([0, 1]), torch.tensor([4, 7]))
    assert lfu.score[:2].tolist() == [3, 1]
    lfu.count(torch.tensor([7, 7, 7]))
    lfu.touch(torch.tensor([1, 1]))
    assert lfu.score[:2].tolist() == [3, 4]
    lru = row_policy(EvictionStrategy.LRU, 3, 10, CPU)
    lru.tick(), lru.tick()
    lru.admit(torch.tensor([1]), torch.tensor([4]))
    assert int(lru.score[1]) == 2
    lru.tick()
    lru.touch(torch.tensor([1]))
    assert int(lru.score[1]) == 3
    prio = row_policy("dataset", 3, 10, CPU, priority=torch.arange(10) * 7)
    assert isinstance(prio, PriorityPolicy) and prio.sketch is None
    prio.admit(torch.tensor([2]), torch.tensor([3]))
    prio.touch(torch.tensor([2]))
    assert int(prio.score[2]) == 21
    low_ids_hot = row_policy("dataset", 3, 10, CPU)
    low_ids_hot.admit(torch.tensor([0, 1]), torch.tensor([1, 8]))
    assert low_ids_hot.score[:2].tolist() == [9, 2]
    with pytest.raises(InvalidArgumentError, match="evict_strategy"):
        row_policy("fifo", 3, 10, CPU)


def test_resize_grows_free_slots_and_cuts_back_and_reset_keeps_frequencies() -> None:
    p = LRUPolicy(2, 10, CPU)
    p.admit(torch.tensor([0, 1]), torch.tensor([3, 4]))
    p.resize(5)
    assert p.n_slots == 5 and p.slot_ids.tolist() == [3, 4, -1, -1, -1]
    assert sorted(p.make_room(3, torch.tensor([0, 1])).tolist()) == [2, 3, 4]
    p.resize(2)
    assert p.slot_ids.tolist() == [3, 4] and p.score.numel() == 2
    p.count(torch.tensor([3, 3]))
    p.reset(7, n_pinned=0)
    assert p.n_slots == 7 and p.slot_ids.tolist() == [-1] * 7 and int(p.sketch.estimate(torch.tensor([3]))) == 2
    state = p.device_state()
    assert state.ids.numel() == 8 and state.lru and state.sketch is p.sketch.table
