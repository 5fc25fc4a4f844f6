"""Launchers for ``exponent.cu``: GPU size, encode and gather + decode of exponent-coded float rows.

The format and its CPU twin live in ``exponent_cpu.py`` (same bytes); the codec (``ibpcache/exponent.py``) builds
the :class:`ExponentTables` these take, so the kernels never see a codec object. Every launch goes on torch's
current stream; nothing here synchronizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ._build import device_index, launch, sm_count

__all__ = ["ExponentTables", "exp_sizes", "exp_encode", "exp_gather", "exp_decode_desc", "STAGED_MAX_ROW",
           "WARP_MAX_ROW", "WARP_SMEM_BYTES", "EXP_GEOM_FIELDS", "LUT1_BITS", "group_rows", "two_level_lut"]

_SRC = "exponent.cu"
_THREADS = 128
_STAGED_WARPS = 4  # IBP_EXP_WARPS
_GATHER_WARPS = 8  # IBP_EXP_GATHER_WARPS
STAGED_MAX_ROW = 256  # IBP_EXP_MAX_ROW: one-segment rows up to this many bytes decode a row per lane
WARP_MAX_ROW = 2048  # IBP_EXP_WARP_MAX_ROW: rows up to this many bytes are staged in shared memory by the warp decode
WARP_SMEM_BYTES = WARP_MAX_ROW + 16 + WARP_MAX_ROW // 2
"""IBP_EXP_WARP_SMEM_BYTES: one warp's shared memory in the warp decoders (a staged row and its exponent bytes)."""
LUT1_BITS = 10
"""IBP_EXP_LUT1_BITS: bits of the first-level decode table (:func:`two_level_lut`)."""
EXP_GEOM_FIELDS = ("row_elems", "eshift", "emask", "raw_bits", "row_bytes", "seg", "n_seg", "hdr_field")
"""The geometry words (``ExponentTables.geom``) in the order lookup.cu's ExpRows reads them (IBP_EXP_GEOM_WORDS)."""


