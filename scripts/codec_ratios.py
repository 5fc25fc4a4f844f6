"""Stored ratios of the row codecs on real dense tables (CPU; ratios do not depend on the device).

Tables: the MiniLM word embeddings (float32, and their bfloat16 / float16 casts) with the values regrouped into
rows of 128, 512, 1536 (the table's own) and 2048 bytes, and the real SmolLM2 KV (K and V of both files, as
[layers * heads * tokens, 64] rows, one codec per table). For each: IBP, the exponent codec with ``seg="auto"`` and
with one segment, and ``method="auto"``. Every codec's round trip is checked bit-exact first.

Columns: ``ratio`` = raw bytes / stored row bytes (the paper's definition); ``stored`` = raw bytes / (row bytes +
codec tables + flags + int32 lengths) (inplace layout's tables); ``stored_packed`` adds the int64 offsets of the
packed layout. ``seg``/``S``: the exponent codec's segment size and segments per row.

``python scripts/codec_ratios.py --out DIR`` writes DIR/codec_ratios.json.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ibpcache import Codec, datasets
from ibpcache.testing.timing import add_out_argument, format_table, write_results

WIDTHS = (128, 512, 1536, 2048)
KV_CASES = [("chat", "k", "bf16"), ("chat", "v", "bf16"), ("chat", "k", "fp32"), ("chat", "v", "fp32"),
            ("code", "k", "fp16"), ("code", "v", "fp16")]


def regroup(x: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """The values of ``x`` (any shape) as rows of ``row_bytes`` bytes (a trailing partial row is dropped)."""
    d = row_bytes // x.element_size()
    flat = x.reshape(-1)
    return flat[: (flat.numel() // d) * d].reshape(-1, d)


def measure_codec(x: torch.Tensor, codec: Codec) -> dict[str, Any]:
    """Ratios of ``x`` under ``codec``, after a verified round trip of every row."""
    packed = codec.compress(x, layout="packed", pin=False)
    assert torch.equal(packed.decompress("cpu").contiguous().view(torch.uint8), x.contiguous().view(torch.uint8))
    n = packed.n_rows
    tables = codec.metadata_nbytes + packed.flags.numel() + 4 * n
    return {"method": codec.method, "ratio": packed.ratio,
            "stored": packed.raw_nbytes / (packed.nbytes + tables),
            "stored_packed": packed.raw_nbytes / (packed.nbytes + tables + 8 * n),
            "seg": getattr(codec, "seg", None), "S": getattr(codec, "n_seg", None)}


def measure(table: str, x: torch.Tensor) -> list[dict[str, Any]]:
    base = {"table": table, "dtype": str(x.dtype).replace("torch.", ""), "row_bytes": x[0].numel() * x.element_size(),
            "rows": int(x.shape[0])}
    out = [dict(base, variant="ibp", **measure_codec(x, Codec.fit(x, method="ibp")))]
    out.append(dict(base, variant="exponent seg=auto", **measure_codec(x, Codec.fit(x, method="exponent"))))
    one = Codec.fit(x, method="exponent", seg=int(x[0].numel()))
    out.append(dict(base, variant="exponent S=1", **measure_codec(x, one)))
    auto = Codec.fit(x, method="auto")
    out.append(dict(base, variant="auto", **measure_codec(x, auto)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(p)
    p.add_argument("--name", default="codec_ratios")
    args = p.parse_args()
    minilm = datasets.load_minilm()
    records: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cast = minilm.to(dtype)
        for width in WIDTHS:
            records += measure("minilm", regroup(cast, width))
    for name, which, dtype in KV_CASES:
        records += measure(f"kv_{name}_{which}", datasets.load_kv(name, which, dtype))
    cols = ("table", "dtype", "row_bytes", "variant", "method", "seg", "S", "ratio", "stored", "stored_packed")
    print(format_table([{k: r[k] for k in cols} for r in records]))
    write_results(args.out, args.name, records)


if __name__ == "__main__":
    main()
