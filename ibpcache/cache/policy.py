"""Cache policies: which rows live in the slab. Policies hold metadata only; storage is elsewhere.

As in DGL GraphBolt, a policy and the storage it steers are separate objects, and policies are built by
name from a registry (:func:`make_policy`, :meth:`PolicyKind.from_str`).

* ``static`` - rows chosen once from a caller-given hotness score (node degree, or id frequency in a
  presampled trace), packed back to back: the paper's static GPU cache. Compressed rows differ in size,
  so the slab is filled greedily by hotness (see :meth:`StaticPolicy.select`).
* ``lru`` / ``lfu`` - rows admitted on miss (TinyLFU: a missed row enters only where it is requested more often
  than the row it would evict), evicting the least recently / least frequently used row. Dynamic policies manage
  the slab as fixed-size slots of ``slot_bytes`` each (chosen by :func:`choose_slot_bytes`), so any admitted row fits
  any freed slot and the budget always holds.

Why frequencies decide admission for both: on skewed traffic (Zipf-like id streams of recommendation and GNN
workloads) most misses are rows requested once; admitting them evicts rows that come back. A row's request rate is
estimated by a :class:`FrequencySketch` (count-min, four hashed rows, halved every ``32 x slots`` requests so the
estimate follows a drifting hot set) kept on the cache's device and bounded by the cache's size, not the table's.
Admitting a candidate only where its estimate beats its victim's makes every cache converge to the rows a static
cache holding the top-k rows would hold (on a stable trace the hit rate reaches >= 0.95x that oracle in a few hundred
steps, and it never falls when the cache grows; tests/cache/test_convergence.py), and after a shift of the hot set it
recovers within about two halvings (``64 x slots`` requests).

Every dynamic cache keeps its state in one :class:`SlotPolicy`, under one of three admission contracts:

* a read cache (FeatureCache): :meth:`SlotPolicy.record` accounts a batch, :meth:`SlotPolicy.plan` pairs the best
  candidates with the worst slots (exact top-k, host syncs allowed) and admits where the rule says so;
* the trainable row cache (``row_cache.py``): every row of a batch must become resident (the optimizer updates
  them), so it asks :meth:`SlotPolicy.make_room` for slots for all misses (victims by the same key);
* the device contract (the embedding bags' fused inference lookup): per step, on the device, with fixed shapes and no
  host sync -- each distinct missed row samples :data:`SAMPLES` slots, bids for the one with the lowest key and wins
  it when it is worth more than its holder (``kernels/admit.cu``; CPU twin ``kernels/admit_cpu.py``). The policy
  holds the state those kernels read and write (:meth:`SlotPolicy.device_state`).

Dynamic policies never evict a row used by the current batch (or, on the device, by a prefetched batch still to be
looked up), and admit at most one row per slot per batch.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from ..errors import CapacityError, InvalidArgumentError
from ..kernels.admit import (FREE_KEY, PROTECTED_KEY, SKETCH_DEPTH, sketch_add, sketch_estimate, sketch_index,
                             touch as touch_slots)

__all__ = [
    "PolicyKind",
    "EvictionStrategy",
    "CachePolicy",
    "StaticPolicy",
    "FrequencySketch",
    "SlotPolicy",
    "LRUPolicy",
    "LFUPolicy",
    "PriorityPolicy",
    "Admission",
    "FREE",
    "SAMPLES",
    "row_policy",
    "POLICIES",
    "make_policy",
    "choose_slot_bytes",
    "greedy_fill",
]


class PolicyKind(str, enum.Enum):
    """Names of the cache policies."""

    STATIC = "static"
    LRU = "lru"
    LFU = "lfu"

    @classmethod
    def from_str(cls, value: "str | PolicyKind") -> "PolicyKind":
        """Parse a policy name; raise ValueError listing the valid names."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise InvalidArgumentError(f"policy must be one of {[m.value for m in cls]}, got {value!r}") from None


