"""The engine's trainable row cache: raw rows on the compute device in front of a :class:`HostStore`.

Where :class:`~ibpcache.cache.feature_cache.FeatureCache` is a read cache (a batch's surplus misses are served from
the host store and may stay uncached), this cache makes EVERY row of a batch resident, because the rows are what an
optimizer updates (Colossal-AI's ``CachedParamMgr`` role; the embedding bags in ``ibpcache.loaders.embedding_bag``
are thin adapters over it):

* :class:`CachedRowManager` owns ``C`` rows kept RAW on the compute device as one ``nn.Parameter``, an id -> slot
  map, and the engine's slot policy (``policy.py``: the slot -> id map and a per-slot eviction score, for
  :class:`~ibpcache.cache.policy.EvictionStrategy` LFU / LRU / DATASET). ``prepare_ids`` turns ids into slot
  indices, reading misses through the host store's transfer path and writing evicted rows back re-compressed
  (:meth:`HostStore.write_rows`, the engine's write-back).
* an attached optimizer (:meth:`CachedRowManager.attach_optimizer`, ``row_optimizer.py``) keeps its per-row state
  with the rows and replays the updates an evicted row missed when it returns, so training equals the same optimizer
  over the full table;
* :class:`FusedLookup` serves inference lookups over the same cache and host store in ONE kernel launch
  (``kernels/lookup.cu``), with no host sync.

A batch with more distinct ids than cache rows is served by growing the parameter for that one batch (so the rows
stay trainable: the optimizer step that follows updates them too) and shrinking it back at the start of the next
batch; Colossal-AI refuses such batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ..codec import Codec
from ..compressed import CompressedRows
from ..errors import (InvalidArgumentError, InvalidTypeError, OptimizerStateError, RowDtypeError,
                      RowShapeError)
from ..format import Layout
from ..kernels.hashmap import IndexArgs
from ..kernels.lookup import (SLOTS_INDEX, BagLayout, ElemType, LookupErrors, PoolOp, RowSource, Staging, lookup_pool,
                              pool_supported)
from .host_store import HostStore
from .ordering import StreamOrder
from .plan_path import PathPlanner
from .policy import EvictionStrategy, SlotPolicy, row_policy
from .row_optimizer import RowOptimizer, watch_unattached

__all__ = ["CachedRowManager", "Prepared", "FusedLookup", "BagLayout", "pool_supported", "check_adoptable_rows"]

_MIN = torch.iinfo(torch.int64).min
_REFIT_CHECK_EVERY = 64
"""Write-back batches between two checks of the host store's compressed fraction (each check syncs)."""


def check_adoptable_rows(rows: CompressedRows, shape: tuple[int, int], dtype: Optional[torch.dtype],
                         name: str = "rows") -> None:
    """Can the row cache serve ``rows`` as its host store (``HostStore.adopt``)? Their shape must be the table's, their
    dtype ``dtype`` if given, and their layout in place: the lookups read row i at ``i * row_bytes``. ``name`` is the
    adapter's argument, for the message."""
    if rows.layout is not Layout.INPLACE:
        raise InvalidArgumentError(f"{name}: the embedding bags read rows at i * row_bytes; compress them with "
                                   f"layout='inplace' (got {rows.layout.value!r})")
    if tuple(rows.shape) != tuple(shape):
        raise RowShapeError(f"{name}: CompressedRows of shape {tuple(rows.shape)} do not match num_embeddings and "
                            f"embedding_dim {tuple(shape)}")
    if dtype is not None and rows.dtype != dtype:
        raise RowDtypeError(f"{name}: CompressedRows hold {rows.dtype}, but dtype={dtype} was asked for")


@dataclass
class Prepared:
    """Where a batch's rows are. ``uniq``: its distinct ids, ascending; ``slot_u``: their cache slots;
    ``inv``: each id's index into ``uniq`` (shaped like the ids: a monotone relabeling of them);
    ``pinned_pos``: the index of the padding row in ``uniq``, or None when the batch does not use it."""

    slot_u: torch.Tensor
    inv: torch.Tensor
    uniq: torch.Tensor
    pinned_pos: Optional[int]

    def slots(self) -> torch.Tensor:
        """The slot of every id, shaped like the ids."""
        return self.slot_u.index_select(0, self.inv.reshape(-1)).view(self.inv.shape)


