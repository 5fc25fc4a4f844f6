"""The host store: every row of the dataset in (pinned) host memory, read by position only.

With ``compress=True`` it wraps a :class:`~ibpcache.compressed.CompressedRows` (the paper's in-place layout
by default: row i at ``i * row_bytes`` so no offset table is needed, only its first ``lengths[i]`` bytes are
read) plus its per-row lengths and 1-bit "is compressed" flags on the GPU. With ``compress=False`` it holds the
raw rows: lengths are ``row_bytes`` and every flag is 0, so no per-row tables exist at all.

On CUDA the bytes are pinned and the fetch kernels read them zero-copy through unified virtual addressing
(the pinned buffer's address is valid on the GPU). An attached shared store (``CompressedRows.attach``) is used
as is: never copied, only page-locked in place, and checked for replacement on every fetch.
"""

from __future__ import annotations

import numpy as np
import torch

from .._validation import as_row_bytes, check_rows
from ..codec import Codec
from ..compressed import CompressedRows
from ..format import Layout
from ..kernels.hashmap import HostArgs

__all__ = ["HostStore"]


class HostStore:
    """Rows of one dataset in host memory, compressed or raw, plus the tables a fetch needs to read them.

    ``rows`` may be non-contiguous (a slice, a transpose): it is copied once with ``.contiguous()`` while the
    store is built, which copies or compresses every row into its own buffer anyway.
    """

    def __init__(self, rows: "torch.Tensor | CompressedRows", *, codec: Codec | None, compress: bool,
                 device: torch.device, layout: "str | Layout" = Layout.INPLACE) -> None:
        self.device = device
        self.compress = bool(compress)
        pin = device.type == "cuda"
        self.packed: CompressedRows | None = None
        if isinstance(rows, CompressedRows):
            self._from_compressed(rows, codec, pin)
        else:
            self._from_tensor(check_rows(rows, "rows"), codec, pin, Layout.from_str(layout))
        self._device_tables()

    # -- construction -----------------------------------------------------------------------------

    def _from_compressed(self, packed: CompressedRows, codec: Codec | None, pin: bool) -> None:
        if codec is not None and not codec.same_tables(packed.codec):
            raise ValueError("codec differs from the codec the CompressedRows were made with")
        self.codec = packed.codec
        self.n_rows, self.row_bytes = packed.n_rows, packed.row_bytes
        self.dtype, self.row_shape = packed.dtype, packed.codec.row_shape
        if self.compress:
            self._use_packed(packed, pin)
        else:
            raw = packed.decompress(device="cpu")
            self._use_raw(as_row_bytes(raw), pin)

    def _from_tensor(self, rows: torch.Tensor, codec: Codec | None, pin: bool, layout: Layout) -> None:
        self.n_rows = int(rows.shape[0])
        self.dtype, self.row_shape = rows.dtype, tuple(rows.shape[1:])
        rows_cpu = rows if rows.device.type == "cpu" else rows.cpu()
        u8 = as_row_bytes(rows_cpu)
        self.row_bytes = int(u8.shape[1])
        self.codec = codec
        if self.compress:
            if codec is None:
                raise ValueError("compress=True needs a codec")
            run_on = rows.device if rows.is_cuda else self.device
            self._use_packed(codec.compress(rows, layout=layout, pin=pin, device=run_on), pin)
        else:
            self._use_raw(u8, pin)

    def _use_packed(self, packed: CompressedRows, pin: bool) -> None:
        self.packed = packed
        self.data = packed.host_data_for_gpu() if pin else packed.data
        self.layout = packed.layout
        self.lengths_cpu = packed.lengths
        self.compressed_cpu = packed.is_compressed()
        self.offsets_cpu = packed.offsets if packed.layout is Layout.PACKED else None

    def _use_raw(self, rows_u8: torch.Tensor, pin: bool) -> None:
        flat = rows_u8.reshape(-1)
        if pin and not flat.is_pinned():
            flat = flat.pin_memory()
        self.data = flat
        self.layout = Layout.INPLACE
        self.lengths_cpu = None
        self.compressed_cpu = None
        self.offsets_cpu = None

    def _device_tables(self) -> None:
        """Per-row tables on the fetch device (only those that exist for this layout)."""
        if self.packed is not None:
            meta = self.packed.device_meta(self.device)
            self.lengths_dev: torch.Tensor | None = meta["lengths"]
            self.flags_dev: torch.Tensor | None = meta["flags"]
            self.offsets_dev: torch.Tensor | None = meta.get("offsets")
        else:
            self.lengths_dev = self.flags_dev = self.offsets_dev = None

    # -- sizes ------------------------------------------------------------------------------------

    @property
    def raw_nbytes(self) -> int:
        return self.n_rows * self.row_bytes

    @property
    def stored_nbytes(self) -> int:
        """Row bytes a full read moves (compressed lengths summed; raw size when uncompressed)."""
        return self.packed.nbytes if self.packed is not None else self.raw_nbytes

    @property
    def ratio(self) -> float:
        return self.raw_nbytes / max(self.stored_nbytes, 1)

    @property
    def device_table_nbytes(self) -> int:
        """GPU bytes of the per-row tables (lengths, flags, offsets)."""
        return sum(t.numel() * t.element_size() for t in (self.lengths_dev, self.flags_dev, self.offsets_dev)
                   if t is not None)

    def stored_lengths(self) -> torch.Tensor:
        """int32 [N] stored bytes per row, on the CPU."""
        if self.lengths_cpu is not None:
            return self.lengths_cpu
        return torch.full((self.n_rows,), self.row_bytes, dtype=torch.int32)

    # -- reads ------------------------------------------------------------------------------------

    def check_live(self) -> None:
        """Raise StaleStoreError if the rows are an attached shared store that was replaced or stopped.

        A few loads from the segment header; FeatureCache.fetch calls it first, so a fetch never mixes a
        replaced store's rows (slab hits) with nothing to tell the caller."""
        if self.packed is not None:
            self.packed.check_shared()

    def host_args(self) -> HostArgs:
        """What the probe kernel needs to address a miss (the base is valid on the GPU through UVA)."""
        return HostArgs(base=int(self.data.data_ptr()), offsets=self.offsets_dev, stride=self.row_bytes,
                        lengths=self.lengths_dev, row_bytes=self.row_bytes, flags=self.flags_dev)

    def cpu_descriptors(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offsets int64, lengths int32, compressed uint8) of rows ``ids`` for ``decode_rows_cpu``."""
        if self.offsets_cpu is not None:
            offsets = self.offsets_cpu.numpy()[ids]
        else:
            offsets = ids.astype(np.int64) * self.row_bytes
        if self.lengths_cpu is None:
            return offsets, np.full(ids.shape, self.row_bytes, np.int32), np.zeros(ids.shape, np.uint8)
        return offsets, self.lengths_cpu.numpy()[ids], self.compressed_cpu.numpy()[ids]

    def raw_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """uint8 [len(ids), row_bytes] raw bytes of rows ``ids`` (cache fills, not the hot path).

        Raw stores index on the CPU; compressed stores decode on the fetch device (the GPU decoder reads
        the pinned store zero-copy)."""
        if self.packed is None:
            return self.data.view(self.n_rows, self.row_bytes)[ids.cpu()]
        rows = self.packed.gather(ids.to(self.device), device=self.device)
        return as_row_bytes(rows)
