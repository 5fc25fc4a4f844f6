"""Run every kernel of the packed KV store (kernels/kv_packed.cu) on small real cases, for compute-sanitizer.

Covers: ibp_kvp_size + ibp_kvp_encode (a prompt larger than a chunk: one sync, encoded into a device buffer and
DMA-copied to its chunks; decode appends without a sync straight into the chunks, rows running into chunk margins; a
crop's rewind, direct and staged; a multi-token append with the attention-buffer copy) and ibp_kvp_fetch (selected tokens, every token, a
beam-reordered slot table, the graph-captured step with its token count read on the device), for every K/V codec
pair (raw, IBP, exponent) in bf16 and fp16, with small chunks so that appends cross many chunk ends.

    compute-sanitizer --tool memcheck --kernel-regex kns=ibp_ python3 scripts/sanitize_kv.py
    compute-sanitizer --tool racecheck --kernel-regex kns=ibp_kvp python3 scripts/sanitize_kv.py

Needs the shared data folder (IBPCACHE_SHARED with llm/*.npz); exits non-zero if any output is wrong, so a clean
sanitizer run is also a correct one.
"""

from __future__ import annotations

import sys

import torch


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.permute(2, 0, 1, 3).reshape(-1, x.shape[3]).contiguous()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.contiguous().view(torch.int16).cpu(), b.contiguous().view(torch.int16).cpu()))


def store_ok(dtype: str, k_method: str, v_method: str) -> bool:
    from ibpcache import datasets
    from ibpcache.cache.append_store import AppendStore
    from ibpcache.codec import Codec

    k = datasets.load_kv("chat", "k", dtype, flat=False)[[2, 9], :, :120].contiguous()  # [2, 3, 120, 64]
    v = datasets.load_kv("chat", "v", dtype, flat=False)[[2, 9], :, :120].contiguous()
    codecs = [Codec.raw(k.dtype, (64,)) if m == "raw" else Codec.fit(_rows(x), method=m)
              for m, x in ((k_method, k), (v_method, v))]
    store = AppendStore(*codecs, "cuda", rows_per_token=6, min_chunk_bytes=8192, max_chunk_bytes=16384)
    cpu = AppendStore(*codecs, "cpu", rows_per_token=6, min_chunk_bytes=8192, max_chunk_bytes=16384)
    kd, vd = k.cuda(), v.cuda()
    ok = True
    for s, kk, vv in ((store, kd, vd), (cpu, k, v)):
        s.reserve(120 * 6)
        s.append(kk[:, :, :80], vv[:, :, :80], 0, 0)  # prompt-sized: one sync
        for t in range(80, 100):
            s.append(kk[:, :, t : t + 1], vv[:, :, t : t + 1], t * 6, t)
        s.append(kk[:, :, 95:97], vv[:, :, 95:97], 95 * 6, 95)  # crop to 95 + rewrite: rewind
        for t in range(97, 117):
            s.append(kk[:, :, t : t + 1], vv[:, :, t : t + 1], t * 6, t)
        s.append(kk[:, :, 100:117], vv[:, :, 100:117], 100 * 6, 100)  # crop to 100 + a staged rewrite (> a chunk)
    att_k = torch.zeros(2, 3, 120, 64, dtype=k.dtype, device="cuda")
    att_v = torch.zeros_like(att_k)
    store.append(kd[:, :, 117:120], vd[:, :, 117:120], 117 * 6, 117, into=(att_k, att_v), att_pos0=117)
    cpu.append(k[:, :, 117:120], v[:, :, 117:120], 117 * 6, 117)
    ok &= _same(att_k[:, :, 117:], k[:, :, 117:])
    idx = torch.randint(0, 120, (2, 3, 41), device="cuda")
    out_k = torch.empty(2, 3, 41, 64, dtype=k.dtype, device="cuda")
    out_v = torch.empty_like(out_k)
    store.fetch(idx, 41, out_k, out_v)
    ok &= _same(out_k, k.gather(2, idx.cpu()[..., None].expand(-1, -1, -1, 64)))
    ok &= _same(out_v, v.gather(2, idx.cpu()[..., None].expand(-1, -1, -1, 64)))
    dense_k = torch.empty(2, 3, 121, 64, dtype=k.dtype, device="cuda")
    dense_v = torch.empty_like(dense_k)
    row0 = (torch.arange(120).view(-1, 1) * 6 + torch.tensor([3, 0])).cuda()  # beams swapped
    store.fetch(None, 120, dense_k, dense_v, row0=row0)
    ok &= _same(dense_k[:, :, :120], k.flip(0)) and _same(dense_v[:, :, :120], v.flip(0))
    dense_k.zero_(), dense_v.zero_()
    store.fetch(None, 120, dense_k, dense_v, row0=row0, staged=store.stage_chunks())  # from the bulk device copy
    ok &= _same(dense_k[:, :, :120], k.flip(0)) and _same(dense_v[:, :, :120], v.flip(0))
    a, b = store.snapshot(120 * 6), cpu.snapshot(120 * 6)
    ok &= bool((a["pos"] == b["pos"]).all() and (a["len"] == b["len"]).all() and (a["data"] == b["data"]).all())
    store.check()
    store.release()
    return ok


def graph_ok() -> bool:
    from ibpcache import datasets
    from ibpcache.loaders.kv import KVOffloadManager

    k = datasets.load_kv("chat", "k", "bf16", flat=False)[[4, 5], :, :200].contiguous().cuda()
    v = datasets.load_kv("chat", "v", "bf16", flat=False)[[4, 5], :, :200].contiguous().cuda()
    mgr = KVOffloadManager(1, 3, 64, torch.bfloat16, batch_size=2, device="cuda", host_chunk_bytes=16384)
    mgr.append(0, k[:, :, :150], v[:, :, :150])
    step = mgr.capture_decode_step(0, max_tokens=200)
    ok = True
    for t in range(150, 200):
        step.keys_in.copy_(k[:, :, t : t + 1])
        step.values_in.copy_(v[:, :, t : t + 1])
        got_k, got_v = step.replay()
    ok &= _same(got_k, k) and _same(got_v, v)
    mgr.stats()
    mgr.close()
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("sanitize_kv: needs a CUDA GPU", file=sys.stderr)
        return 2
    ok = True
    for dtype in ("bf16", "fp16"):
        for pair in (("raw", "ibp"), ("ibp", "exponent"), ("exponent", "raw"), ("exponent", "exponent")):
            good = store_ok(dtype, *pair)
            print(f"kv_packed store {dtype} K={pair[0]} V={pair[1]}: ok={good}")
            ok &= good
    good = graph_ok()
    print(f"kv_packed captured step: ok={good}")
    ok &= good
    torch.cuda.synchronize()
    print("sanitize_kv: all outputs correct" if ok else "sanitize_kv: WRONG OUTPUT", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
