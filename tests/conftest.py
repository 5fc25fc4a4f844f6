"""Shared test setup: GPU gating and session-cached real data sets.

Markers are registered in pyproject.toml (``--strict-markers``). Here ``gpu``/``multi_gpu`` tests become skips
with a reason on machines that cannot run them; with ``IBPCACHE_REQUIRE_GPU=1`` (set by scripts/gpu_check.sh)
that situation is an error instead, so a broken GPU setup cannot pass as "all skipped".
ibpcache is imported inside fixtures only, so a half-written module fails its own tests, not collection.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# The repository root, so tests can import the benchmark helpers (scripts.lib) and examples (examples.gnn) that
# are not part of the installed package.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

try:  # Numba's first compile can take seconds; a per-example deadline would make property tests flaky.
    from hypothesis import settings

    settings.register_profile("ibpcache", deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ibpcache"))
except ImportError:  # hypothesis is a test extra; tests that need it import it themselves
    pass


def _gpu_skip_reason() -> str | None:
    """Why GPU tests cannot run here, or None if they can (torch sees a GPU and CuPy can use it)."""
    try:
        import torch
    except ImportError as exc:
        return f"torch cannot be imported: {exc}"
    if not torch.cuda.is_available():
        return "no CUDA GPU: torch.cuda.is_available() is False"
    try:
        import cupy
    except ImportError as exc:
        return f"cupy cannot be imported: {exc}"
    try:
        if not cupy.is_available():
            return "cupy sees no usable CUDA device (cupy.is_available() is False)"
    except Exception as exc:  # noqa: BLE001 - any driver/runtime failure means "cannot run"
        return f"cupy cannot use the GPU: {exc}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [it for it in items if it.get_closest_marker("gpu") or it.get_closest_marker("multi_gpu")]
    if not gpu_items:
        return
    reason = _gpu_skip_reason()
    if reason is not None and os.environ.get("IBPCACHE_REQUIRE_GPU") == "1":
        raise pytest.UsageError(f"IBPCACHE_REQUIRE_GPU=1 but GPU tests cannot run: {reason}")
    n_devices = 0
    if reason is None:
        import torch

        n_devices = torch.cuda.device_count()
    for item in gpu_items:
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
        elif item.get_closest_marker("multi_gpu") and n_devices < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ GPUs, found {n_devices}"))


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """The shared real-data folder (../shared/data beside the checkout, or $IBPCACHE_SHARED); skip if absent."""
    from ibpcache.datasets import shared_data_dir as find

    try:
        return find()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def cora() -> Any:
    """Bundled Cora as ``GraphData`` (always available). Shared by all tests: clone before modifying."""
    from ibpcache.datasets import load_cora

    return load_cora()


@pytest.fixture(scope="session")
def pubmed(shared_data_dir: Path) -> Any:
    """PubMed ``GraphData`` (19717 nodes; see load_pubmed for how nodes without features get rows)."""
    from ibpcache.datasets import load_pubmed

    return load_pubmed(shared_data_dir)


@pytest.fixture(scope="session")
def minilm(shared_data_dir: Path) -> Any:
    """The MiniLM word-embedding table, float32 [30522, 384]. Shared: clone before modifying."""
    from ibpcache.datasets import load_minilm

    return load_minilm(shared_data_dir)


@pytest.fixture(scope="module")
def code_kv(shared_data_dir: Path) -> Callable[..., Any]:
    """``code_kv(dtype, layer)`` -> real (K, V) [2, 3, 400, 64]: two 400-token windows of the code prompt as a batch."""
    import torch

    from ibpcache.datasets import load_kv

    loaded: dict = {}

    def get(dtype: str, layer: int = 3) -> tuple[Any, Any]:
        key = (dtype, layer)
        if key not in loaded:
            out = []
            for which in ("k", "v"):
                x = load_kv("code", which, dtype, shared_data_dir, flat=False)[layer]  # [3, 832, 64]
                out.append(torch.stack((x[:, :400], x[:, 400:800])).contiguous())
            loaded[key] = tuple(out)
        return loaded[key]

    return get


@pytest.fixture(scope="session")
def real_rows() -> Callable[[str], Any]:
    """``real_rows(name)`` -> rows of ``ibpcache.datasets.DATASETS[name]``, loaded once per session.

    Cora needs nothing; every other data set skips the test when the shared data folder is missing.
    Returned tensors are shared between tests: clone before modifying.
    """
    from ibpcache import datasets

    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            if name != "cora":
                try:
                    datasets.shared_data_dir()
                except FileNotFoundError as exc:
                    pytest.skip(str(exc))
            cache[name] = datasets.load_rows(name)
        return cache[name]

    return get


@pytest.fixture
def store_name() -> Any:
    """A unique shared-store name. Afterwards, pass or fail, every shared-store handle of this process is closed
    (owners' segments removed, attached stores' CUDA registrations dropped) and any file left under the name (or a
    name it begins, ``NAME-b``) is removed."""
    import secrets

    from ibpcache import _shm

    name = f"test-{os.getpid()}-{secrets.token_hex(3)}"
    yield name
    _shm.release()
    for path in _shm.SHM_DIR.glob(f"ibpcache.{name}*"):
        path.unlink(missing_ok=True)


@pytest.fixture
def free_port() -> int:
    """A TCP port free on loopback right now (for the rendezvous of torch.distributed test ranks)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _script_module(name: str) -> Iterator[Any]:
    """``scripts/<name>.py`` imported as a module for the ``with`` block, registered in ``sys.modules`` meanwhile
    (dataclasses look their module up by name), so a test can call its ``main(argv)`` or its functions."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture
def script_module() -> Callable[[str], Any]:
    """``with script_module("bench_cache") as mod: mod.main([...])``: a benchmark script as a module."""
    return _script_module
