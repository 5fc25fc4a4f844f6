"""Tests of ibpcache.testing.timing: statistics, result files, and CUDA-event timing on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ibpcache.testing import cpu_time, cuda_time, default_out_dir, format_table, summarize, write_results


def test_summarize_percentiles() -> None:
    stats = summarize([float(v) for v in range(1, 11)])
    assert stats["median_ms"] == pytest.approx(5.5)
    assert stats["p10"] == pytest.approx(1.9) and stats["p90"] == pytest.approx(9.1)
    assert stats["min_ms"] == 1.0 and stats["iters"] == 10 and len(stats["all"]) == 10
    with pytest.raises(ValueError, match="at least one"):
        summarize([])


def test_cpu_time_counts_calls() -> None:
    calls = []
    stats = cpu_time(lambda: calls.append(1), warmup=3, iters=7)
    assert len(calls) == 10 and stats["iters"] == 7 and stats["median_ms"] >= 0
    with pytest.raises(ValueError, match="iters"):
        cpu_time(lambda: None, iters=0)


def test_default_out_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    assert default_out_dir() == tmp_path
    monkeypatch.delenv("OUT")
    assert default_out_dir() == Path("results")


def test_write_results_json_and_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    records = [{"x": 1, "gbps": np.float32(2.5), "n": torch.tensor(3), "bad": float("nan"), "dtype": torch.float16}]

    def plot(recs):
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots()
        ax.bar([str(r["x"]) for r in recs], [float(r["gbps"]) for r in recs])
        return fig

    paths = write_results(tmp_path / "out", "demo", records, plot, meta={"quick": True})
    data = json.loads(paths["json"].read_text())
    assert data["records"] == [{"x": 1, "gbps": 2.5, "n": 3, "bad": None, "dtype": "torch.float16"}]
    assert data["meta"] == {"quick": True} and "torch" in data["env"]
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="file stem"):
        write_results(tmp_path, "../x", records)


def test_format_table() -> None:
    table = format_table([{"mode": "raw", "gbps": 12.3456}, {"mode": "ibp", "gbps": 20.0, "hit": 0.5}])
    lines = table.splitlines()
    assert lines[0].split() == ["mode", "gbps", "hit"] and "12.35" in lines[2] and "0.5" in lines[3]
    assert format_table([]) == "(no records)"


@pytest.mark.gpu
def test_cuda_time_measures_device_work() -> None:
    x = torch.randn(4096, 4096, device="cuda")
    small = cuda_time(lambda: x.add_(1), warmup=2, iters=5)
    big = cuda_time(lambda: x @ x, warmup=2, iters=5, flush_l2=True)
    assert small["iters"] == big["iters"] == 5
    assert 0 < small["median_ms"] < big["median_ms"]
