"""How often a fused inference lookup runs its admission pass: every step while the cache fills or its hit rate moves,
every ``every``-th step once the hit rate has settled.

Why: once the cache holds the hot set, the admission pass (sort, frequency-sketch counting over every id, victim
sampling, the copies of the rows swapped in) is a third or more of a DLRM lookup step's device time (profiled on an
H200 at 10% cache, batch 8192: ~120 us of 367 us at 128 B fp16 rows, of 629 us at 512 B rows), spent on admissions
that no longer move the hit rate. A step that skips the pass still reads every row exactly (hits from slots, misses
from host memory) and still counts requests, hits and use stamps; it only leaves the cache's contents as they are.

Whether the hit rate has settled is judged on the device's cumulative counters, read a few steps late: every
``window`` steps (more for small steps: a window holds at least ``min_requests`` ids, so that its hit rate is
known to about 0.1 points) a copy of them goes to pinned memory, looked at once it has completed (no host sync).
The cache is settled when it is full and its hit rate is flat: the newest window's rate is within ``rise`` of the
rate ``span`` windows earlier, beyond what sampling noise explains (three standard deviations of the difference of
two binomial rates: tiny for a DLRM step's 10^5 ids, large for a test's few thousand). Flat, not merely "not
rising": a rate still falling after the hot set moved must not settle the cache in the middle of the fall. A slowly
converging cache (TinyLFU on Zipf ids gains a fraction of a point per window for hundreds of steps) keeps admitting
every step until then. It is unsettled again (every step admits) as soon as a window's rate is ``drop`` (plus noise) below the best
settled window: the hot set moved, or the settled admissions were too few to follow it.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Optional

import torch

from ..errors import InvalidArgumentError

__all__ = ["AdmissionPace", "SETTLED_ADMIT_EVERY", "check_admit_every"]

_KEEP_WINDOWS = 64
"""Window readings kept: ``span`` may be at most one less."""

SETTLED_ADMIT_EVERY = 4
"""Default: once settled, one lookup in 4 runs the admission pass (75% of the passes' device time saved; a hot set
that moves is still followed, four times slower, until the hit rate drop puts every step back to admitting)."""


def check_admit_every(every: Any) -> int:
    """``settled_admit_every`` as given, or :class:`InvalidArgumentError` naming it (an int >= 1; not a bool)."""
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise InvalidArgumentError(f"settled_admit_every must be an int >= 1, got {every!r}")
    return every


class AdmissionPace:
    """Decides, per lookup step, whether it runs the admission pass; see the module docstring."""

    def __init__(self, every: int, device: torch.device, window: int = 16, span: int = 4,
                 rise: float = 0.002, drop: float = 0.02, min_requests: int = 1 << 18) -> None:
        self.every = check_admit_every(every)
        self.window = int(window)
        if not 1 <= int(span) < _KEEP_WINDOWS:
            raise InvalidArgumentError(f"span must be in [1, {_KEEP_WINDOWS}), got {span!r}")
        self.span = int(span)
        self.min_requests = int(min_requests)
        self.rise = float(rise)
        self.drop = float(drop)
        self.cuda = device.type == "cuda"
        self.settled = False
        self.best = (0.0, 1)  # the best window since the cache settled: (hit rate, requests)
        self.steps = 0  # steps asked about (admit())
        self.skipped = 0
        self.settles = 0
        self.unsettles = 0
        self.last_rate: Optional[float] = None
        # (hit rate, requests) of the latest windows; ``span`` may be set after construction (tests, experiments)
        self._windows: deque[tuple[float, int]] = deque(maxlen=_KEEP_WINDOWS)
        self._since = 0  # steps since the last copy of the counters
        self._prev: Optional[tuple[int, int]] = None  # (requests, hits) at the last reading
        self._copy: Optional[torch.Tensor] = None
        self._done: Optional[Any] = None  # the copy's event (CUDA)
        if self.cuda:
            self._copy = torch.zeros(2, dtype=torch.int64, pin_memory=True)
            self._done = torch.cuda.Event()
        self._in_flight = False

    def admit(self) -> bool:
        """Does this step run the admission pass? (Called once per step that could skip it.)"""
        self.steps += 1
        if not self.settled or self.every == 1 or self.steps % self.every == 0:
            return True
        self.skipped += 1
        return False

    @property
    def cycling(self) -> bool:
        """Settled and skipping: a step's cost is that of a cycle of ``every`` steps, one of them admitting."""
        return self.settled and self.every > 1

    def count(self, admit: bool) -> None:
        """A step whose admission the caller decided (a timed cycle, see ``FusedLookup.pool``)."""
        self.steps += 1
        self.skipped += not admit

    def observe(self, counters: torch.Tensor, full: bool, n: int) -> None:
        """After a step of ``n`` ids was enqueued: ``counters`` = the lookups' cumulative [requests, hits, ...] on
        their device; ``full`` = every slot has been used (a filling cache is never settled)."""
        if self.every == 1:
            return
        if self._in_flight and (not self.cuda or self._done.query()):
            self._in_flight = False
            self._read(int(self._copy[0]), int(self._copy[1]), full)
        self._since += 1
        window = max(self.window, -(-self.min_requests // max(n, 1)))
        if self._since >= window and not self._in_flight:
            self._since = 0
            if self.cuda:
                self._copy.copy_(counters[:2], non_blocking=True)
                self._done.record()
                self._in_flight = True
            else:
                self._read(int(counters[0]), int(counters[1]), full)

    def _read(self, requests: int, hits: int, full: bool) -> None:
        prev, self._prev = self._prev, (requests, hits)
        if prev is None or requests <= prev[0]:
            return
        now = ((hits - prev[1]) / (requests - prev[0]), requests - prev[0])
        self.last_rate = now[0]
        self._windows.append(now)
        if self.settled:
            if now[0] < self.best[0] - self.drop - _noise(self.best, now):
                self.settled = False
                self.unsettles += 1
                self._windows.clear()
            elif now[0] > self.best[0]:
                self.best = now
            return
        if not full or len(self._windows) <= self.span:
            return
        first = self._windows[-self.span - 1]
        if abs(now[0] - first[0]) <= self.rise + _noise(first, now):
            self.settled = True
            self.settles += 1
            self.best = now

    def reset(self) -> None:
        """The cache was emptied: admit every step until it settles again."""
        self.settled = False
        self._windows.clear()
        self._prev = None
        self.last_rate = None

    def stats(self) -> dict[str, Any]:
        return {"every": self.every, "settled": self.settled, "skipped_steps": self.skipped, "steps": self.steps,
                "settles": self.settles, "unsettles": self.unsettles, "window_hit_rate": self.last_rate,
                "best_settled_hit_rate": self.best[0] if self.settled else None}


def _noise(a: tuple[float, int], b: tuple[float, int]) -> float:
    """Three standard deviations of the difference of two windows' hit rates, (rate, requests) each."""
    p = min(max((a[0] + b[0]) / 2, 0.0), 1.0)
    return 3.0 * math.sqrt(p * (1.0 - p) * (1.0 / a[1] + 1.0 / b[1]))
