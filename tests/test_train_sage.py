"""``examples/train_sage.py`` (GraphSAGE with DGL, side by side; needs the ``dgl`` extra), run as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(args: list[str], tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``python examples/train_sage.py ARGS`` from an empty folder with TMPDIR inside tmp_path."""
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir(exist_ok=True)
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, str(REPO / "examples" / "train_sage.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def _pytest_dgl_available() -> None:
    try:
        from ibpcache.loaders.dgl import import_dgl

        import_dgl()
    except ImportError as exc:
        pytest.skip(str(exc))


def test_help_lists_config_groups(tmp_path: Path) -> None:
    res = _run(["--help"], tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "== Configuration groups ==" in res.stdout
    for line in ("cache: all_modes, ibp", "dataset: cora, cora_su, minilm_su, pubmed, pubmed_su", "model: sage"):
        assert line in res.stdout


def test_train_sage_runs_and_prints_table(tmp_path: Path) -> None:
    _pytest_dgl_available()
    res = _run([], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "train_sage: GraphSAGE fanout [25, 10] on cora" in out
    header = next(line for line in out.splitlines() if line.startswith("mode"))
    for col in ("ratio", "cache rows (raw)", "hit rate", "moved vs raw", "epoch ms", "acc", "same losses"):
        assert col in header
    rows = {line.split("  ")[0]: line for line in out.splitlines() if line.startswith("(")}
    assert set(rows) == {"(1) DGL", "(6) IBP(C/M)"}
    assert rows["(6) IBP(C/M)"].rstrip().endswith("yes")  # identical losses to DGL's path
    assert "%|" in res.stderr  # the tqdm bar
    assert list((tmp_path / "cwd").iterdir()) == []  # Hydra wrote nothing into the working directory


def test_overrides(tmp_path: Path, shared_data_dir: Path) -> None:
    _pytest_dgl_available()
    res = _run(["dataset=pubmed", "cache.budget=0.05", "epochs=1", "cache.modes=[ibp_cm]", "progress=false"],
               tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "on pubmed (19,717 nodes" in res.stdout and "cache budget 0.05" in res.stdout
    assert "(6) IBP(C/M)" in res.stdout and "(1) DGL" not in res.stdout
    assert "%|" not in res.stderr  # progress=false


def test_bad_override_fails_cleanly(tmp_path: Path) -> None:
    res = _run(["dataset=nosuch"], tmp_path, timeout=60)
    assert res.returncode != 0
    assert "nosuch" in res.stderr
