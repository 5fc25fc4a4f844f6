"""Experiment: would masking IBP's invariant bits and then coding the exponent store fewer bytes than either alone?

Issue 26 asks to offer the combination if it does. This bounds what it could store, on the real dense tables
(MiniLM word embeddings and the SmolLM2 chat / code KV, each as fp32 and cast to bf16 and fp16), without building it:

  exponent   the exponent codec's stored bytes (``ExponentCodec.stored_lengths``: row headers and raw rows included)
  ibp        the IBP codec's stored bytes (``IBPCodec.stored_lengths``)
  combo      a lower bound on the bytes of the combination: each row's exponent-coded bytes, minus, for every IBP
             chunk whose masked bits match ``bitval`` (what IBP drops there), the masked bits that lie OUTSIDE the
             exponent fields (the exponent coder already spends less than a bit on a predictable exponent bit), plus
             IBP's participation bit per chunk; per row never more than raw, IBP or exponent coding alone. A real
             format also pays for its tables, a per-row choice and alignment, so it would store more.

``combo_gain`` is the best single codec's bytes over the bound: at 1.00x the combination cannot pay.
CPU only, a few seconds per table:

    python scripts/experiments/ibp_exp_combo.py --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from ibpcache import Codec, datasets  # noqa: E402
from ibpcache.testing.timing import add_out_argument, write_results  # noqa: E402

TABLES = ("minilm", "kv_chat_k_fp32", "kv_chat_v_fp32", "kv_code_k_fp16", "kv_code_v_fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EXPONENT_BITS = {torch.float32: (23, 8), torch.bfloat16: (7, 8), torch.float16: (10, 5)}
"""(lowest bit, width) of the exponent field in one element, per dtype."""


def exponent_bit_mask(dtype: torch.dtype, row_bytes: int) -> np.ndarray:
    """uint8 [row_bytes]: the bits of a stored row (little-endian elements) that belong to exponent fields."""
    lo, width = EXPONENT_BITS[dtype]
    size = torch.tensor([], dtype=dtype).element_size()
    field = ((1 << width) - 1) << lo
    one = np.array([(field >> (8 * b)) & 0xFF for b in range(size)], dtype=np.uint8)
    return np.tile(one, row_bytes // size)


def chunks(rows_u8: np.ndarray, c: int) -> np.ndarray:
    """uint64 [N, row_bytes / c]: each c-byte chunk of each row as a little-endian integer (IBP's chunks)."""
    n, row_bytes = rows_u8.shape
    parts = rows_u8.reshape(n, row_bytes // c, c).astype(np.uint64)
    out = np.zeros(parts.shape[:2], dtype=np.uint64)
    for b in range(c):
        out |= parts[:, :, b] << np.uint64(8 * b)
    return out


def popcount64(v: np.ndarray) -> np.ndarray:
    return np.unpackbits(v.view(np.uint8).reshape(*v.shape, 8), axis=-1).sum(axis=-1)


def combo_bound(x: torch.Tensor) -> dict[str, Any]:
    """Stored bytes of ``x`` under exponent coding, IBP, and the combination's lower bound (module docstring)."""
    exp = Codec.fit(x, method="exponent")
    ibp = Codec.fit(x, method="ibp")
    row_bytes = exp.row_bytes
    rows_u8 = x.contiguous().view(torch.uint8).reshape(x.shape[0], row_bytes).numpy()
    exp_len = exp.stored_lengths(x).numpy().astype(np.int64)
    ibp_len = ibp.stored_lengths(x).numpy().astype(np.int64)
    c = int(ibp.chunk_bytes)
    mask, bitval = ibp.mask.astype(np.uint64), ibp.bitval.astype(np.uint64)
    exp_bits = chunks(exponent_bit_mask(x.dtype, row_bytes)[None, :], c)[0]
    dropped = popcount64(mask & ~exp_bits)  # per chunk: bits IBP drops that the exponent coder stores raw
    matched = (chunks(rows_u8, c) & mask) == bitval
    saved = (matched * dropped).sum(axis=1)
    combo_bits = exp_len * 8 - saved + mask.shape[0]
    # a row either codec leaves raw gains nothing from the other's fields; per row, the best of the three
    combo_len = np.minimum(np.minimum((combo_bits + 7) // 8, row_bytes), np.minimum(exp_len, ibp_len))
    n = x.shape[0]
    total = {"exponent": int(exp_len.sum()), "ibp": int(ibp_len.sum()), "combo_bound": int(combo_len.sum())}
    best = min(total["exponent"], total["ibp"])
    return {"rows": n, "row_bytes": row_bytes, "ibp_chunk_bytes": c,
            "ibp_mask_bits_outside_exponent": int(dropped.sum()), "matched_chunk_share": float(matched.mean()),
            **{f"{k}_ratio": n * row_bytes / v for k, v in total.items()},
            "combo_gain": best / total["combo_bound"]}


def load(name: str, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of a real table (``datasets.load_rows``), as float32."""
    return datasets.load_rows(name)[:rows].float().contiguous()


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tables", default=",".join(TABLES))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--rows", type=int, default=30522, help="rows per table (the first ones)")
    add_out_argument(p)
    args = p.parse_args(argv)
    records = []
    for name in [t for t in args.tables.split(",") if t]:
        base = load(name, args.rows).float()
        for dname in [d for d in args.dtypes.split(",") if d]:
            rec = {"table": name, "dtype": dname, **combo_bound(base.to(DTYPES[dname]))}
            records.append(rec)
            print(f"{name:16s} {dname:5s} exponent {rec['exponent_ratio']:.3f}x  ibp {rec['ibp_ratio']:.3f}x  "
                  f"combo bound {rec['combo_bound_ratio']:.3f}x  gain {rec['combo_gain']:.4f}x  "
                  f"(IBP mask bits outside exponents {rec['ibp_mask_bits_outside_exponent']}, "
                  f"matched chunks {rec['matched_chunk_share']:.2f})")
    write_results(args.out, "ibp_exp_combo", records, meta={"args": vars(args) | {"out": None}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
