"""Experiment: does backing the pinned host store with 2 MB transparent huge pages speed up zero-copy gathers
of small random rows? Hypothesis: random 128 B reads over a 2 GB table are bound by GPU page walks on 4 KB
host pages; huge-page-backed memory registered with cudaHostRegister may be mapped with larger GPU pages.

Prints GB/s of the raw zero-copy gather for torch's pinned allocator vs an mmap(THP)+cudaHostRegister buffer.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np
import torch

from ibpcache.kernels.bitpack import gather_raw
from ibpcache.testing.timing import cuda_time


def thp_state() -> str:
    try:
        return open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError as exc:
        return f"unknown ({exc})"


def main() -> None:
    import cupy

    gb = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    nbytes = int(gb * (1 << 30))
    print("THP:", thp_state(), flush=True)
    results = {}
    for row in (128, 512, 2048):
        n_rows = nbytes // row
        ids = torch.randint(0, n_rows, (100_000,), device="cuda")
        out = torch.empty(100_000, row, dtype=torch.uint8, device="cuda")
        torch_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        torch_buf.fill_(1)
        t = cuda_time(lambda: gather_raw(torch_buf, ids, out, n_rows), warmup=3, iters=10)
        results[(row, "torch_pinned")] = 100_000 * row / t["median_ms"] / 1e6
        del torch_buf
        mm = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError) as exc:
            print("madvise failed:", exc)
        arr = np.frombuffer(mm, dtype=np.uint8)
        base = arr.ctypes.data
        off = (-base) % (2 << 20)
        view = arr[off: off + nbytes]
        view.fill(1)
        cupy.cuda.runtime.hostRegister(view.ctypes.data, nbytes, 0)
        thp_buf = torch.from_numpy(view)
        t = cuda_time(lambda: gather_raw(thp_buf, ids, out, n_rows), warmup=3, iters=10)
        results[(row, "thp_registered")] = 100_000 * row / t["median_ms"] / 1e6
        ok = bool(torch.equal(out.cpu(), torch.ones_like(out.cpu())))
        cupy.cuda.runtime.hostUnregister(view.ctypes.data)
        del thp_buf, view, arr
        try:
            anon = open("/proc/meminfo").read().split("AnonHugePages:")[1].split("\n")[0].strip()
        except Exception:  # noqa: BLE001
            anon = "?"
        print(f"row {row:5d} B: torch pinned {results[(row, 'torch_pinned')]:.1f} GB/s | THP+hostRegister "
              f"{results[(row, 'thp_registered')]:.1f} GB/s | verified {ok} | AnonHugePages {anon}", flush=True)
        mm.close()


if __name__ == "__main__":
    main()
