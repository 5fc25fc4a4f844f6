"""Drop-in replacement for Colossal-AI's ``CachedEmbeddingBag``, backed by an IBP-compressed host table.

Change one import::

    # from colossalai.legacy.nn.parallel.layers import CachedEmbeddingBag, EvictionStrategy
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag, EvictionStrategy

The constructor and ``forward`` take Colossal-AI 0.5's arguments with the same names, order and defaults,
followed by keyword-only compression options. What differs, and why:

* The full table lives in host memory *compressed* with the table's IBP mask (in place, pinned when the
  cache is on a GPU): the engine's ``HostStore`` (``ibpcache.cache``), the same store FeatureCache uses. Misses
  are fetched by one GPU kernel that reads the stored rows zero-copy and decodes them straight into their cache
  slots, or, where the planner measured it faster, gathered as stored bytes on the CPU, copied once, decoded on
  the GPU.
* ``device`` is the device of the cache (default: CUDA when available, else the CPU, where everything
  also works); Colossal-AI used it for the initial CPU weight and always cached on CUDA.
* ``DATASET`` eviction uses ``ids_freq_mapping`` as a priority without renumbering ids, so a pretrained
  ``_weight`` keeps its meaning (Colossal-AI 0.5 renumbers ids but not the weight). ``LRU`` is added.
* Batches with more distinct ids than cache rows are served (the cache grows for that batch and shrinks
  back on the next one); Colossal-AI refuses them.
* ``weight`` is the current full table (cached rows included), ``flush()`` keeps rows cached, and
  ``state_dict()`` holds the full table under ``weight`` like ``torch.nn.EmbeddingBag``.
* ``buffer_size`` and ``pin_weight`` are accepted and ignored: the host store is pinned exactly when the
  cache is on a GPU (zero-copy needs it); the fused inference path's staging buffer is ``stage_bytes``.
* The cached rows are registered as the parameter ``cached_weight`` (Colossal-AI reports it as ``weight``
  from an overridden ``named_parameters``); ``parameters()`` yields that one tensor in both.
* Inference (``torch.no_grad`` / ``inference_mode``) never writes evicted rows back: they cannot have
  changed. Training forwards, ``max_norm`` and any in-place update of ``cached_weight`` (its version counter)
  mark rows dirty.
* Inference on CUDA (``fused_inference``) keeps the cache's rows as the host stores them (compressed) and admits rows
  on the device every step, with no host sync (``ibpcache.cache.row_cache.FusedLookup``). The first such forward
  after training writes dirty rows back and empties the cache, as does the first training forward after inference
  (``stats()['form_switches']``); a forward while a gradient is held takes the training form's path instead.

Training: the cached rows are the module's only parameter (``cached_weight``), dense or ``sparse=True``
gradients. Rows evicted or flushed are written back re-compressed (raw when a row no longer matches the mask);
``refit_threshold`` refits the mask when too many rows stop compressing (``stats()['refit_steps']`` says when).
Exactness against ``torch.nn.EmbeddingBag`` trained the same way, bit for bit:

* SGD without momentum or weight decay (stateless): exact as it is, dense or sparse gradients;
* every other optimizer needs ``attach_optimizer(opt)`` once, before its first step (a step without it is
  refused with ``ibpcache.errors.OptimizerStateError``): SGD with momentum / dampening / nesterov / weight decay,
  Adam, AdamW, Adagrad (dense gradients), Adagrad and SparseAdam (sparse gradients) are then exact. Per-row state
  follows its row in and out of the cache, and a row that was evicted while the optimizer kept moving the table's
  other absent rows (momentum, Adam's moments, weight decay) replays the updates it missed when it comes back, and
  at ``flush()`` / ``weight`` (``ibpcache.cache.row_optimizer``: the optimizer's own update, so the same rounding;
  the cost grows with the updates a row missed). SGD momentum or weight decay with ``sparse=True`` is refused (torch
  keeps a sparse momentum buffer). Colossal-AI keeps the state with the slot and lets evicted rows fall behind.
* fp16/bf16 rows on the CPU with updates that use ``add(alpha=...)`` (SGD, weight decay): within the one tolerance
  ``ibpcache.cache.row_optimizer`` documents (torch rounds such an update by an element's position in its tensor).

One forward per backward, as in Colossal-AI: a second forward before ``backward`` may evict rows the
first one still needs gradients for. An oversized batch resizes ``cached_weight`` for one step (and an attached
optimizer's state with it).
"""

from __future__ import annotations

import weakref

from typing import Any, Callable, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from .._validation import check_fraction, resolve_device
from ..compressed import CompressedRows
from ..errors import FormatError, InvalidArgumentError, InvalidIdsError, InvalidTypeError, StateError, UnsupportedError
from ..cache.admission import SETTLED_ADMIT_EVERY, check_admit_every
from ..cache.host_store import FitOptions, HostStore, Transfer
from ..cache.plan_layout import slot_option
from ..cache.policy import EvictionStrategy
from ..cache.row_optimizer import mark_coalesced
from ..cache.row_cache import (STAGE_BYTES, BagLayout, CachedRowManager, Prepared, check_adoptable_rows,
                               pool_supported)

__all__ = [
    "CachedEmbeddingBag",
    "TableBatchedCachedEmbeddingBag",
    "EvictionStrategy",
    "EmbeddingBagIndexError",
    "EmbeddingBagInputError",
]

_MODES = ("sum", "mean", "max")
_COMPRESS = (True, False, "auto", "ibp", "exponent")


class EmbeddingBagIndexError(InvalidIdsError, RuntimeError):
    """An id outside ``[0, num_embeddings)``; a RuntimeError like torch's, and an ``InvalidIdsError``."""


class EmbeddingBagInputError(FormatError, RuntimeError):
    """Malformed ``input``/``offsets`` where torch raises RuntimeError (dtypes, offsets order)."""


# ------------------------------------------------------------------------------------------------
# input checks (torch's rules, clearer messages, one device sync for all value checks)
# ------------------------------------------------------------------------------------------------


def _check_int_tensor(t: Any, name: str, arg: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int64, torch.int32):
        raise EmbeddingBagInputError(f"Expected tensor for argument {arg} '{name}' to have one of the following "
                                     f"scalar types: Long, Int; but got {t.dtype} instead")
    return t


def _check_bag_shapes(input: Any, offsets: Any) -> None:
    """torch.nn.functional.embedding_bag's shape rules (ValueError there, FormatError here)."""
    _check_int_tensor(input, "indices", "#1")
    if input.dim() == 2:
        if offsets is not None:
            raise FormatError("if input is 2D, then offsets has to be None, as input is treated is a mini-batch "
                              f"of fixed length sequences. However, found offsets of type {type(offsets)}")
    elif input.dim() == 1:
        if offsets is None:
            raise FormatError("offsets has to be a 1D Tensor but got None")
        _check_int_tensor(offsets, "offsets", "#2")
        if offsets.dim() != 1:
            raise FormatError(f"offsets has to be a 1D Tensor, got shape {tuple(offsets.shape)}")
    else:
        raise FormatError(f"input has to be 1D or 2D Tensor, but got Tensor of dimension {input.dim()}")


