"""Experiment: where one decode step of ``bench_llm.py --shape`` spends its GPU time, per method.

For each method it builds the cache exactly as the benchmark does (``scripts/lib/llm_shapes.py``: same model, same
real-KV fill, same constructor options), decodes a few untimed steps, then profiles ``--steps`` more under
``torch.profiler`` (device activity only) and reports per step: wall time, the union of GPU busy intervals (all
streams), the sum of kernel and copy durations, and the kernels with the most device time (count per step, mean
microseconds); then 2 more steps without the profiler, timing the cache's host functions (inclusive wall time per
step). A step whose GPU union is far below its wall time waits on the host or on latency; a kernel whose mean
time is far above its bytes / PCIe rate is latency-bound.

    python3 scripts/experiments/profile_kv_shape.py --shape qwen7b --batches 16 --contexts 32768 --modes sparse \
        --methods ibpcache,ibpcache_raw,infinigen_cpu_gather --data-root /tmp/data --out $OUT

``--trace`` adds one step traced with CPU activity (CUDA runtime calls and aten ops by host time) and one under
``torch.cuda.set_sync_debug_mode("warn")`` (which calls synchronize, and from where).

Takes the benchmark's options (``--steps`` and ``--trace`` are this script's own); writes ``profile_kv_shape.json``.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import time
from typing import Any

import torch

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from scripts.lib import llm_shapes as ls


def _union_ms(intervals: list) -> float:
    """Length of the union of [start, end) intervals (microseconds in, milliseconds out)."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e3


# Host functions whose time (perf_counter, inclusive, no profiler running) is reported per step.
TIMED = {
    "ibpcache.loaders._kv_hf": ["IBPOffloadedCache._on_layer_start", "IBPOffloadedCache._update",
                                "IBPOffloadedCache._speculate"],
    "ibpcache.loaders._kv_model": ["project_query"],
    "ibpcache.cache.kv_select": ["PartialKeySelector.select", "PartialKeySelector.append_keys",
                                 "PartialKeySelector._planned_k"],
    "ibpcache.cache.kv_manager": ["KVOffloadManager.prefetch", "KVOffloadManager.take", "KVOffloadManager.append",
                                  "KVOffloadManager._read"],
    "ibpcache.cache.append_store": ["AppendStore.append", "AppendStore.fetch", "AppendStore.note_append",
                                    "AppendStore.prepare_dynamic"],
    "ibpcache.cache.kv_graph": ["SpeculationGraphs.speculate", "SpeculationGraphs.append"],
}
HOST_S: dict = {}
HOST_STEPS = 2


def time_host_functions() -> None:
    """Wrap the functions of TIMED so each call adds its wall time to HOST_S[name] (and a count)."""
    for mod_name, names in TIMED.items():
        mod = importlib.import_module(mod_name)
        for qual in names:
            owner, attr = (mod, qual) if "." not in qual else (getattr(mod, qual.split(".")[0]), qual.split(".")[1])
            fn = getattr(owner, attr)

            @functools.wraps(fn)
            def wrapped(*a: Any, __fn: Any = fn, __name: str = qual, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return __fn(*a, **kw)
                finally:
                    rec = HOST_S.setdefault(__name, [0, 0.0])
                    rec[0] += 1
                    rec[1] += time.perf_counter() - t0

            setattr(owner, attr, wrapped)
            if owner is not mod:
                continue
            for other in ("ibpcache.loaders._kv_hf", "ibpcache.loaders.kv"):  # names imported elsewhere
                m2 = importlib.import_module(other)
                if getattr(m2, attr, None) is fn:
                    setattr(m2, attr, wrapped)


def host_steps(model: Any, cache: Any, first: torch.Tensor, filled: int, steps: int) -> dict:
    """Decode ``steps`` steps with only the host timers on: event time per step and host time per function."""
    HOST_S.clear()
    out = ls.decode(model, cache, first, filled, steps, 0, False, "cuda")
    return {"event_ms_per_step": out.step_ms, "wall_ms_per_step": out.wall_ms,
            "host_ms_per_step": {k: {"calls": c / steps, "ms": t * 1e3 / steps} for k, (c, t) in HOST_S.items()}}


def profile_steps(model: Any, cache: Any, first: torch.Tensor, filled: int, steps: int) -> dict:
    """Profile ``steps`` decode steps after ``filled`` cached tokens; per-step wall, GPU union, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # device activity only: little host overhead
        t0 = time.perf_counter()
        out = ls.decode(model, cache, first, filled, steps, 0, False, "cuda")
        wall = (time.perf_counter() - t0) * 1e3
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_name: dict = {}
    for e in gpu:
        rec = per_name.setdefault(e.name, [0, 0.0])
        rec[0] += 1
        rec[1] += e.time_range.end - e.time_range.start
    top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:15]
    return {"steps": steps, "wall_ms_per_step": wall / steps, "event_ms_per_step": out.step_ms,
            "gpu_union_ms_per_step": _union_ms([(e.time_range.start, e.time_range.end) for e in gpu]) / steps,
            "gpu_sum_ms_per_step": sum(v[1] for v in per_name.values()) / 1e3 / steps,
            "gpu_activities_per_step": len(gpu) / steps,
            "top": [{"name": n[:120], "per_step": c / steps, "mean_us": t / c, "ms_per_step": t / 1e3 / steps}
                    for n, (c, t) in top]}


def cpu_trace_step(model: Any, cache: Any, first: torch.Tensor, filled: int) -> dict:
    """One decode step under the profiler with CPU activity: the CUDA runtime calls by total host time (a
    blocking call such as cudaStreamSynchronize, cudaEventSynchronize or a synchronous memcpy shows up here with
    the time it waited) and the aten ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ls.decode(model, cache, first, filled, 1, 0, False, "cuda")
    rows = []
    for e in prof.key_averages():
        if e.self_cpu_time_total > 0:
            rows.append({"name": e.key[:100], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3})
    rows.sort(key=lambda r: -r["self_cpu_ms"])
    runtime = [r for r in rows if r["name"].startswith("cuda")]
    return {"runtime_api": runtime[:12], "top_self_cpu": rows[:25]}


def sync_step(model: Any, cache: Any, first: torch.Tensor, filled: int) -> dict:
    """One decode step under ``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing call torch sees,
    with the innermost ibpcache/transformers frames that made it (a sync in a hook stops the CPU running ahead)."""
    import traceback
    import warnings

    seen: dict = {}

    def show(message: Any, *a: Any, **k: Any) -> None:
        frames = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                  if ("ibpcache" in f.filename or "transformers" in f.filename or "scripts" in f.filename)]
        key = str(message)[:80] + " | " + " < ".join(reversed(frames[-4:]))
        seen[key] = seen.get(key, 0) + 1

    torch.cuda.synchronize()
    old = warnings.showwarning
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                ls.decode(model, cache, first, filled, 1, 0, False, "cuda")
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = old
    return {"syncs": [{"where": k, "count": v} for k, v in sorted(seen.items(), key=lambda kv: -kv[1])]}


