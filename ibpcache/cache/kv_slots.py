"""Where a decoder layer's K/V rows live: the slot of every (token, batch row, head), for the KV manager.

A store (:class:`~ibpcache.cache.append_store.AppendStore`, :class:`~ibpcache.cache.cpu_gather_store.CpuGatherStore`)
keeps rows by *slot*; this module decides which slot a row gets and finds it again. Slots are numbered token-major
as rows are written, ``slot = slot0 + t * B * H + b * H + h``, so new tokens always land after the existing ones and
an append never moves data. A layer's :class:`SlotLayout` is a list of *segments* (first token, its first slot,
slots per token), one per batch size the layer has been written with, and, once a beam reorder or a batch selection
has happened, a slot table ``row0`` (int64 ``[capacity, B]`` on the manager's device: the slot of (t, b, head 0)).

Beam search, batch selection and crops rewrite this layout, never the stored rows: a beam reorder is a gather of
``[T, B]`` slot ids on the device (no host sync, no decode, no re-encode); rows that no beam refers to any more stay
where they are until a crop lets new tokens reuse their slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InternalError

__all__ = ["SlotLayout"]


@dataclass
class SlotLayout:
    """One layer's slot layout (see the module docstring). ``row0`` None: the identity layout of the segments."""

    segments: list = field(default_factory=list)
    row0: "torch.Tensor | None" = None

    def slot_of_token(self, t: int) -> int:
        """Physical slot of (token ``t``, batch 0, head 0) as written (``t`` = the tokens stored: the end)."""
        for t0, s0, width in reversed(self.segments):
            if t >= t0:
                return s0 + (t - t0) * width
        return 0

    def place(self, t0: int, n: int, batch_size: int, num_kv_heads: int, device: torch.device) -> int:
        """Slots for tokens ``t0 .. t0 + n - 1`` written now, after the slots of tokens ``< t0``: returns the first.

        Slots of tokens cropped away are reused; a batch size other than the previous tokens' starts a segment."""
        rows_per_token = batch_size * num_kv_heads
        slot0 = self.slot_of_token(t0)
        while self.segments and self.segments[-1][0] >= t0:
            self.segments.pop()
        if not self.segments or self.segments[-1][2] != rows_per_token:
            self.segments.append((t0, slot0, rows_per_token))
        if self.row0 is not None:
            self.fill(t0, n, slot0, batch_size, num_kv_heads, device)
        return slot0

    def fill(self, t0: int, n: int, slot0: int, batch_size: int, num_kv_heads: int, device: torch.device) -> None:
        """Give tokens ``t0 .. t0 + n - 1``, written from ``slot0`` on, identity entries in the slot table."""
        cap = self.row0.shape[0]
        if t0 + n > cap:
            grown = torch.empty((max(t0 + n, 2 * cap), batch_size), dtype=torch.int64, device=device)
            grown[:t0].copy_(self.row0[:t0])
            self.row0 = grown
        t = torch.arange(n, device=device).view(-1, 1) * (batch_size * num_kv_heads)
        b = torch.arange(batch_size, device=device).view(1, -1) * num_kv_heads
        self.row0[t0 : t0 + n] = t + b + slot0

    def table(self, n_tokens: int, batch_size: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
        """The slot table of the layer's ``n_tokens`` tokens (built from the segments at the first reorder or
        selection)."""
        if self.row0 is None:
            t = n_tokens
            self.row0 = torch.empty((max(2 * t, 16), batch_size), dtype=torch.int64, device=device)
            ends = [seg[0] for seg in self.segments[1:]] + [t]
            for (t0, s0, width), t1 in zip(self.segments, ends):
                n = max(0, min(t1, t) - t0)
                if n and width != batch_size * num_kv_heads:
                    raise InternalError(f"tokens stored with {width} rows per token but no slot table")
                if n:
                    self.fill(t0, n, s0, batch_size, num_kv_heads, device)
        return self.row0
