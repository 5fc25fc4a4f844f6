"""Smoke-run scripts/bench_cache.py on the CPU at a tiny size: the script runs end to end, verifies every
configuration and writes its JSON and PNG (the GPU run uses the same code paths with CUDA timers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_bench_cache_runs_on_cpu(tmp_path: Path, script_module) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    with script_module("bench_cache") as mod:
        rc = mod.main(["--device", "cpu", "--quick", "--gb", "0.003", "--batch", "400", "--datasets", "cora",
                       "--policies", "static", "lfu", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "bench_cache.json").read_text())
    recs = data["records"]
    assert {r["mode"] for r in recs} == {"baseline", "IBP(M)", "IBP(C)", "IBP(C/M)"}
    assert len(recs) == 2 * 2 * 4 and all(r["verified"] for r in recs)
    assert all(r["used_bytes"] <= r["budget_bytes"] for r in recs)
    assert (tmp_path / "bench_cache.png").stat().st_size > 0


def test_bench_cache_codec_comparison_runs_on_cpu(tmp_path: Path, shared_data_dir: Path,
                                                  script_module) -> None:
    """MiniLM-SU: the engine's codec choice against forced IBP / exponent / raw, hit rate next to speed; on the CPU
    "auto" takes the smallest store (exponent coding for these dense floats)."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    with script_module("bench_cache") as mod:
        rc = mod.main(["--device", "cpu", "--quick", "--gb", "0.004", "--batch", "300", "--datasets", "minilm",
                       "--only-codecs", "--out", str(tmp_path)])
    assert rc == 0
    recs = json.loads((tmp_path / "bench_cache.json").read_text())["records"]
    assert {r["mode"] for r in recs} == {"codec=auto", "codec=ibp", "codec=exponent", "codec=raw"}
    assert len(recs) == 2 * 4 and all(r["verified"] for r in recs)
    assert all(r["codec_method"] == "exponent" for r in recs if r["mode"] == "codec=auto")
    assert all(0 <= r["hit_rate"] <= 1 and r["speedup"] is not None for r in recs)
    assert all("ratios" in r["host_layout"] for r in recs if r["mode"] == "codec=auto")
