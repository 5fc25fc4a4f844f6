"""Experiment: where does the exponent codec's lookup lose to raw rows -- its decode, or the bytes it reads?

Real MiniLM rows (``bench_dlrm.real_rows``: fp32 / fp16 at 512 B and 2 KB, the DLRM grid's widths) are scaled up
to ``--gb`` GB per set (``datasets.scale_up``: reads come over PCIe, not from L2) and stored by each codec (raw,
ibp, exponent for each ``--seg``) in the ``inplace`` layout (row i at ``i * row_bytes``, per-row lengths: what the
layout planner's calibration times). For ``--ids`` Zipf and uniform ids it times, per codec:

  pool     the embedding bags' fused inference step for one-hot features (``kernels.lookup.lookup_pool``, one id per
           bag, SUM): what ``TableBatchedCachedEmbeddingBag`` runs and ``plan_layout.calibrate_layout`` times
  pool_bags  the same one-id bags given as offsets: the bag loop, which groups rows of ONE bag, so an exponent row
           decodes alone on its segments' lanes (what ``pool``'s grouping across bags is measured against)
  rows     the rows kernel (``lookup_rows``): the same ExpRows decoder, rows grouped across ids
  gather   the same rows' STORED bytes copied with no decode (admit.cu's ``ibp_adm_copy``, the engine's admission
           copy): the rate at which the link delivers this codec's stored size, a floor for its lookups

with the stored rows in pinned host memory (``zc``: zero-copy misses) and in device memory (``hbm``: cache hits,
where only decode speed counts). ``pool_zc / gather_zc`` near 1 means a lookup runs at the link rate of its stored
bytes; far above 1 means the decode is the bottleneck. ``vs_raw`` is raw's time over this codec's (> 1: faster).

Every lookup output is verified byte for byte (rows: the source rows; pool: ``0.0f + row`` rounded back, the
kernel's arithmetic for a bag of one id), the CPU decoder (``Codec.decode_rows_at``) is checked on the same stored
rows, and the gather's bytes against the store. CUDA events, warm-up, medians of ``--reps`` (>= 20).

``--variants`` times compile-time variants of the lookup kernels (exponent.cu's ``IBP_EXP_STAGE_VEC16`` /
``IBP_EXP_VEC16_UNROLL``, lookup.cu's ``IBP_EXP_LOOKUP_UNROLL`` / ``IBP_EXP_LOOKUP_SHFL`` / ``IBP_EXP_MIN_WARPS`` /
``IBP_MIN_WARPS``) in the same process, each verified byte for byte like the default: ``base`` (the defaults),
``v0`` (16-byte-aligned rows staged with 4-byte loads too, as before the 16-byte path), ``v4`` (4 instead of 2
16-byte loads per lane in flight), ``u8`` (8 staged words per lane in flight on the 4-byte path), ``s`` (a staged
word's successor by shuffle: host words requested once, not twice), ``w24`` (registers capped so 24 warps fit an
SM), ``r24`` (the same cap for the raw and IBP kinds' kernels: more cache-hit rows in flight; raw and IBP rows are
timed in it too), ``c0`` (raw rows through the IBP ring decoder, as before the raw copy path), ``n4`` (4 instead
of 8 words per lane in flight for one-id bags of raw rows), and combinations (``u8sw24``). One record per codec and variant (column ``variant``); a variant's
``gather`` is its codec's (no decode); ratios against raw are against raw's defaults. Each
variant is one more NVRTC build of lookup.cu (seconds, inside the first set's time).

    python scripts/experiments/exp_lookup_profile.py --out $OUT            # GPU, about a minute (H100/H200)
    python scripts/experiments/exp_lookup_profile.py --device cpu --quick  # CPU smoke: ratios and checks only
    python scripts/experiments/exp_lookup_profile.py --entry-bytes 512 --dists zipf --seg auto \
        --variants base,v0,v4,v0u8w24 --budget-s 240 --out $OUT     # the variants, 1-2 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

_ROOT = str(Path(__file__).resolve().parents[2])  # the repository root: scripts.* and ibpcache import from it
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from ibpcache import Codec, ExponentCodec, datasets  # noqa: E402
from ibpcache.errors import InvalidArgumentError  # noqa: E402
from ibpcache.kernels._build import extra_kernel_options  # noqa: E402
from ibpcache.kernels.exponent import group_rows  # noqa: E402
from ibpcache.kernels.lookup import POOL_MAX_ROW_BYTES  # noqa: E402
from ibpcache.testing.timing import add_out_argument, cuda_time, format_table, write_results  # noqa: E402
from scripts.bench_dlrm import real_rows  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
KERNELS = ("pool", "pool_bags", "rows", "gather")
WHERE = ("zc", "hbm")
COLUMNS = ["dtype", "row_bytes", "dist", "method", "variant", "n_seg", "G", "G_pool", "ratio", "pool_zc",
           "pool_bags_zc", "rows_zc", "gather_zc", "pool_hbm", "pool_bags_hbm", "rows_hbm", "gather_hbm",
           "pool_zc_vs_raw", "pool_zc_over_gather", "verified"]
_COPY_WARPS = 8  # IBP_ADM_COPY_WARPS in admit.cu


@dataclass
class Store:
    """One codec's stored copy of a set: pinned host bytes, the same bytes in device memory, per-row lengths."""

    method: str
    codec: Codec
    host: torch.Tensor  # uint8 [n * row_bytes], pinned on CUDA runs
    lengths: Optional[torch.Tensor]  # int32 [n] on the CPU; None: every row raw
    resident: Optional[torch.Tensor] = None  # the same bytes in device memory (GPU runs)
    dev_lengths: Optional[torch.Tensor] = None
    sources: dict[str, Any] = field(default_factory=dict)


