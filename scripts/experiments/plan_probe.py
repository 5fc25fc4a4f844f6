"""Experiment: what the host-layout planner decides for dense DLRM-width tables, and the timings it decides on.

``bench_dlrm.py`` reports which layout the embedding bags chose; this shows why. For real MiniLM values at the DLRM
grid's widths (512 B and 2 KB rows, fp32 and fp16; MiniLM's 384 columns repeated to fill a row) it runs the
planner's own calibration (``plan_layout.calibrate_layout``) with IBP and exponent candidates (exponent at the
fitted segment length and at 32 elements) and records its choice, its reason, the candidates' miss timings
(zero-copy from pinned memory) and hit timings (from device memory), and their ratios. GPU only (the planner times
nothing without CUDA); about 20 seconds:

    python scripts/experiments/plan_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from ibpcache import Codec, datasets  # noqa: E402
from ibpcache.cache.plan_layout import calibrate_layout  # noqa: E402
from ibpcache.testing.timing import add_out_argument, write_results  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def table(minilm: torch.Tensor, dtype: torch.dtype, row_bytes: int) -> torch.Tensor:
    """MiniLM's rows, columns repeated to ``row_bytes`` bytes of ``dtype``."""
    cols = row_bytes // torch.tensor([], dtype=dtype).element_size()
    reps = -(-cols // minilm.shape[1])
    return torch.cat([minilm] * reps, 1)[:, :cols].to(dtype).contiguous()


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--entry-bytes", default="512,2048")
    p.add_argument("--dtypes", default="fp32,fp16")
    p.add_argument("--segs", default="auto,32", help="exponent segment lengths to offer the planner, one run each")
    add_out_argument(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("plan_probe: needs a CUDA GPU (the planner times zero-copy and device-memory lookups)")
        return 2
    minilm = datasets.load_minilm(datasets.shared_data_dir())
    records = []
    for dname in [d for d in args.dtypes.split(",") if d]:
        for row_bytes in [int(b) for b in args.entry_bytes.split(",") if b]:
            x = table(minilm, DTYPES[dname], row_bytes)
            for seg in [s if s == "auto" else int(s) for s in args.segs.split(",") if s]:
                candidates = [Codec.fit(x, method="ibp"), Codec.fit(x, method="exponent", seg=seg)]
                choice = calibrate_layout(x, candidates, torch.device("cuda"))
                rec = {"dtype": dname, "row_bytes": row_bytes, "exp_seg": seg, "chosen": choice.method,
                       "reason": choice.reason, "ratios": choice.ratios, "miss_ms": choice.timings_ms,
                       "hit_ms": choice.hit_timings_ms, "batch": choice.batch}
                records.append(rec)
                print(f"{dname} {row_bytes:5d} B seg {seg!s:4s}: {choice.method:8s} {choice.reason}")
    write_results(args.out, "plan_probe", records, meta={"args": vars(args) | {"out": None}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
