"""InfiniGen-style speculative KV selection (our implementation of the published idea, OSDI'24).

Decoding with the KV cache in host memory is bound by PCIe, so only the tokens that matter to the next
query should cross it. InfiniGen guesses them *before* the layer runs, from a cheap approximation:

* At prefill, per layer and KV head, keep the ``partial_ratio`` share of head dimensions whose query and
  key magnitudes contribute most to ``q . k`` (mean ``|q_d|`` times mean ``|k_d|`` over the prompt), and
  keep those key columns on the GPU (the *partial key cache*, 20% of K by default).
* While layer i runs, the attention input of layer i is projected with layer i+1's query weights (the
  residual stream changes little between consecutive layers) and scored against the partial keys.
* Per (batch, KV head) the tokens with ``score >= max_score - alpha`` are the critical ones. Like
  InfiniGen, one count ``k`` serves every head of a step (the mean critical count, capped at
  ``max_num_kv``), and each head fetches its top-``k`` tokens, in ascending token order.

``k`` must be known on the host to size the fetch. Reading it back right away would stall the CPU once per
layer, so the critical *share* measured at step s (mean count / tokens) sizes the fetch of step s + 1 (read
from pinned memory through an event that has long completed); the prefill measures it for the first decode
step. The choice of *which* tokens is always made from the current query.

GQA: a KV head serves several query heads; its score for a token is the max over those heads, so a token
that matters to any of them is kept.

On CUDA two kernels (``kernels/kv_select.cu``) do it: the scores (fp32 accumulation), then per (batch, head) the
critical count and the top-k tokens in ascending order; on the CPU the equivalent torch expressions. Ties at the k-th
score go to the lowest token indices on both (:func:`top_k_ascending`), so every transfer path of a cache, eager or
replayed from a CUDA graph (:meth:`PartialKeySelector.select_static`), picks the same tokens.

This module knows nothing of the model: it takes query states after RoPE. Projecting them from a decoder layer is
the transformers adapter's job (``ibpcache.loaders._kv_model.project_query``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError, StateError

__all__ = ["SelectionConfig", "PartialKeySelector", "top_k_ascending", "critical_counts"]


@dataclass(frozen=True)
class SelectionConfig:
    """InfiniGen's defaults: alpha 4, partial ratio 0.2, at most 400 tokens per head."""

    alpha: float = 4.0
    partial_ratio: float = 0.2
    max_num_kv: int = 400

    def __post_init__(self) -> None:
        if not self.alpha > 0:
            raise InvalidArgumentError(f"alpha must be > 0, got {self.alpha}")
        if not 0.0 < self.partial_ratio <= 1.0:
            raise InvalidArgumentError(f"partial_ratio must be in (0, 1], got {self.partial_ratio}")
        if self.max_num_kv < 1:
            raise InvalidArgumentError(f"max_num_kv must be >= 1, got {self.max_num_kv}")


def top_k_ascending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the ``k`` highest scores of each row, ascending. Ties at the k-th score go to the lowest
    indices (a stable descending sort: NaN ranks highest, -0.0 equals 0.0); the CUDA kernel
    (``kernels.kv_select.select_top``) makes exactly this choice, so a tie never splits GPU and CPU selections."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return order.sort(dim=-1).values


def critical_counts(scores: torch.Tensor, alpha: float) -> torch.Tensor:
    """How many scores of each row are >= the row's max - ``alpha`` (NaN scores neither set the max nor count),
    as the CUDA kernel counts them."""
    mx = torch.where(scores.isnan(), float("-inf"), scores).amax(dim=-1, keepdim=True)
    return (scores >= mx - alpha).sum(dim=-1)


