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
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from ..codec import Codec

__all__ = ["LayoutChoice", "decide_layout", "calibrate_layout", "CALIBRATION_BYTES", "MIN_RATIO", "MARGIN"]

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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    idx = torch.linspace(0, n - 1, m).round().to(torch.int64).unique()
    return table.index_select(0, idx.to(table.device)).cpu().contiguous()


def _time_layout(ids: torch.Tensor, out: torch.Tensor, src: Any, tables: Any, dtype: torch.dtype, err: Any,
                 reps: int) -> list[float]:
    """CUDA-event times (ms) of ``reps`` zero-copy lookups of ``ids`` (all misses) through the kernel the
    embedding bags run: the pooling kernel with one id per bag where it takes the dtype, else the rows kernel."""
    from ..kernels.lookup import ElemType, PoolOp, lookup_pool, lookup_rows, pool_supported

    pooled = pool_supported(dtype, tables.row_bytes)

    def one() -> None:
        if pooled:
            lookup_pool(ids, None, 1, ids.numel(), False, PoolOp.SUM, ElemType.of(dtype), None, out, src, tables,
                        None, err.ptr)
        else:
            lookup_rows(ids, out, src, tables, None, err.ptr)

    one()  # compile + warm
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        one()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in times]


def calibrate_layout(table: torch.Tensor, codec: Codec, device: torch.device, batch: int = 8192,
                     reps: int = 7) -> LayoutChoice:
    """Time compressed vs raw zero-copy misses on a pinned sample of ``table`` (``[N, ...]``, any device) on ``device``.

    The compression ratio used for the floor is the sample's. Both layouts are timed in alternation, so clock
    or PCIe drift hits them alike; medians decide."""
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
    return decide_layout(ratio, statistics.median(t_c), statistics.median(t_r), batch)


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
