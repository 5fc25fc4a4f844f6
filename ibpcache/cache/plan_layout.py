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
from typing import Any, Optional

import torch

from ..codec import Codec
from ._plan_timing import MARGIN, wall_medians

__all__ = ["LayoutChoice", "decide_layout", "prefer_host_gather", "calibrate_layout", "CALIBRATION_BYTES",
           "MIN_RATIO", "MARGIN"]

CALIBRATION_BYTES = 32 << 20
"""Raw bytes of the pinned sample each layout is timed on (a sample this size streams from host memory, like
the table does, rather than hitting the GPU's L2)."""

MIN_RATIO = 1.02
"""Below this host compression ratio nothing is timed: there are no bytes to save, only decode to add."""


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


def _time_host_gather(ids: torch.Tensor, raw: torch.Tensor, out: torch.Tensor, src_c: Any, tables: Any,
                      dtype: torch.dtype, err: Any, reps: int) -> tuple[float, float]:
    """Wall-clock medians (ms) from ids on the CPU to rows on the GPU: raw rows by ``index_select`` into pinned
    staging + one copy, and compressed rows by the zero-copy kernel after the ids' copy."""
    staging = torch.empty((ids.numel(), raw.shape[1]), dtype=torch.uint8, pin_memory=True)
    dev = out.device

    def host() -> None:
        torch.index_select(raw, 0, ids, out=staging)
        out.view(ids.numel(), -1).copy_(staging, non_blocking=True)

    t = wall_medians({"host": host, "zero_copy": lambda: _lookup_once(ids.to(dev, non_blocking=True), out, src_c,
                                                                       tables, dtype, err)}, dev, reps)
    return t["host"], t["zero_copy"]
