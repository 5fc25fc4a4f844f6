"""The pinned block pool of the packed KV stores (ibpcache/cache/host_pool.py), with plain memory standing in for
page-locked slabs: the bookkeeping (reuse, background pinning ahead, waiting for it, trimming) is what is tested;
the GPU tests of the stores (tests/cache/test_append_store.py) run it on real pinned memory."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest


class _Memory:
    """Slab allocator stand-in: numpy buffers kept alive by address; an optional delay and failure switch."""

    def __init__(self, delay: float = 0.0) -> None:
        self.live: dict[int, np.ndarray] = {}
        self.delay = delay
        self.fail = False
        self.calls: list[tuple[str, int]] = []
        self.threads: set[str] = set()

    def alloc(self, n: int) -> int:
        self.threads.add(threading.current_thread().name)
        if self.fail:
            raise MemoryError("no memory")
        time.sleep(self.delay)
        buf = np.zeros(n, dtype=np.uint8)
        self.live[buf.ctypes.data] = buf
        self.calls.append(("alloc", n))
        return buf.ctypes.data

    def free(self, ptr: int) -> None:
        self.calls.append(("free", self.live.pop(ptr).size))


def _pool(mem: _Memory):
    from ibpcache.cache.host_pool import HostPool

    return HostPool(alloc=mem.alloc, free=mem.free)


def test_blocks_are_reused_and_slabs_grow_geometrically() -> None:
    mem = _Memory()
    pool = _pool(mem)
    a = pool.take(1000)
    b = pool.take(1000)  # a second slab (the first held one block)
    assert a != b and [n for op, n in mem.calls] == [1000, 1000]
    pool.give(1000, a)
    assert pool.take(1000) == a  # reused: no new pinning
    blocks = [pool.take(1000) for _ in range(6)]
    assert len(set(blocks) | {a, b}) == 8
    st = pool.stats()
    assert st["in_use_blocks"] == 8 and st["pinned_bytes"] == sum(n for op, n in mem.calls if op == "alloc")
    assert st["sync_slab_allocs"] == len(mem.calls) < 8  # later slabs held several blocks
    other = pool.take(64)  # another size: its own slabs
    assert other not in blocks


def test_prepare_pins_ahead_on_a_background_thread_and_take_waits_for_it() -> None:
    mem = _Memory(delay=0.05)
    pool = _pool(mem)
    pool.prepare(4096, 100)
    t0 = time.perf_counter()
    got = [pool.take(4096) for _ in range(100)]  # waits for the background slabs instead of pinning its own
    assert len(set(got)) == 100
    st = pool.stats()
    assert st["sync_slab_allocs"] == 0 and st["background_bytes"] == st["pinned_bytes"] >= 100 * 4096
    assert "ibpcache-pin" in mem.threads and threading.current_thread().name not in mem.threads
    assert st["pinned_bytes"] <= 128 * 4096  # slabs of at most MAX_SLAB_BLOCKS: not much more than asked
    assert time.perf_counter() - t0 < 5
    for p in got:
        pool.give(4096, p)
    n_calls = len(mem.calls)
    pool.prepare(4096, 3)  # enough is free: nothing more is pinned (asked before the gives, the background thread
    pool.prepare(4096, 50)  # could pin 3 blocks or not, depending on whether it ran before them)
    time.sleep(0.2)
    assert len(mem.calls) == n_calls


def test_trim_frees_whole_free_slabs_only() -> None:
    mem = _Memory()
    pool = _pool(mem)
    held = [pool.take(512) for _ in range(5)]
    for p in held[:-1]:
        pool.give(512, p)
    released = pool.trim()
    assert pool.stats()["in_use_blocks"] == 1
    assert released == sum(n for op, n in mem.calls if op == "free") > 0
    assert pool.stats()["pinned_bytes"] == sum(buf.size for buf in mem.live.values())
    pool.give(512, held[-1])
    pool.trim()
    assert pool.stats()["pinned_bytes"] == 0 and not mem.live
    assert pool.take(512)  # the pool still works after trimming everything


def test_bad_use_and_failed_pinning_raise_ibpcache_errors() -> None:
    from ibpcache.errors import CapacityError, InvalidArgumentError

    mem = _Memory()
    pool = _pool(mem)
    with pytest.raises(InvalidArgumentError, match="block"):
        pool.take(0)
    with pytest.raises(InvalidArgumentError, match="not a block"):
        pool.give(100, 12345)
    a = pool.take(100)
    with pytest.raises(InvalidArgumentError, match="not a block"):
        pool.give(200, a)  # a block of another size
    mem.fail = True
    with pytest.raises(CapacityError, match="could not pin"):
        pool.take(300)
    pool.prepare(300, 10)  # the background pin fails too: take then tries (and reports) itself
    with pytest.raises(CapacityError, match="could not pin"):
        pool.take(300)
    mem.fail = False
    assert pool.take(300)
