"""Path planner of the fused lookup: which of two ways runs a lookup faster, per kind and size, timed as it runs.

The embedding bags' fused inference lookup (``row_cache.FusedLookup``) can take one-id bags in row order or as given,
and, with a staging buffer, read a step's missed rows once into it or every miss zero-copy. Which is faster depends
on the batch size, the table and the machine, so :class:`PathPlanner` times both on the live traffic (CUDA events
read only once they completed: never a sync) and keeps the faster per size class.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["PathPlanner"]


class PathPlanner:
    """Picks between two ways of running a fused lookup, per kind of lookup and size class (powers of two of the
    bag count), from timings on this machine: the first ``trials`` lookups of a class alternate the two, timed with
    CUDA events read only once they have completed (never a sync), then the faster median wins for good.

    Kinds: ``"single"`` (one id per bag): take bags in row order (an argsort first; address-ordered host reads pay
    off when many misses come from a large pinned table) or as given. ``"multi"`` (bags of several ids, only when a
    staging buffer exists): read each missed row once into staging (CLAIM + STAGE) or every miss zero-copy.
    """

    LABELS = {"single": ("as given", "sorted"), "multi": ("zero-copy", "staged")}

    def __init__(self, trials: int = 6) -> None:
        self.trials = trials
        self._times: dict[tuple[str, int], dict[bool, list[float]]] = {}
        self._pending: list[tuple[tuple[str, int], bool, Any, Any]] = []
        self._choice: dict[tuple[str, int], bool] = {}
        self._fixed: dict[str, bool] = {}

    @staticmethod
    def _key(kind: str, n: int) -> tuple[str, int]:
        return kind, max(n, 1).bit_length()

    def fix(self, kind: str, second: "bool | None") -> None:
        """Pin a kind of lookup to one way for every size (``None`` lets the timings decide again)."""
        if kind not in self.LABELS:
            raise InvalidArgumentError(f"kind must be one of {sorted(self.LABELS)}, got {kind!r}")
        if second is None:
            self._fixed.pop(kind, None)
        else:
            self._fixed[kind] = bool(second)

    def calibrating(self, n: int, kind: str = "single") -> bool:
        return kind not in self._fixed and self._key(kind, n) not in self._choice

    def choose(self, n: int, capturing: bool = False, kind: str = "single") -> bool:
        """The second way (sorted / staged)? Decided classes keep their choice; while calibrating, alternate (the
        first way while a CUDA graph is being captured)."""
        if kind in self._fixed:
            return self._fixed[kind]
        key = self._key(kind, n)
        if not capturing:  # querying events is not allowed while a stream is being captured
            self._collect()
        if key in self._choice:
            return self._choice[key]
        if capturing:
            return False
        runs = self._times.setdefault(key, {False: [], True: []})
        pending = sum(1 for k, *_ in self._pending if k == key)
        done = len(runs[False]) + len(runs[True])
        if done >= 2 * self.trials:
            self._choice[key] = float(np.median(runs[True])) < float(np.median(runs[False]))
            return self._choice[key]
        return (done + pending) % 2 == 1

    def record(self, n: int, second: bool, start: Any, end: Any, kind: str = "single") -> None:
        self._pending.append((self._key(kind, n), second, start, end))

    def _collect(self) -> None:
        keep = []
        for key, second, start, end in self._pending:
            if end.query():
                self._times.setdefault(key, {False: [], True: []})[second].append(start.elapsed_time(end))
            else:
                keep.append((key, second, start, end))
        self._pending = keep

    def plan(self) -> dict[str, str]:
        """For stats(): the way chosen per kind and size class (or "calibrating")."""
        self._collect()
        out = {}
        for kind, b in sorted(set(self._times) | set(self._choice)):
            label = f"{kind} {1 << (b - 1)}-{(1 << b) - 1} bags"
            choice = self._choice.get((kind, b))
            out[label] = "calibrating" if choice is None else self.LABELS[kind][int(choice)]
        for kind, second in self._fixed.items():
            out[f"{kind} (fixed)"] = self.LABELS[kind][int(second)]
        return out