def parse_segs(text: str) -> list["int | str | None"]:
    """``--seg``: comma-separated ``auto`` (the engine's choice), ``none`` (one segment per row) or element counts."""
    out: list["int | str | None"] = []
    for tok in (t.strip() for t in text.split(",") if t.strip()):
        if tok == "auto":
            out.append("auto")
        elif tok == "none":
            out.append(None)
        elif tok.isdigit() and int(tok) > 0:
            out.append(int(tok))
        else:
            raise InvalidArgumentError(f"--seg: expected auto, none or a positive int, got {tok!r}")
    return out


def parse_variants(text: str) -> dict[str, tuple[str, ...]]:
    """``--variants``: comma-separated ``base`` or ``v<V>u<U>sw<W>r<R>c0n<N>`` (each part optional, in this order):
    the lookup kernels built with ``-DIBP_EXP_VEC16_UNROLL=V`` (1..16; ``v0``: ``-DIBP_EXP_STAGE_VEC16=0``, the
    4-byte staging path only), ``-DIBP_EXP_LOOKUP_UNROLL=U`` (1..32), ``-DIBP_EXP_LOOKUP_SHFL=1`` (``s``),
    ``-DIBP_EXP_MIN_WARPS=W`` (1..64), and for the raw and IBP kinds' kernels (so their codecs are timed in such a
    variant too) ``-DIBP_MIN_WARPS=R`` (1..64), ``-DIBP_RAW_COPY=0`` (``c0``: raw rows through the ring decoder, as before the copy path) and/or
    ``-DIBP_SINGLE_UNROLL=N`` (1..16: words per lane in flight of one-id bags). Name -> options."""
    out: dict[str, tuple[str, ...]] = {}
    for tok in (t.strip() for t in text.split(",") if t.strip()):
        m = re.fullmatch(r"(?:v(\d+))?(?:u(\d+))?(s)?(?:w(\d+))?(?:r(\d+))?(c0)?(?:n(\d+))?", tok)
        if tok == "base":
            out[tok] = ()
        elif tok and m and (m.group(1) is None or 0 <= int(m.group(1)) <= 16) and (
                m.group(2) is None or 1 <= int(m.group(2)) <= 32) and all(
                m.group(g) is None or 1 <= int(m.group(g)) <= 64 for g in (4, 5)) and (
                m.group(7) is None or 1 <= int(m.group(7)) <= 16):
            vec = [] if m.group(1) is None else (["-DIBP_EXP_STAGE_VEC16=0"] if int(m.group(1)) == 0
                                                  else [f"-DIBP_EXP_VEC16_UNROLL={int(m.group(1))}"])
            opts = vec + ([f"-DIBP_EXP_LOOKUP_UNROLL={int(m.group(2))}"] if m.group(2) else []) + (
                ["-DIBP_EXP_LOOKUP_SHFL=1"] if m.group(3) else []) + (
                [f"-DIBP_EXP_MIN_WARPS={int(m.group(4))}"] if m.group(4) else []) + (
                [f"-DIBP_MIN_WARPS={int(m.group(5))}"] if m.group(5) else []) + (
                ["-DIBP_RAW_COPY=0"] if m.group(6) else []) + (
                [f"-DIBP_SINGLE_UNROLL={int(m.group(7))}"] if m.group(7) else [])
            out[tok] = tuple(opts)
        else:
            raise InvalidArgumentError(f"--variants: expected base or v<0..16>, u<1..32>, s, w<1..64>, r<1..64>, c0, "
                                       f"n<1..16> in this order (e.g. v0, v2, u8, u8s, w24, r24, v0u8sw24, c0, "
                                       f"n4), got {tok!r}")
    if not out:
        raise InvalidArgumentError("--variants: name at least one variant (base: the defaults)")
    return out


