"""Row stores behind :class:`~ibpcache.loaders.kv.KVOffloadManager`: where the rows of one K or V tensor live.

A *slot* is the position of one (token, batch, head) row of ``head_dim`` values; the manager numbers
slots token-major (``slot = (t * B + b) * H + h``) so that the rows of newly generated tokens always land
after the existing ones and an append never moves data. Every store keeps each row in a fixed-size slot
(the paper's in-place layout), so a row's address is computed from its slot, never looked up.

Three stores, one per transfer path:

* :class:`ZeroCopyStore` (CUDA): pinned host chunks, rows compressed on the GPU by ``encode_into`` and
  read back by ONE ``decode_descriptors`` launch whose source pointers are computed on the GPU. No host
  sync on either path. With ``compress=False`` the same kernel copies raw rows (variant "c").
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

__all__ = ["RowStore", "ZeroCopyStore", "CpuGatherStore", "NumbaHostStore", "identity_codec"]

_HOST_CHUNK_BYTES = 4 << 20
"""Default size of one pinned host chunk; a power of two, because torch's pinned allocator rounds up to one."""


def identity_codec(row_bytes: int, dtype: torch.dtype, row_shape: tuple[int, ...]) -> Codec:
    """A codec with an all-zero mask: every row is stored raw. Gives the uncompressed variant the same kernels."""
    chunk = 8 if row_bytes % 8 == 0 else 1
    n = -(-row_bytes // chunk)
    zeros = np.zeros(n, dtype=np.uint64)
    return Codec(zeros, zeros.copy(), chunk_bytes=chunk, row_bytes=row_bytes, dtype=dtype,
                 row_shape=row_shape, threshold=1.0)


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
    def write(self, rows_u8: torch.Tensor, slot0: int) -> "torch.Tensor | int":
        """Store ``rows_u8`` (uint8 [M, row_bytes]) into slots ``[slot0, slot0 + M)``.

        Returns the bytes written: an int, or (GPU paths, to avoid a sync) the int32 stored lengths.
        """

    @abstractmethod
    def read(self, slots: torch.Tensor, out_u8: torch.Tensor, out_rows: "torch.Tensor | None") -> "torch.Tensor | int":
        """Decode the rows of ``slots`` into ``out_u8[out_rows]`` (or in order); returns the bytes moved as
        :meth:`write` does."""

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


class ZeroCopyStore(RowStore):
    """Pinned host chunks read by the GPU through UVA; compression and decompression run on the GPU.

    ``lengths`` (int32 per slot, on the GPU) is the only per-row metadata: ``lengths < row_bytes`` marks a
    compressed row (the paper's flag bitmask, derived instead of stored). Chunks are added as tokens
    arrive; a GPU table of chunk base addresses turns slot ids into source pointers without a host sync.
    """

    def __init__(self, codec: Codec, compress: bool, device: torch.device,
                 chunk_bytes: int = _HOST_CHUNK_BYTES) -> None:
        super().__init__(codec, compress)
        if device.type != "cuda":
            raise ValueError(f"ZeroCopyStore needs a CUDA device, got {device}")
        self.device = device
        self.slots_per_chunk = max(1, chunk_bytes // self.row_bytes)
        self._chunks: list[torch.Tensor] = []
        self._table = torch.empty(0, dtype=torch.int64, device=device)
        self._lengths = torch.empty(0, dtype=torch.int32, device=device)
        self._flags = torch.empty(0, dtype=torch.uint8, device=device)  # lengths < row_bytes, kept at write
        self._raw_lengths = torch.empty(0, dtype=torch.int32, device=device)
        self._raw_flags = torch.empty(0, dtype=torch.uint8, device=device)

    def reserve(self, n_slots: int) -> None:
        if n_slots <= self.capacity:
            return
        n_chunks = -(-n_slots // self.slots_per_chunk)
        chunk_nbytes = self.slots_per_chunk * self.row_bytes
        while len(self._chunks) < n_chunks:
            self._chunks.append(torch.empty(chunk_nbytes, dtype=torch.uint8, pin_memory=True))
        ptrs = torch.tensor([c.data_ptr() for c in self._chunks], dtype=torch.int64)
        self._table = ptrs.to(self.device)
        self.capacity = len(self._chunks) * self.slots_per_chunk
        if self.compress:
            grown = torch.full((self.capacity,), self.row_bytes, dtype=torch.int32, device=self.device)
            grown[: self._lengths.numel()].copy_(self._lengths)
            self._lengths = grown
            flags = torch.zeros(self.capacity, dtype=torch.uint8, device=self.device)
            flags[: self._flags.numel()].copy_(self._flags)
            self._flags = flags
        else:
            self._raw_lengths = torch.full((self.capacity,), self.row_bytes, dtype=torch.int32, device=self.device)
            self._raw_flags = torch.zeros(self.capacity, dtype=torch.uint8, device=self.device)

    def live_tensors(self) -> tuple[torch.Tensor, ...]:
        """GPU tensors a read uses that :meth:`reserve` may replace: a side-stream reader keeps them alive."""
        return (self._table, self._lengths, self._flags, self._raw_lengths, self._raw_flags)

    def locate(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(chunk index, byte offset in chunk) of each slot. K and V stores share it: same geometry."""
        chunk = torch.div(slots, self.slots_per_chunk, rounding_mode="floor")
        offset = (slots - chunk * self.slots_per_chunk) * self.row_bytes
        return chunk, offset

    def _pointers(self, loc: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self._table[loc[0]] + loc[1]

    def _raw_meta(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Constant lengths/flags of m raw rows: views of buffers sized in :meth:`reserve` (read-only, so any
        stream may share them), or fresh ones on the current stream for reads larger than the capacity."""
        if m <= self._raw_lengths.numel():
            return self._raw_lengths[:m], self._raw_flags[:m]
        return (torch.full((m,), self.row_bytes, dtype=torch.int32, device=self.device),
                torch.zeros(m, dtype=torch.uint8, device=self.device))

    def write(self, rows_u8: torch.Tensor, slot0: int) -> "torch.Tensor | int":
        m = rows_u8.shape[0]
        if slot0 + m > self.capacity:
            raise CapacityError(f"write of slots [{slot0}, {slot0 + m}) past capacity {self.capacity}; reserve first")
        if m == 0:
            return 0
        if self.compress:
            from ..kernels.bitpack import encode_into

            slots = torch.arange(slot0, slot0 + m, dtype=torch.int64, device=self.device)
            lengths = self._lengths[slot0 : slot0 + m]
            encode_into(rows_u8, self._pointers(self.locate(slots)), lengths, self.codec)
            # the flags a read needs, computed once here (m rows) instead of at every read (all rows)
            torch.lt(lengths, self.row_bytes, out=self._flags[slot0 : slot0 + m].view(torch.bool))
            return lengths
        # Raw rows: contiguous slots, so one async DMA copy per chunk touched (usually one).
        done = 0
        while done < m:
            slot = slot0 + done
            ci, within = divmod(slot, self.slots_per_chunk)
            n = min(m - done, self.slots_per_chunk - within)
            dst = self._chunks[ci][within * self.row_bytes : (within + n) * self.row_bytes]
            dst.copy_(rows_u8[done : done + n].reshape(-1), non_blocking=True)
            done += n
        return m * self.row_bytes

    def read(self, slots: torch.Tensor, out_u8: torch.Tensor, out_rows: "torch.Tensor | None",
             loc: "tuple[torch.Tensor, torch.Tensor] | None" = None, prefix: bool = False) -> "torch.Tensor | int":
        """One ``decode_descriptors`` launch; returns the stored lengths read (a GPU tensor) or the raw byte count.

        ``prefix=True`` promises ``slots == arange(len(slots))`` (a dense read): the per-row metadata is then
        a view, no gather."""
        from ..kernels.bitpack import decode_descriptors

        m = slots.numel()
        if m == 0:
            return 0
        if self.compress:
            if prefix:
                lengths, flags = self._lengths[:m], self._flags[:m]
            else:
                lengths, flags = self._lengths[slots], self._flags[slots]
            moved: "torch.Tensor | int" = lengths
        else:
            lengths, flags = self._raw_meta(m)
            moved = m * self.row_bytes
        ptrs = self._pointers(loc if loc is not None else self.locate(slots))
        decode_descriptors(out_u8, ptrs, lengths, flags, out_rows, self.codec)
        return moved

    def stored_bytes(self, n_slots: int) -> int:
        if not self.compress:
            return n_slots * self.row_bytes
        return int(self._lengths[:n_slots].sum(dtype=torch.int64))

    @property
    def host_nbytes(self) -> int:
        return sum(c.numel() for c in self._chunks)

    @property
    def device_nbytes(self) -> int:
        tables = self.codec.metadata_nbytes if self.compress else 0
        return (self._lengths.numel() * 5 + self._raw_lengths.numel() * 5 + self._table.numel() * 8 + tables)


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
