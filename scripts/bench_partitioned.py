"""The node cache (PartitionedFeatureCache) vs one independent cache per GPU (multi-GPU; torchrun, one process per GPU).

    torchrun --nproc_per_node=2 scripts/bench_partitioned.py --out DIR \
        [--datasets cora_su,minilm_su --total-gb 2 --budgets 0.01,0.02 --replicate auto]

For each data set (``<name>_su``: a registered data set's real rows scaled up to ``--total-gb``; a plain name is
scaled up too), rank 0 compresses the rows and shares them in POSIX shared memory; every rank attaches the one store.
Ids: a Zipf trace (``--zipf``), different per rank; hotness for the static caches = each row's count in a separate
presampled trace. For each budget per GPU, both methods live in the same processes:

  independent  a FeatureCache per GPU (every GPU caches the same hottest rows: what DDP does without a node cache)
  partitioned  PartitionedFeatureCache: the hottest rows replicated, the warm tail dealt to the GPUs, peer rows read
               by the one lookup launch straight from the owner's slab (CUDA IPC, NVLink); no collective per fetch

Both fetch with ``validate="lazy"`` (no host sync). Each configuration runs ``--repeats`` times, the methods in turn
(round robin), after ``--warmup`` batches; CUDA events around each fetch, medians. The first ``--verify`` batches of
every run are compared byte for byte with the store's own decode. Also timed: a batch of ids that are all peer-owned
(peer hit GB/s), all host misses, all local. Node GB/s = sum over ranks. Rank 0 writes ``<name>.json``
(``{"points": [{"dataset", "gpus", "budget_per_gpu", "methods": {"partitioned": {"GBps", "hit_rate"},
"independent": {...}}, ...}]}``) and ``<name>.png``.
"""

from __future__ import annotations

import argparse
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


def build_store(name: str, total_gb: float, device: str, rank: int, seg_name: str) -> Any:
    """Rank 0: real rows scaled up, compressed on its device, shared; returns the segment handle (None elsewhere)."""
    if rank != 0:
        return None
    base = name[:-3] if name.endswith("_su") else name
    rows = datasets.load_rows(base)
    big = datasets.scale_up(rows, int(total_gb * 1e9), seed=0)
    codec = Codec.fit(big[: min(big.shape[0], 200_000)].to(device))
    return codec.compress(big, layout="inplace", pin=False, device=device).share(seg_name)


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