def fit_codecs(real: torch.Tensor, segs: list["int | str | None"]) -> dict[str, Codec]:
    """raw, ibp and one exponent codec per segment choice, fitted on the real rows (where they live)."""
    codecs: dict[str, Codec] = {"raw": Codec.raw(real.dtype, tuple(real.shape[1:])), "ibp": Codec.fit(real)}
    for seg in segs:
        codec = Codec.fit(real, method="exponent") if seg == "auto" else ExponentCodec.fit(real, seg=seg)
        codecs[f"exp_seg{'auto' if seg == 'auto' else codec.seg}"] = codec
    return codecs


def make_store(method: str, codec: Codec, su: torch.Tensor, device: torch.device) -> Store:
    """``su``'s rows as ``codec`` stores them (inplace layout), on the host and (CUDA) in device memory."""
    cuda = device.type == "cuda"
    if method == "raw":
        store = Store(method, codec, su.view(torch.uint8).reshape(-1), None)
    else:
        packed = codec.compress(su, layout="inplace", pin=cuda, device=device)
        store = Store(method, codec, packed.data, packed.lengths)
    if cuda:
        from ibpcache.kernels.hashmap import IndexArgs, IndexMode
        from ibpcache.kernels.lookup import RowSource

        n, rb = int(su.shape[0]), codec.row_bytes
        store.resident = torch.empty(store.host.numel() + 16, dtype=torch.uint8, device=device)
        store.resident[: store.host.numel()].copy_(store.host)
        store.dev_lengths = None if store.lengths is None else store.lengths.to(device)
        empty = torch.empty(0, dtype=torch.int64, device=device)
        index = IndexArgs(IndexMode.NONE, empty, empty, 0, 0)
        bases = torch.zeros(8, dtype=torch.int64, device=device)
        for where, base in (("zc", store.host.data_ptr()), ("hbm", store.resident.data_ptr())):
            store.sources[where] = RowSource(index, bases, base, None, rb, store.dev_lengths, n)
    return store


def stored_bytes(store: Store, ids_cpu: torch.Tensor, row_bytes: int) -> int:
    if store.lengths is None:
        return int(ids_cpu.numel()) * row_bytes
    return int(store.lengths[ids_cpu].sum(dtype=torch.int64))


def cpu_decode_ok(store: Store, ids_cpu: torch.Tensor, su_u8: torch.Tensor) -> bool:
    """The CPU decoder reads the stored rows of ``ids_cpu`` back to exactly the source rows."""
    if store.lengths is None:
        return True
    rb = store.codec.row_bytes
    ids = ids_cpu.numpy().astype(np.int64)
    out = np.zeros((ids.size, rb), dtype=np.uint8)
    store.codec.decode_rows_at(store.host.numpy(), ids * rb, store.lengths.numpy()[ids].astype(np.int64), out,
                               np.arange(ids.size, dtype=np.int64))
    return bool(np.array_equal(out, su_u8[ids_cpu].numpy()))


# ---- GPU ----------------------------------------------------------------------------------------------------


