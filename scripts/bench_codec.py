"""Codec benchmark: stored ratio and GPU decode speed of every real table under every codec method, in one run.

Tables (real rows from ../shared/data): Cora, PubMed rows, the MiniLM word embeddings, SmolLM2's KV K and V of both
recorded prompts (``chat``: stored fp32, ``code``: stored fp16); each in float32, bfloat16 and float16 (Cora, PubMed
and MiniLM cast with torch's round-to-nearest; KV as ``datasets.load_kv`` converts it: bf16 by truncation). Methods:

  ibp            invariant bit packing (threshold and chunk size searched)
  exponent       exponent coding, ``seg="auto"`` with the default header budget (0.75% of a row)
  exponent_1seg  exponent coding, one segment per row (no header; one lane decodes a row's codewords)
  exponent_hb1   exponent coding, ``seg="auto"`` with a 1% header budget (more segments: the other side of the
                 decode-parallelism vs ratio trade)
  raw            rows verbatim (the baseline every speed is compared with)

Per (table, dtype, method):
  * ``stored_ratio``: raw bytes / (stored row bytes + codec tables + flags + int32 lengths + int64 offsets), the
    packed layout on the real table; ``ratio`` leaves the tables out (the paper's definition);
  * GPU decode GB/s (of output) of ``--batch`` random rows, through the engine's one lookup kernel
    (``kernels/lookup.py``: the kernel every store's fetch runs; all misses), from a ``--gb`` GB scaled-up table
    (``datasets.scale_up``: real rows resampled) coded on the GPU and kept in pinned host memory (``zc``: zero-copy
    reads over PCIe, where a codec's saved bytes count) and the same stored bytes in device memory (``hbm``: what a
    GPU cache hit costs, where only decode speed counts). ``vs_raw_zc`` / ``vs_raw_hbm``: this method's GB/s of
    output over raw rows' (> 1 = faster than raw rows; per byte, so a method timed on a smaller batch compares fairly).
Baselines in the same process: ``cpu_bulk`` (CPU index_select into pinned memory + one bulk copy), ``ideal`` (the
batch's stored bytes at the pinned memcpy rate measured here), nvCOMP with one chunk per row (``--nvcomp-sets``,
scripts/lib/nvcomp_baseline.py), and the paper's Figure 7 sweep (IBP on synthetic rows of 256 B / 1 KB / 4 KB).

Timing: a warm-up, CUDA events, medians; each configuration is timed twice in alternating rounds (``rounds_ms``
keeps both medians); slow configurations (exponent rows wider than the warp decoder's 2 KB stage, i.e. Cora's) are
timed on a smaller batch (``batch_timed``).
Every timed output is verified bit for bit against the source rows. Writes ``bench_codec.json`` / ``.png`` (and
``bench_codec_fig7.*``) under ``--out``. ``--device cpu`` (with ``--quick``) is a smoke run: ratios and the CPU
decoder's speed, same records and checks.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

_ROOT = str(Path(__file__).resolve().parents[1])  # the repository root: scripts.lib imports from it
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from ibpcache import Codec, CompressedRows, ExponentCodec, datasets  # noqa: E402
from ibpcache.kernels.exponent import group_rows  # noqa: E402
from ibpcache.testing.timing import add_out_argument, cpu_time, cuda_time, format_table, write_results  # noqa: E402

TABLES = ("cora", "pubmed", "minilm", "kv_chat_k", "kv_chat_v", "kv_code_k", "kv_code_v")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
METHODS = ("ibp", "exponent", "exponent_1seg", "exponent_hb1", "raw")
COLUMNS = ["table", "dtype", "method", "row_bytes", "stored_ratio", "n_seg", "zc_gbps", "vs_raw_zc", "hbm_gbps",
           "vs_raw_hbm", "verified"]
SLOW_MS = 40.0
"""A configuration whose first full-batch lookup takes longer than this is timed on a smaller batch."""


def load_table(name: str, dtype: str) -> tuple[torch.Tensor, str]:
    """Real rows of ``name`` in ``dtype``, and how they were converted."""
    if name.startswith("kv_"):
        _, prompt, which = name.split("_")
        stored = "fp32" if prompt == "chat" else "fp16"
        how = "as stored" if dtype == stored else ("bf16 truncation" if dtype == "bf16" else f"cast from {stored}")
        return datasets.load_kv(prompt, which, dtype), how
    rows = datasets.load_rows(name)
    return rows.to(DTYPES[dtype]).contiguous(), "as stored" if dtype == "fp32" else "torch cast (round to nearest)"


def fit_method(x: torch.Tensor, method: str) -> Codec:
    """The codec of ``method`` fitted on ``x`` (rows on any device; fitted where they are)."""
    if method == "ibp":
        return Codec.fit(x)
    if method == "exponent":
        return Codec.fit(x, method="exponent")
    if method == "exponent_1seg":
        return ExponentCodec.fit(x, seg=None)
    if method == "exponent_hb1":
        return Codec.fit(x, method="exponent", header_budget=0.01)
    if method == "raw":
        return Codec.raw(x.dtype, tuple(x.shape[1:]))
    raise ValueError(f"unknown method {method!r}")


def applies(method: str, dtype: torch.dtype) -> bool:
    return not method.startswith("exponent") or ExponentCodec.takes(dtype)


def stored_ratios(codec: Codec, real: torch.Tensor, device: str) -> dict[str, Any]:
    """Ratios of the real table under ``codec`` (packed layout, every table counted), after a verified round trip."""
    packed = codec.compress(real, layout="packed", pin=False, device=device)
    back = packed.decompress("cpu")
    ok = torch.equal(back.contiguous().view(torch.uint8), real.contiguous().view(torch.uint8))
    return {"stored_ratio": packed.stored_ratio, "ratio": packed.ratio, "metadata_bytes": packed.metadata_nbytes,
            "compressed_fraction": packed.compressed_fraction, "ratio_verified": ok,
            "seg": getattr(codec, "seg", None), "n_seg": getattr(codec, "n_seg", None),
            "rows_per_warp": (group_rows(codec.row_bytes, codec.row_elems, codec.n_seg)
                              if isinstance(codec, ExponentCodec) else None),
            "chunk_bytes": getattr(codec, "chunk_bytes", None) if codec.method == "ibp" else None}


# ---- GPU: the engine's lookup kernel over the scaled-up table --------------------------------------------------


def pinned_h2d_gbps(nbytes: int = 1 << 30) -> float:
    """Pinned host -> device memcpy bandwidth, the 'ideal' transfer rate of this machine."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t = cuda_time(lambda: dst.copy_(src, non_blocking=True), warmup=3, iters=10)
    return nbytes / (t["median_ms"] * 1e-3) / 1e9


