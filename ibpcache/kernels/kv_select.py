"""Launcher for ``kv_select.cu``: approximate attention logits from a partial key cache plus the per-row count of
critical tokens, in one launch (InfiniGen-style KV selection, see ``ibpcache/loaders/_kv_select.py``)."""

from __future__ import annotations

import numpy as np
import torch

from ._build import launch

__all__ = ["partial_scores", "MAX_QUERY_VALUES"]

_SRC = "kv_select.cu"
_THREADS = 256  # IBP_SEL_THREADS
MAX_QUERY_VALUES = 1024  # IBP_SEL_MAX_QR: groups * r must fit
_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def partial_scores(query: torch.Tensor, q_dims: torch.Tensor, keys: torch.Tensor, n_tokens: int, scale: float,
                   alpha: float, valid: "torch.Tensor | None") -> tuple[torch.Tensor, torch.Tensor]:
    """(scores fp32 [B, Hkv, n_tokens], counts int32 [B, Hkv]) for one decode query.

    ``query`` [B, Hq, 1, D] (any strides); ``q_dims`` int64 [Hq, r] contiguous: the dimensions each query head
    keeps; ``keys`` [B, Hkv, cap, r] contiguous partial keys (first ``n_tokens`` valid), same dtype as the query;
    ``valid`` bool [B, >= n_tokens] with contiguous rows, or None. A token's score is the max over the KV head's
    query group of ``scale * q[dims] . k``; ``counts`` holds how many tokens score >= row max - alpha.
    """
    b, hq, _, _ = query.shape
    _, hkv, cap, r = keys.shape
    groups = hq // hkv
    if query.dtype != keys.dtype or query.dtype not in _DT or not keys.is_contiguous() or not q_dims.is_contiguous():
        raise ValueError(f"partial_scores: query {query.dtype} and contiguous keys {keys.dtype} must share a float "
                         "dtype; q_dims must be contiguous")
    if groups * r > MAX_QUERY_VALUES:
        raise ValueError(f"partial_scores: {groups} query heads x {r} dims exceed {MAX_QUERY_VALUES}")
    if not (query.is_cuda and keys.device == query.device and q_dims.device == query.device):
        raise ValueError("partial_scores: query, q_dims and keys must be CUDA tensors on one device")
    if query.stride(3) != 1:
        raise ValueError("partial_scores: the query's head dimension must be contiguous")
    if valid is not None and (valid.dtype != torch.bool or valid.stride(-1) != 1 or valid.device != query.device):
        raise ValueError("partial_scores: valid must be a bool [B, T] tensor with contiguous rows, on the query's device")
    scores = torch.empty((b, hkv, n_tokens), dtype=torch.float32, device=query.device)
    counts = torch.empty((b, hkv), dtype=torch.int32, device=query.device)
    if n_tokens == 0 or b * hkv == 0:
        counts.zero_()
        return scores, counts
    dev = query.device.index if query.device.index is not None else torch.cuda.current_device()
    launch(_SRC, "ibp_partial_scores", dev, b * hkv, _THREADS, (
        np.uint64(query.data_ptr()), np.int64(query.stride(0)), np.int64(query.stride(1)),
        np.uint64(q_dims.data_ptr()), np.uint64(keys.data_ptr()), np.int64(cap), np.int32(r), np.int64(n_tokens),
        np.int32(hkv), np.int32(groups), np.float32(scale), np.int32(_DT[query.dtype]),
        np.uint64(0 if valid is None else valid.data_ptr()), np.int64(0 if valid is None else valid.stride(0)),
        np.float32(alpha), np.uint64(scores.data_ptr()), np.uint64(counts.data_ptr())))
    return scores, counts
