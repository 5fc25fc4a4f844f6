"""Node-wide partitioned GPU cache vs one cache per GPU (multi-GPU; run with torchrun, one process per GPU).

    torchrun --nproc_per_node=2 scripts/bench_partitioned.py --out DIR [--dataset cora --total-gb 2 --budget 0.01]

Rank 0 scales real rows up to ``--total-gb`` (bundled Cora by default: Cora-SU), compresses them and shares them in
POSIX shared memory; every rank attaches the one store (no copy). Ids: a Zipf trace (``--zipf``); hotness for the
static caches = each row's count in a separate presampled trace. Side by side on every GPU, same budget per GPU:

  per_gpu      a FeatureCache on this GPU alone (what each DDP process does today: every GPU caches the same rows)
  partitioned  PartitionedFeatureCache: the ranks cache disjoint shares of the hot rows and serve each other over
               NCCL (all_to_all_single); rows cached nowhere come from the shared host store, zero-copy

Reported per rank and in total: rows cached (node capacity vs one GPU's), hit rate (this GPU + peers vs this GPU
alone), fetch throughput (GB/s of output; CUDA events around each fetch, medians), and the rate of a batch that is
all peer hits vs all host misses. Every fetched batch of the first ``--verify`` is compared byte for byte with the
store's own decode (``CompressedRows.gather``). Rank 0 writes bench_partitioned.json and .png.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ibpcache import Codec, CompressedRows, FeatureCache, datasets
from ibpcache.cache.partitioned import PartitionedFeatureCache
from ibpcache.testing.timing import add_out_argument, format_table, write_results


def build_store(args: argparse.Namespace, rank: int, name: str) -> Any:
    """Rank 0: real rows scaled up, compressed on its GPU, shared; returns the segment handle (None elsewhere)."""
    if rank != 0:
        return None
    rows = datasets.load_rows(args.dataset)
    big = datasets.scale_up(rows, int(args.total_gb * 1e9), seed=0)
    dev = "cpu" if args.device == "cpu" else "cuda"
    codec = Codec.fit(big[: min(big.shape[0], 200_000)].to(dev))
    return codec.compress(big, layout="inplace", pin=False, device=dev).share(name)


def timed(fn: Any, batches: list[torch.Tensor], verify: int, rows: CompressedRows) -> dict[str, float]:
    """Median ms per batch (CUDA events; every rank runs the same number of batches in lockstep)."""
    times = []
    for k, ids in enumerate(batches):
        if ids.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(ids)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:  # --device cpu: a smoke run of the same code over gloo
            t0 = time.perf_counter()
            out = fn(ids)
            times.append((time.perf_counter() - t0) * 1e3)
        if k < verify:
            want = rows.gather(ids, device=ids.device)
            if not torch.equal(out.view(torch.uint8), want.view(torch.uint8)):
                raise AssertionError("partitioned/per-GPU fetch differs from the store's decode")
    med = float(np.median(times[2:] if len(times) > 4 else times))
    row_bytes = rows.row_bytes
    return {"median_ms": med, "GBps": batches[0].numel() * row_bytes / (med * 1e-3) / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(p)
    p.add_argument("--name", default="bench_partitioned")
    p.add_argument("--dataset", default="cora")
    p.add_argument("--total-gb", type=float, default=2.0)
    p.add_argument("--budget", type=float, default=0.01, help="cache bytes per GPU, as a fraction of the raw rows")
    p.add_argument("--batch", type=int, default=100_000)
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--verify", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a gloo smoke run")
    args = p.parse_args()

    cpu = args.device == "cpu"
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    if not cpu:
        torch.cuda.set_device(local)
    dev = torch.device("cpu") if cpu else torch.device("cuda", local)
    name = f"bench-part-{os.environ.get('MASTER_PORT', '0')}"
    seg = build_store(args, rank, name)
    dist.barrier()
    try:
        t0 = time.perf_counter()
        rows = CompressedRows.attach(name)
        attach_s = time.perf_counter() - t0
        n = rows.n_rows
        hotness = torch.bincount(datasets.zipf_ids(n, 2_000_000, args.zipf, seed=99), minlength=n).to(torch.float64)
        budget = int(args.budget * n * rows.row_bytes)
        per_gpu = FeatureCache(rows, budget_bytes=budget, policy="static", hotness=hotness, device=dev)
        part = PartitionedFeatureCache(rows, hotness, budget_bytes=budget, device=dev)
        batches = [datasets.zipf_ids(n, args.batch, args.zipf, seed=1000 * rank + k).to(dev)
                   for k in range(args.batches)]
        rec: dict[str, Any] = {"rank": rank, "world_size": world, "rows": n, "row_bytes": rows.row_bytes,
                               "ratio": rows.ratio, "attach_s": attach_s, "budget_bytes_per_gpu": budget}
        per_gpu.reset_stats()
        rec["per_gpu"] = timed(per_gpu.fetch, batches, args.verify, rows)
        st = per_gpu.stats()
        rec["per_gpu"].update(rows_cached=int(per_gpu.capacity_rows), hit_rate=float(st["hit_rate"]))
        part.reset_stats()
        rec["partitioned"] = timed(part.fetch, batches, args.verify, rows)
        pst = part.stats()
        rec["partitioned"].update(rows_cached_here=pst["rows_cached_here"], rows_cached_on_node=pst["rows_cached_on_node"],
                                  hit_rate=pst["hit_rate"], peer_fraction=pst["peer_hits"] / pst["requests"],
                                  local_hits=pst["local_hits"], peer_hits=pst["peer_hits"],
                                  host_misses=pst["host_misses"], bytes_sent=pst["bytes_sent"],
                                  bytes_received=pst["bytes_received"])
        # one kind of row per batch: all cached on a peer, all cached nowhere (host misses)
        holder = part.holder
        gen = torch.Generator(device="cpu").manual_seed(5 + rank)
        for label, mask in (("peer_hits", (holder >= 0) & (holder != rank)), ("host_misses", holder < 0)):
            pool = torch.nonzero(mask).reshape(-1).cpu()
            pick = [pool[torch.randint(0, pool.numel(), (args.batch,), generator=gen)].to(dev) for _ in range(12)]
            rec[label] = timed(part.fetch, pick, 2, rows)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, rec)
        if rank == 0:
            summary = {
                "node_capacity_vs_one_gpu": everyone[0]["partitioned"]["rows_cached_on_node"]
                / max(everyone[0]["per_gpu"]["rows_cached"], 1),
                "hit_rate_per_gpu": float(np.mean([r["per_gpu"]["hit_rate"] for r in everyone])),
                "hit_rate_partitioned": float(np.mean([r["partitioned"]["hit_rate"] for r in everyone])),
                "GBps_per_gpu_total": sum(r["per_gpu"]["GBps"] for r in everyone),
                "GBps_partitioned_total": sum(r["partitioned"]["GBps"] for r in everyone),
                "GBps_peer_hits": float(np.mean([r["peer_hits"]["GBps"] for r in everyone])),
                "GBps_host_misses": float(np.mean([r["host_misses"]["GBps"] for r in everyone])),
            }
            print(format_table([{"rank": r["rank"], "per_gpu GB/s": r["per_gpu"]["GBps"],
                                 "partitioned GB/s": r["partitioned"]["GBps"],
                                 "hit per_gpu": r["per_gpu"]["hit_rate"], "hit partitioned": r["partitioned"]["hit_rate"],
                                 "peer GB/s": r["peer_hits"]["GBps"], "host GB/s": r["host_misses"]["GBps"]}
                                for r in everyone]))
            print(summary)
            write_results(args.out, args.name, everyone, plot, meta={"args": vars(args) | {"out": str(args.out)},
                                                                      "summary": summary})
        dist.barrier()
    finally:
        if seg is not None:
            seg.unlink()
            seg.close()
        dist.destroy_process_group()


def plot(records: list[dict[str, Any]]):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    labels = [f"rank {r['rank']}" for r in records]
    xs = np.arange(len(records))
    for k, key in enumerate(("per_gpu", "partitioned")):
        axes[0].bar(xs + 0.4 * (k - 0.5), [r[key]["GBps"] for r in records], 0.4, label=key)
        axes[1].bar(xs + 0.4 * (k - 0.5), [r[key]["hit_rate"] for r in records], 0.4, label=key)
    axes[0].set_ylabel("fetch GB/s of output (Zipf batches)")
    axes[1].set_ylabel("hit rate (GPU caches)")
    for ax in axes:
        ax.set_xticks(xs, labels)
        ax.legend()
    fig.suptitle(f"partitioned vs per-GPU cache, {records[0]['world_size']} GPUs, {records[0]['rows']} rows")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
