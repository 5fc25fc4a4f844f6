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

Takes the benchmark's options (``--steps`` is this script's own); writes ``profile_kv_shape.json``.
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
    "ibpcache.loaders._kv_select": ["PartialKeySelector.select", "PartialKeySelector.append_keys", "project_query",
                                    "PartialKeySelector._planned_k"],
    "ibpcache.loaders.kv": ["KVOffloadManager.prefetch", "KVOffloadManager.take", "KVOffloadManager.append",
                            "KVOffloadManager._read"],
    "ibpcache.cache.append_store": ["AppendStore.append", "AppendStore.fetch", "AppendStore.note_append"],
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


def main() -> None:
    argv = sys.argv[1:]
    steps = 3
    if "--steps" in argv:
        i = argv.index("--steps")
        steps = int(argv[i + 1])
        del argv[i:i + 2]
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
            filled = context - warm - steps - HOST_STEPS  # every step stays inside the reserved context
            cache = ls.make_cache(method, mode, model, args, context)
            try:
                ls.fill_cache(cache, method, mode, model, src, batch, filled, args)
                out = ls.decode(model, cache, first, filled, warm, 0, False, "cuda")
                nxt = out.tokens[:, -1:].cuda()
                rec = profile_steps(model, cache, nxt, filled + warm, steps)
                rec["host"] = host_steps(model, cache, nxt, filled + warm + steps, HOST_STEPS)
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
