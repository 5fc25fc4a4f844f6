"""The one module that reads ``.cu`` files and launches their kernels: CuPy ``RawModule``s built lazily, per device.

Nothing compiles at import time. The first ``get_function`` on a device compiles the source with NVRTC
for that device's architecture (CuPy caches the binary on disk), later calls reuse it. A source whose first
lines hold ``// requires: other.cu ...`` is compiled after those files' text (concatenated, so CuPy's
cache key changes whenever any of them does; NVRTC has no file includes we could rely on for that).

:func:`launch` is the only launch path: it passes torch's current stream by its raw pointer, so a launch
costs a few microseconds of host time (decode steps of an LLM launch thousands of kernels).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from pathlib import Path
from typing import Iterator

from ..errors import DeviceError, KernelBuildError

__all__ = ["get_function", "source_path", "source_text", "launch", "kernel_options", "extra_kernel_options",
           "import_cupy", "sm_count",
           "cupy_install_hint", "check_cupy_cuda_major", "host_alloc", "host_free", "host_register_read_only",
           "host_unregister", "copy_host_to_device", "copy_device_to_host"]

_KERNEL_DIR = Path(__file__).resolve().parent
_LOCK = threading.Lock()
kernel_options: tuple[str, ...] = ("-std=c++17",)


def cupy_install_hint(torch_cuda: "str | None") -> str:
    """The install command that gives CuPy for torch's CUDA (``torch.version.cuda``, e.g. "12.4")."""
    major = torch_cuda.split(".")[0] if torch_cuda else None
    if major in ("12", "13"):
        return f'pip install "ibpcache[cuda{major}]"'
    return (f"install the CuPy wheel for CUDA {torch_cuda} (cupy-cuda<major>x); ibpcache's extras cover CUDA 12 "
            '("ibpcache[cuda12]") and 13 ("ibpcache[cuda13]")')


def check_cupy_cuda_major(torch_cuda: "str | None", cupy_major: "int | None") -> None:
    """Raise KernelBuildError when CuPy was built for another CUDA major than torch (two runtimes, one process)."""
    if not torch_cuda or cupy_major is None:
        return
    torch_major = int(torch_cuda.split(".")[0])
    if cupy_major != torch_major:
        raise KernelBuildError(
            f"CuPy is built for CUDA {cupy_major} but torch for CUDA {torch_cuda}: the kernels would run on a "
            f"second CUDA runtime. Replace it: pip uninstall -y cupy-cuda{cupy_major}x && "
            f"{cupy_install_hint(torch_cuda)}")


def _cupy_cuda_major(cupy: object) -> "int | None":
    """CUDA major CuPy was built for: from its wheel's name (cupy-cuda12x), else from its runtime version."""
    from importlib import metadata

    for dist in metadata.packages_distributions().get("cupy", []):
        name = dist.lower()
        if name.startswith("cupy-cuda") and name.endswith("x") and name[9:-1].isdigit():
            return int(name[9:-1])
    try:
        return int(cupy.cuda.runtime.runtimeGetVersion()) // 1000  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - unknown build: let the first compile report what is wrong
        return None


@functools.lru_cache(maxsize=None)
def import_cupy():
    """CuPy, checked once: installed, and built for torch's CUDA major. The only place ibpcache imports CuPy.

    CuPy is an extra (``[cuda12]`` / ``[cuda13]``) because its wheels are per CUDA major; the CPU path never
    calls this. Raises :class:`KernelBuildError` naming the extra to install.
    """
    import torch

    try:
        import cupy
    except ImportError as exc:
        raise KernelBuildError(
            f"the CUDA kernels need CuPy, which is not installed (torch is built for CUDA {torch.version.cuda}): "
            f"{cupy_install_hint(torch.version.cuda)}") from exc
    check_cupy_cuda_major(torch.version.cuda, _cupy_cuda_major(cupy))
    return cupy


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
    cupy = import_cupy()

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
    cupy = import_cupy()

    with cupy.cuda.Device(device_id):
        try:
            return mod.get_function(symbol)
        except Exception as exc:
            raise KernelBuildError(f"{name} has no kernel {symbol!r}: {exc}") from exc


@contextlib.contextmanager
def extra_kernel_options(*options: str) -> Iterator[None]:
    """Inside the block, every kernel is fetched (and so launched) from modules compiled with ``options`` added
    (e.g. ``"-DIBP_EXP_LOOKUP_UNROLL=8"``), then the defaults again.

    Why: a compile-time variant of a kernel can be timed against the default in one process, through the same
    launchers, without a parameter on every launch path; the options are part of the module cache key, so both
    builds stay cached. Not thread-safe (it swaps the module-wide :data:`kernel_options`): for experiments.
    """
    global kernel_options
    saved = kernel_options
    kernel_options = tuple(saved) + tuple(options)
    try:
        yield
    finally:
        kernel_options = saved


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


