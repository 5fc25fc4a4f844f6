"""Path planner of the fused lookup: which of a few ways runs a lookup step fastest, per kind and batch shape, timed
as it runs.

The embedding bags' fused inference lookup (``row_cache.FusedLookup``) can stage a step's missed rows (each read from
host memory once) or leave them to zero-copy reads, and take one-id bags in row order or as given. Which is faster
depends on the batch, the table, the hit rate and the machine, so :class:`PathPlanner` times the ways on the live
traffic and keeps the fastest. Decisions must not depend on which timings it happened to see (two identical modules
must run alike), so: the ways are interleaved while timing (each sees the same cache states, also while the cache is
still warming up), every way is timed ``trials`` times and the first timing of each is dropped (kernel builds,
allocations), the medians decide, an incumbent is replaced only by a way faster by ``margin``, and the ways are
timed again ``first_recheck`` steps after the first decision, then at intervals growing 4x up to ``recheck_every``
(the traffic or the hit rate may have changed). Why early rechecks: the first timings run while a new cache is still
filling, when misses and admissions dominate every way; a choice made then can be 20-25% slower in the steady state
(two identical DLRM modules picked different ways and ran 0.32 vs 0.40 ms per step), so the warm cache's way is
chosen within a few hundred steps instead of after ``recheck_every``. Each batch shape (bag count) is planned on
its own, and once per phase of the owner's cache (:meth:`PathPlanner.set_phase`): a settled cache skips most admission
passes on its unstaged ways and never on a staged one, so the ways' costs differ between a cache that is filling or
following a moved hot set and a settled one (two identical modules ran 13% apart when one had chosen the staged way,
which never skips a pass, on timings taken before its cache settled). A phase's plan is timed the first time the
phase is entered, starting from the other phase's choice as its incumbent; later it resumes where it was, so a cache
whose hot set drifts (settled, unsettled, settled again) runs each phase's way from the step it enters it instead of
timing every way again at each settle. Timings are CUDA events read once they have completed: never a sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["PathPlanner"]


@dataclass
class _Plan:
    """One (kind, shape)'s state: timings of the current round per way, events still running, the choice."""

    n_ways: int
    times: list = field(default_factory=list)
    dropped: set = field(default_factory=set)
    pending: list = field(default_factory=list)
    choice: Optional[int] = None
    calibrating: bool = True
    since: int = 0
    rounds: int = 0
    interval: int = 0  # steps on the choice before the ways are timed again
    medians: Optional[list] = None

    def __post_init__(self) -> None:
        self.times = [[] for _ in range(self.n_ways)]

    def restart(self) -> None:
        """Time the ways again from the next step; the incumbent stays unless beaten by the margin."""
        self.calibrating = True
        self.times = [[] for _ in range(self.n_ways)]
        self.dropped = set()


