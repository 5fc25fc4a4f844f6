"""Host-layout planner: store a table's host rows IBP-compressed or raw, whichever this machine reads faster.

Compression pays on the miss path only when the bytes it saves on PCIe are worth more than the warp decode it
adds. That trade depends on the table (how well it compresses), the row size and the machine (zero-copy read
rate vs decode rate), so it is measured, not guessed: at start-up :func:`calibrate_layout` builds a small pinned
sample of the table in both layouts and times the same zero-copy lookup kernel (every id a miss) over each, a few
milliseconds in all. :func:`decide_layout` then keeps compression only when it was measurably faster, so the
default configuration is never slower than the raw one on misses. GPU-cached rows are raw either way in the
embedding-bag cache, so the miss path is the whole difference between the two layouts there.

Calibration happens once per table, at construction, before any lookup; its one host sync is there, never in a
lookup step. Without CUDA there is no zero-copy path to time; tables stay compressed (host memory is then the
only thing compression changes).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..codec import Codec

__all__ = ["LayoutChoice", "decide_layout", "prefer_host_gather", "calibrate_layout", "TransferChoice", "decide_transfer",
           "calibrate_transfer", "PathPlanner", "CALIBRATION_BYTES", "MIN_RATIO", "MARGIN"]

CALIBRATION_BYTES = 32 << 20
"""Raw bytes of the pinned sample each layout is timed on (a sample this size streams from host memory, like
the table does, rather than hitting the GPU's L2)."""

MIN_RATIO = 1.02
"""Below this host compression ratio nothing is timed: there are no bytes to save, only decode to add."""

MARGIN = 0.03
"""Compressed must be at least this much faster than raw to be chosen (timings of a few ms move by ~1-2%)."""


@dataclass(frozen=True)
class LayoutChoice:
    """What the planner chose for one table and why (``stats()['host_layout']``)."""

    compress: bool
    reason: str
    ratio: float
    compressed_ms: Optional[float] = None
    raw_ms: Optional[float] = None
    batch: int = 0
    host_gather_ms: Optional[float] = None  # raw rows gathered by the CPU + one copy (wall clock, ids on the CPU)
    compressed_wall_ms: Optional[float] = None  # compressed zero-copy, wall clock with the ids' copy

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def prefer_host_gather(choice: LayoutChoice, host_gather_ms: Optional[float], compressed_wall_ms: Optional[float],
                       margin: float = MARGIN) -> LayoutChoice:
    """For caches fed ids on the CPU: keep raw rows when the CPU's own gather + one copy beat compressed zero-copy
    reads (small rows from a large table: random reads are bound by address translation, not by bytes), so the
    transfer planner can pick that path. A raw choice stands as it is."""
    if not choice.compress or host_gather_ms is None or compressed_wall_ms is None:
        return replace(choice, host_gather_ms=host_gather_ms, compressed_wall_ms=compressed_wall_ms)
    if host_gather_ms <= compressed_wall_ms * (1.0 - margin):
        return replace(choice, compress=False, host_gather_ms=host_gather_ms, compressed_wall_ms=compressed_wall_ms,
                       reason=f"raw rows by CPU gather {compressed_wall_ms / host_gather_ms:.2f}x faster than "
                              f"compressed zero-copy ({choice.reason})")
    return replace(choice, host_gather_ms=host_gather_ms, compressed_wall_ms=compressed_wall_ms)


def decide_layout(ratio: float, compressed_ms: Optional[float], raw_ms: Optional[float], batch: int = 0,
                  margin: float = MARGIN, min_ratio: float = MIN_RATIO) -> LayoutChoice:
    """The rule, apart from the measuring (unit-tested with injected timings).

    No timings (no CUDA): compressed when the table compresses at all (saves host memory, costs no transfer).
    Otherwise compressed only if ``compressed_ms <= raw_ms * (1 - margin)``."""
    if ratio < min_ratio:
        return LayoutChoice(False, f"host ratio {ratio:.3f} < {min_ratio}: nothing to save", ratio,
                            compressed_ms, raw_ms, batch)
    if compressed_ms is None or raw_ms is None:
        return LayoutChoice(True, "no zero-copy path to time (CPU): compressed for host memory", ratio,
                            compressed_ms, raw_ms, batch)
    if compressed_ms <= raw_ms * (1.0 - margin):
        return LayoutChoice(True, f"compressed misses {raw_ms / compressed_ms:.2f}x faster than raw", ratio,
                            compressed_ms, raw_ms, batch)
    return LayoutChoice(False, f"compressed misses only {raw_ms / compressed_ms:.2f}x of raw (< {1 / (1 - margin):.2f}x)",
                        ratio, compressed_ms, raw_ms, batch)


def _sample_rows(table: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """An evenly strided sample of up to CALIBRATION_BYTES of the table's rows (CPU, contiguous)."""
    n = int(table.shape[0])
    m = max(1, min(n, CALIBRATION_BYTES // max(row_bytes, 1)))
    idx = (torch.arange(m, dtype=torch.int64) * (n - 1)) // max(m - 1, 1)  # integer math: exact past 2**24 rows
    return table.index_select(0, idx.to(table.device)).cpu().contiguous()


def _lookup_once(ids: torch.Tensor, out: torch.Tensor, src: Any, tables: Any, dtype: torch.dtype, err: Any) -> None:
    """One zero-copy lookup of ``ids`` (all misses) through the kernel the embedding bags run: the pooling kernel
    with one id per bag where it takes the dtype, else the rows kernel."""
    from ..kernels.lookup import ElemType, PoolOp, lookup_pool, lookup_rows, pool_supported

    if pool_supported(dtype, tables.row_bytes):
        lookup_pool(ids, None, 1, ids.numel(), False, PoolOp.SUM, ElemType.of(dtype), None, out, src, tables,
                    None, err.ptr)
    else:
        lookup_rows(ids, out, src, tables, None, err.ptr)


def _time_layout(ids: torch.Tensor, out: torch.Tensor, src: Any, tables: Any, dtype: torch.dtype, err: Any,
                 reps: int) -> list[float]:
    """CUDA-event times (ms) of ``reps`` zero-copy lookups (:func:`_lookup_once`)."""
    _lookup_once(ids, out, src, tables, dtype, err)  # compile + warm
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _lookup_once(ids, out, src, tables, dtype, err)
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in times]


def calibrate_layout(table: torch.Tensor, codec: Codec, device: torch.device, batch: int = 8192,
                     reps: int = 7, host_paths: bool = False) -> LayoutChoice:
    """Time compressed vs raw zero-copy misses on a pinned sample of ``table`` (``[N, ...]``, any device) on ``device``.

    The compression ratio used for the floor is the sample's. Both layouts are timed in alternation, so clock
    or PCIe drift hits them alike; medians decide. ``host_paths`` (caches fed ids on the CPU): also time, wall
    clock from ids on the CPU, raw rows gathered by the CPU + one copy against compressed zero-copy reads
    (:func:`prefer_host_gather`)."""
    from ..kernels.hashmap import IndexArgs, IndexMode
    from ..kernels.lookup import LookupErrors, RowSource

    row_bytes = codec.row_bytes
    sample = _sample_rows(table, row_bytes)
    m = int(sample.shape[0])
    packed = codec.compress(sample, layout="inplace", pin=True, device=device)
    lengths = packed.lengths.to(torch.int32).to(device)
    ratio = (m * row_bytes) / max(int(lengths.sum(dtype=torch.int64)), 1)
    if ratio < MIN_RATIO or device.type != "cuda":
        return decide_layout(ratio, None, None, batch)
    raw = torch.empty(m * row_bytes, dtype=torch.uint8, pin_memory=True)
    raw.copy_(sample.view(torch.uint8).reshape(-1))
    empty = torch.empty(0, dtype=torch.int64, device=device)
    index = IndexArgs(IndexMode.NONE, empty, empty, 0, 0)
    bases = torch.zeros(8, dtype=torch.int64, device=device)
    src_c = RowSource(index, bases, packed.data.data_ptr(), None, row_bytes, lengths, m)
    src_r = RowSource(index, bases, raw.data_ptr(), None, row_bytes, None, m)
    tables = codec.kernel_tables(device)
    ids = torch.randint(0, m, (batch,), generator=torch.Generator().manual_seed(0)).to(device)
    out = torch.empty(batch * row_bytes, dtype=torch.uint8, device=device)
    err = LookupErrors(pin=True)
    t_c: list[float] = []
    t_r: list[float] = []
    for _ in range(2):  # alternate the two, twice
        t_c += _time_layout(ids, out, src_c, tables, sample.dtype, err, reps)
        t_r += _time_layout(ids, out, src_r, tables, sample.dtype, err, reps)
    choice = decide_layout(ratio, statistics.median(t_c), statistics.median(t_r), batch)
    if not host_paths:
        return choice
    return prefer_host_gather(choice, *_time_host_gather(ids.cpu(), raw.view(m, row_bytes), out, src_c, tables,
                                                         sample.dtype, err, reps))


def _wall_medians(runs: "dict[Any, Callable[[], None]]", device: torch.device, reps: int) -> "dict[Any, float]":
    """Median wall-clock ms of each run (host work included, device synchronised before and after), alternated
    round by round so drift hits them alike; the first round warms up (kernel builds, Numba, pinned pools)."""
    import time

    times: dict[Any, list[float]] = {k: [] for k in runs}
    for rep in range(reps + 1):
        for key, run in runs.items():
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize(device)
            if rep:
                times[key].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _time_host_gather(ids: torch.Tensor, raw: torch.Tensor, out: torch.Tensor, src_c: Any, tables: Any,
                      dtype: torch.dtype, err: Any, reps: int) -> tuple[float, float]:
    """Wall-clock medians (ms) from ids on the CPU to rows on the GPU: raw rows by ``index_select`` into pinned
    staging + one copy, and compressed rows by the zero-copy kernel after the ids' copy."""
    staging = torch.empty((ids.numel(), raw.shape[1]), dtype=torch.uint8, pin_memory=True)
    dev = out.device

    def host() -> None:
        torch.index_select(raw, 0, ids, out=staging)
        out.view(ids.numel(), -1).copy_(staging, non_blocking=True)

    t = _wall_medians({"host": host, "zero_copy": lambda: _lookup_once(ids.to(dev, non_blocking=True), out, src_c,
                                                                        tables, dtype, err)}, dev, reps)
    return t["host"], t["zero_copy"]


# ------------------------------------------------------------------------------------------------
# transfer: how a store's rows cross PCIe
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransferChoice:
    """Which transfer path a store reads misses through, and the timings that chose it (``stats()['transfer']``)."""

    transfer: str
    reason: str
    timings_ms: dict
    batch: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide_transfer(timings_ms: dict, default: str = "zero_copy", margin: float = MARGIN, batch: int = 0
                    ) -> TransferChoice:
    """The rule, apart from the measuring: the fastest path, but ``default`` (zero-copy: no host work, no host
    sync, CUDA-graph capturable) unless another path is at least ``margin`` faster than it."""
    if not timings_ms:
        return TransferChoice(default, "nothing timed (no CUDA)", {}, batch)
    best = min(timings_ms, key=timings_ms.get)
    base = timings_ms.get(default)
    if best == default or base is None:
        return TransferChoice(best, f"{best} fastest", dict(timings_ms), batch)
    if timings_ms[best] <= base * (1.0 - margin):
        return TransferChoice(best, f"{best} {base / timings_ms[best]:.2f}x faster than {default}", dict(timings_ms),
                              batch)
    return TransferChoice(default, f"{best} only {base / timings_ms[best]:.2f}x of {default} (< "
                          f"{1 / (1 - margin):.2f}x)", dict(timings_ms), batch)


def calibrate_transfer(store: Any, batch: int = 16384, reps: int = 5,
                       candidates: "tuple[str, ...] | None" = None) -> TransferChoice:
    """Time ``store.read_into`` of ``batch`` random rows through each candidate path, on the store itself (a
    multi-GB pinned table reads randomly at rates a small sample would not show), ids given on the CPU as a
    sampler hands them over (``host_gather`` too for raw rows: torch's own gather + one copy, the raw baseline).
    Wall clock from the call to the rows being on the GPU, host work included (a path
    that gathers on the CPU pays for it); candidates alternate, medians decide. The store's counters are left as
    they were."""
    from .host_store import Transfer

    if store.device.type != "cuda":
        return decide_transfer({}, batch=batch)
    if candidates is None:  # the CPU's own row gather is a candidate where it needs no decoding (raw rows)
        candidates = ("zero_copy", "cpu_gather") + (() if store.compress else ("host_gather",))
    n = store.n_rows
    ids = torch.randint(0, n, (min(batch, max(n, 1)),), generator=torch.Generator().manual_seed(1))
    out = torch.empty((ids.numel(), store.row_bytes), dtype=torch.uint8, device=store.device)
    saved = (store.transfer, store.rows_read, store.bytes_read.clone())

    def via(name: str) -> "Callable[[], None]":
        def run() -> None:
            store.transfer = Transfer(name)
            store.read_into(ids, out)
        return run

    try:
        medians = _wall_medians({name: via(name) for name in candidates}, store.device, reps)
    finally:
        store.transfer, store.rows_read = saved[0], saved[1]
        store.bytes_read.copy_(saved[2])
    return decide_transfer(medians, batch=int(ids.numel()))


class PathPlanner:
    """Picks between two ways of running a fused lookup, per kind of lookup and size class (powers of two of the
    bag count), from timings on this machine: the first ``trials`` lookups of a class alternate the two, timed with
    CUDA events read only once they have completed (never a sync), then the faster median wins for good.

    Kinds: ``"single"`` (one id per bag): take bags in row order (an argsort first; address-ordered host reads pay
    off when many misses come from a large pinned table) or as given. ``"multi"`` (bags of several ids, only when a
    staging buffer exists): read each missed row once into staging (CLAIM + STAGE) or every miss zero-copy.
    """

    LABELS = {"single": ("as given", "sorted"), "multi": ("zero-copy", "staged")}

    def __init__(self, trials: int = 6) -> None:
        self.trials = trials
        self._times: dict[tuple[str, int], dict[bool, list[float]]] = {}
        self._pending: list[tuple[tuple[str, int], bool, Any, Any]] = []
        self._choice: dict[tuple[str, int], bool] = {}
        self._fixed: dict[str, bool] = {}

    @staticmethod
    def _key(kind: str, n: int) -> tuple[str, int]:
        return kind, max(n, 1).bit_length()

    def fix(self, kind: str, second: "bool | None") -> None:
        """Pin a kind of lookup to one way for every size (``None`` lets the timings decide again)."""
        if kind not in self.LABELS:
            raise ValueError(f"kind must be one of {sorted(self.LABELS)}, got {kind!r}")
        if second is None:
            self._fixed.pop(kind, None)
        else:
            self._fixed[kind] = bool(second)

    def calibrating(self, n: int, kind: str = "single") -> bool:
        return kind not in self._fixed and self._key(kind, n) not in self._choice

    def choose(self, n: int, capturing: bool = False, kind: str = "single") -> bool:
        """The second way (sorted / staged)? Decided classes keep their choice; while calibrating, alternate (the
        first way while a CUDA graph is being captured)."""
        if kind in self._fixed:
            return self._fixed[kind]
        key = self._key(kind, n)
        if not capturing:  # querying events is not allowed while a stream is being captured
            self._collect()
        if key in self._choice:
            return self._choice[key]
        if capturing:
            return False
        runs = self._times.setdefault(key, {False: [], True: []})
        pending = sum(1 for k, *_ in self._pending if k == key)
        done = len(runs[False]) + len(runs[True])
        if done >= 2 * self.trials:
            self._choice[key] = float(np.median(runs[True])) < float(np.median(runs[False]))
            return self._choice[key]
        return (done + pending) % 2 == 1

    def record(self, n: int, second: bool, start: Any, end: Any, kind: str = "single") -> None:
        self._pending.append((self._key(kind, n), second, start, end))

    def _collect(self) -> None:
        keep = []
        for key, second, start, end in self._pending:
            if end.query():
                self._times.setdefault(key, {False: [], True: []})[second].append(start.elapsed_time(end))
            else:
                keep.append((key, second, start, end))
        self._pending = keep

    def plan(self) -> dict[str, str]:
        """For stats(): the way chosen per kind and size class (or "calibrating")."""
        self._collect()
        out = {}
        for kind, b in sorted(set(self._times) | set(self._choice)):
            label = f"{kind} {1 << (b - 1)}-{(1 << b) - 1} bags"
            choice = self._choice.get((kind, b))
            out[label] = "calibrating" if choice is None else self.LABELS[kind][int(choice)]
        for kind, second in self._fixed.items():
            out[f"{kind} (fixed)"] = self.LABELS[kind][int(second)]
        return out


# ---- Row codecs of the packed KV store (issue 13): per layer and K/V, the codec that stores the prompt smallest ----

ROW_METHODS = ("auto", "ibp", "exponent", "raw")
"""What :func:`choose_row_codecs` accepts: one method for every tensor, or ``auto`` to pick per tensor."""


@dataclass(frozen=True)
class RowCodecChoice:
    """The codec chosen for one tensor's rows and the stored bytes of the sample under each candidate."""

    codec: Any  # Codec | ExponentCodec
    method: str  # "ibp", "exponent" or "raw"
    sizes: dict  # method -> stored bytes of the sample (candidates that were measured)
    ibp_chunk_bytes: Optional[int] = None  # chunk size the IBP fit chose (reused by later fits), if one ran

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "sizes": dict(self.sizes)}


def choose_row_codecs(samples: "list[torch.Tensor]", method: str = "auto", threshold: "float | str" = "auto",
                      chunk_bytes: "int | str | list" = "auto") -> "list[RowCodecChoice]":
    """One codec per sample ([N, ...] rows, all on one device): ``method`` for all, or with ``"auto"`` whichever of
    IBP, exponent coding (bf16/fp16 only) and raw stores that sample in the fewest bytes (ties: the earlier of raw,
    IBP, exponent, so a codec must strictly save bytes to be chosen).

    The IBP codecs are fitted together (:meth:`Codec.fit_many`: two host syncs in all on a GPU). Exponent codes are
    counted on the host (a prompt-time copy of the samples). ``threshold``/``chunk_bytes`` go to the IBP fit
    (``chunk_bytes`` may be a list, one per sample)."""
    from ..exponent import FORMATS, ExponentCodec

    if method not in ROW_METHODS:
        raise ValueError(f"method must be one of {ROW_METHODS}, got {method!r}")
    if not samples:
        return []
    dtype = samples[0].dtype
    if method == "exponent" and dtype not in FORMATS:
        raise TypeError(f"method='exponent' codes bfloat16/float16 rows; these rows are {dtype} (use 'ibp', 'raw' or "
                        "'auto')")
    if method == "raw":
        return [RowCodecChoice(Codec.raw(x.dtype, tuple(x.shape[1:])), "raw", {}) for x in samples]
    if method == "exponent":
        return [RowCodecChoice(ExponentCodec.fit(x), "exponent", {}) for x in samples]
    ibp = Codec.fit_many(samples, threshold=threshold, chunk_bytes=chunk_bytes)
    if method == "ibp":
        return [RowCodecChoice(c, "ibp", {}, c.chunk_bytes) for c in ibp]
    out = []
    for x, ibp_codec in zip(samples, ibp):
        sizes = {"raw": int(x.shape[0]) * ibp_codec.row_bytes,
                 "ibp": int(ibp_codec.stored_lengths(x).sum(dtype=torch.int64))}
        codecs: dict[str, Any] = {"raw": Codec.raw(x.dtype, tuple(x.shape[1:])), "ibp": ibp_codec}
        if x.dtype in FORMATS:
            exp = ExponentCodec.fit(x)
            sizes["exponent"] = int(exp.stored_lengths(x).sum(dtype=torch.int64))
            codecs["exponent"] = exp
        best = min(sizes, key=lambda k: (sizes[k], ("raw", "ibp", "exponent").index(k)))
        out.append(RowCodecChoice(codecs[best], best, sizes, ibp_codec.chunk_bytes))
    return out


__all__ += ["ROW_METHODS", "RowCodecChoice", "choose_row_codecs"]
