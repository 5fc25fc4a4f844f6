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
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import CapacityError

__all__ = [
    "PolicyKind",
    "EvictionStrategy",
    "CachePolicy",
    "StaticPolicy",
    "SlotPolicy",
    "LRUPolicy",
    "LFUPolicy",
    "Admission",
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
            raise ValueError(f"policy must be one of {[m.value for m in cls]}, got {value!r}") from None


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
        raise ValueError(f"evict_strategy must be one of {[m.name for m in cls]} (or Colossal-AI's enum), "
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
                raise ValueError(f"hotness must have one score per row ({n}), got {hot.numel()}")
            if hot.dtype == torch.bool or hot.is_complex():
                raise ValueError(f"hotness must be a real-valued score, got dtype {hot.dtype}")
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


class SlotPolicy(CachePolicy):
    """Shared state of slot-based dynamic policies: which id occupies each slot (-1 = free)."""

    dynamic = True

    def __init__(self, n_slots: int, n_rows: int, device: torch.device) -> None:
        if n_slots < 0:
            raise CapacityError(f"n_slots must be >= 0, got {n_slots}")
        self.n_slots = n_slots
        self.n_rows = n_rows
        self.device = device
        self.slot_ids = torch.full((n_slots,), -1, dtype=torch.int64, device=device)

    def resident(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, ids) of occupied slots (for rebuilding an index)."""
        slots = torch.nonzero(self.slot_ids >= 0).reshape(-1)
        return slots, self.slot_ids[slots]

    @abc.abstractmethod
    def _victim_scores(self) -> torch.Tensor:
        """Per-slot score, lower = evict first; free slots must score lowest."""

    @abc.abstractmethod
    def record(self, ids: torch.Tensor, hit_slots: torch.Tensor) -> None:
        """Account one batch: all requested ``ids`` (duplicates count) and the slots that were hit."""

    @abc.abstractmethod
    def _admissible(self, cand: torch.Tensor, cand_counts: torch.Tensor,
                    victim_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(order, take): ``cand[order]`` is best first; ``take[j]`` says pairing candidate ``order[j]``
        with victim j is worth it."""

    def plan(self, cand: torch.Tensor, cand_counts: torch.Tensor) -> Admission:
        """Pair the best missed candidates with the worst slots and update the slot table.

        ``cand``: distinct missed ids that may enter (their stored length fits a slot); ``cand_counts``:
        how often each was requested in the batch.
        """
        empty = cand[:0]
        if self.n_slots == 0 or cand.numel() == 0:
            return Admission(empty, empty, empty, empty)
        scores = self._victim_scores()
        m = min(cand.numel(), self.n_slots)
        victim_scores, victims = torch.topk(scores, m, largest=False, sorted=True)
        order, take = self._admissible(cand, cand_counts, victim_scores)
        k = int(take[:m].sum())  # the admissible pairs form a prefix (best candidate vs worst victim)
        if k == 0:
            return Admission(empty, empty, empty, empty)
        slots = victims[:k]
        picks = order[:k]
        ids = cand[picks]
        old = self.slot_ids[slots]
        evicted = old[old >= 0]
        self.slot_ids[slots] = ids
        self._admitted(slots, ids)
        return Admission(ids, slots, evicted, picks)

    def free(self, slots: torch.Tensor) -> None:
        """Mark ``slots`` empty (used when an index rebuild drops a duplicate)."""
        self.slot_ids[slots] = -1

    def _admitted(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Hook: initialise per-slot state of newly admitted rows."""


class LRUPolicy(SlotPolicy):
    """Least recently used: evict the slots whose last hit is oldest; a batch is one time step."""

    kind = PolicyKind.LRU

    def __init__(self, n_slots: int, n_rows: int, device: torch.device) -> None:
        super().__init__(n_slots, n_rows, device)
        self.clock = 0
        self.last_used = torch.full((n_slots,), -1, dtype=torch.int64, device=device)

    def record(self, ids: torch.Tensor, hit_slots: torch.Tensor) -> None:
        self.clock += 1
        if hit_slots.numel():
            self.last_used[hit_slots] = self.clock

    def _victim_scores(self) -> torch.Tensor:
        return torch.where(self.slot_ids >= 0, self.last_used, torch.full_like(self.last_used, -1))

    def _admissible(self, cand, cand_counts, victim_scores):
        # all candidates are equally recent; prefer ids requested more often in this batch
        order = torch.argsort(cand_counts, descending=True, stable=True)
        return order, victim_scores < self.clock  # never evict a row hit in this batch

    def _admitted(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        self.last_used[slots] = self.clock


class LFUPolicy(SlotPolicy):
    """Least frequently used, with exact per-id request counts (int32 per row on the device).

    A missed id replaces the least frequent resident row only if it was requested strictly more often,
    so equally hot rows do not churn. Counts never decay (suits stationary skew such as degree-driven
    GNN sampling).
    """

    kind = PolicyKind.LFU

    def __init__(self, n_slots: int, n_rows: int, device: torch.device) -> None:
        super().__init__(n_slots, n_rows, device)
        self.freq = torch.zeros(n_rows, dtype=torch.int32, device=device)

    def record(self, ids: torch.Tensor, hit_slots: torch.Tensor) -> None:
        if ids.numel():
            self.freq.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def _victim_scores(self) -> torch.Tensor:
        occupied = self.slot_ids >= 0
        freq = self.freq[self.slot_ids.clamp(min=0)].to(torch.int64)
        return torch.where(occupied, freq, torch.full_like(freq, -1))

    def _admissible(self, cand, cand_counts, victim_scores):
        cand_freq = self.freq[cand].to(torch.int64)
        order = torch.argsort(cand_freq, descending=True, stable=True)
        m = victim_scores.numel()
        return order, cand_freq[order][:m] > victim_scores

    @property
    def nbytes(self) -> int:
        return self.freq.numel() * 4


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