class Store:
    """One method's stored copy of the scaled-up table, as the lookup kernel reads it: pinned host (zero-copy) and
    device memory (HBM), with the codec's kernel tables."""

    def __init__(self, codec: Codec, su: torch.Tensor, su_u8: torch.Tensor) -> None:
        from ibpcache.kernels.hashmap import IndexArgs, IndexMode
        from ibpcache.kernels.lookup import RowSource

        dev = torch.device("cuda")
        self.codec = codec
        self.tables = codec.kernel_tables(dev)
        t0 = time.perf_counter()
        if codec.method == "raw":
            host, offsets, lengths = su_u8.reshape(-1), None, None
            self.stored_bytes = None
        else:
            self.packed: CompressedRows = codec.compress(su, layout="packed", pin=True, device=dev)
            host = self.packed.data
            meta = self.packed.device_meta(dev)
            offsets, lengths = meta["offsets"], meta["lengths"]
            self.stored_bytes = self.packed.lengths
        torch.cuda.synchronize()
        self.compress_s = time.perf_counter() - t0
        self.hbm = torch.empty(host.numel() + 16, dtype=torch.uint8, device=dev)
        self.hbm[: host.numel()].copy_(host)
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        index = IndexArgs(IndexMode.NONE, empty, empty, 0, 0)
        bases = torch.zeros(8, dtype=torch.int64, device=dev)
        n, rb = su_u8.shape
        self.sources = {"zc": RowSource(index, bases, host.data_ptr(), offsets, rb, lengths, n),
                        "hbm": RowSource(index, bases, self.hbm.data_ptr(), offsets, rb, lengths, n)}
        self._host = host  # keeps the pinned bytes alive while the sources point at them

    def batch_bytes(self, ids: torch.Tensor, row_bytes: int) -> float:
        if self.stored_bytes is None:
            return float(ids.numel() * row_bytes)
        return float(self.stored_bytes[ids.cpu()].sum(dtype=torch.int64))


