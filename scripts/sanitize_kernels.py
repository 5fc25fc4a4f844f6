"""Run every bitpack, kv_packed (through the manager; scripts/sanitize_kv.py covers every codec), kv_select and exponent kernel once on a small real case, for compute-sanitizer memcheck/racecheck.

`compute-sanitizer --tool memcheck python scripts/sanitize_kernels.py` (scripts/gpu_check.sh does this).
Exits non-zero if any output is wrong, so a sanitizer-clean run is also a correct one.
"""

from __future__ import annotations

import sys

import torch

from ibpcache import Codec, datasets
from ibpcache.kernels.bitpack import decode_descriptors, encode_into, gather_raw


def kv_kernels_ok() -> bool:
    """The KV manager's fused kernels: append (K+V encode, attention-buffer copy), fetch (sparse, dense), select."""
    from ibpcache.kernels.kv_select import partial_scores, select_top
    from ibpcache.cache.kv_select import top_k_ascending
    from ibpcache.loaders.kv import KVOffloadManager

    try:
        k = datasets.load_kv("code", "k", "bf16", flat=False)[2][:, :96]  # [3, 96, 64] real keys
        v = datasets.load_kv("code", "v", "bf16", flat=False)[2][:, :96]
    except FileNotFoundError:
        g = torch.Generator().manual_seed(0)
        k = (torch.randn(3, 96, 64, generator=g) * 4).to(torch.bfloat16)
        v = (torch.randn(3, 96, 64, generator=g)).to(torch.bfloat16)
    k, v = k[None].expand(2, -1, -1, -1).contiguous().cuda(), v[None].expand(2, -1, -1, -1).contiguous().cuda()
    ok = True
    for compress in (True, False):
        mgr = KVOffloadManager(1, 3, 64, torch.bfloat16, batch_size=2, device="cuda", compress=compress,
                               host_chunk_bytes=4096)
        mgr.append(0, k[:, :, :80], v[:, :, :80])
        for t in range(80, 95):
            mgr.append(0, k[:, :, t : t + 1], v[:, :, t : t + 1])
        buf = mgr.take(0, None, extra_tokens=1)
        mgr.append(0, k[:, :, 95:], v[:, :, 95:], into=buf)
        ok &= torch.equal(buf[0].view(torch.int16), k.view(torch.int16))
        idx = torch.randint(0, 96, (2, 3, 33), device="cuda").sort(dim=-1).values
        got = mgr.fetch(0, idx)
        ok &= torch.equal(got[1].view(torch.int16), v.gather(2, idx[..., None].expand(-1, -1, -1, 64)).view(torch.int16))
        mgr.close()
    dims = torch.arange(13, device="cuda").repeat(9, 1)
    keys = k[..., :13].contiguous()
    q = torch.cat([k[:, :, :1]] * 3, dim=1)  # [2, 9, 1, 64]
    scores = partial_scores(q, dims, keys, 96, 0.125, None)
    idx, counts = select_top(scores, 17, 4.0)
    ok &= bool((counts >= 1).all()) and scores.shape == (2, 3, 96)
    ok &= torch.equal(idx.cpu(), top_k_ascending(scores.cpu(), 17))
    n_dev = torch.tensor([90], dtype=torch.int64, device="cuda")  # the graph path: count read on the device
    wide = torch.zeros(2, 3, 96, device="cuda")
    partial_scores(q, dims, keys, 96, 0.125, None, n_dev=n_dev, out=wide)
    idx, _ = select_top(wide, 17, 4.0, n_dev=n_dev)
    ok &= torch.equal(idx.cpu(), top_k_ascending(scores[:, :, :90].cpu(), 17))
    torch.cuda.synchronize()
    print(f"kv kernels: ok={ok}")
    return ok