class PathPlanner:
    """Picks one of a few ways per kind of lookup and batch shape from timings on this machine (see the module
    docstring). ``ways``: kind -> the labels of its ways (the caller maps a way's index to what it does)."""

    def __init__(self, ways: dict[str, tuple[str, ...]], trials: int = 8, margin: float = 0.05,
                 recheck_every: int = 2048, first_recheck: int = 64) -> None:
        if trials < 1 or recheck_every < 1 or first_recheck < 1 or not 0.0 <= margin < 1.0:
            raise InvalidArgumentError(f"PathPlanner: trials, recheck_every and first_recheck must be >= 1 and margin "
                                       f"in [0, 1), got {trials}, {recheck_every}, {first_recheck}, {margin}")
        self.ways = {k: tuple(v) for k, v in ways.items()}
        self.trials = int(trials)
        self.margin = float(margin)
        self.recheck_every = int(recheck_every)
        self.first_recheck = min(int(first_recheck), self.recheck_every)
        self._plans: dict[tuple[str, int, bool], _Plan] = {}
        self._fixed: dict[str, int] = {}
        self.settled = False  # the owner's cache skips admission passes (see set_phase)
        self.phase_changes = 0

    def _plan(self, kind: str, n: int) -> _Plan:
        key = (kind, int(n), self.settled)
        plan = self._plans.get(key)
        if plan is None:
            if kind not in self.ways:
                raise InvalidArgumentError(f"kind must be one of {sorted(self.ways)}, got {kind!r}")
            plan = self._plans[key] = _Plan(len(self.ways[kind]))
            if plan.n_ways == 1:  # nothing to time, ever
                plan.choice, plan.calibrating, plan.interval = 0, False, np.iinfo(np.int64).max
            else:  # the other phase's choice is the incumbent: kept unless a way beats it by the margin
                other = self._plans.get((kind, int(n), not self.settled))
                plan.choice = other.choice if other is not None else None
        return plan

    def fix(self, kind: str, way: "int | str | None") -> None:
        """Pin a kind of lookup to one way (its index or label) for every shape; ``None`` lets timings decide again."""
        if kind not in self.ways:
            raise InvalidArgumentError(f"kind must be one of {sorted(self.ways)}, got {kind!r}")
        if way is None:
            self._fixed.pop(kind, None)
            return
        if isinstance(way, str):
            if way not in self.ways[kind]:
                raise InvalidArgumentError(f"way must be one of {self.ways[kind]}, got {way!r}")
            way = self.ways[kind].index(way)
        if not 0 <= int(way) < len(self.ways[kind]):
            raise InvalidArgumentError(f"way must be in [0, {len(self.ways[kind])}), got {way!r}")
        self._fixed[kind] = int(way)

    def set_phase(self, settled: bool) -> None:
        """The owner's cache is settled (skips most admission passes on its unstaged ways, never on a staged one) or
        not (filling, or following a moved hot set): from the next step every kind and shape runs that phase's plan,
        timed now if the phase is new to it (see the module docstring). Timings taken in one phase never decide the
        other's way."""
        settled = bool(settled)
        if settled != self.settled:
            self.settled = settled
            self.phase_changes += 1

    def calibrating(self, kind: str, n: int) -> bool:
        """Are the ways of this kind and shape being timed now?"""
        return kind not in self._fixed and self._plan(kind, n).calibrating

    def timing(self, kind: str, n: int) -> bool:
        """Should the caller time this step (and :meth:`record` it)?"""
        return self.calibrating(kind, n)

    def choose(self, kind: str, n: int, capturing: bool = False) -> int:
        """The way to run this step: the chosen one, or while timing, the way with the fewest timings so far (so the
        ways interleave); under CUDA graph capture the chosen one (or the first) and nothing is timed."""
        if kind in self._fixed:
            return self._fixed[kind]
        plan = self._plan(kind, n)
        if not capturing:  # querying events is not allowed while a stream is being captured
            self._collect(plan)
        if capturing:
            return plan.choice if plan.choice is not None else 0
        if not plan.calibrating:
            plan.since += 1
            if plan.since < plan.interval:
                return plan.choice
            plan.restart()
        counts = [len(plan.times[w]) + sum(1 for p in plan.pending if p[0] == w) + (w in plan.dropped)
                  for w in range(plan.n_ways)]
        if min(len(t) for t in plan.times) >= self.trials:
            self._decide(plan)
            return plan.choice
        return int(np.argmin(counts))

    def record(self, kind: str, n: int, way: int, start: Any, end: Any) -> None:
        """A timed step of ``way`` ran between CUDA events ``start`` and ``end``."""
        self.record_steps(kind, n, way, [(start, end)])

    def record_steps(self, kind: str, n: int, way: int, spans: list) -> None:
        """Steps of ``way`` that make one sample, each timed between its own (start, end) CUDA events: a way whose
        steps differ in a fixed cycle is judged on their mean. Each step is timed on its own, so that the host's
        gaps between them (the caller's work, its syncs) count for no way."""
        if kind in self._fixed or not spans:
            return
        self._plan(kind, n).pending.append((int(way), list(spans)))

    def _collect(self, plan: _Plan) -> None:
        keep = []
        for way, spans in plan.pending:
            if not all(end.query() for _, end in spans):
                keep.append((way, spans))
            elif way not in plan.dropped:  # a way's first timing pays for builds and allocations
                plan.dropped.add(way)
            else:
                plan.times[way].append(sum(s.elapsed_time(e) for s, e in spans) / len(spans))
        plan.pending = keep

    def _decide(self, plan: _Plan) -> None:
        med = [float(np.median(t)) for t in plan.times]
        best = int(np.argmin(med))
        if plan.choice is not None and med[best] > med[plan.choice] * (1.0 - self.margin):
            best = plan.choice  # not faster by the margin: no switch (hysteresis)
        plan.choice = best
        plan.calibrating = False
        plan.since = 0
        plan.interval = self.first_recheck if plan.rounds == 0 else min(4 * plan.interval, self.recheck_every)
        plan.rounds += 1
        plan.medians = med
        plan.pending = []

    def plan(self) -> dict[str, Any]:
        """For stats(): per kind, shape and phase (", settled") the way chosen (or "calibrating") and the medians it
        was chosen by."""
        out: dict[str, Any] = {}
        for (kind, n, settled), plan in sorted(self._plans.items()):
            self._collect(plan)
            label = f"{kind} {n} bags" + (", settled" if settled else "")
            if plan.choice is None:
                out[label] = "calibrating"
            else:
                out[label] = self.ways[kind][plan.choice]
                if plan.medians is not None:
                    out[label + " ms"] = {self.ways[kind][w]: round(m, 4) for w, m in enumerate(plan.medians)}
        for kind, way in self._fixed.items():
            out[f"{kind} (fixed)"] = self.ways[kind][way]
        return out
