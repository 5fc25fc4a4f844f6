"""The baseline row store behind :class:`~ibpcache.cache.kv_manager.KVOffloadManager` (``transfer="cpu_gather"``).

A *slot* is the position of one (token, batch, head) row of ``head_dim`` values; the manager numbers
slots token-major (``slot = (t * B + b) * H + h``) so that the rows of newly generated tokens always land
after the existing ones and an append never moves data.

Our transfer paths (zero-copy on CUDA, and its CPU twin) keep rows in the engine's packed append store,
:class:`~ibpcache.cache.append_store.AppendStore`. What is left here is InfiniGen's path, the baseline:
:class:`CpuGatherStore` keeps raw rows in fixed slots of one pinned buffer; a read waits for the indices on the
CPU, gathers them with ``index_select`` into a pinned staging buffer and copies that to the GPU in bulk.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..codec import Codec
from ..errors import CapacityError

__all__ = ["RowStore", "CpuGatherStore", "identity_codec"]


def identity_codec(row_bytes: int, dtype: torch.dtype, row_shape: tuple[int, ...]) -> Codec:
    """The raw codec (:meth:`Codec.raw`) for these rows: gives the uncompressed variant the same kernels."""
    codec = Codec.raw(dtype, row_shape)
    assert codec.row_bytes == row_bytes, (codec.row_bytes, row_bytes)
    return codec


class RowStore(ABC):
    """Fixed-size slots of ``row_bytes`` bytes, written in token-major order and read by slot id."""

    def __init__(self, codec: Codec, compress: bool) -> None:
        self.codec = codec
        self.compress = bool(compress)
        self.row_bytes = codec.row_bytes
        self.capacity = 0  # slots with memory behind them

    @abstractmethod
    def reserve(self, n_slots: int) -> None:
        """Make sure slots ``[0, n_slots)`` have memory (grows, never shrinks, never moves written rows)."""

    @abstractmethod
    def write(self, rows_u8: torch.Tensor, slot0: int) -> int:
        """Store ``rows_u8`` (uint8 [M, row_bytes]) into slots ``[slot0, slot0 + M)``; returns the bytes written."""

    @abstractmethod
    def read(self, slots: torch.Tensor, out_u8: torch.Tensor, out_rows: "torch.Tensor | None") -> int:
        """Decode the rows of ``slots`` into ``out_u8[out_rows]`` (or in order); returns the bytes moved."""

    @abstractmethod
    def stored_bytes(self, n_slots: int) -> int:
        """Bytes that slots ``[0, n_slots)`` occupy once compressed (``n_slots * row_bytes`` when raw)."""

    @property
    @abstractmethod
    def host_nbytes(self) -> int:
        """Host memory held (allocated capacity)."""

    @property
    def device_nbytes(self) -> int:
        """GPU memory held for metadata (lengths, pointer table, mask/bitval)."""
        return 0


class CpuGatherStore(RowStore):
    """InfiniGen's transfer path (the baseline): raw rows in pinned memory, gathered by the CPU.

    A read needs the slot ids on the CPU (``slots_cpu``), gathers the rows with ``index_select`` into a
    pinned staging buffer and issues ONE bulk host-to-device copy on the current stream.
    """

    def __init__(self, codec: Codec, device: torch.device) -> None:
        super().__init__(codec, compress=False)
        if device.type != "cuda":
            raise ValueError(f"CpuGatherStore needs a CUDA device, got {device}")
        self.device = device
        self._host = torch.empty((0, self.row_bytes), dtype=torch.uint8)
        self._staging = torch.empty((0, self.row_bytes), dtype=torch.uint8)

    def reserve(self, n_slots: int) -> None:
        if n_slots <= self.capacity:
            return
        cap = max(n_slots, int(self.capacity * 1.5))
        grown = torch.empty((cap, self.row_bytes), dtype=torch.uint8, pin_memory=True)
        if self.capacity:
            torch.cuda.current_stream(self.device).synchronize()  # pending async writes into the old buffer
            grown[: self.capacity].copy_(self._host)
        self._host = grown
        self.capacity = cap

    def write(self, rows_u8: torch.Tensor, slot0: int) -> int:
        m = rows_u8.shape[0]
        if slot0 + m > self.capacity:
            raise CapacityError(f"write of slots [{slot0}, {slot0 + m}) past capacity {self.capacity}; reserve first")
        self._host[slot0 : slot0 + m].copy_(rows_u8, non_blocking=True)
        return m * self.row_bytes

    def staging(self, m: int) -> torch.Tensor:
        """Pinned staging rows for a gather of ``m`` rows (grown geometrically, reused between steps)."""
        if self._staging.shape[0] < m:
            self._staging = torch.empty((max(m, int(self._staging.shape[0] * 1.5)), self.row_bytes),
                                        dtype=torch.uint8, pin_memory=True)
        return self._staging[:m]

    def read_cpu(self, slots_cpu: torch.Tensor, out_u8: torch.Tensor) -> int:
        """CPU gather + one bulk copy into ``out_u8`` (rows in ``slots_cpu`` order), on the current stream.

        The caller guarantees that the writes of these slots have completed (it synchronised on an event)
        and that the previous copy out of the staging buffer has finished.
        """
        m = slots_cpu.numel()
        if m == 0:
            return 0
        staged = self.staging(m)
        torch.index_select(self._host, 0, slots_cpu, out=staged)
        out_u8.copy_(staged, non_blocking=True)
        return m * self.row_bytes

    def read_range(self, n_slots: int, out_u8: torch.Tensor) -> int:
        """Slots ``[0, n_slots)`` in one bulk copy (dense attention needs every row; no gather)."""
        out_u8.copy_(self._host[:n_slots], non_blocking=True)
        return n_slots * self.row_bytes

    def read(self, slots: torch.Tensor, out_u8: torch.Tensor, out_rows: "torch.Tensor | None") -> int:
        slots_cpu = slots.to("cpu")  # the CPU must see the indices: InfiniGen's inherent sync
        torch.cuda.current_stream(self.device).synchronize()
        if out_rows is None:
            return self.read_cpu(slots_cpu, out_u8)
        tmp = torch.empty((slots_cpu.numel(), self.row_bytes), dtype=torch.uint8, device=self.device)
        moved = self.read_cpu(slots_cpu, tmp)
        out_u8.index_copy_(0, out_rows, tmp)
        return moved

    def stored_bytes(self, n_slots: int) -> int:
        return n_slots * self.row_bytes

    @property
    def host_nbytes(self) -> int:
        return self._host.numel() + self._staging.numel()
