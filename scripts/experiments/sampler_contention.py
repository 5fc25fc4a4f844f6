"""Experiment: what slows the GNN sampler thread inside a pipelined epoch?

Hypothesis (issue 25, docs/results/2026-11-28-h200-s46): PubMed-SU's pipelined epoch follows its sampler thread's
busy time, which is 1.4-3.2x the sampler's time alone; giving the fetch and the sampler their own SMs did not change
it, so the cause is on the host. Two host causes are possible, and this tells them apart:

* the interpreter lock: the fetch and training threads run Python between their CUDA calls, and a sampler that
  released the lock for a CUDA call waits to get it back (up to Python's switch interval, 5 ms);
* the GPU: the sampler's host syncs wait for its own kernels, which queue behind the other stages' kernels.

The example's sampler (ibpcache's ``NeighborSampler`` on the GPU, batches in chunks, on a high-priority side stream
as in ``PipelinedLoader``) samples ``--epochs`` epochs of a SU graph's training seeds in a thread, timed per epoch
(host wall clock, the stream synced at the end of each), under each condition in turn (and again in reverse):

* ``alone``;
* ``python``: another thread runs pure Python for ``--duty`` of every 2 ms and sleeps the rest (the interpreter
  lock contended about as much as by the fetch and training threads' host work, the GPU idle);
* ``gpu``: another stream replays a CUDA graph of matmuls back to back (the GPU busy; its thread waits on an event
  between replays, so it barely holds the lock);
* ``both``.

Records: ``sample_ms`` (median epoch) and ``vs_alone`` per condition, and the sampler's host syncs per epoch
(counted alone with ``torch.cuda.set_sync_debug_mode("warn")``). Writes ``sampler_contention.json`` / ``.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.gnn import pipeline as gnn  # noqa: E402
from ibpcache.testing.timing import add_out_argument, write_results  # noqa: E402

CONDITIONS = ("alone", "python", "gpu", "both")


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="pubmed_su", help="a SU data set of the GNN example")
    p.add_argument("--n-nodes", type=int, default=500_000)
    p.add_argument("--epochs", type=int, default=5, help="timed epochs per condition (after one warm-up epoch)")
    p.add_argument("--matmul", type=int, default=4096, help="the GPU load's square matmul size")
    p.add_argument("--duty", type=float, default=0.25, help="share of the time the python load holds the lock")
    p.add_argument("--switch-ms", type=float, default=None, help="Python's thread switch interval (default 5 ms)")
    p.add_argument("--device", default="cuda")
    add_out_argument(p)
    return p.parse_args(argv)


def sampled_epochs(ds: Any, device: torch.device) -> Any:
    """The example's training batches (a re-iterable: one epoch per ``iter()``) at its defaults."""
    cfg = gnn.TrainConfig(sampler="torch", sampler_device="cuda" if device.type == "cuda" else "cpu")
    sampler = gnn.build_torch_sampler(ds, cfg, device)
    return gnn._batches(ds, None, cfg, device, sampler, train=True)


@contextlib.contextmanager
def running(work: "Callable[[threading.Event], None] | None") -> Iterator[None]:
    """``work(stop)`` in a daemon thread while inside."""
    if work is None:
        yield
        return
    stop = threading.Event()
    t = threading.Thread(target=work, args=(stop,), daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def python_load(duty: float, period_s: float = 2e-3) -> Callable[[threading.Event], None]:
    """Pure Python for ``duty`` of every ``period_s`` (holding the interpreter lock), asleep for the rest."""
    def work(stop: threading.Event) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < duty * period_s:
                sum(i * i for i in range(50))
            time.sleep(max(0.0, (1 - duty) * period_s))
    return work


def gpu_load(device: torch.device, n: int) -> "Callable[[threading.Event], None] | None":
    """Replays of a captured chain of matmuls on a stream of their own, back to back; None off CUDA."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    stream = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the capture (cuBLAS workspaces)
            a.mm(b)
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            c = a
            for _ in range(8):
                c = c.mm(b).mul_(1e-3)

    def work(stop: threading.Event) -> None:
        with torch.cuda.stream(stream):
            pending = None
            while not stop.is_set():
                graph.replay()
                done = stream.record_event()
                if pending is not None:
                    pending.synchronize()  # one replay queued ahead: the GPU never idles, the lock is released
                pending = done
            stream.synchronize()
    return work


def time_epochs(batches: Any, stream: Any, epochs: int) -> list[float]:
    """ms per epoch of sampling in this thread, on ``stream`` (synced at each epoch's end)."""
    times = []
    with torch.cuda.stream(stream):  # None: a no-op
        for _ in range(epochs):
            t0 = time.perf_counter()
            for _ in batches:
                pass
            if stream is not None:
                stream.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def in_thread(fn: Callable[[], list[float]]) -> list[float]:
    """Run ``fn`` in a new thread (the sampler's own, as in the pipeline) and return its result."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def syncs_per_epoch(batches: Any, stream: Any) -> "int | None":
    """Host syncs of one epoch of sampling (CUDA's sync debug mode, counted from its warnings)."""
    if stream is None:
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            time_epochs(batches, stream, 1)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def main(argv: "list[str] | None" = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    ds = gnn.load_gnn_dataset(args.dataset, n_nodes=args.n_nodes, materialize=False)
    batches = sampled_epochs(ds, device)
    stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
    py = python_load(args.duty)
    loads: dict[str, list[Any]] = {"alone": [], "python": [py], "gpu": [gpu_load(device, args.matmul)],
                                   "both": [py, gpu_load(device, args.matmul)]}
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1e3)
    in_thread(lambda: time_epochs(batches, stream, 1))  # warm-up: kernels built, allocator filled
    syncs = syncs_per_epoch(batches, stream)
    records: list[dict[str, Any]] = []
    for run, order in enumerate((CONDITIONS, tuple(reversed(CONDITIONS)))):
        for name in order:
            work = [w for w in loads[name] if w is not None]
            if len(work) < len(loads[name]):
                continue  # the GPU load off CUDA
            with contextlib.ExitStack() as stack:
                for w in work:
                    stack.enter_context(running(w))
                times = in_thread(lambda: time_epochs(batches, stream, args.epochs))
            records.append({"condition": name, "run": run, "sample_ms": statistics.median(times), "epochs_ms": times,
                            "batches": len(batches), "dataset": args.dataset, "syncs_per_epoch": syncs})
    alone = {r["run"]: r["sample_ms"] for r in records if r["condition"] == "alone"}
    for r in records:
        r["vs_alone"] = r["sample_ms"] / alone[r["run"]]
        print(f"run {r['run']} {r['condition']:7s}: sampling {r['sample_ms']:7.1f} ms an epoch "
              f"({r['vs_alone']:.2f}x alone)", flush=True)
    print(f"host syncs per epoch of sampling: {syncs}")
    write_results(args.out, "sampler_contention", records, plot,
                  meta={"dataset": args.dataset, "n_nodes": args.n_nodes, "epochs": args.epochs,
                        "matmul": args.matmul, "duty": args.duty, "device": str(device),
                        "switch_interval_s": sys.getswitchinterval()})


def plot(records: list[dict[str, Any]]) -> Any:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in sorted({r["run"] for r in records}):
        rs = [r for r in records if r["run"] == run]
        ax.bar([f"{r['condition']}\n(run {run})" for r in rs], [r["sample_ms"] for r in rs])
    ax.set_ylabel("sampling, ms an epoch")
    ax.set_title("the GNN sampler thread under contention")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
