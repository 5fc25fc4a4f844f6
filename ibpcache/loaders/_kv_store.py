"""Row stores behind :class:`~ibpcache.loaders.kv.KVOffloadManager`: where the rows of one K or V tensor live.

A *slot* is the position of one (token, batch, head) row of ``head_dim`` values; the manager numbers
slots token-major (``slot = (t * B + b) * H + h``) so that the rows of newly generated tokens always land
after the existing ones and an append never moves data. Every store keeps each row in a fixed-size slot
(the paper's in-place layout), so a row's address is computed from its slot, never looked up.

Three stores, one per transfer path:

* :class:`ZeroCopyKV` (CUDA): one layer's K and V in pinned host chunks; ONE launch encodes a step's new K and
  V rows straight into their slots, ONE launch turns token indices into slots and addresses and decodes the
  K and V rows (``kernels/kv_rows.cu``). No host sync, no per-row tensors. With ``compress=False`` the same
  kernels copy raw rows (variant "c").
* :class:`CpuGatherStore` (CUDA): InfiniGen's path, the baseline. Raw rows in one pinned buffer; a read
  waits for the indices on the CPU, gathers them with ``index_select`` into a pinned staging buffer and
  copies that to the GPU in bulk.
* :class:`NumbaHostStore` (no CUDA): plain host memory and the Numba twins, so the same manager and the
  transformers cache work in CPU-only CI.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np
import torch

from ..codec import Codec
from ..errors import CapacityError
from ..kernels.kv_rows import KvSide, kv_append, kv_fetch

__all__ = ["RowStore", "ZeroCopyKV", "CpuGatherStore", "NumbaHostStore", "identity_codec"]

_HOST_CHUNK_BYTES = 4 << 20
"""Default size of one pinned host chunk; a power of two, because torch's pinned allocator rounds up to one."""


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