def device_index(x: "object") -> int:
    """The CUDA device ordinal of a tensor or ``torch.device`` (torch's current device when the index is unset)."""
    import torch

    dev = x.device if isinstance(x, torch.Tensor) else x
    return dev.index if dev.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    """Streaming multiprocessors of a device (asked once: the query costs more than a launch). Every launcher's grid
    math uses it, so it lives with the one launch path."""
    import torch

    return torch.cuda.get_device_properties(device_id).multi_processor_count


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
    cupy = import_cupy()

    with cupy.cuda.Device(device_id):
        fn(grid_t, (block,), args, stream=stream)


def host_alloc(nbytes: int) -> int:
    """Page-locked host memory of exactly ``nbytes`` (``cudaHostAlloc``), readable and writable by kernels at the
    same address (UVA). torch's pinned allocator rounds every block up to a power of two, which would hide most of
    what a compressed store saves; the packed KV store sizes its chunks itself. Free with :func:`host_free`."""
    cupy = import_cupy()
    return int(cupy.cuda.runtime.hostAlloc(int(nbytes), 1))  # cudaHostAllocPortable: pinned for every device


def host_free(ptr: int) -> None:
    """Release memory from :func:`host_alloc` (the caller makes sure no kernel still reads or writes it)."""
    import_cupy().cuda.runtime.freeHost(int(ptr))


_HOST_REGISTER_MAPPED = 0x02
_HOST_REGISTER_READ_ONLY = 0x08


def host_register_read_only(ptr: int, nbytes: int) -> None:
    """Page-lock the existing host range ``[ptr, ptr + nbytes)`` in place for every device (``cudaHostRegister``,
    mapped + read-only), so kernels read it at its host address (UVA) like pinned memory, with no copy.

    Read-only because the pages are a shared-memory mapping the process may only read: the driver then pins them
    without asking for write access (which a ``PROT_READ`` mapping refuses). The caller must call
    :func:`host_unregister` before the range is unmapped: the driver keeps the range registered past ``munmap``,
    and a later allocation that the kernel places at an overlapping address then fails with "resource already
    mapped". Through CuPy, whose failed calls also reset the runtime's last error (nothing sticky is left behind
    for an unrelated later check to report).
    """
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    # Kernels use the host address itself, valid on the device only where it may use host pointers of registered
    # memory (cudaDevAttrCanUseHostPointerForRegisteredMem).
    if not getattr(props, "can_use_host_pointer_for_registered_mem", True):
        raise DeviceError("this GPU cannot use host pointers of registered memory (no UVA mapping); the zero-copy "
                          "host store needs it")
    import_cupy().cuda.runtime.hostRegister(int(ptr), int(nbytes), _HOST_REGISTER_MAPPED | _HOST_REGISTER_READ_ONLY)


def host_unregister(ptr: int) -> None:
    """Undo :func:`host_register_read_only` of the range starting at ``ptr`` (before that range is unmapped).

    Waits for the current device first: a kernel enqueued before the last view of the range was dropped may still
    be reading it."""
    import torch

    torch.cuda.synchronize()
    import_cupy().cuda.runtime.hostUnregister(int(ptr))


def copy_host_to_device(dst: int, src: int, nbytes: int, stream_ptr: int) -> None:
    """Enqueue one DMA copy of ``nbytes`` from page-locked host memory ``src`` (:func:`host_alloc`) to device memory
    ``dst`` on the raw CUDA stream ``stream_ptr`` (``cudaMemcpyAsync``; no sync). The copy engine moves a whole
    chunk at PCIe's bulk rate, which scattered zero-copy reads of small rows do not reach."""
    import_cupy().cuda.runtime.memcpyAsync(int(dst), int(src), int(nbytes), 1, int(stream_ptr))  # 1: host->device


def copy_device_to_host(dst: int, src: int, nbytes: int, stream_ptr: int) -> None:
    """Enqueue one DMA copy of ``nbytes`` from device memory ``src`` to page-locked host memory ``dst`` on the raw
    CUDA stream ``stream_ptr`` (``cudaMemcpyAsync``; no sync): how a prefill's encoded KV rows leave the GPU without
    keeping SMs busy for the PCIe transfer, so the copy overlaps the next layer's compute."""
    import_cupy().cuda.runtime.memcpyAsync(int(dst), int(src), int(nbytes), 2, int(stream_ptr))  # 2: device->host