def time_lookups(store: Store, batches: list[torch.Tensor], out: torch.Tensor, args: argparse.Namespace
                 ) -> dict[str, Any]:
    """Median ms of the lookup kernel per source (zc, hbm), two alternating rounds; cycles through the batches.

    A configuration whose first lookup of the full batch takes longer than :data:`SLOW_MS` (exponent-coded rows
    wider than the warp decoder's 2 KB stage decode with direct byte reads, slow over PCIe) is timed on a prefix of
    each batch sized to about SLOW_MS (``batch_timed`` records it; GB/s are per output byte either way)."""
    from ibpcache.kernels.lookup import LookupErrors, lookup_rows

    err = LookupErrors(pin=True)
    k = [0]
    m = [batches[0].numel()]

    def run(where: str) -> Callable[[], None]:
        def go() -> None:
            ids = batches[k[0] % len(batches)][: m[0]]
            k[0] += 1
            lookup_rows(ids, out[: m[0]], store.sources[where], store.tables, None, err.ptr)
        return go

    first = cuda_time(run("zc"), warmup=1, iters=1)["median_ms"]
    if first > SLOW_MS:
        m[0] = max(1000, min(m[0], int(m[0] * SLOW_MS / first)))
    rounds: dict[str, list[float]] = {"zc": [], "hbm": []}
    for _ in range(2):
        for where in ("zc", "hbm"):
            rounds[where].append(cuda_time(run(where), warmup=args.warmup, iters=args.iters)["median_ms"])
    res: dict[str, Any] = {"iters": args.iters, "rounds_ms": rounds, "batch_timed": m[0]}
    for where, ms in rounds.items():
        res[f"{where}_ms"] = float(np.median(ms))
    torch.cuda.synchronize()
    res["kernel_report"] = err.take()
    return res


def verify(store: Store, ids: torch.Tensor, out: torch.Tensor, expect: torch.Tensor) -> bool:
    """Both sources decode ``ids`` to exactly the source rows."""
    from ibpcache.kernels.lookup import LookupErrors, lookup_rows

    err = LookupErrors(pin=True)
    ok = True
    for where in ("zc", "hbm"):
        out.zero_()
        lookup_rows(ids, out, store.sources[where], store.tables, None, err.ptr)
        torch.cuda.synchronize()
        ok &= bool(torch.equal(out.cpu(), expect)) and err.take() is None
    return ok


def bench_gpu(name: str, dtype: str, real: torch.Tensor, methods: list[str], args: argparse.Namespace, bw: float,
              base: dict[str, Any]) -> list[dict[str, Any]]:
    su = datasets.scale_up(real, int(args.gb * 1e9), seed=0, pin_memory=True)
    su_u8 = su.view(torch.uint8).reshape(su.shape[0], -1)
    n, rb = su_u8.shape
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, n, (args.batch,), device="cuda", generator=gen) for _ in range(4)]
    expect = su_u8[batches[0].cpu()]
    out = torch.empty((args.batch, rb), dtype=torch.uint8, device="cuda")
    sample = su[torch.randperm(n, generator=torch.Generator().manual_seed(2))[: min(n, 1 << 17)]].cuda()
    recs = []
    for method in methods:
        t0 = time.perf_counter()
        codec = fit_method(sample, method)
        torch.cuda.synchronize()
        fit_s = time.perf_counter() - t0
        store = Store(codec, su, su_u8)
        t = time_lookups(store, batches, out, args)
        ok = verify(store, batches[0], out, expect)
        m = t["batch_timed"]
        comp = float(np.median([store.batch_bytes(b[:m], rb) for b in batches]))
        out_bytes = m * rb
        recs.append({**base[method], "rows_su": n, "su_gb": n * rb / 1e9, "batch": args.batch, "batch_timed": m,
                     "fit_s": fit_s,
                     "compress_s": store.compress_s, "zc_ms": t["zc_ms"], "hbm_ms": t["hbm_ms"],
                     "zc_gbps": out_bytes / (t["zc_ms"] * 1e-3) / 1e9,
                     "hbm_gbps": out_bytes / (t["hbm_ms"] * 1e-3) / 1e9, "rounds_ms": t["rounds_ms"],
                     "iters": t["iters"], "batch_stored_bytes": comp, "ideal_ms": comp / (bw * 1e9) * 1e3,
                     "verified": ok and t["kernel_report"] is None and base[method]["ratio_verified"]})
        del store
        gc.collect()
        torch.cuda.empty_cache()
    raw = next((r for r in recs if r["method"] == "raw"), None)
    for r in recs:
        # throughput ratios: a method timed on a smaller batch (batch_timed) compares per output byte
        r["vs_raw_zc"] = r["zc_gbps"] / raw["zc_gbps"] if raw else None
        r["vs_raw_hbm"] = r["hbm_gbps"] / raw["hbm_gbps"] if raw else None
        r["fraction_of_ideal"] = r["ideal_ms"] / r["zc_ms"]
    recs.append(cpu_bulk(su_u8, batches, expect, args, {"table": name, "dtype": dtype, "row_bytes": rb}))
    if f"{name}:{dtype}" in args.nvcomp_sets.split(","):
        recs += nvcomp(su_u8, batches[0], args, bw, {"table": name, "dtype": dtype, "row_bytes": rb})
    del su, su_u8, sample
    gc.collect()
    torch.cuda.empty_cache()
    return recs


