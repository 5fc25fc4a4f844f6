"""CPU (Numba) and GPU (CuPy RawModule) backends behind one small interface used by fit and compress.

The GPU backend is imported lazily so that ``import ibpcache`` never touches CUDA.
"""

from __future__ import annotations

import numpy as np
import torch

from . import bitpack_cpu as cpu

__all__ = ["CpuBackend", "backend_for"]


class CpuBackend:
    """Numba twins; rows are uint8 [N, row_bytes] CPU tensors."""

    name = "cpu"

    # The GPU backend's interface; on the CPU every "lazy" result is simply ready.
    @staticmethod
    def bitcount_lazy(rows: torch.Tensor) -> np.ndarray:
        return cpu.bitcount_cpu(rows.numpy())

    @staticmethod
    def fit_sizes_lazy(rows: torch.Tensor, level: np.ndarray, inv: np.ndarray, pc: np.ndarray, c: int) -> np.ndarray:
        return cpu.fit_sizes_cpu(rows.numpy(), level, inv, pc, c)

    @staticmethod
    def collect(handles: "list[np.ndarray]") -> list[np.ndarray]:
        return list(handles)


def backend_for(rows: torch.Tensor) -> object:
    """The backend that runs where ``rows`` live."""
    if rows.is_cuda:
        from .bitpack import GpuBackend

        return GpuBackend
    return CpuBackend
