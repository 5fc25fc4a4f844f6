"""The node cache: hottest rows replicated on every GPU, the warm tail partitioned, peers read over CUDA IPC.

CPU: the placement rule, the one-index-over-several-slabs composition in one process (the exact path a peer hit
takes, with another cache's slab standing in for a peer's), and 2 gloo ranks (independent caches: the fallback,
exact, with stats saying why). 2 GPUs (NCCL, marked multi_gpu): peer slabs mapped, bit-exact, peer hits served
with no host sync, refresh.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]


def test_static_policy_never_admits_minus_inf_rows() -> None:
    from ibpcache.cache.policy import StaticPolicy

    hot = torch.tensor([1.0, float("-inf"), 3.0, float("-inf")])
    chosen = StaticPolicy(hot).select(torch.full((4,), 10, dtype=torch.int32), budget=1000)
    assert sorted(chosen.tolist()) == [0, 2]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), world=st.integers(1, 4), budget_rows=st.integers(1, 60), seed=st.integers(0, 99),
       frac=st.floats(0.0, 1.0))
def test_placement_head_then_round_robin_tail(n: int, world: int, budget_rows: int, seed: int, frac: float) -> None:
    """Every rank's priority puts the head first, then its own tail rows in hotness order; the ranks' tails are
    disjoint and cover the tail; the head fits one budget; replicate=0 / 1 give no head / a full budget of head."""
    from ibpcache.cache.partitioned import plan_placement

    gen = torch.Generator().manual_seed(seed)
    hot = torch.rand(n, generator=gen) ** 3
    lens = torch.randint(16, 64, (n,), generator=gen)
    budget = 16 * budget_rows * 4
    for rule in ("auto", frac, 0.0, 1.0):
        p = plan_placement(hot, lens, budget, world, rule)
        head = p.replicated
        assert int(lens[head].sum()) <= budget
        assert torch.equal(p.order, torch.argsort(hot.double(), descending=True, stable=True))  # ties by id
        tails = []
        for r in range(world):
            prio = p.priority(r)
            picked = torch.argsort(prio, descending=True, stable=True)[: int((~torch.isneginf(prio)).sum())]
            assert torch.equal(picked[: head.numel()], head)
            tails.append(picked[head.numel():])
            assert torch.equal(tails[-1], p.order[p.n_replicated + r:: world])
        assert sorted(torch.cat(tails).tolist()) == sorted(p.order[p.n_replicated:].tolist())
    assert plan_placement(hot, lens, budget, world, 0.0).n_replicated == 0
    full = plan_placement(hot, lens, budget, world, 1.0)
    assert full.n_replicated == n or int(lens[full.order[: full.n_replicated + 1]].sum()) > budget


def test_auto_placement_partitions_a_flat_tail_and_replicates_a_sharp_head() -> None:
    """Equal hotness: replication buys nothing, so 'auto' partitions everything (node capacity W x one GPU). One row
    with all the traffic and a peer cost above local: it is replicated."""
    from ibpcache.cache.partitioned import plan_placement

    lens = torch.full((1000,), 32)
    flat = plan_placement(torch.ones(1000), lens, 32 * 100, 2)
    assert flat.n_replicated == 0
    sharp = torch.zeros(1000)
    sharp[17] = 1.0
    p = plan_placement(sharp, lens, 32 * 100, 2)
    assert p.n_replicated >= 1 and int(p.replicated[0]) == 17
    with pytest.raises(Exception, match="replicate"):
        plan_placement(torch.ones(10), torch.full((10,), 32), 320, 2, 1.5)


def _expected_cost(hot: torch.Tensor, order: torch.Tensor, head: int, budget_rows: int, world: int,
                   costs: "tuple[float, float, float]") -> float:
    """Mean cost per request over the ranks, counted row by row from the sets each rank reads locally, from a peer
    and from the host (rows of one length, so a budget is a row count): what plan_placement's prefix sums model."""
    n = order.numel()
    tail = order[head: min(n, head + world * (budget_rows - head))]
    total = 0.0
    for rank in range(world):
        where = torch.full((n,), 2, dtype=torch.int64)
        where[tail] = 1
        where[tail[rank::world]] = 0
        where[order[:head]] = 0
        total += float((hot * torch.tensor(costs, dtype=torch.float64)[where]).sum())
    return total / world


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 400), world=st.integers(2, 4), budget_rows=st.integers(1, 80), seed=st.integers(0, 999),
       a=st.floats(0.0, 2.0), peer=st.floats(1.0, 40.0), host=st.floats(1.0, 40.0))
