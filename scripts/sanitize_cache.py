"""Tiny cache build/probe/fetch on the GPU for compute-sanitizer memcheck/racecheck.

``compute-sanitizer --tool memcheck python scripts/sanitize_cache.py`` (scripts/gpu_check.sh runs every
``scripts/sanitize_*.py``). Covers the hash insert/erase/lookup kernels, the probe kernel with every index
kind (hash, direct, none) and host layout (raw, in place, packed), the decode of hits and misses, and the
dynamic policies' slot writes, and the cpu-gather transfer (CPU ids: staged stored bytes decoded from device memory,
static caches; and the host store's read path); and the row cache's training path: prefetched SGD steps of a
table-batched embedding bag (its one-read admission, write-back, and the sketch's count / estimate / touch kernels).
Exits non-zero if any fetched row differs from ``rows[ids]`` or a trained table from ``nn.EmbeddingBag``'s.
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


def check_row_cache_training() -> bool:
    """Prefetched sparse-SGD steps over a cache too small for two batches (evictions with write-back every step) on
    real MiniLM rows; the trained table must equal nn.EmbeddingBag's bit for bit."""
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag

    w = datasets.load_minilm()[1000:1900, :64].contiguous()  # 3 tables of 300 rows of real trained values
    dev = torch.device("cuda")
    m = TableBatchedCachedEmbeddingBag([300] * 3, 64, _weight=w.clone(), mode="sum", sparse=True, cache_ratio=0.3,
                                       warmup_ratio=0.0, device=dev)
    ref = torch.nn.EmbeddingBag(900, 64, mode="sum", sparse=True, _weight=w.clone().to(dev))
    opt, ref_opt = torch.optim.SGD(m.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 300, (48, 3), generator=gen).to(dev) for _ in range(6)]
    base = torch.arange(3, device=dev) * 300
    m.prefetch(batches[0])
    for i, ids in enumerate(batches):
        m(ids).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        if i + 1 < len(batches):
            m.prefetch(batches[i + 1])
        ref((ids + base).reshape(-1, 1)).pow(2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch.cuda.synchronize()
    return m.stats()["evictions"] > 0 and torch.equal(m.weight.cpu(), ref.weight.detach().cpu())


def main() -> int:
    torch.manual_seed(0)
    rows = datasets.load_cora().features[:300].contiguous()
    codec = Codec.fit(rows)
    ok = check_hash_kernels()
    print(f"hash kernels: ok={ok}")
    ok &= check_row_cache_training()
    print(f"row cache training: ok={ok}")
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