def _check_tensors(ids: torch.Tensor, bad_ids: Optional[torch.Tensor], offsets: Optional[torch.Tensor]) -> list:
    """0-d tensors for every check that needs values: read together with the cache's one device sync."""
    parts = []
    if bad_ids is not None and ids.numel():
        parts.append(bad_ids.any())
    if offsets is not None and offsets.numel():
        parts += [offsets[0], (offsets[1:] < offsets[:-1]).any(), offsets[-1]]
    return parts


def _verifier(ids: torch.Tensor, bad_ids: Optional[torch.Tensor], offsets: Optional[torch.Tensor], limits: str
              ) -> Callable[[list], None]:
    """Turns the values of :func:`_check_tensors` into torch-like exceptions with clear messages."""

    def verify(vals: list) -> None:
        vals = list(vals)
        if bad_ids is not None and ids.numel() and vals.pop(0):
            pos = int(torch.nonzero(bad_ids.reshape(-1))[0])
            value = int(ids.reshape(-1)[pos])
            raise EmbeddingBagIndexError(f"Index {pos} of input takes value {value} which is not in the valid "
                                         f"range {limits}")
        if offsets is not None and offsets.numel():
            first, decreasing, last = vals[:3]
            if first != 0:
                raise EmbeddingBagInputError(f"offsets[0] has to be 0, i.e., the first sequence in the mini-batch "
                                             f"has to start from position 0. However, got {first}")
            if decreasing:
                raise EmbeddingBagInputError("offsets must be non-decreasing (each bag starts where the previous "
                                             "one ends)")
            if last > ids.numel():
                raise EmbeddingBagInputError(f"offsets[-1] can not be greater than input's length {ids.numel()} "
                                             f"but got offsets[-1] of {last}")

    return verify


def _input_key(input: torch.Tensor, offsets: Optional[torch.Tensor]) -> Optional[tuple]:
    """What makes a forward's inputs those a prefetch saw: the same tensor objects, not written to since (None for
    inference tensors, which keep no version counter)."""
    if input.is_inference() or offsets is not None and offsets.is_inference():
        return None
    return (input, input._version, offsets, None if offsets is None else offsets._version)


def _as_freq(mapping: Any, n: int) -> Optional[torch.Tensor]:
    if mapping is None:
        return None
    t = torch.as_tensor(mapping)
    if t.dim() != 1 or t.numel() != n or t.is_floating_point() and not torch.isfinite(t).all():
        raise InvalidArgumentError(f"ids_freq_mapping: expected {n} finite frequencies (one per row), got shape "
                                   f"{tuple(t.shape)}")
    return t.to(torch.int64) if not t.is_floating_point() else t.round().to(torch.int64)


