"""scripts/bench_partitioned.py on 2 gloo CPU ranks (a smoke run): the issue's JSON points, every method (the
independent caches and one node cache per --replicate value) measured in the same processes, verified fetches (the
script raises on a differing row), the fallback named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_gloo_ranks_write_points(tmp_path: Path, free_port: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port}",
           str(ROOT / "scripts" / "bench_partitioned.py"), "--device", "cpu", "--datasets", "cora_su",
           "--total-gb", "0.01", "--budgets", "0.01,0.03", "--batch", "1000", "--batches", "4", "--warmup", "1",
           "--replicate", "auto,0.5", "--traces", "zipf,hotset", "--out", str(tmp_path)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    doc = json.loads((tmp_path / "bench_partitioned.json").read_text())
    assert [(p["dataset"], p["trace"], p["gpus"], p["budget_per_gpu"]) for p in doc["points"]] == [
        ("cora_su", t, 2, b) for t in ("zipf", "hotset") for b in (0.01, 0.03)]
    for p in doc["points"][2:]:  # the hot set: 1.5x the rows one GPU's budget holds, so above one GPU's cache
        assert p["hot_share"] == 0.9 and p["hot_factor"] == 1.5 and p["hot_set_vs_one_gpu"] > 1.0
        assert p["hot_set_exceeds_one_gpu"] and p["targets"]["speedup"]["target"] == 1.3
    for p in doc["points"]:
        assert list(p["methods"]) == ["independent", "partitioned", "partitioned_r0.5"]  # one per --replicate value
        for m in p["methods"].values():
            assert m["GBps"] > 0 and 0 < m["hit_rate"] <= 1 and len(m["GBps_runs_per_rank"][0]) == 2
        assert p["primary"] == "partitioned" and p["speedup"] == p["speedups"]["partitioned"]
        assert p["peer_access"] is False and "CPU" in p["fallback_reason"]
        for name in ("partitioned", "partitioned_r0.5"):
            m = p["methods"][name]
            assert m["hit_rate"] == p["methods"]["independent"]["hit_rate"] and m["replicate"] == 1.0
            assert m["costs_rule"].startswith("default") and m["source_costs_us_per_row"] is None
        assert p["peer_hit_GBps"] is None and p["host_miss_GBps"] > 0
    assert doc["meta"]["source_costs_us_per_row"] == []  # nothing is timed on the CPU
    assert (tmp_path / "bench_partitioned.png").stat().st_size > 0
