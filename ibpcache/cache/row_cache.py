"""The engine's embedding-row cache: rows on the compute device in front of a :class:`HostStore`, for training and
for inference.

Where :class:`~ibpcache.cache.feature_cache.FeatureCache` is a read cache (a batch's surplus misses are served from
the host store and may stay uncached), this cache holds two kinds of rows in one budget of device memory, ``C`` raw
rows' worth (the bytes of the ``cached_weight`` parameter), depending on what the module does:

* training (``form == "raw"``): decoded, trainable rows, one per slot, ``C`` slots. EVERY row of a batch becomes
  resident, because the rows are what an optimizer updates (Colossal-AI's ``CachedParamMgr`` role;
  :class:`CachedRowManager.prepare_unique`): misses are read through the host store's transfer path and evicted rows
  written back re-compressed (:meth:`HostStore.write_rows`, the engine's write-back). An attached optimizer
  (:meth:`CachedRowManager.attach_optimizer`, ``row_optimizer.py``) keeps its per-row state with the rows and replays
  the updates an evicted row missed when it returns, so training equals the same optimizer over the full table.
* inference (``form == "stored"``, :class:`FusedLookup`): rows kept AS STORED in the host store (IBP-compressed, or
  raw), in slots of ``slot_bytes`` chosen for the stored lengths (:func:`~ibpcache.cache.policy.choose_slot_bytes`),
  so the same bytes hold about ratio-times more hot rows. Every lookup admits rows on the device with no host sync
  (``kernels/admit.cu``: frequency sketch, TinyLFU admission of the distinct misses into sampled victim slots, the
  other misses staged once per step), then ONE pooled lookup launch (``kernels/lookup.cu``, index mode
  ``SLOT_TABLE``) decodes slot, staged and host rows into the output.

Switching between the two forms empties the cache (a training forward after inference starts cold, an inference
forward after training writes dirty rows back and brings every evicted row up to date with an attached optimizer's
updates first), so each form's invariants hold on their own. Which rows stay is one :class:`SlotPolicy` (the
slot -> row map, per-slot frequency and last use, a frequency sketch) in both forms.

A training batch with more distinct ids than cache rows is served by growing the parameter for that one batch (so the
rows stay trainable: the optimizer step that follows updates them too) and shrinking it back at the start of the next
batch; Colossal-AI refuses such batches.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ..codec import Codec
from ..compressed import CompressedRows
from ..errors import (InvalidArgumentError, InvalidTypeError, OptimizerStateError, RowDtypeError,
                      RowShapeError)
from ..format import Layout
from ..kernels import admit as admit_gpu
from ..kernels import admit_cpu
from ..kernels.admit import (ADMIT_FORCE, ADMIT_POLICY, N_STATS, N_WS, STAT_ADMITTED, STAT_HITS, STAT_HOST_BYTES,
                             STAT_REQUESTS, STAT_STAGED, WS_LIST, AdmitArgs)
from ..kernels.hashmap import IndexArgs
from ..kernels.lookup import (SLOT_TABLE_INDEX, BagLayout, ElemType, LookupErrors, PoolOp, RowSource, fill_rows,
                              lookup_pool, pool_supported)
from .admission import SETTLED_ADMIT_EVERY, AdmissionPace
from .host_store import HostStore
from .ordering import StreamOrder
from .plan_layout import slot_form, slot_option
from .plan_path import PathPlanner
from .policy import EvictionStrategy, SlotPolicy, choose_slot_bytes, row_policy
from .row_optimizer import RowOptimizer, watch_unattached
from .step_graphs import StepGraphs
from .stats import RecentCounters

__all__ = ["CachedRowManager", "Prepared", "FusedLookup", "BagLayout", "pool_supported", "check_adoptable_rows",
           "STAGE_BYTES"]

_MIN = torch.iinfo(torch.int64).min
_REFIT_CHECK_EVERY = 64
"""Write-back batches between two checks of the host store's compressed fraction (each check syncs)."""

_RECENT_STEPS = 128
"""Steps the ``*_hit_rate_recent`` statistics look back over (about)."""

STAGE_BYTES = 64 << 20
"""Default device bytes of the fused lookup's per-step staging buffer (rows read from host memory once per step)."""

_MAX_PENDING = 4
_PREFETCH_ROUNDS = 3
"""Scan/apply rounds of a prefetch: a row whose sampled victim went to another row's higher bid samples other slots
in the next round, so (nearly) every prefetched row that fits a slot is resident when its lookup comes."""
"""Prefetched batches whose rows stay protected until their lookup; older ones are forgotten."""

_SLOT_ALIGN = 16
"""Stored-row slots start 16-byte aligned: the decoders read whole aligned 16-byte blocks."""

_SLOT_COVERAGE = 0.999
"""Share of the rows the inference cache's slots must fit (``choose_slot_bytes``): a row too long for a slot can
never be cached, however hot, which costs a skewed workload more hit rate than a slightly larger slot does."""


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