@dataclass(frozen=True)
class ExponentTables:
    """Device tables of one exponent code and its row geometry.

    ``code_len`` uint8 [2**ebits], ``code_rev`` int32 [2**ebits] (codewords bit-reversed over their length),
    ``lut`` int32 [2**LUT1_BITS + 2**max_bits] (:func:`two_level_lut`); rows of ``row_elems`` elements of
    ``elem_bytes`` bytes in ``n_seg`` segments of ``seg`` elements, whose starts take ``hdr_field`` bits each in the
    row header. ``geom`` (int32 [8], on the tables' device, built here) holds that geometry as
    :data:`EXP_GEOM_FIELDS`: what the engine's lookup kernels (``lookup.cu``) read, since their parameter list is
    shared with the IBP kinds.
    """

    code_len: torch.Tensor
    code_rev: torch.Tensor
    lut: torch.Tensor
    max_bits: int
    eshift: int
    emask: int
    raw_bits: int
    row_elems: int
    row_bytes: int
    elem_bytes: int
    seg: int
    n_seg: int
    hdr_field: int
    geom: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.elem_bytes not in (2, 4) or self.row_bytes != self.elem_bytes * self.row_elems:
            raise InvalidArgumentError(f"ExponentTables: {self.row_elems} elements of {self.elem_bytes} bytes are "
                                       f"not {self.row_bytes}-byte rows")
        if self.n_seg != -(-self.row_elems // self.seg) or self.hdr_field not in (16, 32):
            raise InvalidArgumentError(f"ExponentTables: {self.n_seg} segments of {self.seg} do not cover "
                                       f"{self.row_elems} elements, or hdr_field {self.hdr_field} is not 16/32")
        geom = torch.tensor([getattr(self, f) for f in EXP_GEOM_FIELDS], dtype=torch.int32)
        object.__setattr__(self, "geom", geom.to(self.lut.device))

    @property
    def device(self) -> torch.device:
        return self.lut.device


def two_level_lut(full: np.ndarray, max_bits: int) -> np.ndarray:
    """The decode table the kernels take (``ibp_exp_lookup``): ``2**LUT1_BITS`` first-level entries, entry ``i``
    the codeword that the next ``LUT1_BITS`` stream bits ``i`` (first bit on top) begin with, as ``(symbol << 8) |
    length``, or -1 where that codeword is longer than ``LUT1_BITS`` bits; then ``full``, the ``2**max_bits``-entry
    table indexed by the next ``max_bits`` bits. A first-level hit needs only the small table (every frequent
    exponent: see ``ibp_exp_lookup`` for why)."""
    if full.shape != (1 << max_bits,):
        raise InvalidArgumentError(f"decode table: expected {1 << max_bits} entries for {max_bits}-bit codes, "
                                   f"got {full.shape}")
    prefix = np.arange(1 << LUT1_BITS, dtype=np.int64)
    if max_bits <= LUT1_BITS:  # every codeword fits the first level
        first = full[prefix >> (LUT1_BITS - max_bits)]
    else:
        first = full[prefix << (max_bits - LUT1_BITS)]
        first = np.where((first & 0xFF) <= LUT1_BITS, first, -1)
    return np.concatenate([first.astype(np.int32), full.astype(np.int32)])


def group_rows(row_bytes: int, row_elems: int, n_seg: int, cap: int = 32) -> int:
    """Rows one warp decodes at once (``ibp_exp_group_rows`` in exponent.cu; keep in sync): as many as fit
    :data:`WARP_SMEM_BYTES` (a staged row of its whole words + 16 bytes, and one exponent byte per element, each)
    with ``G * n_seg <= 32`` segment walks, at most ``cap`` (the lookup's pooling passes its row buffer's rows);
    1 (a row per warp) for rows over :data:`WARP_MAX_ROW` bytes or of more than 16 segments. Tests use it to pick
    geometries that exercise grouping, and the benchmarks report it."""
    if row_bytes > WARP_MAX_ROW or n_seg > 16 or cap < 2:
        return 1
    stride = ((row_bytes + 3) & ~3) + 16
    return max(1, min(WARP_SMEM_BYTES // (stride + row_elems), 32 // n_seg, cap))


def _p(t: "torch.Tensor | None") -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _geometry(tab: ExponentTables) -> tuple:
    """(d, eshift, emask, raw_bits, row_bytes, seg, n_seg, hdr_field) as every kernel takes them."""
    return tuple(np.int32(v) for v in (tab.row_elems, tab.eshift, tab.emask, tab.raw_bits, tab.row_bytes, tab.seg,
                                       tab.n_seg, tab.hdr_field))


def _grid(n: int, dev: int, per_block: int) -> int:
    return max(1, min(-(-n // per_block), sm_count(dev) * 8))


def _check_rows(rows_u8: torch.Tensor, tab: ExponentTables, name: str) -> int:
    """Rows as the size/encode kernels read them; returns the device ordinal."""
    if (not rows_u8.is_cuda or rows_u8.dtype != torch.uint8 or rows_u8.dim() != 2 or not rows_u8.is_contiguous()
            or rows_u8.shape[1] != tab.row_bytes):
        raise InvalidArgumentError(f"{name}: expected contiguous CUDA uint8 [N, {tab.row_bytes}] rows, got "
                                             f"{rows_u8.dtype} {tuple(rows_u8.shape)} on {rows_u8.device}")
    if rows_u8.data_ptr() % tab.elem_bytes:
        raise InvalidArgumentError(f"{name}: rows must start at a multiple of {tab.elem_bytes} bytes (their elements "
                                   "are read as such)")
    if tab.lut.device != rows_u8.device:
        raise InvalidArgumentError(f"tables are on {tab.lut.device}, the rows on {rows_u8.device}")
    return device_index(rows_u8)


def exp_sizes(rows_u8: torch.Tensor, tab: ExponentTables) -> torch.Tensor:
    """int32 [N]: stored bytes of every row of ``rows_u8`` (CUDA uint8 [N, row_bytes])."""
    dev = _check_rows(rows_u8, tab, "rows_u8")
    n = rows_u8.shape[0]
    lengths = torch.empty(n, dtype=torch.int32, device=rows_u8.device)
    if n:
        launch(_SRC, f"ibp_exp_sizes_e{tab.elem_bytes}", dev, _grid(n, dev, _THREADS), _THREADS,
               (_p(rows_u8), np.int64(n), *_geometry(tab), _p(tab.code_len), _p(lengths)))
    return lengths


def exp_encode(rows_u8: torch.Tensor, tab: ExponentTables, dst_ptrs: torch.Tensor, lengths: torch.Tensor) -> None:
    """Encode row i of ``rows_u8`` to address ``dst_ptrs[i]`` (device memory or pinned host memory through UVA; room
    for its stored length); ``lengths[i]`` (int32, CUDA) gets that length."""
    dev = _check_rows(rows_u8, tab, "rows_u8")
    n = rows_u8.shape[0]
    for name, t, dt in (("dst_ptrs", dst_ptrs, torch.int64), ("lengths", lengths, torch.int32)):
        if t.dtype != dt or t.shape != (n,) or not t.is_cuda or not t.is_contiguous():
            raise InvalidArgumentError(f"{name}: expected a contiguous CUDA {dt} tensor of shape ({n},), got {t.dtype} "
                                                 f"{tuple(t.shape)} on {t.device}")
    if n:
        launch(_SRC, f"ibp_exp_encode_e{tab.elem_bytes}", dev, _grid(n, dev, _THREADS), _THREADS,
               (_p(rows_u8), np.int64(n), *_geometry(tab), _p(tab.code_len), _p(tab.code_rev), _p(dst_ptrs),
                _p(lengths)))


def _check_out(out_u8: torch.Tensor, tab: ExponentTables) -> None:
    """The decoders' output: contiguous CUDA uint8 [M, row_bytes], aligned to the element size, on the tables'
    device."""
    if (not out_u8.is_cuda or out_u8.dtype != torch.uint8 or out_u8.dim() != 2 or not out_u8.is_contiguous()
            or out_u8.shape[1] != tab.row_bytes or out_u8.data_ptr() % tab.elem_bytes):
        raise InvalidArgumentError(f"out_u8: expected a contiguous CUDA uint8 [M, {tab.row_bytes}] tensor aligned to "
                                   f"{tab.elem_bytes} bytes, got {out_u8.dtype} {tuple(out_u8.shape)} on "
                                   f"{out_u8.device}")
    if tab.lut.device != out_u8.device:
        raise InvalidArgumentError(f"tables are on {tab.lut.device}, the output on {out_u8.device}")


def _check_vectors(checks: list, device: torch.device) -> None:
    """Each ``(name, tensor, dtype, numel)``: a contiguous tensor of that dtype and size on ``device``."""
    for name, t, dt, size in checks:
        if t.dtype != dt or t.numel() != size or not t.is_contiguous() or t.device != device:
            raise InvalidArgumentError(f"{name}: expected a contiguous {dt} tensor of {size} elements on {device}, "
                                       f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def exp_gather(base: int, offsets: Optional[torch.Tensor], lengths: torch.Tensor, ids: Optional[torch.Tensor],
               n_rows: int, tab: ExponentTables, out_u8: torch.Tensor, err: torch.Tensor,
               out_rows: Optional[torch.Tensor] = None) -> None:
    """Decode stored rows into ``out_u8`` (CUDA uint8 [M, row_bytes], contiguous).

    Row ``ids[i]`` (or ``i`` when ``ids`` is None, M = ``n_rows``) of a store whose row ``r`` is ``lengths[r]``
    bytes at address ``base + offsets[r]`` (``offsets`` None: ``r * row_bytes``) goes to ``out_u8[i]`` (or
    ``[out_rows[i]]``). ``base`` is a device address or a pinned host one (read zero-copy). One-segment rows up to
    :data:`STAGED_MAX_ROW` bytes decode a row per lane, everything else a row per warp, or :func:`group_rows` rows
    per warp where several fit its shared memory. ``err`` (int64 [2], CUDA):
    ``err[0]`` = 1 + the first i whose row is malformed, ``err[1]`` = 1 + the first i whose id is out of range.
    """
    _check_out(out_u8, tab)
    dev = device_index(out_u8)
    m = int(ids.numel()) if ids is not None else int(n_rows)
    checks = [("lengths", lengths, torch.int32, n_rows), ("err", err, torch.int64, 2)]
    if offsets is not None:
        checks.append(("offsets", offsets, torch.int64, n_rows))
    if ids is not None:
        checks.append(("ids", ids, torch.int64, m))
    if out_rows is not None:
        checks.append(("out_rows", out_rows, torch.int64, m))
    _check_vectors(checks, out_u8.device)
    if out_rows is None and out_u8.shape[0] != m:
        raise InvalidArgumentError(f"out_u8: expected {m} rows, got {out_u8.shape[0]}")
    if m == 0:
        return
    args = (_p(ids), np.int64(m), np.uint64(base), _p(offsets), _p(lengths), np.int64(n_rows), _p(out_u8),
            _p(out_rows), _p(err), *_geometry(tab), _p(tab.lut), np.int32(tab.max_bits))
    if tab.n_seg == 1 and tab.row_bytes <= STAGED_MAX_ROW:
        launch(_SRC, f"ibp_exp_decode_staged_e{tab.elem_bytes}", dev, _grid(m, dev, 32 * _STAGED_WARPS),
               32 * _STAGED_WARPS, args)
    else:
        launch(_SRC, f"ibp_exp_gather_e{tab.elem_bytes}", dev, max(1, min(-(-m // _GATHER_WARPS), sm_count(dev) * 16)),
               32 * _GATHER_WARPS, args)


def exp_decode_desc(out_u8: torch.Tensor, src_ptrs: torch.Tensor, lengths: torch.Tensor, compressed: torch.Tensor,
                    out_rows: Optional[torch.Tensor], tab: ExponentTables, err: torch.Tensor) -> None:
    """Decode M rows given by descriptors, a row per warp (or :func:`group_rows` per warp): row m is
    ``lengths[m]`` bytes at the absolute address ``src_ptrs[m]`` (device memory or pinned host memory: slab hits and
    host misses of one fetch, or rows the CPU staged), coded iff ``compressed[m]``, into ``out_u8[out_rows[m]]`` (or
    ``[m]``). The exponent form of ``bitpack.decode_descriptors`` (which calls this for exponent tables). ``err``
    (int64 [2], CUDA): ``err[0]`` = 1 + the first m whose row is malformed (checked by whoever reads it; nothing here
    syncs).
    """
    m = int(src_ptrs.numel())
    _check_out(out_u8, tab)
    checks = [("src_ptrs", src_ptrs, torch.int64, m), ("lengths", lengths, torch.int32, m),
              ("compressed", compressed, torch.uint8, m), ("err", err, torch.int64, 2)]
    if out_rows is not None:
        checks.append(("out_rows", out_rows, torch.int64, m))
    _check_vectors(checks, out_u8.device)
    if out_rows is None and out_u8.shape[0] < m:
        raise InvalidArgumentError(f"out_u8: expected at least {m} rows, got {out_u8.shape[0]}")
    if m == 0:
        return
    dev = device_index(out_u8)
    launch(_SRC, f"ibp_exp_decode_desc_e{tab.elem_bytes}", dev,
           max(1, min(-(-m // _GATHER_WARPS), sm_count(dev) * 16)), 32 * _GATHER_WARPS,
           (_p(src_ptrs), _p(lengths), _p(compressed), _p(out_rows), _p(out_u8), np.int64(m), *_geometry(tab),
            _p(tab.lut), np.int32(tab.max_bits), _p(err)))
