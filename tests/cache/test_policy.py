"""Cache policies: the registry, the static greedy fill, slot sizing, and LRU/LFU admission and eviction under both
admission contracts (FeatureCache's plan, the row cache's make_room + admit + touch)."""

from __future__ import annotations

import pytest
import torch

from ibpcache.cache.policy import (
    FREE,
    EvictionStrategy,
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

CPU = torch.device("cpu")


def test_registry_and_from_str() -> None:
    assert PolicyKind.from_str("LRU") is PolicyKind.LRU
    assert PolicyKind.from_str(PolicyKind.LFU) is PolicyKind.LFU
    assert set(POLICIES) == set(PolicyKind)
    with pytest.raises(ValueError, match="policy must be one of"):
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
    with pytest.raises(ValueError, match="one score per row"):
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


def test_lru_evicts_least_recent_and_spares_this_batch() -> None:
    p = LRUPolicy(3, 100, CPU)
    p.record(torch.tensor([1, 2, 3]), torch.empty(0, dtype=torch.int64))
    a = p.plan(torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]))
    assert sorted(a.ids.tolist()) == [1, 2, 3] and a.evicted.numel() == 0
    slot_of = {int(i): int(s) for i, s in zip(a.ids, a.slots)}
    # batch 2: 1 and 3 hit; 7 misses -> evicts 2 (not hit since batch 1)
    p.record(torch.tensor([1, 3, 7]), torch.tensor([slot_of[1], slot_of[3]]))
    a = p.plan(torch.tensor([7]), torch.tensor([1]))
    assert a.ids.tolist() == [7] and a.evicted.tolist() == [2] and a.slots.tolist() == [slot_of[2]]
    # batch 3: everything resident was hit in this batch -> nothing may be evicted
    p.record(torch.tensor([1, 3, 7, 9]), torch.tensor([slot_of[1], slot_of[3], slot_of[2]]))
    a = p.plan(torch.tensor([9]), torch.tensor([1]))
    assert a.empty


def test_lru_more_candidates_than_slots_prefers_frequent() -> None:
    p = LRUPolicy(2, 100, CPU)
    ids = torch.tensor([4, 5, 5, 6, 6, 6])
    p.record(ids, torch.empty(0, dtype=torch.int64))
    a = p.plan(torch.tensor([4, 5, 6]), torch.tensor([1, 2, 3]))
    assert a.ids.tolist() == [6, 5]
    assert a.picks.tolist() == [2, 1]


def test_lfu_admits_only_strictly_more_frequent() -> None:
    p = LFUPolicy(1, 10, CPU)
    p.record(torch.tensor([1, 1, 1]), torch.empty(0, dtype=torch.int64))
    assert p.plan(torch.tensor([1]), torch.tensor([3])).ids.tolist() == [1]
    p.record(torch.tensor([2, 2]), torch.empty(0, dtype=torch.int64))
    assert p.plan(torch.tensor([2]), torch.tensor([2])).empty  # freq 2 < 3: row 1 stays
    p.record(torch.tensor([2, 2]), torch.empty(0, dtype=torch.int64))
    a = p.plan(torch.tensor([2]), torch.tensor([2]))  # freq 4 > 3
    assert a.ids.tolist() == [2] and a.evicted.tolist() == [1]
    assert p.resident()[1].tolist() == [2]


def test_zero_slots_admits_nothing() -> None:
    p = LRUPolicy(0, 10, CPU)
    p.record(torch.tensor([1]), torch.empty(0, dtype=torch.int64))
    assert p.plan(torch.tensor([1]), torch.tensor([1])).empty


def test_lfu_slot_scores_are_the_resident_ids_lifetime_counts() -> None:
    """FeatureCache's LFU keeps per-slot scores; they must equal the per-id counts of the rows they hold (the
    victim is the least requested resident row), however the rows came in."""
    p = LFUPolicy(4, 50, CPU)
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
        assert torch.equal(p.score[slots], p.freq[held].to(torch.int64))
    assert sorted(slot_of) == sorted(p.resident()[1].tolist())


def test_make_room_free_first_then_lowest_never_protected_or_pinned() -> None:
    p = LFUPolicy(6, 100, CPU, n_pinned=1, since_admission=True)
    p.admit(torch.tensor([0, 1, 2, 3]), torch.tensor([50, 10, 11, 12]))
    p.touch(torch.tensor([0, 1, 2, 3]), torch.tensor([1, 5, 2, 9]))
    assert p.score.tolist()[:4] == [1, 5, 2, 9]
    # free slots 4, 5 first, then slot 2 (score 2): slot 0 is pinned (score 1), slot 3 is protected
    room = p.make_room(3, torch.tensor([3, -1])).tolist()
    assert sorted(room[:2]) == [4, 5] and room[2] == 2  # free ones (in any order), then the lowest score
    assert sorted(p.make_room(2, torch.tensor([-1])).tolist()) == [4, 5]
    assert p.victim_scores().tolist()[4:] == [FREE, FREE]


def test_row_policies_start_and_touch() -> None:
    """The row cache's rules: LFU counts uses since admission (a returning row starts from 0 again), LRU stamps the
    clock, DATASET keeps the id's priority whatever happens."""
    lfu = row_policy("lfu", 3, 10, CPU)
    assert isinstance(lfu, LFUPolicy) and lfu.since_admission and lfu.freq is None
    lfu.admit(torch.tensor([0]), torch.tensor([4]))
    lfu.touch(torch.tensor([0, 0]), torch.tensor([3, 2]))
    assert int(lfu.score[0]) == 5
    lfu.admit(torch.tensor([0]), torch.tensor([7]))
    assert int(lfu.score[0]) == 0
    lru = row_policy(EvictionStrategy.LRU, 3, 10, CPU)
    lru.tick(), lru.tick()
    lru.admit(torch.tensor([1]), torch.tensor([4]))
    assert int(lru.score[1]) == 2
    lru.tick()
    lru.touch(torch.tensor([1]), torch.tensor([1]))
    assert int(lru.score[1]) == 3
    prio = row_policy("dataset", 3, 10, CPU, priority=torch.arange(10) * 7)
    assert isinstance(prio, PriorityPolicy)
    prio.admit(torch.tensor([2]), torch.tensor([3]))
    prio.touch(torch.tensor([2]), torch.tensor([100]))
    assert int(prio.score[2]) == 21
    low_ids_hot = row_policy("dataset", 3, 10, CPU)
    low_ids_hot.admit(torch.tensor([0, 1]), torch.tensor([1, 8]))
    assert low_ids_hot.score[:2].tolist() == [9, 2]


def test_resize_grows_free_slots_and_cuts_back() -> None:
    p = LRUPolicy(2, 10, CPU)
    p.admit(torch.tensor([0, 1]), torch.tensor([3, 4]))
    p.resize(5)
    assert p.n_slots == 5 and p.slot_ids.tolist() == [3, 4, -1, -1, -1]
    assert sorted(p.make_room(3, torch.tensor([0, 1])).tolist()) == [2, 3, 4]
    p.resize(2)
    assert p.slot_ids.tolist() == [3, 4] and p.score.numel() == 2
