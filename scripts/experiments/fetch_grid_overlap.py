"""Experiment: does a fetch kernel with a bounded grid let a training step's kernels run beside it?

Hypothesis (issue 25, docs/results/2026-11-28-h200-h200x2-s44): a pipelined GraphSAGE epoch on MiniLM-SU rows is
1.01-1.06x the sum of its stages' GPU time, i.e. the fetch (bound by host reads over the link) and the training
step's kernels hardly run at the same time. The rows lookup fills every multiprocessor (16 blocks of 8 warps per
SM, grid-stride), so kernels on another stream wait for its blocks to drain. With a few blocks per SM the link
may still be saturated, with the rest of the GPU free for the step.

For each ``fetch_blocks_per_sm`` in 16, 8, 4, 2, 1 (then in reverse: every setting twice), on real MiniLM rows
(float32, 1536 B) tiled to ``--gb`` GB of pinned host rows, a 1% cache, Zipf ids:

* ``fetch_ms``: ``--fetches`` fetches of ``--ids`` ids alone (IBP(C/M) and raw rows);
* ``train_ms``: a stand-in training step alone (a chain of [``--m``, 1024] x [1024, 1024] matmuls) on another
  stream, sized to take about as long as the fetches;
* ``together_ms``: both at once, released by one gate kernel, from the gate to the later of the two ends;
* ``overlap``: (fetch_ms + train_ms) / together_ms (1.0: no overlap; 2.0: full).

Every fetch's output is checked against the rows (bit for bit). Writes ``fetch_grid_overlap.json`` / ``.png``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from ibpcache import datasets
from ibpcache.cache.feature_cache import FeatureCache
from ibpcache.datasets import zipf_ids
from ibpcache.testing.timing import add_out_argument, cuda_time, write_results

SETTINGS = (16, 8, 4, 2, 1)


def tiled_rows(gb: float) -> torch.Tensor:
    """Real MiniLM rows repeated to ``gb`` GB (the table's 30,522 rows are 47 MB)."""
    base = datasets.load_minilm()
    n = int(gb * (1 << 30)) // (base.shape[1] * 4)
    reps = -(-n // base.shape[0])
    return base.repeat(reps, 1)[:n].contiguous()


def timed(fn: Any, stream: torch.cuda.Stream, gate: "torch.cuda.Event | None") -> tuple[Any, Any]:
    """Enqueue ``fn`` on ``stream`` (after ``gate`` if given) between two timing events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        if gate is not None:
            stream.wait_event(gate)
        start.record(stream)
        fn()
        end.record(stream)
    return start, end


def measure(fc: FeatureCache, ids: list[torch.Tensor], outs: list[torch.Tensor], train: Any, repeats: int
            ) -> dict[str, float]:
    """Medians over ``repeats`` of the fetches alone, the step alone and both released together."""
    s_fetch, s_train = torch.cuda.Stream(), torch.cuda.Stream()

    def fetch_all() -> None:
        for i, o in zip(ids, outs):
            fc.fetch(i, out=o)

    alone_f, alone_t, both = [], [], []
    for _ in range(repeats):
        a = timed(fetch_all, s_fetch, None)
        torch.cuda.synchronize()
        b = timed(train, s_train, None)
        torch.cuda.synchronize()
        gate = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(20_000_000)  # hold both streams until each has its work enqueued
        gate.record()
        f = timed(fetch_all, s_fetch, gate)
        t = timed(train, s_train, gate)
        torch.cuda.synchronize()
        alone_f.append(a[0].elapsed_time(a[1]))
        alone_t.append(b[0].elapsed_time(b[1]))
        both.append(max(gate.elapsed_time(f[1]), gate.elapsed_time(t[1])))
    return {"fetch_ms": statistics.median(alone_f), "train_ms": statistics.median(alone_t),
            "together_ms": statistics.median(both)}


def parser(doc: str) -> argparse.ArgumentParser:
    """The options this experiment and ``fetch_sm_partition.py`` share (rows, ids, step size, repeats, --out)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=2.0)
    p.add_argument("--ids", type=int, default=60_000)
    p.add_argument("--fetches", type=int, default=5)
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=7)
    add_out_argument(p)
    return p


def workload(args: argparse.Namespace) -> "tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]":
    """(host rows, each fetch's ids on the GPU, the stand-in step's input and weight)."""
    rows = tiled_rows(args.gb)
    ids = [zipf_ids(rows.shape[0], args.ids, a=1.05, seed=s, hot_seed=0).cuda() for s in range(args.fetches)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.m, 1024, device="cuda", generator=gen)
    w = torch.randn(1024, 1024, device="cuda", generator=gen) / 32
    return rows, ids, x, w


