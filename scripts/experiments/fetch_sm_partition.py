"""Experiment: does giving the fetch its own multiprocessors let a training step run beside it?

Hypothesis (issue 25, docs/results/2026-11-28-h200-s45): a pipelined GraphSAGE epoch on MiniLM-SU or Cora-SU rows
is 0.99-1.06x its stages' GPU time summed: the fetch (bound by host reads over the link) and the step's kernels do
not run at the same time. A bounded fetch grid did not help (fetch_grid_overlap.py: overlap 1.05-1.21x): a matmul
block seemingly cannot share an SM with a fetch block. CUDA green contexts split the SMs instead: the fetch's
kernels on a stream of a context with ``k`` SMs, the step's on a stream of a context with the others, so neither
waits for the other's blocks to leave an SM. The fetch keeps its throughput if ``k`` SMs keep enough host reads in
flight for the link.

For each ``k`` in ``--sms`` (and, as the baseline, no partition: two streams of the primary context), in that order
and then in reverse (every setting twice), on real MiniLM rows (float32, 1536 B) tiled to ``--gb`` GB of pinned
host rows, a 1% cache, Zipf ids, IBP(C/M) and raw rows:

* ``fetch_ms``: ``--fetches`` fetches of ``--ids`` ids alone; ``train_ms``: a stand-in step alone (a chain of
  [``--m``, 1024] x [1024, 1024] matmuls, sized to take about as long as the fetches);
* ``together_ms``: both enqueued at once; ``overlap``: (fetch_ms + train_ms) / together_ms (1.0: none; 2.0: full).

Times are host wall clock between stream synchronizations (medians of ``--repeats``): events and device-wide syncs
are per context. Every fetch's output is checked against the rows, bit for bit. The green contexts are the library's
(:func:`ibpcache.loaders.sm_split.split_sms`: two disjoint SM sets; records say the SMs granted). Where a setting
cannot run, the record says why and the run goes on without it. Writes ``fetch_sm_partition.json`` / ``.png``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from ibpcache.loaders.sm_split import split_sms
from ibpcache.testing.timing import write_results
from fetch_grid_overlap import (derived, new_cache, overlap_plot, parser,  # sys.path[0] when run as a script
                                stand_in_step, workload)


def green_streams(k: int) -> "tuple[Any, Any, dict[str, Any]]":
    """(fetch stream on ``k`` SMs, step stream on the others, how they were split): the library's split
    (:func:`ibpcache.loaders.sm_split.split_sms`, disjoint SM sets), as ``PipelinedLoader(fetch_sms=k)`` uses it."""
    split = split_sms(torch.cuda.current_device(), k)
    return split.fetch_stream, split.step_stream, {"made_by": "split_sms", "disjoint": True,
                                                   "fetch_sms_granted": split.fetch_sms,
                                                   "train_sms_granted": split.step_sms}


def wall(fns: "list[tuple[Callable[[], None], Any]]") -> float:
    """ms from enqueueing every ``fn`` on its stream to the end of the last, host clock."""
    for _, s in fns:
        s.synchronize()
    t0 = time.perf_counter()
    for fn, s in fns:
        with torch.cuda.stream(s):
            fn()
    for _, s in fns:
        s.synchronize()
    return (time.perf_counter() - t0) * 1e3


def measure(fetch_all: Callable[[], None], train: Callable[[], None], s_fetch: Any, s_train: Any, repeats: int
            ) -> dict[str, float]:
    f, t, both = [], [], []
    for _ in range(repeats):
        f.append(wall([(fetch_all, s_fetch)]))
        t.append(wall([(train, s_train)]))
        both.append(wall([(fetch_all, s_fetch), (train, s_train)]))
    return {"fetch_ms": statistics.median(f), "train_ms": statistics.median(t),
            "together_ms": statistics.median(both)}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--sms", default="16,32,48,66", help="SMs of the fetch's context, comma-separated")
    args = p.parse_args()
    total = torch.cuda.get_device_properties(0).multi_processor_count
    settings: list[int] = [0] + [int(s) for s in args.sms.split(",")]  # 0: no partition (the baseline)
    rows, ids, x, w = workload(args)
    expect = [rows[i.cpu()].view(torch.int32) for i in ids]
    records: list[dict[str, Any]] = []
    for name, compress in (("IBP(C/M)", True), ("raw", False)):
        fc = new_cache(rows, compress)
        outs = [torch.empty(args.ids, rows.shape[1], device="cuda") for _ in ids]

        def fetch_all() -> None:
            for i, o in zip(ids, outs):
                fc.fetch(i, out=o)

        def check(what: str) -> None:
            for o, e in zip(outs, expect):
                assert torch.equal(o.cpu().view(torch.int32), e), what

        fetch_all()
        torch.cuda.synchronize()
        check(name)
        train, k_mm = stand_in_step(x, w, measure(fetch_all, lambda: None, torch.cuda.Stream(), torch.cuda.Stream(),
                                                 3)["fetch_ms"])

        for run, order in enumerate((settings, list(reversed(settings)))):
            for k in order:
                rec: dict[str, Any] = {"rows": name, "run": run, "fetch_sms": k or total,
                                       "partitioned": bool(k), "train_sms": total - k if k else total,
                                       "matmuls": k_mm}
                try:
                    if k:
                        s_fetch, s_train, how = green_streams(k)
                        rec.update(how)
                    else:
                        s_fetch, s_train = torch.cuda.Stream(), torch.cuda.Stream()
                    with torch.cuda.stream(s_fetch):
                        fetch_all()  # warm-up on this stream: a launch failure shows here
                    s_fetch.synchronize()
                    m = measure(fetch_all, train, s_fetch, s_train, args.repeats)
                    check(f"{name} k={k}")
                    fc.check_errors()
                except Exception as exc:  # noqa: BLE001 - an experiment: record why a setting could not run
                    rec["error"] = f"{type(exc).__name__}: {exc}"
                    records.append(rec)
                    print(f"{name:9s} run {run} fetch SMs {k or total:3d}: {rec['error']}", flush=True)
                    continue
                rec.update(m, **derived(m, ids, rows))
                records.append(rec)
                print(f"{name:9s} run {run} fetch SMs {rec['fetch_sms']:3d} / step SMs {rec['train_sms']:3d}: fetch "
                      f"{m['fetch_ms']:7.2f} ms ({rec['fetch_output_gbps']:5.1f} GB/s out), step {m['train_ms']:7.2f}, "
                      f"together {m['together_ms']:7.2f} (overlap {rec['overlap']:.2f}x)", flush=True)
        del fc
    write_results(args.out, "fetch_sm_partition", records, plot,
                  meta={"gb": args.gb, "ids": args.ids, "fetches": args.fetches, "m": args.m, "sms": settings,
                        "device_sms": total, "repeats": args.repeats, "rows": "MiniLM float32 [*, 384] tiled",
                        "cache": 0.01, "torch": torch.__version__})


def plot(records: list[dict[str, Any]]) -> Any:
    return overlap_plot(records, "fetch_sms", "the fetch's SMs (all: no partition)")


if __name__ == "__main__":
    main()
