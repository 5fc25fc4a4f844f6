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


def test_drain_waits_until_every_prepared_block_is_pinned() -> None:
    mem = _Memory(delay=0.05)
    pool = _pool(mem)
    assert pool.drain(timeout=0)  # nothing asked: settled at once
    pool.prepare(4096, 100)
    pool.prepare(8192, 40)
    assert not pool.drain(timeout=0.01)  # slabs of 0.05 s each still to come
    assert pool.drain(timeout=10)
    st = pool.stats()
    assert st["pending_blocks"] == 0 and st["free_bytes"] >= 100 * 4096 + 40 * 8192
    assert st["background_bytes"] == st["pinned_bytes"]
    n_calls = len(mem.calls)
    time.sleep(0.2)
    assert len(mem.calls) == n_calls  # nothing was left to pin after drain returned


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


def test_pin_ahead_asks_the_pool_for_a_prompts_blocks_and_a_prefill_finds_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kv_manager.pin_ahead`` asks the process's pool for what the layers' stores will take (one chunk + margin per
    block, raw / 1.25 per layer compressed, raw uncompressed, plus one chunk a layer), pinned in the background; the
    blocks are then taken without a synchronous pin. Without CUDA it asks for nothing; bad arguments are refused."""
    import torch

    from ibpcache.cache import kv_manager
    from ibpcache.cache.append_store import chunk_margin
    from ibpcache.errors import InvalidArgumentError, InvalidTypeError

    mem = _Memory()
    pool = _pool(mem)
    monkeypatch.setattr(kv_manager, "host_pool", lambda: pool)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # the Llama-8B shape: 32 layers, 8 KV heads of 128 bf16 values; 4 sequences of 32k tokens
    block, count = kv_manager.host_blocks_for(32, 4 * 8, 256, 2 * 32768 * 4 * 8 * 256, True)
    raw = 2 * 32768 * 4 * 8 * 256  # K + V bytes of one layer: 512 MiB
    assert block == (4 << 20) + chunk_margin(256)  # the largest chunk: prompts this size fill many
    assert count == 32 * (-(-int(raw / 1.25) // (4 << 20)) + 1)
    assert kv_manager.host_blocks_for(32, 32, 256, raw, False)[1] == 32 * (raw // (4 << 20) + 1)
    small = 2 * 100 * 2 * 3 * 128  # a short prompt's stores get smaller chunks
    assert kv_manager.host_blocks_for(2, 6, 128, small, True)[0] < 4 << 20
    got = kv_manager.pin_ahead(2, 3, 64, torch.bfloat16, batch_size=2, tokens=300)
    b, n = kv_manager.host_blocks_for(2, 6, 128, 2 * 300 * 6 * 128, True)
    assert got == b * n
    deadline = time.perf_counter() + 5
    while pool.stats()["free_bytes"] < b * n and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert pool.stats()["free_bytes"] >= b * n and "ibpcache-pin" in mem.threads
    taken = [pool.take(b) for _ in range(n)]
    assert len(set(taken)) == n and pool.stats()["sync_slab_allocs"] == 0
    for bad in (dict(tokens=0), dict(batch_size=-1), dict(tokens=2.5), dict(batch_size=True)):
        with pytest.raises(InvalidArgumentError):
            kv_manager.pin_ahead(2, 3, 64, torch.bfloat16, **{"batch_size": 2, "tokens": 300, **bad})
    with pytest.raises(InvalidTypeError):
        kv_manager.pin_ahead(2, 3, 64, torch.int8, batch_size=2, tokens=300)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = len(mem.calls)
    assert kv_manager.pin_ahead(2, 3, 64, torch.bfloat16, batch_size=2, tokens=300) == 0 and len(mem.calls) == calls