def run_budget(args: argparse.Namespace, rows: CompressedRows, hotness: torch.Tensor, batches: list[torch.Tensor],
               budget: float, dev: torch.device, rank: int) -> dict[str, Any]:
    """This rank's record for one budget: both methods, ``--repeats`` rounds in turn, plus the one-kind batches."""
    n = rows.n_rows
    budget_bytes = int(budget * n * rows.row_bytes)
    lazy = {"validate": "lazy"} if dev.type == "cuda" else {}
    indep = FeatureCache(rows, budget_bytes=budget_bytes, policy="static", hotness=hotness, device=dev, **lazy)
    part = PartitionedFeatureCache(rows, hotness, budget_bytes=budget_bytes, device=dev,
                                   replicate=args.replicate if args.replicate == "auto" else float(args.replicate),
                                   track_sources=False)
    methods = {"independent": indep, "partitioned": part}
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    hit: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, cache in methods.items():
            cache.reset_stats()
            runs[name].append(timed(cache.fetch, batches, args.verify, rows, args.warmup))
            hit[name] = float(cache.stats()["hit_rate"])
    rec: dict[str, Any] = {"rank": rank, "budget_per_gpu": budget, "budget_bytes": budget_bytes}
    for name in methods:
        ms = float(np.median([r["median_ms"] for r in runs[name]]))
        rec[name] = {"median_ms": ms, "GBps": batches[0].numel() * rows.row_bytes / (ms * 1e-3) / 1e9,
                     "GBps_runs": [r["GBps"] for r in runs[name]], "hit_rate": hit[name]}
    rec["independent"]["rows_cached"] = int(indep.capacity_rows)
    where = part.holder
    src = torch.bincount(torch.cat([where[b].to(torch.int64) for b in batches]).cpu(), minlength=3)
    st = part.stats()
    rec["partitioned"].update(rows_cached_here=st["rows_cached_here"], node_cached_rows=st["node_cached_rows"],
                              replicated_rows=st["replicated_rows"], owned_rows=st["owned_rows"],
                              local_fraction=float(src[LOCAL]) / float(src.sum()),
                              peer_fraction=float(src[PEER]) / float(src.sum()),
                              host_fraction=float(src[HOST]) / float(src.sum()),
                              peer_access=st["peer_access"], fallback_reason=st["fallback_reason"],
                              placement_rule=st["placement_rule"])
    gen = torch.Generator().manual_seed(5 + rank)
    for label, kind in (("peer_hits", PEER), ("host_misses", HOST), ("local_hits", LOCAL)):
        pool = torch.nonzero(where.cpu() == kind).reshape(-1)
        ok = torch.tensor([int(pool.numel() > 0)], dtype=torch.int32, device=dev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank times the same kinds
        if not bool(ok):
            continue
        picks = [pool[torch.randint(0, pool.numel(), (args.batch,), generator=gen)].to(dev) for _ in range(12)]
        rec[label] = timed(part.fetch, picks, 2, rows, args.warmup)
    part.close()
    del indep, part
    return rec


def point(dataset: str, everyone: list[dict[str, Any]]) -> dict[str, Any]:
    """One JSON point from every rank's record of one (data set, budget)."""
    world = len(everyone)
    methods = {}
    for name in ("partitioned", "independent"):
        methods[name] = {"GBps": sum(r[name]["GBps"] for r in everyone),
                         "GBps_per_rank": [r[name]["GBps"] for r in everyone],
                         "GBps_runs_per_rank": [r[name]["GBps_runs"] for r in everyone],
                         "hit_rate": float(np.mean([r[name]["hit_rate"] for r in everyone]))}
    p0 = everyone[0]["partitioned"]
    speedup = methods["partitioned"]["GBps"] / methods["independent"]["GBps"]
    one_gpu = everyone[0]["independent"]["rows_cached"]
    exceeds = p0["node_cached_rows"] > one_gpu and methods["independent"]["hit_rate"] < 0.99
    peer = [r["peer_hits"]["GBps"] for r in everyone if "peer_hits" in r]
    pt = {"dataset": dataset, "gpus": world, "budget_per_gpu": everyone[0]["budget_per_gpu"], "methods": methods,
          "speedup": speedup, "peer_hit_GBps": float(np.mean(peer)) if peer else None,
          "host_miss_GBps": _mean(everyone, "host_misses"), "local_hit_GBps": _mean(everyone, "local_hits"),
          "node_capacity_vs_one_gpu": p0["node_cached_rows"] / max(one_gpu, 1),
          "replicated_rows": p0["replicated_rows"], "owned_rows": [r["partitioned"]["owned_rows"] for r in everyone],
          "sources": {k: float(np.mean([r["partitioned"][f"{k}_fraction"] for r in everyone]))
                      for k in ("local", "peer", "host")},
          "peer_access": all(r["partitioned"]["peer_access"] for r in everyone),
          "fallback_reason": p0["fallback_reason"], "placement_rule": p0["placement_rule"],
          "hot_set_exceeds_one_gpu": exceeds}
    pt["targets"] = {"speedup": {"target": TARGET_SPEEDUP if exceeds else 1.0, "measured": speedup,
                                 "met": speedup >= (TARGET_SPEEDUP if exceeds else 1.0)},
                     "peer_hit_GBps": {"target": TARGET_PEER_GBPS, "measured": pt["peer_hit_GBps"],
                                       "met": (pt["peer_hit_GBps"] or 0.0) >= TARGET_PEER_GBPS}}
    return pt


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
    p.add_argument("--replicate", default="auto", help="'auto' or the fraction of each budget for the shared head")
    p.add_argument("--batch", type=int, default=100_000)
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="runs of each configuration, methods in turn")
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--verify", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a gloo smoke run")
    args = p.parse_args()
    names = [d.strip() for d in (args.datasets or args.dataset).split(",") if d.strip()]
    budgets = _floats(args.budgets) if args.budgets else [args.budget]

    cpu = args.device == "cpu"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if not cpu:
        torch.cuda.set_device(local)
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cpu") if cpu else torch.device("cuda", local)
    points: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    configs = [(d, b) for d in names for b in budgets]
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(configs), desc="bench_partitioned")
    try:
        for dataset in names:
            seg_name = f"bench-part-{os.environ.get('MASTER_PORT', '0')}-{dataset}"
            seg = build_store(dataset, args.total_gb, "cpu" if cpu else "cuda", rank, seg_name)
            dist.barrier()
            try:
                rows = CompressedRows.attach(seg_name)
                n = rows.n_rows
                hot = torch.bincount(datasets.zipf_ids(n, 2_000_000, args.zipf, seed=99), minlength=n)
                batches = [datasets.zipf_ids(n, args.batch, args.zipf, seed=1000 * rank + k).to(dev)
                           for k in range(args.batches)]
                for budget in budgets:
                    rec = run_budget(args, rows, hot.to(torch.float64), batches, budget, dev, rank)
                    everyone: list[Any] = [None] * world
                    dist.all_gather_object(everyone, rec)
                    if rank == 0:
                        points.append(point(dataset, everyone))
                        records += [{"dataset": dataset, **r} for r in everyone]
                        bar.update(1)
                del rows
                dist.barrier()
            finally:
                if seg is not None:
                    seg.unlink()
                    seg.close()
        if rank == 0:
            bar.close()
            print(format_table([{"dataset": q["dataset"], "budget": q["budget_per_gpu"],
                                 "indep GB/s": q["methods"]["independent"]["GBps"],
                                 "part GB/s": q["methods"]["partitioned"]["GBps"], "speedup": q["speedup"],
                                 "hit indep": q["methods"]["independent"]["hit_rate"],
                                 "hit part": q["methods"]["partitioned"]["hit_rate"],
                                 "peer GB/s": q["peer_hit_GBps"], "peer access": q["peer_access"]} for q in points]))
            write_results(args.out, args.name, records, lambda _r: plot(points),
                          meta={"args": vars(args) | {"out": str(args.out)}}, extra={"points": points})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def plot(points: list[dict[str, Any]]):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    labels = [f"{q['dataset']}\n{q['budget_per_gpu']:g}/GPU" for q in points]
    xs = np.arange(len(points))
    for k, key in enumerate(("independent", "partitioned")):
        axes[0].bar(xs + 0.4 * (k - 0.5), [q["methods"][key]["GBps"] for q in points], 0.4, label=key)
        axes[1].bar(xs + 0.4 * (k - 0.5), [q["methods"][key]["hit_rate"] for q in points], 0.4, label=key)
    axes[0].set_ylabel("node fetch GB/s of output (sum over GPUs)")
    axes[1].set_ylabel("hit rate (GPU caches of the node)")
    for ax in axes:
        ax.set_xticks(xs, labels)
        ax.legend()
    fig.suptitle(f"node cache vs independent caches, {points[0]['gpus'] if points else 0} GPUs")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
