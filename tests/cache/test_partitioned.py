"""The node-wide partitioned cache: each rank caches a disjoint share of the hot rows, peers serve each other.

CPU (gloo, 2 ranks, in CI) and 2 GPUs (NCCL, marked multi_gpu). Rows fetched through it are bit-exact; the
ranks' cached sets are disjoint and the node holds their sum; peer traffic adds up; bad ids raise clearly.
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

ROOT = Path(__file__).resolve().parents[2]



def test_deal_rows_round_robin_by_hotness() -> None:
    from ibpcache.cache.partitioned import deal_rows

    owner = deal_rows(torch.tensor([0.1, 5.0, 3.0, 3.0, 9.0]), 2)
    assert owner.tolist() == [0, 1, 0, 1, 0]  # order 4, 1, 2, 3, 0 -> ranks 0, 1, 0, 1, 0


def test_static_policy_never_admits_minus_inf_rows() -> None:
    from ibpcache.cache.policy import StaticPolicy

    hot = torch.tensor([1.0, float("-inf"), 3.0, float("-inf")])
    chosen = StaticPolicy(hot).select(torch.full((4,), 10, dtype=torch.int32), budget=1000)
    assert sorted(chosen.tolist()) == [0, 2]


def _run(world: int, backend: str, tmp_path: Path, free_port: int, mode: str = "ibp") -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("partitioned_worker.py")), str(world),
                          str(free_port), str(tmp_path), backend, mode], env=env, capture_output=True, timeout=600)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(world)]


def _check(ranks: list[dict[str, Any]], cora: Any) -> None:
    raw = cora.features.contiguous().view(torch.uint8).reshape(cora.features.shape[0], -1).numpy()
    for r in ranks:
        assert np.array_equal(r["got"].reshape(len(r["ids"]), -1), raw[r["ids"]])
        assert tuple(r["empty"]) == (0, raw.shape[1] // 4)
        assert "out of range" in str(r["bad"])
        assert "rank(s) [1]" in str(r["one_bad"]) or "negative id -3" in str(r["one_bad"]), str(r["one_bad"])
        assert np.array_equal(r["after"].reshape(20, -1), raw[r["after_ids"]])  # usable after the error
        requests, local, peer, miss = (int(v) for v in r["counts"])
        assert requests == len(r["ids"]) and local + peer + miss == requests and min(local, peer, miss) > 0
        assert peer == int(r["peer_rows"]) and float(r["hit_rate"]) == (local + peer) / requests
        row_bytes = raw.shape[1]
        assert int(r["bytes_received"]) >= peer * row_bytes + 8 * int(r["served_rows"])
    sets = [set(r["cached"].tolist()) for r in ranks]
    assert all(len(a & b) == 0 for i, a in enumerate(sets) for b in sets[i + 1:]), "cached sets overlap"
    assert all(int(r["node_cached"]) == sum(len(s) for s in sets) for r in ranks)
    assert all(int(r["here"]) > 0 for r in ranks)
    assert sum(int(r["peer_rows"]) for r in ranks) == sum(int(r["served_rows"]) for r in ranks) > 0
    assert sum(int(r["bytes_sent"]) for r in ranks) == sum(int(r["bytes_received"]) for r in ranks)
    assert "negative id -3" in str(ranks[1]["one_bad"]) and "rank(s) [1]" in str(ranks[0]["one_bad"])


def test_two_gloo_ranks_partition_the_hot_rows(tmp_path: Path, cora: Any, free_port: int) -> None:
    _check(_run(2, "gloo", tmp_path, free_port), cora)


def test_partitioned_cache_over_an_exponent_store(tmp_path: Path, cora: Any, free_port: int) -> None:
    ranks = _run(2, "gloo", tmp_path, free_port, "exponent")
    _check(ranks, cora)
    assert [str(r["method"]) for r in ranks] == ["exponent", "exponent"]


def test_planned_codec_is_rank_zeros_on_every_rank(tmp_path: Path, cora: Any, free_port: int) -> None:
    """codec='auto' / compress_host='auto' over tensor rows: rank 0 plans once, the other ranks take its codec and
    layout (never a different choice from their own timing noise)."""
    ranks = _run(2, "gloo", tmp_path, free_port, "auto")
    _check(ranks, cora)
    assert str(ranks[0]["method"]) == str(ranks[1]["method"]) == "ibp"  # Cora: IBP is the smallest (CPU rule)
    assert bool(ranks[0]["compress_host"]) == bool(ranks[1]["compress_host"])
    assert str(ranks[0]["chosen_by"]) == "" and str(ranks[1]["chosen_by"]) == "rank 0 of the group"


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.parametrize("mode", ["ibp", "exponent", "auto"])
def test_two_gpus_partition_the_hot_rows(tmp_path: Path, cora: Any, free_port: int, mode: str) -> None:
    ranks = _run(2, "nccl", tmp_path, free_port, mode)
    _check(ranks, cora)
    assert str(ranks[0]["method"]) == str(ranks[1]["method"])


def test_bad_budgets_raise_before_any_exchange(tmp_path: Path, cora: Any) -> None:
    """Each rank's FeatureCache checks the budget (the same table and budget on every rank, so all raise alike)."""
    import torch.distributed as dist

    from ibpcache.cache.partitioned import PartitionedFeatureCache
    from ibpcache.errors import CapacityError, InvalidArgumentError

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        hot = torch.ones(cora.num_nodes)
        for bad, err in ((1, CapacityError), (0, InvalidArgumentError), (2.0, InvalidArgumentError)):
            with pytest.raises(err, match=f"budget_bytes={bad!r}"):
                PartitionedFeatureCache(cora.features, hot, bad, device="cpu", compress_cache=False)
        part = PartitionedFeatureCache(cora.features, hot, 5744, device="cpu", compress_cache=False)
        assert part.node_cached_rows == 1  # 5744 bytes: one 5732-byte row in 16-byte units
    finally:
        dist.destroy_process_group()
