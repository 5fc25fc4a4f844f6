"""Launcher of ``sampling.cu``: one sampling hop's neighbour draws in one kernel (``ibp_smp_hop``).

The hash constants are ``ibpcache.loaders.sampling``'s (its torch path is the reference; the kernel mirrors it,
"keep in sync"): :data:`HASH_CONSTANTS` names them for the CPU test that checks the source.
"""

from __future__ import annotations

import numpy as np
import torch

from ._build import device_index, launch

__all__ = ["KMAX", "HASH_CONSTANTS", "hop_positions"]

_SRC = "sampling.cu"
_BLOCK = 256

KMAX = 64
"""The largest fanout the kernel draws (IBP_SMP_KMAX: a thread keeps its node's k draws in local memory)."""

HASH_CONSTANTS = {"IBP_SMP_GOLDEN": 0x9E3779B9, "IBP_SMP_FMIX1": 0x85EBCA6B, "IBP_SMP_FMIX2": 0xC2B2AE35}
"""The kernel's hash constants, which must equal the torch path's (``_GOLDEN``, ``_FMIX1``, ``_FMIX2``)."""


def hop_positions(colptr: torch.Tensor, nodes: torch.Tensor, batch_keys: torch.Tensor, first: torch.Tensor,
                  k: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(CSC position, node index) of each drawn in-edge, node after node: int64 [total] each, on ``nodes``' device.

    ``colptr`` int64 [N + 1], ``nodes`` int64 [n] ids in [0, N), ``batch_keys`` int64 [n] in [0, 2**32), ``first``
    int64 [n] (where node i's edges start), ``k`` <= :data:`KMAX`, ``total`` = the edges drawn (the caller sized
    them). All CUDA int64 contiguous tensors of one device; the caller checks (the sampler's hot path)."""
    dev = nodes.device
    pos = torch.empty(total, dtype=torch.int64, device=dev)
    seg = torch.empty(total, dtype=torch.int64, device=dev)
    n = int(nodes.numel())
    if n and total:
        launch(_SRC, "ibp_smp_hop", device_index(nodes), (n + _BLOCK - 1) // _BLOCK, _BLOCK,
               (_ptr(colptr), _ptr(nodes), _ptr(batch_keys), _ptr(first), np.int64(n), np.int32(k), _ptr(pos),
                _ptr(seg)))
    return pos, seg


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())
