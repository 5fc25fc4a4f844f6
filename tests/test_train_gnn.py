"""scripts/train_gnn.py end to end at a tiny size on the CPU: every record says how its batches arrived (sampler,
pipelined), runs of one sampler have identical losses, stage times, the stages' host shares, targets and what bounds
the epoch are reported, and the JSON / PNG are written. The GPU run is the benchmark itself (see the script's
docstring)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("hydra")


def test_quick_run_on_cpu_writes_every_variant(tmp_path: Path) -> None:
    try:
        from ibpcache.loaders.dgl import import_dgl

        import_dgl()
    except ImportError as exc:
        pytest.skip(str(exc))
    overrides = ["datasets=[cora_su]", "dataset.n_nodes=3000", "dataset.avg_degree=8", "dataset.n_train=192",
                 "dataset.n_test=64", "dataset.batch_size=64", "cache.modes=[dgl_pinned,raw,ibp_cm]", "epochs=2",
                 "model.hidden=16", "model.num_workers=1", "device=cpu", "progress=false"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_gnn.py"), "--quick", "--out", str(tmp_path),
                          *overrides], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    doc = json.loads((tmp_path / "train_gnn.json").read_text())
    recs = doc["records"]
    runs = [(r["mode"], r["sampler"], r["pipelined"]) for r in recs]
    assert runs == [(m, s, p) for m in ("dgl_pinned", "raw", "ibp_cm") for s in ("dgl", "torch") for p in (False, True)]
    for r in recs:
        assert r["identical_losses"] and r["identical_predictions"], runs
        assert r["batches"] == 3 and min(r["sample_ms"], r["fetch_ms"], r["train_ms"]) > 0
        assert r["slowest_stage_ms"] == max(r["sample_ms"], r["fetch_ms"], r["train_ms"])
        assert r["speedup_vs_dgl_pinned"] is not None and r["speedup_vs_dgl_pinned_unpipelined"] is not None
        assert r["run"]["pipelined"] == r["pipelined"] and len(r["run"]["losses"]) == 2
        assert r["run"]["across_epochs"] == (r["pipelined"] and r["sampler"] == "torch")
        # the profiled stage pass: host shares on the CPU (no GPU numbers, so no GPU bound)
        assert all(r[f"{n}_host_ms"] is not None and r[f"{n}_host_ms"] >= 0 for n in ("sample", "fetch", "train"))
        assert r["host_busy_ms"] > 0 and r["gpu_busy_ms"] is None and r["bound_ms"] is None
        clock = [f"{n}_ms" for n in ("sample_busy", "sample_blocked", "fetch_starved", "fetch_busy", "fetch_blocked")]
        if r["pipelined"]:  # the stage threads' clock (run ahead across epochs, a tiny run's work may all land in one)
            assert all(r[k] >= 0 for k in clock)
            assert all(sum(e[k] for e in r["run"]["epochs"]) > 0 for k in ("sample_busy", "fetch_busy"))
        else:
            assert not set(clock) & set(r) and all(e["fetch_busy"] == 0.0 for e in r["run"]["epochs"])
    assert doc["meta"]["all_modes_identical"]
    assert doc["meta"]["datasets"]["cora_su"]["variants"] == [["dgl", False], ["dgl", True], ["torch", False],
                                                              ["torch", True]]
    goals = doc["meta"]["targets_pipelined"]["cora_su"]
    assert set(goals) >= {"dgl", "torch", "best"}
    assert {"vs_dgl_pinned", "vs_dgl_pinned_pipelined", "epoch_vs_slowest_stage"} <= set(goals["dgl"])
    assert (tmp_path / "train_gnn.png").stat().st_size > 0
    assert "Targets of issue 25" in res.stdout
    assert len(doc["meta"]["limits"]) == 2 and "What bounds the pipelined" in res.stdout  # ibp_cm pipelined x 2
    assert all("each epoch " in line and "steps captured 0 / 0, full GCs " in line and "fetch starved " in line
               for line in doc["meta"]["limits"])
    assert goals["torch"]["limit"]["by"] in {"GPU", "host", "overlap"} or goals["torch"]["limit"]["by"].startswith(
        "slowest stage")


def test_repeats_reverse_the_order_keep_the_losses_and_judge_medians(tmp_path: Path) -> None:
    overrides = ["datasets=[minilm_su]", "dataset.n_nodes=3000", "dataset.avg_degree=8", "dataset.n_train=128",
                 "dataset.n_test=64", "dataset.batch_size=64", "cache.modes=[raw,ibp_cm]", "epochs=2",
                 "model.hidden=16", "samplers=[torch]", "pipeline=[true]", "repeats=3", "device=cpu",
                 "progress=false"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_gnn.py"), "--out", str(tmp_path),
                          *overrides], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    doc = json.loads((tmp_path / "train_gnn.json").read_text())
    runs = [(r["repeat"], r["mode"]) for r in doc["records"]]
    assert runs == [(0, "raw"), (0, "ibp_cm"), (1, "ibp_cm"), (1, "raw"), (2, "raw"), (2, "ibp_cm")]
    assert all(r["identical_losses"] and r["identical_predictions"] for r in doc["records"])
    check = doc["meta"]["targets_pipelined"]["minilm_su"]["vs_raw_every_run"]
    mine = {r["repeat"]: r["speedup_vs_raw"] for r in doc["records"] if r["mode"] == "ibp_cm"}
    assert check["measured_runs"] == [mine[0], mine[1], mine[2]]
    assert check["measured"] == sorted(mine.values())[1] and check["met"] == (check["measured"] >= 1.0)
    med = doc["meta"]["targets_pipelined"]["minilm_su"]["vs_raw_median_epochs"]
    epochs = {m: sorted(r["epoch_ms"] for r in doc["records"] if r["mode"] == m)[1] for m in ("raw", "ibp_cm")}
    assert med["per_variant"] == {"torch pipelined": epochs["raw"] / epochs["ibp_cm"]}
    assert med["measured"] == epochs["raw"] / epochs["ibp_cm"] and med["met"] == (med["measured"] >= 1.0)
    slowest = doc["meta"]["targets_pipelined"]["minilm_su"]["torch"]["epoch_vs_slowest_stage"]
    assert slowest["at_most"] and slowest["met"] == (slowest["measured"] <= slowest["target"])


def test_median_merge_judges_each_check_on_the_median_in_its_direction() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from train_gnn import _check, _median_merge
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    reps = [{"a": _check(1.0, m), "b": _check(1.2, s, at_most=True), "ms": e, "ok": ok, "by": by}
            for m, s, e, ok, by in [(0.9, 1.3, 10.0, True, "host"), (1.1, 1.1, 30.0, True, "GPU"),
                                    (1.05, 1.15, 20.0, False, "host")]]
    out = _median_merge(reps)
    assert out["a"] == {"target": 1.0, "measured": 1.05, "met": True, "measured_runs": [0.9, 1.1, 1.05]}
    assert out["b"]["measured"] == 1.15 and out["b"]["met"] and out["b"]["at_most"]
    assert out["ms"] == 20.0 and out["ok"] is False and out["by"] == "host"
    assert _median_merge([_check(1.0, None), _check(1.0, None)])["met"] is False
    assert _median_merge(reps[:1]) is reps[0]
