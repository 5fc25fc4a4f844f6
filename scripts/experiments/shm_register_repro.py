#!/usr/bin/env python3
"""Repro of issue 28's intermittent ``CUDA error: resource already mapped`` (GPU only).

Hypothesis: an attached shared store was registered with ``cudaHostRegister`` and its mapping unmapped while still
registered; a later pinned allocation the kernel placed over the old range then failed. The fix keeps a mapping
mapped until its last view is gone and unregisters it first. This loops attach -> cache -> fetch -> drop, then
pinned allocations of the same size, and fails at the first allocation error.

    python scripts/experiments/shm_register_repro.py [--rounds 50]
"""

from __future__ import annotations

import argparse
import gc
import os


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()

    import cupy
    import torch

    from ibpcache import Codec, CompressedRows, FeatureCache
    from ibpcache.datasets import load_cora

    x = load_cora().features
    name = f"repro-{os.getpid()}"
    seg = Codec.fit(x).compress(x, layout="inplace", pin=False).share(name)
    ids = torch.arange(0, x.shape[0], 3, device="cuda")
    try:
        for i in range(args.rounds):
            att = CompressedRows.attach(name)
            cache = FeatureCache(att, 0.02, device="cuda")
            out = cache.fetch(ids)
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), x[ids.cpu()]), f"round {i}: wrong rows"
            n = seg.nbytes
            del att, cache, out
            gc.collect()
            p = cupy.cuda.runtime.hostAlloc(n, 0)
            cupy.cuda.runtime.freeHost(p)
            t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            del t
        print(f"no poisoning after {args.rounds} rounds")
    finally:
        seg.unlink()
        seg.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
