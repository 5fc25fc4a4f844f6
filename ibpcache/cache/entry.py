"""The 64-bit hashmap value of the cache: the ONE place that defines its bit layout.

The paper (section 5) replaces the cache hashmap's 64-bit pointer by a packed value that says where a
cached row lives and whether it is compressed::

    bits  0..39  byte offset of the row in its slab    (40 bits: 1 TB per slab)
    bits 40..42  slab id                                (3 bits: up to 8 GPUs, one slab each)
    bit  43      compressed flag                        (1 = decode, 0 = copy verbatim)
    bits 44..63  stored length of the row in bytes      (the paper's 20 "spare" bits; rows < 1 MiB)

Storing the length in the spare bits lets the probe kernel write a complete decode descriptor from the
one 8-byte load it already does, with no second lookup. ``EMPTY_ENTRY`` (all ones, i.e. -1 as int64) marks
"not cached"; it can never be a valid entry because :func:`pack_entry` requires ``offset + length <= 2**40``
and all-ones would put a 1 MiB row at the last byte of the slab address space.

``ibpcache/kernels/hashmap.cu`` mirrors these constants ("keep in sync"); a CPU test parses the .cu text
and checks that both agree.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import CapacityError, InvalidArgumentError
from ..kernels.layout import (  # the kernels' copy is the definition: kernels may not import the cache
    COMPRESSED_SHIFT,
    EMPTY_ENTRY,
    EMPTY_KEY,
    LENGTH_BITS,
    LENGTH_SHIFT,
    OFFSET_BITS,
    OFFSET_SHIFT,
    SLAB_BITS,
    SLAB_SHIFT,
    TOMBSTONE_KEY,
)

__all__ = [
    "OFFSET_SHIFT",
    "OFFSET_BITS",
    "OFFSET_MASK",
    "MAX_SLAB_BYTES",
    "SLAB_SHIFT",
    "SLAB_BITS",
    "SLAB_MASK",
    "MAX_SLABS",
    "COMPRESSED_SHIFT",
    "LENGTH_SHIFT",
    "LENGTH_BITS",
    "LENGTH_MASK",
    "MAX_ROW_LENGTH",
    "EMPTY_ENTRY",
    "EMPTY_KEY",
    "TOMBSTONE_KEY",
    "EntryFields",
    "pack_entry",
    "unpack_entry",
    "pack_entries",
    "entry_offsets",
    "entry_slab_ids",
    "entry_compressed",
    "entry_lengths",
    "check_row_length",
]

OFFSET_MASK = (1 << OFFSET_BITS) - 1
MAX_SLAB_BYTES = 1 << OFFSET_BITS
"""A slab may hold at most 2**40 bytes (1 TB): every row must end at or before this byte."""

SLAB_MASK = (1 << SLAB_BITS) - 1
MAX_SLABS = 1 << SLAB_BITS

LENGTH_MASK = (1 << LENGTH_BITS) - 1
MAX_ROW_LENGTH = LENGTH_MASK
"""Largest stored row the entry can describe: 2**20 - 1 bytes."""

_U64 = 1 << 64
_I64_MIN = -(1 << 63)


class EntryFields(NamedTuple):
    """The four fields of one packed entry."""

    offset: int
    slab_id: int
    compressed: bool
    length: int


def check_row_length(length: int) -> None:
    """Raise CapacityError when a row of ``length`` stored bytes cannot be described by an entry."""
    if length > MAX_ROW_LENGTH:
        raise CapacityError(
            f"rows of {length} bytes exceed the cache entry's 20-bit length field "
            f"(at most {MAX_ROW_LENGTH} = 2**20 - 1 bytes per row)"
        )
    if length < 1:
        raise CapacityError(f"row length must be >= 1 byte, got {length}")


def _check_fields(offset: int, slab_id: int, length: int) -> None:
    check_row_length(length)
    if not 0 <= slab_id < MAX_SLABS:
        raise CapacityError(f"slab id {slab_id} out of range: the entry has {SLAB_BITS} bits (0..{MAX_SLABS - 1})")
    if offset < 0 or offset + length > MAX_SLAB_BYTES:
        raise CapacityError(
            f"row at byte offset {offset} with {length} bytes does not fit the 40-bit slab offset "
            f"(a slab holds at most 2**40 bytes)"
        )


def pack_entry(offset: int, slab_id: int, compressed: bool, length: int) -> int:
    """Pack one entry into a Python int in int64 range (negative when the top bit is set)."""
    _check_fields(offset, slab_id, length)
    value = (offset << OFFSET_SHIFT) | (slab_id << SLAB_SHIFT) | (int(bool(compressed)) << COMPRESSED_SHIFT)
    value |= length << LENGTH_SHIFT
    return value - _U64 if value >= 1 << 63 else value


def unpack_entry(entry: int) -> EntryFields:
    """Inverse of :func:`pack_entry`; accepts the signed (int64) or unsigned form."""
    if entry == EMPTY_ENTRY:
        raise InvalidArgumentError("cannot unpack EMPTY_ENTRY: it marks a row that is not cached")
    if not _I64_MIN <= entry < _U64:
        raise InvalidArgumentError(f"entry {entry} is not a 64-bit value")
    value = entry % _U64
    return EntryFields(
        offset=(value >> OFFSET_SHIFT) & OFFSET_MASK,
        slab_id=(value >> SLAB_SHIFT) & SLAB_MASK,
        compressed=bool((value >> COMPRESSED_SHIFT) & 1),
        length=(value >> LENGTH_SHIFT) & LENGTH_MASK,
    )


def _check_tensor_fields(offsets: torch.Tensor, lengths: torch.Tensor, slab_id: "int | torch.Tensor") -> None:
    """Range-check whole tensors with one reduction each (entry building is not on the fetch hot path)."""
    if offsets.numel() == 0:
        return
    lo_len, hi_len = (int(v) for v in torch.aminmax(lengths.to(torch.int64)))
    if hi_len > MAX_ROW_LENGTH:
        check_row_length(hi_len)
    if lo_len < 1:
        check_row_length(lo_len)
    lo_off = int(offsets.min())
    hi_end = int((offsets + lengths.to(torch.int64)).max())
    if lo_off < 0 or hi_end > MAX_SLAB_BYTES:
        raise CapacityError(f"row byte ranges [{lo_off}, {hi_end}) do not fit the 40-bit slab offset (2**40 bytes)")
    ids = slab_id if isinstance(slab_id, torch.Tensor) else torch.tensor([slab_id])
    lo_s, hi_s = (int(v) for v in torch.aminmax(ids.to(torch.int64).reshape(-1)))
    if lo_s < 0 or hi_s >= MAX_SLABS:
        raise CapacityError(f"slab ids [{lo_s}, {hi_s}] out of range 0..{MAX_SLABS - 1}")


def pack_entries(
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    compressed: torch.Tensor,
    slab_id: "int | torch.Tensor" = 0,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Pack int64 tensors of fields into int64 entries (same device as ``offsets``).

    The length field is shifted into bits 44..63 with exact signed arithmetic (a length >= 2**19 lands in
    the sign bit) instead of relying on wrap-around of a signed left shift.
    """
    if check:
        _check_tensor_fields(offsets, lengths, slab_id)
    off = offsets.to(torch.int64)
    length = lengths.to(torch.int64)
    slab = slab_id.to(torch.int64) if isinstance(slab_id, torch.Tensor) else torch.full_like(off, int(slab_id))
    flag = compressed.to(torch.int64)
    signed_len = torch.where(length >= (1 << (LENGTH_BITS - 1)), length - (1 << LENGTH_BITS), length)
    return off + slab * (1 << SLAB_SHIFT) + flag * (1 << COMPRESSED_SHIFT) + signed_len * (1 << LENGTH_SHIFT)


def entry_offsets(entries: torch.Tensor) -> torch.Tensor:
    """Byte offsets (int64) of packed entries in their slabs."""
    return entries & OFFSET_MASK


def entry_slab_ids(entries: torch.Tensor) -> torch.Tensor:
    """Slab ids (int64) of packed entries."""
    return (entries >> SLAB_SHIFT) & SLAB_MASK


def entry_compressed(entries: torch.Tensor) -> torch.Tensor:
    """Compressed flags (uint8 0/1) of packed entries."""
    return ((entries >> COMPRESSED_SHIFT) & 1).to(torch.uint8)


def entry_lengths(entries: torch.Tensor) -> torch.Tensor:
    """Stored lengths (int32) of packed entries; arithmetic shift then mask recovers the top 20 bits."""
    return ((entries >> LENGTH_SHIFT) & LENGTH_MASK).to(torch.int32)
