"""Thin launchers for ``kv_rows.cu``: one launch appends K and V rows, one launch fetches them.

The KV manager calls these once per layer and decode step, so they check only what a caller inside the
package could get wrong cheaply (shapes, dtypes, devices) and convert arguments without creating tensors.
Both run on torch's current stream and never synchronise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ._build import launch
from .bitpack import warp_grid

__all__ = ["KvSide", "kv_append", "kv_fetch"]

_SRC = "kv_rows.cu"
_THREADS = 256  # 32 * IBP_WARPS_PER_BLOCK in bitpack.cu


@dataclass(frozen=True)
class KvSide:
    """One tensor's (K's or V's) store as the kernels see it.

    ``table``: int64 chunk base addresses (GPU); ``lengths``: int32 stored length per slot (GPU), or None for
    a raw store; ``mask``/``bitval``: the codec's device tables (unused when raw); ``chunk_bytes``/``n_chunks``:
    the codec's chunking.
    """

    table: torch.Tensor
    lengths: "torch.Tensor | None"
    mask: torch.Tensor
    bitval: torch.Tensor
    chunk_bytes: int
    n_chunks: int

    def codec_args(self) -> tuple:
        return (np.uint64(self.mask.data_ptr()), np.uint64(self.bitval.data_ptr()), np.int32(self.chunk_bytes),
                np.int32(self.n_chunks))


def _ptr(t: "torch.Tensor | None") -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _dev(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _byte_strides(x: torch.Tensor, name: str) -> tuple[np.int64, np.int64, np.int64]:
    """Byte strides of dims 0..2 of a [B, H, n, D] tensor whose rows (dim 3) are contiguous."""
    if x.dim() != 4 or (x.stride(3) != 1 and x.shape[3] > 1):
        raise ValueError(f"{name}: expected a [B, H, n, D] tensor with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    e = x.element_size()
    return np.int64(x.stride(0) * e), np.int64(x.stride(1) * e), np.int64(x.stride(2) * e)


def kv_append(keys: torch.Tensor, values: torch.Tensor, slot0: int, slots_per_chunk: int, k: KvSide, v: KvSide,
              written: "torch.Tensor | None" = None,
              into: "tuple[torch.Tensor, torch.Tensor] | None" = None) -> None:
    """Store the rows of ``keys``/``values`` ([B, H, n, D], same shape) in slots ``slot0 + t * B * H + b * H + h``.

    Compressed sides get their stored lengths written at those slots; ``written`` (int64 [1] on the GPU,
    optional) accumulates the bytes stored. ``into``: contiguous [B, H, W, D] buffers whose last n token
    positions also get the rows (the attention input of this step), in the same launch.
    """
    if keys.shape != values.shape or keys.dtype != values.dtype or keys.device != values.device:
        raise ValueError(f"keys and values differ: {tuple(keys.shape)} {keys.dtype} {keys.device} vs "
                         f"{tuple(values.shape)} {values.dtype} {values.device}")
    if not keys.is_cuda:
        raise ValueError(f"keys/values: expected CUDA tensors, got {keys.device}")
    strides = (*_byte_strides(keys, "keys"), *_byte_strides(values, "values"))
    b, h, n, d = keys.shape
    row_bytes = d * keys.element_size()
    att_k = att_v = None
    width = 0
    if into is not None:
        att_k, att_v = into
        width = att_k.shape[2]
        if (att_k.shape != att_v.shape or att_k.shape[:2] != keys.shape[:2] or att_k.shape[3] != d or width < n
                or att_k.dtype != keys.dtype or att_v.dtype != keys.dtype
                or att_k.device != keys.device or att_v.device != keys.device
                or not (att_k.is_contiguous() and att_v.is_contiguous())):
            raise ValueError(f"into: expected two contiguous {keys.dtype} [{b}, {h}, >= {n}, {d}] tensors on "
                             f"{keys.device}, got {tuple(att_k.shape)} and {tuple(att_v.shape)}")
    m = b * h * n
    if m == 0:
        return
    dev = _dev(keys)
    launch(_SRC, "ibp_kv_append", dev, warp_grid(2 * m, dev), _THREADS, (
        _ptr(keys), _ptr(values), *strides, np.int64(n),
        np.int32(h), np.int32(b * h), np.int64(slot0), np.int64(slots_per_chunk), np.int32(row_bytes),
        _ptr(k.table), _ptr(v.table), _ptr(k.lengths), _ptr(v.lengths), *k.codec_args(), *v.codec_args(),
        _ptr(written), _ptr(att_k), _ptr(att_v), np.int64(width), np.int64(width - n)))


def kv_fetch(idx: "torch.Tensor | None", n: int, out_k: torch.Tensor, out_v: torch.Tensor, slots_per_chunk: int,
             k: KvSide, v: KvSide, read: "torch.Tensor | None" = None, row0: "torch.Tensor | None" = None,
             heads: int = 1) -> None:
    """Decode tokens into ``out_k``/``out_v`` ([B, H, width, D], contiguous): row ``(b, h, j)`` gets token
    ``idx[b, h, j]`` (``idx`` int64 [B, H, n], trusted) or token ``j`` (``idx`` None), for j < n.

    ``read`` (int64 [1] on the GPU, optional) accumulates the stored bytes read. ``row0`` (contiguous int64
    [>= T, B] on the GPU, optional, trusted): slot of (token t, batch b, head 0), the table beam reorders and batch
    selections rewrite (``heads`` = H then); None means slot ``t * B * H + b * H + h``.
    """
    b, h, width, d = out_k.shape
    if (out_v.shape != out_k.shape or not (out_k.is_contiguous() and out_v.is_contiguous()) or n > width
            or not out_k.is_cuda or out_v.device != out_k.device):
        raise ValueError(f"out_k/out_v: expected two contiguous CUDA [B, H, >= {n}, D] tensors, got "
                         f"{tuple(out_k.shape)} on {out_k.device} and {tuple(out_v.shape)} on {out_v.device}")
    if idx is not None and (idx.dtype != torch.int64 or tuple(idx.shape) != (b, h, n) or not idx.is_contiguous()
                            or idx.device != out_k.device):
        raise ValueError(f"idx: expected a contiguous int64 tensor of shape {(b, h, n)}, got {idx.dtype} "
                         f"{tuple(idx.shape)}")
    if row0 is not None and (row0.dtype != torch.int64 or row0.dim() != 2 or row0.shape[1] != b or heads != h
                             or not row0.is_contiguous() or row0.device != out_k.device):
        raise ValueError(f"row0: expected a contiguous int64 [T, {b}] tensor on {out_k.device} and heads={h}, got "
                         f"{row0.dtype} {tuple(row0.shape)} on {row0.device}, heads={heads}")
    m = b * h * n
    if m == 0:
        return
    dev = _dev(out_k)
    launch(_SRC, "ibp_kv_fetch", dev, warp_grid(2 * m, dev), _THREADS, (
        _ptr(idx), np.int64(n), np.int32(b * h), np.int64(width), np.int64(slots_per_chunk),
        np.int32(d * out_k.element_size()), _ptr(k.table), _ptr(v.table), _ptr(k.lengths), _ptr(v.lengths),
        *k.codec_args(), *v.codec_args(), _ptr(out_k), _ptr(out_v), _ptr(read), _ptr(row0), np.int32(heads)))