class EvictionStrategy(str, enum.Enum):
    """Which row of the trainable row cache (``row_cache.py``) leaves when a missing one must come in.

    ``LFU``: the lowest request frequency (the policy's sketch estimate). ``LRU``: least recently used.
    ``DATASET``: lowest dataset frequency from ``ids_freq_mapping`` (without one, higher ids are colder,
    Colossal-AI's convention for frequency-sorted tables). Unlike Colossal-AI 0.5 we never renumber ids,
    so a pretrained ``_weight`` keeps its meaning.
    """

    LFU = "lfu"
    DATASET = "dataset"
    LRU = "lru"

    @classmethod
    def coerce(cls, value: Any) -> "EvictionStrategy":
        """Accept our members, their names/values as strings, or any enum member with a matching name
        (so Colossal-AI's ``EvictionStrategy.LFU`` works unchanged)."""
        if isinstance(value, cls):
            return value
        name = value.name if isinstance(value, enum.Enum) else value
        if isinstance(name, str):
            key = name.strip().upper()
            if key in cls.__members__:
                return cls[key]
        raise InvalidArgumentError(f"evict_strategy must be one of {[m.name for m in cls]} (or Colossal-AI's enum), "
                                   f"got {value!r}")


class CachePolicy(abc.ABC):
    """Base of all policies. ``dynamic`` policies admit and evict rows while fetching."""

    kind: ClassVar[PolicyKind]
    dynamic: ClassVar[bool]


# ------------------------------------------------------------------------------------------------
# static
# ------------------------------------------------------------------------------------------------


def greedy_fill(order: torch.Tensor, lengths: torch.Tensor, budget: int, max_passes: int = 8) -> torch.Tensor:
    """Positions (into ``order``) of the rows admitted by a greedy fill of ``budget`` bytes.

    Walk rows in ``order`` (hottest first) and take every row that still fits. Done vectorised in passes:
    each pass admits the longest prefix (in hotness order) of the not-yet-admitted rows that are no larger
    than the space left; rows larger than the space left are skipped for good. Passes stop when nothing
    more fits, so the result is the exact greedy "take it if it fits" walk up to ``max_passes`` rounds.
    """
    lens = lengths[order].to(torch.int64)
    taken = torch.zeros(order.numel(), dtype=torch.bool, device=order.device)
    left = int(budget)
    for _ in range(max_passes):
        open_pos = torch.nonzero(~taken & (lens <= left)).reshape(-1)
        if open_pos.numel() == 0:
            break
        csum = torch.cumsum(lens[open_pos], 0)
        fit = int(torch.searchsorted(csum, torch.tensor([left], device=csum.device), right=True))
        if fit == 0:
            break
        taken[open_pos[:fit]] = True
        left -= int(csum[fit - 1])
    return torch.nonzero(taken).reshape(-1)


class StaticPolicy(CachePolicy):
    """Admit the hottest rows that fit the budget, once, before the first fetch.

    ``hotness``: float/int [n_rows] score (higher = hotter), e.g. node degrees or id counts of a
    presampled trace; ``-inf`` marks a row this cache must never hold (the partitioned cache gives each GPU's
    cache only its own share this way). ``None`` means "no preference": ids in ascending order.
    """

    kind = PolicyKind.STATIC
    dynamic = False

    def __init__(self, hotness: torch.Tensor | None = None) -> None:
        self.hotness = hotness

    def select(self, lengths: torch.Tensor, budget: int) -> torch.Tensor:
        """Row ids to cache, hottest first, whose stored ``lengths`` sum to at most ``budget`` bytes."""
        n = lengths.numel()
        if self.hotness is None:
            order = torch.arange(n, device=lengths.device)
        else:
            hot = self.hotness.reshape(-1)
            if hot.numel() != n:
                raise InvalidArgumentError(f"hotness must have one score per row ({n}), got {hot.numel()}")
            if hot.dtype == torch.bool or hot.is_complex():
                raise InvalidArgumentError(f"hotness must be a real-valued score, got dtype {hot.dtype}")
            hot64 = hot.to(lengths.device).to(torch.float64)
            order = torch.argsort(hot64, descending=True, stable=True)
            if bool(torch.isneginf(hot64).any()):  # construction time only: one host sync is fine
                order = order[: int((~torch.isneginf(hot64)).sum())]
        return order[greedy_fill(order, lengths, budget)]


# ------------------------------------------------------------------------------------------------
# dynamic (slot-based)
# ------------------------------------------------------------------------------------------------


