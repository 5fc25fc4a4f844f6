"""scripts/experiments/sampler_contention.py on the CPU: a tiny run on real PubMed-SU rows times the example's
sampler alone and beside a Python load, each twice, in the order alone, python, python, alone (the GPU conditions
need ``python scripts/experiments/sampler_contention.py`` there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_sampler_contention_smoke(tmp_path: Path, shared_data_dir: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    cmd = [sys.executable, str(root / "scripts/experiments/sampler_contention.py"), "--device", "cpu", "--n-nodes",
           "20000", "--epochs", "1", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, cwd=root, env=env, timeout=600)
    doc = json.loads((tmp_path / "sampler_contention.json").read_text())
    assert (tmp_path / "sampler_contention.png").exists()
    assert [(r["condition"], r["run"]) for r in doc["records"]] == [("alone", 0), ("python", 0), ("python", 1),
                                                                     ("alone", 1)]
    for r in doc["records"]:
        assert r["sample_ms"] > 0 and len(r["epochs_ms"]) == 1 and r["batches"] == 20  # 10,240 seeds / 512
        assert r["syncs_per_epoch"] is None  # counted on a GPU only
        assert (r["vs_alone"] == 1.0) == (r["condition"] == "alone")
    assert doc["meta"]["duty"] == 0.25
