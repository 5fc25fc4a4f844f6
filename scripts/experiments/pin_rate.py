"""Experiment: how fast can this machine page-lock host memory, and does it scale with threads?

Why: the KV store's pinned pool (``ibpcache/cache/host_pool.py``) pins its blocks on ONE background thread with
``cudaHostAlloc``; the first prefill of a process waits for it (bench_llm's first round: 5.9-8.9 s of pinning for
11-17 GB, docs/results/2026-11-26-h100-s30). If pinning scales with threads, the pool can pin with several.

For ``--gb`` GB in 256 MiB slabs, GB/s of: ``cudaHostAlloc`` on 1, 2, 4 and 8 threads; ``mmap`` + first touch +
``cudaHostRegister`` on the same thread counts. Every slab is freed before the next variant. Prints one JSON line
per variant.

    python3 scripts/experiments/pin_rate.py --gb 4
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import time
from concurrent.futures import ThreadPoolExecutor

SLAB = 256 << 20


def _alloc_slabs(n: int, threads: int) -> "tuple[float, list[int]]":
    import cupy

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        ptrs = list(pool.map(lambda _: int(cupy.cuda.runtime.hostAlloc(SLAB, 1)), range(n)))
    return time.perf_counter() - t0, ptrs


def _register_slabs(n: int, threads: int) -> "tuple[float, list]":
    import cupy

    def one(_: int) -> "tuple[mmap.mmap, int]":
        m = mmap.mmap(-1, SLAB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(m))  # no buffer object kept: the map can be closed later
        cupy.cuda.runtime.hostRegister(ptr, SLAB, 1 | 2)  # portable | mapped
        return m, ptr

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        held = list(pool.map(one, range(n)))
    return time.perf_counter() - t0, held


def main() -> None:
    import cupy

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=4.0)
    args = p.parse_args()
    n = max(1, int(args.gb * (1 << 30)) // SLAB)
    cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))  # the context exists before timing
    for threads in (1, 2, 4, 8):
        dt, ptrs = _alloc_slabs(n, threads)
        t0 = time.perf_counter()
        for ptr in ptrs:
            cupy.cuda.runtime.freeHost(ptr)
        print(json.dumps({"how": "cudaHostAlloc", "threads": threads, "gb": n * SLAB / 2**30,
                          "gb_per_s": n * SLAB / 1e9 / dt, "free_s": time.perf_counter() - t0}), flush=True)
    for threads in (1, 2, 4, 8):
        dt, held = _register_slabs(n, threads)
        for m, ptr in held:
            cupy.cuda.runtime.hostUnregister(ptr)
            m.close()
        print(json.dumps({"how": "mmap+populate+cudaHostRegister", "threads": threads, "gb": n * SLAB / 2**30,
                          "gb_per_s": n * SLAB / 1e9 / dt}), flush=True)


if __name__ == "__main__":
    main()
