"""The cache index: row id (int64) -> packed entry (int64, see ``entry.py``), on GPU or CPU.

Two implementations behind one interface (``build``, ``lookup``, ``insert``, ``erase``, ``kernel_args``):

* :class:`HashIndex` - open addressing with linear probing, capacity = next power of two >= n / 0.5
  (load factor 0.5), probe sequences bounded by ``max_probes``. Built and probed by the CUDA kernels of
  ``kernels/hashmap.cu`` on CUDA and by their Numba twins on CPU. A build that cannot place a key within
  ``max_probes`` raises :class:`CapacityError`.
* :class:`DirectIndex` - a dense int64 array of entries indexed by id (one load per lookup, no probing).

Which one :func:`make_index` picks (``kind="auto"``): the smaller of the two in bytes, i.e. direct when
``8 * n_rows <= 16 * hash_capacity(max_entries)``. A cache that holds a sizeable share of the rows (e.g. a
compressed cache of Cora at 1% budget holds ~25% of them) is then direct-indexed, which costs no more memory
than the hash table and saves the probes; a cache of a few rows of a huge table gets a hash table.
:class:`NoIndex` serves a cache of capacity zero (everything is a miss).
"""

from __future__ import annotations

import abc
import math
from typing import Any

import numpy as np
import torch

from ..errors import CapacityError, InternalError, InvalidArgumentError, InvalidIdsError
from ..kernels.hashmap import IndexArgs, IndexMode, Status
from .entry import EMPTY_ENTRY, EMPTY_KEY

__all__ = [
    "LOAD_FACTOR",
    "DEFAULT_MAX_PROBES",
    "hash_capacity",
    "CacheIndex",
    "HashIndex",
    "DirectIndex",
    "NoIndex",
    "make_index",
]

LOAD_FACTOR = 0.5
DEFAULT_MAX_PROBES = 128
"""Probe bound; at load factor 0.5 linear probing needs ~1.5 probes on average and far fewer than this."""

_REBUILD_FILL = 0.75
"""A dynamic hash index is rebuilt when live keys plus tombstones may exceed this share of its buckets."""


def hash_capacity(max_entries: int, load_factor: float = LOAD_FACTOR) -> int:
    """Buckets for ``max_entries`` keys: the next power of two >= max_entries / load_factor (at least 2)."""
    need = max(2, math.ceil(max_entries / load_factor))
    return 1 << (need - 1).bit_length()