def test_auto_head_minimises_the_expected_cost_of_the_ranks_sets(n: int, world: int, budget_rows: int, seed: int,
                                                                 a: float, peer: float, host: float) -> None:
    """'auto' picks a head no worse than any other head size, the cost of each counted from the rows every rank
    actually reads locally / from a peer / from the host; where a peer read is not PEER_MARGIN cheaper than a host
    read it keeps the independent layout, and that is also the least expected cost (a peer costing what the host
    does never pays for a smaller head)."""
    from ibpcache.cache.partitioned import PEER_MARGIN, plan_placement

    gen = torch.Generator().manual_seed(seed)
    hot = (torch.randperm(n, generator=gen) + 1.0).to(torch.float64) ** -a  # Zipf(a) over a random permutation
    costs = (1.0, peer, host)
    p = plan_placement(hot, torch.full((n,), 16), 16 * budget_rows, world, "auto", costs)
    best = min(_expected_cost(hot, p.order, h, budget_rows, world, costs) for h in range(min(budget_rows, n) + 1))
    got = _expected_cost(hot, p.order, p.n_replicated, budget_rows, world, costs)
    if peer > (1 - PEER_MARGIN) * host:
        assert not p.partitioned and p.n_replicated == min(budget_rows, n) and p.replicate == 1.0
        assert p.rule.startswith("independent")
        if peer >= host:  # the model agrees: replicating everything is (one of) the cheapest
            assert got <= best * (1 + 1e-9)
    else:
        assert p.partitioned and got <= best * (1 + 1e-9)


def _cora_lengths(cora: Any, hot: torch.Tensor) -> "tuple[torch.Tensor, int]":
    """Cora's stored row lengths in the slab format (the IBP codec fitted on the rows) and a 1% budget."""
    from ibpcache import FeatureCache

    cache = FeatureCache(cora.features, 0.01, hotness=hot, device="cpu")
    return cache.cache_lengths, cache.budget_bytes


def test_costs_decide_independent_or_partitioned_on_cora_degrees(cora: Any) -> None:
    """Cora's real in-degrees and compressed row lengths, 2 GPUs, 1% of the rows each: a peer read that costs what a
    host read does (or only a little less) keeps every GPU's own hottest rows (the independent layout); a cheap
    peer read deals out a tail, so the node caches more rows than one GPU; a peer read as cheap as a local one
    (as measured on NVLink for Cora rows) partitions everything."""
    from ibpcache.cache.partitioned import DEFAULT_COSTS, plan_placement

    hot = torch.bincount(cora.dst, minlength=cora.num_nodes).to(torch.float64)
    lens, budget = _cora_lengths(cora, hot)
    one_gpu = plan_placement(hot, lens, budget, 2, 1.0).n_replicated
    for costs in ((1.0, 16.0, 16.0), (1.0, 15.0, 16.0), (1.0, 20.0, 16.0)):
        p = plan_placement(hot, lens, budget, 2, "auto", costs)
        assert not p.partitioned and p.n_replicated == one_gpu and p.replicate == 1.0, costs
    heads = [plan_placement(hot, lens, budget, 2, "auto", (1.0, peer, 16.0)) for peer in (1.0, 2.0, 4.0, 8.0, 14.0)]
    assert all(p.partitioned for p in heads)
    assert [p.n_replicated for p in heads] == sorted(p.n_replicated for p in heads)  # dearer peers: a bigger head
    assert heads[0].n_replicated == 0 and heads[0].replicate == 0.0  # a peer as cheap as local: a pure partition
    assert 0 < heads[-1].replicate < 1 and heads[-1].n_replicated < one_gpu
    cheap = plan_placement(hot, lens, budget, 2, "auto", DEFAULT_COSTS)
    node_rows = {int(i) for r in range(2) for i in torch.nonzero(~torch.isneginf(cheap.priority(r))).reshape(-1)}
    assert len(node_rows) > one_gpu


