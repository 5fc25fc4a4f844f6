"""The data slab: one contiguous uint8 buffer per GPU holding cached rows (paper section 5).

Rows, compressed or raw, sit back to back with no per-row padding: every byte of the budget holds row data,
which is what makes a compressed cache hold ``ratio`` times more rows (paper Table 7: Cora-SU 25.9x, dense
sets ~1.11x). The decoder (``bitpack.cu``) reads any row through 16-byte aligned loads of the 16-byte blocks
that hold it, whatever the row's own alignment, so padding would only save it part of one 16-byte block per
row (device-memory traffic, not PCIe) at the price of up to 15 bytes of capacity per row; not worth it for
rows of hundreds of bytes. Dynamic policies use fixed slots of ``slot_bytes`` instead (see ``policy.py``),
still in one contiguous buffer.

A slab never allocates more than its byte budget; its ``slab_id`` (0..7) is what cache entries store. Its
allocation is a multiple of :data:`SLAB_ALIGN` bytes because the decoder reads whole 16-byte blocks: the block
holding the last row's last byte must lie inside the allocation (compute-sanitizer memcheck checks this). So
rows may use at most :func:`usable_bytes` of a budget (the budget rounded down to 16 bytes).
"""

from __future__ import annotations

import torch

from ..errors import CapacityError
from .entry import MAX_SLAB_BYTES, MAX_SLABS

__all__ = ["SLAB_ALIGN", "usable_bytes", "Slab"]

SLAB_ALIGN = 16
"""Allocation granularity of a slab (the decoder's load width)."""


def usable_bytes(budget_bytes: int) -> int:
    """Bytes of a budget that rows may occupy: the budget rounded down to :data:`SLAB_ALIGN`."""
    return max(0, budget_bytes) // SLAB_ALIGN * SLAB_ALIGN


class Slab:
    """A byte buffer of ``nbytes`` (<= the budget) on ``device``, addressed by byte offset."""

    def __init__(self, nbytes: int, budget_bytes: int, device: torch.device, slab_id: int = 0) -> None:
        if not 0 <= slab_id < MAX_SLABS:
            raise CapacityError(f"slab id must be in 0..{MAX_SLABS - 1}, got {slab_id}")
        if nbytes < 0 or nbytes > usable_bytes(budget_bytes):
            raise CapacityError(f"slab of {nbytes} bytes does not fit its budget of {budget_bytes} bytes "
                                f"(rows may use {usable_bytes(budget_bytes)} bytes of it)")
        if nbytes > MAX_SLAB_BYTES:
            raise CapacityError(f"slab of {nbytes} bytes exceeds the 40-bit entry offset (2**40 bytes)")
        self.slab_id = slab_id
        self.device = device
        self.budget_bytes = int(budget_bytes)
        alloc = -(-nbytes // SLAB_ALIGN) * SLAB_ALIGN  # <= usable_bytes(budget) <= budget
        self.data = torch.zeros(alloc, dtype=torch.uint8, device=device)
        self.row_bytes_limit = nbytes
        self.used_bytes = 0

    @property
    def nbytes(self) -> int:
        """Allocated bytes (a multiple of 16, never above ``budget_bytes``)."""
        return int(self.data.numel())

    @property
    def base_ptr(self) -> int:
        """Device address of byte 0 (0 for an empty slab; nothing reads it then)."""
        return int(self.data.data_ptr()) if self.nbytes else 0

    def pack(self, lengths: torch.Tensor) -> torch.Tensor:
        """Byte offsets (int64) of rows of ``lengths`` laid back to back from offset 0; marks them used."""
        lens = lengths.to(torch.int64)
        ends = torch.cumsum(lens, 0)
        total = int(ends[-1]) if ends.numel() else 0
        if total > self.row_bytes_limit:
            raise CapacityError(f"{lens.numel()} rows of {total} bytes do not fit a slab of {self.nbytes} bytes")
        self.used_bytes = total
        return ends - lens

    def write(self, offset: int, payload: torch.Tensor) -> None:
        """Copy the bytes of ``payload`` (uint8, any device) into the slab at ``offset``."""
        payload = payload.reshape(-1)
        end = offset + payload.numel()
        if offset < 0 or end > self.nbytes:
            raise CapacityError(f"write of bytes [{offset}, {end}) outside a slab of {self.nbytes} bytes")
        self.data[offset:end].copy_(payload, non_blocking=True)

    def slots(self, slot_bytes: int) -> torch.Tensor:
        """The slab viewed as ``[n_slots, slot_bytes]`` (dynamic policies); marks all of it used."""
        n_slots = self.row_bytes_limit // slot_bytes if slot_bytes > 0 else 0
        self.used_bytes = n_slots * slot_bytes
        return self.data[: self.used_bytes].view(n_slots, slot_bytes)
