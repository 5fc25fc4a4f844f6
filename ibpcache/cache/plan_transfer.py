"""Transfer planner: which path a store's rows take to the GPU, chosen from timings on the store itself.

The paths (:class:`Transfer`) are the host store's (``host_store.py`` documents what each does); this module names
them and picks one. :func:`calibrate_transfer` times the store's own ``read_into`` through each candidate at
construction (wall clock, host work included: a path that gathers on the CPU pays for it), and
:func:`decide_transfer` keeps zero-copy (no host work, no host sync, CUDA-graph capturable) unless another path is at
least :data:`MARGIN` faster. Without CUDA nothing crosses PCIe and nothing is timed.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol

import torch

from ..errors import InvalidArgumentError
from ._plan_timing import MARGIN, wall_medians

__all__ = ["Transfer", "TransferChoice", "decide_transfer", "calibrate_transfer", "MARGIN"]


class Transfer(str, enum.Enum):
    """How a CUDA store's rows reach the GPU (see ``host_store.py``)."""

    ZERO_COPY = "zero_copy"
    CPU_GATHER = "cpu_gather"
    HOST_GATHER = "host_gather"

    @classmethod
    def coerce(cls, value: "str | Transfer", name: str = "transfer") -> "Transfer":
        """Parse a name (``name`` is the argument's name in the message)."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise InvalidArgumentError(f"{name} must be one of {[m.value for m in cls]}, got {value!r}") from None


class TimedStore(Protocol):
    """What :func:`calibrate_transfer` needs of a store (the host store has it): where it reads to, its size, its
    transfer path and read counters (restored after timing), and ``read_into``."""

    device: torch.device
    compress: bool
    n_rows: int
    row_bytes: int
    transfer: Transfer
    rows_read: int
    bytes_read: torch.Tensor

    def read_into(self, ids: torch.Tensor, out_u8: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class TransferChoice:
    """Which transfer path a store reads misses through, and the timings that chose it (``stats()['transfer']``)."""

    transfer: str
    reason: str
    timings_ms: dict
    batch: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide_transfer(timings_ms: dict, default: str = "zero_copy", margin: float = MARGIN, batch: int = 0
                    ) -> TransferChoice:
    """The rule, apart from the measuring: the fastest path, but ``default`` (zero-copy: no host work, no host
    sync, CUDA-graph capturable) unless another path is at least ``margin`` faster than it."""
    if not timings_ms:
        return TransferChoice(default, "nothing timed (no CUDA)", {}, batch)
    best = min(timings_ms, key=timings_ms.get)
    base = timings_ms.get(default)
    if best == default or base is None:
        return TransferChoice(best, f"{best} fastest", dict(timings_ms), batch)
    if timings_ms[best] <= base * (1.0 - margin):
        return TransferChoice(best, f"{best} {base / timings_ms[best]:.2f}x faster than {default}", dict(timings_ms),
                              batch)
    return TransferChoice(default, f"{best} only {base / timings_ms[best]:.2f}x of {default} (< "
                          f"{1 / (1 - margin):.2f}x)", dict(timings_ms), batch)


def calibrate_transfer(store: TimedStore, batch: int = 16384, reps: int = 5,
                       candidates: "tuple[str, ...] | None" = None) -> TransferChoice:
    """Time ``store.read_into`` of ``batch`` random rows through each candidate path, on the store itself (a
    multi-GB pinned table reads randomly at rates a small sample would not show), ids given on the CPU as a
    sampler hands them over (``host_gather`` too for raw rows: torch's own gather + one copy, the raw baseline).
    Wall clock from the call to the rows being on the GPU, host work included (a path
    that gathers on the CPU pays for it); candidates alternate, medians decide. The store's counters are left as
    they were."""
    if store.device.type != "cuda":
        return decide_transfer({}, batch=batch)
    if candidates is None:  # the CPU's own row gather is a candidate where it needs no decoding (raw rows)
        candidates = ("zero_copy", "cpu_gather") + (() if store.compress else ("host_gather",))
    n = store.n_rows
    ids = torch.randint(0, n, (min(batch, max(n, 1)),), generator=torch.Generator().manual_seed(1))
    out = torch.empty((ids.numel(), store.row_bytes), dtype=torch.uint8, device=store.device)
    saved = (store.transfer, store.rows_read, store.bytes_read.clone())

    def via(name: str) -> "Callable[[], None]":
        def run() -> None:
            store.transfer = Transfer(name)
            store.read_into(ids, out)
        return run

    try:
        medians = wall_medians({name: via(name) for name in candidates}, store.device, reps)
    finally:
        store.transfer, store.rows_read = saved[0], saved[1]
        store.bytes_read.copy_(saved[2])
    return decide_transfer(medians, batch=int(ids.numel()))
