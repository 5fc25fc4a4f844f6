"""Run every bitpack kernel once on a small real case, for compute-sanitizer memcheck/racecheck.

`compute-sanitizer --tool memcheck python scripts/sanitize_kernels.py` (scripts/gpu_check.sh does this).
Exits non-zero if any output is wrong, so a sanitizer-clean run is also a correct one.
"""

from __future__ import annotations

import sys

import torch

from ibpcache import Codec, datasets
from ibpcache.kernels.bitpack import decode_descriptors, encode_into, gather_raw


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
                                   p.is_compressed()[ids.cpu()].cuda(), None, codec)
                ok &= torch.equal(out.cpu(), rows[ids.cpu()])
            dst = torch.zeros(x.shape[0] * codec.row_bytes, dtype=torch.uint8, device="cuda")
            lens = torch.empty(x.shape[0], dtype=torch.int32, device="cuda")
            encode_into(rows.cuda(), torch.arange(x.shape[0], device="cuda") * codec.row_bytes + dst.data_ptr(), lens, codec)
        flat = x.view(torch.uint8).reshape(-1).pin_memory()
        out = torch.empty(257, rows.shape[1], dtype=torch.uint8, device="cuda")
        gather_raw(flat, ids, out, x.shape[0])
        ok &= torch.equal(out.cpu(), rows[ids.cpu()])
        torch.cuda.synchronize()
        print(f"{name}: ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
