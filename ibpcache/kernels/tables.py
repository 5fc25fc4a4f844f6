"""Plain codec tables handed to the kernels, so that kernels never import the codec (arrows: kernels <- codec)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KernelTables"]


@dataclass(frozen=True)
class KernelTables:
    """What a decode/encode launch needs of a codec, on the launch device.

    ``mask``/``bitval``: int64 ``[n_chunks]`` holding the uint64 bit patterns of each chunk position.
    """

    mask: torch.Tensor
    bitval: torch.Tensor
    chunk_bytes: int
    n_chunks: int
    row_bytes: int