def new_cache(rows: torch.Tensor, compress: bool) -> FeatureCache:
    """IBP(C/M) (``compress``) or raw rows, 1% cache, lazy id checks (no host sync per fetch)."""
    return FeatureCache(rows, 0.01, device="cuda", compress_cache=compress, compress_host=compress,
                        codec="auto" if compress else None, validate="lazy")


def stand_in_step(x: torch.Tensor, w: torch.Tensor, fetch_ms: float) -> "tuple[Any, int]":
    """A training step's stand-in: a chain of ``relu(y @ w)`` about ``fetch_ms`` long; (step, its matmuls)."""
    k = max(1, round(fetch_ms / cuda_time(lambda: torch.relu(x @ w), warmup=3, iters=10)["median_ms"]))

    def train() -> None:
        y = x
        for _ in range(k):
            y = torch.relu(y @ w)

    return train, k


def derived(m: dict[str, float], ids: list[torch.Tensor], rows: torch.Tensor) -> dict[str, float]:
    """From ``measure``'s times: their sum, the overlap (sum / together) and the fetches' output GB/s."""
    gb = sum(i.numel() for i in ids) * rows.shape[1] * rows.element_size() / 1e9
    return {"sum_ms": m["fetch_ms"] + m["train_ms"], "overlap": (m["fetch_ms"] + m["train_ms"]) / m["together_ms"],
            "fetch_output_gbps": gb / (m["fetch_ms"] * 1e-3)}


def main() -> None:
    args = parser(__doc__).parse_args()
    rows, ids, x, w = workload(args)
    records: list[dict[str, Any]] = []
    for name, compress in (("IBP(C/M)", True), ("raw", False)):
        fc = new_cache(rows, compress)
        outs = [torch.empty(args.ids, rows.shape[1], device="cuda") for _ in ids]
        for i, o in zip(ids, outs):  # warm-up, and every byte checked
            fc.fetch(i, out=o)
            assert torch.equal(o.cpu().view(torch.int32), rows[i.cpu()].view(torch.int32)), name
        fc.check_errors()
        train, k = stand_in_step(x, w, measure(fc, ids, outs, lambda: None, 3)["fetch_ms"])

        for run, order in enumerate((SETTINGS, tuple(reversed(SETTINGS)))):
            for b in order:
                fc.fetch_blocks_per_sm = b  # read at each fetch; the constructor checks a given value
                m = measure(fc, ids, outs, train, args.repeats)
                for i, o in zip(ids, outs):
                    assert torch.equal(o.cpu().view(torch.int32), rows[i.cpu()].view(torch.int32)), (name, b)
                rec = {"rows": name, "run": run, "fetch_blocks_per_sm": b, **m, "matmuls": k,
                       **derived(m, ids, rows), "hit_rate": fc.stats()["hit_rate"]}
                records.append(rec)
                print(f"{name:9s} run {run} blocks/SM {b:2d}: fetch {m['fetch_ms']:7.2f} ms "
                      f"({rec['fetch_output_gbps']:5.1f} GB/s out), step {m['train_ms']:7.2f}, together "
                      f"{m['together_ms']:7.2f} (sum {rec['sum_ms']:7.2f}, overlap {rec['overlap']:.2f}x)", flush=True)
        del fc
    write_results(args.out, "fetch_grid_overlap", records, plot,
                  meta={"gb": args.gb, "ids": args.ids, "fetches": args.fetches, "m": args.m,
                        "repeats": args.repeats, "rows": "MiniLM float32 [*, 384] tiled", "cache": 0.01})


def plot(records: list[dict[str, Any]]) -> Any:
    return overlap_plot(records, "fetch_blocks_per_sm", "fetch kernel blocks per SM", log2=True)


def overlap_plot(records: list[dict[str, Any]], x_key: str, x_label: str, log2: bool = False) -> Any:
    """Fetch alone and with the step (ms), and the overlap, against ``x_key``: one line per rows kind and run
    (records with an ``error`` left out)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, marker in (("IBP(C/M)", "o"), ("raw", "s")):
        for run in (0, 1):
            rs = sorted((r for r in records if r["rows"] == name and r["run"] == run and "error" not in r),
                        key=lambda r: r[x_key])
            xs = [r[x_key] for r in rs]
            axes[0].plot(xs, [r["fetch_ms"] for r in rs], marker=marker, label=f"{name} fetch alone, run {run}")
            axes[0].plot(xs, [r["together_ms"] for r in rs], marker=marker, ls="--",
                         label=f"{name} with the step, run {run}")
            axes[1].plot(xs, [r["overlap"] for r in rs], marker=marker, label=f"{name}, run {run}")
    for ax in axes:
        if log2:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(x_label)
    axes[0].set_ylabel("ms")
    axes[1].set_ylabel("(fetch + step alone) / together")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