@contextlib.contextmanager
def _state_mode() -> Iterator[None]:
    """Cache state is created and updated outside inference mode (tensors made under ``torch.inference_mode`` could
    not be updated in place by a later training step) and never records autograd."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def _in_state_mode(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _state_mode():
            return fn(*args, **kwargs)

    return wrapped


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


@dataclass
class _Ahead:
    """A batch a prefetch made resident, kept for the lookup of the same inputs that follows it (FBGEMM's TBE hands
    its prefetch's cache locations to the forward the same way): that lookup then needs no ``unique`` and no host
    read, so a training step over prefetched rows never waits for the device. ``key``: the caller's input tensors
    and their version counters (the same tensors, unchanged)."""

    key: tuple
    prep: Prepared
    counts: torch.Tensor
    n_ids: int


def _same_key(a: tuple, b: tuple) -> bool:
    """Tensors compare by identity (the same object), everything else by value."""
    return len(a) == len(b) and all(x is y if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) else x == y
                                    for x, y in zip(a, b))


class CachedRowManager:
    """The row cache in front of a :class:`HostStore` (Colossal-AI's ``CachedParamMgr`` role, plus the inference form).

    Raw form: slots ``[0, P)`` are pinned (the padding row, never evicted); ``[P, P + C)`` are the cache proper;
    during an oversized batch the parameter grows past ``P + C`` until the next call. ``slot_of`` (int32, ``[N]``, -1
    = not cached; one scratch entry follows it in ``slot_table``) and ``id_of`` (int64, per slot, -1 = free: the
    policy's slot table) live on the cache device. Which rows leave is the policy's call
    (:func:`~ibpcache.cache.policy.row_policy`), under the row cache's contract: every missed row enters. The stored
    form belongs to :class:`FusedLookup` (see the module docstring).
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
        self.strategy = EvictionStrategy.coerce(strategy)
        self.pinned_ids = [int(i) for i in pinned_ids]
        self.n_pinned = len(self.pinned_ids)
        self.capacity = int(capacity)
        self.cuda_row_num = self.capacity  # Colossal-AI's name for the cache size in rows
        self.base_slots = self.n_pinned + self.capacity
        self.refit_threshold = refit_threshold
        dev = self.device
        self.cached_weight = torch.nn.Parameter(
            torch.zeros((self.base_slots, self.embedding_dim), dtype=store.dtype, device=dev))
        self.slot_table = torch.full((self.num_embeddings + 1,), -1, dtype=torch.int32, device=dev)
        self.slot_of = self.slot_table[: self.num_embeddings]
        self.n_free = self.capacity
        self.freq = None if ids_freq_mapping is None else ids_freq_mapping.to(dev, torch.int64)
        self.policy: SlotPolicy = row_policy(strategy, self.base_slots, self.num_embeddings, dev,
                                             n_pinned=self.n_pinned, priority=self.freq)
        self.form = "raw"
        self.form_switches = 0
        self.dirty = False
        self.raw_for_writes = False  # prepare_writes turned the planner's coded host rows into raw ones
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
        # distinct rows the prefetches looked for, and those not resident then: a prefetched step's forward finds
        # every row, so its hit rate says nothing of what the step read from the host; these do
        self.prefetch_unique_ids = 0
        self.prefetch_misses = 0
        self.prefetch_write_backs = 0
        self.order = StreamOrder(self.device)  # one operation at a time, from any thread or CUDA stream
        self.fused: "FusedLookup | None" = None
        self._fused_lock = threading.Lock()  # threads' first lookups or prefetches build ONE FusedLookup
        self._side: "torch.cuda.Stream | None" = None
        self._side_active = False  # an operation runs on the side stream now (it must not reallocate state)
        self._ahead: Optional[_Ahead] = None  # the last prefetch's batch, while no slot has changed since
        if self.n_pinned:
            self._place(torch.tensor(list(pinned_ids), dtype=torch.int64, device=dev),
                        torch.arange(self.n_pinned, dtype=torch.int64, device=dev))
        self._warmup(warmup_ratio)
        watch_unattached(self)

    def fused_lookup(self, stage_bytes: int = STAGE_BYTES, compress_cache: "bool | str" = True,
                     graphs: bool = True, settled_admit_every: int = SETTLED_ADMIT_EVERY) -> "FusedLookup":
        """The fused inference lookup over this cache and its host store (built on first use, once: two lookups
        over one manager would each keep their own per-slot lengths of the same slots)."""
        if self.fused is None:
            with self._fused_lock:
                if self.fused is None:
                    self.fused = FusedLookup(self, stage_bytes, compress_cache, graphs, settled_admit_every)
        return self.fused

    # -- setup ------------------------------------------------------------------------------------
    @property
    def id_of(self) -> torch.Tensor:
        """int64 per slot: the id it holds, -1 = free (the policy's slot table)."""
        return self.policy.slot_ids

    def _place(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Load rows ``ids`` into ``slots`` (free, or emptied by eviction) and admit them to the policy."""
        self.store.read_into(ids, self._weight_u8(), slots)
        self.slot_of.index_put_((ids,), slots.to(torch.int32))
        self.policy.admit(slots, ids)

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
        self._place(ids, slots)
        self.n_free -= k

    def _weight_u8(self) -> torch.Tensor:
        w = self.cached_weight.data
        return w.view(torch.uint8).view(w.shape[0], self.store.row_bytes)

    def is_dirty(self) -> bool:
        """May cached rows differ from their host copies? Set by training forwards, and by any in-place
        update of the parameter (optimizer steps bump its version counter), e.g. after a flush."""
        return self.form == "raw" and (self.dirty or self.cached_weight._version != self._clean_version)

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

    # -- the two forms ------------------------------------------------------------------------------
    @_in_state_mode
    def use_raw(self) -> None:
        """Hold decoded, trainable rows (training, the non-fused lookups). From the stored form: the cache starts
        empty (its rows were clean copies of host rows), the padding row pinned again."""
        if self.form == "raw":
            return
        self._ahead = None
        self._clear_slots()
        self.policy.reset(self.base_slots, self.n_pinned)
        self.form = "raw"
        self.form_switches += 1
        self.n_free = self.capacity
        if self.n_pinned:
            self._place(torch.tensor(self.pinned_ids, dtype=torch.int64, device=self.device),
                        torch.arange(self.n_pinned, dtype=torch.int64, device=self.device))
        self.mark_clean()

    @_in_state_mode
    def use_stored(self, n_slots: Callable[[], int]) -> None:
        """Hold rows as stored in ``n_slots()`` slots (the fused inference lookup; ``n_slots`` is asked after the
        host store is current). From the raw form every row leaves: written back if dirty, its optimizer state saved,
        and every evicted row brought up to date with the attached optimizer's updates, since inference reads host
        rows as they are."""
        self._ahead = None
        if self.form == "raw":
            self._shrink()
            slots = self.occupied_slots()
            if slots.numel():
                ids = self.id_of.index_select(0, slots)
                if self.is_dirty():
                    self.store.write_rows(ids, self._weight_u8().index_select(0, slots))
                if self.optim is not None:
                    self.optim.save(slots, ids)
                self.slot_of.index_fill_(0, ids, -1)
                self.evictions += int(slots.numel())
            self.catch_up()
            self.store.sync_host()
            self.mark_clean()
        else:
            self._clear_slots()
        self.policy.reset(n_slots(), 0)
        self.form = "stored"
        self.form_switches += 1

    def _clear_slots(self) -> None:
        slots, ids = self.policy.resident()
        if ids.numel():
            self.slot_of.index_fill_(0, ids, -1)

    # -- the per-batch path -----------------------------------------------------------------------
    @torch.no_grad()
    def prepare_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Make every row in ``ids`` (int64, valid, on the cache device) resident; return slot indices
        (Colossal-AI's ``prepare_ids``)."""
        return self.prepare_unique(ids).slots()

    @_in_state_mode
    def prepare_unique(self, ids: torch.Tensor, checks: Sequence[torch.Tensor] = (),
                       verify: Optional[Callable[[list], None]] = None, count: bool = True,
                       grow: bool = True, remember: Optional[tuple] = None) -> "Prepared":
        """Make the rows of ``ids`` (int64 on the cache device) resident and say where they are.

        ``checks`` (0-d int64 tensors, e.g. "some id is out of range") ride along with the one device sync
        this needs anyway; ``verify(values)`` runs on their values before the cache changes and may raise.
        Ids are only trusted after ``verify`` passed. Cost: one ``unique``, one sync, then (if anything
        misses) one top-k for the victims, one write-back encode (training only) and one decode launch.
        ``count=False`` (a prefetch): the rows are admitted and touched, but the lookup and its hits/misses are
        not counted as one (``prefetched_rows`` counts the admissions). ``grow=False`` (a prefetch on a side stream):
        the cache is never resized; misses beyond the free and evictable slots stay out (the lookup admits them).
        ``remember`` (a prefetch): a key of the caller's inputs; when every row found a slot, the lookup that passes
        the same key to :meth:`take_prepared` reuses this batch's slots with no device sync.
        """
        self._ahead = None
        self.use_raw()
        if grow:
            self._shrink()
        flat = ids.reshape(-1)
        if flat.numel() == 0:
            if checks and verify is not None:
                verify(torch.stack(list(checks)).tolist())
            if count:
                self._tick()
                self._record(0, 0, 0)
            return Prepared(flat.clone(), flat.clone().view(ids.shape), flat.clone(), None)
        # the batch's distinct ids, found, counted and checked with ONE read of device values (torch.unique and
        # nonzero would each wait for the device once more)
        uniq, inv, counts, n_uniq_t = _sorted_unique(flat)
        valid = torch.arange(flat.numel(), device=flat.device) < n_uniq_t
        safe = uniq.clamp(0, self.num_embeddings - 1)  # ids are verified below, before anything changes
        slot_u = self.slot_of.index_select(0, safe).to(torch.int64)
        hit = (slot_u >= 0) & valid
        probes = [n_uniq_t, (valid & ~hit).sum(), (hit & (slot_u < self.n_pinned)).sum()]
        if self.n_pinned:
            first = self.pinned_ids[0]
            probes += [((uniq == first) & valid).any().to(torch.int64), ((uniq < first) & valid).sum()]
        n_probes = len(probes)
        vals = torch.stack(probes + [c.to(torch.int64) for c in checks]).tolist()
        if verify is not None and checks:
            verify(vals[n_probes:])
        n_uniq, n_miss, n_pinned_hits = vals[:3]
        uniq, counts, slot_u, hit = uniq[:n_uniq], counts[:n_uniq], slot_u[:n_uniq], hit[:n_uniq]
        if count:
            self._tick()
            self.lookups += int(flat.numel())
        self.policy.count(uniq, counts)
        pinned_pos = vals[4] if self.n_pinned and vals[3] else None
        written = 0
        all_placed = True  # every id has a slot now (a best-effort prefetch may leave some out)
        if n_miss:
            miss_pos = torch.argsort(hit.to(torch.int8), stable=True)[:n_miss]  # the misses, in order: no sync
            avail = (self.slots - self.n_pinned) - (n_uniq - n_miss - n_pinned_hits)
            if not grow and n_miss > avail:  # best effort: what fits without resizing
                miss_pos = miss_pos[:avail]
                n_miss = avail
                all_placed = False
            if n_miss:
                miss_ids = uniq.index_select(0, miss_pos)
                dest, written = self._admit(miss_ids, slot_u, n_miss, n_uniq - vals[1] - n_pinned_hits)
                slot_u.index_copy_(0, miss_pos, dest)
        self.policy.touch(slot_u if all_placed else slot_u[slot_u >= 0])  # a boolean mask syncs on CUDA
        prep = Prepared(slot_u, inv.view(ids.shape), uniq, pinned_pos)
        if count:
            self._record(n_uniq - vals[1], vals[1], written)
        else:
            self.prefetched_rows += int(n_miss)
            self.prefetch_write_backs += int(written)
            self.prefetch_unique_ids += n_uniq
            self.prefetch_misses += vals[1]
            if remember is not None and all_placed and self.slots == self.base_slots:
                self._ahead = _Ahead(remember, prep, counts, int(flat.numel()))
        return prep

    def take_prepared(self, key: Optional[tuple], shape: tuple) -> Optional[Prepared]:
        """The slots of the batch the last prefetch made resident under ``key`` (``shape``: the shape of the lookup's
        rows, as it wants ``inv``), if no slot has changed since, counted as the lookup :meth:`prepare_unique` would
        count (every row a hit); else None. No device sync, and the same cache state and statistics as
        :meth:`prepare_unique` of those ids would leave."""
        ahead, self._ahead = self._ahead, None
        if (ahead is None or key is None or self.form != "raw" or self.slots != self.base_slots
                or ahead.n_ids != math.prod(shape) or not _same_key(ahead.key, key)):
            return None
        prep = ahead.prep
        if self.device.type == "cuda":  # made on the side stream: its blocks wait for this stream's use too
            for t in (prep.slot_u, prep.inv, prep.uniq, ahead.counts):
                t.record_stream(torch.cuda.current_stream(self.device))
        self._tick()
        self.lookups += ahead.n_ids
        self.policy.count(prep.uniq, ahead.counts)
        self.policy.touch(prep.slot_u)
        n_uniq = int(prep.uniq.numel())
        self._record(n_uniq, 0, 0)
        return Prepared(prep.slot_u, prep.inv.view(shape), prep.uniq, prep.pinned_pos)

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
        self._ahead = None
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
        if self.form == "raw":
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
        slots = self.occupied_slots() if self.form == "raw" else self.occupied_slots()[:0]
        if slots.numel():  # raw rows may be newer than the host's; stored ones are copies of them
            table.index_copy_(0, self.id_of.index_select(0, slots).cpu(),
                              self.cached_weight.data.index_select(0, slots).cpu())
        return table

    @torch.no_grad()
    def load_weight(self, table: torch.Tensor) -> None:
        """Replace the whole table (e.g. ``load_state_dict``): re-encode it and reload the cached rows."""
        if tuple(table.shape) != (self.num_embeddings, self.embedding_dim):
            raise InvalidArgumentError(f"weight: expected shape {(self.num_embeddings, self.embedding_dim)}, "
                                       f"got {tuple(table.shape)}")
        self.use_raw()  # stored rows would be copies of the old table
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
        if self.refit_threshold is None or not self.store.compress or self._side_active:
            return  # (on the side stream nothing is reallocated: see on_side_stream; the next check will tell)
        self._writebacks_since_check += 1
        if not force_check and self._writebacks_since_check < _REFIT_CHECK_EVERY:
            return
        self._writebacks_since_check = 0
        if self.store.compressed_fraction() < self.refit_threshold * self.store.compressed_fraction_at_fit:
            self.refit()

    @torch.no_grad()
    def refit(self) -> None:
        """Fit a new codec on the current table and re-encode the host store (raw cached rows stay valid; stored ones
        are dropped, they were bytes of the old codec)."""
        table = self.full_weight()
        self.use_raw()
        self.store.refit(table)
        self.refit_steps.append(self.step)

    @torch.no_grad()
    def prepare_writes(self) -> None:
        """Call before rows start being written back (a training step, ``max_norm``): a store whose coded host
        rows the planner chose (``compress="auto"``) keeps raw rows from now on (:meth:`HostStore.keep_raw` says
        why); an explicitly compressed store stays coded."""
        store = self.store
        if self.dirty or not store.compress or store.compress_option != "auto" or store.read_only:
            return
        table = self.full_weight()
        was = store.layout_choice.method if store.layout_choice is not None else "coded"
        store.keep_raw(table, f"trained: raw rows from the first write-back (the planner chose {was} for reads; "
                              "coded write-back of evicted rows costs more than it saves)")
        self.raw_for_writes = True

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
        recent_h = int(sum(self.num_hits_history[-_RECENT_STEPS:]))
        recent_m = int(sum(self.num_miss_history[-_RECENT_STEPS:]))
        out = {
            "steps": self.step,
            "lookups": self.lookups,
            "unique_ids": hits + misses,
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / max(hits + misses, 1),
            "hit_rate_recent": recent_h / max(recent_h + recent_m, 1),
            "recent_steps": min(len(self.num_hits_history), _RECENT_STEPS),
            "form": self.form,
            "form_switches": self.form_switches,
            "evictions": self.evictions,
            "write_backs": int(sum(self.num_write_back_history)) + self.prefetch_write_backs,
            "prefetched_rows": self.prefetched_rows,
            "prefetch_unique_ids": self.prefetch_unique_ids,
            "prefetch_misses": self.prefetch_misses,
            "prefetch_hit_rate": (1.0 - self.prefetch_misses / self.prefetch_unique_ids
                                  if self.prefetch_unique_ids else None),
            "cache_rows": self.capacity,
            "pinned_rows": self.n_pinned,
            "cached_rows": int((self.id_of >= 0).sum()),
            "cache_slots": self.policy.n_slots,
            "policy_bytes": self.policy.nbytes,
            "overflow_batches": self.overflow_batches,
            "overflow_rows_max": self.overflow_rows_max,
            "refit_steps": list(self.refit_steps),
            "eviction_strategy": self.strategy.name,
            "device": str(self.device),
        }
        out.update(self.store.stats())
        if self.fused is not None:
            fused = self.fused.stats()
            out.update(fused)
            out["prefetched_rows"] += fused["fused_prefetched_rows"]
        return out

    def print_comm_stats(self) -> None:
        """Colossal-AI-compatible summary on stdout."""
        for k, v in self.stats().items():
            print(f"{k}: {v}")


    # -- a second stream for prefetches --------------------------------------------------------------
    def side_stream(self) -> "torch.cuda.Stream":
        """The cache's prefetch stream (made on first use)."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    @contextlib.contextmanager
    def on_side_stream(self, *inputs: torch.Tensor) -> Iterator[bool]:
        """Run a cache operation on the side stream, after everything enqueued so far on the caller's stream (its
        inputs included) and after the cache's last operation; the cache's next operation, from any thread, runs
        after it (the ``StreamOrder``), while the caller's own later work does not wait. Yields whether it runs on the
        side stream (not on a CPU, nor while the caller's stream is being captured into a CUDA graph).

        Nothing that outlives the operation may be allocated inside it: a block freed on the side stream could go to
        the caller's stream while still being written (callers allocate first, then enter)."""
        if self.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            with self.order.exclusive():
                yield False
            return
        caller = torch.cuda.current_stream(self.device)
        side = self.side_stream()
        side.wait_stream(caller)
        for t in inputs:
            if t.is_cuda:
                t.record_stream(side)
        with torch.cuda.stream(side), self.order.exclusive():
            self._side_active = True
            try:
                yield True
            finally:
                self._side_active = False


def _sorted_unique(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)`` without its host sync: the
    distinct ids ascending and their counts padded to ``len(flat)`` (entries from the count on are 0), each id's
    index among them, and the count as a 0-d device tensor (read with the caller's other values)."""
    n = flat.numel()
    keys, order = torch.sort(flat)
    first = torch.ones(n, dtype=torch.bool, device=flat.device)
    torch.ne(keys[1:], keys[:-1], out=first[1:])
    rank = torch.cumsum(first, 0) - 1
    inv = torch.empty_like(rank).scatter_(0, order, rank)
    uniq = torch.zeros_like(keys).scatter_(0, rank, keys)  # equal keys write the same value
    counts = torch.zeros_like(rank).index_add_(0, rank, torch.ones_like(rank))
    return uniq, inv, counts, rank[-1] + 1


def _retire(*tensors: Optional[torch.Tensor]) -> None:
    """Buffers about to be replaced: their memory goes back to the allocator only once the caller's stream has
    passed this point. Several streams (threads' own, the side stream) run the cache's kernels, ordered by the
    ``StreamOrder``; a buffer made on one stream and last read on another could otherwise be handed to a new
    tensor on the first while the other's kernel still reads it. The caller's stream waits for every earlier cache
    operation, so recording the buffers on it covers them all."""
    if not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        return
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


class _Workspace:
    """One role's (``"lookup"`` or ``"prefetch"``) per-step buffers, grown to the largest step seen and used as views,
    so steps of one size reuse the same memory (what a CUDA graph of the pass needs)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cap = 0
        self.slots = -1
        self.ws = torch.zeros(N_WS, dtype=torch.int64, device=device)

    def ensure(self, n: int, n_slots: int) -> bool:
        """Grow to ``n`` ids and ``n_slots`` slots; True when a buffer was replaced."""
        dev = self.device
        grown = n > self.cap or n_slots != self.slots
        if n > self.cap:
            if self.cap:
                _retire(self.victim, self.key, self.flags, self.rank, self.list_gid, self.list_dst, self.list_len)
            self.cap = max(n, int(self.cap * 1.5))
            self.victim = torch.zeros(self.cap, dtype=torch.int64, device=dev)
            self.key = torch.zeros(self.cap, dtype=torch.int64, device=dev)
            self.flags = torch.zeros(self.cap, dtype=torch.uint8, device=dev)
            self.rank = torch.zeros(self.cap, dtype=torch.int64, device=dev)
            self.list_gid = torch.zeros(self.cap, dtype=torch.int64, device=dev)
            self.list_dst = torch.zeros(self.cap, dtype=torch.int64, device=dev)
            self.list_len = torch.zeros(self.cap, dtype=torch.int32, device=dev)
        if n_slots != self.slots:
            _retire(getattr(self, "bid", None))
            self.slots = n_slots
            self.bid = torch.full((n_slots + 1,), -1, dtype=torch.int64, device=dev)
        return grown


_WAYS = {
    # one id per bag: bags in row order or as given (address-ordered host reads pay off on large pinned tables),
    # misses staged (each distinct row read once per step) or read zero-copy by the lookup
    "single": (("as given", False, False), ("sorted", False, True), ("staged", True, False),
               ("staged, sorted", True, True)),
    "multi": (("zero-copy", False, False), ("staged", True, False)),
}
"""The ways a fused lookup can run, per kind: (label, stage the misses, take bags in row order)."""


@dataclass
class _Cycle:
    """A timed cycle of a settled cache: ``every`` steps of one unstaged way, the first admitting, the others not;
    the planner gets their mean (one step alone would time the pass, or the skip, not what the way costs)."""

    kind: str
    n_bags: int
    way: int
    left: int  # steps still to run after the current one
    spans: list = field(default_factory=list)  # (start, end) CUDA events of each step run so far
    clean: bool = True  # every step ran as it will from now on (see pool) and skipped as planned: recorded


def _sorted_rows(keys: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The admission pass's keys (rows in ``[0, n_rows]``) sorted, as int64, and the permutation that sorts them.
    Below 2^31 rows they sort as int32: half the radix passes of int64 keys (on an H200 the int64 sort took 58-69 us
    of a 160-580 us DLRM lookup step). Equal keys may come in any order, as from any unstable sort: the pass reads
    only the sorted keys, the lookup only which bag comes where."""
    if n_rows < 2 ** 31 - 1:
        s, perm = torch.sort(keys.to(torch.int32))
        return s.to(torch.int64), perm
    return torch.sort(keys)


def _ways_of(kind: str) -> list:
    """The ways of a planner kind ("single", "multi", or either + " unstaged": no staging buffer)."""
    return [w for w in _WAYS[kind.split()[0]] if not (w[1] and kind.endswith("unstaged"))]


def _ptr_of(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _shape_of(t: Optional[torch.Tensor]) -> Optional[tuple]:
    return None if t is None else (tuple(t.shape), t.dtype)


class FusedLookup:
    """Inference lookups of a :class:`CachedRowManager`: admission on the device, then ONE pooled lookup launch.

    The cache holds rows in ``slot_bytes`` slots carved from the manager's ``cached_weight`` bytes, in one of two
    forms (``compress_cache``; ``plan_layout.SLOT_FORMS``): as the host store stores them ("stored": slots sized to
    the stored lengths by ``choose_slot_bytes``, so the same bytes keep ratio-times more rows, each hit decoded), or
    decoded when admitted ("decoded": ``row_bytes`` slots whose hits read at copy speed, while misses still cross
    PCIe compressed). ``"auto"`` takes the host layout planner's word (``layout_choice.slots``). Each lookup, with no
    host sync:

    1. the step's ids become keys (global rows; bad ids a sentinel the kernels skip: the lookup reports them);
    2. ``kernels/admit.cu``: requests are counted into the policy's frequency sketch; the distinct missed rows bid for
       sampled victim slots and enter where the policy admits them (TinyLFU: more frequent than the victim), copied
       as stored (or decoded: ``kernels.lookup.fill_rows``); the other misses are copied once each into this step's
       staging buffer (``stage_bytes``, sized to the step, nothing per table row) -- or left to zero-copy reads,
       where the path planner measured that faster;
    3. ``kernels/lookup.cu`` (index mode ``SLOT_TABLE``) decodes slot, staged and host rows and pools them into the
       output; then the staged rows leave the slot table.

    Once the cache is full and its hit rate has settled (:class:`~ibpcache.cache.admission.AdmissionPace`), only
    every ``settled_admit_every``-th lookup runs step 2 in full; the others only count requests, hits and use
    stamps, and read their misses zero-copy (steps whose way stages misses, and prefetched batches, always run it).

    :meth:`prefetch` runs step 2 for a coming batch on the manager's side stream (TorchRec's pipeline: the next
    batch's rows are read while the current step computes); its lookup then counts nothing twice. Rows of batches
    prefetched but not yet looked up are never evicted. Hit rates count rows resident when a lookup starts.
    On a CPU the same admission runs through the kernels' twin (``kernels/admit_cpu.py``) and the lookup is emulated
    (rows decoded, then ``embedding_bag``): what the tests drive.
    """

    def __init__(self, mgr: "CachedRowManager", stage_bytes: int = STAGE_BYTES, compress_cache: "bool | str" = True,
                 graphs: bool = True, settled_admit_every: int = SETTLED_ADMIT_EVERY) -> None:
        if stage_bytes < 0:
            raise InvalidArgumentError(f"stage_bytes must be >= 0, got {stage_bytes}")
        self.mgr = mgr
        dev = mgr.device
        self.cuda = dev.type == "cuda"
        self.kern: Any = admit_gpu if self.cuda else admit_cpu
        self.stage_bytes = int(stage_bytes)
        self.slots_option = slot_option(compress_cache)
        self.decoded = False  # the slots hold decoded rows (see _slots_for)
        self.slots_reason = ""
        with _state_mode():
            self.errors = LookupErrors(pin=self.cuda)  # the kernel writes it through UVA
            self.counters = torch.zeros(4, dtype=torch.int64, device=dev)  # lookup kernel: requests, device, host, slab
            self.adm_stats = torch.zeros(N_STATS, dtype=torch.int64, device=dev)  # lookups' admission passes
            self.pre_stats = torch.zeros(N_STATS, dtype=torch.int64, device=dev)  # prefetches' admission passes
            self.slab_bases = torch.zeros(8, dtype=torch.int64, device=dev)
            self.scal = torch.zeros(2, dtype=torch.int64, device=dev)  # [step stamp, first protected step] of a pass
            self._ws = {"lookup": _Workspace(dev), "prefetch": _Workspace(dev)}
        self.recent = RecentCounters()
        self.pace = AdmissionPace(settled_admit_every, dev)
        self.calls = 0
        self.prefetches = 0
        self._passes = 0  # admission passes so far (the device's step stamp, unless a captured lookup was replayed)
        self._pending: deque[tuple[int, int]] = deque()  # (pass, n) of prefetched batches not yet looked up
        self._done: Optional[torch.cuda.Event] = None  # the last prefetch's end on the side stream
        self._cycles: dict[tuple[str, int], _Cycle] = {}  # a settled cache's timed cycles under way, per shape
        self.way_steps: Counter[tuple[str, int]] = Counter()  # lookup steps per (kind, way): stats' way counts
        self.timed_cycles = 0
        self.slot_bytes = 0
        self.n_slots = 0
        self.stage_cap = 0
        self.slot_len: Optional[torch.Tensor] = None
        self.stage_buf: Optional[torch.Tensor] = None
        self.stage_gid: Optional[torch.Tensor] = None
        self._src: Any = None
        self._src_key: tuple = ()
        self._tables: Any = None
        self._full = False  # every slot used since the stored form began (see _cache_full)
        self._form_gen = 0  # stored forms entered so far
        self._gen = 0  # bumped whenever a buffer a lookup step reads or writes is replaced (graphs' keys)
        self.graphs = StepGraphs(dev) if graphs and self.cuda else None
        self._fill_seen: Optional[int] = None  # the form a copy of the device's fill on its way to _fill_host is of
        if self.cuda:
            with _state_mode():
                self._fill_host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
            self._fill_done = torch.cuda.Event()
        ways = {k: tuple(w[0] for w in v) for k, v in _WAYS.items()}
        ways.update({f"{k} unstaged": tuple(w[0] for w in v if not w[1]) for k, v in _WAYS.items()})
        self.planner = PathPlanner(ways)

    # -- the stored form --------------------------------------------------------------------------
    def _slots_for(self) -> int:
        """Slot form, size and count for the manager's bytes and the host store's current stored lengths."""
        mgr, store = self.mgr, self.mgr.store
        budget = mgr.base_slots * store.row_bytes
        choice = store.layout_choice
        if not store.compress:
            form, self.slots_reason = slot_form(self.slots_option, "raw", 1.0, {})
        elif self.slots_option == "auto" and choice is not None and choice.compress:
            form, self.slots_reason = choice.slots, choice.slots_reason
        elif self.slots_option == "auto":
            form, self.slots_reason = "stored", "compression asked for: no timings to weigh slots by"
        else:
            form, self.slots_reason = slot_form(self.slots_option, store.codec.method, 1.0, {})
        self.decoded = store.compress and form == "decoded"
        if store.compress and not self.decoded:
            self.slot_bytes = choose_slot_bytes(store.stored_lengths(), budget, store.row_bytes, _SLOT_ALIGN,
                                                coverage=_SLOT_COVERAGE)
        else:
            self.slot_bytes = store.row_bytes
        self.n_slots = max(budget // self.slot_bytes, 1) if budget >= self.slot_bytes else 0
        return self.n_slots

    def _enter(self, n: int, stage: bool, role: str) -> None:
        """The manager holds stored rows, the per-slot lengths fit them, the staging buffer holds this step's rows
        and the role's workspace its ids (allocations happen here, on the caller's stream)."""
        mgr, store = self.mgr, self.mgr.store
        dev = mgr.device
        fresh = mgr.form != "stored"
        if fresh:
            mgr.use_stored(self._slots_for)
            self.pace.reset()
            self._full = False
            self._form_gen += 1
        # sized for the step whatever way the planner picks this time: the planner alternates staged and unstaged
        # ways while it times them, and growing here (a new buffer, a new slab base) would cost a host sync
        cap = min(n, self.stage_bytes // store.row_bytes) if role == "lookup" else 0
        if fresh or self.slot_len is None or cap > self.stage_cap:
            self._gen += 1  # captured steps read the replaced buffers: none of them may replay
            _retire(self.slot_len, self.stage_buf, self.stage_gid)
            self.stage_cap = max(cap, 0 if fresh or self.slot_len is None else self.stage_cap)
            lens = torch.zeros(self.n_slots + self.stage_cap + 1, dtype=torch.int32, device=dev)
            if not fresh and self.slot_len is not None:  # resident rows keep their lengths
                lens[: self.n_slots] = self.slot_len[: self.n_slots]
            self.slot_len = lens
            self.stage_buf = torch.zeros(self.stage_cap * store.row_bytes + 16, dtype=torch.uint8, device=dev)
            self.stage_gid = torch.zeros(max(self.stage_cap, 1), dtype=torch.int64, device=dev)
            self.slab_bases[1] = self.stage_buf.data_ptr()
        if self._ws[role].ensure(n, self.n_slots):
            self._gen += 1
        key = (store.data.data_ptr(), id(store.lengths_dev), id(store.offsets_dev), store.codec,
               mgr.cached_weight.data_ptr(), self.slot_len.data_ptr())
        if key != self._src_key:
            self._src_key = key
            self._gen += 1
            self.slab_bases[0] = mgr.cached_weight.data_ptr()
            self._tables = store.codec.kernel_tables(dev)
            index = IndexArgs(SLOT_TABLE_INDEX, self.slot_len, mgr.slot_of, self.n_slots, self.slot_bytes)
            self._src = RowSource(index, self.slab_bases, store.data.data_ptr(), store.offsets_dev, store.row_bytes,
                                  store.lengths_dev, mgr.num_embeddings)

    def _args(self, role: str, stage: bool) -> AdmitArgs:
        mgr, store, ws = self.mgr, self.mgr.store, self._ws[role]
        st = mgr.policy.device_state()
        return AdmitArgs(
            slot_of=mgr.slot_table, ids=st.ids, freq=st.freq, last=st.last, fill=st.fill, n_slots=st.n_slots,
            n_pinned=st.n_pinned,
            lru=st.lru, samples=st.samples, sketch=st.sketch if st.sketch is not None else self.slot_len[:0],
            width=st.width, prio=st.prio, slot_len=self.slot_len, slot_stride=self.slot_bytes,
            slot_bytes=self.slot_bytes, slab_base=mgr.cached_weight.data_ptr(),
            stage_base=self.stage_buf.data_ptr(), stage_cap=self.stage_cap if stage else 0,
            stage_gid=self.stage_gid, host_base=store.data.data_ptr(), host_offsets=store.offsets_dev,
            host_len=None if self.decoded else store.lengths_dev,  # decoded slots: every row admitted is row_bytes
            row_bytes=store.row_bytes, n_rows=mgr.num_embeddings, stamp=self.scal[0],
            protect=self.scal[1], stats=self.adm_stats if role == "lookup" else self.pre_stats, ws=ws.ws, bid=ws.bid[: st.n_slots + 1], victim=ws.victim,
            key=ws.key, flags=ws.flags, rank=ws.rank, list_gid=ws.list_gid, list_dst=ws.list_dst,
            list_len=ws.list_len)

    # -- keys: the global row of every id, bad ids a sentinel ------------------------------------------
    def keys(self, ids: torch.Tensor, offsets: Optional[torch.Tensor], bag_size: int, include_last: bool,
             layout: Optional[BagLayout]) -> torch.Tensor:
        """int64 [n]: each id's global row, or ``n_rows`` where the id is outside its table (fixed shape, no sync)."""
        n_rows = self.mgr.num_embeddings
        n = ids.numel()
        if n == 0:
            return ids.reshape(-1).clone()
        if layout is None or layout.n_tables <= 1:
            return torch.where((ids >= 0) & (ids < n_rows), ids, n_rows)
        t_count = layout.n_tables
        if layout.sample_major and bag_size == 1 and n % t_count == 0:  # [B, T]: table = column
            loc = ids.view(-1, t_count)
            ok = (loc >= 0) & (loc < layout.table_rows)
            return torch.where(ok, loc + layout.table_base, n_rows).reshape(-1)
        pos = torch.arange(n, device=ids.device)
        if offsets is not None:  # table-major bags: table t starts at offsets[t * per_table]
            starts = offsets[layout.per_table: t_count * layout.per_table: layout.per_table].contiguous()
            table = torch.searchsorted(starts, pos, right=True)
        elif layout.sample_major:
            table = torch.div(pos, max(bag_size, 1), rounding_mode="floor") % t_count
        else:
            table = torch.div(torch.div(pos, max(bag_size, 1), rounding_mode="floor"), max(layout.per_table, 1),
                              rounding_mode="floor")
        table = table.clamp_(max=t_count - 1)
        ok = (ids >= 0) & (ids < layout.table_rows[table])
        return torch.where(ok, ids + layout.table_base[table], n_rows)

    # -- the admission pass ----------------------------------------------------------------------------
    def _next_pass(self) -> None:
        """A new pass: the device's step stamp moves on by one (in the stream, so a captured and replayed lookup keeps
        stamping newer steps), and the protected steps start at the oldest prefetched batch not yet looked up (its
        distance in passes is known here; 0 without one)."""
        self._passes += 1
        back = self._passes - self._pending[0][0] if self._pending else 0
        self.scal[0].add_(1)
        torch.sub(self.scal[0], back, out=self.scal[1])

    def _pass(self, keys: torch.Tensor, role: str, *, count_sketch: bool, count_stats: bool,
              stage: bool) -> torch.Tensor:
        """sort, count, scan, apply, copy (see ``kernels/admit.cu``); returns the sort's permutation (the bags in row
        order, for a one-id-per-bag lookup)."""
        k = self.kern
        a = self._args(role, stage)
        count_sketch = count_sketch and self.mgr.policy.sketch is not None
        a.ws.zero_()
        a.bid.fill_(-1)
        s, perm = _sorted_rows(keys, self.mgr.num_embeddings)
        k.count(s, a, count_sketch, count_stats)
        n = keys.numel()
        prefetch = role == "prefetch"
        full = self._cache_full()
        for r in range(_PREFETCH_ROUNDS if prefetch else 1):
            if r:
                a.bid.fill_(-1)
            k.scan(s, a, ADMIT_FORCE if prefetch else ADMIT_POLICY, r)
            if not full:  # never-used slots may remain: ranked, then counted as used (a full cache skips both)
                admit_gpu.rank(n, a)
            k.apply(s, a, stage and self.stage_cap > 0)
            if not full:
                admit_gpu.advance_fill(n, a)
        self._fill(a, n, role)
        if count_sketch and not (self.cuda and torch.cuda.is_current_stream_capturing()):
            self.mgr.policy.counted(n)  # the halving is host-timed: a captured lookup's replays do not age the sketch
        return perm

    def _count_only(self, keys: torch.Tensor, in_order: bool) -> Optional[torch.Tensor]:
        """A step without the admission pass: requests, hits and the use stamps of resident rows counted (the hit
        rate and LRU order stay those of every step), nothing admitted, nothing staged; the keys sorted only where
        the lookup takes the bags in row order (returns the permutation then)."""
        a = self._args("lookup", False)
        if not in_order:
            self.kern.count(keys, a, False, True)
            return None
        s, perm = _sorted_rows(keys, self.mgr.num_embeddings)
        self.kern.count(s, a, False, True)
        return perm

    def _fill(self, a: AdmitArgs, n: int, role: str) -> None:
        """The admission's copy list into slots and staging rows: stored bytes as they are, or decoded ones."""
        if not self.decoded:
            self.kern.copy(a, n)
            return
        stats = self.adm_stats if role == "lookup" else self.pre_stats
        if self.cuda:
            fill_rows(a.list_gid, a.list_dst, a.ws[WS_LIST: WS_LIST + 1], n, self._src, self._tables,
                      stats[STAT_HOST_BYTES: STAT_HOST_BYTES + 1], self.errors.ptr)
        else:
            self._fill_cpu(a, n, stats)

    def _fill_cpu(self, a: AdmitArgs, n: int, stats: torch.Tensor) -> None:
        """The CPU twin of ``fill_rows``: the listed host rows decoded, each moved to its address."""
        store = self.mgr.store
        count = min(int(a.ws[WS_LIST]), n)
        if count == 0:
            return
        lens, offs = self._host_rows_cpu(a.list_gid[:count])
        rows = torch.zeros((count, store.row_bytes), dtype=torch.uint8)
        self._decode_cpu(store.data, offs, lens, rows, torch.arange(count))
        for d, r in zip(a.list_dst[:count].tolist(), rows):
            ctypes.memmove(d, r.data_ptr(), store.row_bytes)
        stats[STAT_HOST_BYTES] += lens.sum()

    def _cache_full(self) -> bool:
        """Has every slot been used since the cache was emptied (the device's ``fill``, read without waiting: a copy
        to pinned memory now, looked at once it completed)? Until then each pass ranks the never-used slots."""
        if self._full:
            return True
        fill = self.mgr.policy.device_state().fill
        if not self.cuda:
            self._full = int(fill) >= self.n_slots
            return self._full
        capturing = torch.cuda.is_current_stream_capturing()  # an event may not be queried during a capture
        if self._fill_seen is not None and not capturing and self._fill_done.query():
            # a copy made before the cache was last emptied says nothing about it now
            self._full = self._fill_seen == self._form_gen and int(self._fill_host[0]) >= self.n_slots
            self._fill_seen = None
        if not self._full and self._fill_seen is None and not capturing:
            self._fill_host.copy_(fill, non_blocking=True)  # the last copy has completed: the buffer is free
            self._fill_done.record()
            self._fill_seen = self._form_gen
        return self._full

    # -- the lookup -----------------------------------------------------------------------------------
    @_in_state_mode
    def pool(self, ids: torch.Tensor, offsets: Optional[torch.Tensor], bag_size: int, n_bags: int,
             include_last: bool, mode: str, psw: Optional[torch.Tensor], out: torch.Tensor, layout: Any) -> None:
        """Pool bags of ``ids`` into ``out`` (see ``kernels.lookup.lookup_pool``), admitting rows on the way: from a
        CUDA graph of the step where one is kept (``graphs``), else eagerly."""
        mgr = self.mgr
        kind = "single" if bag_size == 1 and offsets is None else "multi"
        n = ids.numel()
        capturing = self.cuda and torch.cuda.is_current_stream_capturing()
        if self.stage_bytes < mgr.store.row_bytes:  # no staging buffer: only the unstaged ways remain
            kind += " unstaged"
        if capturing:  # a caller's capture: no cycle's sample may include its steps
            self._cycles.clear()
        elif self.pace.cycling != self.planner.settled:  # skipping passes changes which way is fastest
            self._cycles.clear()  # a cycle is timed in the phase it began in
            self.planner.set_phase(self.pace.cycling)
        cyc = self._cycles.get((kind, n_bags))  # other shapes' steps may come between a cycle's own
        if cyc is not None:
            way, timed = cyc.way, True  # each step of a cycle is timed on its own
        else:
            way = self.planner.choose(kind, n_bags, capturing)
            timed = self.cuda and not capturing and self.planner.timing(kind, n_bags)
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        if self._done is not None and self.cuda and not capturing:  # the prefetch's rows are in place, and nothing
            torch.cuda.current_stream(mgr.device).wait_event(self._done)  # it reads is freed before it has run
        if capturing or (self._pending and self._pending[0][1] != n):  # not the batch that was prefetched
            self._pending.clear()
        # a step whose way stages misses needs the pass (it places them); a prefetched batch's pass only places the
        # rows already admitted; a caller's capture would freeze the decision into every replay
        forced = capturing or bool(self._pending) or _ways_of(kind)[way][1]
        if cyc is not None:  # a cycle's later steps skip the pass while the cache stays settled
            admit = forced or not self.pace.settled
            cyc.clean &= not admit
            self.pace.count(admit)
        elif timed and not forced and self.pace.cycling:  # time a whole cycle of this way, starting with its pass
            admit = True
            self.pace.count(admit)
            cyc = self._cycles[(kind, n_bags)] = _Cycle(kind, n_bags, way, self.pace.every - 1)
        else:
            admit = forced or self.pace.admit()
        ran = self._replayed(kind, way, ids, offsets, bag_size, n_bags, include_last, mode, psw, out, layout, admit)
        if ran not in ("replayed", "captured"):
            prefetched = bool(self._pending)
            if prefetched:
                self._pending.popleft()
            self._step(kind, way, ids, offsets, bag_size, n_bags, include_last, mode, psw, out, layout, prefetched,
                       admit=admit)
        if not capturing:
            self.pace.observe(self.adm_stats, self._full, n)
        self.way_steps[(kind, way)] += 1
        if cyc is not None:
            self._cycle_step(cyc, ran, start)
            timed = False
        if ran in ("first", "failed", "captured") or not admit:
            # ways compare as they will run from now on: replayed, never eager or a capture's host time; a skipping
            # step is timed only within its way's cycle
            timed = False
        if timed:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.planner.record(kind, n_bags, way, start, end)
        self.calls += 1

    def _cycle_step(self, cyc: _Cycle, ran: str, start: Any) -> None:
        """One step of a timed cycle ran (from event ``start``): at its last, the planner gets the cycle's mean
        step."""
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        cyc.spans.append((start, end))
        cyc.clean &= ran not in ("first", "failed", "captured")  # as a single step's timing: replayed or eager
        if cyc.left > 0:
            cyc.left -= 1
            return
        del self._cycles[(cyc.kind, cyc.n_bags)]
        if cyc.clean:
            self.planner.record_steps(cyc.kind, cyc.n_bags, cyc.way, cyc.spans)
            self.timed_cycles += 1

    def _replayed(self, kind: str, way: int, ids: torch.Tensor, offsets: Optional[torch.Tensor], bag_size: int,
                  n_bags: int, include_last: bool, mode: str, psw: Optional[torch.Tensor], out: torch.Tensor,
                  layout: Any, admit: bool) -> str:
        """Run the step from its CUDA graph: "replayed", or "captured" (captured on the key's second sight, then
        replayed). Else the caller runs it eagerly: "first" (a key's first sight), "failed" (the capture failed:
        graphs are off from now on), or "eager" (no graphs here, or inside a
        caller's own capture)."""
        graphs = self.graphs
        if graphs is None or not graphs.enabled or torch.cuda.is_current_stream_capturing():
            return "eager"
        self._enter(ids.numel(), _ways_of(kind)[way][1], "lookup")
        self._cache_full()  # a cache that filled up drops the ranking of never-used slots: a new key
        st = self.mgr.policy.device_state()
        # a prefetched batch (pool left only this one's entry first) counts nothing into the sketch again, and the
        # protected steps start ``back`` passes back at the next prefetched batch (a constant in the capture)
        prefetched = bool(self._pending)
        later = list(self._pending)[1:]
        back = self._passes + 1 - later[0][0] if later else 0
        lay = None if layout is None else (layout.n_tables, layout.per_table, layout.sample_major,
                                           _ptr_of(layout.table_base), _ptr_of(layout.table_rows))
        key = (kind, way, admit, tuple(ids.shape), ids.dtype, _shape_of(offsets), bag_size, n_bags, include_last, mode,
               _shape_of(psw), tuple(out.shape), out.dtype, lay, self._gen, self._full, prefetched, back,
               _ptr_of(st.ids), _ptr_of(st.sketch), _ptr_of(st.prio))
        passes, pending = self._passes, deque(self._pending)

        def body(static: tuple, out_: torch.Tensor, out_ref: torch.Tensor) -> None:
            if prefetched:
                self._pending.popleft()
            try:  # the lookup writes each replay's own output (its address read from out_ref): nothing to copy out
                self._step(kind, way, static[0], static[1], bag_size, n_bags, include_last, mode, static[2],
                           out_, layout, prefetched, out_ref, admit)
            finally:  # the host's view of passes and prefetches is settled below, once, for the step that ran
                self._passes, self._pending = passes, deque(pending)

        captures = graphs.captures
        if not graphs.run(key, (ids, offsets, psw), out, body, keep=(layout,), by_ref=True):
            return "first" if graphs.enabled else "failed"
        # what a captured step leaves to the host: the pass count, the prefetch it consumed, the sketch's aging,
        # the recent-window counters
        self._passes = passes + 1
        if prefetched:
            self._pending.popleft()
        elif admit and self.mgr.policy.sketch is not None:
            self.mgr.policy.counted(ids.numel())
        self.recent.push(self.adm_stats)
        return "captured" if graphs.captures != captures else "replayed"

    def _step(self, kind: str, way: int, ids: torch.Tensor, offsets: Optional[torch.Tensor], bag_size: int,
              n_bags: int, include_last: bool, mode: str, psw: Optional[torch.Tensor], out: torch.Tensor,
              layout: Any, prefetched: bool, out_ref: Optional[torch.Tensor] = None, admit: bool = True) -> None:
        """One lookup step as the device runs it: admission pass (or, where ``admit`` is False, only the counts of
        requests, hits and use stamps), the pooled lookup, staged rows released. ``out_ref`` (a CUDA-graph capture):
        the lookup writes where it points when it runs, ``out`` is the shape."""
        mgr = self.mgr
        n = ids.numel()
        capturing = self.cuda and torch.cuda.is_current_stream_capturing()
        _, stage, in_order = _ways_of(kind)[way]
        self._enter(n, stage, "lookup")
        self._next_pass()
        keys = self.keys(ids, offsets, bag_size, include_last, layout)
        in_order = in_order and kind == "single"
        if admit:
            perm = self._pass(keys, "lookup", count_sketch=not prefetched, count_stats=True, stage=stage)
        else:
            perm = self._count_only(keys, in_order)
        order = perm if in_order else None
        if self.cuda:
            op = {"sum": PoolOp.SUM, "mean": PoolOp.MEAN, "max": PoolOp.MAX}[mode]
            out_u8 = out.view(torch.uint8).reshape(-1, mgr.store.row_bytes)
            lookup_pool(ids, offsets, bag_size, n_bags, include_last, op, ElemType.of(mgr.store.dtype), psw, out_u8,
                        self._src, self._tables, self.counters, self.errors.ptr, None, layout, None, order, out_ref)
        else:
            self._lookup_cpu(ids, keys, offsets, bag_size, n_bags, include_last, mode, psw, out, layout)
        if admit:  # a step without the pass staged nothing (the counter still holds the last pass's staged rows)
            self.kern.unstage(self._args("lookup", stage))
        if not capturing:
            self.recent.push(self.adm_stats)

    @_in_state_mode
    def prefetch(self, ids: torch.Tensor, offsets: Optional[torch.Tensor], bag_size: int, include_last: bool,
                 layout: Any) -> None:
        """Admit the rows a coming lookup of ``ids`` will read (counted into the sketch now, not again at that lookup),
        on the manager's side stream after everything enqueued so far; the lookup waits for it. Rows of batches
        prefetched and not yet looked up stay resident (at most their own count is the cache's limit)."""
        n = ids.numel()
        with self.mgr.order.exclusive():  # allocations on the caller's stream, before the side stream runs
            self._enter(n, False, "prefetch")
        with self.mgr.on_side_stream(ids, *(t for t in (offsets,) if t is not None)) as side:
            if self.mgr.form != "stored":  # another thread trained in between: the next lookup admits them itself
                return
            if len(self._pending) >= _MAX_PENDING:  # prefetched and never looked up: stop protecting them
                self._pending.popleft()
            self._pending.append((self._passes + 1, n))
            self._next_pass()
            keys = self.keys(ids, offsets, bag_size, include_last, layout)
            self._pass(keys, "prefetch", count_sketch=True, count_stats=False, stage=False)
            if side:
                if self._done is None:
                    self._done = torch.cuda.Event()
                self._done.record()
        self.prefetches += 1

    # -- CPU: the lookup kernel's reads, then embedding_bag --------------------------------------------
    def _rows_cpu(self, keys: torch.Tensor) -> torch.Tensor:
        """Decoded rows of ``keys`` (zeros for the sentinel), read where the lookup kernel would read them."""
        mgr, store = self.mgr, self.mgr.store
        n_rows, rb = mgr.num_embeddings, store.row_bytes
        out = torch.zeros((keys.numel(), rb), dtype=torch.uint8)
        ok = keys < n_rows
        v = mgr.slot_table[keys].to(torch.int64)
        for where, buf, offs, lens in self._sources_cpu(keys, v, ok):
            rows = torch.nonzero(where).reshape(-1)
            if rows.numel():
                self._decode_cpu(buf, offs[rows], lens[rows], out, rows)
        return out

    def _decode_cpu(self, buf: torch.Tensor, offs: torch.Tensor, lens: torch.Tensor, out: torch.Tensor,
                    at: torch.Tensor) -> None:
        """Rows of ``lens`` bytes at ``offs`` in ``buf`` decoded into rows ``at`` of ``out`` (a row of ``row_bytes``
        stored bytes is raw: the kernels' rule)."""
        lens32 = lens.to(torch.int32)
        comp = (lens32 < self.mgr.store.row_bytes).to(torch.uint8)
        self.mgr.store.codec.decode_rows_at(buf.numpy(), offs.numpy(), lens32.numpy(), out.numpy(), at.numpy(),
                                            compressed=comp.numpy())

    def _host_rows_cpu(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored lengths and byte offsets (int64) of host rows ``rows``."""
        store = self.mgr.store
        lens = store.stored_lengths().to(torch.int64)[rows]
        return lens, store.offsets_cpu[rows] if store.offsets_cpu is not None else rows * store.row_bytes

    def _sources_cpu(self, keys: torch.Tensor, v: torch.Tensor, ok: torch.Tensor) -> list:
        store, rb = self.mgr.store, self.mgr.store.row_bytes
        slab = self.mgr.cached_weight.data.view(torch.uint8).reshape(-1)
        slot_lens = self.slot_len.to(torch.int64)
        host_len, host_off = self._host_rows_cpu(keys.clamp(max=self.mgr.num_embeddings - 1))
        cached = ok & (v >= 0)
        staged = ok & (v <= -2)
        k = (-2 - v).clamp(min=0)
        return [(cached, slab, v.clamp(min=0) * self.slot_bytes, slot_lens[v.clamp(min=0)]),
                (staged, self.stage_buf, k * rb, slot_lens[(self.n_slots + k).clamp(max=slot_lens.numel() - 1)]),
                (ok & (v == -1), store.data, host_off, host_len)]

    def _lookup_cpu(self, ids: torch.Tensor, keys: torch.Tensor, offsets: Optional[torch.Tensor], bag_size: int,
                    n_bags: int, include_last: bool, mode: str, psw: Optional[torch.Tensor], out: torch.Tensor,
                    layout: Any) -> None:
        store = self.mgr.store
        rows = self._rows_cpu(keys).view(store.dtype).view(keys.numel(), -1)
        flat = torch.arange(keys.numel())
        psw = None if psw is None else psw.to(rows.dtype)  # torch's CPU embedding_bag weighs in the rows' dtype
        if offsets is None:  # fixed-size bags
            flat = flat.view(n_bags, -1)
            psw = None if psw is None else psw.view(n_bags, -1)
        pooled = torch.nn.functional.embedding_bag(flat, rows, offsets, mode=mode, per_sample_weights=psw,
                                                   include_last_offset=include_last and offsets is not None)
        t = 1 if layout is None else max(layout.n_tables, 1)
        if t > 1 and not layout.sample_major:  # table-major bags -> [samples, tables, dim]
            pooled = pooled.view(t, -1, pooled.shape[1]).transpose(0, 1)
        out.copy_(pooled.reshape(out.shape))

    # -- statistics -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        adm, pre = self.adm_stats.tolist(), self.pre_stats.tolist()
        requests, device_reads, zero_copy_bytes, slab_bytes = (int(v) for v in self.counters.tolist())
        window = self.recent.delta(self.adm_stats)
        recent = None
        if window is not None and window[1][STAT_REQUESTS]:
            recent = window[1][STAT_HITS] / window[1][STAT_REQUESTS]
        rb = self.mgr.store.row_bytes
        return {"fused_lookups": adm[STAT_REQUESTS], "fused_hits": adm[STAT_HITS],
                "fused_hit_rate": adm[STAT_HITS] / max(adm[STAT_REQUESTS], 1), "fused_hit_rate_recent": recent,
                "fused_recent_calls": window[0] if window is not None else 0,
                "fused_admitted": adm[STAT_ADMITTED] + pre[STAT_ADMITTED], "fused_prefetched_rows": pre[STAT_ADMITTED],
                "fused_staged": adm[STAT_STAGED],
                "fused_host_bytes": adm[STAT_HOST_BYTES] + pre[STAT_HOST_BYTES] + zero_copy_bytes,
                "fused_zero_copy_bytes": zero_copy_bytes, "fused_device_reads": device_reads,
                "fused_raw_host_bytes": (adm[STAT_REQUESTS] - adm[STAT_HITS]) * rb,
                "fused_cache_slots": self.n_slots, "fused_slot_bytes": self.slot_bytes,
                "fused_slot_form": "decoded" if self.decoded else "stored", "fused_slot_form_reason": self.slots_reason,
                "fused_cache_rows_raw": self.mgr.base_slots,
                "fused_staging_bytes": self.stage_buf.numel() if self.stage_buf is not None else 0,
                "fused_calls": self.calls, "fused_prefetches": self.prefetches, "fused_plan": self.planner.plan(),
                "fused_way_steps": {f"{k}: {self.planner.ways[k][w]}": c for (k, w), c in self.way_steps.items()},
                "fused_admission": {**self.pace.stats(), "timed_cycles": self.timed_cycles},
                **({f"fused_{k}": v for k, v in self.graphs.stats().items()} if self.graphs is not None else {}),
                "sketch_halvings": self.mgr.policy.sketch.halvings if self.mgr.policy.sketch is not None else 0}


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
