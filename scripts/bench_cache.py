"""Benchmark the compressed GPU cache: fetch throughput, hit rate and capacity of the paper's four configurations.

On scaled-up real data sets (Cora-SU, PubMed-SU, MiniLM-SU: real rows resampled up to ``--gb`` GB, kept in pinned
host memory) and two access streams (Zipf a=1.05 ids; degree-proportional ids of a power-law graph), for cache
budgets of 1%, 5% and 20% of the raw size, it times ``FeatureCache.fetch`` on batches of 100k ids for

* ``baseline`` - raw cache + raw host rows (the same probe + decode kernels, nothing compressed),
* ``IBP(M)``  - raw cache, compressed host rows (less PCIe traffic per miss),
* ``IBP(C)``  - compressed cache (more rows cached), raw host rows,
* ``IBP(C/M)`` - both,

side by side in one run, plus a framework-style reference with no cache (``torch_gather``: CPU ``index_select``
into pinned memory and one bulk copy). On the dense data sets of ``--codec-datasets`` (default MiniLM-SU) it also
compares codecs for slab and host rows: ``codec=auto`` (the engine's choice: ``FeatureCache(codec="auto",
compress_host="auto")`` times IBP, exponent coding and raw rows at construction; the record says what it chose and
why) against forced ``codec=ibp``, ``codec=exponent`` (both sides coded) and ``codec=raw``, hit rate next to speed. Timing: warm-up batches first, then CUDA events around each fetch, medians
over ``--iters`` batches. Every timed configuration is verified bit-exactly against ``rows[ids]`` on the first and
last batch. The fetch is also split into its phases (id check, probe kernel, decode kernel) so the result says where
time goes. Writes ``bench_cache.json`` and ``bench_cache.png`` under ``--out`` and prints a compact table.

Usage (GPU machine): ``python scripts/bench_cache.py [--gb 2] [--quick] [--policies static lru] [--out DIR]``;
``--only-codecs`` runs just the codec comparison.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from ibpcache import Codec, CompressedRows, ExponentCodec, datasets
from ibpcache._validation import check_ids
from ibpcache.cache.feature_cache import FeatureCache, mode_name
from ibpcache.testing import add_out_argument, cpu_time, cuda_time, format_table, write_results

MODES = [(False, False), (False, True), (True, False), (True, True)]
DATASETS = {"cora": "Cora-SU", "pubmed": "PubMed-SU", "minilm": "MiniLM-SU"}
COLUMNS = ["dataset", "stream", "budget", "mode", "policy", "gbps", "speedup", "hit_rate", "capacity_rows",
           "capacity_x", "host_MB_per_batch", "check_ms", "probe_ms", "decode_ms", "other_ms", "fetch_ms", "verified"]
CODECS = ["auto", "ibp", "exponent", "raw"]
CODEC_COLUMNS = ["dataset", "stream", "budget", "mode", "policy", "chosen", "gbps", "speedup", "hit_rate",
                 "capacity_rows", "host_ratio", "host_MB_per_batch", "fetch_ms", "verified"]


@dataclass
class Workload:
    """One data set in pinned host memory, its codec and compressed host copy, and its id streams."""

    name: str
    rows: torch.Tensor
    codec: Codec
    packed: CompressedRows
    streams: dict[str, tuple[list[torch.Tensor], torch.Tensor]]  # name -> (batches on GPU, static hotness)
    coded: dict[str, tuple[Codec, CompressedRows]]  # method -> the host copy coded by it (the codec comparison)

    @property
    def row_bytes(self) -> int:
        return self.codec.row_bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(p)
    p.add_argument("--gb", type=float, default=2.0, help="scaled-up size of each data set in GB (default 2)")
    p.add_argument("--quick", action="store_true", help="small smoke run: 0.25 GB, 1%% budget, few batches")
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--budgets", nargs="+", type=float, default=[0.01, 0.05, 0.20], help="fractions of raw size")
    p.add_argument("--policies", nargs="+", default=["static"], choices=["static", "lru", "lfu"])
    p.add_argument("--batch", type=int, default=100_000, help="ids per batch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--avg-degree", type=float, default=16.0, help="mean degree of the power-law graph")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec-datasets", nargs="*", default=["minilm"], choices=list(DATASETS),
                   help="data sets that also run the codec comparison (auto vs forced ibp / exponent / raw)")
    p.add_argument("--codecs", nargs="+", default=CODECS, choices=CODECS)
    p.add_argument("--only-codecs", action="store_true", help="run only the codec comparison")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu = smoke-test the script without a GPU (Numba decoders, host timers)")
    args = p.parse_args(argv)
    if args.quick:
        args.gb = min(args.gb, 0.25)
        args.budgets = [0.01]
        args.iters, args.warmup = 5, 2
    if args.gb <= 0 or args.batch < 1 or args.iters < 1:
        p.error("--gb, --batch and --iters must be positive")
    return args


def load_workload(name: str, args: argparse.Namespace, compare: bool = False) -> Workload:
    """Scale real rows up into pinned memory, fit a codec on a GPU sample, compress the host copy, make streams."""
    real = datasets.load_rows(name).contiguous()
    cuda = args.device == "cuda"
    rows = datasets.scale_up(real, int(args.gb * 1e9), seed=args.seed, pin_memory=cuda)
    n = rows.shape[0]
    gen = torch.Generator().manual_seed(args.seed)
    sample = torch.randperm(n, generator=gen)[: min(n, 1 << 17)]
    fit_rows = rows[sample].to(args.device)
    codec = Codec.fit(fit_rows)
    packed = codec.compress(rows, layout="inplace", pin=cuda, device=args.device)
    coded: dict[str, tuple[Codec, CompressedRows]] = {"ibp": (codec, packed)}
    if compare and "exponent" in args.codecs and ExponentCodec.takes(rows.dtype):
        exp = Codec.fit(fit_rows, method="exponent")
        coded["exponent"] = (exp, exp.compress(rows, layout="inplace", pin=cuda, device=args.device))
    n_batches = args.warmup + args.iters
    total = n_batches * args.batch
    streams: dict[str, tuple[list[torch.Tensor], torch.Tensor]] = {}
    # one draw, split in two: a presampled trace (the static policy's hotness) and the measured stream
    zipf = datasets.zipf_ids(n, 2 * total, a=1.05, seed=args.seed + 1)
    trace, zipf = zipf[:total], zipf[total:]
    streams["zipf"] = (_split(zipf, args.batch, args.device), torch.bincount(trace, minlength=n).float())
    src, _ = datasets.power_law_graph(n, avg_degree=args.avg_degree, seed=args.seed + 2)
    degrees = torch.bincount(src, minlength=n).float()
    del src
    deg_ids = datasets.degree_proportional_ids(degrees, total, seed=args.seed + 3)
    streams["degree"] = (_split(deg_ids, args.batch, args.device), degrees)
    return Workload(DATASETS[name], rows, codec, packed, streams, coded)


def _split(ids: torch.Tensor, batch: int, device: str) -> list[torch.Tensor]:
    return [b.to(device) for b in ids.split(batch)]


def _cycle(batches: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    it: Iterator[torch.Tensor] = iter(())

    def nxt() -> torch.Tensor:
        nonlocal it
        try:
            return next(it)
        except StopIteration:
            it = iter(batches)
            return next(it)

    return nxt


def verify(fc: FeatureCache, rows: torch.Tensor, ids: torch.Tensor) -> bool:
    """Bit-exact check of one fetch against ``rows[ids]`` (rows on the host)."""
    got = fc.fetch(ids).cpu()
    want = rows[ids.cpu()]
    return torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def time_phases(fc: FeatureCache, ids: torch.Tensor, iters: int) -> dict[str, float]:
    """Median ms of the id check, the probe kernel and the decode kernel alone, on one batch."""
    b = ids.numel()
    out = torch.empty((b, *fc.row_shape), dtype=fc.dtype, device="cuda")
    out_u8 = out.view(torch.uint8).reshape(b, fc.row_bytes)
    check = cpu_time(lambda: check_ids(ids, fc.n_rows, fc.device), warmup=2, iters=iters, sync_cuda=True)
    probe = cuda_time(lambda: fc._probe(ids), warmup=2, iters=iters)
    fc._probe(ids)
    decode = cuda_time(lambda: fc._decode(out_u8, b), warmup=2, iters=iters)
    return {"check_ms": check["median_ms"], "probe_ms": probe["median_ms"], "decode_ms": decode["median_ms"]}


def build_and_time(make: Callable[[], FeatureCache], w: Workload, batches: list[torch.Tensor],
                   args: argparse.Namespace) -> tuple[FeatureCache, float, dict[str, Any], dict[str, Any], bool]:
    """Build a cache (timed), verify a first fetch, time fetches cycling through ``batches`` (CUDA events on a GPU),
    read its stats (counters cover warm-up and timed batches) and verify a last fetch.
    Returns ``(cache, build_s, timing, stats, verified)``."""
    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    fc = make()
    if cuda:
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    ok = verify(fc, w.rows, batches[0])
    fc.reset_stats()
    nxt = _cycle(batches)
    timing = (cuda_time if cuda else cpu_time)(lambda: fc.fetch(nxt()), warmup=args.warmup, iters=args.iters)
    st = fc.stats()
    ok &= verify(fc, w.rows, batches[-1])
    return fc, build_s, timing, st, ok


def bench_mode(w: Workload, stream: str, budget: float, combo: tuple[bool, bool], policy: str,
               args: argparse.Namespace) -> dict[str, Any]:
    batches, hotness = w.streams[stream]
    cc, ch = combo
    src: torch.Tensor | CompressedRows = w.packed if ch else w.rows
    cuda = args.device == "cuda"
    fc, build_s, timing, st, ok = build_and_time(
        lambda: FeatureCache(src, budget, hotness=hotness, policy=policy, device=args.device,
                             codec=w.codec if (cc or ch) else None, compress_cache=cc, compress_host=ch),
        w, batches, args)
    phases = time_phases(fc, batches[-1], max(3, args.iters // 2)) if cuda else \
        {"check_ms": None, "probe_ms": None, "decode_ms": None}
    out_bytes = args.batch * w.row_bytes
    n_batches = max(1, st["requests"] // args.batch)
    rec = {
        "dataset": w.name, "stream": stream, "budget": budget, "mode": fc.mode, "policy": policy,
        "fetch_ms": timing["median_ms"], "fetch_p10_ms": timing["p10"], "fetch_p90_ms": timing["p90"],
        "gbps": out_bytes / (timing["median_ms"] * 1e-3) / 1e9,
        "hit_rate": st["hit_rate"], "capacity_rows": st["capacity_rows"], "capacity_rows_raw": st["capacity_rows_raw"],
        "capacity_x": st["capacity_increase"], "ratio": st["ratio"], "transfer_ratio": st["transfer_ratio"],
        "host_MB_per_batch": st["host_bytes_read"] / n_batches / 1e6, "used_bytes": st["used_bytes"],
        "budget_bytes": st["budget_bytes"], "index": st["index"]["kind"], "slot_bytes": st["slot_bytes"],
        "metadata_bytes": st["metadata_bytes"], "build_s": build_s, "verified": bool(ok),
        "kernel_status": st["kernel_status"], "row_bytes": w.row_bytes, "n_rows": fc.n_rows, **phases,
    }
    # what the phases do not cover: launch overhead and, for dynamic policies, admission bookkeeping
    if cuda:
        rec["other_ms"] = rec["fetch_ms"] - phases["check_ms"] - phases["probe_ms"] - phases["decode_ms"]
    del fc
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rec


def codec_cache(w: Workload, method: str, budget: float, hotness: torch.Tensor, policy: str,
                device: str) -> FeatureCache:
    """The codec comparison's cache: ``auto`` is the engine's choice from dense rows (timed at construction), the
    forced codecs code slab and host rows (raw: neither)."""
    kw: dict[str, Any] = {"hotness": hotness, "policy": policy, "device": device}
    if method == "auto":
        return FeatureCache(w.rows, budget, codec="auto", compress_host="auto", **kw)
    if method == "raw":
        return FeatureCache(w.rows, budget, compress_cache=False, compress_host=False, **kw)
    codec, packed = w.coded[method]
    return FeatureCache(packed, budget, codec=codec, compress_cache=True, compress_host=True, **kw)


def bench_codec(w: Workload, stream: str, budget: float, method: str, policy: str,
                args: argparse.Namespace) -> dict[str, Any]:
    """One point of the codec comparison: fetch speed, hit rate and what the cache stores (same timing rules as
    :func:`bench_mode`)."""
    batches, hotness = w.streams[stream]
    cuda = args.device == "cuda"
    fc, build_s, timing, st, ok = build_and_time(
        lambda: codec_cache(w, method, budget, hotness, policy, args.device), w, batches, args)
    n_batches = max(1, st["requests"] // args.batch)
    layout = st["host_layout"]
    rec = {"dataset": w.name, "stream": stream, "budget": budget, "mode": f"codec={method}", "policy": policy,
           "chosen": f"{fc.codec.method if fc.codec is not None else 'raw'}/"
                     f"{'host ' + layout.get('method', 'raw') if fc.compress_host else 'host raw'}",
           "codec_method": fc.codec.method if fc.codec is not None else "raw", "host_layout": layout,
           "fetch_ms": timing["median_ms"], "fetch_p10_ms": timing["p10"], "fetch_p90_ms": timing["p90"],
           "gbps": args.batch * w.row_bytes / (timing["median_ms"] * 1e-3) / 1e9, "hit_rate": st["hit_rate"],
           "capacity_rows": st["capacity_rows"], "capacity_x": st["capacity_increase"], "ratio": st["ratio"],
           "host_ratio": st["host_ratio"], "host_MB_per_batch": st["host_bytes_read"] / n_batches / 1e6,
           "used_bytes": st["used_bytes"], "budget_bytes": st["budget_bytes"], "build_s": build_s,
           "transfer": st["transfer"], "verified": bool(ok), "kernel_status": st["kernel_status"],
           "row_bytes": w.row_bytes, "n_rows": fc.n_rows}
    del fc
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rec


def bench_torch_gather(w: Workload, stream: str, args: argparse.Namespace) -> dict[str, Any]:
    """No cache: CPU index_select into a pinned staging buffer, then one bulk host-to-device copy."""
    batches, _ = w.streams[stream]
    cpu_batches = [b.cpu() for b in batches]
    staging = torch.empty((args.batch, *w.rows.shape[1:]), dtype=w.rows.dtype, pin_memory=True)
    nxt = _cycle(cpu_batches)

    def fetch() -> torch.Tensor:
        ids = nxt()
        torch.index_select(w.rows, 0, ids, out=staging[: ids.numel()])
        return staging[: ids.numel()].to("cuda", non_blocking=True)

    timing = cpu_time(fetch, warmup=args.warmup, iters=args.iters, sync_cuda=True)
    nxt = _cycle(cpu_batches)  # restart so the verified batch is known
    got = fetch().cpu()
    ok = torch.equal(got.view(torch.uint8), w.rows[cpu_batches[0]].view(torch.uint8))
    return {"dataset": w.name, "stream": stream, "budget": 0.0, "mode": "torch_gather", "policy": "none",
            "fetch_ms": timing["median_ms"], "gbps": args.batch * w.row_bytes / (timing["median_ms"] * 1e-3) / 1e9,
            "hit_rate": 0.0, "verified": bool(ok), "row_bytes": w.row_bytes, "n_rows": w.rows.shape[0]}


def add_speedups(records: list[dict[str, Any]]) -> None:
    """speedup = GB/s over the raw baseline of the same data set, stream, budget and policy (the codec comparison's
    over its ``codec=raw`` point)."""
    def key(r: dict[str, Any]) -> tuple:
        return (r["dataset"], r["stream"], r["budget"], r["policy"], r["mode"].startswith("codec="))

    base = {key(r): r["gbps"] for r in records if r["mode"] in ("baseline", "codec=raw")}
    for r in records:
        b = base.get(key(r))
        r["speedup"] = r["gbps"] / b if b else None


def plot(records: list[dict[str, Any]]) -> Any:
    import matplotlib.pyplot as plt

    dsets = list(dict.fromkeys(r["dataset"] for r in records))
    streams = list(dict.fromkeys(r["stream"] for r in records))
    modes = [mode_name(*c) for c in MODES] + [f"codec={c}" for c in CODECS]
    modes = [m for m in modes if any(r["mode"] == m for r in records)]
    fig, axes = plt.subplots(len(streams), len(dsets), figsize=(4.5 * len(dsets), 3.4 * len(streams)),
                             squeeze=False)
    for i, stream in enumerate(streams):
        for j, ds in enumerate(dsets):
            ax = axes[i][j]
            recs = [r for r in records if r["dataset"] == ds and r["stream"] == stream and r["mode"] in modes]
            budgets = sorted({r["budget"] for r in recs})
            policies = sorted({r["policy"] for r in recs})
            groups = [(b, p) for b in budgets for p in policies]
            width = 0.8 / len(modes)
            for k, m in enumerate(modes):
                ys = [next((r["gbps"] for r in recs if (r["budget"], r["policy"], r["mode"]) == (b, p, m)), 0.0)
                      for b, p in groups]
                ax.bar([g + k * width for g in range(len(groups))], ys, width, label=m)
            ref = [r["gbps"] for r in records if r["dataset"] == ds and r["stream"] == stream
                   and r["mode"] == "torch_gather"]
            if ref:
                ax.axhline(ref[0], color="gray", ls="--", lw=1, label="torch gather (no cache)")
            ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
            ax.set_xticklabels([f"{b:.0%}" + (f"\n{p}" if len(policies) > 1 else "") for b, p in groups])
            ax.set_title(f"{ds}, {stream} ids")
            ax.set_ylabel("fetch GB/s (output)")
            ax.set_xlabel("cache budget (share of raw size)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_cache needs a CUDA GPU (or --device cpu for a smoke test)", file=sys.stderr)
        return 2
    records: list[dict[str, Any]] = []
    names = [n for n in args.datasets if not args.only_codecs or n in args.codec_datasets]
    per = len(args.budgets) * len(args.policies) * 2
    n_configs = sum(per * ((0 if args.only_codecs else len(MODES))
                           + (len(args.codecs) if n in args.codec_datasets else 0)) for n in names)
    bar = tqdm(total=n_configs, desc="cache configs", file=sys.stdout, mininterval=5)
    for name in names:
        compare = name in args.codec_datasets
        w = load_workload(name, args, compare)
        print(f"{w.name}: {w.rows.shape[0]} rows x {w.row_bytes} B, codec ratio {w.packed.ratio:.3f}, {w.codec}")
        for stream in w.streams:
            if args.device == "cuda" and not args.only_codecs:
                records.append(bench_torch_gather(w, stream, args))
            for budget in args.budgets:
                for policy in args.policies:
                    for combo in ([] if args.only_codecs else MODES):
                        records.append(bench_mode(w, stream, budget, combo, policy, args))
                        bar.update()
                    for method in (args.codecs if compare else []):
                        if method in ("ibp", "exponent") and method not in w.coded:
                            continue  # exponent coding needs float rows
                        records.append(bench_codec(w, stream, budget, method, policy, args))
                        bar.update()
        del w
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    add_speedups(records)
    if any(not r["mode"].startswith("codec=") for r in records):
        print(format_table([r for r in records if not r["mode"].startswith("codec=")], COLUMNS))
    if any(r["mode"].startswith("codec=") for r in records):
        print(format_table([r for r in records if r["mode"].startswith("codec=")], CODEC_COLUMNS))
    meta = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in vars(args).items()
            if k != "out"}
    paths = write_results(args.out, "bench_cache", records, plot, meta=meta)
    print("wrote", ", ".join(str(p) for p in paths.values()))
    bad = [r for r in records if not r["verified"] or r.get("kernel_status", 0) != 0]
    if bad:
        print(f"VERIFICATION FAILED for {len(bad)} configuration(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