def test_costs_decide_on_the_benchmarks_zipf_trace() -> None:
    """The bench's workload (bench_partitioned.py: hotness = counts of a Zipf 1.05 trace, MiniLM-sized table of
    1536 B rows, 1% per GPU): the same rule, and a peer read that is measured no cheaper than the host never
    leaves any rank a tail (the head fills every budget)."""
    from ibpcache import datasets
    from ibpcache.cache.partitioned import plan_placement

    n = 30522
    hot = torch.bincount(datasets.zipf_ids(n, 400_000, 1.05, seed=99), minlength=n).to(torch.float64)
    lens = torch.full((n,), 1536)
    budget = int(0.01 * n * 1536)
    indep = plan_placement(hot, lens, budget, 2, "auto", (1.0, 5.0, 5.0))
    assert not indep.partitioned
    assert indep.head_bytes + 1536 > indep.budget_bytes  # the head fills each budget: no room for a tail row
    assert torch.equal(indep.replicated, torch.argsort(hot, descending=True, stable=True)[:indep.n_replicated])
    part = plan_placement(hot, lens, budget, 2, "auto", (1.0, 1.5, 5.0))
    assert part.partitioned and part.n_replicated < indep.n_replicated
    with pytest.raises(Exception, match="costs"):
        plan_placement(hot, lens, budget, 2, "auto", (1.0, 0.0, 5.0))
    with pytest.raises(Exception, match="costs"):
        plan_placement(hot, lens, budget, 2, "auto", (1.0, 2.0))


def test_weighted_probe_sample_follows_hotness() -> None:
    """The set-up probe draws rows by hotness (as requests are): never a row of zero hotness, the hottest most
    often; uniform when the pool has no positive hotness."""
    from ibpcache.cache.partitioned import _weighted_sample

    hot = torch.tensor([0.0, 5.0, 1.0, 0.0, -3.0, 10.0], dtype=torch.float64)
    pool = torch.tensor([0, 1, 2, 3, 4, 5])
    got = _weighted_sample(pool, hot, 20000, torch.Generator().manual_seed(0))
    counts = torch.bincount(got, minlength=6)
    assert counts[0] == counts[3] == counts[4] == 0 and counts[5] > counts[1] > counts[2] > 0
    assert abs(float(counts[5]) / 20000 - 10 / 16) < 0.02
    cold = _weighted_sample(torch.tensor([0, 3, 4]), hot, 3000, torch.Generator().manual_seed(1))
    assert set(cold.tolist()) == {0, 3, 4}


def test_peer_slab_composition_is_exact_on_the_cpu(cora: Any) -> None:
    """One cache indexes another cache's rows at (its slab id, its offsets): a fetch reads each hit from the slab its
    entry names, bit-exact; the rows of both caches count as hits; restock drops the peer rows."""
    from ibpcache import FeatureCache
    from ibpcache.errors import InvalidArgumentError

    f = cora.features
    n = f.shape[0]
    gen = torch.Generator().manual_seed(0)
    hot = (torch.randperm(n, generator=gen) + 1.0) ** -1.1
    a = FeatureCache(f, 0.004, hotness=hot, device="cpu", slab_id=0)
    b = FeatureCache(f, 0.004, hotness=-hot, device="cpu", slab_id=1)
    ids_b, e_b = b.own_entries()
    with pytest.raises(InvalidArgumentError, match="slabs"):
        a.add_peer_rows(ids_b, e_b, {2: b.slab.data})
    with pytest.raises(InvalidArgumentError, match="past the end of slab 1"):
        a.add_peer_rows(ids_b, e_b, {1: b.slab.data[:16]})
    a.add_peer_rows(ids_b, e_b, {1: b.slab.data})
    assert a.peer_rows == int(ids_b.numel()) > 0 and a.capacity_rows > 0
    cached = torch.cat([a.cached_ids, ids_b])
    ids = torch.cat([torch.randint(0, n, (3000,), generator=gen), ids_b, ids_b[:7]])
    a.reset_stats()
    assert torch.equal(a.fetch(ids).view(torch.uint8), f[ids].view(torch.uint8))
    assert a.stats()["hits"] == int(torch.isin(ids, cached).sum())
    a.restock(-hot)
    assert a.peer_rows == 0 and torch.equal(a.fetch(ids).view(torch.uint8), f[ids].view(torch.uint8))


