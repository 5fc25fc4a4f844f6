"""Experiment: where does a training step of ``TableBatchedCachedEmbeddingBag`` go: host or device?

bench_dlrm's training setup (``--tables`` 26 tables of real 512 B fp32 rows, zipf-stable trace, 10% cache, sparse
gradients, SGD or Adagrad with ``attach_optimizer``, ``prefetch`` of the next batch after each step: its ``Method``
and ``Trace``), per (optimizer, bag, batch): after a warm-up, each step timed alone (device idle before it) with CUDA
events (device ms) and perf_counter (host ms: the call's wall time, the sync at its end excluded), medians; the
same number of steps back to back, as a training loop runs them (mean ms per step, and each phase's host ms); then
torch.profiler over a few steps: per step the CUDA kernel launches, the aten ops, and the calls that make the host
wait for the device (``aten::item`` / ``_local_scalar_dense``, ``aten::nonzero``, ``aten::unique``-style ops,
``cudaStreamSynchronize`` / ``cudaDeviceSynchronize``); then as many steps again with Python stacks recorded, for
the function that issued each of those and each launch (``sync_sites_per_step``, ``launch_sites_per_step``; kept
apart because recording stacks slows the host). On the CPU (``--device cpu``) the same counts without kernel times:
the ops and the would-be syncs are what a GPU step pays for. Writes ``train_step_profile.json`` under --out.

    PYTHONPATH=$PWD python scripts/experiments/train_step_profile.py --out /tmp/tsp            # GPU, < 60 s
    PYTHONPATH=$PWD python scripts/experiments/train_step_profile.py --device cpu --rows 2000 --batches 256 --out /tmp/tsp
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from ibpcache import datasets
from ibpcache.testing.sync_audit import host_reads_recorded

SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
            "aten::masked_select", "aten::_coalesce", "cudaStreamSynchronize", "cudaDeviceSynchronize",
            "cudaMemcpyAsync")
"""Profiler events that wait for the device on CUDA (a data-dependent size or a value read on the host); on the CPU
they are counted as the syncs a GPU step would pay (``cudaMemcpyAsync`` counts copies, some of them device to host)."""


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="train_step_profile_out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=75_120, help="rows per table (bench_dlrm: 1 GB of 512 B rows)")
    p.add_argument("--entry-bytes", type=int, default=512)
    p.add_argument("--batches", default="1024,8192")
    p.add_argument("--bags", default="1,20")
    p.add_argument("--optimizers", default="sgd,adagrad")
    p.add_argument("--cache-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.01)
    return p.parse_args(argv)


def _timed(step: Callable[[], Any], cuda: bool) -> tuple[float, float]:
    """(device ms, host ms) of one step run alone."""
    if cuda:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
    t0 = time.perf_counter()
    step()
    host = (time.perf_counter() - t0) * 1e3
    if not cuda:
        return host, host
    b.record()
    b.synchronize()
    return a.elapsed_time(b), host


def _back_to_back(step: Callable[[int, list], Any], steps: range, cuda: bool) -> tuple[float, dict[str, float]]:
    """Mean ms per step of ``steps`` run one after another, as a training loop (and bench_dlrm) runs them: each
    step's host work overlaps the previous step's device work, and every sync drains what is queued. Also the host
    ms per step of each phase (``Method.step``'s marks: forward, backward, optimizer step, prefetch)."""
    marks: list = []
    if cuda:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
    t0 = time.perf_counter()
    for i in steps:
        marks.append(time.perf_counter())
        step(i, marks)
    if cuda:
        b.record()
        b.synchronize()
        total = a.elapsed_time(b)
    else:
        total = (time.perf_counter() - t0) * 1e3
    per = [marks[k:k + 5] for k in range(0, len(marks), 5)]
    phases = {name: statistics.median((m[j + 1] - m[j]) * 1e3 for m in per)
              for j, name in enumerate(("forward", "backward", "optimizer", "prefetch"))}
    return total / len(steps), phases


HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")
"""Tensor methods that read device values on the host: each is a sync on CUDA."""


@contextlib.contextmanager
def count_host_reads() -> Iterator[Counter]:
    """Count Python-level calls of :data:`HOST_READS` on tensors while the block runs."""
    seen: Counter = Counter()
    with host_reads_recorded(HOST_READS, lambda name: seen.update((name,))):
        yield seen


_OURS = ("ibpcache/", "scripts/", "torch/optim/")
"""Frames worth naming as a wait's site: this project's lines and torch's optimizers (their sparse updates wait)."""


def _site(ev: Any) -> str:
    """The Python function that issued a profiler event: with ``with_stack`` the profiler nests each op under events
    named after the Python frames that called it ("path(first line): function"); the innermost of :data:`_OURS`, else
    the innermost frame, else "?"."""
    frames = []
    ev = ev.cpu_parent
    while ev is not None:
        if ".py(" in ev.name and not ev.name.startswith("<"):
            frames.append(ev.name)
        ev = ev.cpu_parent
    ours = [f for f in frames if any(k in f for k in _OURS)]
    return (ours or frames or ["?"])[0]


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaMemsetAsync", "cudaMemcpyAsync")
"""CUDA runtime calls that put work on a stream: a step's launches, by the function that issued them."""


def event_sites(events: Any, n: int, names: tuple = SYNC_OPS, top: Optional[int] = None) -> dict[str, float]:
    """Per step, each event named in ``names`` (default :data:`SYNC_OPS`) counted by the function that issued it
    ("op @ path(line): function"), the ``top`` most frequent: where a step's waits (or launches) come from, so they
    can be taken out one by one."""
    sites: Counter = Counter()
    for ev in events:
        if ev.name in names:
            sites[f"{ev.name} @ {_site(ev)}"] += 1
    return {k: c / n for k, c in sites.most_common(top)}


def _stacked_sites(step: Callable[[], Any], n: int) -> dict[str, dict[str, float]]:
    """Of ``n`` steps profiled with Python stacks: :func:`event_sites` of the waits, and of the launches (top 30)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(n):
            step()
    events = prof.events()
    return {"sync_sites_per_step": event_sites(events, n),
            "launch_sites_per_step": event_sites(events, n, LAUNCHES, 30)}


def _profile(step: Callable[[], Any], n: int, cuda: bool) -> dict[str, Any]:
    """Per-step counts: kernel launches, aten ops, the events that make the host wait (SYNC_OPS) and host reads."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof, count_host_reads() as reads:
        for _ in range(n):
            step()
        if cuda:
            torch.cuda.synchronize()
    names: Counter = Counter()
    kernel_time: Counter = Counter()
    kernels = 0
    kernel_us = 0.0
    for ev in prof.events():
        if cuda and ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            kernel_us += ev.device_time
            kernel_time[ev.name[:120]] += ev.device_time
        else:
            names[ev.name] += 1
    host_self = Counter({a.key: a.self_cpu_time_total for a in prof.key_averages()})
    aten = sum(c for k, c in names.items() if k.startswith("aten::"))
    syncs = {k: names[k] / n for k in SYNC_OPS if names[k]}
    launches = names["cudaLaunchKernel"] + names["cuLaunchKernel"] + names["cudaLaunchKernelExC"]
    return {"kernels_per_step": kernels / n, "launch_calls_per_step": launches / n,
            "kernel_ms_per_step": kernel_us / 1e3 / n, "aten_ops_per_step": aten / n, "sync_ops_per_step": syncs,
            "host_reads_per_step": {k: v / n for k, v in reads.items()},
            "top_ops": {k: c / n for k, c in names.most_common(25)},
            "top_kernels_ms": {k: t / 1e3 / n for k, t in kernel_time.most_common(15)},
            "top_host_self_ms": {k: t / 1e3 / n for k, t in host_self.most_common(15)}}


def run_point(method: Any, trace: Any, args: argparse.Namespace, bag: int, batch: int, cuda: bool) -> dict[str, Any]:
    """Steps of one (bag, batch) point on ``method`` (trained on, as bench_dlrm's windows do): timings, profile counts,
    and the hit rates of the point's own lookups and of its prefetches (the share of the distinct rows each prefetch
    looked for that were resident: what the step did not read from the host)."""
    trace.reset(batch + 7919 * bag)
    n = args.warmup + 2 * args.iters + 2 * args.profile_steps + 1
    inputs = [method.inputs(trace.batch(batch, bag), bag) for _ in range(n)]
    method.module.prefetch(inputs[0][0], inputs[0][1])
    before = method.module.stats()
    dev_ms, host_ms = [], []
    for i in range(args.warmup + args.iters):
        d, h = _timed(lambda: method.step(inputs[i], bag, inputs[i + 1]), cuda)
        if i >= args.warmup:
            dev_ms.append(d)
            host_ms.append(h)
    k0 = args.warmup + args.iters
    run_ms, phase_ms = _back_to_back(lambda i, marks: method.step(inputs[i], bag, inputs[i + 1], marks),
                                     range(k0, k0 + args.iters), cuda)
    k0 += args.iters
    it = iter(range(k0, k0 + 2 * args.profile_steps))

    def step() -> None:
        i = next(it)
        method.step(inputs[i], bag, inputs[i + 1])

    prof = _profile(step, args.profile_steps, cuda)
    prof.update(_stacked_sites(step, args.profile_steps))
    after = method.module.stats()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    probed = after["prefetch_unique_ids"] - before["prefetch_unique_ids"]
    missed = after["prefetch_misses"] - before["prefetch_misses"]
    return {"bag": bag, "batch": batch, "tables": args.tables, "rows_per_table": args.rows,
            "device_ms": statistics.median(dev_ms), "host_ms": statistics.median(host_ms), "back_to_back_ms": run_ms,
            "back_to_back_host_ms_by_phase": phase_ms,
            "hit_rate": hits / max(1, hits + misses), "prefetch_hit_rate": 1.0 - missed / max(1, probed), **prof}


def main(argv: "list[str] | None" = None) -> None:
    args = parse_args(argv)
    from scripts import bench_dlrm as bd

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("train_step_profile needs a CUDA GPU (or --device cpu)")
    table = datasets.resample_rows(bd.real_rows(args.entry_bytes), args.rows * args.tables, seed=args.entry_bytes)
    trace = bd.Trace("zipf-stable", args.rows, args.tables, 1.05, device, 200)
    results = []
    for opt in args.optimizers.split(","):  # one module per optimizer, as bench_dlrm builds them
        method = bd.Method("ibpcache", table, args.tables, args.cache_ratio, None, True, args.lr, device, opt)
        for bag in (int(b) for b in args.bags.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                r = {"optimizer": opt, **run_point(method, trace, args, bag, batch, device.type == "cuda")}
                results.append(r)
                shown = {k: v for k, v in r.items() if k not in ("top_ops", "launch_sites_per_step")}
                print(json.dumps(shown), flush=True)
        del method
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            **vars(args)}
    (out / "train_step_profile.json").write_text(json.dumps({"meta": meta, "points": results}, indent=1))
    print(f"wrote {out / 'train_step_profile.json'}")


if __name__ == "__main__":
    main()
