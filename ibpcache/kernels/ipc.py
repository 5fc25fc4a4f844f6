"""GPU memory of one process read by kernels of another on a peer GPU of the same host (CUDA IPC).

The owner exports a tensor's allocation (:func:`export_tensor`: the IPC handle of the ``cudaMalloc`` block that holds
it and the tensor's byte offset in that block, found with the driver's ``cuMemGetAddressRange``; torch's own
sharing is left alone, so its reference counting never holds the block after the owner frees it); a reader opens it with the READER's device current and
``cudaIpcMemLazyEnablePeerAccess`` (:func:`open_peer`), so its kernels may dereference the pointer over NVLink.
Torch's ``rebuild_cuda_tensor`` opens handles on the owner's device instead: a kernel on the reader's own device
then faults on the pointer even with peer access enabled (measured on two H200s), which is why the engine opens
them here. The mapping stays open until :meth:`PeerMapping.close` (or garbage collection); the owner must keep the
tensor allocated until every reader closed it.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from ..errors import DeviceError
from ._build import import_cupy

__all__ = ["IpcExport", "PeerMapping", "export_tensor", "open_peer"]


@dataclass(frozen=True)
class IpcExport:
    """What a reader needs to map a tensor: the owner's GPU, the allocation's IPC handle, the tensor's byte offset in
    that allocation and its byte size. Plain bytes and ints: it travels through ``all_gather_object``."""

    device: int
    handle: bytes
    offset: int
    nbytes: int


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _allocation_base(ptr: int) -> int:
    """Start of the ``cudaMalloc`` block that holds device address ``ptr`` (the caching allocator carves tensors
    out of larger blocks; an IPC handle always maps a whole block)."""
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    rc = _libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise DeviceError(f"cuMemGetAddressRange failed (CUresult {rc}) for address {ptr:#x}")
    return int(base.value)


def export_tensor(t: torch.Tensor) -> IpcExport:
    """Export a contiguous CUDA tensor for :func:`open_peer` in another process on the same host."""
    if not t.is_cuda or not t.is_contiguous():
        raise DeviceError(f"only a contiguous CUDA tensor can be exported, got {t.device} "
                          f"contiguous={t.is_contiguous()}")
    cupy = import_cupy()
    with cupy.cuda.Device(t.device.index):
        handle = cupy.cuda.runtime.ipcGetMemHandle(t.data_ptr())
        base = _allocation_base(t.data_ptr())
    return IpcExport(int(t.device.index), bytes(handle), t.data_ptr() - base, t.numel() * t.element_size())


class PeerMapping:
    """An opened peer allocation: ``tensor`` is a uint8 view of the exported bytes (its ``data_ptr()`` is what this
    process's kernels read); ``close()`` unmaps it (after which the view must not be used)."""

    def __init__(self, base: int, tensor: torch.Tensor, device: int) -> None:
        self._base = base
        self.tensor = tensor
        self._device = device

    def close(self) -> None:
        if self._base:
            cupy = import_cupy()
            with cupy.cuda.Device(self._device):
                torch.cuda.synchronize(self._device)  # no queued kernel still reads it
                cupy.cuda.runtime.ipcCloseMemHandle(self._base)
            self._base = 0
            self.tensor = torch.empty(0, dtype=torch.uint8)

    def __del__(self) -> None:  # a mapping left open costs address space only; never raise from a finalizer
        try:
            self.close()
        except Exception:
            pass


def open_peer(export: IpcExport, device: int) -> PeerMapping:
    """Map ``export`` (made by another process) for kernels on ``device``: opened with ``device`` current and lazy
    peer access, viewed as a 1-D uint8 CUDA tensor of ``export.nbytes`` bytes."""
    cupy = import_cupy()
    with cupy.cuda.Device(device):
        base = int(cupy.cuda.runtime.ipcOpenMemHandle(export.handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess))
        mem = cupy.cuda.UnownedMemory(base + export.offset, export.nbytes, owner=None, device_id=device)
        arr = cupy.ndarray((export.nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        view = torch.as_tensor(arr, device=torch.device("cuda", device))
    if view.data_ptr() != base + export.offset:
        raise DeviceError("a peer mapping was copied instead of viewed")
    return PeerMapping(base, view, device)