def pool_expect(rows_u8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the pooling kernel writes for a bag of one row: ``0.0f + v`` in float32, rounded back to the dtype."""
    rb = rows_u8.shape[1]
    v = rows_u8.view(dtype).float()
    return (torch.zeros_like(v) + v).to(dtype).view(torch.uint8).reshape(-1, rb)


class Runner:
    """The three timed operations of one store on one source (zc / hbm), for one batch of ids."""

    def __init__(self, store: Store, where: str, ids: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> None:
        from ibpcache.kernels.lookup import LookupErrors

        self.store, self.where, self.ids, self.out, self.dtype = store, where, ids, out, dtype
        self.tables = store.codec.kernel_tables(out.device)
        self.err = LookupErrors(pin=True)
        dev = out.device
        n, rb = ids.numel(), store.codec.row_bytes
        self.list_len = (torch.full((n,), rb, dtype=torch.int32, device=dev) if store.dev_lengths is None
                         else store.dev_lengths[ids].contiguous())
        self.list_dst = out.data_ptr() + torch.arange(n, dtype=torch.int64, device=dev) * rb
        self.ws = torch.tensor([n, 0], dtype=torch.int64, device=dev)  # IBP_ADM_WS_LIST: entries of the copy list
        self.stats = torch.zeros(8, dtype=torch.int64, device=dev)
        self.offsets = torch.arange(n, dtype=torch.int64, device=dev)  # one id per bag, for the bag loop

    def pool(self) -> None:
        from ibpcache.kernels.lookup import ElemType, PoolOp, lookup_pool

        n = self.ids.numel()
        lookup_pool(self.ids, None, 1, n, False, PoolOp.SUM, ElemType.of(self.dtype), None, self.out,
                    self.store.sources[self.where], self.tables, None, self.err.ptr)

    def pool_bags(self) -> None:
        from ibpcache.kernels.lookup import ElemType, PoolOp, lookup_pool

        n = self.ids.numel()
        lookup_pool(self.ids, self.offsets, 0, n, False, PoolOp.SUM, ElemType.of(self.dtype), None, self.out,
                    self.store.sources[self.where], self.tables, None, self.err.ptr)

    def rows(self) -> None:
        from ibpcache.kernels.lookup import lookup_rows

        lookup_rows(self.ids, self.out, self.store.sources[self.where], self.tables, None, self.err.ptr)

    def gather(self) -> None:
        from ibpcache.kernels._build import device_index, launch, sm_count

        dev, n = device_index(self.out), self.ids.numel()
        base = self.store.host if self.where == "zc" else self.store.resident
        grid = max(1, min(-(-n // _COPY_WARPS), sm_count(dev) * 16))
        launch("admit.cu", "ibp_adm_copy", dev, grid, 32 * _COPY_WARPS,
               (np.uint64(self.ids.data_ptr()), np.uint64(self.list_dst.data_ptr()),
                np.uint64(self.list_len.data_ptr()), np.uint64(self.ws.data_ptr()), np.int64(n),
                np.int64(base.data_ptr()), np.uint64(0), np.int64(self.store.codec.row_bytes),
                np.uint64(self.stats.data_ptr())))

    def verify(self, kernel: str, expect_rows: torch.Tensor, expect_pool: torch.Tensor) -> bool:
        """One run of ``kernel`` into a zeroed output, compared byte for byte (and no kernel error report)."""
        self.out.zero_()
        getattr(self, kernel)()
        torch.cuda.synchronize()
        if self.err.take() is not None:
            return False
        if kernel.startswith("pool"):
            return bool(torch.equal(self.out, expect_pool))
        if kernel == "rows":
            return bool(torch.equal(self.out, expect_rows))
        return self._gather_ok()

    def _gather_ok(self, check: int = 2048) -> bool:
        """The first ``check`` rows' stored bytes arrived intact (the bytes past a row's length are untouched)."""
        rb = self.store.codec.row_bytes
        m = min(check, self.ids.numel())
        ids = self.ids[:m].cpu()
        stored = self.store.host.view(-1, rb)[ids]
        got = self.out[:m].cpu()
        keep = torch.arange(rb).unsqueeze(0) < self.list_len[:m].cpu().unsqueeze(1)
        return bool(torch.equal(got[keep], stored[keep])) and bool((got[~keep] == 0).all())


def time_store(store: Store, batches: list[torch.Tensor], out: torch.Tensor, dtype: torch.dtype,
               expect: tuple[torch.Tensor, torch.Tensor], kernels: list[str], args: argparse.Namespace
               ) -> dict[str, Any]:
    """Median ms of every (kernel, source), cycling through ``batches``; every output verified once."""
    res: dict[str, Any] = {}
    ok = True
    for where in WHERE:
        runners = [Runner(store, where, b, out, dtype) for b in batches]
        for kernel in kernels:
            ok &= runners[0].verify(kernel, *expect)
            k = [0]

            def step(kernel: str = kernel) -> None:
                getattr(runners[k[0] % len(runners)], kernel)()
                k[0] += 1

            res[f"{kernel}_{where}"] = cuda_time(step, warmup=args.warmup, iters=args.reps)["median_ms"]
    res["gpu_verified"] = ok
    return res


# ---- one set ------------------------------------------------------------------------------------------------


def make_ids(n_rows: int, dist: str, args: argparse.Namespace, seed: int) -> torch.Tensor:
    a = args.zipf_a if dist == "zipf" else 0.0  # a = 0: uniform
    return datasets.zipf_ids(n_rows, args.ids, a=a, seed=seed, hot_seed=0)


def run_set(dtype_name: str, row_bytes: int, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Every codec and id distribution of one (dtype, row size) set."""
    dtype = DTYPES[dtype_name]
    cuda = device.type == "cuda"
    real = real_rows(row_bytes, dtype)
    su = datasets.scale_up(real, int(args.gb * 1e9), seed=0, pin_memory=cuda)
    su_u8 = su.view(torch.uint8).reshape(su.shape[0], -1)
    n = int(su.shape[0])
    codecs = fit_codecs(real.to(device), args.segs)
    stores = {m: make_store(m, c, su, device) for m, c in codecs.items()}
    recs: list[dict[str, Any]] = []
    for d, dist in enumerate(args.dists):
        ids_cpu = [make_ids(n, dist, args, seed=1 + b) for b in range(args.batches)]
        base = {"dtype": dtype_name, "row_bytes": row_bytes, "dist": dist, "rows": n, "ids": args.ids,
                "set_gb": n * row_bytes / 1e9}
        timed: dict[str, dict[str, Any]] = {}
        if cuda:
            batches = [i.to(device) for i in ids_cpu]
            out = torch.empty((args.ids, row_bytes), dtype=torch.uint8, device=device)
            expect_rows = su_u8[ids_cpu[0]].to(device)
            expect = (expect_rows, pool_expect(expect_rows, dtype))
            for method, store in stores.items():
                variants = variants_of(method, args)
                for i, variant in enumerate(variants):
                    # the stored-bytes copy (admit.cu) does not depend on the variant: timed once
                    kernels = [k for k in args.kernels if i == 0 or k != "gather"]
                    with (extra_kernel_options(*args.variants[variant]) if variant != "base"
                          else contextlib.nullcontext()):
                        timed[method, variant] = time_store(store, batches, out, dtype, expect, kernels, args)
                    for key in (f"gather_{w}" for w in WHERE):
                        if key in timed[method, variants[0]]:
                            timed[method, variant].setdefault(key, timed[method, variants[0]][key])
            del out, expect_rows, expect, batches
        check = ids_cpu[0][: args.cpu_check]
        first = len(recs)
        for method, store in stores.items():
            codec = store.codec
            sb = stored_bytes(store, ids_cpu[0], row_bytes)
            n_seg = getattr(codec, "n_seg", None)
            rec = {**base, "method": method, "seg": getattr(codec, "seg", None), "n_seg": n_seg,
                   "G": group_rows(row_bytes, codec.row_elems, n_seg) if n_seg else None,
                   "G_pool": group_rows(row_bytes, codec.row_elems, n_seg, POOL_MAX_ROW_BYTES // row_bytes)
                   if n_seg else None,
                   "ratio": args.ids * row_bytes / sb, "batch_stored_bytes": sb,
                   "cpu_verified": cpu_decode_ok(store, check, su_u8) if d == 0 else None}
            for variant in variants_of(method, args) if cuda else ["base"]:
                vrec = {**rec, "variant": variant, **timed.get((method, variant), {})}
                vrec["verified"] = vrec["cpu_verified"] is not False and vrec.get("gpu_verified", True)
                recs.append(vrec)
        derive(recs[first:], args.kernels if cuda else [])
    return recs


def variants_of(method: str, args: argparse.Namespace) -> list[str]:
    """The variants a codec is timed in: every ``--variants`` for exponent codecs (the kernels they change); for raw
    and IBP rows the defaults and the variants that change their kernels (``r<R>``, ``c0``, ``n<N>``)."""
    if method.startswith("exp"):
        return list(args.variants)
    ibp_kinds = ("-DIBP_MIN_WARPS=", "-DIBP_RAW_COPY=", "-DIBP_SINGLE_UNROLL=")
    return ["base"] + [v for v, opts in args.variants.items()
                       if v != "base" and any(o.startswith(ibp_kinds) for o in opts)]


def derive(recs: list[dict[str, Any]], kernels: list[str]) -> None:
    """Speed against raw rows and against the codec's own stored-bytes gather (same source)."""
    raw = next(r for r in recs if r["method"] == "raw" and r.get("variant", "base") == "base")
    for r in recs:
        for kernel in kernels:
            for where in WHERE:
                key = f"{kernel}_{where}"
                if key in r and key in raw:
                    r[f"{key}_vs_raw"] = raw[key] / r[key]
                    if kernel != "gather" and f"gather_{where}" in r:
                        r[f"{key}_over_gather"] = r[key] / r[f"gather_{where}"]


# ---- main ---------------------------------------------------------------------------------------------------


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: ratios and CPU checks only")
    p.add_argument("--dtypes", default="fp32,fp16")
    p.add_argument("--entry-bytes", default="512,2048", help="row sizes in bytes")
    p.add_argument("--seg", default="auto,32", help="exponent segment choices: auto, none or elements (comma list)")
    p.add_argument("--gb", type=float, default=1.0, help="GB of stored raw rows per set (pinned host memory)")
    p.add_argument("--ids", type=int, default=131072, help="ids per lookup")
    p.add_argument("--dists", default="zipf,uniform")
    p.add_argument("--zipf-a", type=float, default=1.05)
    p.add_argument("--batches", type=int, default=2, help="id batches the timed runs cycle through")
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--variants", default="base", help="compile-time variants of the exponent lookup kernels: base, "
                   "u<U> (IBP_EXP_LOOKUP_UNROLL), s (IBP_EXP_LOOKUP_SHFL), w<W> (IBP_EXP_MIN_WARPS), or several "
                   "(u8sw24); comma list")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cpu-check", type=int, default=4096, help="rows the CPU decoder checks per set (first dist)")
    p.add_argument("--budget-s", type=float, default=85.0, help="skip the sets left once this much time has run")
    p.add_argument("--quick", action="store_true", help="a tiny run (tests, CPU smoke)")
    add_out_argument(p)
    args = p.parse_args(argv)
    if args.quick:
        args.gb, args.ids, args.reps, args.warmup, args.cpu_check = 0.004, 2000, 3, 1, 500
    args.segs = parse_segs(args.seg)
    try:
        args.variants = parse_variants(args.variants)
    except InvalidArgumentError as exc:
        p.error(str(exc))
    args.dtype_names = [d for d in args.dtypes.split(",") if d]
    args.entries = [int(e) for e in args.entry_bytes.split(",") if e]
    args.dists = [d for d in args.dists.split(",") if d]
    args.kernels = [k for k in args.kernels.split(",") if k]
    bad = ([d for d in args.dtype_names if d not in DTYPES] + [d for d in args.dists if d not in ("zipf", "uniform")]
           + [k for k in args.kernels if k not in KERNELS])
    if bad:
        p.error(f"unknown values {bad}: dtypes {list(DTYPES)}, dists zipf/uniform, kernels {list(KERNELS)}")
    if not args.quick and args.reps < 20:
        p.error("--reps: medians need at least 20 repetitions (or --quick)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: pass --device cpu for the CPU checks")
    return args


def main(argv: "list[str] | None" = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    records: list[dict[str, Any]] = []
    skipped: list[str] = []
    for row_bytes in args.entries:
        for dtype_name in args.dtype_names:
            tag = f"{dtype_name} {row_bytes} B"
            if time.perf_counter() - t0 > args.budget_s:
                skipped.append(tag)
                continue
            t_set = time.perf_counter()
            records += run_set(dtype_name, row_bytes, args, device)
            print(f"{tag}: {time.perf_counter() - t_set:.1f} s", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(format_table(records, COLUMNS))
    if skipped:
        print(f"skipped (past --budget-s {args.budget_s:g}): {', '.join(skipped)}")
    meta = {"args": {k: v for k, v in vars(args).items() if k not in ("out",)}, "skipped": skipped,
            "wall_s": time.perf_counter() - t0}
    meta["args"]["segs"] = [str(s) for s in args.segs]
    write_results(args.out, "exp_lookup_profile", records, meta=meta)
    return 0 if all(r["verified"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
