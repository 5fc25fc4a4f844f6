"""Experiment: where does one decode step of bench_llm's paths spend its time (CPU launch work vs GPU work)?

Kept for the record: it measured the fixed-slot store (ZeroCopyKV, kernels/kv_rows.cu) that the packed append store
(ibpcache/cache/append_store.py, kernels/kv_packed.cu) replaced; rerun it at commit 616e602.

For each (mode, path) of ``scripts/bench_llm.py`` it generates a few tokens under ``torch.profiler`` and reports,
per decode step: wall time, GPU busy time (sum of kernel and memcpy durations), the number of GPU activities
(kernels + copies), and the CPU time inside the cache's own functions (each wrapped in a ``record_function``
label). A step whose wall time is far above its GPU time is bound by the host (Python, launches, syncs).
Also times the launch cost of our CuPy kernels against a plain torch op, per call, from Python.

    python3 scripts/experiments/profile_kv_decode.py --gguf PATH --out $OUT   # or --allow-random
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_llm import DTYPES, generate, load_model, make_cache, stdlib_prompts  # noqa: E402

LABELLED = {
    "ibpcache.loaders.kv": ["KVOffloadManager.append", "KVOffloadManager.prefetch", "KVOffloadManager.take",
                            "KVOffloadManager._read", "KVOffloadManager.flush"],
    "ibpcache.loaders._kv_select": ["PartialKeySelector.select", "PartialKeySelector.append_keys",
                                    "PartialKeySelector._planned_k", "PartialKeySelector._scores_counted"],
    "ibpcache.loaders._kv_hf": ["IBPOffloadedCache._on_layer_start", "IBPOffloadedCache._update"],
    "ibpcache.loaders._kv_store": ["ZeroCopyKV.write", "ZeroCopyKV.read"],
    }


def label_functions() -> None:
    """Wrap the cache's functions in record_function so the profiler attributes CPU time to them."""
    import importlib

    for mod_name, names in LABELLED.items():
        mod = importlib.import_module(mod_name)
        for qual in names:
            cls_name, fn_name = qual.split(".")
            cls = getattr(mod, cls_name)
            fn = getattr(cls, fn_name)

            @functools.wraps(fn)
            def wrapped(*a: Any, __fn=fn, __label=qual, **kw: Any) -> Any:
                with torch.profiler.record_function(__label):
                    return __fn(*a, **kw)

            setattr(cls, fn_name, wrapped)


def launch_cost(n: int = 2000) -> dict:
    """Host microseconds per call: a torch add vs our decode_descriptors launch (1 row), no sync inside."""
    from ibpcache.kernels.bitpack import decode_descriptors
    from ibpcache.loaders._kv_store import identity_codec

    codec = identity_codec(128, torch.float16, (64,))
    tables = codec.kernel_tables("cuda")
    src = torch.zeros(256, dtype=torch.uint8, device="cuda")
    ptrs = torch.full((1,), src.data_ptr(), dtype=torch.int64, device="cuda")
    lengths = torch.full((1,), 128, dtype=torch.int32, device="cuda")
    flags = torch.zeros(1, dtype=torch.uint8, device="cuda")
    out = torch.empty((1, 128), dtype=torch.uint8, device="cuda")
    a = torch.zeros(64, device="cuda")
    res = {}
    for name, fn in (("torch_add", lambda: torch.add(a, 1.0)),
                     ("ibp_decode_descriptors", lambda: decode_descriptors(out, ptrs, lengths, flags, None, tables))):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        res[f"{name}_us_per_call"] = (t1 - t0) / n * 1e6
    return res