def cpu_bulk(su_u8: torch.Tensor, batches: list[torch.Tensor], expect: torch.Tensor, args: argparse.Namespace,
             base: dict[str, Any]) -> dict[str, Any]:
    """(b) the framework way: CPU index_select of raw rows into pinned staging + one bulk copy."""
    cpu_batches = [b.cpu() for b in batches]
    staging = torch.empty((args.batch, su_u8.shape[1]), dtype=torch.uint8, pin_memory=True)
    out = torch.empty_like(staging, device="cuda")
    k = [0]

    def run() -> None:
        ids = cpu_batches[k[0] % len(cpu_batches)]
        k[0] += 1
        torch.index_select(su_u8, 0, ids, out=staging)
        out.copy_(staging, non_blocking=True)

    t = cpu_time(run, warmup=args.warmup, iters=args.iters, sync_cuda=True)
    k[0] = 0
    run()
    torch.cuda.synchronize()
    return {**base, "method": "cpu_bulk", "zc_ms": t["median_ms"],
            "zc_gbps": args.batch * su_u8.shape[1] / (t["median_ms"] * 1e-3) / 1e9,
            "verified": bool(torch.equal(out.cpu(), expect))}


def nvcomp(su_u8: torch.Tensor, ids: torch.Tensor, args: argparse.Namespace, bw: float,
           base: dict[str, Any]) -> list[dict[str, Any]]:
    """(c) nvCOMP codecs, one chunk per row, on the first ``--nvcomp-rows`` rows (a failing baseline is recorded,
    never fatal)."""
    try:
        from scripts.lib.nvcomp_baseline import available, nvcomp_row_codec_bench

        ok, why = available()
        if not ok:
            return [{**base, "method": "nvcomp", "error": why}]
        sub_n = min(su_u8.shape[0], args.nvcomp_rows)
        sub = su_u8[:sub_n].cuda()
        recs = []
        for r in nvcomp_row_codec_bench(sub, ids % sub_n, iters=args.iters, warmup=args.warmup, pinned_gbps=bw,
                                        encode_budget_s=args.nvcomp_budget):
            ms = r.get("fetch_ms_median")
            rec = {**base, "method": f"nvcomp_{r.get('algorithm')}", "nvcomp": r}
            if ms:
                rec.update(zc_ms=ms, zc_gbps=ids.numel() * su_u8.shape[1] / (ms * 1e-3) / 1e9,
                           verified=r.get("verified"))
            recs.append(rec)
        return recs
    except Exception as exc:  # a baseline failing must not hide our numbers
        return [{**base, "method": "nvcomp", "error": repr(exc)}]


# ---- CPU smoke run: the CPU decoder over a small scaled-up table -------------------------------------------------


def bench_cpu(name: str, dtype: str, real: torch.Tensor, methods: list[str], args: argparse.Namespace,
              base: dict[str, Any]) -> list[dict[str, Any]]:
    su = datasets.scale_up(real, int(args.gb * 1e9), seed=0)
    su_u8 = su.view(torch.uint8).reshape(su.shape[0], -1)
    n, rb = su_u8.shape
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, n, (args.batch,), generator=gen) for _ in range(2)]
    recs = []
    for method in methods:
        codec = fit_method(su[: min(n, 1 << 15)], method)
        packed = codec.compress(su, layout="packed", pin=False, device="cpu")
        k = [0]

        def run() -> torch.Tensor:
            ids = batches[k[0] % 2]
            k[0] += 1
            return packed.gather(ids, device="cpu")

        t = cpu_time(run, warmup=1, iters=args.iters)
        ok = bool(torch.equal(packed.gather(batches[0], device="cpu").view(torch.uint8).reshape(-1, rb),
                              su_u8[batches[0]]))
        recs.append({**base[method], "rows_su": n, "batch": args.batch, "cpu_ms": t["median_ms"],
                     "cpu_gbps": args.batch * rb / (t["median_ms"] * 1e-3) / 1e9,
                     "verified": ok and base[method]["ratio_verified"]})
    return recs


