"""Cache policies: which rows live in the slab. Policies hold metadata only; storage is elsewhere.

As in DGL GraphBolt, a policy and the storage it steers are separate objects, and policies are built by
name from a registry (:func:`make_policy`, :meth:`PolicyKind.from_str`).

* ``static`` - rows chosen once from a caller-given hotness score (node degree, or id frequency in a
  presampled trace), packed back to back: the paper's static GPU cache. Compressed rows differ in size,
  so the slab is filled greedily by hotness (see :meth:`StaticPolicy.select`).
* ``lru`` / ``lfu`` - rows admitted on miss, evicting the least recently / least frequently used row.
  Dynamic policies manage the slab as fixed-size slots of ``slot_bytes`` each (chosen by
  :func:`choose_slot_bytes`), so any admitted row fits any freed slot and the budget always holds. Their
  bookkeeping is vectorised torch code on the cache's device, run once per batch after the fetch has been
  served; it never loops over ids in Python.

Dynamic policies never evict a row that was hit in the current batch (LRU: its stamp is the newest; LFU:
the candidate must be strictly more frequent than the victim), and admit at most one row per slot per
batch, so batches with more distinct ids than slots are served (the surplus comes from host) and the
policy keeps its best candidates.

The trainable row cache of the embedding bags (``row_cache.py``) keeps its eviction state in the same
:class:`SlotPolicy` objects (:func:`row_policy` maps its :class:`EvictionStrategy`), under its own admission
contract: every row of a batch must become resident (the optimizer updates them), so it asks for room for all
misses instead of a plan.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import CapacityError, InvalidArgumentError

__all__ = [
    "PolicyKind",
    "EvictionStrategy",
    "CachePolicy",
    "StaticPolicy",
    "SlotPolicy",
    "LRUPolicy",
    "LFUPolicy",
    "PriorityPolicy",
    "Admission",
    "FREE",
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

    ``LFU``: fewest uses since admission (Colossal-AI's default). ``LRU``: least recently used.
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


def choose_slot_bytes(lengths: torch.Tensor, budget: int, row_bytes: int, align: int = 1) -> int:
    """Slot size for a dynamic cache: the one that lets it hold the most rows.

    With slots of ``s`` bytes the cache has ``budget // s`` slots but only rows whose stored length is
    ``<= s`` may enter. We pick ``s`` among the distinct stored lengths (rounded up to ``align``) to maximise
    ``min(budget // s, number of rows with length <= s)``: the rows it can hold under uniform access. Ties
    go to the larger ``s`` (more rows eligible). A raw cache, or a dataset where many rows stay raw, gets
    ``s = row_bytes``; a very compressible one (Cora) gets slots close to its longest common compressed rows.
    """
    if lengths.numel() == 0 or budget <= 0:
        return row_bytes
    lens = torch.sort(lengths.to(torch.int64).reshape(-1).cpu()).values
    cand, counts = torch.unique_consecutive(lens, return_counts=True)
    eligible = torch.cumsum(counts, 0)
    sizes = torch.clamp((cand + align - 1) // align * align, max=max(row_bytes, 1))
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


FREE = torch.iinfo(torch.int64).min
"""The score a free slot is ranked by: below every occupied slot's, so free slots are filled before anything is
evicted."""

_PROTECTED = torch.iinfo(torch.int64).max


class SlotPolicy(CachePolicy):
    """Which id each slot holds (-1 = free) and one int64 score per slot: lower is evicted first.

    Every dynamic cache of the engine keeps its eviction state here, through one of two admission contracts:

    * a read cache (FeatureCache) may leave misses uncached: :meth:`record` accounts a batch, then :meth:`plan`
      pairs the best missed candidates with the worst slots and admits a candidate only where it beats its victim;
    * the trainable row cache (``row_cache.py``) must make every row of a batch resident, because the optimizer
      updates them: :meth:`make_room` picks slots for all misses (free first, then the lowest scores, never a slot
      the batch uses), :meth:`admit` fills them, and :meth:`touch` accounts every slot the batch used.

    A policy is the rule for the score a row starts with when admitted (:meth:`_start`) and for what a use does to
    it (:meth:`touch`); ``clock`` counts batches (:meth:`tick`). Slots ``[0, n_pinned)`` are never evicted (the row
    cache's padding row). The row cache resizes the slots for an oversized batch (:meth:`resize`).
    """

    dynamic = True

    def __init__(self, n_slots: int, n_rows: int, device: torch.device, n_pinned: int = 0) -> None:
        if n_slots < 0:
            raise CapacityError(f"n_slots must be >= 0, got {n_slots}")
        self.n_rows = n_rows
        self.device = device
        self.n_pinned = int(n_pinned)
        self.clock = 0
        self.slot_ids = torch.full((n_slots,), -1, dtype=torch.int64, device=device)
        self.score = torch.zeros(n_slots, dtype=torch.int64, device=device)

    @property
    def n_slots(self) -> int:
        return int(self.slot_ids.numel())

    @property
    def nbytes(self) -> int:
        """Device bytes of the policy's state."""
        return (self.slot_ids.numel() + self.score.numel()) * 8

    def resident(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, ids) of occupied slots (for rebuilding an index)."""
        slots = torch.nonzero(self.slot_ids >= 0).reshape(-1)
        return slots, self.slot_ids[slots]

    def victim_scores(self) -> torch.Tensor:
        """Per-slot score, lower = evicted first; free slots score :data:`FREE`."""
        return torch.where(self.slot_ids >= 0, self.score, torch.full_like(self.score, FREE))

    # -- the rule -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _start(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 score of rows ``ids`` admitted now."""

    @abc.abstractmethod
    def touch(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        """Slots ``slots`` (duplicates allowed) were used ``counts`` times each in this batch."""

    def _count(self, ids: torch.Tensor) -> None:
        """Hook: every requested id of a read-cache batch (duplicates count), hit or miss."""

    def _candidates(self, cand: torch.Tensor, cand_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(order, scores): ``cand[order]`` best first, and the score each of those would start with."""
        scores = self._start(cand)
        order = torch.argsort(scores, descending=True, stable=True)
        return order, scores[order]

    def tick(self) -> int:
        """One more batch; returns the clock."""
        self.clock += 1
        return self.clock

    # -- read-cache contract ----------------------------------------------------------------------------
    def record(self, ids: torch.Tensor, hit_slots: torch.Tensor) -> None:
        """Account one batch: all requested ``ids`` (duplicates count) and the slot of every hit (one per hit)."""
        self.tick()
        if ids.numel():
            self._count(ids)
        if hit_slots.numel():
            self.touch(hit_slots, torch.ones_like(hit_slots))

    def plan(self, cand: torch.Tensor, cand_counts: torch.Tensor) -> Admission:
        """Pair the best missed candidates with the worst slots and admit where the candidate scores higher.

        ``cand``: distinct missed ids that may enter (their stored length fits a slot); ``cand_counts``:
        how often each was requested in the batch.
        """
        empty = cand[:0]
        if self.n_slots == 0 or cand.numel() == 0:
            return Admission(empty, empty, empty, empty)
        m = min(cand.numel(), self.n_slots)
        victim_scores, victims = torch.topk(self.victim_scores(), m, largest=False, sorted=True)
        order, cand_scores = self._candidates(cand, cand_counts)
        take = cand_scores[:m] > victim_scores
        k = int(take.sum())  # the admissible pairs form a prefix (best candidate vs worst victim)
        if k == 0:
            return Admission(empty, empty, empty, empty)
        slots = victims[:k]
        picks = order[:k]
        ids = cand[picks]
        old = self.slot_ids[slots]
        evicted = old[old >= 0]
        self.admit(slots, ids)
        return Admission(ids, slots, evicted, picks)

    # -- row-cache contract ---------------------------------------------------------------------------
    def make_room(self, n: int, protect: torch.Tensor) -> torch.Tensor:
        """Slots for ``n`` rows that must all enter: free slots first, then occupied ones from the lowest score
        up, never a pinned slot or one in ``protect`` (int64 slots the batch uses; negative entries are ignored).
        The caller makes sure there are enough (:meth:`resize`). Returned in that order."""
        n_slots = self.n_slots
        key = torch.empty(n_slots + 1, dtype=torch.int64, device=self.device)
        key[:n_slots].copy_(self.victim_scores())
        key.index_fill_(0, torch.where(protect >= 0, protect, n_slots), _PROTECTED)
        return torch.topk(key[self.n_pinned:n_slots], n, largest=False, sorted=True).indices + self.n_pinned

    def admit(self, slots: torch.Tensor, ids: torch.Tensor, scores: "torch.Tensor | None" = None) -> None:
        """Rows ``ids`` now occupy ``slots``, starting at ``scores`` (default: the policy's start score)."""
        self.slot_ids.index_copy_(0, slots, ids)
        self.score.index_copy_(0, slots, self._start(ids) if scores is None else scores.to(torch.int64))

    def free(self, slots: torch.Tensor) -> None:
        """Mark ``slots`` empty."""
        self.slot_ids.index_fill_(0, slots, -1)

    def resize(self, n_slots: int) -> None:
        """Grow (new slots free) or cut to ``n_slots`` slots (the caller has emptied the ones cut)."""
        have = self.n_slots
        if n_slots > have:
            self.slot_ids = torch.cat([self.slot_ids, self.slot_ids.new_full((n_slots - have,), -1)])
            self.score = torch.cat([self.score, self.score.new_zeros(n_slots - have)])
        elif n_slots < have:
            self.slot_ids = self.slot_ids[:n_slots].clone()
            self.score = self.score[:n_slots].clone()


class LRUPolicy(SlotPolicy):
    """Least recently used: a slot's score is the batch (``clock``) it was last used in."""

    kind = PolicyKind.LRU

    def _start(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.full_like(ids, self.clock, dtype=torch.int64)

    def touch(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        self.score.index_fill_(0, slots, self.clock)

    def _candidates(self, cand: torch.Tensor, cand_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # all candidates are equally recent (they would start at the clock, so a row hit in this batch, scored the
        # clock too, is never their victim); prefer ids requested more often in this batch
        order = torch.argsort(cand_counts, descending=True, stable=True)
        return order, self._start(cand)


class LFUPolicy(SlotPolicy):
    """Least frequently used: a slot's score counts its row's requests.

    ``since_admission=False`` (FeatureCache): exact per-id request counts over the cache's lifetime (int32 per row on
    the device; they never decay, which suits stationary skew such as degree-driven GNN sampling). An admitted row
    starts at its count, so a missed id replaces the least frequent resident row only if it was requested strictly
    more often, and equally hot rows do not churn. ``since_admission=True`` (the row cache, as Colossal-AI's
    ``CachedParamMgr``): a row's uses since it entered; nothing is kept per table row.
    """

    kind = PolicyKind.LFU

    def __init__(self, n_slots: int, n_rows: int, device: torch.device, n_pinned: int = 0,
                 since_admission: bool = False) -> None:
        super().__init__(n_slots, n_rows, device, n_pinned)
        self.since_admission = bool(since_admission)
        self.freq = None if since_admission else torch.zeros(n_rows, dtype=torch.int32, device=device)

    def _count(self, ids: torch.Tensor) -> None:
        if self.freq is not None:
            self.freq.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def _start(self, ids: torch.Tensor) -> torch.Tensor:
        if self.freq is None:
            return torch.zeros_like(ids, dtype=torch.int64)
        return self.freq[ids].to(torch.int64)

    def touch(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        self.score.index_add_(0, slots, counts.to(torch.int64))

    @property
    def nbytes(self) -> int:
        return super().nbytes + (0 if self.freq is None else self.freq.numel() * 4)


class PriorityPolicy(SlotPolicy):
    """A static priority per id, set when the row enters (uses change nothing): ``priority[id]``, or without one
    ``n_rows - id`` (low ids hot: Colossal-AI's convention for frequency-sorted tables). The row cache's
    ``DATASET`` strategy."""

    def __init__(self, n_slots: int, n_rows: int, device: torch.device, n_pinned: int = 0,
                 priority: "torch.Tensor | None" = None) -> None:
        super().__init__(n_slots, n_rows, device, n_pinned)
        self.priority = None if priority is None else priority.to(device, torch.int64)

    def _start(self, ids: torch.Tensor) -> torch.Tensor:
        return self.priority[ids] if self.priority is not None else self.n_rows - ids

    def touch(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return super().nbytes + (0 if self.priority is None else self.priority.numel() * 8)


def row_policy(strategy: "EvictionStrategy | str", n_slots: int, n_rows: int, device: torch.device, *,
               n_pinned: int = 0, priority: "torch.Tensor | None" = None) -> SlotPolicy:
    """The row cache's policy for an :class:`EvictionStrategy`: LFU counts uses since admission, LRU, or DATASET
    (``priority``: the dataset frequency of each id, or None for low ids hot)."""
    strategy = EvictionStrategy.coerce(strategy)
    if strategy is EvictionStrategy.LFU:
        return LFUPolicy(n_slots, n_rows, device, n_pinned, since_admission=True)
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
