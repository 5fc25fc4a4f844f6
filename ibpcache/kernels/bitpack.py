"""Thin launchers for ``bitpack.cu``: grid math, dtype-to-symbol mapping, torch-stream ordering.

Every launch goes on torch's current stream; nothing here synchronizes the device except the fit
(which must read its counts back).
Workspaces (the error word) are cached per device, so the fetch path does no cudaMalloc.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CodecKindError, InvalidArgumentError, RowShapeError
from ._build import device_index, launch, sm_count
from .exponent import ExponentTables, exp_decode_desc
from .tables import KernelTables

__all__ = [
    "GpuBackend",
    "size_rows",
    "encode_into",
    "decode_descriptors",
    "gather_rows",
    "gather_raw",
    "check_ibp_tables",
]

_SRC = "bitpack.cu"
_WARPS_PER_BLOCK = 8  # keep in sync with IBP_WARPS_PER_BLOCK in bitpack.cu
_THREADS = 32 * _WARPS_PER_BLOCK
_err_words: dict[int, torch.Tensor] = {}


def _ptr(t: "torch.Tensor | None") -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def warp_grid(n_rows: int, device_id: int) -> int:
    """Blocks for a warp-per-row grid-stride kernel: enough to fill the GPU, never more than needed."""
    return max(1, min(-(-n_rows // _WARPS_PER_BLOCK), sm_count(device_id) * 16))


def _launch(symbol: str, device_id: int, grid: "int | tuple", block: int, args: tuple) -> None:
    launch(_SRC, symbol, device_id, grid, block, args)


def _exp_err_words(device_id: int) -> torch.Tensor:
    """A scratch error pair for exponent descriptor decodes whose caller reads no report."""
    key = -1 - device_id
    if key not in _err_words:
        _err_words[key] = torch.zeros(2, dtype=torch.int64, device=f"cuda:{device_id}")
    return _err_words[key]


def _err_word(device_id: int) -> torch.Tensor:
    if device_id not in _err_words:
        _err_words[device_id] = torch.zeros(1, dtype=torch.int32, device=f"cuda:{device_id}")
    return _err_words[device_id]


def _check_u8_rows(rows: torch.Tensor, name: str) -> None:
    if rows.dtype != torch.uint8 or rows.dim() != 2 or not rows.is_contiguous():
        raise InvalidArgumentError(f"{name}: expected a contiguous uint8 [N, row_bytes] tensor, got {rows.dtype} "
                                   f"{tuple(rows.shape)}")


def _upload(arrays: "list[np.ndarray]", device: torch.device) -> list[torch.Tensor]:
    """Small host arrays in ONE host-to-device copy: 8-byte aligned pieces of a byte buffer, typed views on the GPU."""
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // 8) * 8
    buf = np.zeros(max(total, 8), dtype=np.uint8)
    for a, off in zip(arrays, offsets):
        buf[off : off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    dev = torch.from_numpy(buf).to(device)
    return [dev[off : off + a.nbytes].view(_TORCH_OF[a.dtype]) for a, off in zip(arrays, offsets)]


_TORCH_OF = {np.dtype(np.uint8): torch.uint8, np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


class GpuBackend:
    """Fit passes on the GPU; ``rows`` is a CUDA uint8 [N, row_bytes] tensor.

    The ``*_lazy`` forms leave their results on the GPU and :meth:`collect` reads any number of them back with
    one copy (one host sync), so fitting many codecs at once (the KV manager's prefill) syncs twice, not per codec.
    """

    name = "gpu"

    @staticmethod
    def bitcount_lazy(rows: torch.Tensor) -> torch.Tensor:
        n, rb = rows.shape
        dev = device_index(rows)
        counts = torch.zeros(rb * 8, dtype=torch.int64, device=rows.device)
        gx = -(-rb // 256)
        gy = max(1, min(n, (sm_count(dev) * 64) // gx))
        _launch("ibp_bitcount", dev, (gx, gy), 256, (_ptr(rows), np.int64(n), np.int32(rb), _ptr(counts)))
        return counts

    @staticmethod
    def fit_sizes_lazy(rows: torch.Tensor, level: np.ndarray, inv: np.ndarray, pc: np.ndarray,
                       c: int) -> torch.Tensor:
        n, rb = rows.shape
        k = pc.shape[0]
        if k > 32:
            raise InvalidArgumentError(f"the GPU fit scores at most 32 thresholds at once, got {k}")
        dev = device_index(rows)
        lv, iv, pct = _upload([np.ascontiguousarray(level, dtype=np.uint8), np.ascontiguousarray(inv).view(np.int64),
                               np.ascontiguousarray(pc, dtype=np.int32)], rows.device)
        totals = torch.zeros(k, dtype=torch.int64, device=rows.device)
        _launch(f"ibp_fit_sizes_c{c}", dev, warp_grid(n, dev), _THREADS,
                (_ptr(rows), np.int64(n), np.int32(rb), np.int32(inv.shape[0]), _ptr(lv), _ptr(iv), _ptr(pct),
                 np.int32(k), _ptr(totals)))
        return totals

    @staticmethod
    def collect(handles: "list[torch.Tensor]") -> list[np.ndarray]:
        """The lazy results as numpy arrays: one device-to-host copy for all of them."""
        if not handles:
            return []
        flat = torch.cat([h.reshape(-1) for h in handles]).cpu().numpy()
        out, pos = [], 0
        for h in handles:
            out.append(flat[pos : pos + h.numel()])
            pos += h.numel()
        return out


def check_ibp_tables(tables: object) -> KernelTables:
    """``tables`` if they are IBP kernel tables; else CodecKindError naming what was given. Why: these kernels read
    IBP's format only, and another codec's rows (exponent-coded ones) would decode to wrong values."""
    if not isinstance(tables, KernelTables):
        raise CodecKindError(f"the IBP kernels decode IBP (and raw) rows; got tables of type {type(tables).__name__} "
                             "(rows of another codec method go through that codec's own kernels)")
    return tables


def _check_tables(tables: KernelTables, device: torch.device, row_bytes: int, name: str) -> None:
    """IBP tables that sit on the launch device and describe rows of the width being launched on."""
    check_ibp_tables(tables)
    if tables.mask.device != device:
        raise InvalidArgumentError(f"tables: mask/bitval are on {tables.mask.device}, the launch is on {device} "
                                   f"(use codec.kernel_tables({str(device)!r}))")
    if row_bytes != tables.row_bytes:
        raise RowShapeError(f"{name}: expected {tables.row_bytes}-byte rows, got {row_bytes}")


def size_rows(rows: torch.Tensor, tables: KernelTables) -> torch.Tensor:
    """int32 [N] stored bytes per row, computed on the GPU (no sync)."""
    _check_u8_rows(rows, "rows")
    n, rb = rows.shape
    _check_tables(tables, rows.device, rb, "rows")
    dev = device_index(rows)
    lengths = torch.empty(n, dtype=torch.int32, device=rows.device)
    if n:
        _launch(f"ibp_size_c{tables.chunk_bytes}", dev, warp_grid(n, dev), _THREADS,
                (_ptr(rows), np.int64(n), np.int32(rb), np.int32(tables.n_chunks), _ptr(tables.mask),
                 _ptr(tables.bitval), _ptr(lengths)))
    return lengths


def encode_into(rows_u8: torch.Tensor, dst_ptrs: torch.Tensor, lengths_out: torch.Tensor,
                tables: KernelTables) -> None:
    """Compress each row straight to ``dst_ptrs[m]`` (device memory, or pinned host memory via UVA).

    Each destination needs room for ``row_bytes``; ``lengths_out[m] < row_bytes`` iff row m was
    compressed. Runs on torch's current stream with no host sync (the KV manager appends with it).
    """
    _check_u8_rows(rows_u8, "rows_u8")
    n, rb = rows_u8.shape
    _check_tables(tables, rows_u8.device, rb, "rows_u8")
    for name, t, dt in (("dst_ptrs", dst_ptrs, torch.int64), ("lengths_out", lengths_out, torch.int32)):
        if t.dtype != dt or t.shape != (n,) or not t.is_cuda or not t.is_contiguous():
            raise InvalidArgumentError(f"{name}: expected a contiguous CUDA {dt} tensor of shape ({n},), got {t.dtype} "
                                       f"{tuple(t.shape)} on {t.device}")
    if n == 0:
        return
    dev = device_index(rows_u8)
    _launch(f"ibp_encode_c{tables.chunk_bytes}", dev, warp_grid(n, dev), _THREADS,
            (_ptr(rows_u8), np.int64(n), np.int32(rb), np.int32(tables.n_chunks), _ptr(tables.mask),
             _ptr(tables.bitval), _ptr(dst_ptrs), _ptr(lengths_out)))


def decode_descriptors(out_u8: torch.Tensor, src_ptrs: torch.Tensor, lengths: torch.Tensor, compressed: torch.Tensor,
                       out_rows: "torch.Tensor | None", tables: "KernelTables | ExponentTables",
                       err: "torch.Tensor | None" = None) -> None:
    """Decode M rows, row m from absolute address ``src_ptrs[m]`` into ``out_u8[out_rows[m]]`` (or ``[m]``).

    Sources may mix device memory (slab hits) and pinned host memory (misses): one launch serves both. ``tables``
    picks the decoder: IBP/raw :class:`KernelTables` (this module's ``ibp_decode_desc_c{C}``) or
    :class:`~ibpcache.kernels.exponent.ExponentTables` (``exponent.exp_decode_desc``, the same warp decode as the
    lookup kernels). Exponent rows can be told malformed: ``err`` (int64 [2] on the device; a scratch word when None)
    gets ``1 + m`` of the first such row in ``err[0]``; nothing here syncs.
    """
    if isinstance(tables, ExponentTables):
        _check_u8_rows(out_u8, "out_u8")
        dev = device_index(out_u8)
        exp_decode_desc(out_u8, src_ptrs, lengths, compressed, out_rows, tables,
                        err if err is not None else _exp_err_words(dev))
        return
    _check_u8_rows(out_u8, "out_u8")
    m = src_ptrs.numel()
    _check_tables(tables, out_u8.device, out_u8.shape[1], "out_u8")
    if m == 0:
        return
    for name, t, dt in (("src_ptrs", src_ptrs, torch.int64), ("lengths", lengths, torch.int32),
                        ("compressed", compressed, torch.uint8)):
        if t.dtype != dt or t.numel() != m or not t.is_cuda or not t.is_contiguous():
            raise InvalidArgumentError(f"{name}: expected a contiguous CUDA {dt} tensor of {m} elements, got {t.dtype} "
                                       f"{tuple(t.shape)} on {t.device}")
    if out_rows is not None and (out_rows.dtype != torch.int64 or out_rows.numel() != m or not out_rows.is_cuda):
        raise InvalidArgumentError(f"out_rows: expected a CUDA int64 tensor of {m} elements")
    dev = device_index(out_u8)
    _launch(f"ibp_decode_desc_c{tables.chunk_bytes}", dev, warp_grid(m, dev), _THREADS,
            (_ptr(src_ptrs), _ptr(lengths), _ptr(compressed), _ptr(out_rows), _ptr(out_u8), np.int64(m),
             np.int32(tables.row_bytes), np.int32(tables.n_chunks), _ptr(tables.mask), _ptr(tables.bitval)))


def gather_rows(base: torch.Tensor, offsets: "torch.Tensor | None", lengths: torch.Tensor, flags: torch.Tensor,
                n_rows: int, ids: torch.Tensor, out_u8: torch.Tensor, tables: KernelTables) -> None:
    """Fused gather + decode of stored rows ``ids`` (already range-checked) into ``out_u8``.

    ``base`` is the stored bytes (pinned host memory read through UVA, or device memory); ``offsets`` (int64
    [n_rows], or None for the in-place layout where row i starts at ``i * row_bytes``), ``lengths`` (int32
    [n_rows]) and ``flags`` (uint8 bitmap, bit i % 8 of byte i // 8 = row i compressed) live on the launch device.
    ``CompressedRows.gather`` passes its own buffers; the kernels never see a ``CompressedRows``.
    """
    _check_u8_rows(out_u8, "out_u8")
    _check_tables(tables, out_u8.device, out_u8.shape[1], "out_u8")
    dev = device_index(out_u8)
    err = _err_word(dev)
    n = ids.numel()
    if n == 0:
        return
    _launch(f"ibp_gather_c{tables.chunk_bytes}", dev, warp_grid(n, dev), _THREADS,
            (_ptr(ids), np.int64(n), _ptr(base), _ptr(offsets), _ptr(lengths),
             _ptr(flags), np.int64(n_rows), _ptr(out_u8), np.int32(tables.row_bytes),
             np.int32(tables.n_chunks), _ptr(tables.mask), _ptr(tables.bitval), _ptr(err)))


def gather_raw(base: torch.Tensor, ids: torch.Tensor, out_u8: torch.Tensor, n_rows: int) -> None:
    """Zero-copy gather of raw rows ``base`` (pinned host or device, [n_rows * row_bytes] bytes)."""
    _check_u8_rows(out_u8, "out_u8")
    dev = device_index(out_u8)
    n = ids.numel()
    if n == 0:
        return
    _launch("ibp_gather_raw", dev, warp_grid(n, dev), _THREADS,
            (_ptr(ids), np.int64(n), _ptr(base), np.int64(n_rows), _ptr(out_u8), np.int32(out_u8.shape[1]),
             _ptr(_err_word(dev))))