class CacheIndex(abc.ABC):
    """Maps row ids to packed entries; ``EMPTY_ENTRY`` means "not cached"."""

    mode: IndexMode

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @abc.abstractmethod
    def build(self, ids: torch.Tensor, entries: torch.Tensor) -> None:
        """Forget every key, then map ``ids[i] -> entries[i]`` (ids unique, >= 0)."""

    @abc.abstractmethod
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 entries of ``ids`` (``EMPTY_ENTRY`` where absent)."""

    @abc.abstractmethod
    def insert(self, ids: torch.Tensor, entries: torch.Tensor) -> None:
        """Add keys that are not present (the dynamic policies' admissions)."""

    @abc.abstractmethod
    def erase(self, ids: torch.Tensor) -> None:
        """Remove keys that are present (the dynamic policies' evictions)."""

    @abc.abstractmethod
    def kernel_args(self) -> IndexArgs:
        """What the fetch probe kernel needs to read this index."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Device bytes of the index arrays."""

    @property
    def wants_rebuild(self) -> bool:
        """True when the caller should :meth:`build` again from its resident set (hash tombstones)."""
        return False

    def status(self) -> dict[str, Any]:
        """Kind and size of the index (for stats and tests)."""
        return {"kind": self.mode.name.lower(), "nbytes": self.nbytes}


class NoIndex(CacheIndex):
    """Index of a cache with no capacity: every lookup misses."""

    mode = IndexMode.NONE

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._empty = torch.empty(0, dtype=torch.int64, device=device)

    def build(self, ids: torch.Tensor, entries: torch.Tensor) -> None:
        if ids.numel():
            raise CapacityError(f"cannot index {ids.numel()} rows in a cache of capacity zero")

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.full(ids.shape, EMPTY_ENTRY, dtype=torch.int64, device=self.device)

    def insert(self, ids: torch.Tensor, entries: torch.Tensor) -> None:
        self.build(ids, entries)

    def erase(self, ids: torch.Tensor) -> None:
        return None

    def kernel_args(self) -> IndexArgs:
        return IndexArgs(IndexMode.NONE, self._empty, self._empty, 0, 0)

    @property
    def nbytes(self) -> int:
        return 0


class DirectIndex(CacheIndex):
    """Dense ``entries[id]`` array over all ``n_rows`` ids: one load per lookup, updates are scatters."""

    mode = IndexMode.DIRECT

    def __init__(self, n_rows: int, device: torch.device) -> None:
        super().__init__(device)
        self.n_rows = n_rows
        self.values = torch.full((n_rows,), EMPTY_ENTRY, dtype=torch.int64, device=device)
        self._empty = torch.empty(0, dtype=torch.int64, device=device)

    def build(self, ids: torch.Tensor, entries: torch.Tensor) -> None:
        self.values.fill_(EMPTY_ENTRY)
        self.insert(ids, entries)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.values[ids.to(self.device)]

    def insert(self, ids: torch.Tensor, entries: torch.Tensor) -> None:
        self.values[ids.to(self.device)] = entries.to(self.device)

    def erase(self, ids: torch.Tensor) -> None:
        self.values[ids.to(self.device)] = EMPTY_ENTRY

    def kernel_args(self) -> IndexArgs:
        return IndexArgs(IndexMode.DIRECT, self._empty, self.values, self.n_rows, 0)

    @property
    def nbytes(self) -> int:
        return self.values.numel() * 8


class HashIndex(CacheIndex):
    """Open-addressing hash table with ``capacity`` buckets for up to ``max_entries`` live keys."""

    mode = IndexMode.HASH

    def __init__(self, max_entries: int, device: torch.device, max_probes: int = DEFAULT_MAX_PROBES) -> None:
        super().__init__(device)
        if max_probes < 1:
            raise InvalidArgumentError(f"max_probes must be >= 1, got {max_probes}")
        self.max_entries = max_entries
        self.capacity = hash_capacity(max_entries)
        self.max_probes = max_probes
        self.keys = torch.full((self.capacity,), EMPTY_KEY, dtype=torch.int64, device=device)
        self.values = torch.full((self.capacity,), EMPTY_ENTRY, dtype=torch.int64, device=device)
        self._status = torch.zeros(2, dtype=torch.int32, device=device)
        self._live = 0
        self._used_bound = 0  # live keys + tombstones, an upper bound (inserts may reuse tombstones)
        self.longest_probe = 0

    # -- kernels or twins ------------------------------------------------------------------------

    def _run_insert(self, ids: torch.Tensor, entries: torch.Tensor) -> None:
        if self.device.type == "cuda":
            from ..kernels.hashmap import launch_insert

            launch_insert(ids, entries, None, self.keys, self.values, self.max_probes, self._status)
        else:
            from ..kernels.hashmap_cpu import hashmap_insert_cpu

            hashmap_insert_cpu(ids.numpy(), entries.numpy(), _NO_VALID, self.keys.numpy(), self.values.numpy(),
                               self.max_probes, self._status.numpy())

    def _run_erase(self, ids: torch.Tensor) -> None:
        if self.device.type == "cuda":
            from ..kernels.hashmap import launch_erase

            launch_erase(ids, None, self.keys, self.values, self.max_probes, self._status)
        else:
            from ..kernels.hashmap_cpu import hashmap_erase_cpu

            hashmap_erase_cpu(ids.numpy(), _NO_VALID, self.keys.numpy(), self.values.numpy(), self.max_probes,
                              self._status.numpy())

    def _take_status(self) -> tuple[int, int]:
        code, longest = (int(v) for v in self._status.tolist())  # syncs: only on build/update, never fetch
        self._status.zero_()
        self.longest_probe = max(self.longest_probe, longest)
        return code, longest

    # -- interface -------------------------------------------------------------------------------

    def build(self, ids: torch.Tensor, entries: torch.Tensor) -> None:
        ids, entries = _as_i64(ids, self.device), _as_i64(entries, self.device)
        if ids.numel() > self.max_entries:
            raise CapacityError(f"hash index sized for {self.max_entries} rows cannot hold {ids.numel()}")
        self.keys.fill_(EMPTY_KEY)
        self.values.fill_(EMPTY_ENTRY)
        self._status.zero_()
        self.longest_probe = 0
        self._run_insert(ids, entries)
        code, _ = self._take_status()
        self._raise_for(code, "build")
        self._live = self._used_bound = ids.numel()

    def insert(self, ids: torch.Tensor, entries: torch.Tensor) -> None:
        """Insert absent keys; a key that finds no bucket within ``max_probes`` is left out and the index
        asks for a rebuild (a missing key only turns a would-be hit into a correct miss)."""
        ids, entries = _as_i64(ids, self.device), _as_i64(entries, self.device)
        self._run_insert(ids, entries)
        code, _ = self._take_status()
        if code == Status.FULL:
            self._used_bound = self.capacity  # forces wants_rebuild
        else:
            self._raise_for(code, "insert")
        self._live += ids.numel()
        self._used_bound += ids.numel()

    def erase(self, ids: torch.Tensor) -> None:
        ids = _as_i64(ids, self.device)
        self._run_erase(ids)
        code, _ = self._take_status()
        if code not in (Status.OK, Status.NOT_FOUND):  # NOT_FOUND: a key an earlier FULL insert left out
            self._raise_for(code, "erase")
        self._live = max(0, self._live - ids.numel())

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        ids = _as_i64(ids, self.device)
        out = torch.empty_like(ids)
        if self.device.type == "cuda":
            from ..kernels.hashmap import launch_lookup

            launch_lookup(ids, self.kernel_args(), out)
        else:
            from ..kernels.hashmap_cpu import hashmap_lookup_cpu

            hashmap_lookup_cpu(ids.numpy(), int(IndexMode.HASH), self.keys.numpy(), self.values.numpy(),
                               self.max_probes, out.numpy())
        return out

    def kernel_args(self) -> IndexArgs:
        return IndexArgs(IndexMode.HASH, self.keys, self.values, self.capacity, self.max_probes)

    @property
    def nbytes(self) -> int:
        return self.capacity * 16

    @property
    def wants_rebuild(self) -> bool:
        return self._used_bound > _REBUILD_FILL * self.capacity

    def status(self) -> dict[str, Any]:
        return {**super().status(), "capacity": self.capacity, "max_probes": self.max_probes,
                "longest_probe": self.longest_probe, "live": self._live}

    def _raise_for(self, code: int, what: str) -> None:
        if code == Status.OK:
            return
        if code == Status.FULL:
            raise CapacityError(
                f"hash index {what}: a key found no free bucket within max_probes={self.max_probes} "
                f"(capacity {self.capacity}); raise max_probes or use index='direct'")
        if code == Status.DUPLICATE:
            raise InvalidArgumentError(f"hash index {what}: duplicate row ids (each cached id must be unique)")
        if code == Status.BAD_KEY:
            raise InvalidIdsError(f"hash index {what}: negative row id")
        raise InternalError(f"hash index {what}: kernel status {code}")


_NO_VALID = np.zeros(0, dtype=np.uint8)


def _as_i64(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=torch.int64).contiguous()


def make_index(n_rows: int, max_entries: int, device: torch.device, kind: str = "auto",
               max_probes: int = DEFAULT_MAX_PROBES) -> CacheIndex:
    """Choose and allocate the index of a cache holding at most ``max_entries`` of ``n_rows`` rows.

    ``kind``: ``"auto"`` (the smaller in bytes: direct when ``8 * n_rows <= 16 * hash_capacity``),
    ``"hash"`` or ``"direct"``. A cache of capacity zero always gets a :class:`NoIndex`.
    """
    if kind not in ("auto", "hash", "direct"):
        raise InvalidArgumentError(f"index kind must be 'auto', 'hash' or 'direct', got {kind!r}")
    if max_entries <= 0:
        return NoIndex(device)
    if kind == "auto":
        kind = "direct" if 8 * n_rows <= 16 * hash_capacity(max_entries) else "hash"
    if kind == "direct":
        return DirectIndex(n_rows, device)
    return HashIndex(max_entries, device, max_probes)
