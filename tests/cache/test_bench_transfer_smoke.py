"""Smoke-run scripts/bench_transfer.py on the CPU at a tiny size: every method runs, is verified bit-exact, and the
JSON carries the ``points`` schema (the GPU run uses the same code with CUDA transfers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_bench_transfer_runs_on_cpu(tmp_path: Path, shared_data_dir: Path, script_module) -> None:
    pytest.importorskip("matplotlib")
    with script_module("bench_transfer") as mod:
        rc = mod.main(["--device", "cpu", "--quick", "--gb", "0.002", "--batch", "300", "--datasets", "minilm_32B",
                       "cora_5732B", "--out", str(tmp_path)])
    assert rc == 0
    points = json.loads((tmp_path / "bench_transfer.json").read_text())["points"]
    assert [p["dataset"] for p in points] == ["minilm_32B", "cora_5732B"]
    for p in points:
        assert set(p["methods"]) == set(mod.METHODS) and all(m["verified"] for m in p["methods"].values())
        assert p["ibpcache_vs_best_raw"] > 0 and p["methods"]["ibpcache"]["transfer"]["transfer"]
    assert (tmp_path / "bench_transfer.png").stat().st_size > 0
