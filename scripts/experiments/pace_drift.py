"""Experiment: what does the settled admission pace cost in hit rate on a moving hot set, and which settings cut it?

Hit rates depend only on the admission decisions, which the CPU twin of the admission kernels makes as the GPU does
(``kernels/admit_cpu.py``), so this runs on the CPU: ``FusedLookup`` over a raw host store of real MiniLM values
(narrow rows: the row width does not change which rows are cached when slots hold raw rows), ids from
``bench_dlrm.Trace`` (``zipf-drift``: the hot set drawn anew every ``--period`` steps; ``zipf-stable``). For each pace
setting (``every=1`` admits every step: the yardstick): the hit rate per step, the mean over the steps after the
first move, the share of steps that skipped the pass (the device time the pace saves), and per move the steps until
the 16-step hit rate is back within 1 point of every-step admission's. Writes JSON + PNG.

    PYTHONPATH=$PWD python scripts/experiments/pace_drift.py [--tables 26] [--rows-per-table 75120] [--batch 4096]
        [--steps 800] [--period 200] [--ratio 0.1] [--configs "every=1;every=4;every=4,window=8"]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ibpcache import datasets
from ibpcache.cache.host_store import FitOptions, HostStore
from ibpcache.cache.row_cache import CachedRowManager
from ibpcache.testing.timing import add_out_argument, write_results
from scripts import bench_dlrm as bd

_KNOBS = {"every": int, "window": int, "span": int, "rise": float, "drop": float, "min_requests": int}


def parse_config(text: str) -> dict[str, Any]:
    """``"every=4,window=8"`` -> {"every": 4, "window": 8}."""
    out: dict[str, Any] = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in _KNOBS:
            raise SystemExit(f"unknown pace setting {key!r}; choose from {sorted(_KNOBS)}")
        out[key] = _KNOBS[key](value)
    return out


def run(table: torch.Tensor, rows: int, tables: int, ratio: float, batch: int, steps: int, trace_kind: str,
        period: int, config: dict[str, Any]) -> dict[str, Any]:
    store = HostStore(table, codec=FitOptions(), compress=False, device=torch.device("cpu"))
    mgr = CachedRowManager(store, int(rows * tables * ratio), strategy="lfu", ids_freq_mapping=None,
                           warmup_ratio=0.0)
    fused = mgr.fused_lookup(compress_cache=False, settled_admit_every=config.get("every", 1))
    fused.planner.fix("single", "sorted")  # an unstaged way: the one a settled cache skips on
    for key, value in config.items():
        if key != "every":
            setattr(fused.pace, key, value)
    trace = bd.Trace(trace_kind, rows, tables, 1.05, torch.device("cpu"), period)
    trace.reset(0)
    base = torch.arange(tables, dtype=torch.int64).unsqueeze(1) * rows
    out = torch.empty((batch * tables, table.shape[1]))
    rates = []
    for step in range(steps):
        ids = (trace.batch(batch, 1) + base).t().reshape(-1)  # sample-major global rows
        before = fused.adm_stats[:2].clone()
        fused.pool(ids, None, 1, ids.numel(), False, "sum", None, out, None)
        if step % 100 == 0:
            assert torch.equal(out.view(torch.uint8), table[ids].view(torch.uint8)), f"step {step}"
        d = fused.adm_stats[:2] - before
        rates.append(float(d[1]) / float(d[0]))
    pace = fused.pace.stats()
    return {"config": config, "trace": trace_kind, "rates": rates, "slots": fused.n_slots,
            "oracle_hit_rate": trace.oracle(fused.n_slots), "skipped_share": pace["skipped_steps"] / steps,
            "settles": pace["settles"], "unsettles": pace["unsettles"]}


def recovery(rates: list[float], ref: list[float], period: int, tol: float = 0.01, span: int = 16) -> list:
    """Per move: steps until the ``span``-step mean hit rate is within ``tol`` of the yardstick's over the same steps
    (None if never before the next move)."""
    out = []
    for move in range(period, len(rates), period):
        found = None
        for s in range(move, min(move + period, len(rates)) - span + 1):
            if sum(rates[s: s + span]) / span >= sum(ref[s: s + span]) / span - tol:
                found = s - move
                break
        out.append(found)
    return out


def plot(records: list[dict[str, Any]]) -> Any:
    import matplotlib.pyplot as plt

    traces = sorted({r["trace"] for r in records})
    fig, axes = plt.subplots(1, len(traces), figsize=(7 * len(traces), 4), squeeze=False)
    for ax, kind in zip(axes[0], traces):
        for r in (r for r in records if r["trace"] == kind):
            k = 16
            smooth = [sum(r["rates"][i: i + k]) / k for i in range(len(r["rates"]) - k + 1)]
            ax.plot(smooth, label=f"{r['label']} (skipped {r['skipped_share']:.0%})")
        ax.axhline(records[0]["oracle_hit_rate"], color="k", ls=":", label="static top-k oracle")
        ax.set_title(f"{kind}: hit rate, 16-step mean")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(p)
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows-per-table", type=int, default=75_120, help="bench_dlrm's 512 B tables: 1 GB in all")
    p.add_argument("--dim", type=int, default=16, help="floats per row (MiniLM's first columns)")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--period", type=int, default=200, help="zipf-drift: steps between two hot sets")
    p.add_argument("--ratio", type=float, default=0.1)
    p.add_argument("--traces", default="zipf-drift,zipf-stable")
    p.add_argument("--configs", default="every=1;every=4;every=4,window=8;every=4,drop=0.01;every=4,window=8,drop=0.01")
    p.add_argument("--name", default="pace_drift")
    args = p.parse_args()
    rows, tables = args.rows_per_table, args.tables
    table = datasets.resample_rows(bd.real_rows(4 * args.dim), rows * tables, seed=1)
    records = []
    for kind in args.traces.split(","):
        ref = None
        for text in args.configs.split(";"):
            rec = run(table, rows, tables, args.ratio, args.batch, args.steps, kind, args.period, parse_config(text))
            rec["label"] = text
            if ref is None:
                ref = rec["rates"]
            after = rec["rates"][args.period:]
            rec["mean_hit_rate_after_first_move"] = sum(after) / len(after)
            rec["loss_vs_first_config_points"] = 100 * (sum(ref[args.period:]) / len(after) - rec[
                "mean_hit_rate_after_first_move"])
            if kind == "zipf-drift":
                rec["recovery_steps"] = recovery(rec["rates"], ref, args.period)
            print(f"{kind:12s} {text:32s} hit {rec['mean_hit_rate_after_first_move']:.4f} "
                  f"(-{rec['loss_vs_first_config_points']:.2f} pt) skipped {rec['skipped_share']:.0%} "
                  f"recovery {rec.get('recovery_steps')}", flush=True)
            records.append(rec)
    write_results(args.out, args.name, records, plot, meta=vars(args) | {"out": str(args.out)})


if __name__ == "__main__":
    main()
