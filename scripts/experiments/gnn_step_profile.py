"""Where the GraphSAGE training step's time goes, on the host and on the GPU (issue 25: a pipelined epoch is bound by
the training stage's host time with eager steps, by the GPU's work or the stages' overlap with graphed ones).

``scripts/train_gnn.py`` reports each stage's host and GPU time per epoch, not what they are made of. This times
the step (``examples.gnn.pipeline.make_step``: ``GraphedStep`` as ``train_gnn.py`` runs it by default, or the eager
``_step`` with ``--no-step-graphs``) alone on real sampled batches (the torch sampler on the training device,
Cora-SU rows, train_gnn's model, optimizer and deterministic settings), back to back and between syncs, then once
more under ``torch.profiler``: the ops by self CPU time and calls per step, the kernels by GPU time per step (none on
the CPU), and the CUDA launches per step.
JSON (+ PNG of the top ops) to ``--out``.

    python scripts/experiments/gnn_step_profile.py --nodes 500000 --steps 20 [--no-step-graphs]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: deterministic matmuls

from examples.gnn import pipeline as gnn  # noqa: E402
from ibpcache.testing.timing import add_out_argument, write_results  # noqa: E402


def _batches(ds: gnn.GnnDataset, cfg: gnn.TrainConfig, device: torch.device, steps: int) -> list[Any]:
    """``steps`` training batches with their features on ``device`` (read from the host rows, untimed)."""
    sampler = gnn.build_torch_sampler(ds, cfg, device)
    sampled = list(itertools.islice(iter(gnn._batches(ds, None, cfg, device, sampler, train=True)), steps))
    return [gnn._Batch(s.input_nodes, s.blocks, ds.node_rows(s.input_nodes.cpu()).to(device), s.y) for s in sampled]


def _timed(step: Any, batches: list[Any], device: torch.device) -> dict[str, float]:
    """Median wall ms of one step between syncs, and of the steps back to back (host-bound if close)."""
    one = []
    for b in batches:
        gnn._sync(device)
        t0 = time.perf_counter()
        step(b)
        gnn._sync(device)
        one.append((time.perf_counter() - t0) * 1e3)
    gnn._sync(device)
    t0 = time.perf_counter()
    for b in batches:
        step(b)
    gnn._sync(device)
    return {"step_ms_median": float(np.median(one)), "steps_back_to_back_ms": (time.perf_counter() - t0) * 1e3 /
            len(batches)}


def _profile(step: Any, batches: list[Any], top: int, device: torch.device) -> dict[str, Any]:
    """Self CPU time and calls per step of the top ops, and CUDA launches per step, under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for b in batches:
            step(b)
        gnn._sync(device)
    n = len(batches)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    ops = [{"op": e.key, "self_cpu_us_per_step": e.self_cpu_time_total / n, "calls_per_step": e.count / n}
           for e in rows[:top]]
    launches = sum(e.count for e in rows if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    aten = [e for e in rows if e.key.startswith("aten::")]
    # kernels and copies: device time and no CPU time (a CPU op's row may carry its GPU annotation's span too,
    # which would count a kernel twice)
    gpu = sorted((e for e in rows if e.self_device_time_total > 0 and e.self_cpu_time_total == 0),
                 key=lambda e: e.self_device_time_total, reverse=True)
    kernels = [{"kernel": e.key[:120], "gpu_us_per_step": e.self_device_time_total / n, "calls_per_step": e.count / n}
               for e in gpu[:top]]
    return {"top_ops": ops, "top_kernels": kernels, "launches_per_step": launches / n,
            "aten_calls_per_step": sum(e.count for e in aten) / n,
            "self_cpu_ms_per_step": sum(e.self_cpu_time_total for e in rows) / n / 1e3,
            "gpu_ms_per_step": sum(e.self_device_time_total for e in gpu) / n / 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="cora_su")
    p.add_argument("--nodes", type=int, default=500_000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--name", default="gnn_step_profile")
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run)")
    p.add_argument("--step-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="the step as CUDA graphs (model.step_graphs; on a GPU)")
    add_out_argument(p)
    args = p.parse_args()
    device = torch.device(args.device)
    cfg = gnn.TrainConfig(sampler="torch", step_graphs=args.step_graphs)
    ds = gnn.load_gnn_dataset(args.dataset, n_nodes=args.nodes)
    in_dim = int(np.prod(ds.row_shape))
    records = []
    with gnn.deterministic_cuda(cfg.deterministic and device.type == "cuda", tf32=cfg.tf32):
        batches = _batches(ds, cfg, device, args.steps)
        model = gnn.GraphSAGE(in_dim, cfg.hidden, ds.num_classes, len(cfg.fanouts), cfg.dropout)
        model.seed_dropout(cfg.seed)
        model = model.to(device)
        step = gnn.make_step(model, torch.optim.Adam(model.parameters(), lr=cfg.lr), cfg, device)
        for b in batches * 2:  # optimizer state, allocator, kernel loads; with graphs, every shape captured (its
            step(b)  # first batch steps eagerly, its second is captured)
        for run in range(2):
            rec = {"run": run, "dataset": args.dataset, "nodes": args.nodes, "steps": len(batches),
                   "step_graphs": args.step_graphs, **_timed(step, batches, device),
                   **_profile(step, batches, args.top, device)}
            records.append(rec)
            print(f"run {run}: step {rec['step_ms_median']:.2f} ms alone, {rec['steps_back_to_back_ms']:.2f} ms back "
                  f"to back; {rec['launches_per_step']:.0f} launches, {rec['aten_calls_per_step']:.0f} aten calls, "
                  f"{rec['self_cpu_ms_per_step']:.2f} ms self CPU and {rec['gpu_ms_per_step']:.2f} ms of kernels per "
                  f"step (profiled)")
            for op in rec["top_ops"][:12]:
                print(f"  {op['op']:<48s} {op['self_cpu_us_per_step']:8.1f} us  x{op['calls_per_step']:.1f}")
            for k in rec["top_kernels"][:8]:
                print(f"  GPU {k['kernel'][:60]:<60s} {k['gpu_us_per_step']:8.1f} us  x{k['calls_per_step']:.1f}")

    def plot(recs: list[dict[str, Any]]) -> Any:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 6), layout="constrained")
        top = recs[-1]["top_ops"][:15][::-1]
        ax.barh([o["op"][:40] for o in top], [o["self_cpu_us_per_step"] for o in top])
        ax.set_xlabel("self CPU us per training step (profiled)")
        ax.set_title(f"GraphSAGE step, {args.dataset} {args.nodes} nodes: top ops by self CPU time")
        return fig

    write_results(args.out, args.name, records, plot, meta={"args": vars(args) | {"out": str(args.out)}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
