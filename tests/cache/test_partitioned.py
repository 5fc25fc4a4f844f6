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
    served as peer hits with no host sync, ranks' tails disjoint, node capacity above one GPU's, refresh exact."""
    ranks = _run(2, "nccl", tmp_path, free_port, mode)
    raw = _check_exact(ranks, cora)
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
        part = PartitionedFeatureCache(f, hot, 5744 * 3, device="cpu", compress_cache=False)
        st = part.stats()
        assert st["peer_access"] is False and st["fallback_reason"] == "one rank: no peers"
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