class ZeroCopyKV:
    """One layer's K AND V in pinned host chunks, moved by the GPU: one launch appends, one launch fetches.

    Compression and decompression run on the GPU (``kv_rows.cu``); slot -> chunk -> address is computed in
    the kernels from a GPU table of chunk addresses, so neither path synchronises or builds per-row tensors.
    ``lengths`` (int32 per slot, on the GPU, one per tensor) is the only per-row metadata: ``< row_bytes``
    marks a compressed row (the paper's flag bit, derived instead of stored). With ``compress=False`` the
    same kernels copy raw rows (variant "c"). K and V keep their own codecs (their bits differ).
    """

    def __init__(self, k_codec: Codec, v_codec: Codec, compress: bool, device: torch.device,
                 chunk_bytes: int = _HOST_CHUNK_BYTES) -> None:
        if device.type != "cuda":
            raise ValueError(f"ZeroCopyKV needs a CUDA device, got {device}")
        if k_codec.row_bytes != v_codec.row_bytes:
            raise ValueError(f"K and V rows differ in size: {k_codec.row_bytes} vs {v_codec.row_bytes}")
        self.codecs = (k_codec, v_codec)
        self.compress = bool(compress)
        self.device = device
        self.row_bytes = k_codec.row_bytes
        self.slots_per_chunk = max(1, chunk_bytes // self.row_bytes)
        self.capacity = 0
        self._chunks: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._sides: "tuple[KvSide, KvSide] | None" = None
        self._lengths: "list[torch.Tensor | None]" = [None, None]

    def reserve(self, n_slots: int) -> None:
        """Make sure slots ``[0, n_slots)`` have host memory (adds chunks; written rows never move)."""
        if n_slots <= self.capacity:
            return
        n_chunks = -(-n_slots // self.slots_per_chunk)
        nbytes = self.slots_per_chunk * self.row_bytes
        sides = []
        for t, codec in enumerate(self.codecs):
            chunks = self._chunks[t]
            while len(chunks) < n_chunks:
                chunks.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
            table = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64).to(self.device)
            lengths = None
            if self.compress:  # unwritten slots read as raw rows (never fetched: indices are checked)
                lengths = torch.full((n_chunks * self.slots_per_chunk,), self.row_bytes, dtype=torch.int32,
                                     device=self.device)
                old = self._lengths[t]
                if old is not None:
                    lengths[: old.numel()].copy_(old)
                self._lengths[t] = lengths
            mask, bitval = codec.device_tables(self.device)
            sides.append(KvSide(table, lengths, mask, bitval, codec.chunk_bytes, codec.n_chunks))
        self._sides = (sides[0], sides[1])
        self.capacity = n_chunks * self.slots_per_chunk

    def live_tensors(self) -> tuple[torch.Tensor, ...]:
        """GPU tensors a read uses that :meth:`reserve` may replace: a side-stream reader keeps them alive."""
        if self._sides is None:
            return ()
        return tuple(t for side in self._sides for t in (side.table, side.lengths) if t is not None)

    def write(self, keys: torch.Tensor, values: torch.Tensor, slot0: int, written: "torch.Tensor | None" = None,
              into: "tuple[torch.Tensor, torch.Tensor] | None" = None) -> None:
        """Store [B, H, n, D] keys/values at slots ``slot0 + t * B * H + b * H + h`` (one launch, no sync);
        ``into`` buffers ([B, H, W, D]) also get them at their last n token positions."""
        b, h, n, _ = keys.shape
        if slot0 + b * h * n > self.capacity:
            raise CapacityError(f"write of slots [{slot0}, {slot0 + b * h * n}) past capacity {self.capacity}; "
                                "reserve first")
        kv_append(keys, values, slot0, self.slots_per_chunk, *self._sides, written=written, into=into)

    def read(self, idx: "torch.Tensor | None", n: int, out_k: torch.Tensor, out_v: torch.Tensor,
             read: "torch.Tensor | None" = None, row0: "torch.Tensor | None" = None) -> None:
        """Decode ``n`` tokens per (batch, head) into ``out_k``/``out_v`` [B, H, >= n, D]: the tokens ``idx``
        [B, H, n] names (trusted), or tokens ``0..n-1`` (``idx`` None). ``row0`` (int64 [>= n, B], optional): slot
        of each (token, batch)'s head 0 after beam reorders (see the manager). One launch, no sync."""
        if n and self._sides is not None:
            kv_fetch(idx, n, out_k, out_v, self.slots_per_chunk, *self._sides, read=read, row0=row0,
                     heads=out_k.shape[1])

    def stored_bytes(self, n_slots: int) -> int:
        """K plus V bytes that slots ``[0, n_slots)`` occupy once compressed (synchronises)."""
        if not self.compress:
            return 2 * n_slots * self.row_bytes
        return sum(int(lengths[:n_slots].sum(dtype=torch.int64)) for lengths in self._lengths)

    @property
    def host_nbytes(self) -> int:
        return sum(c.numel() for chunks in self._chunks for c in chunks)

    @property
    def device_nbytes(self) -> int:
        """GPU bytes of metadata: per-slot lengths, chunk tables, codec tables."""
        if self._sides is None:
            return 0
        total = sum(side.table.numel() * 8 for side in self._sides)
        if self.compress:
            total += sum(lengths.numel() * 4 for lengths in self._lengths) + sum(
                c.metadata_nbytes for c in self.codecs)
        return total


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


class NumbaHostStore(RowStore):
    """Plain host memory and the Numba encoder/decoder: the manager's path on machines without CUDA."""

    def __init__(self, codec: Codec, compress: bool) -> None:
        super().__init__(codec, compress)
        self._buf = np.zeros(0, dtype=np.uint8)
        self._lengths = np.zeros(0, dtype=np.int32)

    def reserve(self, n_slots: int) -> None:
        if n_slots <= self.capacity:
            return
        cap = max(n_slots, int(math.ceil(self.capacity * 1.5)))
        buf = np.zeros(cap * self.row_bytes, dtype=np.uint8)
        buf[: self._buf.size] = self._buf
        lengths = np.full(cap, self.row_bytes, dtype=np.int32)
        lengths[: self._lengths.size] = self._lengths
        self._buf, self._lengths, self.capacity = buf, lengths, cap

    def write(self, rows_u8: torch.Tensor, slot0: int) -> int:
        m = rows_u8.shape[0]
        if slot0 + m > self.capacity:
            raise CapacityError(f"write of slots [{slot0}, {slot0 + m}) past capacity {self.capacity}; reserve first")
        if m == 0:
            return 0
        rows = rows_u8.numpy()
        if not self.compress:
            self._buf[slot0 * self.row_bytes : (slot0 + m) * self.row_bytes] = rows.reshape(-1)
            return m * self.row_bytes
        offsets = np.arange(slot0, slot0 + m, dtype=np.int64) * self.row_bytes
        lengths = self.codec.encode_rows_at(rows, self._buf, offsets)
        self._lengths[slot0 : slot0 + m] = lengths
        return int(lengths.sum(dtype=np.int64))

    def read(self, slots: torch.Tensor, out_u8: torch.Tensor, out_rows: "torch.Tensor | None") -> int:
        m = slots.numel()
        if m == 0:
            return 0
        s = slots.numpy()
        lengths = self._lengths[s]
        rows = out_rows.numpy() if out_rows is not None else np.arange(m, dtype=np.int64)
        self.codec.decode_rows_at(self._buf, s * self.row_bytes, lengths, out_u8.numpy(), rows)
        return int(lengths.sum(dtype=np.int64))

    def stored_bytes(self, n_slots: int) -> int:
        return int(self._lengths[:n_slots].sum(dtype=np.int64))

    @property
    def host_nbytes(self) -> int:
        return int(self._buf.nbytes + self._lengths.nbytes)