def choose_slot_bytes(lengths: torch.Tensor, budget: int, row_bytes: int, align: int = 1,
                      coverage: "float | None" = None) -> int:
    """Slot size for a dynamic cache: the one that lets it hold the most rows.

    With slots of ``s`` bytes the cache has ``budget // s`` slots but only rows whose stored length is
    ``<= s`` may enter. Without ``coverage`` we pick ``s`` among the distinct stored lengths (rounded up to ``align``)
    to maximise ``min(budget // s, number of rows with length <= s)``: the rows it can hold under uniform access. Ties
    go to the larger ``s`` (more rows eligible). A raw cache, or a dataset where many rows stay raw, gets
    ``s = row_bytes``; a very compressible one (Cora) gets slots close to its longest common compressed rows.

    ``coverage`` (a fraction, e.g. 0.999): the smallest ``s`` that at least that share of the rows fit. For skewed
    traffic: a row that fits no slot is lost to the cache however hot it is, while slots 3% larger cost 3% of the
    capacity, which a Zipf-like hit rate (growing with the log of the capacity) barely notices.
    One histogram of the lengths (O(N), no sort: tables of tens of millions of rows are sized at a layout switch).
    """
    if lengths.numel() == 0 or budget <= 0:
        return row_bytes
    lens = lengths.reshape(-1).cpu().to(torch.int64).clamp(0, row_bytes)
    hist = torch.bincount(lens, minlength=row_bytes + 1)
    cand = torch.nonzero(hist).reshape(-1)  # the distinct stored lengths, ascending
    eligible = torch.cumsum(hist, 0)[cand]
    sizes = torch.clamp((cand + align - 1) // align * align, min=1, max=max(row_bytes, 1))
    if coverage is not None:
        need = torch.tensor([float(coverage) * lens.numel()], dtype=torch.float64)
        first = int(torch.searchsorted(eligible.to(torch.float64), need))  # the first size that many rows fit
        return int(sizes[min(first, sizes.numel() - 1)])
    held = torch.minimum(torch.div(budget, sizes, rounding_mode="floor"), eligible)
    best = held.numel() - 1 - int(torch.argmax(torch.flip(held, (0,))))
    return int(sizes[best])


@dataclass
class Admission:
    """What a dynamic policy decided after a batch: write ``ids[k]`` (= ``cand[picks[k]]``) into
    ``slots[k]``; ``evicted`` ids left the cache (their slots are among ``slots``)."""

    ids: torch.Tensor
    slots: torch.Tensor
    evicted: torch.Tensor
    picks: torch.Tensor

    @property
    def empty(self) -> bool:
        return self.ids.numel() == 0


FREE = FREE_KEY
"""The key a free slot is ranked by: below every occupied slot's, so free slots are filled before anything is
evicted."""

_PROTECTED = PROTECTED_KEY

SAMPLES = 4
"""Victim slots a missed row looks at under the device contract (the lowest key is its victim). Four samples reach
>= 0.95x the static top-k oracle's hit rate on Zipf 1.05 traffic, like eight, at half the reads."""

_MIN_WIDTH = 1 << 12
_MIN_SAMPLE = 1 << 14


class FrequencySketch:
    """Request counts of rows, approximately, in memory bounded by the cache (TinyLFU's frequency estimate).

    A count-min sketch: :data:`~ibpcache.kernels.admit.SKETCH_DEPTH` rows of ``width`` int32 counters (``width`` the
    power of two >= 4 x ``n_slots``, at least 4096); a request adds one to its row's counter in each sketch row and
    the estimate is the minimum of the four (never below the true count since the last halving; above it only by
    collisions). After every ``sample`` counted requests (32 x ``n_slots``) all counters are halved, so old traffic
    fades and a shifted hot set takes over within about two halvings. The halving is decided on the host from the
    number of requests counted (never a device read): on every call of :meth:`add`, including those whose counting
    runs inside a replayed CUDA graph (the caller reports them with ``n``).

    Memory: 16 x ``width`` bytes, 64 to 128 bytes per cache slot; nothing per table row.
    """

    def __init__(self, n_slots: int, device: torch.device, *, width: "int | None" = None,
                 sample: "int | None" = None) -> None:
        want = max(4 * int(n_slots), _MIN_WIDTH) if width is None else int(width)
        if want < 1:
            raise InvalidArgumentError(f"sketch width must be >= 1, got {width!r}")
        self.width = 1 << (want - 1).bit_length()
        self.sample = int(sample) if sample is not None else max(32 * int(n_slots), _MIN_SAMPLE)
        self.table = torch.zeros(SKETCH_DEPTH * self.width, dtype=torch.int32, device=device)
        self.added = 0  # requests counted since the last halving (host-side)
        self.halvings = 0

    @property
    def nbytes(self) -> int:
        return self.table.numel() * 4

    def add(self, ids: torch.Tensor, weights: "torch.Tensor | None" = None) -> bool:
        """Count ``ids`` (int64, duplicates count; ``weights`` int: how many requests each stands for, e.g. 0 for
        padding). Returns whether the counters were halved."""
        if ids.numel() == 0:
            return False
        if ids.is_cuda:  # one launch; the torch expression below takes a dozen (same counters)
            sketch_add(ids, weights, self.table, self.width)
        else:
            self._add_torch(ids, weights)
        return self.counted(ids.numel())

    def _add_torch(self, ids: torch.Tensor, weights: "torch.Tensor | None") -> None:
        """:meth:`add`'s counting as torch ops (the CPU's; on CUDA the reference its kernel is tested against)."""
        idx = sketch_index(ids.reshape(-1), self.width)
        if weights is None:
            src = torch.ones(idx.numel(), dtype=torch.int32, device=idx.device)
        else:
            src = weights.reshape(-1, 1).to(torch.int32).expand_as(idx).reshape(-1)
        self.table.index_add_(0, idx.reshape(-1), src)

    def counted(self, n: int) -> bool:
        """``n`` requests were counted (by :meth:`add` or by a kernel); halve when a sample is complete."""
        self.added += int(n)
        if self.added < self.sample:
            return False
        self.table.bitwise_right_shift_(1)
        self.added //= 2
        self.halvings += 1
        return True

    def estimate(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 estimated request count of every id (the minimum over the sketch rows)."""
        if ids.numel() == 0:
            return torch.zeros(ids.shape, dtype=torch.int64, device=ids.device)
        if ids.is_cuda:
            return sketch_estimate(ids, self.table, self.width)
        return self._estimate_torch(ids)

    def _estimate_torch(self, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`estimate` as torch ops (the CPU's; on CUDA the reference its kernel is tested against)."""
        idx = sketch_index(ids.reshape(-1), self.width)
        return self.table[idx].amin(1).to(torch.int64).view(ids.shape)


@dataclass(frozen=True)
class DeviceState:
    """What the device contract's kernels read and write of a policy (see ``kernels/admit.py`` AdmitArgs): the
    per-slot arrays with their scratch element, the first never-used slot (``fill``, int64 [1]; the device contract
    never frees a slot, so they are a suffix until :meth:`SlotPolicy.reset`), the sketch (None for a static priority)
    or the priority per row."""

    ids: torch.Tensor
    freq: torch.Tensor
    last: torch.Tensor
    fill: torch.Tensor
    n_slots: int
    n_pinned: int
    lru: bool
    samples: int
    sketch: Optional[torch.Tensor]
    width: int
    prio: Optional[torch.Tensor]


class SlotPolicy(CachePolicy):
    """Which row each slot holds and what it is worth: the engine's one dynamic cache policy.

    Per slot (int64, on the cache's device, each array with one scratch element at its end for fixed-shape
    updates): ``slot_ids`` (the row, -1 = free), ``freq`` (the row's request frequency when last used, halved with the
    sketch; a static priority under :class:`PriorityPolicy`) and ``last`` (the clock of its last use). A policy is
    the rule for the key a slot is evicted by (:attr:`score`: lower leaves first) and for a row's worth
    (:meth:`worth`); a candidate replaces a victim only when it is worth more. ``clock`` counts batches
    (:meth:`tick`). Slots ``[0, n_pinned)`` are never evicted (the row cache's padding row). The row cache resizes
    the slots for an oversized batch (:meth:`resize`).
    """

    dynamic = True
    lru = False  # the eviction key: last use (LRU) or frequency (LFU, priority)

    def __init__(self, n_slots: int, n_rows: int, device: torch.device, n_pinned: int = 0,
                 sketch: bool = True) -> None:
        if n_slots < 0:
            raise CapacityError(f"n_slots must be >= 0, got {n_slots}")
        self.n_rows = n_rows
        self.device = device
        self.n_pinned = int(n_pinned)
        self.clock = 0
        self._alloc(n_slots)
        self.sketch = FrequencySketch(max(n_slots, 1), device) if sketch else None

    def _alloc(self, n_slots: int) -> None:
        dev = self.device
        self._ids = torch.full((n_slots + 1,), -1, dtype=torch.int64, device=dev)
        self._freq = torch.zeros(n_slots + 1, dtype=torch.int64, device=dev)
        self._last = torch.zeros(n_slots + 1, dtype=torch.int64, device=dev)
        self._fill = torch.zeros(1, dtype=torch.int64, device=dev)  # device contract: slots >= it never used

    @property
    def n_slots(self) -> int:
        return int(self._ids.numel()) - 1

    @property
    def slot_ids(self) -> torch.Tensor:
        """int64 per slot: the row it holds, -1 = free."""
        return self._ids[:-1]

    @property
    def freq(self) -> torch.Tensor:
        """int64 per slot: the held row's frequency estimate at its last use (or its static priority)."""
        return self._freq[:-1]

    @property
    def last(self) -> torch.Tensor:
        """int64 per slot: the clock (or device step) of the held row's last use."""
        return self._last[:-1]

    @property
    def score(self) -> torch.Tensor:
        """int64 per slot: the eviction key of the held row (lower leaves first)."""
        return self.last if self.lru else self.freq

    @property
    def nbytes(self) -> int:
        """Device bytes of the policy's state."""
        own = (self._ids.numel() + self._freq.numel() + self._last.numel()) * 8
        return own + (self.sketch.nbytes if self.sketch is not None else 0)

    def resident(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, ids) of occupied slots (for rebuilding an index)."""
        slots = torch.nonzero(self.slot_ids >= 0).reshape(-1)
        return slots, self.slot_ids[slots]

    def victim_scores(self) -> torch.Tensor:
        """Per-slot eviction key, lower = evicted first; free slots score :data:`FREE`."""
        return torch.where(self.slot_ids >= 0, self.score, torch.full_like(self.score, FREE))

    # -- frequencies --------------------------------------------------------------------------------
    def count(self, ids: torch.Tensor, weights: "torch.Tensor | None" = None) -> None:
        """Requests of ``ids`` (duplicates count) were seen."""
        if self.sketch is not None and self.sketch.add(ids, weights):
            self.aged()

    def counted(self, n: int) -> None:
        """``n`` requests were counted into the sketch on the device (the device contract's kernels)."""
        if self.sketch is not None and self.sketch.counted(n):
            self.aged()

    def aged(self) -> None:
        """The sketch was halved: so are the frequencies slots keep, so old and new estimates compare."""
        self._freq.bitwise_right_shift_(1)

    def worth(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 what rows ``ids`` are worth to the cache: their estimated request frequency."""
        return self.sketch.estimate(ids)

    def tick(self) -> int:
        """One more batch; returns the clock."""
        self.clock += 1
        return self.clock

    def touch(self, slots: torch.Tensor) -> None:
        """Slots ``slots`` (duplicates allowed) were used by this batch: stamped with the clock, their frequency
        refreshed from the sketch."""
        if slots.numel() == 0:
            return
        if slots.is_cuda and self.sketch is not None:  # worth is the sketch's estimate: one launch for all of it
            touch_slots(slots, self._ids, self._freq, self._last, self.clock, self.sketch.table, self.sketch.width)
            return
        self._last.index_fill_(0, slots, self.clock)
        self._freq.index_copy_(0, slots, self.worth(self._ids.index_select(0, slots)))

    def _protected(self) -> torch.Tensor:
        """Slots this batch used (never victims)."""
        return self.last == self.clock

    # -- read-cache contract ----------------------------------------------------------------------------
    def record(self, ids: torch.Tensor, hit_slots: torch.Tensor) -> None:
        """Account one batch: all requested ``ids`` (duplicates count) and the slot of every hit (one per hit)."""
        self.tick()
        if ids.numel():
            self.count(ids)
        self.touch(hit_slots)

    def plan(self, cand: torch.Tensor, cand_counts: torch.Tensor) -> Admission:
        """Pair the best missed candidates with the worst slots and admit where the candidate is worth more.

        ``cand``: distinct missed ids that may enter (their stored length fits a slot); ``cand_counts``:
        how often each was requested in the batch (ties of worth go to the more requested).
        """
        empty = cand[:0]
        if self.n_slots == 0 or cand.numel() == 0:
            return Admission(empty, empty, empty, empty)
        m = min(cand.numel(), self.n_slots)
        keys = torch.where(self._protected(), torch.full_like(self.score, _PROTECTED), self.victim_scores())
        vkeys, victims = torch.topk(keys, m, largest=False, sorted=True)
        worth = self.worth(cand)
        by_count = torch.argsort(cand_counts, descending=True, stable=True)
        order = by_count[torch.argsort(worth[by_count], descending=True, stable=True)][:m]
        vworth = torch.where(self.slot_ids[victims] >= 0, self.freq[victims], torch.full_like(vkeys, -1))
        take = torch.nonzero((vkeys < _PROTECTED) & (worth[order] > vworth)).reshape(-1)
        if take.numel() == 0:
            return Admission(empty, empty, empty, empty)
        slots = victims[take]
        picks = order[take]
        ids = cand[picks]
        old = self.slot_ids[slots]
        evicted = old[old >= 0]
        self.admit(slots, ids, worth[picks])
        return Admission(ids, slots, evicted, picks)

    # -- row-cache contract ---------------------------------------------------------------------------
    def make_room(self, n: int, protect: torch.Tensor) -> torch.Tensor:
        """Slots for ``n`` rows that must all enter: free slots first, then occupied ones from the lowest key up,
        never a pinned slot or one in ``protect`` (int64 slots the batch uses; negative entries are ignored).
        The caller makes sure there are enough (:meth:`resize`). Returned in that order."""
        n_slots = self.n_slots
        key = torch.empty(n_slots + 1, dtype=torch.int64, device=self.device)
        key[:n_slots].copy_(self._room_keys())
        key.index_fill_(0, torch.where(protect >= 0, protect, n_slots), _PROTECTED)
        return torch.topk(key[self.n_pinned:n_slots], n, largest=False, sorted=True).indices + self.n_pinned

    def admit(self, slots: torch.Tensor, ids: torch.Tensor, worth: "torch.Tensor | None" = None) -> None:
        """Rows ``ids`` now occupy ``slots``, used now and worth ``worth`` (default: :meth:`worth`)."""
        self._ids.index_copy_(0, slots, ids)
        self._freq.index_copy_(0, slots, self.worth(ids) if worth is None else worth.to(torch.int64))
        self._last.index_fill_(0, slots, self.clock)

    def free(self, slots: torch.Tensor) -> None:
        """Mark ``slots`` empty."""
        self._ids.index_fill_(0, slots, -1)

    def resize(self, n_slots: int) -> None:
        """Grow (new slots free) or cut to ``n_slots`` slots (the caller has emptied the ones cut)."""
        have = self.n_slots
        if n_slots == have:
            return
        ids, freq, last = self.slot_ids, self.freq, self.last
        self._alloc(n_slots)
        k = min(have, n_slots)
        self._ids[:k] = ids[:k]
        self._freq[:k] = freq[:k]
        self._last[:k] = last[:k]

    def reset(self, n_slots: int, n_pinned: "int | None" = None) -> None:
        """Empty every slot and make ``n_slots`` of them (frequencies seen so far are kept). Under the device contract
        the never-used slots (from ``fill`` on, all of them now) go to the first misses in order, without bids."""
        if n_pinned is not None:
            self.n_pinned = int(n_pinned)
        self._alloc(n_slots)

    def _room_keys(self) -> torch.Tensor:
        """The eviction key :meth:`make_room` ranks by (the forced-admission contract)."""
        return self.victim_scores()

    # -- device contract ----------------------------------------------------------------------------
    def device_state(self) -> DeviceState:
        """The state the per-step admission kernels work on (the arrays themselves, scratch element included)."""
        sk = self.sketch
        return DeviceState(self._ids, self._freq, self._last, self._fill, self.n_slots, self.n_pinned, self.lru, SAMPLES,
                           None if sk is None else sk.table, 1 if sk is None else sk.width, self._priority_table())

    def _priority_table(self) -> Optional[torch.Tensor]:
        return None


class LRUPolicy(SlotPolicy):
    """Least recently used: a slot's key is the batch it was last used in; a missed row enters only in place of a
    row it is requested more often than (TinyLFU admission, so one-off rows do not flush the cache).

    Where every missed row must enter (the row cache's training batches) there is no admission filter, so eviction
    goes by frequency class first: rows are grouped by the power of two of their request frequency, the rarest group
    leaves first, least recent first within a group -- one-off rows pass through without flushing the hot ones, and
    recency still decides among rows about as frequent."""

    kind = PolicyKind.LRU
    lru = True

    def _room_keys(self) -> torch.Tensor:
        level = torch.floor(2.0 * torch.log2(self.freq.clamp(min=0).to(torch.float64) + 1.0)).to(torch.int64)
        return torch.where(self.slot_ids >= 0, (level << 40) + self.last, torch.full_like(self.last, FREE))


class LFUPolicy(SlotPolicy):
    """Least frequently used: a slot's key is its row's request frequency (the sketch's estimate, refreshed at every
    use, halved with the sketch so a shifted hot set takes over); a missed row replaces the least frequent resident
    row only if it is requested strictly more often, so equally hot rows do not churn."""

    kind = PolicyKind.LFU


class PriorityPolicy(SlotPolicy):
    """A static priority per id (uses change nothing): ``priority[id]``, or without one ``n_rows - id`` (low ids hot:
    Colossal-AI's convention for frequency-sorted tables). The row cache's ``DATASET`` strategy."""

    def __init__(self, n_slots: int, n_rows: int, device: torch.device, n_pinned: int = 0,
                 priority: "torch.Tensor | None" = None) -> None:
        super().__init__(n_slots, n_rows, device, n_pinned, sketch=False)
        self.priority = None if priority is None else priority.to(device, torch.int64)

    def worth(self, ids: torch.Tensor) -> torch.Tensor:
        return self.priority[ids] if self.priority is not None else self.n_rows - ids

    def aged(self) -> None:
        pass

    def _priority_table(self) -> Optional[torch.Tensor]:
        if self.priority is None:  # the device contract reads a table: n_rows - id, materialised once
            self.priority = torch.arange(self.n_rows, 0, -1, dtype=torch.int64, device=self.device)
        return self.priority

    @property
    def nbytes(self) -> int:
        return super().nbytes + (0 if self.priority is None else self.priority.numel() * 8)


def row_policy(strategy: "EvictionStrategy | str", n_slots: int, n_rows: int, device: torch.device, *,
               n_pinned: int = 0, priority: "torch.Tensor | None" = None) -> SlotPolicy:
    """The row cache's policy for an :class:`EvictionStrategy`: LFU by request frequency, LRU, or DATASET
    (``priority``: the dataset frequency of each id, or None for low ids hot)."""
    strategy = EvictionStrategy.coerce(strategy)
    if strategy is EvictionStrategy.LFU:
        return LFUPolicy(n_slots, n_rows, device, n_pinned)
    if strategy is EvictionStrategy.LRU:
        return LRUPolicy(n_slots, n_rows, device, n_pinned)
    return PriorityPolicy(n_slots, n_rows, device, n_pinned, priority)


POLICIES: dict[PolicyKind, type[CachePolicy]] = {
    PolicyKind.STATIC: StaticPolicy,
    PolicyKind.LRU: LRUPolicy,
    PolicyKind.LFU: LFUPolicy,
}
"""Registry: policy name -> class."""


def make_policy(kind: "str | PolicyKind", *, hotness: torch.Tensor | None = None, n_slots: int = 0,
                n_rows: int = 0, device: torch.device | str = "cpu") -> CachePolicy:
    """Build a policy by name. ``hotness`` is used by ``static`` only; ``n_slots`` by the dynamic ones."""
    cls = POLICIES[PolicyKind.from_str(kind)]
    if cls is StaticPolicy:
        return StaticPolicy(hotness)
    return cls(n_slots, n_rows, torch.device(device))  # type: ignore[call-arg]