def main() -> None:
    argv = sys.argv[1:]
    steps = 3
    if "--steps" in argv:
        i = argv.index("--steps")
        steps = int(argv[i + 1])
        del argv[i:i + 2]
    trace = "--trace" in argv  # also one CPU-traced step and one step under the sync debug mode
    if trace:
        argv.remove("--trace")
    args = ls.parse_args(argv)
    torch.backends.cuda.enable_cudnn_sdp(False)
    time_host_functions()
    dtype = ls.DTYPES[args.dtype]
    model = ls.build_model(args.shape, dtype, "cuda", args.attn, args.seed)
    layers = ls.geometry(model.config)[0]
    src = ls.KvSource(args.kv_source, args.dtype, "cuda", layers, args.seed, args.data_root)
    batch, context = int(args.batches.split(",")[0]), int(args.contexts.split(",")[0])
    first = torch.randint(model.config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(1)).cuda()
    warm = 2
    results: dict = {"shape": args.shape, "batch": batch, "context": context,
                     "device": torch.cuda.get_device_name(), "methods": {}}
    for mode in args.modes.split(","):
        for method in args.methods.split(","):
            filled = context - warm - steps - HOST_STEPS - 2 * trace  # every step stays inside the reserved context
            cache = ls.make_cache(method, mode, model, args, context)
            try:
                ls.fill_cache(cache, method, mode, model, src, batch, filled, args)
                out = ls.decode(model, cache, first, filled, warm, 0, False, "cuda")
                nxt = out.tokens[:, -1:].cuda()
                rec = profile_steps(model, cache, nxt, filled + warm, steps)
                rec["host"] = host_steps(model, cache, nxt, filled + warm + steps, HOST_STEPS)
                if trace:
                    at = filled + warm + steps + HOST_STEPS
                    rec["cpu_trace"] = cpu_trace_step(model, cache, nxt, at)
                    rec["sync"] = sync_step(model, cache, nxt, at + 1)
                    for r in rec["cpu_trace"]["runtime_api"][:6] + rec["cpu_trace"]["top_self_cpu"][:10]:
                        print(f"    cpu {r['self_cpu_ms']:8.2f} ms  {r['calls']:6d}  {r['name'][:70]}", flush=True)
                    for r in rec["sync"]["syncs"][:8]:
                        print(f"    sync x{r['count']}: {r['where'][:200]}", flush=True)
                results["methods"][f"{mode}/{method}"] = rec
                print(f"{mode}/{method}: wall {rec['wall_ms_per_step']:.1f} ms/step, GPU union "
                      f"{rec['gpu_union_ms_per_step']:.1f}, GPU sum {rec['gpu_sum_ms_per_step']:.1f}, "
                      f"{rec['gpu_activities_per_step']:.0f} activities/step", flush=True)
                for t in rec["top"][:8]:
                    print(f"    {t['ms_per_step']:8.2f} ms/step  {t['per_step']:7.0f}/step  {t['mean_us']:9.1f} us  "
                          f"{t['name'][:70]}", flush=True)
                h = rec["host"]
                print(f"  host-timed steps: events {[round(x, 1) for x in h['event_ms_per_step']]} ms", flush=True)
                for name, v in sorted(h["host_ms_per_step"].items(), key=lambda kv: -kv[1]["ms"]):
                    print(f"    host {v['ms']:8.2f} ms/step  {v['calls']:6.0f} calls  {name}", flush=True)
            finally:
                if hasattr(cache, "close"):
                    cache.close()
                del cache
                ls.free_everything("cuda")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "profile_kv_shape.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