# ---- the paper's Figure 7 sweep (IBP on synthetic masks) ---------------------------------------------------------


def fig7(args: argparse.Namespace, bw: float) -> list[dict[str, Any]]:
    """Rows of 256 B / 1 KB / 4 KB; a synthetic mask fixing a fraction s of the bits in every row."""
    from ibpcache.kernels.bitpack import gather_rows

    recs = []
    n_bytes = int(args.fig7_gb * 1e9)
    for rb in (256, 1024, 4096):
        n = n_bytes // rb
        for s in (0.1, 0.3, 0.5, 0.7, 0.9):
            g = torch.Generator(device="cuda").manual_seed(rb)
            words = rb // 4
            fixed = torch.rand(words * 32, generator=g, device="cuda") < s
            fixed_mask = (fixed.view(words, 32).long() << torch.arange(32, device="cuda")).sum(1)
            fixed_val = fixed_mask & torch.randint(0, 2**32, (words,), device="cuda", generator=g)
            vals = torch.randint(0, 2**32, (n, words), device="cuda", generator=g, dtype=torch.int64)
            vals = (vals & ~fixed_mask) | fixed_val
            rows = torch.where(vals >= 2**31, vals - 2**32, vals).to(torch.int32)
            del vals
            codec = Codec(fixed_mask.cpu().numpy().astype(np.uint64), fixed_val.cpu().numpy().astype(np.uint64),
                          chunk_bytes=4, row_bytes=rb, dtype=torch.int32, row_shape=(words,), threshold=1.0)
            packed = codec.compress(rows)
            host_rows = rows.cpu()
            del rows
            torch.cuda.empty_cache()
            batches = [torch.randint(0, n, (args.batch,), device="cuda", generator=g) for _ in range(4)]
            out = torch.empty(args.batch, rb, dtype=torch.uint8, device="cuda")
            meta = packed.device_meta(out.device)
            k = [0]

            def run() -> None:
                ids = batches[k[0] % 4]
                k[0] += 1
                gather_rows(packed.host_data_for_gpu(), meta.get("offsets"), meta["lengths"], meta["flags"],
                            packed.n_rows, ids, out, codec.kernel_tables(out.device))

            t = cuda_time(run, warmup=args.warmup, iters=args.iters)
            k[0] = 0
            run()
            ok = bool(torch.equal(out.cpu(), host_rows.view(torch.uint8).reshape(n, rb)[batches[0].cpu()]))
            comp = float(packed.lengths[batches[0].cpu()].sum())
            ideal_ms = comp / (bw * 1e9) * 1e3
            recs.append({"row_bytes": rb, "target_savings": s, "savings": 1 - 1 / packed.ratio, "ratio": packed.ratio,
                         "median_ms": t["median_ms"], "ideal_ms": ideal_ms,
                         "fraction_of_ideal": ideal_ms / t["median_ms"],
                         "gbps": args.batch * rb / (t["median_ms"] * 1e-3) / 1e9, "verified": ok})
            del packed, host_rows
    return recs


# ---- plots ---------------------------------------------------------------------------------------------------------


def plot_main(records: list[dict[str, Any]]) -> Any:
    import matplotlib.pyplot as plt

    ours = [r for r in records if r.get("method") in METHODS]
    keys = list(dict.fromkeys((r["table"], r["dtype"]) for r in ours))
    methods = [m for m in METHODS if any(r["method"] == m for r in ours)]
    speed = "zc_gbps" if any("zc_gbps" in r for r in ours) else "cpu_gbps"
    panels = [("stored_ratio", "stored ratio (tables included)"), (speed, f"{speed} (output)")]
    if any("hbm_gbps" in r for r in ours):
        panels.append(("hbm_gbps", "hbm_gbps (output)"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(10, 0.55 * len(keys) * len(methods) / 2), 3.2 * len(panels)),
                             squeeze=False)
    w = 0.8 / max(1, len(methods))
    x = np.arange(len(keys))
    for ax, (field, label) in zip(axes[:, 0], panels):
        for i, m in enumerate(methods):
            vals = [next((r.get(field) or 0 for r in ours if (r["table"], r["dtype"]) == k and r["method"] == m), 0)
                    for k in keys]
            ax.bar(x + i * w, vals, w, label=m)
        if field == speed:
            bulk = [next((r.get(field) or 0 for r in records if (r.get("table"), r.get("dtype")) == k
                          and r.get("method") == "cpu_bulk"), 0) for k in keys]
            if any(bulk):
                ax.plot(x + 0.4 - w / 2, bulk, "k_", ms=14, label="cpu_bulk")
        ax.set_ylabel(label)
        ax.set_xticks(x + 0.4 - w / 2, [f"{t}\n{d}" for t, d in keys], fontsize=7)
    axes[0, 0].legend(fontsize=7, ncol=len(methods) + 1)
    axes[0, 0].set_title(f"{records[0].get('batch', '')} random rows per lookup (the engine's lookup kernel)")
    fig.tight_layout()
    return fig


