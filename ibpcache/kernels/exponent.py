"""Launchers for ``exponent.cu``: GPU encode/decode of exponent-coded bf16/fp16 rows (thread per row).

The format and its CPU reference live in ``ibpcache/exponent.py``; these produce and read the same bytes. The
kernels take plain tensors and geometry (no codec object): the codec layer builds :class:`ExponentTables`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ._build import device_index, launch
from .bitpack import sm_count

__all__ = ["ExponentTables", "exp_sizes", "exp_encode", "exp_decode"]

_SRC = "exponent.cu"
_THREADS = 128
_STAGED_WARPS = 4  # IBP_EXP_WARPS
STAGED_MAX_ROW = 256  # IBP_EXP_MAX_ROW


@dataclass(frozen=True)
class ExponentTables:
    """Device tables of one exponent code: ``code_len`` uint8 [S], ``code_rev`` int32 [S] (codewords bit-reversed
    over their length), ``lut`` int32 [2**max_bits] ((symbol << 8) | length), plus the element geometry."""

    code_len: torch.Tensor
    code_rev: torch.Tensor
    lut: torch.Tensor
    max_bits: int
    eshift: int
    emask: int
    raw_bits: int
    row_elems: int
    row_bytes: int


def _p(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _geometry(tab: ExponentTables) -> tuple:
    """(d, eshift, emask, raw_bits, row_bytes) as the sizes/encode kernels take them."""
    return (np.int32(tab.row_elems), np.int32(tab.eshift), np.int32(tab.emask), np.int32(tab.raw_bits),
            np.int32(tab.row_bytes))


def _grid(n: int, dev: int) -> int:
    return max(1, min(-(-n // _THREADS), sm_count(dev) * 8))


def _dev(t: torch.Tensor, what: str) -> int:
    if not t.is_cuda:
        raise ValueError(f"{what}: expected a CUDA tensor")
    return device_index(t)


def _rows_u16(x: torch.Tensor, tab: ExponentTables) -> torch.Tensor:
    if x.dtype not in (torch.bfloat16, torch.float16) or not x.is_contiguous() or x.numel() % tab.row_elems:
        raise ValueError("exponent kernels: x must be contiguous bf16/fp16 rows of the codec's size")
    return x.view(torch.int16)


def exp_sizes(x: torch.Tensor, tab: ExponentTables) -> torch.Tensor:
    """int32 [N]: stored bytes of every row of ``x`` (CUDA)."""
    dev = _dev(x, "x")
    u = _rows_u16(x, tab)
    n = u.numel() // tab.row_elems
    lengths = torch.empty(n, dtype=torch.int32, device=x.device)
    if n:
        launch(_SRC, "ibp_exp_sizes", dev, _grid(n, dev), _THREADS,
               (_p(u), np.int64(n), *_geometry(tab), _p(tab.code_len), _p(lengths)))
    return lengths


def exp_encode(x: torch.Tensor, tab: ExponentTables, offsets: torch.Tensor, lengths: torch.Tensor,
               dst: torch.Tensor) -> None:
    """Write every row of ``x`` at ``dst[offsets[i]:][:lengths[i]]`` (``dst`` uint8, device or pinned host)."""
    dev = _dev(x, "x")
    u = _rows_u16(x, tab)
    n = u.numel() // tab.row_elems
    if offsets.dtype != torch.int64 or lengths.dtype != torch.int32 or dst.dtype != torch.uint8:
        raise ValueError("exp_encode: offsets int64, lengths int32, dst uint8")
    if n:
        launch(_SRC, "ibp_exp_encode", dev, _grid(n, dev), _THREADS,
               (_p(u), np.int64(n), *_geometry(tab), _p(tab.code_len), _p(tab.code_rev), _p(offsets), _p(lengths),
                _p(dst)))


def exp_decode(base: int, offsets: torch.Tensor, lengths: torch.Tensor, tab: ExponentTables, out: torch.Tensor,
               err: torch.Tensor) -> None:
    """``out`` (bf16/fp16 [N, D] contiguous, CUDA) = the rows stored at ``base + offsets[i]`` (a device address,
    or a pinned host one read zero-copy). ``err`` int64 [1] (device) gets 1 + the first row that overruns."""
    dev = _dev(out, "out")
    n = offsets.numel()
    if offsets.dtype != torch.int64 or lengths.dtype != torch.int32 or lengths.numel() != n:
        raise ValueError("exp_decode: offsets int64 [N] and lengths int32 [N]")
    if out.numel() != n * tab.row_elems or not out.is_contiguous():
        raise ValueError("exp_decode: out must be contiguous [N, row_elems]")
    if n and tab.row_bytes <= STAGED_MAX_ROW:  # the usual case: coalesced staging, then a row per lane
        grid = max(1, min(-(-n // (32 * _STAGED_WARPS)), sm_count(dev) * 8))
        launch(_SRC, "ibp_exp_decode_staged", dev, grid, 32 * _STAGED_WARPS,
               (np.uint64(base), _p(offsets), _p(lengths), np.int64(n), np.int32(tab.row_elems), np.int32(tab.eshift),
                np.int32(tab.raw_bits), np.int32(tab.row_bytes), _p(tab.lut), np.int32(tab.max_bits), _p(out),
                _p(err)))
    elif n:
        launch(_SRC, "ibp_exp_decode", dev, _grid(n, dev), _THREADS,
               (np.uint64(base), _p(offsets), _p(lengths), np.int64(n), np.int32(tab.row_elems), np.int32(tab.eshift),
                np.int32(tab.raw_bits), np.int32(tab.row_bytes), _p(tab.lut), np.int32(tab.max_bits), _p(out),
                _p(err)))
