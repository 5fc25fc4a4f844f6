"""InfiniGen's transfer path, the baseline the KV benchmarks compare against (``KVOffloadManager(transfer="cpu_gather")``).

One decoder layer's K and V rows, raw, in fixed slots of pinned host memory: slot ``s`` of a side at byte
``s * row_bytes`` (the manager numbers slots token-major, ``slot = (t * B + b) * H + h``, so an append never moves
data). A read waits for the slot ids on the CPU, gathers the rows with ``index_select`` into a pinned staging buffer
(one per side) and copies that to the GPU in bulk: InfiniGen's inherent host round trip, kept as the reference.

It sits beside :class:`~ibpcache.cache.append_store.AppendStore` (our path: rows encoded and packed per append, read
by the GPU) and shares its construction and bookkeeping interface (``codecs``, ``row_bytes``, ``slot_cap``,
:meth:`reserve`, :meth:`append`, :meth:`stored_bytes`, ``host_nbytes``, ``device_nbytes``, :meth:`release`), so the
manager holds either one as a layer's store. Reads differ on purpose: this store's are the CPU's (by slot id, per
side), the append store's are the GPU's.
"""

from __future__ import annotations

import torch

from ..errors import CapacityError, InvalidArgumentError
from ..kernels import layout as L
from .append_store import RowCodec, codec_method

__all__ = ["CpuGatherStore"]


class CpuGatherStore:
    """One layer's raw K and V rows in pinned memory, gathered by the CPU (see the module docstring).

    Args:
        k_codec, v_codec: raw codecs (:meth:`Codec.raw <ibpcache.codec.Codec.raw>`) of the two sides' rows, of one
            size: the baseline stores rows uncompressed.
        device: the CUDA device reads copy to.
    """

    def __init__(self, k_codec: RowCodec, v_codec: RowCodec, device: torch.device) -> None:
        if device.type != "cuda":
            raise InvalidArgumentError(f"CpuGatherStore needs a CUDA device, got {device}")
        if codec_method(k_codec) != L.KVP_RAW or codec_method(v_codec) != L.KVP_RAW:
            raise InvalidArgumentError("CpuGatherStore stores raw rows (InfiniGen's baseline): pass raw codecs "
                                       "(Codec.raw)")
        if k_codec.row_bytes != v_codec.row_bytes:
            raise InvalidArgumentError(f"K and V rows differ in size: {k_codec.row_bytes} vs {v_codec.row_bytes}")
        self.codecs = (k_codec, v_codec)
        self.device = device
        self.cuda = True
        self.row_bytes = int(k_codec.row_bytes)
        self.slot_cap = 0  # slots with memory behind them (both sides)
        self._host = [torch.empty((0, self.row_bytes), dtype=torch.uint8) for _ in range(2)]
        self._staging = [torch.empty((0, self.row_bytes), dtype=torch.uint8) for _ in range(2)]

    def reserve(self, n_slots: int) -> None:
        """Make sure slots ``[0, n_slots)`` have memory (grows 1.5x, never shrinks, never moves written rows)."""
        if n_slots <= self.slot_cap:
            return
        cap = max(n_slots, int(self.slot_cap * 1.5))
        for side in (0, 1):
            grown = torch.empty((cap, self.row_bytes), dtype=torch.uint8, pin_memory=True)
            if self.slot_cap:
                torch.cuda.current_stream(self.device).synchronize()  # pending async writes into the old buffer
                grown[: self.slot_cap].copy_(self._host[side])
            self._host[side] = grown
        self.slot_cap = cap

    def append(self, keys: torch.Tensor, values: torch.Tensor, slot0: int) -> int:
        """Store [B, H, n, D] keys/values as slots ``slot0 + t * B * H + b * H + h`` (t < n) of K and V, with an
        asynchronous copy each on the current stream; returns the bytes written."""
        moved = 0
        for side, x in enumerate((keys, values)):
            rows = x.permute(2, 0, 1, 3).reshape(-1, x.shape[3]).contiguous().view(torch.uint8)
            m = rows.shape[0]
            if slot0 + m > self.slot_cap:
                raise CapacityError(f"write of slots [{slot0}, {slot0 + m}) past capacity {self.slot_cap}; "
                                    "reserve first")
            self._host[side][slot0 : slot0 + m].copy_(rows, non_blocking=True)
            moved += m * self.row_bytes
        return moved

    def staging(self, side: int, m: int) -> torch.Tensor:
        """Pinned staging rows of ``side`` for a gather of ``m`` rows (grown geometrically, reused between steps)."""
        if self._staging[side].shape[0] < m:
            self._staging[side] = torch.empty((max(m, int(self._staging[side].shape[0] * 1.5)), self.row_bytes),
                                              dtype=torch.uint8, pin_memory=True)
        return self._staging[side][:m]

    def read_cpu(self, side: int, slots_cpu: torch.Tensor, out_u8: torch.Tensor) -> int:
        """CPU gather + one bulk copy into ``out_u8`` (rows in ``slots_cpu`` order), on the current stream.

        The caller guarantees that the writes of these slots have completed (it synchronised on an event)
        and that the previous copy out of this side's staging buffer has finished.
        """
        m = slots_cpu.numel()
        if m == 0:
            return 0
        staged = self.staging(side, m)
        torch.index_select(self._host[side], 0, slots_cpu, out=staged)
        out_u8.copy_(staged, non_blocking=True)
        return m * self.row_bytes

    def read_range(self, side: int, n_slots: int, out_u8: torch.Tensor) -> int:
        """Slots ``[0, n_slots)`` of ``side`` in one bulk copy (dense attention needs every row; no gather)."""
        out_u8.copy_(self._host[side][:n_slots], non_blocking=True)
        return n_slots * self.row_bytes

    def read(self, side: int, slots: torch.Tensor, out_u8: torch.Tensor, out_rows: "torch.Tensor | None") -> int:
        """Rows of ``slots`` (on any device) into ``out_u8[out_rows]`` (or in order); returns the bytes moved."""
        slots_cpu = slots.to("cpu")  # the CPU must see the indices: InfiniGen's inherent sync
        torch.cuda.current_stream(self.device).synchronize()
        if out_rows is None:
            return self.read_cpu(side, slots_cpu, out_u8)
        tmp = torch.empty((slots_cpu.numel(), self.row_bytes), dtype=torch.uint8, device=self.device)
        moved = self.read_cpu(side, slots_cpu, tmp)
        out_u8.index_copy_(0, out_rows, tmp)
        return moved

    def stored_bytes(self, n_slots: int) -> int:
        """K plus V bytes that slots ``[0, n_slots)`` occupy (raw rows: their full size)."""
        return 2 * n_slots * self.row_bytes

    @property
    def host_nbytes(self) -> int:
        """Host memory held: both sides' slots and staging buffers."""
        return sum(t.numel() for t in (*self._host, *self._staging))

    @property
    def device_nbytes(self) -> int:
        """GPU memory held: none (slot ids are computed per read)."""
        return 0

    def release(self) -> None:
        """Drop the pinned buffers now (after the device finished with them). The store is unusable after."""
        torch.cuda.synchronize(self.device)
        self._host = [torch.empty((0, self.row_bytes), dtype=torch.uint8) for _ in range(2)]
        self._staging = [torch.empty((0, self.row_bytes), dtype=torch.uint8) for _ in range(2)]
        self.slot_cap = 0
