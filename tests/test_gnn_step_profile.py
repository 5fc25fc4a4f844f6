"""scripts/experiments/gnn_step_profile.py on the CPU: a tiny run on real Cora-SU rows writes records whose profile
counts the training step's ops (the GPU numbers need ``python scripts/experiments/gnn_step_profile.py`` there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_gnn_step_profile_smoke(tmp_path: Path, shared_data_dir: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    cmd = [sys.executable, str(root / "scripts/experiments/gnn_step_profile.py"), "--device", "cpu", "--nodes",
           "20000", "--steps", "2", "--top", "5", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, cwd=root, env=env, timeout=600)
    doc = json.loads((tmp_path / "gnn_step_profile.json").read_text())
    assert [r["run"] for r in doc["records"]] == [0, 1] and (tmp_path / "gnn_step_profile.png").exists()
    for r in doc["records"]:
        assert r["steps"] == 2 and len(r["top_ops"]) == 5 and r["aten_calls_per_step"] > 50
        assert r["step_ms_median"] > 0 and r["self_cpu_ms_per_step"] > 0
        assert r["gpu_ms_per_step"] == sum(k["gpu_us_per_step"] for k in r["top_kernels"]) / 1e3 == 0  # CPU run
        assert any(o["op"].startswith("aten::index_") for o in r["top_ops"]), r["top_ops"]