def plot_fig7(records: list[dict[str, Any]]) -> Any:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for rb in sorted({r["row_bytes"] for r in records}):
        rr = [r for r in records if r["row_bytes"] == rb]
        ax.plot([r["savings"] for r in rr], [r["fraction_of_ideal"] for r in rr], "o-", label=f"{rb} B rows")
    ax.axhline(0.95, ls="--", c="gray")
    ax.axhline(0.90, ls=":", c="gray")
    ax.set_xlabel("space savings")
    ax.set_ylabel("throughput / ideal")
    ax.legend()
    fig.tight_layout()
    return fig


# ---- main --------------------------------------------------------------------------------------------------------


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(p)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run (CPU decoder)")
    p.add_argument("--gb", type=float, default=2.0, help="scaled-up size of each (table, dtype) in GB")
    p.add_argument("--tables", default=",".join(TABLES))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--batch", type=int, default=100_000)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nvcomp-sets", default="minilm:fp32,kv_chat_v:bf16",
                   help="table:dtype pairs that also run the nvCOMP baseline")
    p.add_argument("--nvcomp-rows", type=int, default=200_000)
    p.add_argument("--nvcomp-budget", type=float, default=3.0, help="seconds of nvCOMP encoding per algorithm")
    p.add_argument("--no-nvcomp", action="store_true")
    p.add_argument("--fig7-gb", type=float, default=0.25)
    p.add_argument("--no-fig7", action="store_true")
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.gb, args.iters, args.warmup, args.fig7_gb, args.nvcomp_rows = min(args.gb, 0.02), 3, 1, 0.02, 20_000
        args.batch = min(args.batch, 2_000)
    if args.no_nvcomp or args.device == "cpu":
        args.nvcomp_sets = ""
    return args


def main(argv: "list[str] | None" = None) -> int:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench_codec needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    bw = pinned_h2d_gbps() if cuda else 0.0
    if cuda:
        print(f"pinned H2D memcpy: {bw:.1f} GB/s", flush=True)
    records: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for name in args.tables.split(","):
        for dtype in args.dtypes.split(","):
            real, how = load_table(name, dtype)
            methods = [m for m in args.methods.split(",") if applies(m, real.dtype)]
            base = {}
            for m in methods:
                codec = fit_method(real.cuda() if cuda else real, m)
                base[m] = {"table": name, "dtype": dtype, "conversion": how, "method": m, "rows": int(real.shape[0]),
                           "row_bytes": int(real[0].numel() * real.element_size()),
                           **stored_ratios(codec, real, args.device)}
            recs = (bench_gpu(name, dtype, real, methods, args, bw, base) if cuda
                    else bench_cpu(name, dtype, real, methods, args, base))
            records += recs
            print(format_table([r for r in recs if r["method"] in METHODS], COLUMNS if cuda else
                               ["table", "dtype", "method", "stored_ratio", "cpu_gbps", "verified"]), flush=True)
    meta = {k: v for k, v in vars(args).items() if k != "out"}
    meta["pinned_h2d_gbps"] = bw
    meta["seconds"] = time.perf_counter() - t_start
    write_results(args.out, "bench_codec", records, plot_main, meta=meta)
    if cuda and not args.no_fig7:
        f7 = fig7(args, bw)
        print(format_table(f7), flush=True)
        write_results(args.out, "bench_codec_fig7", f7, plot_fig7, meta=meta)
        records += f7
    bad = [r for r in records if r.get("verified") is False]
    if bad:
        print(f"VERIFICATION FAILED for {len(bad)} record(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