@pytest.mark.gpu
def test_peer_slab_composition_in_one_lookup_launch_on_a_gpu(cora: Any) -> None:
    """The CUDA path of the composition on one GPU: another cache's slab (slab id 1, same device) read by the ONE
    lookup launch beside this cache's own hits and host misses, bit-exact, with no host sync (lazy validation)."""
    from ibpcache import FeatureCache

    f = cora.features
    n = f.shape[0]
    gen = torch.Generator().manual_seed(1)
    hot = (torch.randperm(n, generator=gen) + 1.0) ** -1.1
    a = FeatureCache(f, 0.004, hotness=hot, device="cuda", slab_id=0, validate="lazy")
    b = FeatureCache(f, 0.004, hotness=-hot, device="cuda", slab_id=1, validate="lazy")
    ids_b, e_b = b.own_entries()
    a.add_peer_rows(ids_b, e_b, {1: b.slab.data})
    ids = torch.cat([torch.randint(0, n, (3000,), generator=gen), ids_b, a.cached_ids.cpu()]).cuda()
    a.fetch(ids)
    torch.cuda.synchronize()
    a.reset_stats()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = a.fetch(ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu().view(torch.uint8), f[ids.cpu()].view(torch.uint8))
    cached = torch.cat([a.cached_ids.cpu(), ids_b])
    assert a.stats()["hits"] == int(torch.isin(ids.cpu(), cached).sum())


def _run(world: int, backend: str, tmp_path: Path, free_port: int, mode: str = "ibp") -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("partitioned_worker.py")), str(world),
                          str(free_port), str(tmp_path), backend, mode], env=env, capture_output=True, timeout=600)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(world)]