def _default_device(device: Any) -> torch.device:
    """CUDA when available, else the CPU; "cuda" is pinned to an index so device comparisons hold."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


# ------------------------------------------------------------------------------------------------
# shared module body
# ------------------------------------------------------------------------------------------------


class _CachedBagBase(nn.Module):
    """Construction, cache plumbing, statistics and state_dict shared by the single and batched forms."""

    def _setup(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int],
        max_norm: Optional[float],
        norm_type: float,
        scale_grad_by_freq: bool,
        sparse: bool,
        weight: Optional[torch.Tensor],
        mode: str,
        include_last_offset: bool,
        dtype: Optional[torch.dtype],
        device: Any,
        cache_ratio: float,
        ids_freq_mapping: Any,
        warmup_ratio: float,
        evict_strategy: Any,
        compress: "bool | str",
        threshold: "float | str",
        chunk_bytes: "int | str",
        refit_threshold: Optional[float],
        fetch: "str | Transfer",
        fused_inference: bool = True,
        validate: str = "lazy",
        stage_bytes: int = STAGE_BYTES,
        compress_cache: "bool | str" = "auto",
        cuda_graphs: bool = True,
        settled_admit_every: int = SETTLED_ADMIT_EVERY,
    ) -> None:
        if validate not in ("eager", "lazy"):
            raise InvalidArgumentError(f"validate must be 'eager' or 'lazy', got {validate!r}")
        if not isinstance(stage_bytes, int) or isinstance(stage_bytes, bool) or stage_bytes < 0:
            raise InvalidArgumentError(f"stage_bytes must be an int >= 0, got {stage_bytes!r}")
        check_admit_every(settled_admit_every)
        if not isinstance(num_embeddings, int) or num_embeddings < 1:
            raise InvalidArgumentError(f"num_embeddings: expected a positive int, got {num_embeddings!r}")
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise InvalidArgumentError(f"embedding_dim: expected a positive int, got {embedding_dim!r}")
        if mode not in _MODES:
            raise InvalidArgumentError(f"mode has to be one of sum, mean or max, got {mode!r}")
        check_fraction(cache_ratio, "cache_ratio")  # a fraction of the rows (Colossal-AI's), >= 1 row; never bytes
        if not 0.0 <= float(warmup_ratio) <= 1.0:
            raise InvalidArgumentError(f"warmup_ratio must be in [0, 1], got {warmup_ratio}")
        if refit_threshold is not None and not 0.0 < float(refit_threshold) <= 1.0:
            raise InvalidArgumentError(f"refit_threshold must be None or in (0, 1], got {refit_threshold}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise InvalidArgumentError(f"padding_idx must be within num_embeddings ({num_embeddings}), got "
                                           f"{padding_idx}")
            padding_idx = padding_idx % num_embeddings
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        self.mode = mode
        self.include_last_offset = include_last_offset
        self.cache_ratio = float(cache_ratio)
        self.evict_strategy = EvictionStrategy.coerce(evict_strategy)
        self.device = _default_device(device)
        self.cache_op = True

        fetch = fetch if fetch == "auto" else Transfer.coerce(fetch, "fetch")
        slots = slot_option(compress_cache)
        if compress not in _COMPRESS:
            raise InvalidArgumentError(f"compress must be one of {_COMPRESS}, got {compress!r}")
        if isinstance(weight, CompressedRows):  # serve the given store's bytes: no second host copy
            check_adoptable_rows(weight, (num_embeddings, embedding_dim), dtype, "_weight")
            store = HostStore.adopt(weight, device=self.device, transfer=fetch)
        else:
            weight = self._initial_weight(weight, dtype).to("cpu")
            # "auto": the planner weighs IBP, exponent coding (float tables) and raw rows by this machine's fetch
            # (and, with compress_cache="auto", how the inference cache holds the chosen rows); True is IBP
            method = compress if isinstance(compress, str) else "ibp"
            store = HostStore(weight, codec=FitOptions(threshold, chunk_bytes, method=method),
                              compress=compress if compress in (True, False, "auto") else True,
                              device=self.device, transfer=fetch, slots=slots)
        del weight
        capacity = max(1, int(num_embeddings * self.cache_ratio))
        self.cache_weight_mgr = CachedRowManager(
            store, capacity, strategy=self.evict_strategy,
            ids_freq_mapping=_as_freq(ids_freq_mapping, num_embeddings), warmup_ratio=float(warmup_ratio),
            pinned_ids=() if padding_idx is None else (padding_idx,), refit_threshold=refit_threshold)
        self.cached_weight = self.cache_weight_mgr.cached_weight
        self._padding_slot = None if padding_idx is None else 0
        self.validate = validate
        self.stage_bytes = int(stage_bytes)
        self.compress_cache = compress_cache
        self.cuda_graphs = bool(cuda_graphs)
        self.settled_admit_every = settled_admit_every
        # an explicitly chosen host-side path is honoured for every read; with "auto" the planner's choice serves
        # cache fills (training, prefetch, refresh) and fused inference lookups read misses zero-copy, sync-free
        self.fused_inference = (bool(fused_inference) and self.device.type == "cuda" and padding_idx is None
                                and (fetch == "auto" or store.transfer is Transfer.ZERO_COPY)
                                and pool_supported(store.dtype, store.row_bytes))

    def _initial_weight(self, weight: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> torch.Tensor:
        """``_weight`` as given, or Colossal-AI's init: uniform(-1/N, 1/N) with a zero padding row."""
        shape = (self.num_embeddings, self.embedding_dim)
        if weight is None:
            w = torch.empty(shape, dtype=dtype or torch.float32)
            w.uniform_(-1.0 / self.num_embeddings, 1.0 / self.num_embeddings)
            if self.padding_idx is not None:
                w[self.padding_idx].fill_(0)
            return w
        if not isinstance(weight, torch.Tensor):
            raise InvalidTypeError(f"_weight: expected a torch.Tensor, got {type(weight).__name__}")
        if tuple(weight.shape) != shape:
            raise InvalidArgumentError("Shape of weight does not match num_embeddings and embedding_dim: expected "
                                       f"{shape}, got {tuple(weight.shape)}")
        if not weight.is_floating_point():
            raise InvalidTypeError(f"_weight: expected a floating-point tensor, got {weight.dtype}")
        return weight.detach()

    # -- the cached lookup ------------------------------------------------------------------------
    def _check_ready(self) -> None:
        self.cache_weight_mgr.store.check_live()  # a replaced shared store: StaleStoreError, never mixed rows
        w = self.cached_weight
        if w.device != self.device or w.dtype != self.cache_weight_mgr.store.dtype:
            raise StateError(f"the cached rows were moved/cast to {w.device}/{w.dtype}; a cached embedding stays on "
                             f"the device and dtype it was built with ({self.device}, "
                             f"{self.cache_weight_mgr.store.dtype}): construct it with device=... instead")

    def _direct(self, slots: torch.Tensor, offsets: Optional[torch.Tensor], psw: Optional[torch.Tensor],
                max_norm: Optional[float]) -> torch.Tensor:
        """Reduce straight over slot indices (inference, SGD-style sparse gradients, ``cache_op=False``)."""
        return F.embedding_bag(slots, self.cached_weight, offsets, max_norm, self.norm_type, self.scale_grad_by_freq,
                               self.mode, self.sparse, psw, self.include_last_offset, self._padding_slot)

    def _prepare(self, shape: tuple, key: Optional[tuple], resolve: Callable[[], tuple[torch.Tensor, list,
                 Callable[[list], None]]]) -> tuple[Prepared, bool]:
        """Make the batch's rows resident; say whether the reduction must use the ranked path.

        ``shape``: the shape of the batch's cache-row ids; ``key``: its inputs (:func:`_input_key`); ``resolve()``
        -> (cache-row ids, checks, verify), called only when no prefetch made this batch resident already (that
        prefetch mapped and checked the same input tensors, so a prefetched step skips those ops).

        Inference reduces straight over slots. Training reduces over each id's rank among the batch's
        distinct ids, on rows gathered by :class:`RowGather`, so gradients are bit-identical to
        ``torch.nn.EmbeddingBag``'s (RowGather says why slots alone would not be). Sparse gradients for SGD
        keep torch's per-occurrence form, which the slot path already reproduces.
        """
        mgr = self.cache_weight_mgr
        w = self.cached_weight
        training = torch.is_grad_enabled() and w.requires_grad
        if (training or self.max_norm is not None) and mgr.store.read_only:
            raise StateError("this embedding table serves adopted CompressedRows (read-only): use it for inference "
                             "(torch.no_grad() or weight.requires_grad_(False)), or build it from the dense table "
                             "to train")
        prep = mgr.take_prepared(key, shape)  # a prefetched batch: its slots, checked then, with no sync now
        if prep is None:
            prep = mgr.prepare_unique(*resolve())
        if training or self.max_norm is not None:
            mgr.prepare_writes()
            mgr.dirty = True
        if self.max_norm is not None:  # renormalise the cached rows themselves, once per distinct id, like torch
            with torch.no_grad():
                torch.embedding_renorm_(w, prep.slot_u, self.max_norm, self.norm_type)
        ranked = training and not (self.sparse and not mgr.coalesce_sparse_grads)
        return prep, ranked

    def _to_device(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        return t.to(self.device, non_blocking=True)

    # -- the fused inference lookup ---------------------------------------------------------------
    def _use_fused(self) -> bool:
        """Inference lookups (no gradient wanted, no max_norm) go through the one-launch pooled lookup."""
        return (self.fused_inference and self.cache_op and self.max_norm is None
                and not (torch.is_grad_enabled() and self.cached_weight.requires_grad) and self._no_training_pending())

    def _no_training_pending(self) -> bool:
        """No training step is half done: no gradient is held and no training forward awaits its backward. The fused
        path holds stored rows in the cached parameter's bytes, which an optimizer step must never see."""
        return self.cached_weight.grad is None and not self._backward_pending

    def check_errors(self) -> None:
        """Wait for queued lookups and raise the bad-id error a lazily validated lookup saw (``validate='lazy'``:
        the kernel checks ids without a host sync; the bad id's bag gets nothing from it)."""
        self.cache_weight_mgr.order.synchronize()
        self._raise_pending()

    def _raise_pending(self) -> None:
        fused = self.cache_weight_mgr.fused
        report = fused.errors.take() if fused is not None else None
        if report is None:
            return
        kind, where = report
        if kind == fused.errors.CORRUPT_ROW:
            raise FormatError("a recent lookup read a stored row that does not decode within its stored length (a "
                              "corrupt host store); it pooled nothing")
        if kind == 2:
            raise EmbeddingBagInputError(f"a recent lookup got offsets that are not non-decreasing from 0 to at most "
                                         f"len(input) (first seen at bag {where}; validate='lazy' reports it after "
                                         "the fact; that bag pooled nothing)")
        table = f" of table {where}" if getattr(self, "num_tables", 1) > 1 else ""
        raise EmbeddingBagIndexError(f"a recent lookup got an id{table} outside its valid range (validate='lazy' "
                                     "reports it after the fact; that id contributed nothing to its bag)")

    def _fused(self, ids: torch.Tensor, offs: Optional[torch.Tensor], bag_size: int, n_bags: int,
               psw: Optional[torch.Tensor], out: torch.Tensor, layout: Any, bad: Optional[torch.Tensor]) -> None:
        """Validate (eagerly: one sync; lazily: none) and run the pooled lookup into ``out``."""
        if psw is not None:
            if self.mode != "sum":
                raise EmbeddingBagInputError("embedding_bag: per_sample_weights was not None. per_sample_weights is "
                                             f"only supported for mode='sum' (got mode='{self.mode}'). Please open a "
                                             "feature request on GitHub.")
            if psw.shape != ids.shape:
                raise EmbeddingBagInputError(f"per_sample_weights: expected shape {tuple(ids.shape)} (like input), "
                                             f"got {tuple(psw.shape)}")
            psw = psw.to(torch.float32).reshape(-1).contiguous()
        if self.validate == "eager":
            checks = _check_tensors(ids, bad, offs)
            if checks:
                _verifier(ids, bad, offs, "[0, num_embeddings of its table)")(torch.stack(checks).tolist())
        else:
            self._raise_pending()
        mgr = self.cache_weight_mgr
        with mgr.order.exclusive():
            fused = mgr.fused_lookup(self.stage_bytes, self.compress_cache, self.cuda_graphs,
                                     self.settled_admit_every)
            fused.pool(ids.reshape(-1), offs, bag_size, n_bags, self.include_last_offset, self.mode, psw, out, layout)

    # -- prefetch -----------------------------------------------------------------------------------
    def prefetch(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None) -> None:
        """Load the rows a coming ``forward(input, offsets)`` will look up into the device cache now, as
        FBGEMM's TBE ``prefetch`` does, so that forward finds them cached: TorchRec's pipeline, where the next batch's
        rows are read while the current step computes.

        Takes ``forward``'s inputs. On CUDA it runs on the cache's side stream, after everything enqueued so far on
        the caller's stream (the previous lookup included) and after the cache's last operation from any thread; the
        caller's later work (the dense part of its step) runs beside it, and the next cache operation waits for it.

        Inference (fused lookups on, and the module in ``eval()`` mode, or under ``torch.no_grad()``, or its rows
        frozen): the rows are admitted on the device with no host sync, and the coming forward counts its ids once;
        rows of batches prefetched but not yet looked up are never evicted. Bad ids are left for that forward to
        report.

        Training: call it after ``optimizer.step()`` and ``optimizer.zero_grad()`` (set_to_none, the default), never
        while a gradient is held or between a forward and its backward: admitting rows may evict rows whose gradients
        that backward would write (FBGEMM locks such rows; this cache does not, and raises instead when it can tell).
        Bad ids raise here, before the cache changes (one host sync). On CUDA it never resizes the cache: rows beyond
        the free and evictable slots are left to the forward (which serves an oversized batch from a grown cache).
        When every row found a slot, the forward of the same ``input`` / ``offsets`` tensors (not written to since, and
        no other cache operation in between) takes their slots from here: no ``unique``, no host sync, so with SGD the
        whole step (forward, backward, optimizer) never waits for the device. That forward then hits every row, so
        ``stats()["hit_rate"]`` says little of a prefetched loop; ``stats()["prefetch_hit_rate"]`` is the share of the
        distinct rows the prefetches looked for that were already resident (the rest came from the host).
        """
        self._check_ready()
        if not self.cache_op:
            raise StateError("prefetch needs cache_op=True (with cache_op=False, forward takes cache slots)")
        _check_bag_shapes(input, offsets)
        ids = input.to(self.device, torch.int64, non_blocking=True)
        offs = None if offsets is None else offsets.to(self.device, torch.int64, non_blocking=True)
        inference = not self.training or not torch.is_grad_enabled() or not self.cached_weight.requires_grad
        if self.fused_inference and self.cache_op and self.max_norm is None and inference \
                and self._no_training_pending():
            flat, offs, bag_size, _, layout = self._fused_inputs(ids.contiguous(), offs)
            fused = self.cache_weight_mgr.fused_lookup(self.stage_bytes, self.compress_cache, self.cuda_graphs,
                                                        self.settled_admit_every)
            fused.prefetch(flat.reshape(-1), offs, bag_size, self.include_last_offset, layout)
            return
        if self._backward_pending:
            raise StateError("prefetch between a training forward and its backward would evict rows the backward "
                             "writes: call it after backward() and optimizer.step()")
        if self.cached_weight.grad is not None:
            raise StateError("prefetch while the cached rows hold a gradient: call optimizer.zero_grad() (which sets "
                             "it to None) after optimizer.step() and before prefetch; admitting rows may evict rows "
                             "that gradient belongs to")
        global_ids, bad, limits = self._global_ids(ids, offs)
        mgr = self.cache_weight_mgr
        if mgr.form != "raw":  # a switch of forms reallocates the cache's state: on the caller's stream, not the side's
            with mgr.order.exclusive():
                mgr.use_raw()
        inputs = [t for t in (ids, offs, global_ids, bad) if t is not None]
        with mgr.on_side_stream(*inputs) as side:
            checks = _check_tensors(global_ids, bad, offs)
            mgr.prepare_unique(global_ids.reshape(-1), checks, _verifier(ids, bad, offs, limits), count=False,
                               grow=not side, remember=_input_key(input, offsets))

    def _fused_inputs(self, ids: torch.Tensor, offs: Optional[torch.Tensor]
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor], int, int, Any]:
        """(ids, offsets, bag size, bag count, layout) of a fused lookup of ``forward``'s input."""
        raise UnsupportedError(f"{type(self).__name__} has no fused lookup: use CachedEmbeddingBag or "
                               "TableBatchedCachedEmbeddingBag")

    @property
    def _backward_pending(self) -> bool:
        """A training forward's output is alive and its gradient has not been computed yet."""
        ref = getattr(self, "_pending_out", None)
        return ref is not None and ref() is not None

    def _watch_backward(self, out: torch.Tensor) -> torch.Tensor:
        """Remember a training output until backward reaches it (see :meth:`prefetch`)."""
        if out.requires_grad:
            self._pending_out = weakref.ref(out)

            def done(grad: torch.Tensor) -> None:
                self._pending_out = None

            out.register_hook(done)
        return out

    def _global_ids(self, ids: torch.Tensor, offs: Optional[torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, str]:
        """Cache-row ids of ``forward``'s input, a bad-id mask over it, and the valid range for messages."""
        raise UnsupportedError(f"{type(self).__name__} does not map input ids to cache rows: use CachedEmbeddingBag or "
                               "TableBatchedCachedEmbeddingBag")

    # -- Colossal-AI API --------------------------------------------------------------------------
    def set_cache_op(self, cache_op: bool = True) -> None:
        """With ``cache_op=False``, ``forward`` takes slot indices produced by ``cache_weight_mgr.prepare_ids``."""
        self.cache_op = bool(cache_op)

    def set_cache_mgr_async_copy(self, flag: bool) -> None:
        """Accepted for compatibility; zero-copy fetches need no separate copy stream."""

    def flush(self) -> None:
        """Write every cached row back to the compressed host table (rows stay cached)."""
        self.cache_weight_mgr.flush()

    def refit(self) -> None:
        """Refit the codec on the current table and re-encode the host store now."""
        self.cache_weight_mgr.refit()

    def attach_optimizer(self, optimizer: "torch.optim.Optimizer") -> None:
        """Keep ``optimizer`` exact against the same optimizer over the full table: per-row state follows its row
        through evictions and evicted rows catch up on missed updates (see the module docstring). Once, before the
        optimizer's first step; any optimizer other than plain SGD needs it."""
        self.cache_weight_mgr.attach_optimizer(optimizer)

    @property
    def weight(self) -> torch.Tensor:
        """The full current table as a new CPU tensor (host rows decoded, cached rows overlaid)."""
        return self.cache_weight_mgr.full_weight()

    @property
    def num_hits_history(self) -> List[int]:
        return self.cache_weight_mgr.num_hits_history

    @property
    def num_miss_history(self) -> List[int]:
        return self.cache_weight_mgr.num_miss_history

    @property
    def num_write_back_history(self) -> List[int]:
        return self.cache_weight_mgr.num_write_back_history

    def stats(self) -> dict:
        """Cache and host-store counters: hits/misses, evictions, write-backs, bytes fetched, compression (and, with a
        node cache in use, its own stats under ``"node"``)."""
        out = {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim, "mode": self.mode}
        out.update(self.cache_weight_mgr.stats())
        node = getattr(self, "_node", None)
        if node is not None:
            out["node"] = node.stats()
        return out

    def extra_repr(self) -> str:
        s = self.cache_weight_mgr.store
        return (f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, cache_rows="
                f"{self.cache_weight_mgr.capacity}, evict_strategy={self.evict_strategy.name}, "
                f"compress={s.compress}, device={self.device}")

    # -- state_dict holds the full table, like torch.nn.EmbeddingBag -------------------------------
    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
        else:
            try:
                self.cache_weight_mgr.load_weight(state_dict[key])
            except ValueError as exc:
                error_msgs.append(f"While copying the parameter named {key!r}: {exc}")
        if strict:
            for k in state_dict:
                if k.startswith(prefix) and k != key and "." not in k[len(prefix):]:
                    unexpected_keys.append(k)


class CachedEmbeddingBag(_CachedBagBase):
    """``torch.nn.EmbeddingBag`` over a table bigger than device memory: cached rows on the device, the
    rest IBP-compressed in host memory. Arguments as Colossal-AI 0.5's ``CachedEmbeddingBag``;
    ``_weight`` may also be a :class:`~ibpcache.CompressedRows` of the table (in-place layout; e.g. one attached from
    shared memory with ``CompressedRows.attach``): the module then serves those bytes with no second host copy,
    for inference only (``HostStore`` adopts them read-only). The
    keyword-only ones: ``compress`` (host table: True (IBP), "ibp", "exponent" (exponent coding, float tables),
    False (raw), or "auto", the default: the planner in ``ibpcache.cache.plan_layout`` times IBP, exponent and raw
    misses and hits on this machine at construction and keeps the fastest; ``stats()['host_layout']`` says which and
    why), ``threshold`` / ``chunk_bytes`` (codec fit,
    "auto" searches), ``refit_threshold`` (refit when the compressed-row share falls below this fraction of
    its value at the last fit; None never refits), ``fetch`` (how cache fills cross PCIe on CUDA: "zero_copy",
    "cpu_gather" (stored bytes gathered on the CPU, one copy, GPU decode), "host_gather" (decoded on the CPU), or "auto", the default: the engine's planner times zero-copy
    against cpu-gather reads of this table at construction and keeps the faster; ``stats()["transfer"]`` says
    which; with "auto" fused inference lookups still read misses zero-copy, with no host sync; an explicitly
    chosen host-side path turns them off),
    ``fused_inference`` (inference forwards on CUDA admit rows on the device and pool in one lookup launch, with no
    host sync, see ``ibpcache.cache.row_cache.FusedLookup``), ``validate``
    ("lazy": ids are checked in the kernel with no host sync and a bad one raises at the next forward or at
    ``check_errors()``; "eager": checked before the lookup, one sync), ``stage_bytes`` (device buffer, sized to the
    step, in which a fused lookup reads each distinct missed row from host memory once per step; the path planner
    keeps it only where it measured faster than zero-copy reads of every miss; 0 turns it off), ``compress_cache``
    (how the inference cache holds compressed host rows: True, as stored, in slots sized to their compressed length,
    so the same device bytes hold about ratio-times more rows, each hit decoded; False, decoded when admitted, one
    row per ``row_bytes`` slot, as many as training holds, hits read at copy speed; "auto", the default: the host
    layout planner's choice, ``stats()['fused_slot_form']`` and its reason),
    ``cuda_graphs`` (a fused inference step of a batch shape seen before replays from a CUDA graph: one launch
    instead of ~40, the host time that bounds small batches; ``ibpcache.cache.step_graphs``),
    ``settled_admit_every`` (once the inference cache is full and its hit rate has settled, one fused lookup in this
    many runs the admission pass, the others read misses without changing the cache: the pass is a third or more of
    a large step's device time; a hit-rate drop puts every step back to admitting; 1: every step admits;
    ``stats()['fused_admission']``; ``ibpcache.cache.admission``).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: "Optional[torch.Tensor | CompressedRows]" = None,
        mode: str = "mean",
        include_last_offset: bool = False,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[str, torch.device]] = None,
        cache_ratio: float = 0.01,
        ids_freq_mapping: Optional[Union[List, torch.Tensor]] = None,
        warmup_ratio: float = 0.7,
        buffer_size: int = 0,
        pin_weight: bool = False,
        evict_strategy: Any = EvictionStrategy.LFU,
        *,
        compress: "bool | str" = "auto",
        threshold: "float | str" = "auto",
        chunk_bytes: "int | str" = "auto",
        refit_threshold: Optional[float] = 0.5,
        fetch: str = "auto",
        fused_inference: bool = True,
        validate: str = "lazy",
        stage_bytes: int = STAGE_BYTES,
        compress_cache: "bool | str" = "auto",
        cuda_graphs: bool = True,
        settled_admit_every: int = SETTLED_ADMIT_EVERY,
    ) -> None:
        super().__init__()
        self.buffer_size = buffer_size
        self.pin_weight = pin_weight
        self._setup(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse,
                    _weight, mode, include_last_offset, dtype, device, cache_ratio, ids_freq_mapping, warmup_ratio,
                    evict_strategy, compress, threshold, chunk_bytes, refit_threshold, fetch, fused_inference,
                    validate, stage_bytes, compress_cache, cuda_graphs, settled_admit_every)

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None,
                shape_hook: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """Same inputs and outputs as ``torch.nn.EmbeddingBag.forward`` (tensors may live on any device)."""
        self._check_ready()
        _check_bag_shapes(input, offsets)
        ids = input.to(self.device, torch.int64, non_blocking=True)
        offs = None if offsets is None else offsets.to(self.device, torch.int64, non_blocking=True)
        psw = self._to_device(per_sample_weights)
        if self._use_fused():
            ids = ids.contiguous()
            ids, offs, bag_size, n_bags, _ = self._fused_inputs(ids, offs)
            out = torch.empty((n_bags, self.embedding_dim), dtype=self.cached_weight.dtype, device=self.device)
            bad = (ids < 0) | (ids >= self.num_embeddings) if self.validate == "eager" else None
            self._fused(ids, offs, bag_size, n_bags, psw, out, None, bad)
            return shape_hook(out) if shape_hook is not None else out
        if not self.cache_op:  # Colossal-AI's split use: ids are slots from cache_weight_mgr.prepare_ids
            verify = _verifier(ids, None, offs, "")
            verify(torch.stack(_check_tensors(ids, None, offs)).tolist() if offs is not None and offs.numel() else [])
            out = self._direct(ids, offs, psw, self.max_norm)
        else:
            def resolve() -> tuple[torch.Tensor, list, Callable[[list], None]]:
                bad = (ids < 0) | (ids >= self.num_embeddings)
                return ids, _check_tensors(ids, bad, offs), _verifier(ids, bad, offs, f"[0, {self.num_embeddings})")

            with self.cache_weight_mgr.order.exclusive():  # after any prefetch; no prefetch evicts mid-reduction
                prep, ranked = self._prepare(tuple(ids.shape), _input_key(input, offsets), resolve)
                if ranked:
                    rows = RowGather.apply(self.cached_weight, prep.slot_u, None)
                    out = F.embedding_bag(prep.inv, rows, offs, None, self.norm_type, self.scale_grad_by_freq,
                                          self.mode, self.sparse, psw, self.include_last_offset, prep.pinned_pos)
                else:
                    out = self._direct(prep.slots(), offs, psw, None)
            self._watch_backward(out)
        if shape_hook is not None:
            out = shape_hook(out)
        return out


    def _fused_inputs(self, ids: torch.Tensor, offs: Optional[torch.Tensor]
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor], int, int, Any]:
        if ids.dim() == 2:  # fixed-size bags
            return ids, None, int(ids.shape[1]), int(ids.shape[0]), None
        offs = offs.contiguous()
        return ids, offs, 0, max(offs.numel() - (1 if self.include_last_offset else 0), 0), None

    def _global_ids(self, ids: torch.Tensor, offs: Optional[torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, str]:
        return ids, (ids < 0) | (ids >= self.num_embeddings), f"[0, {self.num_embeddings})"


class TableBatchedCachedEmbeddingBag(_CachedBagBase):
    """Many embedding tables of one width behind ONE cache and ONE host store, so a DLRM lookup of all
    tables is one fetch (one decode launch), not one per table.

    Table ``t`` owns global rows ``[table_offsets[t], table_offsets[t + 1])``; callers pass table-local ids.
    ``forward`` takes either

    * ``input`` 2-D ``[B, T]`` (one id per sample and table) and no offsets, or
    * ``input`` 1-D with ``offsets`` of ``T * B`` bags (``+ 1`` with ``include_last_offset``) in table-major
      order: bags ``0..B-1`` belong to table 0, and so on (the torchrec / Colossal-AI tablewise layout);

    and returns ``[B, T * embedding_dim]``, bit-identical to ``T`` separate ``torch.nn.EmbeddingBag``
    lookups concatenated along dim 1. ``_weight`` may be one ``[sum(N_t), D]`` tensor or a list of per-table
    tensors; ``ids_freq_mapping`` likewise. ``padding_idx`` is not supported here.
    """

    def __init__(
        self,
        num_embeddings_per_table: Sequence[int],
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: "Optional[Union[torch.Tensor, Sequence[torch.Tensor], CompressedRows]]" = None,
        mode: str = "mean",
        include_last_offset: bool = False,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[str, torch.device]] = None,
        cache_ratio: float = 0.01,
        ids_freq_mapping: Optional[Union[Sequence, torch.Tensor]] = None,
        warmup_ratio: float = 0.7,
        buffer_size: int = 0,
        pin_weight: bool = False,
        evict_strategy: Any = EvictionStrategy.LFU,
        *,
        compress: "bool | str" = "auto",
        threshold: "float | str" = "auto",
        chunk_bytes: "int | str" = "auto",
        refit_threshold: Optional[float] = 0.5,
        fetch: str = "auto",
        fused_inference: bool = True,
        validate: str = "lazy",
        stage_bytes: int = STAGE_BYTES,
        compress_cache: "bool | str" = "auto",
        cuda_graphs: bool = True,
        settled_admit_every: int = SETTLED_ADMIT_EVERY,
    ) -> None:
        super().__init__()
        sizes = [int(n) for n in num_embeddings_per_table]
        if not sizes or any(n < 1 for n in sizes):
            raise InvalidArgumentError("num_embeddings_per_table: expected positive sizes, got "
                                       f"{list(num_embeddings_per_table)}")
        if padding_idx is not None:
            raise UnsupportedError("padding_idx is not supported by TableBatchedCachedEmbeddingBag "
                                   "(use one CachedEmbeddingBag per table that needs it)")
        self.num_embeddings_per_table = sizes
        self.num_tables = len(sizes)
        self.buffer_size = buffer_size
        self.pin_weight = pin_weight
        if isinstance(_weight, (list, tuple)):
            if len(_weight) != len(sizes):
                raise InvalidArgumentError(f"_weight: expected {len(sizes)} tables, got {len(_weight)}")
            _weight = torch.cat([w.detach().cpu() for w in _weight], 0)
        per_table = isinstance(ids_freq_mapping, (list, tuple)) and len(ids_freq_mapping) > 0
        if per_table and not isinstance(ids_freq_mapping[0], (int, float)):
            ids_freq_mapping = torch.cat([torch.as_tensor(f).reshape(-1) for f in ids_freq_mapping])
        self._setup(sum(sizes), embedding_dim, None, max_norm, norm_type, scale_grad_by_freq, sparse, _weight, mode,
                    include_last_offset, dtype, device, cache_ratio, ids_freq_mapping, warmup_ratio, evict_strategy,
                    compress, threshold, chunk_bytes, refit_threshold, fetch, fused_inference, validate, stage_bytes,
                    compress_cache, cuda_graphs, settled_admit_every)
        starts = torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0)
        self.register_buffer("table_offsets", starts.to(self.device), persistent=False)
        self.register_buffer("table_sizes", torch.tensor(sizes, dtype=torch.int64, device=self.device),
                             persistent=False)
        self.register_buffer("table_starts", starts[:-1].contiguous().to(self.device), persistent=False)
        self._node: Any = None  # a node cache serving every lookup (use_node_cache)

    def use_node_cache(self, cache: Any) -> None:
        """Serve every lookup from ``cache``, a node cache (``ibpcache.cache.partitioned.PartitionedFeatureCache``)
        over the same rows (the one shared store), instead of this module's own cache: the GPUs of a node then hold the
        hottest rows each and a share of the warm tail, and a lookup reads peers' rows over NVLink in the same one
        launch. Frozen tables only (the node cache is read-only): a forward that would train raises. The rows are
        gathered by the node cache and pooled by ``F.embedding_bag`` in each bag's order, so the output equals
        ``T`` EmbeddingBags over the decoded tables bit for bit. ``prefetch`` is a no-op then (the node cache is
        static). ``None`` goes back to the module's own cache."""
        if cache is not None:
            if (int(cache.n_rows), int(cache.row_bytes)) != (self.num_embeddings,
                                                              self.embedding_dim * self.cached_weight.element_size()):
                raise InvalidArgumentError(f"node cache: expected {self.num_embeddings} rows of "
                                           f"{self.embedding_dim * self.cached_weight.element_size()} bytes, got "
                                           f"{cache.n_rows} rows of {cache.row_bytes} bytes")
            if self.max_norm is not None:
                raise UnsupportedError("max_norm renormalises rows in place: not with a read-only node cache")
        self._node = cache

    def prefetch(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None) -> None:
        if self._node is not None:
            return  # a node cache is static: nothing to load ahead
        super().prefetch(input, offsets)

    prefetch.__doc__ = _CachedBagBase.prefetch.__doc__

    def _forward_node(self, ids: torch.Tensor, offsets: Optional[torch.Tensor],
                      psw: Optional[torch.Tensor]) -> torch.Tensor:
        """The node cache's rows of every id, pooled per bag: ``[B, T * D]``. A bad table-local id becomes an id past
        the table's end, which the node cache reports (at once on the CPU, from a later call on CUDA)."""
        if self.training and torch.is_grad_enabled() and self.cached_weight.requires_grad:
            raise UnsupportedError("a node cache serves frozen tables: call eval(), torch.no_grad() or "
                                   "requires_grad_(False) first")
        n_tab = self.num_tables
        offs = None if ids.dim() == 2 else offsets.to(self.device, torch.int64, non_blocking=True)
        global_ids, bad, _ = self._global_ids(ids, offs)
        flat = torch.where(bad, torch.full_like(global_ids, self.num_embeddings), global_ids).reshape(-1)
        rows = self._node.fetch(flat)
        pos = torch.arange(flat.numel(), device=rows.device)
        if offs is None:  # [B, T]: B*T bags of one id, sample-major
            batch = ids.shape[0]
            out = F.embedding_bag(pos.view(-1, 1), rows, None, None, self.norm_type, False, self.mode, False,
                                  None if psw is None else psw.reshape(-1, 1), False, None)
            return out.reshape(batch, n_tab * self.embedding_dim)
        batch = (offs.numel() - (1 if self.include_last_offset else 0)) // n_tab
        out = F.embedding_bag(pos, rows, offs, None, self.norm_type, False, self.mode, False, psw,
                              self.include_last_offset, None)
        return out.view(n_tab, batch, self.embedding_dim).transpose(0, 1).reshape(batch, n_tab * self.embedding_dim)

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None,
                shape_hook: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """Look up every table at once; see the class docstring for the layouts."""
        self._check_ready()
        if self._node is not None:
            _check_bag_shapes(input, offsets)
            ids = input.to(self.device, torch.int64, non_blocking=True)
            out = self._forward_node(ids, offsets, self._to_device(per_sample_weights))
            return shape_hook(out) if shape_hook is not None else out
        if not self.cache_op:
            raise UnsupportedError("TableBatchedCachedEmbeddingBag has no cache_op=False mode: pass table-local ids")
        _check_bag_shapes(input, offsets)
        n_tab = self.num_tables
        ids = input.to(self.device, torch.int64, non_blocking=True)
        psw = self._to_device(per_sample_weights)
        if self._use_fused():
            out = self._forward_fused(ids, offsets, psw)
            return shape_hook(out) if shape_hook is not None else out
        offs = None if ids.dim() == 2 else offsets.to(self.device, torch.int64, non_blocking=True)
        batch = ids.shape[0] if offs is None else (offs.numel() - (1 if self.include_last_offset else 0)) // n_tab
        # [B, T] -> B*T bags of one id, in sample-major order
        shape = (ids.numel(), 1) if offs is None else tuple(ids.shape)
        if offs is None and psw is not None:
            psw = psw.reshape(-1, 1)

        def resolve() -> tuple[torch.Tensor, list, Callable[[list], None]]:
            global_ids, bad, limits = self._global_ids(ids, offs)
            return global_ids.reshape(shape), _check_tensors(ids, bad, offs), _verifier(ids, bad, offs, limits)

        with self.cache_weight_mgr.order.exclusive():  # after any prefetch; no prefetch evicts mid-reduction
            prep, ranked = self._prepare(shape, _input_key(input, offsets), resolve)
            if ranked:
                out = self._ranked(prep, offs, psw, batch)
            else:
                out = self._direct(prep.slots(), offs, psw, None)
        if offs is not None:  # [T*B, D] table-major -> [B, T, D]; [B*T, D] sample-major is already in order
            out = out.view(n_tab, batch, self.embedding_dim).transpose(0, 1)
        out = self._watch_backward(out.reshape(batch, n_tab * self.embedding_dim))
        if shape_hook is not None:
            out = shape_hook(out)
        return out

    def _forward_fused(self, ids: torch.Tensor, offsets: Optional[torch.Tensor],
                       psw: Optional[torch.Tensor]) -> torch.Tensor:
        """Inference: all tables in ONE lookup launch, straight into the ``[B, T * D]`` output (no host sync with
        ``validate='lazy'``, the default: CUDA-graph capturable with fixed-size inputs)."""
        n_tab = self.num_tables
        ids, offs, bag_size, n_bags, layout = self._fused_inputs(ids.contiguous(), offsets)
        bad = None
        if self.validate == "eager":
            if offs is None:
                bad = (ids < 0) | (ids >= self.table_sizes.unsqueeze(0))
            else:
                table = self._table_of_positions(ids.numel(), offs, layout.per_table)
                bad = (ids < 0) | (ids >= self.table_sizes[table])
        out = torch.empty((layout.per_table, n_tab * self.embedding_dim), dtype=self.cached_weight.dtype,
                          device=self.device)
        self._fused(ids, offs, bag_size, n_bags, psw, out, layout, bad)
        return out

    def _fused_inputs(self, ids: torch.Tensor, offs: Optional[torch.Tensor]
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor], int, int, Any]:
        """A ``[B, T]`` input: sample-major bags of one id; 1-D with offsets: table-major bags (TorchRec's KJT)."""
        n_tab = self.num_tables
        if ids.dim() == 2:
            if ids.shape[1] != n_tab:
                raise FormatError(f"input: a 2-D input must be [batch, {n_tab} tables], got {tuple(ids.shape)}")
            batch = int(ids.shape[0])
            return ids, None, 1, batch * n_tab, BagLayout(n_tab, batch, True, self.table_starts, self.table_sizes)
        offs = offs.to(self.device, torch.int64, non_blocking=True).contiguous()
        n_bags = offs.numel() - (1 if self.include_last_offset else 0)
        if n_bags < 0 or n_bags % n_tab:
            raise FormatError(f"offsets: expected {n_tab} tables x batch bags"
                              f"{' + 1' if self.include_last_offset else ''}, got {offs.numel()} offsets")
        batch = n_bags // n_tab
        return ids, offs, 0, n_bags, BagLayout(n_tab, batch, False, self.table_starts, self.table_sizes)

    def _ranked(self, prep: Prepared, offs: Optional[torch.Tensor], psw: Optional[torch.Tensor],
                batch: int) -> torch.Tensor:
        """Training: reduce over each id's rank among the batch's distinct ids (:class:`RowGather` says why), as
        ``T`` separate EmbeddingBags would. Returns ``[B*T, D]`` sample-major (a ``[B, T]`` input) or ``[T*B, D]``
        table-major (offsets), like :meth:`_direct`.

        The tables' rank ranges are disjoint and each bag belongs to one table, so ONE reduction over all tables gives
        every bag, and every row's gradient contributions in the order, that ``T`` reductions give, wherever the
        sorts that order duplicates are stable: CUDA's are. Torch's CPU sort is not (below ~100k indices it is
        introsort, whose order of equal ids depends on every other id in the array), so on the CPU a dense gradient
        is reduced table by table, and a sparse one is coalesced table by table (``segments``)."""
        cpu = self.device.type == "cpu"
        segments = None
        if cpu and self.num_tables > 1:  # each table's range in uniq (a host read: free on the CPU)
            segments = tuple(torch.searchsorted(prep.uniq, self.table_offsets).tolist())
        rows = RowGather.apply(self.cached_weight, prep.slot_u, segments)
        if not (cpu and not self.sparse and self.num_tables > 1):
            return F.embedding_bag(prep.inv, rows, offs, None, self.norm_type, self.scale_grad_by_freq, self.mode,
                                   self.sparse, psw, self.include_last_offset, None)
        return self._per_table(prep, rows, offs, psw, batch)

    def _per_table(self, prep: Prepared, rows: torch.Tensor, offs: Optional[torch.Tensor],
                   psw: Optional[torch.Tensor], batch: int) -> torch.Tensor:
        """:meth:`_ranked`'s reduction one table at a time (the CPU's dense gradients), in its output layout."""
        n_tab = self.num_tables
        outs = []
        if offs is None:  # [B*T, 1] sample-major: table t is every T-th bag
            inv = prep.inv.view(batch, n_tab)
            w = None if psw is None else psw.view(batch, n_tab)
            for t in range(n_tab):
                outs.append(F.embedding_bag(inv[:, t:t + 1], rows, None, None, self.norm_type,
                                            self.scale_grad_by_freq, self.mode, self.sparse,
                                            None if w is None else w[:, t:t + 1], False, None))
            return torch.stack(outs, 1).reshape(batch * n_tab, self.embedding_dim)
        n_ids = prep.inv.numel()
        starts = offs[: n_tab * batch: batch].tolist() if batch else [0] * n_tab
        ends = starts[1:] + [int(offs[-1]) if self.include_last_offset else n_ids]
        for t in range(n_tab):
            lo, hi = starts[t], ends[t]
            outs.append(F.embedding_bag(prep.inv[lo:hi], rows, offs[t * batch:(t + 1) * batch] - lo, None,
                                        self.norm_type, self.scale_grad_by_freq, self.mode, self.sparse,
                                        None if psw is None else psw[lo:hi], False, None))
        return torch.cat(outs, 0)

    def _global_ids(self, ids: torch.Tensor, offs: Optional[torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, str]:
        """Table-local ids -> rows of the one cache: ``[B, T]`` input, or 1-D with T x batch bags of offsets."""
        n_tab = self.num_tables
        if offs is None:
            if ids.dim() != 2 or ids.shape[1] != n_tab:
                raise FormatError(f"input: a 2-D input must be [batch, {n_tab} tables], got {tuple(ids.shape)}")
            table = torch.arange(n_tab, device=self.device).expand_as(ids)
        else:
            n_bags = offs.numel() - (1 if self.include_last_offset else 0)
            if n_bags < 0 or n_bags % n_tab:
                raise FormatError(f"offsets: expected {n_tab} tables x batch bags"
                                  f"{' + 1' if self.include_last_offset else ''}, got {offs.numel()} offsets")
            table = self._table_of_positions(ids.numel(), offs, n_bags // n_tab)
        bad = (ids < 0) | (ids >= self.table_sizes[table])
        return ids + self.table_offsets[table], bad, "[0, num_embeddings of its table)"

    def _table_of_positions(self, n_ids: int, offs: torch.Tensor, batch: int) -> torch.Tensor:
        """Table index of every id position: table t starts at ``offs[t * batch]`` (no host sync)."""
        if n_ids == 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        if batch == 0 or self.num_tables == 1:
            return torch.zeros(n_ids, dtype=torch.int64, device=self.device)
        starts = offs[batch: self.num_tables * batch: batch].contiguous()  # where tables 1..T-1 begin
        pos = torch.arange(n_ids, device=self.device)
        return torch.searchsorted(starts, pos, right=True)

    def table_weight(self, table: int) -> torch.Tensor:
        """The current rows of one table as a CPU tensor."""
        lo, hi = self.table_offsets[table].item(), self.table_offsets[table + 1].item()
        return self.weight[lo:hi]


class RowGather(torch.autograd.Function):
    """``weight[slot_u]`` whose backward hands the cache parameter the gradient the reference would get.

    Why: torch's CPU ``embedding_bag`` backward sorts indices with an unstable sort, so the order in which a
    row's duplicate contributions are summed depends on the index *values*. Reducing over each id's rank
    among the batch's distinct ids (a monotone relabeling of the ids) reproduces the reference's order
    exactly; slot numbers cannot. Dense gradients are copied into their slots (each slot once, no
    arithmetic). A sparse gradient is coalesced in rank space (the order ``Tensor.coalesce`` on the ids
    would use), then relabeled to slots and marked coalesced: what Adagrad/SparseAdam compute with. With
    ``segments`` (the CPU's table batches) one range at a time, one per table, as each table's optimizer would
    (the CPU's unstable sort orders a table's duplicates by all the ids it sorts); without, in one call (CUDA's
    sort is stable, so the tables' duplicates keep their order whatever else is sorted with them).
    """

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, slot_u: torch.Tensor,
                segments: Optional[Sequence[int]] = None) -> torch.Tensor:
        ctx.save_for_backward(slot_u)
        ctx.weight = weakref.ref(weight)  # the parameter, for mark_coalesced (a reference would keep it alive)
        ctx.weight_shape = tuple(weight.shape)
        ctx.segments = segments
        return weight.index_select(0, slot_u)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (slot_u,) = ctx.saved_tensors
        shape = ctx.weight_shape
        if not grad.is_sparse:
            out = grad.new_zeros(shape)
            out.index_copy_(0, slot_u, grad)
            return out, None, None
        if ctx.segments is None:  # one coalesce: every table's duplicates summed in their order (a stable sort)
            part = grad.coalesce()
            idx, vals = part.indices()[0], part.values()
        else:
            idx, vals = _coalesce_segments(grad, ctx.segments)
        rows = slot_u.index_select(0, idx)
        order = torch.argsort(rows)
        out = torch.sparse_coo_tensor(rows[order].unsqueeze(0), vals.index_select(0, order), shape, is_coalesced=True)
        weight = ctx.weight()
        if weight is not None:
            mark_coalesced(weight, out)
        return out, None, None


def _coalesce_segments(grad: torch.Tensor, bounds: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse rank-space gradient coalesced one ``[bounds[i], bounds[i + 1])`` range at a time, as each table's own
    ``Tensor.coalesce`` would (the CPU's sort orders a range's duplicates by the range's ids alone); indices and values
    of the ranges, concatenated in ascending order."""
    idx, vals = grad._indices()[0], grad._values()
    parts_i, parts_v = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        keep = (idx >= lo) & (idx < hi)  # keeps each table's occurrences in their order
        part = torch.sparse_coo_tensor(idx[keep].unsqueeze(0), vals[keep], grad.shape).coalesce()
        parts_i.append(part.indices()[0])
        parts_v.append(part.values())
    return torch.cat(parts_i), torch.cat(parts_v)
