"""Launchers for ``kv_select.cu``: approximate attention logits from a partial key cache, then per row the count of
critical tokens and the top-k tokens in ascending order (InfiniGen-style KV selection, see
``ibpcache/cache/kv_select.py``). Two launches per layer, no host sync, CUDA-graph safe with ``n_dev``."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ._build import device_index, launch

__all__ = ["partial_scores", "select_top", "MAX_QUERY_VALUES"]

_SRC = "kv_select.cu"
_THREADS = 256  # IBP_SEL_THREADS
_TILE = 1024  # IBP_SEL_TILE
_TOP_THREADS = 1024  # IBP_TOP_THREADS
MAX_QUERY_VALUES = 1024  # IBP_SEL_MAX_QR: groups * r must fit
_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _check_count(n_dev: "torch.Tensor | None", like: torch.Tensor) -> None:
    if n_dev is not None and (n_dev.dtype != torch.int64 or n_dev.device != like.device or n_dev.numel() != 1):
        raise InvalidArgumentError("n_dev must be a one-element int64 tensor on the query's device")


def partial_scores(query: torch.Tensor, q_dims: torch.Tensor, keys: torch.Tensor, n_tokens: int, scale: float,
                   valid: "torch.Tensor | None", *, n_dev: "torch.Tensor | None" = None,
                   out: "torch.Tensor | None" = None) -> torch.Tensor:
    """Scores fp32 [B, Hkv, n_tokens] (a view of ``out`` when given) for one decode query.

    ``query`` [B, Hq, 1, D] (any strides, head dim contiguous); ``q_dims`` int64 [Hq, r] contiguous: the dimensions
    each query head keeps; ``keys`` [B, Hkv, cap, r] contiguous partial keys, same dtype as the query; ``valid``
    bool [B, >= n_tokens] with contiguous rows, or None. A token's score is the max over the KV head's query group of
    ``scale * q[dims] . k``. ``n_dev`` (int64 [1] on the device): the token count is read there at run time (for a
    captured graph); ``n_tokens`` then only bounds the launch, and ``out`` [B, Hkv, >= n_tokens] fp32 receives it.
    """
    b, hq, _, _ = query.shape
    _, hkv, cap, r = keys.shape
    groups = hq // hkv
    if query.dtype != keys.dtype or query.dtype not in _DT or not keys.is_contiguous() or not q_dims.is_contiguous():
        raise InvalidArgumentError(f"partial_scores: query {query.dtype} and contiguous keys {keys.dtype} must share a "
                                   "float dtype; q_dims must be contiguous")
    if groups * r > MAX_QUERY_VALUES:
        raise InvalidArgumentError(f"partial_scores: {groups} query heads x {r} dims exceed {MAX_QUERY_VALUES}")
    if not (query.is_cuda and keys.device == query.device and q_dims.device == query.device):
        raise InvalidArgumentError("partial_scores: query, q_dims and keys must be CUDA tensors on one device")
    if query.stride(3) != 1:
        raise InvalidArgumentError("partial_scores: the query's head dimension must be contiguous")
    if valid is not None and (valid.dtype != torch.bool or valid.stride(-1) != 1 or valid.device != query.device):
        raise InvalidArgumentError("partial_scores: valid must be a bool [B, T] tensor with contiguous rows, on the "
                                   "query's device")
    if not 0 <= n_tokens <= cap:
        raise InvalidArgumentError(f"partial_scores: n_tokens {n_tokens} outside the partial key cache's [0, {cap}]")
    _check_count(n_dev, query)
    if out is None:
        out = torch.empty((b, hkv, n_tokens), dtype=torch.float32, device=query.device)
    elif (out.dtype != torch.float32 or out.shape[:2] != (b, hkv) or out.shape[2] < n_tokens or out.stride(2) != 1
          or out.stride(0) != hkv * out.stride(1) or out.device != query.device):
        raise InvalidArgumentError(f"partial_scores: out must be fp32 [{b}, {hkv}, >= {n_tokens}] with contiguous rows")
    if n_tokens == 0 or b * hkv == 0:
        return out[:, :, :n_tokens]
    launch(_SRC, "ibp_partial_scores", device_index(query), (b * hkv, -(-n_tokens // _TILE)), _THREADS, (
        np.uint64(query.data_ptr()), np.int64(query.stride(0)), np.int64(query.stride(1)),
        np.uint64(q_dims.data_ptr()), np.uint64(keys.data_ptr()), np.int64(cap), np.int32(r), np.int64(n_tokens),
        np.uint64(0 if n_dev is None else n_dev.data_ptr()), np.int32(hkv), np.int32(groups), np.float32(scale),
        np.int32(_DT[query.dtype]), np.uint64(0 if valid is None else valid.data_ptr()),
        np.int64(0 if valid is None else valid.stride(0)), np.uint64(out.data_ptr()), np.int64(out.stride(1))))
    return out[:, :, :n_tokens]


def select_top(scores: torch.Tensor, k: int, alpha: float, *, n_dev: "torch.Tensor | None" = None,
               idx: "torch.Tensor | None" = None, counts: "torch.Tensor | None" = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx int64 [B, H, k] ascending, counts int32 [B, H]) from fp32 ``scores`` [B, H, T] (contiguous rows).

    ``idx``: the ``k`` highest-scoring tokens of each row, ties at the k-th value to the lowest indices (NaN ranks
    highest, -0.0 equals 0.0): exactly :func:`ibpcache.cache.kv_select.top_k_ascending`. ``counts``: how many
    tokens score >= row max - ``alpha``. With ``n_dev`` the row length is read on the device (at most T; the caller
    keeps it >= k); ``idx``/``counts`` are filled in place when given.
    """
    if scores.dtype != torch.float32 or scores.dim() != 3 or not scores.is_cuda or scores.stride(2) != 1 \
            or scores.stride(0) != scores.shape[1] * scores.stride(1):
        raise InvalidArgumentError("select_top: scores must be a CUDA fp32 [B, H, T] tensor with contiguous rows")
    b, h, t = scores.shape
    if not 0 <= k <= t:
        raise InvalidArgumentError(f"select_top: k {k} outside [0, {t}] (the row length)")
    _check_count(n_dev, scores)
    if idx is None:
        idx = torch.empty((b, h, k), dtype=torch.int64, device=scores.device)
    if counts is None:
        counts = torch.empty((b, h), dtype=torch.int32, device=scores.device)
    if idx.shape != (b, h, k) or idx.dtype != torch.int64 or not idx.is_contiguous() or idx.device != scores.device \
            or counts.shape != (b, h) or counts.dtype != torch.int32 or not counts.is_contiguous() \
            or counts.device != scores.device:
        raise InvalidArgumentError(f"select_top: idx must be int64 [{b}, {h}, {k}] and counts int32 [{b}, {h}], "
                                   "contiguous, on the scores' device")
    if b * h == 0:
        return idx, counts
    launch(_SRC, "ibp_select_top", device_index(scores), b * h, _TOP_THREADS, (
        np.uint64(scores.data_ptr()), np.int64(scores.stride(1)), np.int64(t),
        np.uint64(0 if n_dev is None else n_dev.data_ptr()), np.int32(k), np.float32(alpha),
        np.uint64(idx.data_ptr()), np.uint64(counts.data_ptr())))
    return idx, counts
