"""Run every kernel of ``kernels/lookup.cu`` on small real cases, for compute-sanitizer memcheck / racecheck.

Covers: the rows lookup (FeatureCache static, lazy validation, a bad id; raw rows several per warp), the pooling lookup (sum with per-sample
weights, mean, max; fp32 and bf16; table-batched and single-table; sorted and as-given bag order) and the staged
path (claim + stage + lookup, with a buffer that holds every miss and one that overflows); and the same kernels'
exponent kinds (``*_e2`` / ``*_e4``: fp32, bf16, fp16 rows, one and several segments, narrow rows several per warp,
rows past the 2 KB stage, a corrupt row), the exponent descriptor decode (dynamic policy, cpu-gather transfer) and
the GPU encoder (admission); inference caches holding decoded rows (the FILL kernels).
`compute-sanitizer --tool memcheck python scripts/sanitize_lookup.py [rows pool exponent single decoded]` (no names: every part;
scripts/gpu_check.sh runs every scripts/sanitize_*.py). Exits non-zero if any output is wrong, so a sanitizer-clean
run is also a correct one.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ibpcache import Codec, datasets
from ibpcache.cache.feature_cache import FeatureCache
from ibpcache.loaders.embedding_bag import CachedEmbeddingBag, TableBatchedCachedEmbeddingBag


def rows_ok() -> bool:
    x = datasets.load_cora().features[:600].contiguous()
    ids = torch.randint(0, 600, (300,), device="cuda")
    ok = True
    for cc, ch in ((True, True), (False, True), (False, False)):
        fc = FeatureCache(x, 0.05, device="cuda", compress_cache=cc, compress_host=ch, validate="lazy")
        ok &= torch.equal(fc.fetch(ids).cpu(), x[ids.cpu()])
        fc.fetch(torch.tensor([1, 600], device="cuda"))  # a bad id: reported, never read
        try:
            fc.check_errors()
            ok = False
        except IndexError:
            pass
    dense = minilm_rows(600, 128)  # raw 512-byte rows: the ROWS kernel with several rows per warp
    fc = FeatureCache(dense, 0.05, device="cuda", compress_cache=False, compress_host=False)
    for _ in range(2):
        ok &= torch.equal(fc.fetch(ids).cpu(), dense[ids.cpu()])
    fc.check_errors()
    return ok


def minilm_rows(n: int, dim: int) -> torch.Tensor:
    try:
        return datasets.load_minilm()[:n, :dim].contiguous()
    except FileNotFoundError:
        return torch.randn(n, dim, generator=torch.Generator().manual_seed(0))


def pool_ok() -> bool:
    ok = True
    w = minilm_rows(900, 96)
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        wt = w.to(dtype)
        for mode in ("sum", "mean", "max"):
            for stage in (0, 4096, 1 << 20):
                m = CachedEmbeddingBag(900, 96, _weight=wt.clone(), mode=mode, cache_ratio=0.03, device="cuda",
                                       stage_bytes=stage)
                m.eval()
                # run the staged path whenever a buffer exists (the planner would alternate while calibrating)
                fused = m.cache_weight_mgr.fused_lookup(stage)
                if stage:
                    fused.planner.fix("multi", "staged")
                ref = torch.nn.EmbeddingBag(900, 96, _weight=wt.clone().cuda(), mode=mode)
                lengths = torch.randint(0, 7, (40,), generator=gen)
                ids = torch.randint(0, 900, (int(lengths.sum()),), generator=gen).cuda()
                offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]).cuda()
                psw = torch.randn(ids.numel(), generator=gen).to(dtype).cuda() if mode == "sum" else None
                with torch.no_grad():
                    got = m(ids, offsets, per_sample_weights=psw)
                    ok &= torch.equal(got.view(torch.uint8), ref(ids, offsets, per_sample_weights=psw).view(torch.uint8))
                    single = torch.randint(0, 900, (50, 1), generator=gen).cuda()
                    kind = "single" if stage else "single unstaged"
                    for way in fused.planner.ways[kind]:  # every way of one-id bags (order, staging)
                        fused.planner.fix(kind, way)
                        for _ in range(3):
                            m.prefetch(single)  # the admission on the side stream, then the lookup after it
                            ok &= torch.equal(m(single).view(torch.uint8), ref(single).view(torch.uint8))
                m.check_errors()
    sizes = [300, 200, 400]
    tb = TableBatchedCachedEmbeddingBag(sizes, 96, _weight=w.clone(), mode="sum", cache_ratio=0.05, device="cuda",
                                        stage_bytes=1 << 16)
    ids = torch.stack([torch.randint(0, n, (64,), generator=gen) for n in sizes], 1).cuda()
    glob = (ids + torch.tensor([0, 300, 500], device="cuda")).reshape(-1, 1)
    with torch.no_grad():
        ok &= torch.equal(tb(ids), F.embedding_bag(glob, w.cuda(), mode="sum").reshape(64, -1))
    tb.check_errors()
    return ok


def exponent_ok() -> bool:
    """Exponent-coded rows through every lookup kernel kind, the descriptor decode and the GPU encoder."""
    ok = True
    base = minilm_rows(1200, 384)
    wide = torch.cat([base, base[:, :316]], 1).contiguous()  # 2800-byte fp32 rows: the direct decode
    ids = torch.randint(0, 1200, (700,), generator=torch.Generator().manual_seed(4))
    kv_like = base[:, :64].to(torch.bfloat16).contiguous()  # 128-byte rows: 14 per warp (the grouped decode)
    for x in (base, base.to(torch.bfloat16), base[:, :33].to(torch.float16).contiguous(), kv_like, wide):
        for seg in ("auto", 384):
            codec = Codec.fit(x, method="exponent", seg=seg)
            for policy, transfer in (("static", "zero_copy"), ("static", "cpu_gather"), ("lru", "zero_copy")):
                fc = FeatureCache(x, 0.05, policy=policy, device="cuda", codec=codec, transfer=transfer)
                for _ in range(2):
                    ok &= torch.equal(fc.fetch(ids if transfer == "cpu_gather" else ids.cuda()).cpu(), x[ids])
                fc.check_errors()
    packed = Codec.fit(base, method="exponent").compress(base, layout="inplace")
    coded = int(torch.nonzero(packed.lengths < packed.row_bytes)[0])
    packed.lengths[coded] = 2  # a corrupt row: reported, never read past
    fc = FeatureCache(packed, None, device="cuda", validate="lazy")
    fc.fetch(torch.tensor([coded, 0], device="cuda"))
    try:
        fc.check_errors()
        ok = False
    except ValueError:
        pass
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        w = base[:, :96].to(dtype).contiguous()
        rows = Codec.fit(w, method="exponent").compress(w, layout="inplace")
        for stage in (0, 4096, 1 << 20):
            m = CachedEmbeddingBag(1200, 96, _weight=rows, mode="sum", cache_ratio=0.03, device="cuda",
                                   stage_bytes=stage)
            m.eval()
            if stage:  # the staged way whenever a buffer exists (the planner alternates while calibrating)
                m.cache_weight_mgr.fused_lookup(stage).planner.fix("multi", "staged")
            ref = torch.nn.EmbeddingBag(1200, 96, _weight=w.clone().cuda(), mode="sum")
            for width in (5, 1):  # bags of five (the bag loop) and of one id (the one-id-bag kernel)
                bags = torch.randint(0, 1200, (64, width), generator=gen).cuda()
                with torch.no_grad():
                    ok &= torch.equal(m(bags).view(torch.uint8), ref(bags).view(torch.uint8))
            m.check_errors()
    return ok


def single_ok() -> bool:
    """The kernels that take several one-id bags (or rows) per warp, alone (racecheck runs the whole pool part for
    many minutes): raw rows (the word path) and IBP-coded rows (row by row), sum and max, fp32 and bf16; raw rows
    fetched by FeatureCache (``ibp_lookup_rows_single_c*``), misses then hits."""
    ok = True
    w = minilm_rows(900, 96)
    gen = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.bfloat16):
        wt = w.to(dtype)
        ibp_rows = Codec.fit(wt, method="ibp").compress(wt, layout="inplace")  # coded rows: IBP's kernels
        for weight, mode in ((wt.clone(), "sum"), (ibp_rows, "max")):
            m = CachedEmbeddingBag(900, 96, _weight=weight, mode=mode, cache_ratio=0.05, device="cuda",
                                   **({"compress": False} if weight is not ibp_rows else {}))
            m.eval()
            ref = torch.nn.EmbeddingBag(900, 96, _weight=wt.clone().cuda(), mode=mode)
            for _ in range(2):
                single = torch.randint(0, 900, (300, 1), generator=gen).cuda()
                with torch.no_grad():
                    ok &= torch.equal(m(single).view(torch.uint8), ref(single).view(torch.uint8))
            m.check_errors()
    dense = w[:600, :64].contiguous()
    fc = FeatureCache(dense, 0.05, device="cuda", compress_cache=False, compress_host=False)
    ids = torch.randint(0, 600, (500,), generator=gen)
    for _ in range(2):
        ok &= torch.equal(fc.fetch(ids.cuda()).cpu(), dense[ids])
    fc.check_errors()
    return ok


def decoded_ok() -> bool:
    """Inference caches of decoded rows in front of compressed host rows (``compress_cache=False``): the FILL kernels
    (``ibp_lookup_fill_*``: admitted and staged rows decoded into slots), then hits read raw: one-id bags (the direct
    word path of ``ibp_lookup_pool_single_*``, exponent and IBP kinds) and bags of five; fp32, fp16, bf16."""
    ok = True
    w = minilm_rows(1200, 128)
    gen = torch.Generator().manual_seed(9)
    for method, dtype in (("exponent", torch.float32), ("exponent", torch.float16), ("ibp", torch.bfloat16)):
        wt = w.to(dtype).contiguous()
        for stage in (0, 1 << 20):
            m = CachedEmbeddingBag(1200, 128, _weight=wt.clone(), mode="sum", cache_ratio=0.05, device="cuda",
                                   compress=method, compress_cache=False, stage_bytes=stage)
            m.eval()
            ref = torch.nn.EmbeddingBag(1200, 128, _weight=wt.clone().cuda(), mode="sum")
            hot = torch.randint(0, 1200, (40,), generator=gen)
            for _ in range(3):  # misses, then hits of the rows the first steps admitted
                for width in (1, 5):
                    bags = hot[torch.randint(0, 40, (96, width), generator=gen)].cuda()
                    with torch.no_grad():
                        ok &= torch.equal(m(bags).view(torch.uint8), ref(bags).view(torch.uint8))
            m.check_errors()
            ok &= m.cache_weight_mgr.fused is not None and m.cache_weight_mgr.fused.decoded
    return ok


PARTS = {"rows": rows_ok, "pool": pool_ok, "exponent": exponent_ok, "single": single_ok, "decoded": decoded_ok}


def main(argv: list[str]) -> int:
    """Every part, or those named (``python scripts/sanitize_lookup.py exponent``: a shorter sanitizer run)."""
    names = argv or list(PARTS)
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        print(f"unknown parts {unknown}; choose from {list(PARTS)}")
        return 2
    ok = {name: PARTS[name]() for name in names}
    torch.cuda.synchronize()
    print("lookup kernels: " + ", ".join(f"{name} ok={good}" for name, good in ok.items()))
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