class CachedRowManager:
    """The trainable row cache in front of a :class:`HostStore` (Colossal-AI's ``CachedParamMgr`` role).

    Slots ``[0, P)`` are pinned (the padding row, never evicted); ``[P, P + C)`` are the cache proper;
    during an oversized batch the parameter grows past ``P + C`` until the next call. ``slot_of`` (int32,
    ``[N]``, -1 = not cached) and ``id_of`` (int64, per slot, -1 = free: the policy's slot table) live on the cache
    device. Which rows leave is the policy's call (:func:`~ibpcache.cache.policy.row_policy`), the same slot policies
    FeatureCache uses, under the row cache's contract: every missed row enters.
    """

    def __init__(
        self,
        store: HostStore,
        capacity: int,
        *,
        strategy: EvictionStrategy,
        ids_freq_mapping: "torch.Tensor | None",
        warmup_ratio: float,
        pinned_ids: Sequence[int] = (),
        refit_threshold: "float | None" = None,
    ) -> None:
        self.store = store
        self.device = store.device
        self.num_embeddings = store.n_rows
        self.embedding_dim = store.dim
        self.strategy = strategy
        self.pinned_ids = [int(i) for i in pinned_ids]
        self.n_pinned = len(self.pinned_ids)
        self.capacity = int(capacity)
        self.cuda_row_num = self.capacity  # Colossal-AI's name for the cache size in rows
        self.base_slots = self.n_pinned + self.capacity
        self.refit_threshold = refit_threshold
        dev = self.device
        self.cached_weight = torch.nn.Parameter(
            torch.zeros((self.base_slots, self.embedding_dim), dtype=store.dtype, device=dev))
        self.slot_of = torch.full((self.num_embeddings,), -1, dtype=torch.int32, device=dev)
        self.n_free = self.capacity
        self.freq = None if ids_freq_mapping is None else ids_freq_mapping.to(dev, torch.int64)
        self.policy: SlotPolicy = row_policy(strategy, self.base_slots, self.num_embeddings, dev,
                                             n_pinned=self.n_pinned, priority=self.freq)
        self.dirty = False
        self._clean_version = self.cached_weight._version
        self.step = 0
        self.num_hits_history: list[int] = []
        self.num_miss_history: list[int] = []
        self.num_write_back_history: list[int] = []
        self.lookups = 0
        self.overflow_batches = 0
        self.overflow_rows_max = 0
        self.evictions = 0
        self.refit_steps: list[int] = []
        self._writebacks_since_check = 0
        self.optim: Optional[RowOptimizer] = None  # the attached optimizer (attach_optimizer)
        self.coalesce_sparse_grads = False
        self.prefetched_rows = 0  # rows admitted by prefetch (not counted as lookups)
        self.prefetch_write_backs = 0
        self.order = StreamOrder(self.device)  # one forward at a time, from any thread or CUDA stream
        self.fused: "FusedLookup | None" = None
        if self.n_pinned:
            self._place(torch.tensor(list(pinned_ids), dtype=torch.int64, device=dev),
                        torch.arange(self.n_pinned, dtype=torch.int64, device=dev))
        self._warmup(warmup_ratio)
        watch_unattached(self)

    def fused_lookup(self, refresh_every: int, stage_bytes: int = 0) -> "FusedLookup":
        """The fused inference lookup over this cache and its host store (built on first use)."""
        if self.fused is None:
            self.fused = FusedLookup(self, refresh_every, stage_bytes)
        return self.fused

    # -- setup ------------------------------------------------------------------------------------
    @property
    def id_of(self) -> torch.Tensor:
        """int64 per slot: the id it holds, -1 = free (the policy's slot table)."""
        return self.policy.slot_ids

    def _place(self, ids: torch.Tensor, slots: torch.Tensor, scores: Optional[torch.Tensor] = None) -> None:
        """Load rows ``ids`` into ``slots`` (free, or emptied by eviction) and admit them to the policy."""
        self.store.read_into(ids, self._weight_u8(), slots)
        self.slot_of.index_put_((ids,), slots.to(torch.int32))
        self.policy.admit(slots, ids, scores)

    def _warmup(self, warmup_ratio: float) -> None:
        """Preload ``ceil(C * warmup_ratio)`` rows: the most frequent ones when frequencies are known,
        else ids ``0..k-1`` (Colossal-AI's behaviour)."""
        k = min(int(math.ceil(self.capacity * warmup_ratio)), self.num_embeddings - self.n_pinned, self.capacity)
        if k <= 0:
            return
        exclude = self.slot_of >= 0
        if self.freq is not None:
            prio = torch.where(exclude, _MIN, self.freq)
            ids = torch.topk(prio, k).indices
        else:
            ids = torch.nonzero(~exclude).squeeze(1)[:k]
        slots = torch.arange(self.n_pinned, self.n_pinned + k, dtype=torch.int64, device=self.device)
        # LFU counts uses; rows preloaded by dataset frequency start with that frequency as their count
        seeded = self.strategy is EvictionStrategy.LFU and self.freq is not None
        self._place(ids, slots, self.freq[ids] if seeded else None)
        self.n_free -= k

    def _weight_u8(self) -> torch.Tensor:
        w = self.cached_weight.data
        return w.view(torch.uint8).view(w.shape[0], self.store.row_bytes)

    def is_dirty(self) -> bool:
        """May cached rows differ from their host copies? Set by training forwards, and by any in-place
        update of the parameter (optimizer steps bump its version counter), e.g. after a flush."""
        return self.dirty or self.cached_weight._version != self._clean_version

    def mark_clean(self) -> None:
        self.dirty = False
        self._clean_version = self.cached_weight._version

    @property
    def weight(self) -> torch.Tensor:
        """Colossal-AI's ``CachedParamMgr.weight`` (its CPU table); here the current full table, decoded."""
        return self.full_weight()

    @property
    def cuda_cached_weight(self) -> torch.nn.Parameter:
        """Colossal-AI's name for the cached rows (the trainable parameter)."""
        return self.cached_weight

    @property
    def slots(self) -> int:
        return int(self.cached_weight.shape[0])

    # -- the per-batch path -----------------------------------------------------------------------
    @torch.no_grad()
    def prepare_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Make every row in ``ids`` (int64, valid, on the cache device) resident; return slot indices
        (Colossal-AI's ``prepare_ids``)."""
        return self.prepare_unique(ids).slots()

    @torch.no_grad()
    def prepare_unique(self, ids: torch.Tensor, checks: Sequence[torch.Tensor] = (),
                       verify: Optional[Callable[[list], None]] = None, count: bool = True) -> "Prepared":
        """Make the rows of ``ids`` (int64 on the cache device) resident and say where they are.

        ``checks`` (0-d int64 tensors, e.g. "some id is out of range") ride along with the one device sync
        this needs anyway; ``verify(values)`` runs on their values before the cache changes and may raise.
        Ids are only trusted after ``verify`` passed. Cost: one ``unique``, one sync, then (if anything
        misses) one top-k for the victims, one write-back encode (training only) and one decode launch.
        ``count=False`` (a prefetch): the rows are admitted and touched, but the lookup and its hits/misses are
        not counted as one (``prefetched_rows`` counts the admissions).
        """
        self._shrink()
        flat = ids.reshape(-1)
        if flat.numel() == 0:
            if checks and verify is not None:
                verify(torch.stack(list(checks)).tolist())
            if count:
                self._tick()
                self._record(0, 0, 0)
            return Prepared(flat.clone(), flat.clone().view(ids.shape), flat.clone(), None)
        uniq, inv, counts = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
        safe = uniq.clamp(0, self.num_embeddings - 1)  # ids are verified below, before anything changes
        slot_u = self.slot_of.index_select(0, safe).to(torch.int64)
        hit = slot_u >= 0
        probes = [(~hit).sum(), (hit & (slot_u < self.n_pinned)).sum()]
        if self.n_pinned:
            first = self.pinned_ids[0]
            probes += [(uniq == first).any().to(torch.int64), (uniq < first).sum()]
        n_probes = len(probes)
        vals = torch.stack(probes + [c.to(torch.int64) for c in checks]).tolist()
        if verify is not None and checks:
            verify(vals[n_probes:])
        if count:
            self._tick()
            self.lookups += int(flat.numel())
        n_miss, n_pinned_hits = vals[0], vals[1]
        pinned_pos = vals[3] if self.n_pinned and vals[2] else None
        n_uniq = int(uniq.numel())
        written = 0
        if n_miss:
            miss_pos = torch.nonzero(~hit).squeeze(1)
            miss_ids = uniq.index_select(0, miss_pos)
            dest, written = self._admit(miss_ids, slot_u, n_miss, n_uniq - n_miss - n_pinned_hits)
            slot_u.index_copy_(0, miss_pos, dest)
        self.policy.touch(slot_u, counts)
        if count:
            self._record(n_uniq - n_miss, n_miss, written)
        else:
            self.prefetched_rows += int(n_miss)
            self.prefetch_write_backs += int(written)
        return Prepared(slot_u, inv.view(ids.shape), uniq, pinned_pos)

    def _tick(self) -> None:
        """One more counted lookup: a step of the cache and of its policy's clock (prefetches are not steps)."""
        self.step += 1
        self.policy.tick()

    def _record(self, hits: int, misses: int, written: int) -> None:
        self.num_hits_history.append(hits)
        self.num_miss_history.append(misses)
        self.num_write_back_history.append(written)

    def _admit(self, miss_ids: torch.Tensor, slot_u: torch.Tensor, n_miss: int,
               n_hit_unpinned: int) -> tuple[torch.Tensor, int]:
        """Choose slots for the misses (free ones first, then victims not used by this batch), write the
        victims back if rows may have changed, and decode the misses into their slots."""
        avail = (self.slots - self.n_pinned) - n_hit_unpinned  # free + evictable
        if n_miss > avail:
            self._grow(n_miss - avail)
        n_from_free = min(n_miss, self.n_free)
        chosen = self.policy.make_room(n_miss, slot_u)  # free slots first, never this batch's hits
        victims = chosen[n_from_free:]
        written = 0
        victim_ids = None
        if victims.numel():
            victim_ids = self.id_of.index_select(0, victims)
            if self.is_dirty():
                self.store.write_rows(victim_ids, self._weight_u8().index_select(0, victims))
                written = int(victims.numel())
                self._maybe_refit()
            self.slot_of.index_fill_(0, victim_ids, -1)
            self.evictions += int(victims.numel())
        if self.optim is not None and victim_ids is not None:
            self.optim.save(victims, victim_ids)
        self._place(miss_ids, chosen)
        if self.optim is not None:
            self.optim.restore(self.cached_weight.data, chosen, miss_ids)
        self.n_free -= n_from_free
        return chosen, written

    # -- oversized batches ------------------------------------------------------------------------
    def _grow(self, extra: int) -> None:
        """Add ``extra`` free slots for this batch only (the parameter object stays the same)."""
        old = self.slots
        _set_rows(self.cached_weight, _grow_rows(self.cached_weight.data, extra))
        grad = self.cached_weight.grad
        if grad is not None:
            self.cached_weight.grad = _grow_grad(grad, old + extra)
        self.policy.resize(old + extra)
        self.n_free += extra
        if self.optim is not None:
            self.optim.resize(old + extra)
        self.overflow_batches += 1
        self.overflow_rows_max = max(self.overflow_rows_max, old + extra - self.base_slots)

    def _shrink(self) -> None:
        """Return to ``P + C`` slots after an oversized batch: rows above the base are evicted."""
        if self.slots == self.base_slots:
            return
        high = torch.arange(self.base_slots, self.slots, device=self.device)
        occupied = high[self.id_of[self.base_slots:] >= 0]
        if occupied.numel():
            ids = self.id_of.index_select(0, occupied)
            if self.is_dirty():
                self.store.write_rows(ids, self._weight_u8().index_select(0, occupied))
            if self.optim is not None:
                self.optim.save(occupied, ids)
            self.slot_of.index_fill_(0, ids, -1)
            self.evictions += int(occupied.numel())
        self.n_free -= (self.slots - self.base_slots) - int(occupied.numel())
        keep = self.base_slots
        _set_rows(self.cached_weight, self.cached_weight.data[:keep].clone())
        grad = self.cached_weight.grad
        if grad is not None:
            self.cached_weight.grad = _shrink_grad(grad, keep)
        self.policy.resize(keep)
        if self.optim is not None:
            self.optim.resize(keep)

    # -- write back / whole table -----------------------------------------------------------------
    def occupied_slots(self) -> torch.Tensor:
        return torch.nonzero(self.id_of >= 0).squeeze(1)

    @torch.no_grad()
    def flush(self) -> None:
        """Write every cached row back to the host store (re-compressed), after bringing evicted rows up to date
        with an attached optimizer's updates. Rows stay cached, now clean."""
        self._shrink()
        self.catch_up()
        if self.is_dirty():
            slots = self.occupied_slots()
            self.store.write_rows(self.id_of.index_select(0, slots), self._weight_u8().index_select(0, slots))
            self.mark_clean()
        self.store.sync_host()
        self._maybe_refit(force_check=True)

    @torch.no_grad()
    def full_weight(self) -> torch.Tensor:
        """The current table (host rows with the cached, possibly newer, rows overlaid) as a CPU tensor."""
        self.catch_up()
        table = self.store.dense()
        slots = self.occupied_slots()
        if slots.numel():
            table.index_copy_(0, self.id_of.index_select(0, slots).cpu(),
                              self.cached_weight.data.index_select(0, slots).cpu())
        return table

    @torch.no_grad()
    def load_weight(self, table: torch.Tensor) -> None:
        """Replace the whole table (e.g. ``load_state_dict``): re-encode it and reload the cached rows."""
        if tuple(table.shape) != (self.num_embeddings, self.embedding_dim):
            raise InvalidArgumentError(f"weight: expected shape {(self.num_embeddings, self.embedding_dim)}, "
                                       f"got {tuple(table.shape)}")
        self._shrink()
        self.catch_up()  # optimizer state current as of now: the new rows continue from it
        self.store.refit(table.to(self.store.dtype))
        self.store.refits -= 1  # a reload is not a refit
        slots = self.occupied_slots()
        if slots.numel():
            self.store.read_into(self.id_of.index_select(0, slots), self._weight_u8(), slots)
        self.mark_clean()

    def _maybe_refit(self, force_check: bool = False) -> None:
        """Refit mask/bitval when the share of compressed rows fell below ``refit_threshold`` times its
        value at the last fit (rows drift away from the learned invariant bits while training)."""
        if self.refit_threshold is None or not self.store.compress:
            return
        self._writebacks_since_check += 1
        if not force_check and self._writebacks_since_check < _REFIT_CHECK_EVERY:
            return
        self._writebacks_since_check = 0
        if self.store.compressed_fraction() < self.refit_threshold * self.store.compressed_fraction_at_fit:
            self.refit()

    @torch.no_grad()
    def refit(self) -> None:
        """Fit a new codec on the current table and re-encode the host store (cached rows stay valid)."""
        self.store.refit(self.full_weight())
        self.refit_steps.append(self.step)

    # -- optimizer state that follows its rows ----------------------------------------------------
    def attach_optimizer(self, optimizer: "torch.optim.Optimizer") -> None:
        """Make ``optimizer`` (over :attr:`cached_weight`) exact against the same optimizer over the full table: its
        per-row state follows its row in and out of the cache, and rows catch up on the updates they missed while
        evicted (``row_optimizer.py``). Call it once, before the optimizer's first step."""
        if self.optim is not None:
            if self.optim.optimizer is optimizer:
                return
            raise OptimizerStateError("attach_optimizer: another optimizer is attached to these cached rows; one "
                                      "optimizer owns their per-row state")
        self.optim = RowOptimizer(optimizer, self)
        # SGD adds a sparse gradient occurrence by occurrence; Adagrad/SparseAdam coalesce it first. To stay
        # bit-exact the cache hands each the structure the reference would see (see RowGather).
        self.coalesce_sparse_grads = not isinstance(optimizer, torch.optim.SGD)

    @torch.no_grad()
    def catch_up(self) -> int:
        """Bring every evicted row's host copy up to date with the attached optimizer's updates (``flush``,
        ``weight`` and ``load_weight`` do this first). Returns the rows replayed."""
        return 0 if self.optim is None else self.optim.catch_up_host(self)

    # -- statistics -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        hits = int(sum(self.num_hits_history))
        misses = int(sum(self.num_miss_history))
        out = {
            "steps": self.step,
            "lookups": self.lookups,
            "unique_ids": hits + misses,
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / max(hits + misses, 1),
            "evictions": self.evictions,
            "write_backs": int(sum(self.num_write_back_history)) + self.prefetch_write_backs,
            "prefetched_rows": self.prefetched_rows,
            "cache_rows": self.capacity,
            "pinned_rows": self.n_pinned,
            "cached_rows": int((self.id_of >= 0).sum()),
            "overflow_batches": self.overflow_batches,
            "overflow_rows_max": self.overflow_rows_max,
            "refit_steps": list(self.refit_steps),
            "eviction_strategy": self.strategy.name,
            "device": str(self.device),
        }
        out.update(self.store.stats())
        if self.fused is not None:
            out.update(self.fused.stats())
        return out

    def print_comm_stats(self) -> None:
        """Colossal-AI-compatible summary on stdout."""
        for k, v in self.stats().items():
            print(f"{k}: {v}")


class FusedLookup:
    """Inference lookups of a :class:`CachedRowManager` in ONE kernel launch (``kernels/lookup.cu``).

    The kernel reads a bag's rows from the manager's cache (raw rows of ``cached_weight``, found through the
    ``slot_of`` table) or, on a miss, zero-copy from the compressed host store, decodes and pools them straight into
    the output. Nothing is admitted on the lookup path and nothing syncs the host: ids are checked in the kernel
    (reported lazily through pinned host words), hits / host bytes are device counters, and every id's lookup is
    counted per row (``freq``). The cache follows the traffic by a refresh on a schedule (after 16, 32, 64, ...
    lookups, then every ``refresh_every``): the most requested rows are made resident through the manager's own
    admission path (one sync then), and the counts are halved (aging, so the cache follows drift). Requires rows
    of the pooling kernel's size (``lookup.pool_supported``).

    With ``stage_bytes`` > 0 a lookup of multi-id bags may be three launches instead of one: the step's distinct
    missed rows are claimed, read from host memory once each and decoded into a staging buffer of that many bytes in
    device memory, and the pooling reads them from there (rows beyond the buffer are still read zero-copy); the
    :class:`PathPlanner` times both ways per size class and keeps the faster. Duplicate misses within a step (many
    at large batches and bags) then cost no PCIe traffic; still no host sync. It costs 8 bytes per table row of
    device memory (the per-step claim tags), which is why it is opt-in.
    """

    def __init__(self, mgr: "CachedRowManager", refresh_every: int, stage_bytes: int = 0) -> None:
        self.mgr = mgr
        dev = mgr.device
        self.refresh_every = int(refresh_every)
        self.errors = LookupErrors(pin=dev.type == "cuda")  # the kernel writes it through UVA
        self.counters = torch.zeros(4, dtype=torch.int64, device=dev)
        self.freq = torch.zeros(mgr.num_embeddings, dtype=torch.int32, device=dev)
        self.slab_bases = torch.zeros(8, dtype=torch.int64, device=dev)
        self._empty = torch.empty(0, dtype=torch.int64, device=dev)
        self._weight_ptr = -1
        self._codec: "Codec | None" = None
        self._tables: Any = None
        self._src: Any = None  # built once per host buffer + codec (a refit replaces bytes, lengths and codec)
        self._src_key: tuple[int, int] = (0, 0)
        self.calls = 0
        self.refreshes = 0
        self._next_refresh = 16
        self.planner = PathPlanner()
        self.staging = None
        if stage_bytes > 0:
            self.staging = Staging.allocate(mgr.num_embeddings, mgr.store.row_bytes, int(stage_bytes), dev)

    def _source(self) -> Any:
        mgr, store = self.mgr, self.mgr.store
        ptr = mgr.cached_weight.data_ptr()
        if ptr != self._weight_ptr:  # the cache grew/shrank for an oversized batch: a new slab address
            self.slab_bases[0] = ptr
            self._weight_ptr = ptr
        key = (store.data.data_ptr(), id(store.lengths_dev))
        if store.codec is not self._codec or self._src is None or key != self._src_key:  # a refit replaces them
            self._codec = store.codec
            self._src_key = key
            self._tables = store.codec.kernel_tables(mgr.device)
            index = IndexArgs(SLOTS_INDEX, self._empty, mgr.slot_of, 0, 0)
            lengths = store.lengths_dev if store.compress else None
            self._src = RowSource(index, self.slab_bases, store.data.data_ptr(), None, store.row_bytes, lengths,
                                  mgr.num_embeddings)
        return self._src

    def pool(self, ids: torch.Tensor, offsets: Optional[torch.Tensor], bag_size: int, n_bags: int,
             include_last: bool, mode: str, psw: Optional[torch.Tensor], out: torch.Tensor, layout: Any) -> None:
        """Pool bags of ``ids`` into ``out`` (see ``kernels.lookup.lookup_pool``); then maybe refresh the cache."""
        mgr = self.mgr
        op = {"sum": PoolOp.SUM, "mean": PoolOp.MEAN, "max": PoolOp.MAX}[mode]
        elem = ElemType.of(mgr.store.dtype)
        out_u8 = out.view(torch.uint8).reshape(-1, mgr.store.row_bytes)
        kind = "single" if bag_size == 1 and offsets is None else "multi"
        capturing = torch.cuda.is_current_stream_capturing()
        planned = n_bags > 1 and (kind == "single" or self.staging is not None)
        second = planned and self.planner.choose(n_bags, capturing, kind)
        timed = planned and not capturing and self.planner.calibrating(n_bags, kind)
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        # one id per bag: taking bags in row order reads misses from host memory in address order (random order
        # thrashes the I/O address translation of a multi-GB pinned table; FBGEMM sorts its misses too)
        order = torch.argsort(ids) if second and kind == "single" else None
        staging = self.staging if second and kind == "multi" else None
        lookup_pool(ids, offsets, bag_size, n_bags, include_last, op, elem, psw, out_u8, self._source(), self._tables,
                    self.counters, self.errors.ptr, self.freq, layout, staging, order)
        if timed:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.planner.record(n_bags, second, start, end, kind)
        self.calls += 1
        if self.calls >= self._next_refresh and not torch.cuda.is_current_stream_capturing():
            self.refresh()
            self._next_refresh = self.calls + (self._next_refresh if self._next_refresh < self.refresh_every
                                               else self.refresh_every)

    @torch.no_grad()
    def refresh(self) -> None:
        """Make the most requested rows (by the lookup counts) resident, evicting the others as needed."""
        mgr = self.mgr
        k = min(mgr.capacity, int((self.freq > 0).sum()))
        if k == 0:
            return
        hot = torch.topk(self.freq, k, sorted=False).indices
        mgr.prepare_unique(hot)
        self.freq.bitwise_right_shift_(1)  # age the counts: recent traffic weighs more, and int32 never overflows
        self.refreshes += 1

    def stats(self) -> dict[str, Any]:
        requests, hits, host_bytes, slab_bytes = (int(v) for v in self.counters.tolist())
        return {"fused_lookups": requests, "fused_hits": hits, "fused_hit_rate": hits / max(requests, 1),
                "fused_staging_bytes": self.staging.nbytes if self.staging is not None else 0,
                "fused_host_bytes": host_bytes, "fused_raw_host_bytes": (requests - hits) * self.mgr.store.row_bytes,
                "fused_calls": self.calls, "fused_refreshes": self.refreshes, "fused_plan": self.planner.plan()}


def _set_rows(param: torch.nn.Parameter, data: torch.Tensor) -> None:
    """Give ``param`` new storage with another row count, keeping the Parameter object the optimizer holds.

    Autograd caches a leaf's shape in its gradient accumulator, which any earlier graph still alive (the last
    step's ``loss``) keeps alive; torch drops that cache only when the dtype or device changes, so the data
    passes through another dtype once. Without this the next backward fails with "invalid gradient".
    """
    other = torch.float64 if data.dtype != torch.float64 else torch.float32
    param.data = torch.empty(0, dtype=other, device=data.device)
    param.data = data


def _grow_rows(t: torch.Tensor, extra: int, fill: float = 0.0) -> torch.Tensor:
    out = torch.empty((t.shape[0] + extra, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    out[t.shape[0]:] = fill
    return out


def _grow_grad(grad: torch.Tensor, rows: int) -> torch.Tensor:
    """A gradient left over from a smaller parameter, padded to ``rows`` (sparse stays sparse)."""
    if grad.is_sparse:
        return torch.sparse_coo_tensor(grad._indices(), grad._values(), (rows, *grad.shape[1:]))
    return _grow_rows(grad, rows - grad.shape[0])


def _shrink_grad(grad: torch.Tensor, rows: int) -> torch.Tensor:
    if grad.is_sparse:
        g = grad.coalesce()
        keep = g.indices()[0] < rows
        return torch.sparse_coo_tensor(g.indices()[:, keep], g.values()[keep], (rows, *grad.shape[1:]))
    return grad[:rows].clone()
