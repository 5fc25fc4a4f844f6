"""scripts/experiments/train_step_profile.py: each wait of a training step named by the function that issued it.

The attribution walks the profiler's tree of Python-frame events; a fake tree pins the rule (this project's and
torch's optimizers' frames first, the innermost one), and a tiny CPU run on real MiniLM rows checks that every wait
the step counts on the CPU (Adagrad's coalesces, its step counter read) gets a site inside the project or torch's
optimizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from scripts.experiments import train_step_profile as tsp


def _chain(*names: str) -> SimpleNamespace:
    """A profiler event under the given parents, innermost first."""
    parent: Optional[SimpleNamespace] = None
    for name in reversed(names):
        parent = SimpleNamespace(name=name, cpu_parent=parent)
    assert parent is not None
    return parent


def test_site_is_the_innermost_frame_of_the_project_or_a_torch_optimizer() -> None:
    ev = _chain("aten::_local_scalar_dense", "aten::item", "<built-in method item of Tensor object>",
                "torch/optim/optimizer.py(90): _get_value", "torch/optim/adagrad.py(300): _single_tensor_adagrad",
                "/x/ibpcache/cache/row_optimizer.py(221): step", "scripts/bench_dlrm.py(305): step")
    assert tsp._site(ev) == "torch/optim/optimizer.py(90): _get_value"
    ev = _chain("aten::nonzero", "torch/_tensor.py(40): wrapped", "contextlib.py(80): inner",
                "/x/ibpcache/cache/row_cache.py(503): _shrink")
    assert tsp._site(ev) == "/x/ibpcache/cache/row_cache.py(503): _shrink"
    assert tsp._site(_chain("aten::nonzero", "contextlib.py(80): inner")) == "contextlib.py(80): inner"
    assert tsp._site(_chain("aten::nonzero", "aten::index")) == "?"


def test_event_sites_counts_only_the_named_events_per_step() -> None:
    back = "/x/ibpcache/loaders/embedding_bag.py(1021): backward"
    pre = "/x/ibpcache/cache/row_cache.py(356): prepare_unique"
    evs = [_chain("aten::_coalesce", back), _chain("aten::_coalesce", back), _chain("aten::add", back),
           _chain("cudaLaunchKernel", "aten::add", back), _chain("cudaLaunchKernel", "aten::sort", pre),
           _chain("cudaLaunchKernel", "aten::sort", pre), _chain("cudaMemsetAsync", "aten::zeros", pre)]
    assert tsp.event_sites(evs, 2) == {f"aten::_coalesce @ {back}": 1.0}
    assert tsp.event_sites(evs, 2, tsp.LAUNCHES) == {f"cudaLaunchKernel @ {pre}": 1.0,
                                                     f"cudaLaunchKernel @ {back}": 0.5,
                                                     f"cudaMemsetAsync @ {pre}": 0.5}
    assert list(tsp.event_sites(evs, 2, tsp.LAUNCHES, top=1)) == [f"cudaLaunchKernel @ {pre}"]


def test_cpu_run_names_a_site_for_every_wait(tmp_path: Path, shared_data_dir: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    cmd = [sys.executable, str(root / "scripts/experiments/train_step_profile.py"), "--device", "cpu", "--rows", "500",
           "--batches", "256", "--bags", "1", "--optimizers", "adagrad", "--tables", "2", "--warmup", "3",
           "--iters", "3", "--profile-steps", "2", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, cwd=root, env=env, timeout=600)
    (point,) = json.loads((tmp_path / "train_step_profile.json").read_text())["points"]
    sites = point["sync_sites_per_step"]
    assert point["sync_ops_per_step"].get("aten::_coalesce") and sites
    for key, per_step in sites.items():
        op, site = key.split(" @ ")
        assert op in tsp.SYNC_OPS and per_step > 0
        assert any(k in site for k in ("ibpcache/", "torch/optim/")), key
    by_op = {op: sum(v for k, v in sites.items() if k.startswith(op + " @ ")) for op in point["sync_ops_per_step"]}
    assert by_op == point["sync_ops_per_step"]  # the same waits in the stacked steps as in the counted ones
    assert point["launch_sites_per_step"] == {}  # the CPU launches nothing; see the fake trees for the rule
    assert 0.0 <= point["prefetch_hit_rate"] <= 1.0
