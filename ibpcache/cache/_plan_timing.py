"""What the planners share: the margin a measured path must win by, and the alternating wall-clock timer."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

__all__ = ["MARGIN", "wall_medians"]

MARGIN = 0.03
"""A path other than the default must be at least this much faster to be chosen (timings of a few ms move by
~1-2%)."""


def wall_medians(runs: "dict[Any, Callable[[], None]]", device: torch.device, reps: int) -> "dict[Any, float]":
    """Median wall-clock ms of each run (host work included, device synchronised before and after), alternated
    round by round so drift hits them alike; the first round warms up (kernel builds, Numba, pinned pools)."""
    times: dict[Any, list[float]] = {k: [] for k in runs}
    for rep in range(reps + 1):
        for key, run in runs.items():
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize(device)
            if rep:
                times[key].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}
