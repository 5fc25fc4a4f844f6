"""Experiment: do IBP's byte savings on 128-byte KV rows become fewer PCIe transfers in the manager's in-place slots?

Kept for the record: it measured the fixed-slot store (ZeroCopyKV, kernels/kv_rows.cu) that the packed append store
(ibpcache/cache/append_store.py, kernels/kv_packed.cu) replaced; rerun it at commit 616e602.

The zero-copy kernels read a row's stored bytes with 16-byte loads from its fixed 128-byte slot; the GPU fetches host
memory in 32-byte sectors, so a row stored in 97..128 bytes costs 4 sectors whether compressed or not. This times
the KV manager's fused fetch kernel on real SmolLM2 KV rows (bf16 and fp16, K and V), reading every row (dense
mode) from a compressed store and from a raw store, and compares the time ratio with the ratio of 32-byte sectors
the stored lengths imply.

    python3 scripts/experiments/kv_sector_granularity.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from ibpcache import datasets
from ibpcache.codec import Codec
from ibpcache.loaders._kv_store import ZeroCopyKV, identity_codec


def sectors(lengths: torch.Tensor) -> torch.Tensor:
    """32-byte sectors a row of each stored length touches in a 16-byte-aligned slot (bounded 16-byte loads)."""
    return (((lengths + 15) // 16 * 16) + 31) // 32


def time_fetch(store: ZeroCopyKV, n: int, reps: int = 20) -> float:
    out_k = torch.empty((1, 1, n, 64), dtype=store.codecs[0].dtype, device="cuda")
    out_v = torch.empty_like(out_k)
    for _ in range(3):
        store.read(None, n, out_k, out_v)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        store.read(None, n, out_k, out_v)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1 << 20, help="rows per tensor (real rows tiled)")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = p.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    recs = []
    for dtype in ("bf16", "fp16"):
        k = datasets.load_kv("code", "k", dtype)
        v = datasets.load_kv("code", "v", dtype)
        reps = -(-args.rows // k.shape[0])
        kk = k.repeat(reps, 1)[: args.rows].cuda().view(1, 1, args.rows, 64)
        vv = v.repeat(reps, 1)[: args.rows].cuda().view(1, 1, args.rows, 64)
        codecs = Codec.fit_many([k[:4096], v[:4096]])
        ident = identity_codec(128, k.dtype, (64,))
        res = {}
        for name, kc, vc, comp in (("compressed", codecs[0], codecs[1], True), ("raw", ident, ident, False)):
            store = ZeroCopyKV(kc, vc, comp, dev)
            store.reserve(args.rows)
            store.write(kk, vv, 0)
            torch.cuda.synchronize()
            got_k = torch.empty_like(kk)
            got_v = torch.empty_like(vv)
            store.read(None, args.rows, got_k, got_v)
            assert torch.equal(got_k.view(torch.int16), kk.view(torch.int16))
            assert torch.equal(got_v.view(torch.int16), vv.view(torch.int16))
            secs = time_fetch(store, args.rows)
            if comp:
                lengths = torch.cat([store._lengths[0][: args.rows], store._lengths[1][: args.rows]]).to(torch.int64)
            else:
                lengths = torch.full((2 * args.rows,), 128, dtype=torch.int64, device="cuda")
            res[name] = {"seconds": secs, "stored_bytes": int(lengths.sum()), "sectors": int(sectors(lengths).sum()),
                         "share_rows_le_96B": float((lengths <= 96).float().mean()),
                         "output_gb_per_s": 2 * args.rows * 128 / secs / 1e9}
        rec = {"dtype": dtype, "rows_per_tensor": args.rows, **{f"{n}_{k2}": v2 for n, r in res.items() for k2, v2 in r.items()}}
        rec["byte_ratio_raw_over_compressed"] = res["raw"]["stored_bytes"] / res["compressed"]["stored_bytes"]
        rec["sector_ratio_raw_over_compressed"] = res["raw"]["sectors"] / res["compressed"]["sectors"]
        rec["time_ratio_raw_over_compressed"] = res["raw"]["seconds"] / res["compressed"]["seconds"]
        recs.append(rec)
        print(json.dumps({k2: (round(v2, 4) if isinstance(v2, float) else v2) for k2, v2 in rec.items()}))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kv_sector_granularity.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "records": recs}, f, indent=1)


if __name__ == "__main__":
    main()
