"""The one module that reads ``.cu`` files and launches their kernels: CuPy ``RawModule``s built lazily, per device.

Nothing compiles at import time. The first ``get_function`` on a device compiles the source with NVRTC
for that device's architecture (CuPy caches the binary on disk), later calls reuse it. A source whose first
lines hold ``// requires: other.cu ...`` is compiled after those files' text (concatenated, so CuPy's
cache key changes whenever any of them does; NVRTC has no file includes we could rely on for that).

:func:`launch` is the only launch path: it passes torch's current stream by its raw pointer, so a launch
costs a few microseconds of host time (decode steps of an LLM launch thousands of kernels).
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

from ..errors import KernelBuildError

__all__ = ["get_function", "source_path", "source_text", "launch", "kernel_options"]

_KERNEL_DIR = Path(__file__).resolve().parent
_LOCK = threading.Lock()
kernel_options: tuple[str, ...] = ("-std=c++17",)


def source_path(name: str) -> Path:
    path = _KERNEL_DIR / name
    if not path.exists():
        raise KernelBuildError(f"CUDA source {name} is missing from {_KERNEL_DIR}")
    return path


def _requires(text: str) -> list[str]:
    """Files named on ``// requires:`` lines at the top of a source (before its first non-comment line)."""
    names: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("//"):
            break
        if line.startswith("// requires:"):
            names += line[len("// requires:"):].split()
    return names


def source_text(name: str, _seen: "tuple[str, ...]" = ()) -> str:
    """The text NVRTC compiles for ``name``: its required sources (each once, in order), then itself."""
    if name in _seen:
        raise KernelBuildError(f"CUDA source {name} requires itself through {' -> '.join(_seen)}")
    own = source_path(name).read_text()
    parts = [source_text(dep, _seen + (name,)) for dep in _requires(own)]
    return "\n".join(parts + [f"// ---- {name}", own])


@functools.lru_cache(maxsize=None)
def _module(name: str, device_id: int, options: tuple[str, ...]):
    import cupy

    code = source_text(name)
    with cupy.cuda.Device(device_id):
        try:
            mod = cupy.RawModule(code=code, options=options)
            mod.compile()
        except Exception as exc:  # CuPy raises its own CompileException with the NVRTC log
            raise KernelBuildError(f"failed to build {name} for device {device_id}: {exc}") from exc
    return mod


@functools.lru_cache(maxsize=None)
def _function(name: str, symbol: str, device_id: int, options: tuple[str, ...]):
    with _LOCK:
        mod = _module(name, device_id, options)
    import cupy

    with cupy.cuda.Device(device_id):
        try:
            return mod.get_function(symbol)
        except Exception as exc:
            raise KernelBuildError(f"{name} has no kernel {symbol!r}: {exc}") from exc


def get_function(source_file: str, symbol: str, device_id: "int | None" = None, options: tuple[str, ...] = ()):
    """The compiled kernel ``symbol`` of ``source_file`` (in ibpcache/kernels) for ``device_id``."""
    import torch

    if device_id is None:
        device_id = torch.cuda.current_device()
    return _function(source_file, symbol, int(device_id), tuple(kernel_options) + tuple(options))


class _StreamRef:
    """What CuPy's ``Function.__call__`` reads from a stream argument: its ``ptr`` (no CuPy stream object)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def _current_stream_ptr(device_id: int) -> int:
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object: ~10x cheaper
    return raw(device_id) if raw is not None else torch.cuda.current_stream(device_id).cuda_stream


def launch(source_file: str, symbol: str, device_id: int, grid: "int | tuple[int, ...]", block: int,
           args: tuple) -> None:
    """Launch ``symbol`` of ``source_file`` on torch's current stream of ``device_id`` (ordered with torch work).

    The device is switched only when it is not current already (CuPy and torch share the runtime's current
    device), and the stream goes in as a raw pointer: no per-launch CuPy objects, no deprecation warnings.
    """
    import torch

    fn = get_function(source_file, symbol, device_id)
    grid_t = grid if isinstance(grid, tuple) else (grid,)
    stream = _StreamRef(_current_stream_ptr(device_id))
    if torch.cuda.current_device() == device_id:
        fn(grid_t, (block,), args, stream=stream)
        return
    import cupy

    with cupy.cuda.Device(device_id):
        fn(grid_t, (block,), args, stream=stream)
