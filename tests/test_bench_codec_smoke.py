"""Smoke-run scripts/bench_codec.py on the CPU at a tiny size: every method on real tables (and a cast), ratios and
the CPU decoder's speed, every output verified, JSON and PNG written (the GPU run adds the lookup-kernel timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_bench_codec_runs_on_cpu(tmp_path: Path, shared_data_dir: Path, script_module) -> None:
    pytest.importorskip("matplotlib")
    with script_module("bench_codec") as mod:
        rc = mod.main(["--device", "cpu", "--quick", "--gb", "0.003", "--batch", "300", "--tables", "cora,kv_chat_v",
                       "--dtypes", "fp32,bf16", "--out", str(tmp_path)])
    assert rc == 0
    recs = json.loads((tmp_path / "bench_codec.json").read_text())["records"]
    assert {(r["table"], r["dtype"]) for r in recs} == {(t, d) for t in ("cora", "kv_chat_v") for d in ("fp32", "bf16")}
    assert {r["method"] for r in recs} == set(mod.METHODS) and all(r["verified"] for r in recs)
    by = {(r["table"], r["dtype"], r["method"]): r for r in recs}
    assert by["cora", "fp32", "ibp"]["ratio"] == pytest.approx(25.39, abs=0.01)  # the paper's Cora number
    assert by["kv_chat_v", "bf16", "exponent"]["stored_ratio"] > by["kv_chat_v", "bf16", "ibp"]["stored_ratio"]
    assert by["cora", "fp32", "exponent_1seg"]["n_seg"] == 1 and by["cora", "fp32", "exponent"]["n_seg"] > 1
    assert (tmp_path / "bench_codec.png").stat().st_size > 0
