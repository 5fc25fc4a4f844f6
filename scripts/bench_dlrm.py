"""DLRM embedding lookups (GPU): FBGEMM's TBE cache, Colossal-AI and ibpcache side by side in one process.

Setup: ``--tables`` (26) embedding tables of real trained rows: the MiniLM word-embedding table resampled to
``--total-gb`` per row size (128 B = MiniLM[:, :32], 512 B = [:, :128], 2 KB = a MiniLM row + 128 columns of
another), ids drawn per table from a bounded Zipf law (``--zipf`` 1.05, hot rows spread by a per-table random
permutation), ``--bags`` ids per table per sample (1 = one categorical value per feature; 20 = a multi-hot bag,
summed). All methods get the same ids, built outside the timed region.

Methods (one module over all tables each, so one lookup call per step):
  fbgemm_lfu / fbgemm_lru  FBGEMM 1.6 ``SplitTableBatchedEmbeddingBagsCodegen`` (what TorchRec runs), every table
                 ``EmbeddingLocation.MANAGED_CACHING`` with ``uvm_host_mapped=True`` (tables in pinned host memory,
                 an HBM cache of ``cache_load_factor`` = the cache ratio), LFU or LRU, default bounds check;
                 staged by ../shared/tools/stage-fbgemm (put its folder on PYTHONPATH)
  colossal       Colossal-AI 0.5 CachedEmbeddingBag (batches it refuses are recorded as "refused")
  torch          ``torch.nn.EmbeddingBag`` over all tables, resident in GPU memory (the no-offload ceiling where the
                 tables fit; sparse gradients + SGD in --train, like the others)
  ibpcache       TableBatchedCachedEmbeddingBag as a user gets it (all defaults): compress="auto" (the planner times
                 compressed vs raw misses at construction and keeps the faster host layout; the JSON's
                 "host_layout" says which and why), fused one-launch inference lookups (lazy id checks, no host
                 sync), cache refreshed from lookup counts
  ibpcache_ibp   the same with compress=True (IBP-compressed pinned host table, whatever the planner would say)
  ibpcache_raw   the same with compress=False (raw host rows through the same kernel)
  ibpcache_staged  ibpcache with a 64 MiB staging buffer (opt-in): multi-id bags may read each missed row once
                 per step (the path planner times both ways per size class and keeps the faster)

In --train every method runs forward + backward + SGD; ours also calls ``prefetch`` with the next batch's ids after
each optimizer step (inside the timed step, as a TorchRec pipeline would), so the next forward finds its rows cached.
Then, per bag size, a fresh module of every offloaded method trains ``--check-steps`` steps on the same ids (batch =
the smallest of ``--batches``; ours with prefetch) beside a fresh ``torch.nn.EmbeddingBag`` with the same SGD, and the
full trained tables are compared: ``trained_weights`` in that point's record says bit_exact, how many rows differ
and the max abs difference (a failing check for ours fails the run; Colossal-AI's is reported as it is).

Inference also runs ``ibpcache`` (defaults) and ``ibpcache_raw`` once more as a pair, their steps alternated on the
same ids (``paired_vs_raw`` in the ibpcache record; ``--no-paired`` skips it): separate runs minutes apart differ by
up to +-10% even between identical configurations, so the "compression never slower than raw" target reads the
paired ratio, and counts a point where the planner chose raw host rows as the raw path it is.

Every step is timed alone with CUDA events (device idle before it; the latency a serving step sees), medians over
``--iters`` steps after ``--warmup`` steps (capped by ``--max-seconds-per-point``). Every method's output is checked
bit for bit against torch's embedding_bag over the full table on the GPU, before and after timing. Writes
bench_dlrm.json (``{"points": [{"row_bytes", "batch", "cache_ratio", "bag", "mode", "methods": {name:
{"M_lookups_per_s", ...}}}]}``) and bench_dlrm.png under --out.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import importlib.util
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ibpcache import datasets
from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag
from ibpcache.testing.timing import add_out_argument, format_table, write_results

METHODS = ("fbgemm_lfu", "fbgemm_lru", "colossal", "torch", "ibpcache", "ibpcache_ibp", "ibpcache_raw",
           "ibpcache_staged")
OURS = {"ibpcache": dict(), "ibpcache_ibp": dict(compress=True), "ibpcache_raw": dict(compress=False),
        "ibpcache_staged": dict(compress=True, stage_bytes=64 << 20)}


# ------------------------------------------------------------------------------------------------
# data: real rows, Zipf ids
# ------------------------------------------------------------------------------------------------


def real_rows(entry_bytes: int) -> torch.Tensor:
    """MiniLM rows shaped to the entry size (float32): <= 1536 B = the first columns; 2 KB = 384 + 128 of another row."""
    minilm = datasets.load_minilm()
    dim = entry_bytes // 4
    if dim <= minilm.shape[1]:
        return minilm[:, :dim].contiguous()
    gen = torch.Generator().manual_seed(1)
    parts, have = [minilm], minilm.shape[1]
    while have < dim:
        other = minilm[torch.randperm(minilm.shape[0], generator=gen)]
        parts.append(other[:, : min(minilm.shape[1], dim - have)])
        have += parts[-1].shape[1]
    return torch.cat(parts, 1).contiguous()


class ZipfIds:
    """Per-table bounded Zipf ids on the GPU: rank k has P ~ k**-a; ranks map to ids by a per-table permutation.

    Every method replays the same sequence (``reset(seed)``), generated outside the timed region.
    """

    def __init__(self, rows_per_table: int, tables: int, a: float, device: torch.device, seed: int = 0) -> None:
        weights = torch.arange(1, rows_per_table + 1, dtype=torch.float64).pow_(-a)
        self.cdf = (weights.cumsum(0) / weights.sum()).to(device)
        gen = torch.Generator().manual_seed(seed)
        self.perm = torch.stack([torch.randperm(rows_per_table, generator=gen) for _ in range(tables)]).to(device)
        self.n, self.tables, self.device = rows_per_table, tables, device
        self.gen = torch.Generator(device=device)

    def reset(self, seed: int) -> None:
        self.gen.manual_seed(seed)

    def batch(self, batch: int, bag: int) -> torch.Tensor:
        """Table-local ids ``[T, batch * bag]`` (table-major: table t's bags are row t)."""
        u = torch.rand((self.tables, batch * bag), generator=self.gen, device=self.device, dtype=torch.float64)
        ranks = torch.searchsorted(self.cdf, u).clamp_(max=self.n - 1)
        return self.perm.gather(1, ranks)


# ------------------------------------------------------------------------------------------------
# the methods, behind one interface: inputs(local ids [T, B*bag]) built untimed, lookup(inputs) -> [B, T*D]
# ------------------------------------------------------------------------------------------------


def load_colossal(folder: "str | None") -> tuple[type, Any]:
    """Colossal-AI's cache_embedding modules under a synthetic package (skips colossalai/__init__, which
    imports peft/transformers 4.x); needs ``pip install --no-deps colossalai==0.5.0 contexttimer``."""
    if folder is None:
        spec = importlib.util.find_spec("colossalai")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("colossalai is not installed (pip install --no-deps colossalai==0.5.0 contexttimer)")
        folder = str(Path(list(spec.submodule_search_locations)[0]) / "legacy/nn/parallel/layers/cache_embedding")
    pkg = types.ModuleType("colo_ce")
    pkg.__path__ = [folder]
    sys.modules["colo_ce"] = pkg
    cached = importlib.import_module("colo_ce.cached_embedding")
    mgr = importlib.import_module("colo_ce.cache_mgr")
    return cached.CachedEmbeddingBag, mgr.EvictionStrategy


def build_fbgemm(name: str, table: torch.Tensor, tables: int, rows: int, ratio: float, device: torch.device) -> Any:
    """FBGEMM TBE with every table in host-mapped memory behind one HBM cache (TorchRec's UVM caching)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm, EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    alg = CacheAlgorithm.LFU if name == "fbgemm_lfu" else CacheAlgorithm.LRU
    dim = table.shape[1]
    emb = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA)] * tables, cache_algorithm=alg,
        cache_load_factor=ratio, pooling_mode=PoolingMode.SUM, uvm_host_mapped=True, device=device)
    with torch.no_grad():
        for t, w in enumerate(emb.split_embedding_weights()):
            w.copy_(table[t * rows:(t + 1) * rows].view(w.shape))
    return emb


class Method:
    """One embedding module over all tables plus the layout glue; ``lookup`` returns [B, T * D]."""

    def __init__(self, name: str, table: torch.Tensor, tables: int, cache_ratio: float, colossal: Any,
                 train: bool, lr: float, device: torch.device) -> None:
        self.name = name
        self.device = device
        self.tables = tables
        self.rows = table.shape[0] // tables
        self.dim = table.shape[1]
        if name.startswith("fbgemm"):
            self.module = build_fbgemm(name, table, tables, self.rows, cache_ratio, device)
        elif name == "colossal":
            cls, strategy = colossal
            weight = table.clone() if train else table  # it writes evicted rows back into the tensor it is given
            self.module = cls(table.shape[0], self.dim, mode="sum", sparse=train, _weight=weight,
                              cache_ratio=cache_ratio, warmup_ratio=0.7, evict_strategy=strategy.LFU)
        elif name == "torch":
            self.module = torch.nn.EmbeddingBag(table.shape[0], self.dim, mode="sum", sparse=train,
                                                _weight=table.to(device).clone()).to(device)
            self.module.weight.requires_grad_(train)
        else:
            self.module = TableBatchedCachedEmbeddingBag([self.rows] * tables, self.dim, mode="sum", sparse=train,
                                                         _weight=table, cache_ratio=cache_ratio, warmup_ratio=0.7,
                                                         device=device, refit_threshold=None, **OURS[name])
        self.table_base = (torch.arange(tables, device=device) * self.rows).unsqueeze(1)
        self.train = train
        self.fresh = True
        self.opt = torch.optim.SGD(list(self.module.parameters()), lr=lr) if train else None

    def inputs(self, local: torch.Tensor, bag: int) -> tuple[torch.Tensor, "torch.Tensor | None", int]:
        """The module's own input format for table-local ids ``[T, B * bag]``."""
        batch = local.shape[1] // bag
        if self.name.startswith("fbgemm"):  # KJT order: table-major bags, offsets with the total at the end
            return local.reshape(-1), torch.arange(0, local.numel() + 1, bag, device=self.device), batch
        if self.name in ("colossal", "torch"):
            glob = local + self.table_base
            flat = glob.t().reshape(-1) if bag == 1 else glob.reshape(-1)
            return flat, torch.arange(0, flat.numel(), bag, device=self.device), batch
        if bag == 1:  # ours: a [B, T] id matrix (sample-major) needs no offsets
            return local.t().contiguous(), None, batch
        return local.reshape(-1), torch.arange(0, local.numel(), bag, device=self.device), batch

    def lookup(self, inp: tuple[torch.Tensor, "torch.Tensor | None", int], bag: int) -> torch.Tensor:
        ids, offsets, batch = inp
        if self.name in ("colossal", "torch"):
            out = self.module(ids, offsets)  # [B*T, D] sample-major (bag 1) or [T*B, D] table-major
            if bag == 1:
                return out.view(batch, -1)
            return out.view(self.tables, batch, self.dim).transpose(0, 1).reshape(batch, -1)
        return self.module(ids, offsets)

    def step(self, inp: tuple, bag: int, nxt: "tuple | None" = None) -> torch.Tensor:
        """One inference lookup, or one training step (+ ours: prefetch of the next batch ``nxt``)."""
        if not self.train:
            with torch.no_grad():
                return self.lookup(inp, bag)
        self.opt.zero_grad()
        out = self.lookup(inp, bag)
        out.sum().backward()
        self.opt.step()
        if nxt is not None and self.name.startswith("ibpcache"):
            self.opt.zero_grad()  # prefetch needs the step's gradient released (it may resize the cache)
            self.module.prefetch(nxt[0], nxt[1])
        return out

    def counters(self) -> dict[str, float]:
        if self.name.startswith("fbgemm") or self.name == "torch":
            return {}
        if self.name == "colossal":
            mgr = self.module.cache_weight_mgr
            return {"hits": float(sum(mgr.num_hits_history)), "misses": float(sum(mgr.num_miss_history))}
        st = self.module.stats()
        if "fused_hits" in st:
            return {"hits": float(st["fused_hits"]), "misses": float(st["fused_lookups"] - st["fused_hits"]),
                    "host_bytes": float(st["fused_host_bytes"]), "raw_host_bytes": float(st["fused_raw_host_bytes"]),
                    "refreshes": float(st["fused_refreshes"]), "host_ratio": st["host_ratio"],
                    "plan": st.get("fused_plan"), "host_layout": st.get("host_layout")}
        return {"hits": float(st["hits"]), "misses": float(st["misses"]), "host_ratio": st["host_ratio"]}


# ------------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------------


def reference(table_dev: torch.Tensor, local: torch.Tensor, rows: int, bag: int) -> torch.Tensor:
    """The expected [B, T * D] output: torch's embedding_bag over the full table (on the GPU when it is there)."""
    t, n = local.shape
    glob = (local.to(table_dev.device) + torch.arange(t, device=table_dev.device).unsqueeze(1) * rows).reshape(-1)
    offsets = torch.arange(0, glob.numel(), bag, device=table_dev.device)
    out = F.embedding_bag(glob, table_dev, offsets, mode="sum")
    return out.view(t, n // bag, -1).transpose(0, 1).reshape(n // bag, -1)


def run_point(method: Method, ids: ZipfIds, table_dev: torch.Tensor, batch: int, bag: int,
              args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Warm up, then time steps one by one with CUDA events; verify outputs before and after."""
    ids.reset(seed)
    probe = ids.batch(batch, bag)
    got = method.step(method.inputs(probe, bag), bag).detach()
    checkable = not method.train or method.fresh  # training changes the table after the first step
    ok_before = bool(torch.equal(got, reference(table_dev, probe, method.rows, bag).to(got.device))) \
        if checkable else None
    method.fresh = False
    t_warm = time.perf_counter()
    for _ in range(args.warmup):  # capped like the timed loop: slow baselines get fewer warm-up steps
        method.step(method.inputs(ids.batch(batch, bag), bag), bag)
        if time.perf_counter() - t_warm > args.max_seconds_per_point:
            break
    before = method.counters()
    times: list[float] = []
    cuda = method.device.type == "cuda"
    if cuda:
        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    nxt = method.inputs(ids.batch(batch, bag), bag)
    for _ in range(args.iters):
        local, nxt = nxt, method.inputs(ids.batch(batch, bag), bag)
        pre = nxt if method.train else None
        if cuda:
            torch.cuda.synchronize()
            start_ev.record()
            method.step(local, bag, pre)
            end_ev.record()
            end_ev.synchronize()
            times.append(start_ev.elapsed_time(end_ev))
        else:  # --device cpu smoke runs only
            t_step = time.perf_counter()
            method.step(local, bag, pre)
            times.append((time.perf_counter() - t_step) * 1e3)
        if time.perf_counter() - t0 > args.max_seconds_per_point:
            break
    after = method.counters()
    ok_after: "bool | None" = None
    if not method.train:  # a trained table no longer equals the initial one
        probe = ids.batch(batch, bag)
        got = method.step(method.inputs(probe, bag), bag).detach()
        ok_after = bool(torch.equal(got, reference(table_dev, probe, method.rows, bag).to(got.device)))
    arr = np.asarray(times)
    lookups = batch * bag * method.tables
    med = float(np.median(arr))
    res: dict[str, Any] = {
        "status": "ok", "iters": len(times), "median_ms": med, "p10_ms": float(np.percentile(arr, 10)),
        "p90_ms": float(np.percentile(arr, 90)), "max_ms": float(arr.max()), "mean_ms": float(arr.mean()),
        "M_lookups_per_s": lookups / (med * 1e-3) / 1e6, "lookups_per_step": lookups,
        "verified": None if ok_before is None else bool(ok_before and ok_after is not False),
    }
    if "hits" in after:
        d = {k: after[k] - before.get(k, 0.0) for k in after if isinstance(after[k], float)}
        res["hit_rate"] = d["hits"] / max(d["hits"] + d["misses"], 1.0)
        if "host_bytes" in d:
            res["host_mb_per_step"] = d["host_bytes"] / max(len(times), 1) / 1e6
            res["transfer_ratio"] = d["raw_host_bytes"] / max(d["host_bytes"], 1.0)
            res["refreshes_during_timing"] = d["refreshes"]
        res["host_ratio"] = after.get("host_ratio")
        res["plan"] = after.get("plan")
        if after.get("host_layout") is not None:
            res["host_layout"] = after["host_layout"]
    return res


def _timed_step(method: Method, inp: tuple, bag: int, cuda: bool) -> float:
    """One step alone on the device (idle before it), in ms."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        method.step(inp, bag)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    method.step(inp, bag)
    return (time.perf_counter() - t0) * 1e3


def run_paired(a: Method, b: Method, ids: ZipfIds, batch: int, bag: int, args: argparse.Namespace,
               seed: int) -> dict[str, Any]:
    """Inference steps of ``a`` and ``b`` on the same batches, alternated (A B, then B A, ...), so clock, PCIe and
    host drift hit both alike: a fair "is a slower than b" that separate runs, minutes apart, cannot give. Both see
    identical ids, so their caches hold the same rows at every step. Outputs are checked equal to each other."""
    ids.reset(seed)
    cuda = a.device.type == "cuda"
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        local = ids.batch(batch, bag)
        a.step(a.inputs(local, bag), bag)
        b.step(b.inputs(local, bag), bag)
        if time.perf_counter() - t0 > args.max_seconds_per_point:
            break
    ta: list[float] = []
    tb: list[float] = []
    same = True
    t0 = time.perf_counter()
    for i in range(args.iters):
        local = ids.batch(batch, bag)
        ia, ib = a.inputs(local, bag), b.inputs(local, bag)
        if i % 2 == 0:
            ta.append(_timed_step(a, ia, bag, cuda))
            tb.append(_timed_step(b, ib, bag, cuda))
        else:
            tb.append(_timed_step(b, ib, bag, cuda))
            ta.append(_timed_step(a, ia, bag, cuda))
        if i == 0:
            same = bool(torch.equal(a.step(ia, bag), b.step(ib, bag)))
        if time.perf_counter() - t0 > 2 * args.max_seconds_per_point:
            break
    ma, mb = float(np.median(ta)), float(np.median(tb))
    return {"pairs": len(ta), "median_ms": ma, "raw_median_ms": mb, "speedup_vs_raw": mb / ma,
            "outputs_equal": same}


def trained_weights(method: Method) -> torch.Tensor:
    """The method's whole table after training (CPU for the offloaded modules, where it lives)."""
    if method.name == "torch":
        return method.module.weight.detach()
    if method.name == "colossal":  # its own flush writes the cached rows back into the CPU weight
        mgr = method.module.cache_weight_mgr
        mgr.flush()
        return mgr.weight.view(-1, method.dim)
    return method.module.weight  # ours: host rows decoded, cached rows overlaid


def compare_tables(got: torch.Tensor, want: torch.Tensor, device: torch.device,
                   chunk_rows: int = 1 << 18) -> dict[str, Any]:
    """Bitwise comparison of two [N, D] tables (chunks moved to ``device``), and the max abs difference where not."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return {"bit_exact": False, "error": f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} "
                                             f"{want.dtype}"}
    differing, max_diff = 0, 0.0
    for lo in range(0, want.shape[0], chunk_rows):
        a = got[lo:lo + chunk_rows].to(device).contiguous()
        b = want[lo:lo + chunk_rows].to(device).contiguous()
        neq = (a.view(torch.uint8) != b.view(torch.uint8)).any(1)
        n = int(neq.sum())
        if n:
            differing += n
            max_diff = max(max_diff, float((a[neq].double() - b[neq].double()).abs().max()))
    return {"bit_exact": differing == 0, "rows_differing": differing, "max_abs_diff": max_diff}


def train_steps(method: Method, ids: ZipfIds, batch: int, bag: int, steps: int, seed: int) -> None:
    """``steps`` SGD steps on the ids of ``ids.reset(seed)``; ours prefetches each next batch after its step."""
    ids.reset(seed)
    batches = [method.inputs(ids.batch(batch, bag), bag) for _ in range(steps)]
    if method.name.startswith("ibpcache"):
        method.module.prefetch(batches[0][0], batches[0][1])
    for i, inp in enumerate(batches):
        method.step(inp, bag, batches[i + 1] if i + 1 < steps else None)


def training_check(name: str, build: Any, reference_w: "torch.Tensor | None", ids: ZipfIds, batch: int, bag: int,
                   steps: int, device: torch.device) -> dict[str, Any]:
    """Train a fresh module ``build()`` as the reference was trained; compare the whole tables."""
    res: dict[str, Any] = {"steps": steps, "batch": batch, "bag": bag, "optimizer": "SGD (sparse gradients)",
                           "vs": "torch.nn.EmbeddingBag, same ids, same SGD"}
    if reference_w is None:
        return {**res, "status": "no reference (torch.nn.EmbeddingBag does not fit)"}
    method = None
    try:
        method = build()
        train_steps(method, ids, batch, bag, steps, seed=104729 + bag)
        res.update(compare_tables(trained_weights(method), reference_w, device), status="ok")
    except Exception as exc:  # Colossal-AI asserts when a batch has more rows than its cache
        res.update(status="refused" if name == "colossal" else "error",
                   error=f"{type(exc).__name__}: {exc}")
    del method
    free_memory()
    return res


def _check_line(chk: dict[str, Any]) -> str:
    if chk.get("status") != "ok":
        return f"{chk.get('status')} {chk.get('error', '')}".strip()
    if chk["bit_exact"]:
        return "bit-exact vs torch.nn.EmbeddingBag"
    return f"{chk['rows_differing']} rows differ, max abs diff {chk['max_abs_diff']:.3g}"


def check_targets(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 11's inference targets, point by point: ibpcache >= 1.5x the better FBGEMM policy at 512 B / 2 KB rows
    (>= 2x at batch >= 4096), >= 1.0x at 128 B, and compression never slower than raw."""
    lines, misses = [], []
    for pt in points:
        if pt["mode"] != "inference":
            continue
        m = pt["methods"]
        tag = f"{pt['row_bytes']} B, batch {pt['batch']}, cache {pt['cache_ratio']:g}, bag {pt['bag']}"
        ours = m.get("ibpcache", {})
        if ours.get("status") != "ok":
            misses.append(f"{tag}: ibpcache did not run ({ours.get('error')})")
            continue
        fb = [m[k]["M_lookups_per_s"] for k in ("fbgemm_lfu", "fbgemm_lru") if m.get(k, {}).get("status") == "ok"]
        if fb:
            need = 1.0 if pt["row_bytes"] <= 128 else (2.0 if pt["batch"] >= 4096 else 1.5)
            got = ours["M_lookups_per_s"] / max(fb)
            pt["speedup_vs_best_fbgemm"] = got
            (lines if got >= need else misses).append(f"{tag}: {got:.2f}x the better FBGEMM policy (target {need}x)")
        raw = m.get("ibpcache_raw", {})
        pair = ours.get("paired_vs_raw")
        if pair is not None:  # alternated on the same ids: drift cancels
            ratio = pair["speedup_vs_raw"]
            pt["compression_speedup"] = ratio
            if pair["same_layout_as_raw"]:  # the planner fell back: the default IS the raw path
                lines.append(f"{tag}: planner chose raw host rows, so the default runs the raw path (paired "
                             f"{ratio:.3f}, noise)")
            else:
                (lines if ratio >= 1.0 else misses).append(
                    f"{tag}: default (compressed host rows) / raw {ratio:.3f}, paired over {pair['pairs']} steps")
        elif raw.get("status") == "ok":
            ratio = ours["M_lookups_per_s"] / raw["M_lookups_per_s"]
            pt["compression_speedup"] = ratio
            (lines if ratio >= 1.0 else misses).append(f"{tag}: default (planner) / raw {ratio:.3f} (separate runs)")
        if raw.get("status") == "ok":
            pt["unpaired_compression_speedup"] = ours["M_lookups_per_s"] / raw["M_lookups_per_s"]
            ibp = m.get("ibpcache_ibp", {})
            if ibp.get("status") == "ok":  # informational: forced compression vs raw
                pt["forced_compression_speedup"] = ibp["M_lookups_per_s"] / raw["M_lookups_per_s"]
    return {"met": not misses, "missed": misses, "lines": [f"target met: {x}" for x in lines]
            + [f"TARGET MISSED: {x}" for x in misses]}


def plot(records: list[dict[str, Any]]):
    import matplotlib.pyplot as plt

    panels = sorted({(r["row_bytes"], r["bag"]) for r in records})
    ratios = sorted({r["cache_ratio"] for r in records})
    fig, axes = plt.subplots(len(panels), len(ratios), figsize=(5.5 * len(ratios), 3.8 * len(panels)), squeeze=False)
    styles = {"fbgemm_lfu": "s-", "fbgemm_lru": "s--", "colossal": "x:", "torch": "v-", "ibpcache": "o-", "ibpcache_ibp": "^:",
              "ibpcache_raw": "o--", "ibpcache_staged": "d-."}
    for i, (rb, bag) in enumerate(panels):
        for j, c in enumerate(ratios):
            ax = axes[i][j]
            rr = [r for r in records if (r["row_bytes"], r["bag"], r["cache_ratio"]) == (rb, bag, c)]
            for m in METHODS:
                pts = sorted((r["batch"], r["M_lookups_per_s"]) for r in rr if r["method"] == m and r["status"] == "ok")
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[m], label=m)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size (samples)")
            ax.set_ylabel("M lookups / s")
            ax.set_title(f"{rb} B rows, bag {bag}, cache {c:.0%}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    first = records[0]
    fig.suptitle(f"DLRM lookups ({first['tables']} tables, Zipf, {'training' if first['train'] else 'inference'})")
    fig.tight_layout()
    return fig


def free_memory() -> None:
    """Drop the last method's device and pinned host buffers before building the next one."""
    gc.collect()
    if not torch.cuda.is_available():
        return
    torch.cuda.empty_cache()
    empty_host = getattr(torch._C, "_host_emptyCache", None)
    if empty_host is not None:
        empty_host()


def build_table(entry_bytes: int, rows: int, seed: int) -> torch.Tensor:
    return datasets.resample_rows(real_rows(entry_bytes), rows, seed=seed)


def to_points(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat records -> the issue's schema: one point per (row size, batch, cache, bag) with a dict of methods."""
    keys = ("row_bytes", "batch", "cache_ratio", "bag", "mode")
    points: dict[tuple, dict[str, Any]] = {}
    for r in records:
        k = tuple(r[x] for x in keys)
        pt = points.setdefault(k, {**dict(zip(keys, k)), "methods": {}})
        pt["methods"][r["method"]] = {x: v for x, v in r.items() if x not in keys and x != "method"}
    return list(points.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(p)
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--entry-bytes", default="128,512,2048", help="row sizes (multiples of 4 bytes of float32)")
    p.add_argument("--rows-per-table", type=int, default=225_000)
    p.add_argument("--total-gb", type=float, default=None, help="instead of --rows-per-table: host bytes per row size")
    p.add_argument("--batches", default="1024,4096,8192,16384")
    p.add_argument("--cache-ratios", default="0.01,0.1")
    p.add_argument("--bags", default="1,20", help="ids per table per sample (summed)")
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=70, help="warm-up steps (ibpcache refreshes its cache at 16/32/64)")
    p.add_argument("--max-seconds-per-point", type=float, default=3.0)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--train", action="store_true", help="time forward + backward + sparse SGD (ours, Colossal-AI)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--colossal-dir", default=None, help="folder of colossalai's cache_embedding modules")
    p.add_argument("--name", default="bench_dlrm", help="stem of the JSON/PNG files")
    p.add_argument("--no-paired", dest="paired", action="store_false",
                   help="inference: skip the paired run of ibpcache (defaults) against ibpcache_raw, step by step "
                        "alternated on the same ids (what the 'compression never slower than raw' target reads)")
    p.add_argument("--check-steps", type=int, default=8,
                   help="--train: SGD steps of the trained-weights check per bag size (0: no check)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes (20k rows/table, batches 1024 and 8192, <= 1.5 s/point; --train: 512 B and "
                        "2 KB rows, Colossal-AI, torch and ours, 4 check steps): a few minutes on an H100")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run of our methods)")
    args = p.parse_args()
    if args.quick:  # smaller defaults; options given explicitly still win
        quick = {"rows_per_table": 20_000, "iters": 20, "warmup": 20, "batches": "1024,8192",
                 "max_seconds_per_point": 1.5, "check_steps": 4}
        if args.train:
            quick.update(methods="colossal,torch,ibpcache,ibpcache_raw", entry_bytes="512,2048")
        for key, value in quick.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_dlrm needs a CUDA GPU (or --device cpu for a smoke run)")
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    unavailable: dict[str, str] = {}
    if device.type != "cuda":
        unavailable.update({m: "needs CUDA" for m in methods if not m.startswith("ibpcache")})
    if args.train:
        unavailable.update({m: "FBGEMM's training libraries are not staged" for m in methods if m.startswith("fbgemm")})
    torch_fits = True
    if device.type == "cuda":  # GPU-resident nn.EmbeddingBag (a method, and the trained-weights reference)
        widest = max(int(x) for x in args.entry_bytes.split(","))
        need = widest * args.tables * (int(args.total_gb * 1e9 / widest / args.tables) if args.total_gb
                                       else args.rows_per_table)
        torch_fits = need * (3 if args.train else 1) <= 0.8 * torch.cuda.mem_get_info()[0]
        if "torch" in methods and not torch_fits:
            unavailable["torch"] = f"the tables ({need / 1e9:.1f} GB) do not fit in GPU memory"
    check = args.train and args.check_steps > 0
    paired = (args.paired and not args.train and all(m in methods and m not in unavailable
                                                     for m in ("ibpcache", "ibpcache_raw")))
    reference_ok = check and torch_fits
    colossal: Any = None
    if "colossal" in methods and "colossal" not in unavailable:
        try:
            colossal = load_colossal(args.colossal_dir)
        except Exception as exc:  # the baseline missing must not hide our numbers
            unavailable["colossal"] = f"{type(exc).__name__}: {exc}"
    for name in [m for m in methods if m.startswith("fbgemm") and m not in unavailable]:
        try:
            importlib.import_module("fbgemm_gpu.split_table_batched_embeddings_ops_training")
        except Exception as exc:
            unavailable[name] = f"{type(exc).__name__}: {exc}"
    for name, why in unavailable.items():
        print(f"{name}: unavailable ({why})", flush=True)
    entries = [int(x) for x in args.entry_bytes.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    ratios = [float(x) for x in args.cache_ratios.split(",")]
    bags = [int(x) for x in args.bags.split(",")]
    plan = {e: (max(1, int(args.total_gb * 1e9 / e / args.tables)) if args.total_gb else args.rows_per_table)
            for e in entries}
    mode = "training" if args.train else "inference"
    print(f"bench_dlrm: {args.tables} tables, rows/table {plan}, zipf a={args.zipf}, bags {bags}, batches {batches}, "
          f"cache ratios {ratios}, <= {args.iters} timed steps (<= {args.max_seconds_per_point}s/point) after "
          f"{args.warmup} warm-up, {mode}, methods {methods}", flush=True)
    t_start = time.perf_counter()
    records: list[dict[str, Any]] = []
    bar = tqdm(total=len(entries) * len(ratios) * len(methods) * len(batches) * len(bags), desc="points")
    for entry in entries:
        rows = plan[entry]
        table = build_table(entry, rows * args.tables, seed=entry)
        table_dev = table.to(device) if device.type == "cuda" else table
        ids = ZipfIds(rows, args.tables, args.zipf, device)
        check_batch = min(batches)
        references: dict[int, "torch.Tensor | None"] = {}
        for bag in bags if check else ():  # reference tables kept on the CPU (GPU memory is for the methods)
            if reference_ok:
                ref = Method("torch", table, args.tables, ratios[0], colossal, True, args.lr, device)
                train_steps(ref, ids, check_batch, bag, args.check_steps, seed=104729 + bag)
                references[bag] = trained_weights(ref).cpu()
                del ref
                free_memory()
            else:
                references[bag] = None
        for ratio in ratios:
            for name in methods:
                base = {"row_bytes": entry, "rows_per_table": rows, "tables": args.tables, "cache_ratio": ratio,
                        "method": name, "mode": mode, "train": args.train}
                if name in unavailable:
                    for b in batches:
                        for bag in bags:
                            records.append({**base, "batch": b, "bag": bag, "status": "unavailable",
                                            "error": unavailable[name]})
                            bar.update()
                    continue
                t_build = time.perf_counter()
                method = Method(name, table, args.tables, ratio, colossal, args.train, args.lr, device)
                build_s = time.perf_counter() - t_build
                for bag in bags:
                    for b in batches:
                        try:
                            res = run_point(method, ids, table_dev, b, bag, args, seed=b + 7919 * bag)
                        except Exception as exc:  # Colossal-AI asserts when a batch has more rows than its cache
                            res = {"status": "refused" if name == "colossal" else "error",
                                   "error": f"{type(exc).__name__}: {exc}"}
                            del method
                            free_memory()
                            method = Method(name, table, args.tables, ratio, colossal, args.train, args.lr, device)
                        records.append({**base, "batch": b, "bag": bag, "build_s": build_s, **res})
                        bar.update()
                del method
                free_memory()
                for bag in bags if check and name != "torch" else ():  # torch is the reference itself
                    build = functools.partial(Method, name, table, args.tables, ratio, colossal, True, args.lr,
                                              device)
                    chk = training_check(name, build, references[bag], ids, check_batch, bag, args.check_steps,
                                         device)
                    rec = next(r for r in records if r["row_bytes"] == entry and r["cache_ratio"] == ratio
                               and r["method"] == name and r["batch"] == check_batch and r["bag"] == bag)
                    rec["trained_weights"] = chk
                    print(f"trained weights after {chk['steps']} steps, {entry} B, cache {ratio:g}, bag {bag}, "
                          f"{name}: {_check_line(chk)}", flush=True)
            if paired:  # the default (planner) against forced raw, alternated step by step
                a = Method("ibpcache", table, args.tables, ratio, colossal, False, args.lr, device)
                b = Method("ibpcache_raw", table, args.tables, ratio, colossal, False, args.lr, device)
                layout = a.module.stats().get("host_layout") or {}
                for bag in bags:
                    for bt in batches:
                        res = run_paired(a, b, ids, bt, bag, args, seed=bt + 7919 * bag + 1)
                        res["same_layout_as_raw"] = layout.get("compress") is False
                        rec = next(r for r in records if r["row_bytes"] == entry and r["cache_ratio"] == ratio
                                   and r["method"] == "ibpcache" and r["batch"] == bt and r["bag"] == bag)
                        rec["paired_vs_raw"] = res
                del a, b
                free_memory()
            cols = ("row_bytes", "cache_ratio", "bag", "batch", "method", "status", "median_ms", "M_lookups_per_s",
                    "hit_rate", "verified")
            here = [r for r in records if r["row_bytes"] == entry and r["cache_ratio"] == ratio]
            print(format_table([{k: r.get(k) for k in cols} for r in here]), flush=True)
        del table, table_dev, ids
        free_memory()
    bar.close()
    points = to_points(records)
    targets = check_targets(points)
    for line in targets["lines"]:
        print(line, flush=True)
    meta = {**vars(args), "rows_per_table": plan, "out": str(args.out), "elapsed_s": time.perf_counter() - t_start,
            "targets": targets, "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "note": "rows: 128 B = MiniLM[:, :32]; 512 B = [:, :128]; 2 KB = a MiniLM row + 128 columns of another"}
    paths = write_results(args.out, args.name, records, plot, meta=meta, extra={"points": points})
    print(f"wrote {paths}", flush=True)
    bad = [r for r in records if r.get("status") == "ok" and r.get("verified") is False]
    bad += [r for r in records if r.get("paired_vs_raw", {}).get("outputs_equal") is False]
    bad += [r for r in records if r["method"].startswith("ibpcache") and r.get("trained_weights", {}).get("status")
            in ("ok", "error") and not r["trained_weights"].get("bit_exact")]
    errors = [r for r in records if r.get("status") == "error"]
    if bad or errors:
        raise SystemExit(f"{len(bad)} points produced wrong outputs, {len(errors)} failed: "
                         f"{[(r['method'], r.get('error')) for r in errors][:3]}")


if __name__ == "__main__":
    main()
