"""Fetch counters of a FeatureCache, kept on the cache's device so fetches never sync to count.

The probe kernel adds to an int64 [N_COUNTERS] tensor indexed by :class:`Counter` (mirrored by
``IBP_COUNTER_*`` in ``kernels/hashmap.cu``: keep in sync). Timing uses CUDA events recorded around each
fetch and read only when :meth:`FetchStats.snapshot` is called.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from typing import Any

import torch

__all__ = ["Counter", "N_COUNTERS", "FetchStats", "RecentCounters"]


class Counter(enum.IntEnum):
    """Index of each device counter (keep in sync with IBP_COUNTER_* in hashmap.cu)."""

    REQUESTS = 0
    HITS = 1
    HOST_BYTES = 2
    SLAB_BYTES = 3


N_COUNTERS = len(Counter)

_MAX_TIMED = 256
"""Fetches whose timing is kept (a ring); older ones fall off so memory stays bounded."""


class RecentCounters:
    """Counters over the last few hundred steps, from cumulative device counters, with no sync per step.

    Every ``every``-th :meth:`push` keeps a device copy of the counters (one small copy, never read then); the
    window is the difference between the newest and the oldest of the ``keep`` copies kept (read at :meth:`delta`,
    which syncs: call it from ``stats()``). Why: a cumulative hit rate hides how a cache does now (it still counts the
    cold start, or a hot set that has moved on).
    """

    def __init__(self, every: int = 16, keep: int = 9) -> None:
        self.every = int(every)
        self._calls = 0
        self._ring: deque[tuple[int, Any]] = deque(maxlen=int(keep))

    def push(self, counters: Any) -> None:
        """One more step; ``counters`` is the cumulative counter tensor (or a list of numbers)."""
        if self._calls % self.every == 0:
            snap = counters.clone() if hasattr(counters, "clone") else list(counters)
            self._ring.append((self._calls, snap))
        self._calls += 1

    def delta(self, counters: Any) -> "tuple[int, list[int]] | None":
        """(steps, counters now minus the oldest copy kept) or None before the second step."""
        if not self._ring or self._calls - self._ring[0][0] < 2:
            return None
        steps, old = self._ring[0]
        now = counters.tolist() if hasattr(counters, "tolist") else list(counters)
        old = old.tolist() if hasattr(old, "tolist") else list(old)
        return self._calls - steps, [int(a) - int(b) for a, b in zip(now, old)]

    def clear(self) -> None:
        self._calls = 0
        self._ring.clear()


class FetchStats:
    """Device-side counters plus optional per-fetch timing.

    ``counters`` is written by the probe kernel (CUDA) or by torch ops (CPU); ``row_bytes`` converts
    request counts into the bytes a raw fetch would have moved.
    """

    def __init__(self, device: torch.device, row_bytes: int) -> None:
        self.device = device
        self.row_bytes = row_bytes
        self.counters = torch.zeros(N_COUNTERS, dtype=torch.int64, device=device)
        self._timed: deque[tuple[Any, Any, int]] = deque(maxlen=_MAX_TIMED)
        self.recent = RecentCounters()

    def reset(self) -> None:
        """Zero every counter and forget timings."""
        self.counters.zero_()
        self._timed.clear()
        self.recent.clear()

    def start(self) -> Any:
        """Mark the start of a fetch: a CUDA event on CUDA, a perf_counter value on CPU."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start: Any, n_requests: int) -> None:
        """Mark the end of a fetch of ``n_requests`` rows started by :meth:`start`."""
        if n_requests == 0:
            return
        self.recent.push(self.counters)
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._timed.append((start, end, n_requests))
        else:
            self._timed.append((start, time.perf_counter(), n_requests))

    def add_cpu(self, requests: int, hits: int, host_bytes: int, slab_bytes: int) -> None:
        """Count a CPU fetch (the CPU path has its numbers as Python ints already)."""
        cuda = self.device.type == "cuda"  # pinned + non_blocking: counting never waits for the GPU
        delta = torch.tensor([requests, hits, host_bytes, slab_bytes], dtype=torch.int64, pin_memory=cuda)
        self.counters += delta.to(self.device, non_blocking=cuda)

    def _seconds(self) -> tuple[float, int]:
        total_s, total_rows = 0.0, 0
        for start, end, n in self._timed:
            if self.device.type == "cuda":
                end.synchronize()
                total_s += start.elapsed_time(end) / 1e3
            else:
                total_s += end - start
            total_rows += n
        return total_s, total_rows

    def snapshot(self) -> dict[str, Any]:
        """Counters as Python numbers (this syncs: call it between batches, not inside a loop)."""
        requests, hits, host_bytes, slab_bytes = (int(v) for v in self.counters.tolist())
        window = self.recent.delta(self.counters)
        seconds, timed_rows = self._seconds()
        gbps = (timed_rows * self.row_bytes / seconds / 1e9) if seconds > 0 else None
        return {
            "requests": requests,
            "hits": hits,
            "misses": requests - hits,
            "hit_rate": hits / requests if requests else None,
            "hit_rate_recent": (window[1][Counter.HITS] / window[1][Counter.REQUESTS]
                                if window is not None and window[1][Counter.REQUESTS] else None),
            "recent_fetches": window[0] if window is not None else 0,
            "host_bytes_read": host_bytes,
            "slab_bytes_read": slab_bytes,
            "raw_bytes_equivalent": requests * self.row_bytes,
            "raw_host_bytes_equivalent": (requests - hits) * self.row_bytes,
            "effective_gbps": gbps,
        }
