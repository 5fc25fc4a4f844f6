"""Tiny cache build/probe/fetch on the GPU for compute-sanitizer memcheck/racecheck.

``compute-sanitizer --tool memcheck python scripts/sanitize_cache.py`` (scripts/gpu_check.sh runs every
``scripts/sanitize_*.py``). Covers the hash insert/erase/lookup kernels, the probe kernel with every index
kind (hash, direct, none) and host layout (raw, in place, packed), the decode of hits and misses, and the
dynamic policies' slot writes, and the cpu-gather transfer (CPU ids: staged stored bytes decoded from device memory,
static caches; and the host store's read path). Exits non-zero if any fetched row differs from ``rows[ids]``.
"""

from __future__ import annotations

import sys

import torch

from ibpcache import Codec, datasets
from ibpcache.cache.feature_cache import FeatureCache, mode_name
from ibpcache.cache.hashmap import HashIndex

COMBOS = [(False, False), (False, True), (True, False), (True, True)]


def _same(got: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> bool:
    return torch.equal(got.cpu().reshape(-1).view(torch.uint8), rows[ids.cpu()].reshape(-1).view(torch.uint8))


def check_hash_kernels() -> bool:
    ids = torch.randperm(10_000)[:600]
    idx = HashIndex(600, torch.device("cuda"))
    idx.build(ids, ids * 2)
    idx.erase(ids[:200])
    idx.insert(ids[:100] + 20_000, ids[:100])
    got = idx.lookup(torch.cat([ids, ids[:100] + 20_000])).cpu()
    want = torch.cat([torch.full((200,), -1), ids[200:] * 2, ids[:100]])
    return torch.equal(got, want)


def main() -> int:
    torch.manual_seed(0)
    rows = datasets.load_cora().features[:300].contiguous()
    codec = Codec.fit(rows)
    ok = check_hash_kernels()
    print(f"hash kernels: ok={ok}")
    packed = codec.compress(rows, layout="packed")
    cases = [(mode_name(*c), dict(compress_cache=c[0], compress_host=c[1])) for c in COMBOS]
    cases.append(("packed host", dict(rows=packed)))
    for name, kw in cases:
        src = kw.pop("rows", rows)
        for policy in ("static", "lru", "lfu"):
            for index in ("hash", "direct"):
                for budget in (None, 0.05):  # None: no slab, every row from the host store
                    for transfer in ("zero_copy", "cpu_gather"):
                        fc = FeatureCache(src, budget, policy=policy, device="cuda", codec=codec, index=index,
                                          transfer=transfer, **kw)
                        for b in range(3):
                            ids = torch.randint(0, rows.shape[0], (97 + b,))
                            ok &= _same(fc.fetch(ids if transfer == "cpu_gather" else ids.cuda()), rows, ids)
                        torch.cuda.synchronize()
                        ok &= fc.stats()["kernel_status"] == 0
        print(f"{name}: ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
