"""Launchers of the cache index kernels in ``hashmap.cu`` (hash insert/erase/lookup and the fetch probe).

Thin by design: grid math, cheap invariant asserts, and the launch on torch's current stream. Tensors are
passed to CuPy as raw device addresses (``numpy.uint64``) so no CuPy arrays are created per call. Nothing
compiles at import: the first launch builds the module through ``ibpcache.kernels._build``.

The status codes and index modes below mirror ``#define``s in hashmap.cu ("keep in sync"; a CPU test
checks them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from ._build import device_index

__all__ = [
    "Status",
    "IndexMode",
    "BLOCK",
    "IndexArgs",
    "HostArgs",
    "launch_insert",
    "launch_erase",
    "launch_lookup",
    "launch_probe",
]

BLOCK = 256
"""Threads per block; a multiple of 32 (the probe's warp reduction uses full masks)."""

_SOURCE = "hashmap.cu"


class Status(enum.IntEnum):
    """Status codes kernels write instead of trapping (keep in sync with IBP_STATUS_* in hashmap.cu)."""

    OK = 0
    FULL = 1
    DUPLICATE = 2
    BAD_KEY = 3
    NOT_FOUND = 4


class IndexMode(enum.IntEnum):
    """How the probe finds an id's entry (keep in sync with IBP_INDEX_* in hashmap.cu)."""

    HASH = 0
    DIRECT = 1
    NONE = 2


@dataclass(frozen=True)
class IndexArgs:
    """What the probe kernel needs to read an index: table arrays may be empty for ``NONE``."""

    mode: IndexMode
    table_keys: torch.Tensor
    table_values: torch.Tensor
    capacity: int
    max_probes: int


@dataclass(frozen=True)
class HostArgs:
    """Where misses are read: ``base`` is the device-visible address of the host store.

    ``offsets`` (int64 [N]) is None for fixed-stride layouts (row i at ``i * stride``); ``lengths``
    (int32 [N]) is None when every row is ``row_bytes`` long; ``flags`` (uint8 bitmask) is None when no
    row is compressed.
    """

    base: int
    offsets: torch.Tensor | None
    stride: int
    lengths: torch.Tensor | None
    row_bytes: int
    flags: torch.Tensor | None


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None or t.numel() == 0 else t.data_ptr())


def _grid(n: int) -> tuple[int]:
    return (max(1, min(-(-n // BLOCK), (1 << 31) - 1)),)


def _launch(symbol: str, n: int, device_id: int, args: tuple) -> None:
    """Build (once per device) and launch ``symbol`` over ``n`` items on torch's current stream."""
    from ._build import launch

    launch(_SOURCE, symbol, device_id, _grid(n), BLOCK, args)


def _check_table(table_keys: torch.Tensor, table_values: torch.Tensor) -> None:
    assert table_keys.dtype == torch.int64 and table_values.dtype == torch.int64
    assert table_keys.is_contiguous() and table_values.is_contiguous()
    cap = table_keys.numel()
    assert cap > 0 and cap & (cap - 1) == 0 and table_values.numel() == cap, "capacity must be a power of two"


def launch_insert(keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None, table_keys: torch.Tensor,
                  table_values: torch.Tensor, max_probes: int, status: torch.Tensor) -> None:
    """Insert keys -> values (rows with ``valid == 0`` skipped); status int32 [2] accumulates codes."""
    _check_table(table_keys, table_values)
    assert keys.dtype == torch.int64 and values.dtype == torch.int64 and keys.numel() == values.numel()
    assert status.dtype == torch.int32 and status.numel() >= 2
    n = keys.numel()
    if n == 0:
        return
    _launch("ibp_hashmap_insert", n, device_index(table_keys), (
        _ptr(keys), _ptr(values), _ptr(valid), np.int64(n), _ptr(table_keys), _ptr(table_values),
        np.int64(table_keys.numel()), np.int32(max_probes), _ptr(status)))


def launch_erase(keys: torch.Tensor, valid: torch.Tensor | None, table_keys: torch.Tensor,
                 table_values: torch.Tensor, max_probes: int, status: torch.Tensor) -> None:
    """Erase keys (leaving tombstones); status int32 [2] accumulates codes."""
    _check_table(table_keys, table_values)
    assert keys.dtype == torch.int64 and status.dtype == torch.int32
    n = keys.numel()
    if n == 0:
        return
    _launch("ibp_hashmap_erase", n, device_index(table_keys), (
        _ptr(keys), _ptr(valid), np.int64(n), _ptr(table_keys), _ptr(table_values),
        np.int64(table_keys.numel()), np.int32(max_probes), _ptr(status)))


def launch_lookup(ids: torch.Tensor, index: IndexArgs, entries_out: torch.Tensor) -> None:
    """``entries_out[i]`` = entry of ``ids[i]`` (EMPTY_ENTRY when absent)."""
    assert ids.dtype == torch.int64 and entries_out.dtype == torch.int64 and entries_out.numel() >= ids.numel()
    n = ids.numel()
    if n == 0:
        return
    _launch("ibp_hashmap_lookup", n, device_index(ids), (
        _ptr(ids), np.int64(n), np.int32(int(index.mode)), _ptr(index.table_keys), _ptr(index.table_values),
        np.int64(index.capacity), np.int32(index.max_probes), _ptr(entries_out)))


def launch_probe(ids: torch.Tensor, n_rows: int, index: IndexArgs, slab_bases: torch.Tensor, host: HostArgs,
                 src_ptrs: torch.Tensor, lengths: torch.Tensor, compressed: torch.Tensor,
                 entries_out: torch.Tensor | None, counters: torch.Tensor, status: torch.Tensor) -> None:
    """Write decode descriptors (src_ptrs, lengths, compressed) for ``ids``; see ibp_cache_probe."""
    n = ids.numel()
    assert ids.dtype == torch.int64 and ids.is_contiguous()
    assert src_ptrs.dtype == torch.int64 and lengths.dtype == torch.int32 and compressed.dtype == torch.uint8
    assert src_ptrs.numel() >= n and lengths.numel() >= n and compressed.numel() >= n
    assert slab_bases.dtype == torch.int64 and slab_bases.numel() == 8
    assert counters.dtype == torch.int64 and counters.numel() >= 4 and status.dtype == torch.int32
    if n == 0:
        return
    _launch("ibp_cache_probe", n, device_index(ids), (
        _ptr(ids), np.int64(n), np.int64(n_rows), np.int32(int(index.mode)), _ptr(index.table_keys),
        _ptr(index.table_values), np.int64(index.capacity), np.int32(index.max_probes), _ptr(slab_bases),
        np.int64(host.base), _ptr(host.offsets), np.int64(host.stride), _ptr(host.lengths),
        np.int32(host.row_bytes), _ptr(host.flags), _ptr(src_ptrs), _ptr(lengths), _ptr(compressed),
        _ptr(entries_out), _ptr(counters), _ptr(status)))