def exponent_kernels_ok() -> bool:
    """The exponent codec's sizes/encode/decode kernels (device data, then pinned host data read zero-copy): one-segment
    16-bit KV rows (lane-per-row decode), segmented fp32/bf16 rows (warp-per-row decode) and rows over 2 KB (the
    unstaged warp decode), each with raw rows mixed in."""
    from ibpcache.exponent import ExponentCodec

    ok = True
    g = torch.Generator().manual_seed(1)
    cases = []
    for dtype in ("bf16", "fp16", "fp32"):
        try:
            cases.append((datasets.load_kv("chat", "k", dtype)[:300], None))
        except FileNotFoundError:
            dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
            cases.append(((torch.randn(300, 64, generator=g) * 3).to(dt), None))
    cases += [((torch.randn(300, 384, generator=g) * 0.05).to(torch.float32), "auto"),
              ((torch.randn(300, 385, generator=g) * 0.05).to(torch.bfloat16), "auto"),
              ((torch.randn(40, 600, generator=g) * 0.05).to(torch.float32), "auto")]
    for x, seg in cases:
        codec = ExponentCodec.fit(x, seg=seg)
        x = x.clone()
        x[::9] = float("inf")  # rare exponents: stored raw
        data, lengths, offsets = codec.encode_gpu(x.cuda())
        ok &= torch.equal(data.cpu(), codec.encode(x)[0])
        bits = torch.int32 if x.element_size() == 4 else torch.int16
        ok &= torch.equal(codec.decode_gpu(data, lengths, offsets).cpu().view(bits), x.view(bits))
        host = codec.decode_gpu(data.cpu().pin_memory(), lengths, offsets)
        ok &= torch.equal(host.cpu().view(bits), x.view(bits))
        p = codec.compress(x, layout="packed")
        ids = torch.randint(0, x.shape[0], (257,), generator=g)
        ok &= torch.equal(p.gather(ids, device="cuda").cpu().view(bits), x[ids].view(bits))
    torch.cuda.synchronize()
    print(f"exponent kernels: ok={ok}")
    return ok


def main() -> int:
    cases = {"cora": datasets.load_cora().features[:96], "odd_u8": datasets.load_cora().features[:64].view(torch.uint8)[:, :1001].contiguous()}
    try:
        cases["kv_bf16"] = datasets.load_kv("chat", "v", "bf16")[:300]
    except FileNotFoundError:
        pass
    ok = True
    for name, x in cases.items():
        for c in (1, 2, 4, 8):
            codec = Codec.fit(x.cuda(), chunk_bytes=c)  # bitcount + fit_sizes kernels
            for layout in ("inplace", "packed"):
                p = codec.compress(x.cuda(), layout=layout)  # size + encode kernels
                ids = torch.randint(0, x.shape[0], (257,), device="cuda")
                y = p.gather(ids, device="cuda")  # fused gather kernel
                ok &= torch.equal(y.cpu().view(torch.uint8), x[ids.cpu()].view(torch.uint8))
                rows = x.view(torch.uint8).reshape(x.shape[0], -1)
                out = torch.empty(257, codec.row_bytes, dtype=torch.uint8, device="cuda")
                decode_descriptors(out, (p.offsets[ids.cpu()] + p.data.data_ptr()).cuda(), p.lengths[ids.cpu()].cuda(),
                                   p.is_compressed()[ids.cpu()].cuda(), None, codec.kernel_tables("cuda"))
                ok &= torch.equal(out.cpu(), rows[ids.cpu()])
            dst = torch.zeros(x.shape[0] * codec.row_bytes, dtype=torch.uint8, device="cuda")
            lens = torch.empty(x.shape[0], dtype=torch.int32, device="cuda")
            encode_into(rows.cuda(), torch.arange(x.shape[0], device="cuda") * codec.row_bytes + dst.data_ptr(), lens,
                        codec.kernel_tables("cuda"))
        flat = x.view(torch.uint8).reshape(-1).pin_memory()
        out = torch.empty(257, rows.shape[1], dtype=torch.uint8, device="cuda")
        gather_raw(flat, ids, out, x.shape[0])
        ok &= torch.equal(out.cpu(), rows[ids.cpu()])
        torch.cuda.synchronize()
        print(f"{name}: ok={ok}")
    ok &= kv_kernels_ok()
    ok &= exponent_kernels_ok()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
