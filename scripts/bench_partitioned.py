"""The node cache (PartitionedFeatureCache) vs one independent cache per GPU (multi-GPU; torchrun, one process per GPU).

    torchrun --nproc_per_node=2 scripts/bench_partitioned.py --out DIR \
        [--datasets cora_su,minilm_su --total-gb 2 --budgets 0.01,0.02 --replicate auto,0,0.25,0.5 \
         --traces zipf,hotset --hot-factor 1.5 --hot-share 0.9]

For each data set (``<name>_su``: a registered data set's real rows scaled up to ``--total-gb``; a plain name is
scaled up too), rank 0 compresses the rows and shares them in POSIX shared memory; every rank attaches the one store.
Ids, one trace per ``--traces`` value, drawn differently per rank over one fixed set of hot rows (the same rows are
hot on every rank and in every batch); hotness for the static caches = each row's count in a separate presampled
trace of the same law:

  zipf    a Zipf law (``--zipf``) over all rows: a long tail, so a second GPU's worth of cache adds few hits
  hotset  a working set (``datasets.hot_set_ids``): ``--hot-share`` of the ids uniform over ``--hot-factor`` times the
          rows one GPU's budget holds (estimated from the stored row bytes), the rest uniform over all rows: the hot
          set exceeds one GPU's cache and fits the node's, the case the node cache is for (the point's
          ``hot_set_vs_one_gpu`` is the hot rows over the rows one independent cache really holds)

For each budget per GPU, both methods live in the same processes:

  independent  a FeatureCache per GPU (every GPU caches the same hottest rows: what DDP does without a node cache)
  partitioned  PartitionedFeatureCache: the hottest rows replicated, the warm tail dealt to the GPUs, peer rows read
               by the one lookup launch straight from the owner's slab (CUDA IPC, NVLink); no collective per fetch.
               One per ``--replicate`` value: ``auto`` (method ``partitioned``: the head sized from per-source costs
               the cache measures at set-up, kept only if it beats the independent layout on a set-up batch) and
               fixed fractions of the budget for the head (method ``partitioned_r<f>``, e.g. ``partitioned_r0.25``;
               0 is a pure partition), so a point shows where the measured choice sits among fixed ones

Both fetch with ``validate="lazy"`` (no host sync). Each configuration runs ``--repeats`` times, the methods in turn
(round robin), after ``--warmup`` batches; CUDA events around each fetch, medians. The first ``--verify`` batches of
every run are compared byte for byte with the store's own decode. Also timed: a batch of ids that are all peer-owned
(peer hit GB/s), all host misses, all local (on the first method with peer access). Node GB/s = sum over ranks.
Rank 0 writes ``<name>.json`` (``{"points": [{"dataset", "trace", "gpus", "budget_per_gpu", "methods": {"partitioned":
{"GBps", "hit_rate", "replicate", "speedup", ...}, "partitioned_r0.25": {...}, "independent": {...}}, "speedup",
"speedups", ...}]}``; ``speedup`` and the point's other placement keys are the first ``--replicate`` value's; the
costs each ``auto`` cache measured are in ``meta.source_costs_us_per_row``) and ``<name>.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ibpcache import Codec, CompressedRows, FeatureCache, datasets
from ibpcache.cache.partitioned import HOST, LOCAL, PEER, PartitionedFeatureCache
from ibpcache.testing.timing import add_out_argument, format_table, write_results

TARGET_SPEEDUP, TARGET_PEER_GBPS = 1.3, 150.0
HOT_SEED = 7  # which rows are hot: one permutation for the whole benchmark
TRACES = ("zipf", "hotset")


def build_store(name: str, total_gb: float, device: str, rank: int, seg_name: str) -> Any:
    """Rank 0: real rows scaled up, compressed on its device, shared; returns the segment handle (None elsewhere)."""
    if rank != 0:
        return None
    base = name[:-3] if name.endswith("_su") else name
    rows = datasets.load_rows(base)
    big = datasets.scale_up(rows, int(total_gb * 1e9), seed=0)
    codec = Codec.fit(big[: min(big.shape[0], 200_000)].to(device))
    return codec.compress(big, layout="inplace", pin=False, device=device).share(seg_name)


def make_trace(kind: str, args: argparse.Namespace, rows: CompressedRows, budget: float, rank: int,
               dev: torch.device) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, Any]]:
    """(hotness counts for the static caches, this rank's batches, what the point records about the trace)."""
    n = rows.n_rows
    if kind == "zipf":
        def draw(count: int, seed: int) -> torch.Tensor:
            return datasets.zipf_ids(n, count, args.zipf, seed=seed, hot_seed=HOT_SEED)
        info: dict[str, Any] = {"trace": kind, "zipf": args.zipf}
    else:
        stored_per_row = max(rows.nbytes / n, 1.0)  # what one cached row takes, on average
        hot_rows = min(n, max(1, math.ceil(args.hot_factor * budget * n * rows.row_bytes / stored_per_row)))

        def draw(count: int, seed: int) -> torch.Tensor:
            return datasets.hot_set_ids(n, count, hot_rows, args.hot_share, seed=seed, hot_seed=HOT_SEED)
        info = {"trace": kind, "hot_rows": hot_rows, "hot_share": args.hot_share, "hot_factor": args.hot_factor}
    hot = torch.bincount(draw(2_000_000, 99), minlength=n).to(torch.float64)
    batches = [draw(args.batch, 1000 * rank + k).to(dev) for k in range(args.batches)]
    return hot, batches, info


def timed(fn: Callable[[torch.Tensor], torch.Tensor], batches: list[torch.Tensor], verify: int, rows: CompressedRows,
          warmup: int = 2) -> dict[str, float]:
    """Median ms per batch after ``warmup`` batches (CUDA events; every rank runs as many batches); the first
    ``verify`` outputs are checked against the store's decode."""
    times = []
    for k, ids in enumerate(batches):
        if ids.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(ids)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:  # --device cpu: a smoke run of the same code over gloo
            t0 = time.perf_counter()
            out = fn(ids)
            ms = (time.perf_counter() - t0) * 1e3
        if k >= warmup:
            times.append(ms)
        if k < verify:
            want = rows.gather(ids, device=ids.device)
            if not torch.equal(out.view(torch.uint8), want.view(torch.uint8)):
                raise AssertionError("fetch differs from the store's decode")
    med = float(np.median(times if times else [ms]))
    return {"median_ms": med, "GBps": batches[0].numel() * rows.row_bytes / (med * 1e-3) / 1e9}


def method_name(replicate: "str | float") -> str:
    """``partitioned`` for ``auto``, ``partitioned_r<f>`` for a fixed head fraction (``partitioned_r0.25``)."""
    return "partitioned" if replicate == "auto" else f"partitioned_r{float(replicate):g}"


def _replicates(text: str) -> "list[str | float]":
    vals: "list[str | float]" = []
    for v in (v.strip() for v in text.split(",") if v.strip()):
        vals.append("auto" if v == "auto" else float(v))
    if not vals or len({method_name(v) for v in vals}) != len(vals):
        raise SystemExit(f"--replicate: a comma list of distinct values ('auto' or fractions), got {text!r}")
    return vals


def run_budget(args: argparse.Namespace, rows: CompressedRows, hotness: torch.Tensor, batches: list[torch.Tensor],
               budget: float, dev: torch.device, rank: int) -> dict[str, Any]:
    """This rank's record for one budget: every method, ``--repeats`` rounds in turn, plus the one-kind batches."""
    n = rows.n_rows
    budget_bytes = int(budget * n * rows.row_bytes)
    lazy = {"validate": "lazy"} if dev.type == "cuda" else {}
    t0 = time.perf_counter()
    methods: dict[str, Any] = {"independent": FeatureCache(rows, budget_bytes=budget_bytes, policy="static",
                                                           hotness=hotness, device=dev, **lazy)}
    setup_s = {"independent": time.perf_counter() - t0}
    parts: dict[str, PartitionedFeatureCache] = {}
    for rep in args.replicate_values:
        t0 = time.perf_counter()
        parts[method_name(rep)] = PartitionedFeatureCache(rows, hotness, budget_bytes=budget_bytes, device=dev,
                                                          replicate=rep, track_sources=False)
        setup_s[method_name(rep)] = time.perf_counter() - t0
    methods.update(parts)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    hit: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, cache in methods.items():
            cache.reset_stats()
            runs[name].append(timed(cache.fetch, batches, args.verify, rows, args.warmup))
            hit[name] = float(cache.stats()["hit_rate"])
    rec: dict[str, Any] = {"rank": rank, "budget_per_gpu": budget, "budget_bytes": budget_bytes,
                           "methods": list(methods), "primary": method_name(args.replicate_values[0])}
    for name in methods:
        ms = float(np.median([r["median_ms"] for r in runs[name]]))
        rec[name] = {"median_ms": ms, "GBps": batches[0].numel() * rows.row_bytes / (ms * 1e-3) / 1e9,
                     "GBps_runs": [r["GBps"] for r in runs[name]], "hit_rate": hit[name], "setup_s": setup_s[name]}
    rec["independent"]["rows_cached"] = int(methods["independent"].capacity_rows)
    for name, part in parts.items():
        where = part.holder
        src = torch.bincount(torch.cat([where[b].to(torch.int64) for b in batches]).cpu(), minlength=3)
        st = part.stats()
        rec[name].update(rows_cached_here=st["rows_cached_here"], node_cached_rows=st["node_cached_rows"],
                         replicated_rows=st["replicated_rows"], owned_rows=st["owned_rows"],
                         local_fraction=float(src[LOCAL]) / float(src.sum()),
                         peer_fraction=float(src[PEER]) / float(src.sum()),
                         host_fraction=float(src[HOST]) / float(src.sum()),
                         peer_access=st["peer_access"], fallback_reason=st["fallback_reason"],
                         placement_rule=st["placement_rule"], replicate=st["replicate"],
                         placement_costs=list(st["placement_costs"]), costs_rule=st["costs_rule"],
                         source_costs_us_per_row=st["source_costs_us_per_row"], setup_check=st["setup_check"])
    # one-kind batches on the first method whose placement reads peers (peer access is agreed by every rank)
    probe_on = next((name for name, part in parts.items() if part.peer_access), next(iter(parts)))
    rec["kinds_timed_on"] = probe_on
    where = parts[probe_on].holder
    gen = torch.Generator().manual_seed(5 + rank)
    for label, kind in (("peer_hits", PEER), ("host_misses", HOST), ("local_hits", LOCAL)):
        pool = torch.nonzero(where.cpu() == kind).reshape(-1)
        ok = torch.tensor([int(pool.numel() > 0)], dtype=torch.int32, device=dev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank times the same kinds
        if not bool(ok):
            continue
        picks = [pool[torch.randint(0, pool.numel(), (args.batch,), generator=gen)].to(dev) for _ in range(12)]
        rec[label] = timed(parts[probe_on].fetch, picks, 2, rows, args.warmup)
    for part in parts.values():
        part.close()
    del methods, parts
    return rec


def point(dataset: str, everyone: list[dict[str, Any]], trace: dict[str, Any]) -> dict[str, Any]:
    """One JSON point from every rank's record of one (data set, trace, budget)."""
    world = len(everyone)
    names = everyone[0]["methods"]
    methods = {}
    for name in names:
        methods[name] = {"GBps": sum(r[name]["GBps"] for r in everyone),
                         "GBps_per_rank": [r[name]["GBps"] for r in everyone],
                         "GBps_runs_per_rank": [r[name]["GBps_runs"] for r in everyone],
                         "hit_rate": float(np.mean([r[name]["hit_rate"] for r in everyone])),
                         "setup_s": max(r[name]["setup_s"] for r in everyone)}
    one_gpu = everyone[0]["independent"]["rows_cached"]
    for name in names[1:]:
        p0 = everyone[0][name]
        methods[name].update(
            speedup=methods[name]["GBps"] / methods["independent"]["GBps"], replicate=p0["replicate"],
            node_capacity_vs_one_gpu=p0["node_cached_rows"] / max(one_gpu, 1), node_cached_rows=p0["node_cached_rows"],
            replicated_rows=p0["replicated_rows"], owned_rows=[r[name]["owned_rows"] for r in everyone],
            sources={k: float(np.mean([r[name][f"{k}_fraction"] for r in everyone]))
                     for k in ("local", "peer", "host")},
            peer_access=all(r[name]["peer_access"] for r in everyone), fallback_reason=p0["fallback_reason"],
            placement_rule=p0["placement_rule"], placement_costs=p0["placement_costs"], costs_rule=p0["costs_rule"],
            source_costs_us_per_row=p0["source_costs_us_per_row"], setup_check=p0["setup_check"])
    primary = everyone[0]["primary"]
    prim = methods[primary]
    speedup = prim["speedup"]
    if trace["trace"] == "hotset":
        exceeds = trace["hot_rows"] > one_gpu
        trace = trace | {"hot_set_vs_one_gpu": trace["hot_rows"] / max(one_gpu, 1)}
    else:
        exceeds = prim["node_cached_rows"] > one_gpu and methods["independent"]["hit_rate"] < 0.99
    peer = [r["peer_hits"]["GBps"] for r in everyone if "peer_hits" in r]
    pt = {"dataset": dataset, **trace, "gpus": world, "budget_per_gpu": everyone[0]["budget_per_gpu"],
          "methods": methods,
          "primary": primary, "speedup": speedup, "speedups": {m: methods[m]["speedup"] for m in names[1:]},
          "best_method": max(names, key=lambda m: methods[m]["GBps"]),
          "peer_hit_GBps": float(np.mean(peer)) if peer else None,
          "host_miss_GBps": _mean(everyone, "host_misses"), "local_hit_GBps": _mean(everyone, "local_hits"),
          "kinds_timed_on": everyone[0]["kinds_timed_on"],
          "node_capacity_vs_one_gpu": prim["node_capacity_vs_one_gpu"], "replicate": prim["replicate"],
          "replicated_rows": prim["replicated_rows"], "owned_rows": prim["owned_rows"], "sources": prim["sources"],
          "peer_access": prim["peer_access"], "fallback_reason": prim["fallback_reason"],
          "placement_rule": prim["placement_rule"], "hot_set_exceeds_one_gpu": exceeds}
    pt["bound"] = speedup_bound(pt)
    pt["targets"] = {"speedup": {"target": TARGET_SPEEDUP if exceeds else 1.0, "measured": speedup,
                                 "met": speedup >= (TARGET_SPEEDUP if exceeds else 1.0)},
                     "never_below_independent": {"target": 1.0, "measured": speedup, "met": speedup >= 1.0},
                     "peer_hit_GBps": {"target": TARGET_PEER_GBPS, "measured": pt["peer_hit_GBps"],
                                       "met": (pt["peer_hit_GBps"] or 0.0) >= TARGET_PEER_GBPS}}
    return pt


def speedup_bound(pt: dict[str, Any]) -> "dict[str, Any] | None":
    """What the per-source read speeds allow: seconds per byte = sum over sources of (fraction / GB/s).

    ``ceiling`` is the independent caches' cost over the cost of serving every row from local HBM: no placement can
    beat it. ``predicted`` applies the same model to each method's measured source fractions, so a measured speedup
    far below its prediction points at overheads outside the reads themselves.
    """
    local, peer, host = pt["local_hit_GBps"], pt["peer_hit_GBps"], pt["host_miss_GBps"]
    if not (local and peer and host):
        return None
    h = pt["methods"]["independent"]["hit_rate"]
    indep = h / local + (1.0 - h) / host
    predicted = {name: indep / (m["sources"]["local"] / local + m["sources"]["peer"] / peer
                                + m["sources"]["host"] / host)
                 for name, m in pt["methods"].items() if "sources" in m}
    return {"ceiling": indep * local, "predicted": predicted,
            "rule": "s/B = local/local_GBps + peer/peer_GBps + host/host_GBps; ceiling = every row a local hit"}


def _mean(everyone: list[dict[str, Any]], key: str) -> "float | None":
    vals = [r[key]["GBps"] for r in everyone if key in r]
    return float(np.mean(vals)) if vals else None


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(p)
    p.add_argument("--name", default="bench_partitioned")
    p.add_argument("--dataset", default="cora", help="one data set (kept for old command lines; see --datasets)")
    p.add_argument("--datasets", default=None, help="comma list, e.g. cora_su,minilm_su (default: --dataset)")
    p.add_argument("--total-gb", type=float, default=2.0)
    p.add_argument("--budget", type=float, default=0.01, help="cache bytes per GPU, as a fraction of the raw rows")
    p.add_argument("--budgets", default=None, help="comma list of budgets per GPU (default: --budget)")
    p.add_argument("--replicate", default="auto",
                   help="comma list, one node cache each: 'auto' (measured costs) or the fraction of each budget for "
                        "the shared head, e.g. auto,0,0.25,0.5 (the first is the point's 'speedup')")
    p.add_argument("--batch", type=int, default=100_000)
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="runs of each configuration, methods in turn")
    p.add_argument("--traces", default="zipf", help=f"comma list of {TRACES} (module docstring)")
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--hot-factor", type=float, default=1.5, help="hotset: hot rows / rows one GPU's budget holds")
    p.add_argument("--hot-share", type=float, default=0.9, help="hotset: the share of ids drawn from the hot set")
    p.add_argument("--verify", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a gloo smoke run")
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="start no further (data set, budget) once this many seconds have passed (0: no limit); "
                        "the points done are written, the rest listed in meta.skipped")
    args = p.parse_args()
    names = [d.strip() for d in (args.datasets or args.dataset).split(",") if d.strip()]
    budgets = _floats(args.budgets) if args.budgets else [args.budget]
    args.replicate_values = _replicates(args.replicate)
    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    if not traces or any(t not in TRACES for t in traces):
        raise SystemExit(f"--traces: a comma list of {TRACES}, got {args.traces!r}")

    started = time.perf_counter()
    cpu = args.device == "cpu"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if not cpu:
        torch.cuda.set_device(local)
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cpu") if cpu else torch.device("cuda", local)
    points: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    configs = [(d, t, b) for d in names for t in traces for b in budgets]
    skipped: list[dict[str, Any]] = []

    def out_of_time() -> bool:
        """Every rank takes rank 0's view of the deadline (so all skip the same configurations)."""
        late = [args.deadline_s > 0 and time.perf_counter() - started > args.deadline_s]
        dist.broadcast_object_list(late, src=0)
        return bool(late[0])

    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(configs), desc="bench_partitioned")
    try:
        for dataset in names:
            if out_of_time():
                skipped += [{"dataset": dataset, "trace": t, "budget_per_gpu": b} for t in traces for b in budgets]
                continue
            seg_name = f"bench-part-{os.environ.get('MASTER_PORT', '0')}-{dataset}"
            seg = build_store(dataset, args.total_gb, "cpu" if cpu else "cuda", rank, seg_name)
            dist.barrier()
            try:
                rows = CompressedRows.attach(seg_name)
                drawn: dict[Any, Any] = {}  # the Zipf trace does not depend on the budget: drawn once
                for kind, budget in [(t, b) for t in traces for b in budgets]:
                    if out_of_time():
                        skipped.append({"dataset": dataset, "trace": kind, "budget_per_gpu": budget})
                        continue
                    key = kind if kind == "zipf" else (kind, budget)
                    if key not in drawn:
                        drawn = {key: make_trace(kind, args, rows, budget, rank, dev)}
                    hot, batches, info = drawn[key]
                    rec = run_budget(args, rows, hot, batches, budget, dev, rank)
                    everyone: list[Any] = [None] * world
                    dist.all_gather_object(everyone, rec)
                    if rank == 0:
                        points.append(point(dataset, everyone, info))
                        records += [{"dataset": dataset, **info, **r} for r in everyone]
                        bar.update(1)
                del drawn
                del rows
                dist.barrier()
            finally:
                if seg is not None:
                    seg.unlink()
                    seg.close()
        if rank == 0:
            bar.close()
            print(format_table([{"dataset": q["dataset"], "trace": q["trace"], "budget": q["budget_per_gpu"],
                                 "method": m,
                                 "GB/s": q["methods"][m]["GBps"], "speedup": q["methods"][m].get("speedup", 1.0),
                                 "hit": q["methods"][m]["hit_rate"], "replicate": q["methods"][m].get("replicate"),
                                 "peer access": q["methods"][m].get("peer_access"),
                                 "setup s": q["methods"][m]["setup_s"]}
                                for q in points for m in q["methods"]]))
            costs = [{"dataset": q["dataset"], "budget_per_gpu": q["budget_per_gpu"], "method": m,
                      **q["methods"][m]["source_costs_us_per_row"]}
                     for q in points for m in q["methods"] if q["methods"][m].get("source_costs_us_per_row")]
            args_meta = {k: v for k, v in vars(args).items() if k != "replicate_values"} | {"out": str(args.out)}
            write_results(args.out, args.name, records, lambda _r: plot(points),
                          meta={"args": args_meta, "source_costs_us_per_row": costs, "skipped": skipped,
                                "elapsed_s": time.perf_counter() - started}, extra={"points": points})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def plot(points: list[dict[str, Any]]):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(max(12.0, 1.6 * len(points)), 4.2))
    labels = [f"{q['dataset']}\n{q['trace']}\n{q['budget_per_gpu']:g}/GPU" for q in points]
    xs = np.arange(len(points))
    names = list(points[0]["methods"]) if points else []
    width = 0.8 / max(len(names), 1)
    for k, key in enumerate(names):
        off = width * (k - (len(names) - 1) / 2)
        axes[0].bar(xs + off, [q["methods"][key]["GBps"] for q in points], width, label=key)
        axes[1].bar(xs + off, [q["methods"][key]["hit_rate"] for q in points], width, label=key)
    axes[0].set_ylabel("node fetch GB/s of output (sum over GPUs)")
    axes[1].set_ylabel("hit rate (GPU caches of the node)")
    for ax in axes:
        ax.set_xticks(xs, labels, fontsize=7)
        ax.legend(fontsize=7)
    fig.suptitle(f"node cache vs independent caches, {points[0]['gpus'] if points else 0} GPUs")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
