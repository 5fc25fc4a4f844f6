"""The codec tables a kernel launch needs, as plain tensors and ints.

Launchers take a :class:`KernelTables` instead of a ``Codec`` so that ``ibpcache.kernels`` never imports the
codec layer (the arrows run kernels <- codec <- cache <- loaders). ``Codec.kernel_tables(device)`` builds one
per device and caches it, so a launch pays no upload.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError

__all__ = ["KernelTables"]


@dataclass(frozen=True)
class KernelTables:
    """mask/bitval on the launch device plus the row geometry the kernels are specialised on.

    ``mask`` and ``bitval`` are int64 ``[n_chunks]`` tensors holding the codec's uint64 bit patterns (only the
    low ``chunk_bytes * 8`` bits of each are used); ``chunk_bytes`` picks the kernel instantiation.
    """

    mask: torch.Tensor
    bitval: torch.Tensor
    chunk_bytes: int
    n_chunks: int
    row_bytes: int
    raw: bool = False
    """Every row is stored verbatim (no invariant bit to drop: ``RawCodec``): plain row fetches then take the ROWS
    kernel that keeps several rows per warp in flight (``ibp_lookup_rows_single_c*``)."""

    def __post_init__(self) -> None:
        for name in ("mask", "bitval"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.shape != (self.n_chunks,) or not t.is_contiguous():
                raise InvalidArgumentError(f"KernelTables.{name}: expected a contiguous int64 tensor of shape "
                                           f"({self.n_chunks},), got {t.dtype} {tuple(t.shape)}")
        if self.mask.device != self.bitval.device:
            raise InvalidArgumentError(f"KernelTables: mask on {self.mask.device} but bitval on {self.bitval.device}")
        if self.chunk_bytes not in (1, 2, 4, 8):
            raise InvalidArgumentError(f"KernelTables.chunk_bytes: expected 1, 2, 4 or 8, got {self.chunk_bytes}")
        if self.n_chunks * self.chunk_bytes < self.row_bytes or self.row_bytes < 1:
            raise InvalidArgumentError(f"KernelTables: {self.n_chunks} chunks of {self.chunk_bytes} B cannot hold "
                                       f"{self.row_bytes}-byte rows")

    @property
    def device(self) -> torch.device:
        return self.mask.device
