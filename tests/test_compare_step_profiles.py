"""scripts/experiments/compare_step_profiles.py: pairs points across runs and reports the base / new step ratio."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, name: str, ms: list, prefetch: float, syncs: float) -> Path:
    points = [{"optimizer": "sgd", "bag": 1, "batch": b, "back_to_back_ms": m, "hit_rate": 1.0,
               "back_to_back_host_ms_by_phase": {"forward": 1.0, "prefetch": prefetch}, "kernels_per_step": 100.0,
               "sync_ops_per_step": {"cudaStreamSynchronize": syncs}} for b, m in zip((1024, 8192), ms)]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"points": points[::-1] if name.endswith("2") else points}))  # order may differ
    return path


def test_compare_pairs_points_and_reports_ratios(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts" / "experiments"))
    try:
        import compare_step_profiles as cmp
    finally:
        sys.path.pop(0)
    base = [_run(tmp_path, "b1", [4.0, 8.0], 3.0, 3), _run(tmp_path, "b2", [6.0, 8.0], 3.0, 3)]
    new = [_run(tmp_path, "n1", [2.0, 8.0], 2.0, 1), _run(tmp_path, "n2", [3.0, 16.0], 1.0, 1)]
    paths = cmp.main(["--base", *map(str, base), "--new", *map(str, new), "--out", str(tmp_path / "o")])
    doc = json.loads(paths["json"].read_text())
    by_batch = {r["batch"]: r for r in doc["points"]}
    assert abs(by_batch[1024]["speedup"] - 2.0) < 1e-9 and abs(by_batch[8192]["speedup"] - 8.0 / 12.0) < 1e-9
    assert by_batch[1024]["new"]["host_ms_by_phase"]["prefetch"] == 1.5
    assert by_batch[1024]["base"]["stream_syncs_per_step"] == 3 and by_batch[1024]["new"]["stream_syncs_per_step"] == 1
    assert paths["png"].stat().st_size > 0
