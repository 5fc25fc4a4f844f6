"""Experiment: is a DLRM inference step of ``TableBatchedCachedEmbeddingBag`` bound by the host (Python + launches)
or by the device? Hypothesis: at batch 1024 the step (~0.25-0.6 ms timed with the device idle before it) is mostly
host time, so a larger cache (more admission work while slots are still free) or FBGEMM's own host work decide it.

For each configuration (26 tables of real 512 B rows, Zipf 1.05 stable trace, bench_dlrm's builders), after a
warm-up: (1) the step timed alone with CUDA events, device idle before it (bench_dlrm's measure); (2) the host time
of the call (perf_counter, no sync inside); (3) 50 steps enqueued back to back, ms per step; (4) ours: the same step
captured in a CUDA graph and replayed with new ids copied in, timed like (1), output verified; (5) torch.profiler:
kernels per step and their summed device time. Prints one JSON line per configuration.

    PYTHONPATH=$PWD:<fbgemm> python scripts/experiments/dlrm_step_overhead.py [--batches 1024,8192] [--ratios 0.01,0.1]
        [--entry-bytes 512] [--dtype fp32|fp16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from scripts import bench_dlrm as bd
from ibpcache import datasets


def timed_idle(fn, n: int) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def host_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def back_to_back(fn, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def profile(fn, n: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict = {}
    for e in kernels:
        by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + e.device_time / n
    top = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:12])
    return {"kernels_per_step": len(kernels) / n, "device_us_per_step": sum(by_name.values()),
            "top_us": {k: round(v, 1) for k, v in top.items()}}


def _graphed(m, trace, table_dev, rows: int, batch: int, inputs: list, ours: bool) -> dict:
    """Capture the module's forward in a CUDA graph after warm-up calls on a side stream, verify 5 replays with new
    ids against torch, and time replays like the eager step (FBGEMM: can a user capture its cached TBE at all?)."""
    static = (inputs[0][0].clone(),) if ours else (inputs[0][0].clone(), inputs[0][1].clone())
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(1 if ours else 3):
                m.module(*static)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            out = m.module(*static)
    except Exception as exc:  # noqa: BLE001 -- report why it cannot be captured
        return {"graph_error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    ok = True
    for _ in range(5):
        local = trace.batch(batch, 1)
        static[0].copy_(local.t() if ours else local.reshape(-1))  # ours: [B, T]; FBGEMM: table-major ids
        graph.replay()
        want = bd.reference(table_dev, local, rows, 1).to(out.dtype)
        ok &= bool(torch.equal(out.view(torch.uint8), want.view(torch.uint8)))
    it = iter(range(10 ** 9))

    def replay():
        static[0].copy_(inputs[next(it) % len(inputs)][0])
        graph.replay()

    return {"graph_idle_ms": timed_idle(replay, 60), "graph_host_ms": host_ms(replay, 60),
            "graph_b2b_ms": back_to_back(replay, 60), "graph_verified": ok}


def run(name: str, table: torch.Tensor, table_dev: torch.Tensor, rows: int, ratio: float, batch: int,
        tables: int) -> dict:
    dev = torch.device("cuda")
    m = bd.Method(name, table, tables, ratio, None, False, 0.01, dev)
    trace = bd.Trace("zipf-stable", rows, tables, 1.05, dev, 200)
    trace.reset(batch)
    for _ in range(400):
        m.step(m.inputs(trace.batch(batch, 1), 1), 1)
    inputs = [m.inputs(trace.batch(batch, 1), 1) for _ in range(60)]
    it = iter(range(10 ** 9))

    def step():
        m.step(inputs[next(it) % len(inputs)], 1)

    res = {"method": name, "ratio": ratio, "batch": batch, "idle_ms": timed_idle(step, 60), "host_ms": host_ms(step, 60),
           "b2b_ms": back_to_back(step, 60), **profile(step, 20)}
    if name.startswith("ibpcache"):
        st = m.module.stats()
        res["stats_plan"] = st.get("fused_plan")
        res["graph_stats"] = {k: v for k, v in st.items() if "graph" in k}
        res["admission"] = st.get("fused_admission")  # settled (passes skipped) or admitting every step
    res.update(_graphed(m, trace, table_dev, rows, batch, inputs, name.startswith("ibpcache")))
    del m
    bd.free_memory()
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1024,8192")
    p.add_argument("--ratios", default="0.01,0.1")
    p.add_argument("--methods", default="ibpcache,ibpcache_raw,fbgemm_lru,fbgemm_lfu")
    p.add_argument("--entry-bytes", type=int, default=512)
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16"], help="weights precision (FBGEMM's too)")
    args = p.parse_args()
    dtype = torch.float16 if args.dtype == "fp16" else torch.float32
    rows = int(1e9 // args.entry_bytes // args.tables)
    table = datasets.resample_rows(bd.real_rows(args.entry_bytes, dtype), rows * args.tables, seed=args.entry_bytes)
    table_dev = table.cuda()
    for ratio in [float(x) for x in args.ratios.split(",")]:
        for batch in [int(x) for x in args.batches.split(",")]:
            for name in args.methods.split(","):
                try:
                    res = run(name, table, table_dev, rows, ratio, batch, args.tables)
                    print(json.dumps({"entry_bytes": args.entry_bytes, "dtype": args.dtype, **res}), flush=True)
                except Exception as exc:  # a baseline that cannot load reports why and the rest go on
                    print(json.dumps({"method": name, "ratio": ratio, "batch": batch,
                                      "error": f"{type(exc).__name__}: {exc}"}), flush=True)


if __name__ == "__main__":
    main()
