"""Thin launchers for ``kv_packed.cu``: append K and V rows to a packed store (two launches), fetch them (one).

The engine's :class:`~ibpcache.cache.append_store.AppendStore` owns the store and its descriptor (an int64 device
tensor laid out by ``layout.KVP_D_*``); these functions only check what a caller inside the package could get
wrong cheaply (shapes, dtypes, devices), convert arguments without creating tensors and launch on torch's current
stream. None of them synchronises, so a decode step's KV work can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ._build import device_index, launch
from .bitpack import sm_count

__all__ = ["kvp_append", "kvp_fetch", "byte_strides", "THREADS"]

_SRC = "kv_packed.cu"
THREADS = 128  # 32 * KVP_WARPS in kv_packed.cu


def _ptr(t: "torch.Tensor | None") -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _grid(rows: int, dev: int) -> int:
    """Blocks for ``rows`` rows per side: warps take 32 rows of one side each, 4 warps a block."""
    tasks = 2 * -(-rows // 32)
    return max(1, min(-(-tasks // (THREADS // 32)), sm_count(dev) * 8))


def byte_strides(x: torch.Tensor, name: str) -> tuple[np.int64, np.int64, np.int64]:
    """Byte strides of dims 0..2 of a [B, H, n, D] tensor whose rows (dim 3) are contiguous."""
    if x.dim() != 4 or (x.stride(3) != 1 and x.shape[3] > 1):
        raise InvalidArgumentError(f"{name}: expected a [B, H, n, D] tensor with contiguous rows, got shape "
                                   f"{tuple(x.shape)} strides {x.stride()}")
    e = x.element_size()
    return np.int64(x.stride(0) * e), np.int64(x.stride(1) * e), np.int64(x.stride(2) * e)


def _check_desc(desc: torch.Tensor, device: torch.device) -> None:
    if desc.dtype != torch.int64 or desc.device != device or not desc.is_contiguous():
        raise InvalidArgumentError(f"desc: expected the store's contiguous int64 descriptor on {device}, got "
                                   f"{desc.dtype} on {desc.device}")


def kvp_append(desc: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot0: int, t0: int, *,
               dyn: bool = False, rewind: bool = False, written: "torch.Tensor | None" = None,
               into: "tuple[torch.Tensor, torch.Tensor] | None" = None, att_pos0: int = 0,
               before_encode: "Callable[[], torch.Tensor | None] | None" = None) -> None:
    """Append ``keys``/``values`` ([B, H, n, D], same shape, rows contiguous) as slots ``slot0 + t * B * H + bh``.

    ``dyn``: take the first token from the store's device state instead (slots move with it; for graph replays).
    ``rewind``: start at the stored position of ``slot0``'s K row instead of the cursor (slots are being rewritten
    after a crop). ``written`` (int64 [1], device): += stored bytes. ``into``: contiguous [B, H, W, D] buffers that
    also get the rows, token t at ``att_pos0 + t``. ``before_encode``: called between the two launches; it may
    return a contiguous uint8 CUDA buffer the encode then writes the rows to (row at virtual offset v goes to
    ``buffer[v - base]``) instead of their host chunks (a prompt: the store reads where it went, sizes the buffer and
    copies it to its chunks with DMA copies afterwards).
    """
    if keys.shape != values.shape or keys.dtype != values.dtype or keys.device != values.device:
        raise InvalidArgumentError(f"keys and values differ: {tuple(keys.shape)} {keys.dtype} {keys.device} vs "
                                   f"{tuple(values.shape)} {values.dtype} {values.device}")
    if not keys.is_cuda:
        raise InvalidArgumentError(f"keys/values: expected CUDA tensors, got {keys.device}")
    _check_desc(desc, keys.device)
    strides = (*byte_strides(keys, "keys"), *byte_strides(values, "values"))
    b, h, n, d = keys.shape
    att_k = att_v = None
    width = 0
    if into is not None:
        att_k, att_v = into
        width = att_k.shape[2]
        if (att_k.shape != att_v.shape or att_k.shape[:2] != keys.shape[:2] or att_k.shape[3] != d
                or att_k.dtype != keys.dtype or att_v.dtype != keys.dtype
                or att_k.device != keys.device or att_v.device != keys.device
                or not (att_k.is_contiguous() and att_v.is_contiguous())
                or not (dyn or 0 <= att_pos0 <= width - n)):
            raise InvalidArgumentError(f"into: expected two contiguous {keys.dtype} [{b}, {h}, W, {d}] tensors on "
                                       f"{keys.device} with room for {n} tokens at {att_pos0}, got "
                                       f"{tuple(att_k.shape)} and {tuple(att_v.shape)}")
    m = b * h * n
    if m == 0:
        return
    dev = device_index(keys)
    grid = _grid(m, dev)
    launch(_SRC, "ibp_kvp_size", dev, grid, THREADS, (
        _ptr(desc), _ptr(keys), _ptr(values), *strides, np.int64(n), np.int32(h), np.int32(b * h),
        np.int64(slot0), np.int64(t0), np.int32(dyn), np.int32(rewind)))
    stage = before_encode() if before_encode is not None else None
    if stage is not None and (stage.dtype != torch.uint8 or stage.device != keys.device or not stage.is_contiguous()):
        raise InvalidArgumentError(f"stage: expected a contiguous uint8 buffer on {keys.device}, got "
                                   f"{stage.dtype} on {stage.device}")
    launch(_SRC, "ibp_kvp_encode", dev, grid, THREADS, (
        _ptr(desc), _ptr(keys), _ptr(values), *strides, np.int64(n), np.int32(h), np.int32(b * h), np.int64(t0),
        np.int32(dyn), _ptr(written), _ptr(att_k), _ptr(att_v), np.int64(width), np.int64(att_pos0), _ptr(stage)))


def kvp_fetch(desc: torch.Tensor, idx: "torch.Tensor | None", k: int, out_k: torch.Tensor, out_v: torch.Tensor, *,
              k_dyn: bool = False, read: "torch.Tensor | None" = None, row0: "torch.Tensor | None" = None,
              heads: int = 1, stage: "tuple[torch.Tensor, torch.Tensor] | None" = None) -> None:
    """Decode tokens into ``out_k``/``out_v`` ([B, H, width, D], contiguous): row ``(b, h, j)`` gets token
    ``idx[b, h, j]`` (``idx`` int64 [B, H, k], trusted) or token ``j`` (``idx`` None), for j < k.

    ``k_dyn``: k is the token count in the store's device state (graph replays; ``idx`` must be None and ``k`` is
    then the most it can be, which sizes the grid). ``read`` (int64 [1], device): += stored bytes read. ``row0``
    (contiguous int64 [>= T, B], device, trusted): slot of (token t, batch b, head 0) after beam reorders or batch
    selections (``heads`` = H then); None means slot ``t * B * H + b * H + h``. ``stage``: (uint8 buffer, int64
    chunk offsets) on the device, a copy of the store's chunks (chunk c at ``buffer[offsets[c]:]``) to decode from
    instead of the pinned host chunks; trusted to cover every chunk the rows lie in.
    """
    b, h, width, d = out_k.shape
    if (out_v.shape != out_k.shape or not (out_k.is_contiguous() and out_v.is_contiguous()) or k > width
            or not out_k.is_cuda or out_v.device != out_k.device or out_v.dtype != out_k.dtype):
        raise InvalidArgumentError(f"out_k/out_v: expected two contiguous CUDA [B, H, >= {k}, D] tensors, got "
                                   f"{tuple(out_k.shape)} on {out_k.device} and {tuple(out_v.shape)} on {out_v.device}")
    _check_desc(desc, out_k.device)
    if idx is not None and (k_dyn or idx.dtype != torch.int64 or tuple(idx.shape) != (b, h, k)
                            or not idx.is_contiguous() or idx.device != out_k.device):
        raise InvalidArgumentError(f"idx: expected a contiguous int64 tensor of shape {(b, h, k)} (and no k_dyn), got "
                                   f"{idx.dtype} {tuple(idx.shape)}")
    if row0 is not None and (row0.dtype != torch.int64 or row0.dim() != 2 or row0.shape[1] != b or heads != h
                             or not row0.is_contiguous() or row0.device != out_k.device):
        raise InvalidArgumentError(f"row0: expected a contiguous int64 [T, {b}] tensor on {out_k.device} and "
                                   f"heads={h}, got {row0.dtype} {tuple(row0.shape)} on {row0.device}, heads={heads}")
    stage_buf = stage_off = None
    if stage is not None:
        stage_buf, stage_off = stage
        if (stage_buf.dtype != torch.uint8 or stage_off.dtype != torch.int64 or stage_buf.device != out_k.device
                or stage_off.device != out_k.device or not stage_off.is_contiguous()):
            raise InvalidArgumentError("stage: expected a uint8 buffer and contiguous int64 offsets on "
                                       f"{out_k.device}, got {stage_buf.dtype} on {stage_buf.device} and "
                                       f"{stage_off.dtype} on {stage_off.device}")
    m = b * h * k
    if m == 0:
        return
    dev = device_index(out_k)
    launch(_SRC, "ibp_kvp_fetch", dev, _grid(m, dev), THREADS, (
        _ptr(desc), _ptr(idx), np.int64(k), np.int32(k_dyn), np.int32(b * h), np.int64(width), _ptr(out_k),
        _ptr(out_v), _ptr(read), _ptr(row0), np.int32(heads), _ptr(stage_buf), _ptr(stage_off)))
