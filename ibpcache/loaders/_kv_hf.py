"""transformers 5.x ``Cache`` on top of the engine's :class:`~ibpcache.cache.kv_manager.KVOffloadManager` (imports
transformers; reached through :mod:`ibpcache.loaders.kv`, which stays importable without it).

``model.generate(ids, past_key_values=IBPOffloadedCache(model.config, mode=...))``:

* ``mode="dense"``: every layer attends to all its tokens, fetched from host memory; lossless, so greedy
  tokens equal those with ``DynamicCache``. Layer i+1's fetch runs on a side stream while layer i computes.
* ``mode="sparse"`` (needs ``model=``): InfiniGen-style speculation (``cache/kv_select.py``). Forward pre-hooks on
  the decoder layers project layer i's input with layer i+1's query weights, pick the critical tokens from
  the partial key cache and start their fetch while layer i runs; the attention mask of each layer is cut
  down to the selected tokens so padded batches stay correct.

The cache is only a translator: storage, transfer and compression are the manager's.
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from ..cache.kv_graph import QueryProjection, SpeculationGraphs
from ..cache.kv_manager import KVOffloadManager, pin_ahead
from ..cache.kv_select import PartialKeySelector, SelectionConfig
from ..errors import InvalidArgumentError, InvalidTypeError, StateError, UnsupportedError
from ._kv_model import decoder_geometry, decoder_layers, gather_mask, project_query, valid_from_mask

__all__ = ["IBPOffloadedCache", "IBPOffloadedLayer"]

MODES = ("dense", "sparse")

@functools.lru_cache(maxsize=1)
def _positive_crop_keeps() -> bool:
    """How the installed ``DynamicLayer.crop`` reads a positive argument: True when it is the length to keep
    (transformers <= 5.17, deprecated there with a warning), False when it is refused (5.18 on). Asked of a
    two-token DynamicLayer once, since the parameter was renamed before the meaning changed."""
    layer = DynamicLayer()
    x = torch.zeros((1, 1, 2, 1))
    layer.update(x, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        level = logging.getLogger("transformers").level
        logging.getLogger("transformers").setLevel(logging.ERROR)
        try:
            layer.crop(1)
        except ValueError:
            return False
        finally:
            logging.getLogger("transformers").setLevel(level)
    return layer.get_seq_length() == 1


def crop_target(seq_length: int, arg: int) -> int:
    """Tokens left after ``crop(arg)`` on ``seq_length`` stored tokens, in the installed transformers' convention:
    ``-n`` removes n tokens, 0 nothing; a positive n keeps n tokens (transformers <= 5.17) or raises (later)."""
    if isinstance(arg, torch.Tensor) and arg.dim() == 0 and not arg.is_floating_point() and arg.dtype != torch.bool:
        arg = int(arg)  # transformers 5.17's prompt-lookup decoding passes a 0-d tensor (reading it syncs once)
    if isinstance(arg, bool) or not isinstance(arg, int):
        raise InvalidTypeError(f"crop: expected an int, got {arg!r}")
    if arg <= 0:
        return max(0, seq_length + arg)
    if _positive_crop_keeps():
        return min(seq_length, arg)
    raise InvalidArgumentError(f"Calling `crop` with a positive value (`{arg}`) is not supported: pass -n to remove n "
                               "tokens")


class IBPOffloadedLayer(CacheLayerMixin):
    """One decoder layer's view of the shared manager (transformers calls ``update`` once per forward)."""

    is_compileable = False
    is_sliding = False
    is_croppable = True  # crop restores exactly the earlier state (rows are never rewritten in place)

    def __init__(self, owner: "IBPOffloadedCache", layer_idx: int) -> None:
        super().__init__()
        self._owner = weakref.proxy(owner)
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._owner._update(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: "int | torch.Tensor") -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older signature: cache_position
            query_length = int(query_length.shape[0])
        return self.get_seq_length() + int(query_length), 0

    def get_seq_length(self) -> int:
        return self._owner._seq_length(self.layer_idx)

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:  # the manager keeps everything in host memory already
        pass

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """This layer only (``IBPOffloadedCache.reorder_cache`` does all layers at once)."""
        self._owner._reorder(beam_idx, self.layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """This layer only, in the installed transformers' ``crop`` convention (see :func:`crop_target`)."""
        self._owner._crop(crop_target(self.get_seq_length(), tokens_to_remove), self.layer_idx)

    def _whole_cache(self, what: str) -> None:
        if self.get_seq_length() > 0:
            raise UnsupportedError(f"{what} changes the batch size of the store all layers share: call it on the "
                                   "IBPOffloadedCache, not on one layer")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._whole_cache("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._whole_cache("batch_select_indices")


class IBPOffloadedCache(Cache):
    """A transformers ``Cache`` whose K/V live in host memory as losslessly compressed rows (packed per append).

    Supported models (checked at construction; anything else raises :class:`~ibpcache.errors.UnsupportedModelError`
    naming the problem instead of failing later with a shape error):

    * decoder-only models whose every layer is full attention, with the KV geometry in the config
      (``num_hidden_layers``, ``num_attention_heads``, optional ``num_key_value_heads``, ``head_dim`` or
      ``hidden_size``) and calling ``Cache.update`` with [B, KV heads, T, head_dim] states. Dense mode: the Llama
      family (Llama / SmolLM2 and Qwen2-shaped models are what the tests and benchmarks run) and GPT-2.
    * sparse mode additionally needs rotary position embeddings and Llama-like decoder layers
      (``model.model.layers[i].self_attn.q_proj``, ``input_layernorm``): the Llama family, not GPT-2.
    * refused: encoder-decoder configs (T5), encoders (BERT, ``is_decoder=False``), sliding-window or other
      non-full attention layers (Mistral's ``sliding_window``, Gemma's ``layer_types``), sparse mode without RoPE.

    transformers: >= 5.0; tested with 5.17 (the GPU image: the GPU tests) and 5.24 (CPU CI: the CPU tests, chunked
    prefill included). ``crop`` follows the installed version's convention (:func:`crop_target`), and the
    sparse-mode hooks find the cache under either keyword those versions pass to decoder layers.

    Sparse mode also tells the manager its stores are read by scattered selections (``scattered_reads``): on CUDA
    a layer and side is stored raw unless the GPU measures a fetch of its selected coded rows faster than of raw
    rows by a margin (``codec="auto"``; a named ``codec`` is used as named).

    Args:
        config: the model config (see above; a composite config's text decoder is used).
        mode: "dense" (lossless, all tokens) or "sparse" (InfiniGen-style selection; needs ``model``).
        model: the causal LM, for sparse mode's query speculation (hooks are removed by :meth:`close` or
            when the cache is garbage-collected).
        compress, codec, transfer, sample_rows, threshold, chunk_bytes, reserve_tokens, timing, count_bytes,
            dense_fetch, prefill: see :class:`KVOffloadManager` (``prefill="auto"``: on CUDA a worker stores each
            layer's prompt while the model computes the next layers, so the first token does not wait for it).
        alpha, partial_ratio, max_num_kv: InfiniGen's selection knobs (defaults 4, 0.2, 400).
        prefetch: overlap layer i+1's fetch with layer i's compute (GPU only).
        graphs: sparse mode on CUDA: replay each layer's speculation (and a zero-copy store's fetch) from a CUDA
            graph captured per (layer, k) instead of launching it from Python (``cache/kv_graph.py``), and the layer's
            append after attention (store and partial keys) likewise; the same kernels, so the same tokens and the
            same stored bytes, padded batches included (the padding is copied into a fixed buffer).
    """

    def __init__(self, config: Any, mode: str = "dense", *, model: "torch.nn.Module | None" = None,
                 compress: bool = True, transfer: str = "auto", alpha: float = 4.0, partial_ratio: float = 0.2,
                 max_num_kv: int = 400, sample_rows: int = 4096, threshold: "float | str" = "auto",
                 chunk_bytes: "int | str" = "auto", reserve_tokens: int = 0, prefetch: bool = True,
                 timing: bool = False, count_bytes: bool = True, codec: str = "auto", dense_fetch: str = "bulk",
                 graphs: bool = True, prefill: str = "auto") -> None:
        if mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
        if transfer == "cpu_gather" and compress:
            raise InvalidArgumentError("transfer='cpu_gather' is InfiniGen's uncompressed baseline: pass "
                                       "compress=False")
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = decoder_geometry(config, mode)
        super().__init__(layers=[IBPOffloadedLayer(self, i) for i in range(self.num_layers)])
        self.mode = mode
        self.use_prefetch = bool(prefetch)
        self.use_graphs = bool(graphs)
        self._spec_graphs: "SpeculationGraphs | None" = None
        self._manager_kwargs = dict(compress=compress, codec=codec, transfer=transfer, sample_rows=sample_rows,
                                    threshold=threshold, chunk_bytes=chunk_bytes, reserve_tokens=reserve_tokens,
                                    timing=timing, count_bytes=count_bytes, dense_fetch=dense_fetch,
                                    prefill=prefill)
        self.manager: "KVOffloadManager | None" = None
        self.selector: "PartialKeySelector | None" = None
        self._selection: dict[int, torch.Tensor] = {}
        self._selection_ready: dict[int, torch.cuda.Event] = {}  # graph replays: when a selection may be read
        self._prefill_q: dict[int, torch.Tensor] = {}
        self._hooks: list = []
        if mode == "sparse":
            if model is None:
                raise InvalidArgumentError("mode='sparse' needs model=<the causal LM> to speculate the next layer's "
                                           "query")
            self.selector = PartialKeySelector(self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim,
                                               SelectionConfig(alpha, partial_ratio, max_num_kv))
            self._decoder = decoder_layers(model)
            if len(self._decoder) != self.num_layers:
                raise InvalidArgumentError(f"model has {len(self._decoder)} decoder layers, config says "
                                           f"{self.num_layers}")
            self._install_hooks()

    # -- hooks (sparse mode) ----------------------------------------------------------------------
    def _install_hooks(self) -> None:
        ref = weakref.ref(self)
        for i, layer in enumerate(self._decoder):
            def hook(module: torch.nn.Module, args: tuple, kwargs: dict, i: int = i) -> Any:
                cache = ref()
                # transformers <= 5.23 hands decoder layers the cache as past_key_values=, 5.24 as cache=
                if cache is None or kwargs.get("past_key_values", kwargs.get("cache")) is not cache:
                    return None
                with torch.no_grad():
                    return cache._on_layer_start(i, args, kwargs)
            self._hooks.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
        weakref.finalize(self, _remove_hooks, list(self._hooks))

    @staticmethod
    def pin_ahead(config: Any, batch_size: int, tokens: int, dtype: torch.dtype = torch.bfloat16, *,
                  compress: bool = True) -> int:
        """Start pinning the host memory that a prompt of ``tokens`` tokens for ``batch_size`` sequences of this
        model will be stored in, on a background thread, and return at once (the bytes asked for; 0 without CUDA).

        Call it while the model loads: the first prefill of a process otherwise waits for page-locking, which runs
        at ~2-2.5 GB/s on one thread (6-9 s for a 32k x 4 Llama-8B prompt). The blocks stay in the process's pool
        and serve every later cache (:func:`~ibpcache.cache.kv_manager.pin_ahead`). ``compress``: as the caches
        will be created (compressed stores take fewer blocks)."""
        layers, _, kv_heads, head_dim = decoder_geometry(config, "dense")
        return pin_ahead(layers, kv_heads, head_dim, dtype, batch_size, tokens, compress=compress)

    def close(self) -> None:
        """Remove the sparse-mode hooks from the model and stop the manager's worker thread."""
        _remove_hooks(self._hooks)
        self._hooks = []
        self._spec_graphs = None
        if self.manager is not None:
            self.manager.close()

    def __enter__(self) -> "IBPOffloadedCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_layer_start(self, i: int, args: tuple, kwargs: dict) -> Any:
        """Before decoder layer i: speculate and prefetch layer i+1 (and layer 0), cut layer i's mask."""
        hidden = args[0] if args else kwargs.get("hidden_states")
        pos = kwargs.get("position_embeddings")
        if pos is None:
            raise UnsupportedError("sparse mode needs the decoder layers to receive position_embeddings (Llama-family)")
        n_past = self._seq_length(i)
        if n_past == 0:
            self._prefill_q[i] = project_query(self._decoder[i], hidden, pos)
            return None
        if hidden.shape[1] != 1:
            return None  # a multi-token continuation attends densely
        mask = kwargs.get("attention_mask")
        valid = valid_from_mask(mask, n_past)
        if i == 0:
            self._speculate(0, hidden, pos, valid)
        if i + 1 < self.num_layers and self._seq_length(i + 1) == n_past:
            self._speculate(i + 1, hidden, pos, valid)
        idx = self._selection.get(i)
        if idx is None or mask is None:
            return None
        ready = self._selection_ready.pop(i, None)
        if ready is not None:  # made on the graphs' stream
            torch.cuda.current_stream(idx.device).wait_event(ready)
        kwargs["attention_mask"] = gather_mask(mask, idx, n_past, self.num_heads)
        return args, kwargs

    def _speculate(self, j: int, hidden: torch.Tensor, pos: tuple, valid: "torch.Tensor | None") -> None:
        if self.use_graphs and self.use_prefetch and hidden.is_cuda:
            if self._spec_graphs is None:
                self._spec_graphs = SpeculationGraphs(_query_projection(self._decoder), self.selector,
                                                      hidden.device)
            replayed = self._spec_graphs.speculate(j, hidden, pos, valid, self.manager)
            if replayed is not None:
                self._selection[j], self._selection_ready[j] = replayed
                return
        q = project_query(self._decoder[j], hidden, pos)
        idx = self.selector.select(j, q, valid)
        self._selection[j] = idx
        self._selection_ready.pop(j, None)
        if self.use_prefetch:
            self.manager.prefetch(j, idx, extra_tokens=1)

    # -- the Cache interface ----------------------------------------------------------------------
    def _seq_length(self, layer: int) -> int:
        return 0 if self.manager is None else self.manager.seq_length(layer)

    def _make_manager(self, k: torch.Tensor) -> KVOffloadManager:
        return KVOffloadManager(self.num_layers, self.num_kv_heads, self.head_dim, k.dtype,
                                batch_size=k.shape[0], device=k.device, scattered_reads=self.mode == "sparse",
                                **self._manager_kwargs)

    def _update(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.manager is None:
            self.manager = self._make_manager(k)
        m = self.manager
        q_len = k.shape[2]
        if m.seq_length(i) == 0:  # prompt: store (and fit) it; attention gets what DynamicLayer would return
            # DynamicLayer returns torch.cat([empty, k], -2): a CONTIGUOUS copy. The projections hand us
            # transposed views ([B, T, H, D] memory), and on CUDA SDPA's backend choice and kernels depend on
            # the strides, so returning k/v as they are changes the prefill's rounding (and greedy tokens).
            k, v = _like_dynamic_layer(k), _like_dynamic_layer(v)
            m.append(i, k, v, donate=True)  # fresh tensors nobody writes: the prefill worker stores them as they are
            if self.selector is not None:
                q = self._prefill_q.pop(i, None)
                if q is None:
                    raise StateError("sparse mode: the decoder-layer hooks did not run; pass the same model to "
                                     "IBPOffloadedCache(model=...) that generates")
                self.selector.prefill(i, q, k, self._manager_kwargs["reserve_tokens"])
            self._prefetch_next(i)
            return k, v
        idx = self._selection.pop(i, None) if q_len == 1 else None
        if idx is not None and self._spec_graphs is not None:  # sparse mode: the appends replayed from graphs
            out = self._spec_graphs.append(i, idx, k, v, m)
            if out is not None:
                return out
        keys, values = m.take(i, idx, extra_tokens=q_len)
        # stores the new tokens and puts them after the fetched ones (the projections' outputs: never written again)
        m.append(i, k, v, into=(keys, values), donate=True)
        if self.selector is not None:
            self.selector.append_keys(i, k)
        self._prefetch_next(i)
        return keys, values

    def _prefetch_next(self, i: int) -> None:
        """Dense mode: start layer i+1's fetch (layer 0's for the next step after the last layer)."""
        if self.mode != "dense" or not self.use_prefetch or self.manager.device.type != "cuda":
            return
        j = (i + 1) % self.num_layers
        if self.manager.seq_length(j) > 0:
            self.manager.prefetch(j, None, extra_tokens=1)

    # -- decoding strategies: beam search, assisted decoding, batch selection ---------------------------------
    # The manager rewrites its per-token slot tables (a device gather of [T, B] ints): no stored row is
    # decoded, re-encoded or moved, and nothing waits for the GPU.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: batch row b continues the sequence of row ``beam_idx[b]`` (every layer)."""
        self._reorder(beam_idx, None)

    def _reorder(self, beam_idx: torch.Tensor, layer: "int | None") -> None:
        if self.manager is None:
            return
        self.manager.reorder(beam_idx, layer)
        if self.selector is not None:
            self.selector.select_batch(beam_idx.to(self.manager.device), layer)
        self._after_change(layer)

    def crop(self, tokens_to_remove: int) -> None:
        """Assisted decoding: drop the rejected draft tokens (installed transformers' ``crop`` convention)."""
        self._crop(crop_target(self.get_seq_length(), tokens_to_remove), None)

    def _crop(self, n_tokens: int, layer: "int | None") -> None:
        if self.manager is None:
            return
        self.manager.crop(n_tokens, layer)
        if self.selector is not None:
            self.selector.crop(n_tokens, layer)
        self._after_change(layer)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times (e.g. expanding a prefilled prompt into beams)."""
        if self.manager is None:
            return
        self.manager.repeat_batch(repeats)
        if self.selector is not None:
            self.selector.repeat_batch(repeats)
        self._after_change(None)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices``."""
        if self.manager is None:
            return
        self.manager.select_batch(indices)
        if self.selector is not None:
            self.selector.select_batch(indices.to(self.manager.device))
        self._after_change(None)

    def _after_change(self, layer: "int | None") -> None:
        """Selections made for the old order are void; restart layer 0's prefetch (dense, GPU) in the new one."""
        self._selection.clear()
        self._selection_ready.clear()
        if layer is None or layer == self.num_layers - 1:
            self._prefetch_next(self.num_layers - 1)

    @property
    def batch_size(self) -> int:
        """Sequences in the cache (-1 before the first update), like transformers' ``Cache.batch_size``."""
        return -1 if self.manager is None else self.manager.batch_size

    def reset(self) -> None:
        """Forget everything; the next update may bring another batch size (a fresh manager is made then)."""
        if self.manager is not None:
            self.manager.reset()
            self.manager.close()
            self.manager = None
        if self.selector is not None:
            self.selector.reset()
        self._spec_graphs = None  # captured against the old stores and partial key caches
        self._selection.clear()
        self._selection_ready.clear()
        self._prefill_q.clear()
        for layer in self.layers:
            layer.reset()

    def flush(self) -> None:
        """Wait until the prefill worker stored every prompt handed to it (decoding never needs this: each layer's
        read waits for that layer; a benchmark timing a whole prefill does)."""
        if self.manager is not None:
            self.manager.flush()

    def stats(self) -> dict:
        """The manager's :meth:`~KVOffloadManager.stats` plus the mode and the selection's GPU share."""
        out = {"mode": self.mode}
        if self.manager is not None:
            out.update(self.manager.stats())
        if self.selector is not None:
            out["partial_key_bytes"] = self.selector.gpu_bytes
            out["gpu_bytes"] = out.get("gpu_bytes", 0) + self.selector.gpu_bytes
            out["selected_k_last"] = list(self.selector.last_k)
        if self._spec_graphs is not None:
            out.update(self._spec_graphs.stats())
        return out


def _like_dynamic_layer(x: torch.Tensor) -> torch.Tensor:
    """What ``DynamicLayer.update`` returns for the first states of a layer: ``torch.cat([empty, x], dim=-2)``
    (same values, dtype, shape and strides, a fresh contiguous tensor)."""
    return torch.cat([torch.tensor([], dtype=x.dtype, device=x.device), x], dim=-2)


def _query_projection(decoder: "torch.nn.ModuleList") -> QueryProjection:
    """The speculation graphs' one view of the model: layer j's query from a residual input and its RoPE tables."""

    def project(j: int, hidden: torch.Tensor, pos: "tuple[torch.Tensor, ...]") -> torch.Tensor:
        return project_query(decoder[j], hidden, pos)

    return project


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()