def _profiled(model: Any, ids: torch.Tensor, cache: Any, new_tokens: int) -> dict:
    """One generation under the profiler: wall ms, GPU busy ms, GPU activity count, CPU ms per labelled region."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run = generate(model, ids, cache, new_tokens)
    gpu_us, gpu_n = 0.0, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu_us += getattr(e, "device_time_total", None) or e.cuda_time_total
            gpu_n += 1
    labels = {q for qs in LABELLED.values() for q in qs}
    regions = {k.key: k.cpu_time_total / 1e3 for k in prof.key_averages() if k.key in labels}
    return {"wall_ms": run.prefill_ms + sum(run.step_ms), "gpu_ms": gpu_us / 1e3, "gpu_n": gpu_n,
            "regions": regions, "steps": run.step_ms, "prof": prof}


def profile_one(model: Any, ids: torch.Tensor, mode: str, path: str, args: argparse.Namespace) -> dict:
    """Per-decode-step costs as the difference of a long and a short profiled generation (prefill cancels)."""
    reserve = ids.shape[1] + args.new_tokens + 1
    generate(model, ids, make_cache(path, mode, model, args, reserve, False), 3)  # warm-up
    plain = generate(model, ids, make_cache(path, mode, model, args, reserve, False), args.new_tokens)
    short_n = 4
    short = _profiled(model, ids, make_cache(path, mode, model, args, reserve, False), short_n)
    long = _profiled(model, ids, make_cache(path, mode, model, args, reserve, False), args.new_tokens)
    n = args.new_tokens - short_n
    prof = long["prof"]
    table_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    table_gpu = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60)
    regions = {k: (long["regions"].get(k, 0.0) - short["regions"].get(k, 0.0)) / n for k in long["regions"]}
    return {
        "mode": mode, "path": path,
        "decode_ms_per_token_unprofiled": statistics.median(plain.step_ms),
        "decode_ms_per_token_profiled": statistics.median(long["steps"]),
        "wall_ms_per_step": (long["wall_ms"] - short["wall_ms"]) / n,
        "gpu_busy_ms_per_step": (long["gpu_ms"] - short["gpu_ms"]) / n,
        "gpu_activities_per_step": (long["gpu_n"] - short["gpu_n"]) / n,
        "region_cpu_ms_per_step": regions,
        "table_cpu": table_cpu, "table_gpu": table_gpu,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--allow-random", action="store_true")
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=1920)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--configs", default="dense:r,dense:a,dense:b,dense:c,dense:d,sparse:b,sparse:c,sparse:d")
    p.add_argument("--alpha", type=float, default=4.0)
    p.add_argument("--partial-ratio", type=float, default=0.2)
    p.add_argument("--max-num-kv", type=int, default=400)
    p.add_argument("--sample-rows", type=int, default=1024)
    p.add_argument("--fit-chunk-bytes", default="auto_once")
    p.add_argument("--cpu-threads", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = p.parse_args()
    torch.set_num_threads(args.cpu_threads)
    if args.device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as bench_llm does by default
    model, tok, source = load_model(args)
    model.to(DTYPES[args.dtype])
    ids = stdlib_prompts(tok, args.batch, args.prompt_len, model.config.vocab_size).to(args.device)
    label_functions()
    cuda = args.device == "cuda"
    out: dict = {"model": source, "device": torch.cuda.get_device_name() if cuda else "cpu",
                 "launch": launch_cost() if cuda else {}, "configs": []}
    print(json.dumps(out["launch"]))
    for item in args.configs.split(","):
        mode, path = item.split(":")
        rec = profile_one(model, ids, mode, path, args)
        out["configs"].append(rec)
        print(f"== {mode}/{path}: unprofiled {rec['decode_ms_per_token_unprofiled']:.1f} ms/token, profiled "
              f"{rec['decode_ms_per_token_profiled']:.1f}; per step: wall {rec['wall_ms_per_step']:.1f} ms, GPU busy "
              f"{rec['gpu_busy_ms_per_step']:.1f} ms, {rec['gpu_activities_per_step']:.0f} GPU activities")
        print("   regions (CPU ms/step):", {k: round(v, 2) for k, v in rec["region_cpu_ms_per_step"].items()})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_kv_decode.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(args.out, "profile_kv_decode_tables.txt"), "w") as f:
        for rec in out["configs"]:
            f.write(f"\n\n######## {rec['mode']}/{rec['path']}\n{rec['table_cpu']}\n{rec['table_gpu']}\n")


if __name__ == "__main__":
    main()
