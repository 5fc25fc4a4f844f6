"""Page-locked host blocks for the packed KV stores, pooled per process and pinned ahead on a background thread.

Why a pool: pinning host memory is slow and serial. ``cudaHostAlloc`` ran at ~2.7 GB/s on the H100 box (the
CPU-gather baseline filled an 18 GB store in 6.7-7.6 s with fresh pinned memory and in 0.5 s with torch's cached
blocks, docs/results/2026-11-25-h100-s21), so a prefill that pins its 11-17 GB of KV as it goes waits ~4-6 s for
the allocator, in series with the model. A store takes fixed-size blocks from here and gives them back when it is
released, so the next request (or the next method of a benchmark) pins nothing; :meth:`HostPool.prepare` pins the
blocks a prefill will need on a background thread while the GPU computes (``cudaHostAlloc`` releases the GIL).

Blocks of one size are cut from slabs (one allocation each, at most ``MAX_SLAB_BLOCKS`` blocks or ``SLAB_BYTES``);
a slab is freed by :meth:`HostPool.trim` once all its blocks are back. Nothing here waits for the device: a store
gives a block back only after the device finished with it (it synchronises first), like ``cudaFreeHost`` did
implicitly.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..errors import CapacityError, InvalidArgumentError

__all__ = ["HostPool", "host_pool", "SLAB_BYTES", "MAX_SLAB_BLOCKS"]

SLAB_BYTES = 256 << 20
"""Largest slab the pool cuts blocks from (a block larger than this gets a slab of its own)."""

MAX_SLAB_BLOCKS = 64
"""Most blocks per slab: small blocks (a short prompt's store) do not pin hundreds of megabytes."""

Alloc = Callable[[int], int]
Free = Callable[[int], None]


@dataclass
class _Slab:
    ptr: int
    nbytes: int
    block: int
    n_blocks: int
    free: int = 0  # blocks of this slab in the free lists


@dataclass
class _Size:
    """One block size: its free blocks (address, slab) and the blocks a background allocation will add."""

    free: deque = field(default_factory=deque)
    pending: int = 0  # blocks being pinned by the background thread
    slabs: int = 0
    target: int = 0  # blocks prepare() said will be taken soon (each take counts one down)


class HostPool:
    """Fixed-size page-locked blocks, reused between stores (see the module docstring).

    Args:
        alloc, free: how a slab is pinned and released (default: ``cudaHostAlloc`` / ``cudaFreeHost`` through
            :mod:`ibpcache.kernels._build`); tests pass plain-memory stand-ins.
    """

    def __init__(self, alloc: "Alloc | None" = None, free: "Free | None" = None) -> None:
        self._alloc_fn = alloc
        self._free_fn = free
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._sizes: dict[int, _Size] = {}
        self._slabs: dict[int, _Slab] = {}  # by slab address
        self._owner: dict[int, int] = {}  # block address -> slab address
        self._in_use = 0  # blocks handed out
        self._thread: "threading.Thread | None" = None
        self._work: deque = deque()  # block sizes the background thread should look at
        self._error: "BaseException | None" = None
        self.pinned_bytes = 0
        self.pin_seconds = 0.0  # spent in slab allocations, either thread
        self.background_bytes = 0  # pinned by the background thread
        self.wait_seconds = 0.0  # take() waiting for a background slab
        self.sync_allocs = 0  # slabs take() had to pin itself

    # -- allocation -------------------------------------------------------------------------------------------
    def _pin(self, nbytes: int) -> int:
        if self._alloc_fn is not None:
            return self._alloc_fn(nbytes)
        from ..kernels._build import host_alloc

        return host_alloc(nbytes)

    def _unpin(self, ptr: int) -> None:
        if self._free_fn is not None:
            self._free_fn(ptr)
            return
        from ..kernels._build import host_free

        host_free(ptr)

    @staticmethod
    def _slab_blocks(block: int, wanted: int) -> int:
        """Blocks of the next slab of this size: what is wanted, within the slab limits."""
        return max(1, min(MAX_SLAB_BLOCKS, SLAB_BYTES // block, max(1, wanted)))

    def _new_slab(self, block: int, n_blocks: int) -> _Slab:
        """Pin one slab (outside the lock: this is the slow part) and return it, not yet registered."""
        t0 = time.perf_counter()
        try:
            ptr = self._pin(block * n_blocks)
        except Exception as exc:  # noqa: BLE001 - CuPy's OutOfMemoryError / CUDARuntimeError, or a test's error
            raise CapacityError(f"could not pin {block * n_blocks} bytes of host memory for the KV store "
                                f"({type(exc).__name__}: {exc})") from exc
        dt = time.perf_counter() - t0
        with self._lock:
            self.pin_seconds += dt
        return _Slab(ptr, block * n_blocks, block, n_blocks)

    def _register(self, slab: _Slab) -> None:
        """Add a pinned slab's blocks to the free list (lock held)."""
        size = self._sizes.setdefault(slab.block, _Size())
        self._slabs[slab.ptr] = slab
        for i in range(slab.n_blocks):
            addr = slab.ptr + i * slab.block
            self._owner[addr] = slab.ptr
            size.free.append(addr)
        slab.free = slab.n_blocks
        size.slabs += 1
        self.pinned_bytes += slab.nbytes

    def take(self, block: int) -> int:
        """The address of a free block of ``block`` bytes: a pooled one, one being pinned in the background (waits
        for it), or a new slab pinned now."""
        if not isinstance(block, int) or block <= 0:
            raise InvalidArgumentError(f"block: expected a positive number of bytes, got {block!r}")
        with self._cond:
            size = self._sizes.setdefault(block, _Size())
            t0 = time.perf_counter()
            while not size.free and (size.pending or block in self._work) and self._error is None:
                self._cond.wait()  # the background thread is (about to be) pinning this size
            self.wait_seconds += time.perf_counter() - t0
            if size.free:
                return self._hand_out(size)
            held = size.slabs
            self.sync_allocs += 1
        slab = self._new_slab(block, self._slab_blocks(block, max(1, held // 2)))
        with self._cond:
            self._register(slab)
            return self._hand_out(size)

    def _hand_out(self, size: _Size) -> int:
        addr = size.free.popleft()
        size.target = max(0, size.target - 1)
        self._slabs[self._owner[addr]].free -= 1
        self._in_use += 1
        return addr

    def give(self, block: int, addr: int) -> None:
        """Return a block from :meth:`take` (the device must be done with it)."""
        with self._cond:
            slab = self._slabs.get(self._owner.get(addr, -1))
            if slab is None or slab.block != block:
                raise InvalidArgumentError(f"give: {addr:#x} is not a block of {block} bytes of this pool")
            self._sizes[block].free.append(addr)
            slab.free += 1
            self._in_use -= 1

    # -- pinning ahead ----------------------------------------------------------------------------------------
    def prepare(self, block: int, count: int) -> None:
        """About ``count`` blocks of ``block`` bytes will be taken soon (this replaces the previous estimate for the
        size): the ones the pool lacks are pinned on a background thread, never waited for here. Blocks prepared
        and not taken stay in the pool for later stores."""
        if not isinstance(block, int) or block <= 0:
            raise InvalidArgumentError(f"block: expected a positive number of bytes, got {block!r}")
        with self._cond:
            size = self._sizes.setdefault(block, _Size())
            size.target = max(0, int(count))
            if len(size.free) + size.pending >= size.target:
                return
            self._work.append(block)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._background, name="ibpcache-pin", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _background(self) -> None:
        while True:
            with self._cond:
                if not self._work:
                    self._thread = None
                    self._cond.notify_all()  # drain() waits for this
                    return
                block = self._work[0]
                size = self._sizes[block]
                missing = size.target - len(size.free) - size.pending
                if missing <= 0:
                    self._work.popleft()
                    self._cond.notify_all()
                    continue
                n = self._slab_blocks(block, missing)
                size.pending += n
            try:
                slab = self._new_slab(block, n)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits; take() then pins itself
                with self._cond:
                    size.pending -= n
                    size.target = 0
                    self._error = exc
                    self._work.clear()
                    self._thread = None
                    self._cond.notify_all()
                return
            with self._cond:
                size.pending -= n
                self._register(slab)
                self.background_bytes += slab.nbytes
                self._cond.notify_all()

    def drain(self, timeout: "float | None" = None) -> bool:
        """Wait until the background thread has pinned every block :meth:`prepare` asked for (or stopped on an
        error); False if ``timeout`` seconds passed first. For a caller that must know the pool's size is settled
        (a measurement, a test), never needed before :meth:`take`, which waits for the blocks it needs itself."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self._cond:
            while self._work or any(s.pending for s in self._sizes.values()):
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    # -- release and reporting --------------------------------------------------------------------------------
    def trim(self) -> int:
        """Free every slab whose blocks are all back in the pool; returns the bytes released."""
        with self._cond:
            for size in self._sizes.values():  # no more pinning for earlier estimates
                size.target = 0
            self._work.clear()
            while any(s.pending for s in self._sizes.values()):  # never race the background thread's slabs
                self._cond.wait()
            done = [s for s in self._slabs.values() if s.free == s.n_blocks]
            for slab in done:
                size = self._sizes[slab.block]
                size.free = deque(a for a in size.free if self._owner[a] != slab.ptr)
                size.slabs -= 1
                for i in range(slab.n_blocks):
                    del self._owner[slab.ptr + i * slab.block]
                del self._slabs[slab.ptr]
                self.pinned_bytes -= slab.nbytes
            self._error = None
        for slab in done:
            self._unpin(slab.ptr)
        return sum(s.nbytes for s in done)

    def stats(self) -> dict:
        """Pinned bytes (in use and free), slabs, and the time spent pinning / waiting for background pins."""
        with self._lock:
            free = sum(len(s.free) * b for b, s in self._sizes.items())
            return {"pinned_bytes": self.pinned_bytes, "free_bytes": free, "in_use_blocks": self._in_use,
                    "pending_blocks": sum(s.pending for s in self._sizes.values()),
                    "slabs": len(self._slabs), "pin_s": self.pin_seconds, "background_bytes": self.background_bytes,
                    "take_wait_s": self.wait_seconds, "sync_slab_allocs": self.sync_allocs}


_POOL: "HostPool | None" = None
_POOL_LOCK = threading.Lock()


def host_pool() -> HostPool:
    """The process's pool of pinned blocks (every CUDA store shares it: pinned memory is portable across devices)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = HostPool()
        return _POOL