class PartialKeySelector:
    """Per-layer partial key caches and the selection of critical tokens (see the module docstring)."""

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 config: SelectionConfig = SelectionConfig()) -> None:
        if num_heads % num_kv_heads:
            raise InvalidArgumentError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.cfg = config
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.groups = num_heads // num_kv_heads
        self.rank = max(1, int(round(config.partial_ratio * head_dim)))
        self.scale = 1.0 / math.sqrt(head_dim)
        self._dims: list["torch.Tensor | None"] = [None] * num_layers  # [Hkv, r] int64
        self._q_dims: list["torch.Tensor | None"] = [None] * num_layers  # [Hq, r]: dims of each query head
        self._keys: list["torch.Tensor | None"] = [None] * num_layers  # [B, Hkv, cap, r]
        self._len = [0] * num_layers
        self._len_dev: "torch.Tensor | None" = None  # CUDA: int64 [layers], the same counts for captured graphs
        self._count_host: list["torch.Tensor | None"] = [None] * num_layers  # pinned: critical count per (b, head)
        self._count_total = [1] * num_layers  # (batch, head, token) scores the counts were taken over
        self._count_event: list["torch.cuda.Event | None"] = [None] * num_layers
        self.last_k = [0] * num_layers

    def reset(self) -> None:
        n = self.num_layers
        self._dims, self._q_dims, self._keys, self._len = [None] * n, [None] * n, [None] * n, [0] * n
        self._len_dev = None
        self._count_host, self._count_event, self.last_k = [None] * n, [None] * n, [0] * n
        self._count_total = [1] * n

    @property
    def gpu_bytes(self) -> int:
        """Bytes of the partial key caches and dimension tables (what this scheme adds on the GPU)."""
        total = 0
        for keys, dims in zip(self._keys, self._dims):
            if keys is not None:
                total += keys.numel() * keys.element_size()
            if dims is not None:
                total += dims.numel() * dims.element_size()
        return total

    def seq_length(self, layer: int) -> int:
        return self._len[layer]

    def prefill(self, layer: int, query: torch.Tensor, keys: torch.Tensor, reserve_tokens: int = 0) -> None:
        """Choose the layer's partial dimensions from the prompt and build its partial key cache.

        ``query`` [B, Hq, T, D] and ``keys`` [B, Hkv, T, D] are the layer's real prompt states. The last
        prompt query also measures the critical-token count that sizes the first decode step.
        """
        b, hkv, t, d = keys.shape
        q_mag = query.detach().abs().float().mean(dim=(0, 2)).view(hkv, self.groups, d).amax(dim=1)  # [Hkv, D]
        k_mag = keys.detach().abs().float().mean(dim=(0, 2))  # [Hkv, D]
        dims = torch.topk(q_mag * k_mag, self.rank, dim=-1).indices.sort(dim=-1).values  # [Hkv, r]
        self._dims[layer] = dims
        self._q_dims[layer] = dims.repeat_interleave(self.groups, dim=0)
        cap = max(reserve_tokens, t, 16)
        store = torch.empty((b, hkv, cap, self.rank), dtype=keys.dtype, device=keys.device)
        store[:, :, :t].copy_(self._columns(keys, dims))
        self._keys[layer] = store
        self._set_len(layer, t)
        self._scores_counted(layer, query[:, :, -1:, :], None)

    def select_batch(self, indices: torch.Tensor, layer: "int | None" = None) -> None:
        """Beam reorder / batch selection: the partial keys of batch row ``b`` become those of ``indices[b]``
        (GPU-resident, like InfiniGen's; one gather per layer, no sync). ``layer`` None: every layer."""
        for i, keys in enumerate(self._keys):
            if keys is not None and layer in (None, i):
                self._keys[i] = keys.index_select(0, indices.to(keys.device))

    def repeat_batch(self, repeats: int) -> None:
        """Repeat every batch row's partial keys ``repeats`` times (``repeat_interleave`` on the batch)."""
        for layer, keys in enumerate(self._keys):
            if keys is not None:
                self._keys[layer] = keys.repeat_interleave(repeats, dim=0)

    def crop(self, n_tokens: int, layer: "int | None" = None) -> None:
        """Forget the partial keys of tokens ``>= n_tokens`` (assisted decoding rejected them)."""
        for i, n in enumerate(self._len):
            if layer in (None, i) and n > n_tokens:
                self._set_len(i, n_tokens)

    def _set_len(self, layer: int, n: int) -> None:
        """The layer's partial-key count, on the host and (CUDA) in the device counter graphs read."""
        self._len[layer] = n
        keys = self._keys[layer]
        if keys is None or not keys.is_cuda:
            return
        if self._len_dev is None or self._len_dev.device != keys.device:
            self._len_dev = torch.zeros(self.num_layers, dtype=torch.int64, device=keys.device)
        self._len_dev[layer].fill_(n)

    def length_on_device(self, layer: int) -> torch.Tensor:
        """int64 [1] device view of the layer's token count (what :meth:`select_static` reads)."""
        if self._len_dev is None:
            raise StateError("length_on_device: no CUDA partial key cache yet")
        return self._len_dev[layer : layer + 1]

    def keys_of(self, layer: int) -> "torch.Tensor | None":
        """The layer's partial key cache [B, Hkv, cap, r] (a new tensor after growth or a batch change)."""
        return self._keys[layer]

    def _columns(self, x: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
        """x[..., dims[h]] per KV head: [B, Hkv, n, D] -> [B, Hkv, n, r]."""
        b, h, n, _ = x.shape
        return x.gather(-1, dims.view(1, h, 1, self.rank).expand(b, h, n, self.rank))

    def append_keys(self, layer: int, keys: torch.Tensor) -> None:
        """Add the partial columns of newly generated keys [B, Hkv, n, D]."""
        store = self._keys[layer]
        if store is None:
            raise StateError(f"layer {layer}: append_keys before prefill")
        n = keys.shape[2]
        t = self._len[layer]
        store = self.reserve_keys(layer, n)
        store[:, :, t : t + n].copy_(self._columns(keys, self._dims[layer]))
        self._set_len(layer, t + n)

    def reserve_keys(self, layer: int, n: int) -> torch.Tensor:
        """Room for ``n`` more tokens in the layer's partial key cache (grown 2x, so rarely a new tensor: graphs
        that captured the old one must be captured again). Returns the cache."""
        store = self._keys[layer]
        t = self._len[layer]
        if t + n > store.shape[2]:
            grown = torch.empty((*store.shape[:2], max(t + n, 2 * store.shape[2]), self.rank),
                                dtype=store.dtype, device=store.device)
            grown[:, :, :t].copy_(store[:, :, :t])
            store = self._keys[layer] = grown
        return store

    def append_keys_static(self, layer: int, keys: torch.Tensor) -> None:
        """CUDA, capturable: :meth:`append_keys` of one token ([B, Hkv, 1, D], a fixed buffer) at the position the
        device counter holds, which it then moves on. Before each run: :meth:`reserve_keys` (same cache, else
        capture again); after: :meth:`note_appended`."""
        if keys.shape[2] != 1:
            raise InvalidArgumentError(f"append_keys_static: one token at a time, got {keys.shape[2]}")
        pos = self.length_on_device(layer)
        self._keys[layer].index_copy_(2, pos, self._columns(keys, self._dims[layer]))
        pos.add_(1)

    def note_appended(self, layer: int, n: int) -> None:
        """Host side of a run of :meth:`append_keys_static` (the device counter moved already)."""
        self._len[layer] += n

    def _scores(self, layer: int, query: torch.Tensor, valid: "torch.Tensor | None") -> torch.Tensor:
        """Approximate attention logits [B, Hkv, T] of one query row per head, from the partial keys."""
        t = self._len[layer]
        b = query.shape[0]
        q_dims = self._q_dims[layer].unsqueeze(0).expand(b, -1, -1)
        qp = query[:, :, 0, :].gather(-1, q_dims).view(b, self.num_kv_heads, self.groups, self.rank)
        kp = self._keys[layer][:, :, :t]  # [B, Hkv, T, r]
        # approximate logits in the model dtype (r of D dims: a ranking, not an exact value), max over the group
        s = torch.matmul(qp * self.scale, kp.transpose(-1, -2)).amax(dim=2).float()  # [B, Hkv, T]
        if valid is not None:
            s = s.masked_fill(~valid[:, None, :].to(s.device), float("-inf"))
        return s

    def _scores_counted(self, layer: int, query: torch.Tensor, valid: "torch.Tensor | None",
                        k: int = 0) -> "tuple[torch.Tensor, torch.Tensor]":
        """(approximate logits [B, Hkv, T], top-``k`` indices [B, Hkv, k] ascending) of one query row, recording
        the critical counts for the next step."""
        if query.is_cuda:
            from ..kernels.kv_select import partial_scores, select_top

            if valid is not None:
                valid = valid.to(query.device)
                if valid.stride(-1) != 1:
                    valid = valid.contiguous()
            scores = partial_scores(query, self._q_dims[layer], self._keys[layer], self._len[layer], self.scale, valid)
            idx, counts = select_top(scores, k, self.cfg.alpha)
        else:
            scores = self._scores(layer, query, valid)
            counts = critical_counts(scores, self.cfg.alpha)
            idx = top_k_ascending(scores, k)
        self._record_count(layer, counts)
        return scores, idx

    def _record_count(self, layer: int, counts: torch.Tensor) -> "torch.cuda.Event | None":
        """Per-(batch, head) critical counts over the layer's tokens, copied to the host without waiting for them
        (CUDA: on the current stream; returns the event recorded after the copy)."""
        self._count_total[layer] = counts.numel() * self._len[layer]
        if counts.is_cuda:
            host = self._count_host[layer]
            if host is None or host.shape != counts.shape or host.dtype != counts.dtype:
                host = self._count_host[layer] = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            host.copy_(counts, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._count_event[layer] = ev
            return ev
        self._count_host[layer] = counts
        return None

    def _planned_k(self, layer: int) -> int:
        host, ev = self._count_host[layer], self._count_event[layer]
        if host is None:
            return self.cfg.max_num_kv
        if ev is not None:
            ev.synchronize()  # recorded a whole step ago: already complete in steady state
        share = int(host.numpy().sum(dtype="int64")) / self._count_total[layer]  # numpy: no torch dispatch
        return max(1, min(self.cfg.max_num_kv, int(math.ceil(share * self._len[layer] - 1e-6))))

    def planned_k(self, layer: int) -> int:
        """How many tokens per head the next :meth:`select` of ``layer`` returns (from the last measured share)."""
        return min(self._planned_k(layer), self._len[layer])

    def select(self, layer: int, query: torch.Tensor, valid: "torch.Tensor | None" = None) -> torch.Tensor:
        """Token indices [B, Hkv, k] (int64, ascending per head) to fetch for ``layer``'s next attention.

        ``query`` is the (speculated) query [B, Hq, 1, D] after RoPE; ``valid`` [B, T] excludes padding.
        """
        if self._dims[layer] is None:
            raise StateError(f"layer {layer}: select before prefill")
        k = self.planned_k(layer)
        self.last_k[layer] = k
        return self._scores_counted(layer, query, valid, k)[1]

    def select_static(self, layer: int, query: torch.Tensor, k: int, scores: torch.Tensor, idx: torch.Tensor,
                      counts: torch.Tensor, valid: "torch.Tensor | None" = None) -> None:
        """CUDA, capturable: :meth:`select` into fixed buffers, the token count read on the device.

        ``scores`` fp32 [B, Hkv, >= cap], ``idx`` int64 [B, Hkv, k], ``counts`` int32 [B, Hkv]; ``valid``: bool
        [B, >= cap] padding (first count columns read), or None. Same kernels and tie rule as :meth:`select`, so a
        replay picks what it would.
        The caller keeps ``k <= `` the layer's count and calls :meth:`note_static` after every run (outside the
        graph: the copy of the counts to pinned memory records a host-allocator event).
        """
        from ..kernels.kv_select import partial_scores, select_top

        keys = self._keys[layer]
        cap = keys.shape[2]
        n_dev = self.length_on_device(layer)
        partial_scores(query, self._q_dims[layer], keys, cap, self.scale, valid, n_dev=n_dev, out=scores)
        select_top(scores[:, :, :cap], k, self.cfg.alpha, n_dev=n_dev, idx=idx, counts=counts)

    def note_static(self, layer: int, k: int, counts: torch.Tensor) -> "torch.cuda.Event":
        """After a run of :meth:`select_static`, on its stream: its ``counts`` size the next step (copied to the host
        as :meth:`select` copies its own). Returns the event recorded after the run and that copy."""
        self.last_k[layer] = k
        return self._record_count(layer, counts)