def _check_exact(ranks: list[dict[str, Any]], cora: Any) -> np.ndarray:
    raw = cora.features.contiguous().view(torch.uint8).reshape(cora.features.shape[0], -1).numpy()
    for r in ranks:
        assert np.array_equal(r["got"].reshape(len(r["ids"]), -1), raw[r["ids"]])
        assert np.array_equal(r["after"].reshape(len(r["ids"]), -1), raw[r["ids"]])  # after the refresh
        assert tuple(r["empty"]) == (0, raw.shape[1] // 4)
        requests, local, peer, miss = (int(v) for v in r["counts"])
        assert requests == len(r["ids"]) and local + peer + miss == requests
        assert float(r["hit_rate"]) == (local + peer) / requests
        assert not np.array_equal(np.sort(r["cached"]), np.sort(r["cached_after"]))  # refresh moved rows
    return raw


def test_gloo_ranks_fall_back_to_independent_caches(tmp_path: Path, cora: Any, free_port: int) -> None:
    ranks = _run(2, "gloo", tmp_path, free_port)
    _check_exact(ranks, cora)
    for r in ranks:
        assert not bool(r["peer_access"]) and str(r["fallback"]) == "independent"
        assert "CPU" in str(r["reason"])
        assert int(r["counts"][2]) == 0 and int(r["owned"]) == 0 and int(r["replicated"]) == int(r["here"]) > 0
    assert np.array_equal(ranks[0]["cached"], ranks[1]["cached"])  # independent: the same hottest rows


def test_gloo_fallback_over_an_exponent_store_and_a_planned_codec(tmp_path: Path, cora: Any, free_port: int) -> None:
    ranks = _run(2, "gloo", tmp_path, free_port, "exponent")
    _check_exact(ranks, cora)
    assert [str(r["method"]) for r in ranks] == ["exponent", "exponent"]
    ranks = _run(2, "gloo", tmp_path, free_port + 1, "auto")
    _check_exact(ranks, cora)
    assert str(ranks[0]["method"]) == str(ranks[1]["method"])
    assert str(ranks[0]["chosen_by"]) == "" and str(ranks[1]["chosen_by"]) == "rank 0 of the group"


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.parametrize("mode", ["ibp", "exponent", "auto"])
def test_two_gpus_read_peer_slabs(tmp_path: Path, cora: Any, free_port: int, mode: str) -> None:
    """Peer slabs mapped through CUDA IPC: exact fetches of local, peer and host rows, a batch of peer-owned rows
    served as peer hits with no host sync, ranks' tails disjoint, node capacity above one GPU's, refresh exact.
    ``auto`` builds with measured costs: every rank plans with the same timed costs, and where they (or the set-up
    check) say peer reads do not pay, both ranks keep independent caches and say why."""
    ranks = _run(2, "nccl", tmp_path, free_port, mode)
    raw = _check_exact(ranks, cora)
    if mode == "auto":
        assert all(str(r["costs_rule"]) == "measured" for r in ranks), [str(r["costs_rule"]) for r in ranks]
        assert np.array_equal(ranks[0]["placement_costs"], ranks[1]["placement_costs"])
        assert np.all(ranks[0]["source_costs"] > 0) and np.array_equal(ranks[0]["source_costs"],
                                                                       ranks[1]["source_costs"])
        assert {str(r["setup_kept"]) for r in ranks} <= {"placed", "independent", "None"}
        if not bool(ranks[0]["peer_access"]):  # the measured costs chose the independent layout, on both ranks
            for r in ranks:
                assert not bool(r["peer_access"]) and float(r["replicate"]) == 1.0
                assert "measured costs" in str(r["reason"]) or "set-up check" in str(r["reason"])
                assert int(r["owned"]) == 0 and int(r["counts"][2]) == 0
            return
    for r in ranks:
        assert bool(r["peer_access"]), str(r["reason"])
        assert min(int(v) for v in r["counts"][1:]) > 0  # local hits, peer hits and host misses all happen
        assert int(r["node_cached"]) > int(r["here"])
        assert int(r["peer_hits"]) == len(r["peer_ids"]) > 0
        assert np.array_equal(r["peer_got"].reshape(len(r["peer_ids"]), -1), raw[r["peer_ids"]])
    owned = [set(r["cached"].tolist()) for r in ranks]
    head = owned[0] & owned[1]
    assert len(head) == int(ranks[0]["replicated"]) == int(ranks[1]["replicated"])
    assert str(ranks[0]["method"]) == str(ranks[1]["method"])


def test_one_rank_group_bad_budgets_and_refresh(tmp_path: Path, cora: Any) -> None:
    """A group of one: bad budgets raise as FeatureCache's do; no peers (said in stats); refresh checks its
    hotness and moves the cached rows; fetches stay exact."""
    import torch.distributed as dist

    from ibpcache.cache.partitioned import PartitionedFeatureCache
    from ibpcache.errors import CapacityError, InvalidArgumentError

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        f = cora.features
        hot = torch.arange(cora.num_nodes, dtype=torch.float64)
        for bad, err in ((1, CapacityError), (0, InvalidArgumentError), (2.0, InvalidArgumentError)):
            with pytest.raises(err, match=f"budget_bytes={bad!r}"):
                PartitionedFeatureCache(f, hot, bad, device="cpu", compress_cache=False)
        for bad in ("fast", (1.0, float("nan"), 2.0), (1.0, 2.0)):
            with pytest.raises(InvalidArgumentError, match="costs"):
                PartitionedFeatureCache(f, hot, 5744 * 3, device="cpu", compress_cache=False, costs=bad)
        part = PartitionedFeatureCache(f, hot, 5744 * 3, device="cpu", compress_cache=False)
        st = part.stats()
        assert st["peer_access"] is False and st["fallback_reason"] == "one rank: no peers"
        assert st["replicate"] == 1.0 and st["costs_rule"].startswith("default")  # nothing timed on the CPU
        assert st["source_costs_us_per_row"] is None and st["setup_check"] is None
        assert sorted(part.cache.cached_ids.tolist()) == [cora.num_nodes - 3, cora.num_nodes - 2, cora.num_nodes - 1]
        with pytest.raises(InvalidArgumentError, match="one score per row"):
            part.refresh(hot[:-1])
        part.refresh(-hot)
        assert sorted(part.cache.cached_ids.tolist()) == [0, 1, 2]
        ids = torch.tensor([0, 5, 2707, 1, 1])
        assert torch.equal(part.fetch(ids), f[ids])
        st = part.stats()
        assert (st["local_hits"], st["peer_hits"], st["host_misses"]) == (3, 0, 2)
    finally:
        dist.destroy_process_group()


def test_measured_costs_and_the_setup_check_with_injected_times(tmp_path: Path, cora: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The set-up timing's bookkeeping on one gloo rank, with the CUDA timer replaced by injected times (the path
    itself needs peers, so GPUs): per-row costs are the timed fetch over its rows, per kind of row; with no host
    misses to time, a host read is DEFAULT_COSTS' ratio to a local one; a placed layout slower than the independent
    one on the check batch sends the rank back to its own hottest rows, and says so; a faster one is kept."""
    import torch.distributed as dist

    from ibpcache.cache.partitioned import HOST, LOCAL, PEER, PROBE_REPEATS, PROBE_WARMUP, PartitionedFeatureCache

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        f = cora.features
        hot = torch.bincount(cora.dst, minlength=cora.num_nodes).to(torch.float64)
        part = PartitionedFeatureCache(f, hot, 0.01, device="cpu")
        cached = part.cache.cached_ids.cpu()
        others = torch.nonzero(~torch.isin(torch.arange(cora.num_nodes), cached)).reshape(-1)
        part._peer_ids = others[:100]  # as if a peer held these rows
        part._where = part._where_table()
        per_row = {LOCAL: 0.5, PEER: 0.75, HOST: 6.0}
        monkeypatch.setattr(part, "_time_fetch",
                            lambda batches: per_row[int(part._where[batches[0][0]])] * batches[0].numel())
        costs = part._measure_costs(hot)
        assert costs == pytest.approx((0.5, 0.75, 6.0))
        src = part.source_costs_us_per_row
        assert (src["local"], src["peer"], src["host"]) == pytest.approx(costs) and src["note"] == "timed"
        assert src["rows_per_probe"] == part._probe_rows() >= 16384
        part._peer_ids = others  # every row on the node: nothing to time on the host
        part._where = part._where_table()
        assert part._measure_costs(hot) == pytest.approx((0.5, 0.75, 8.0))
        assert "no misses" in part.source_costs_us_per_row["note"]
        part._peer_ids = torch.empty(0, dtype=torch.int64)  # no peer rows: nothing to plan with, defaults kept
        part._where = part._where_table()
        assert part._measure_costs(hot) is None and part.costs_rule.startswith("default")

        part.fallback_reason = None
        part.cache.restock(-hot)  # as if placed: other rows than the hottest
        batches = part._probe_batches(hot, torch.arange(cora.num_nodes))
        assert len(batches) == PROBE_WARMUP + PROBE_REPEATS
        assert all(b.numel() == part._probe_rows() and float(hot[b].min()) > 0 for b in batches)
        # a new draw per timed fetch (a batch fetched again would be timed from L2), each drawn by hotness
        assert all(not torch.equal(a, b) for a, b in zip(batches, batches[1:]))
        monkeypatch.setattr(part, "_time_fetch", lambda batches: 120.0)
        part._check_against_independent(hot, batches, 100.0)  # placed slower: back to the independent layout
        st = part.stats()
        assert st["setup_check"]["kept"] == "independent" and st["setup_check"]["placed_us"] == [120.0]
        assert st["peer_access"] is False and st["fallback_reason"].startswith("set-up check")
        assert st["replicate"] == 1.0
        again = PartitionedFeatureCache(f, hot, 0.01, device="cpu")
        assert torch.equal(part.cache.cached_ids.cpu().sort().values, again.cache.cached_ids.cpu().sort().values)
        part.fallback_reason = None
        part._check_against_independent(hot, batches, 150.0)  # placed faster: kept
        assert part.setup_check["kept"] == "placed" and part.peer_access
        assert part.setup_check["speedup"] == pytest.approx(150 / 120)
        ids_all = torch.arange(cora.num_nodes)
        assert torch.equal(part.fetch(ids_all), f)
    finally:
        dist.destroy_process_group()
