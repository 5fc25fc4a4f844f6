"""The GPU sampler's fused hop: the engine side of ``kernels/sampling.cu``.

``ibpcache.loaders.sampling.NeighborSampler`` (``hop_kernel=True``, its default) calls :func:`hop_positions` on a CUDA
device for each hop whose fanout is at most :data:`KMAX`: one launch draws what its torch path draws with about 100
small ops (the hash and Floyd's algorithm), the same samples bit for bit. Why it matters: a GPU sampler's host time is
its launches, and in a pipelined GNN epoch the stages' host work shares one interpreter.
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgumentError
from ..kernels import sampling as _kernels

__all__ = ["KMAX", "hop_positions"]

KMAX = _kernels.KMAX


def hop_positions(colptr: torch.Tensor, nodes: torch.Tensor, batch_keys: torch.Tensor, first: torch.Tensor,
                  k: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(CSC position, index into ``nodes``) of the in-edges hop ``k`` draws for each node, node after node
    (int64 [total] each). ``batch_keys``: each node's hop key; ``first``: where each node's edges start (an exclusive
    cumsum of ``min(deg, k)``, or of ``deg`` for ``k < 0``); ``total``: their sum."""
    tensors = {"colptr": colptr, "nodes": nodes, "batch_keys": batch_keys, "first": first}
    for name, t in tensors.items():
        if not t.is_cuda or t.device != nodes.device or t.dtype != torch.int64 or not t.is_contiguous():
            raise InvalidArgumentError(f"hop_positions: {name} must be a contiguous int64 tensor on {nodes.device}, "
                                       f"got {t.dtype} on {t.device}")
    if not -1 <= k <= KMAX:
        raise InvalidArgumentError(f"hop_positions: the kernel draws fanouts -1..{KMAX}, got {k}")
    if not batch_keys.numel() == first.numel() == nodes.numel():
        raise InvalidArgumentError("hop_positions: nodes, batch_keys and first must have one entry per node")
    return _kernels.hop_positions(colptr, nodes, batch_keys, first, k, int(total))
