"""The one module that reads ``.cu`` files: builds CuPy ``RawModule``s lazily, memoized per device.

Nothing compiles at import time. The first ``get_function`` on a device compiles the source with NVRTC
for that device's architecture (CuPy caches the binary on disk), later calls reuse it.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

from ..errors import KernelBuildError

__all__ = ["get_function", "source_path", "cupy_stream", "kernel_options"]

_KERNEL_DIR = Path(__file__).resolve().parent
_LOCK = threading.Lock()
kernel_options: tuple[str, ...] = ("-std=c++17",)


def source_path(name: str) -> Path:
    path = _KERNEL_DIR / name
    if not path.exists():
        raise KernelBuildError(f"CUDA source {name} is missing from {_KERNEL_DIR}")
    return path


@functools.lru_cache(maxsize=None)
def _module(name: str, device_id: int, options: tuple[str, ...]):
    import cupy

    code = source_path(name).read_text()
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


def cupy_stream(device_id: "int | None" = None):
    """torch's current CUDA stream as a CuPy stream, so kernels order with torch work (no syncs)."""
    import cupy
    import torch

    stream = torch.cuda.current_stream(device_id)
    return cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index if stream.device.index is not None else 0)
