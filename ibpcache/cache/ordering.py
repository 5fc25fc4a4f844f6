"""One operation at a time over a cache's shared state, from any number of Python threads and CUDA streams.

A lock orders the host side; on CUDA an event chain orders the device side: each operation's stream first waits for
the last operation enqueued by any thread, then records its own end. So workspaces, slab slots and index entries are
never used by two streams at once, and an admission never overwrites a slot another stream has yet to read. While a
stream is being captured into a CUDA graph the chain is skipped (a replay runs in stream order, and waiting on an
event recorded outside the capture is not allowed there).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["StreamOrder"]


class StreamOrder:
    """The lock + event chain shared by FeatureCache and the embedding-bag cache manager."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = threading.RLock()
        self._last: "torch.cuda.Event | None" = None

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the lock; on CUDA, run after the last operation and become the last one."""
        with self._lock:
            cuda = self.device.type == "cuda"
            capturing = cuda and torch.cuda.is_current_stream_capturing()
            if cuda and not capturing and self._last is not None:
                torch.cuda.current_stream(self.device).wait_event(self._last)
            yield
            if cuda and not capturing:
                if self._last is None:
                    self._last = torch.cuda.Event()
                self._last.record(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        """Wait until the last enqueued operation has finished on the device."""
        with self._lock:
            if self._last is not None:
                self._last.synchronize()
