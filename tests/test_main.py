"""The main job, ``python -m ibpcache``, run as a user would: a fresh process, default config, base install only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(args: list[str], tmp_path: Path, timeout: float = 180,
         pythonpath: "Path | None" = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m ibpcache ARGS`` from an empty folder with TMPDIR inside tmp_path (to see what it writes)."""
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir(exist_ok=True)
    tmp.mkdir(exist_ok=True)
    extra = os.environ.get("PYTHONPATH", "") if pythonpath is None else ""  # e.g. carried wheels on a GPU runner
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(p for p in (str(pythonpath or REPO), extra) if p)}
    return subprocess.run([sys.executable, "-m", "ibpcache", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_help_lists_the_task_group(tmp_path: Path) -> None:
    res = _run(["--help"], tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "== Configuration groups ==" in res.stdout
    assert "task: demo" in res.stdout


def test_demo_runs_verifies_and_prints_the_table(tmp_path: Path) -> None:
    res = _run([], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "compression ratio 25.39x" in out and "round trip bit-exact" in out  # Cora's ratio (README, FORMAT.md)
    assert "fanouts [25, 10]" in out
    header = next(line for line in out.splitlines() if line.startswith("policy"))
    for col in ("hit rate", "host bytes read / raw", "cache rows (raw cache)", "fetch rows/s", "exact"):
        assert col in header
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["static"], ["lru"], ["lfu"])}
    assert set(rows) == {"static", "lru", "lfu"}
    assert all(line.rstrip().endswith("yes") for line in rows.values()), rows
    assert list((tmp_path / "cwd").iterdir()) == []  # Hydra wrote nothing into the working directory
    for heavy in ("dgl", "matplotlib", "transformers"):  # the base install suffices
        assert f"import {heavy}" not in res.stderr


def test_overrides(tmp_path: Path) -> None:
    res = _run(["device=cpu", "task.budget=0.002", "task.epochs=1", "task.policies=[lru]"], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "cache budget 0.002" in res.stdout and "1 epochs" in res.stdout
    assert [line.split()[0] for line in res.stdout.splitlines() if line.startswith(("static", "lru", "lfu"))] == ["lru"]


def test_bad_override_fails_cleanly(tmp_path: Path) -> None:
    res = _run(["task=nosuch"], tmp_path, timeout=60)
    assert res.returncode != 0
    assert "nosuch" in res.stderr


def test_installed_wheel_without_configs_uses_packaged_defaults(tmp_path: Path) -> None:
    """A wheel has ibpcache/ but no configs/: the ConfigStore defaults must run the same job."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "ibpcache", site / "ibpcache", ignore=shutil.ignore_patterns("__pycache__"))
    res = _run(["task.epochs=1", "task.policies=[static]"], tmp_path, pythonpath=site)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "compression ratio 25.39x" in res.stdout
    assert [line.split()[0] for line in res.stdout.splitlines() if line.startswith("static")] == ["static"]
    # --config-dir adds a folder that overrides the packaged defaults
    extra = tmp_path / "myconf" / "task"
    extra.mkdir(parents=True)
    (extra / "demo.yaml").write_text((REPO / "configs" / "task" / "demo.yaml").read_text()
                                     .replace("policies: [static, lru, lfu]", "policies: [lfu]"))
    res = _run(["--config-dir", str(tmp_path / "myconf"), "task.epochs=1"], tmp_path, pythonpath=site)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert [line.split()[0] for line in res.stdout.splitlines() if line.startswith(("static", "lru", "lfu"))] == ["lfu"]


def test_configs_folder_equals_packaged_defaults() -> None:
    """configs/ (what a user edits) and the ConfigStore defaults (what a wheel runs) compose to the same config, for
    every task."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from ibpcache.__main__ import CONFIG_NAME, checkout_config_dir, register_packaged_configs

    assert checkout_config_dir() == REPO / "configs"
    keys = ("run", "sweep", "output_subdir", "job.chdir", "help.app_name", "help.header", "help.footer")

    def composed(config_dir: "str | None", overrides: list[str]) -> tuple[dict, list]:
        GlobalHydra.instance().clear()
        if config_dir is None:
            register_packaged_configs()
            from hydra import initialize

            ctx = initialize(config_path=None, version_base=None)
        else:
            ctx = initialize_config_dir(config_dir=config_dir, version_base=None)
        with ctx:
            cfg = compose(config_name=CONFIG_NAME, overrides=overrides, return_hydra_config=True)
        plain = OmegaConf.to_container(cfg)
        hydra_plain = [OmegaConf.select(cfg.hydra, k) for k in keys]  # unresolved: ${now:...} differs per call
        hydra_plain = [OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for v in hydra_plain]
        return {k: v for k, v in plain.items() if k != "hydra"}, hydra_plain

    tasks = sorted(p.stem for p in (REPO / "configs" / "task").glob("*.yaml"))
    assert tasks == ["demo", "gc", "serve"]
    try:  # every folder composition first: once registered, the ConfigStore would validate the files against it
        from_files = [composed(str(REPO / "configs"), [f"task={task}"]) for task in tasks]
        packaged = [composed(None, [f"task={task}"]) for task in tasks]
    finally:
        GlobalHydra.instance().clear()
    for task, a, b in zip(tasks, from_files, packaged):
        assert a == b, task


def test_demo_exits_non_zero_when_a_fetch_is_not_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exit status is the verification: corrupt one fetched bit and the task must report failure."""
    from omegaconf import OmegaConf

    import ibpcache
    from ibpcache.__main__ import DemoTask, run

    real_fetch = ibpcache.FeatureCache.fetch

    def corrupt(self, ids, out=None):  # noqa: ANN001, ANN202 - same signature as the method
        rows = real_fetch(self, ids, out).clone()
        rows.view(-1).view(__import__("torch").uint8)[0] ^= 1
        return rows

    monkeypatch.setattr(ibpcache.FeatureCache, "fetch", corrupt)
    cfg = OmegaConf.create({"device": "cpu", "task": OmegaConf.structured(DemoTask(epochs=1, policies=["static"]))})
    assert run(cfg) == 1


def test_serve_task_publishes_until_sigterm(tmp_path: Path) -> None:
    """``python -m ibpcache task=serve +task.stores.NAME=FILE``: the store host of issue 12 as a task of the main
    job; a client attaches by name, reads exact rows, and SIGTERM removes the segment."""
    import json
    import signal
    import time
    import uuid

    import torch

    from ibpcache import Codec, CompressedRows, _shm
    from ibpcache.datasets import load_cora

    rows = load_cora().features[:500].contiguous()
    path = tmp_path / "cora.ibp"
    Codec.fit(rows).compress(rows, layout="packed", pin=False).save(path)
    name = f"test-main-{uuid.uuid4().hex[:8]}"
    ready = tmp_path / "ready.json"
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    host = subprocess.Popen([sys.executable, "-m", "ibpcache", "task=serve", f"+task.stores.{name}={path}",
                             f"task.ready_file={ready}"], cwd=cwd, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert host.poll() is None, host.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert name in json.loads(ready.read_text())["stores"]
        att = CompressedRows.attach(name)
        assert torch.equal(att.decompress().view(torch.uint8), rows.view(torch.uint8))
        host.send_signal(signal.SIGTERM)
        assert host.wait(timeout=60) == 0, host.stderr.read().decode()[-2000:]
        assert "ibpcache serve: stopped" in host.stderr.read().decode()
        assert not _shm.segment_path(name).exists()
        with pytest.raises(_shm.StaleStoreError, match=f"its store host \\(pid {host.pid}\\) stopped"):
            att.decompress()  # told the host stopped, not that the store was replaced
        with pytest.raises(FileNotFoundError, match="is the host running"):
            CompressedRows.attach(name)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()


def test_gc_task_removes_a_killed_owners_store_and_keeps_live_ones(tmp_path: Path) -> None:
    """``python -m ibpcache task=gc``: a store whose owner was killed (kill -9: nothing of it ran) is removed, a store
    of a live owner (this process) is kept; ``task.dry_run=true`` only reports."""
    import signal
    import time
    import uuid

    from ibpcache import Codec, _shm
    from ibpcache.datasets import load_cora

    rows = load_cora().features[:300].contiguous()
    path = tmp_path / "rows.ibp"
    Codec.fit(rows).compress(rows, layout="packed", pin=False).save(path)
    dead, live = f"test-gc-{uuid.uuid4().hex[:8]}", f"test-gc-{uuid.uuid4().hex[:8]}"
    ready = tmp_path / "ready.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    mine = Codec.fit(rows).compress(rows, layout="packed", pin=False).share(live)  # before: share() sweeps too
    host = subprocess.Popen([sys.executable, "-m", "ibpcache.cache.service", "--store", f"{dead}={path}",
                             "--ready-file", str(ready)], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert host.poll() is None, host.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        host.send_signal(signal.SIGKILL)
        host.wait(timeout=30)
        assert _shm.segment_path(dead).exists()
        res = _run(["task=gc", "task.dry_run=true"], tmp_path, timeout=120)
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"would remove {_shm.segment_path(dead)}: published by pid {host.pid}, which is gone" in res.stdout
        assert _shm.segment_path(dead).exists()
        res = _run(["task=gc"], tmp_path, timeout=120)
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"removed {_shm.segment_path(dead)}" in res.stdout
        assert f"kept {_shm.segment_path(live)}: published by pid {os.getpid()}, which runs" in res.stdout
        assert not _shm.segment_path(dead).exists() and _shm.segment_path(live).exists()
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
        mine.close()
        _shm.segment_path(dead).unlink(missing_ok=True)


def test_serve_task_without_stores_fails_cleanly(tmp_path: Path) -> None:
    res = _run(["task=serve"], tmp_path, timeout=120)
    assert res.returncode != 0
    assert "task.stores" in res.stderr


# ------------------------------------------------------------------------------------------------------------
# Settings are checked before any work, named as typed, and end the job with status 2 and no traceback


def _demo_cfg(**task: Any) -> Any:
    """A composed config as configs/ gives it (untyped: a user's typo reaches the job as typed)."""
    from dataclasses import asdict

    from omegaconf import OmegaConf

    from ibpcache.__main__ import DemoTask

    return OmegaConf.create({"device": task.pop("device", "cpu"), "task": {**asdict(DemoTask()), **task}})


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading data or fitting a codec fails the test: validation must come first."""
    import ibpcache.datasets
    from ibpcache import Codec

    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("work started before the settings were checked")

    monkeypatch.setattr(ibpcache.datasets, "load_cora", boom)
    monkeypatch.setattr(Codec, "fit", boom)


@pytest.mark.parametrize("setting, message", [
    ({"batch_size": 0}, "task.batch_size=0: must be a positive integer"),
    ({"batch_size": -5}, "task.batch_size=-5: must be a positive integer"),
    ({"batch_size": "abc"}, "task.batch_size=abc: must be a positive integer"),
    ({"batch_size": 2.5}, "task.batch_size=2.5: must be a positive integer"),
    ({"batch_size": True}, "task.batch_size=true: must be a positive integer"),
    ({"epochs": 0}, "task.epochs=0: must be a positive integer"),
    ({"seed": -1}, "task.seed=-1: must be an integer in [0, 2**64)"),
    ({"budget": 0}, "task.budget=0: an int budget is a byte count and must be >= 1"),
    ({"budget": 0.0}, "task.budget=0.0: a float budget is a fraction"),
    ({"budget": 1.5}, "task.budget=1.5: a float budget is a fraction"),
    ({"budget": "1GB"}, "task.budget: expected a float fraction in (0, 1]"),
    ({"budget": True}, "task.budget: expected a float fraction in (0, 1]"),
    ({"policies": []}, "task.policies=[]: must name at least one policy"),
    ({"policies": ["static", "fifo"]}, "task.policies=[static, fifo]: fifo is not a policy; known: ['static', 'lru', 'lfu']"),
    ({"policies": "lru"}, "task.policies=lru: must be a list"),
    ({"fanouts": [25, 0]}, "task.fanouts=[25, 0]: must be a list of positive integers"),
    ({"fanouts": [-1]}, "task.fanouts=[-1]: must be a list of positive integers"),
    ({"batchsize": 64}, "task.batchsize=64: unknown setting of task=demo"),
    ({"device": "tpu"}, "device=tpu: must be auto, cpu or cuda"),
    ({"name": "nosuch"}, "task.name=nosuch: unknown task; known: ['demo', 'gc', 'serve']"),
])
def test_bad_demo_settings_fail_before_any_work(no_work: None, setting: dict, message: str) -> None:
    from ibpcache.__main__ import run
    from ibpcache.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        run(_demo_cfg(**setting))
    assert str(info.value).startswith(message), str(info.value)
    assert isinstance(info.value, ValueError)


def test_default_and_edge_settings_pass_validation() -> None:
    from omegaconf import OmegaConf

    from ibpcache.__main__ import DemoTask, validate_demo

    validate_demo(_demo_cfg())
    validate_demo(_demo_cfg(budget=1.0, policies=["LRU"], fanouts=[], seed=2**64 - 1, device="auto"))
    validate_demo(OmegaConf.create({"device": "cpu", "task": OmegaConf.structured(DemoTask)}))


def test_packaged_config_keeps_an_int_budget_an_int() -> None:
    """The ConfigStore schema must not turn task.budget=2 (bytes) into 2.0 (a fraction), or a wheel would read the
    same command line differently from a checkout."""
    from omegaconf import OmegaConf

    from ibpcache.__main__ import DemoTask

    task = OmegaConf.structured(DemoTask)
    OmegaConf.update(task, "budget", 2)
    assert task.budget == 2 and isinstance(task.budget, int)


@pytest.mark.parametrize("budget, message", [
    (2, "task.budget=2 (an int budget is a byte count): too small to cache one row; the smallest valid budget is "
        "16 bytes"),
    (1e-9, "task.budget=1e-09 (0 bytes of 15522256): too small to cache one row"),
])
def test_budget_below_any_row_fails_before_the_fit(monkeypatch: pytest.MonkeyPatch, budget: Any,
                                                   message: str) -> None:
    from ibpcache import Codec
    from ibpcache.__main__ import run
    from ibpcache.errors import ConfigError

    monkeypatch.setattr(Codec, "fit", lambda *a, **k: pytest.fail("the codec was fitted before the budget check"))
    with pytest.raises(ConfigError, match="^" + message.replace("(", "\\(").replace(")", "\\)")):
        run(_demo_cfg(budget=budget))


def test_budget_below_the_smallest_compressed_row_names_the_smallest_valid_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Between 16 bytes and Cora's smallest compressed row the check needs the codec; it runs before any cache."""
    import ibpcache
    from ibpcache import Codec
    from ibpcache.__main__ import run
    from ibpcache.datasets import load_cora
    from ibpcache.errors import ConfigError

    fitted, real_fit = [], Codec.fit
    monkeypatch.setattr(Codec, "fit", lambda *a, **k: fitted.append(real_fit(*a, **k)) or fitted[-1])
    monkeypatch.setattr(ibpcache, "FeatureCache", lambda *a, **k: pytest.fail("a cache was built"))
    with pytest.raises(ConfigError, match=r"^task.budget=17 \(an int budget is a byte count\): too small") as info:
        run(_demo_cfg(budget=17))
    x = load_cora().features
    smallest = -(-int(fitted[0].stored_lengths(x).min()) // 16) * 16
    assert smallest > 17 and f"smallest valid budget is {smallest} bytes" in str(info.value)


def test_bad_setting_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    res = _run(["task.batch_size=0"], tmp_path, timeout=120)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.strip() == "ibpcache: task.batch_size=0: must be a positive integer"
    assert "codec:" not in res.stdout and "serving" not in res.stdout  # nothing was loaded or fitted


def test_bad_serve_settings_fail_before_publishing(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from ibpcache.__main__ import run
    from ibpcache.errors import ConfigError

    store = tmp_path / "s.ibp"
    store.write_bytes(b"")

    def cfg(**task: Any) -> Any:
        return OmegaConf.create({"device": "auto", "task": {"name": "serve", "stores": {"ok": str(store)},
                                                            "ready_file": None, "replace": True, **task}})

    cases = [
        (cfg(stores={}), "task.stores={}: task=serve needs at least one store"),
        (cfg(stores={"feats": str(tmp_path / "missing.ibp")}), f"task.stores.feats={tmp_path / 'missing.ibp'}: "
                                                              "no such file"),
        (cfg(stores={"bad/name": str(store)}), "task.stores.bad/name="),
        (cfg(ready_file=str(tmp_path / "nowhere" / "ready.json")), "task.ready_file="),
        (cfg(replace="yes"), "task.replace=yes: must be true or false"),
        (cfg(store={"a": "b"}), "task.store={'a': 'b'}: unknown setting of task=serve"),
    ]
    for c, message in cases:
        with pytest.raises(ConfigError) as info:
            run(c)
        assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("setting, message", [
    ({"dry_run": "maybe"}, "task.dry_run=maybe: must be true or false"),
    ({"dryrun": True}, "task.dryrun=true: unknown setting of task=gc"),
])
def test_bad_gc_settings_fail_before_any_sweep(monkeypatch: pytest.MonkeyPatch, setting: dict, message: str) -> None:
    from omegaconf import OmegaConf

    import ibpcache._shm
    from ibpcache.__main__ import run
    from ibpcache.errors import ConfigError

    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the sweep started before the settings were checked")

    monkeypatch.setattr(ibpcache._shm, "sweep", boom)
    cfg = OmegaConf.create({"device": "cpu", "task": {"name": "gc", "dry_run": False, **setting}})
    with pytest.raises(ConfigError) as info:
        run(cfg)
    assert str(info.value).startswith(message), str(info.value)
