"""The engine's host store: every row of a table in (pinned) host memory, read and written by position only.

ONE class serves every adapter: :class:`~ibpcache.cache.feature_cache.FeatureCache` (GNN features, read-only)
and the embedding bags' trainable row cache (:mod:`ibpcache.cache.row_cache`, with write-back).

* Compressed (``compress=True``): a :class:`~ibpcache.compressed.CompressedRows` of any codec (IBP, exponent
  coding) in the paper's in-place layout by default (row i at ``i * row_bytes``, only its first ``lengths[i]`` bytes
  meaningful), or packed. The in-place layout is what makes write-back possible: a row re-encoded after a training
  update always fits its own slot, coded with the table's codec when that shrinks it and raw otherwise, so nothing
  moves.
* Raw (``compress=False``): the rows as they are; lengths are ``row_bytes`` and no per-row tables exist.
* ``compress="auto"``: the host-layout planner (``plan_layout.py``) times compressed vs raw misses on this machine;
  with ``FitOptions(method="auto")`` it weighs IBP, exponent coding and raw rows (:func:`fit_candidates`).
* An existing ``CompressedRows`` (also one attached from shared memory) is served as is, never copied:
  ``adopted`` rows are read-only (their bytes belong to their owner), and checked for replacement on every read.

Transfer paths (:class:`~ibpcache.cache.plan_transfer.Transfer`; ``plan_transfer.py`` picks one) for
:meth:`HostStore.read_into`, i.e. how rows reach a CUDA device:

* ``zero_copy``: GPU warps read the stored rows straight from pinned host memory (UVA) and decode them;
* ``cpu_gather``: the CPU packs the rows' *stored* (compressed) bytes into pinned staging, which crosses PCIe in
  one bulk copy and is decoded on the GPU; wins where random small reads from a large pinned table are bound by
  I/O address translation rather than bandwidth (<= 128 B rows);
* ``host_gather``: the CPU gathers raw rows (torch's multithreaded row gather) or decodes compressed ones into
  pinned staging, one bulk copy: for raw rows this is the code a user would write, the raw baseline a small-row
  table may not beat any other way (Colossal-AI's style for compressed ones).

On CUDA the authoritative per-row lengths live on the GPU (the encode/decode kernels read and write them without a
host round trip; rows are written back by a GPU encode whatever the read path); :meth:`sync_host` refreshes the CPU
copy, and the host-side read paths get the written rows' lengths mirrored at each write. On a CPU the CPU copy is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np
import torch

from .._validation import as_row_bytes, check_rows
from ..codec import METHODS, Codec
from ..compressed import CompressedRows, _flags_from_lengths
from ..errors import (FormatError, InvalidArgumentError, RowDtypeError, RowShapeError, StateError,
                      UnsupportedError)
from ..exponent import ExponentCodec
from ..format import Layout
from ..kernels.hashmap import HostArgs
from .plan_layout import SLOT_FORMS, LayoutChoice, calibrate_layout, named_fit, pick_codec, slot_form
from .plan_transfer import Transfer, TransferChoice, calibrate_transfer

__all__ = ["HostStore", "Transfer", "FitOptions", "CacheMirror", "StagedRows", "fit_codec", "fit_candidates",
           "plan_codec", "FIT_SAMPLE_ROWS", "FIT_SAMPLE_BYTES", "FAST_SEG"]

FIT_SAMPLE_ROWS = 1 << 18
FIT_SAMPLE_BYTES = 1 << 28
"""Tables of more than ``max(FIT_SAMPLE_ROWS, FIT_SAMPLE_BYTES // row_bytes)`` rows are fitted on a seeded random
sample of that many rows (the paper's Table 5: a 1-10% sample loses almost nothing), so a multi-GB table is never
copied to the GPU whole for a fit."""

_STAGE_ALIGN = 16
"""The GPU decoders read 16-byte aligned blocks up to the one holding a row's last byte: staged bytes start
16-byte aligned and end with 16 spare bytes."""


@dataclass(frozen=True)
class FitOptions:
    """How a store fits its own codec (passed to :meth:`Codec.fit`); kept for refits.

    ``method``: ``"ibp"`` (the default), ``"exponent"``, ``"raw"`` or ``"auto"``: the store's planner picks among
    IBP, exponent coding (float tables) and, where the store may stay raw (``compress="auto"``), raw rows, by timing
    the store's own fetch on this machine (the smallest stored size without CUDA). ``threshold`` / ``chunk_bytes``
    apply to IBP, ``seg`` / ``header_budget`` to exponent coding (see :meth:`Codec.fit`)."""

    threshold: "float | str" = "auto"
    chunk_bytes: "int | str" = "auto"
    sample: "float | int | None" = None
    method: str = "ibp"
    seg: "int | str" = "auto"
    header_budget: "float | None" = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidArgumentError(f"method must be one of {', '.join(repr(m) for m in METHODS)}, got "
                                       f"{self.method!r}")

    @classmethod
    def of(cls, codec: Codec) -> "FitOptions":
        """Options that refit a codec like ``codec`` (its method and, for IBP, its threshold and chunk size;
        exponent coding keeps its segment size)."""
        if codec.method == "ibp":
            return cls(threshold=codec.threshold, chunk_bytes=codec.chunk_bytes)  # type: ignore[attr-defined]
        if codec.method == "exponent":
            return cls(method="exponent", seg=codec.seg)  # type: ignore[attr-defined]
        return cls(method=codec.method)

    def methods(self, dtype: torch.dtype) -> tuple[str, ...]:
        """The compressed methods to fit for rows of ``dtype``: ``method``, or for ``"auto"`` IBP plus exponent
        coding where the dtype takes it."""
        if self.method != "auto":
            return (self.method,)
        return ("ibp", "exponent") if ExponentCodec.takes(dtype) else ("ibp",)


def _fit_sample(rows: torch.Tensor, options: FitOptions) -> torch.Tensor:
    """``rows``, or a seeded random sample of them for large tables: the engine's one sampling rule."""
    n = int(rows.shape[0])
    row_bytes = max(1, rows[:1].numel() * rows.element_size())
    k = max(FIT_SAMPLE_ROWS, FIT_SAMPLE_BYTES // row_bytes)
    if options.sample is None and n > k:
        pick = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:k].sort().values
        rows = rows[pick.to(rows.device)]
    return rows


def _fit_one(rows: torch.Tensor, method: str, options: FitOptions) -> Codec:
    kw: dict[str, Any] = {}
    if options.header_budget is not None:
        kw["header_budget"] = options.header_budget
    return Codec.fit(rows, threshold=options.threshold, chunk_bytes=options.chunk_bytes, sample=options.sample,
                     method=method, seg=options.seg, **kw)


def fit_codec(rows: torch.Tensor, device: torch.device, options: FitOptions = FitOptions()) -> Codec:
    """Fit a codec on ``rows`` (any device) on ``device`` (large tables: a seeded sample). ``method="auto"`` here
    is the untimed rule: the smallest stored size (:meth:`Codec.fit`); :func:`plan_codec` times the candidates."""
    return _fit_one(_fit_sample(rows, options).to(device), options.method, options)


FAST_SEG = 32
"""The segment length of the second exponent candidate :func:`fit_candidates` offers the planner when the fitted one
(``seg="auto"``: the smallest stored size) is longer. Why: a row's segments are decoded in parallel, one lane each,
so rows of few long segments decode slowly from device memory (cache hits); measured on an H200 with MiniLM rows,
32-element segments decoded 2 KB rows 2.5-3.7x faster and 512 B rows 1.3x faster, for 1-4% of the ratio
(docs/results/2026-11-26-h200-s26). Which of the two pays is the planner's measurement."""


def fit_candidates(rows: torch.Tensor, device: torch.device, options: FitOptions = FitOptions()) -> list[Codec]:
    """One fitted codec per compressed method ``options`` allows for these rows (:meth:`FitOptions.methods`), all
    fitted on the same sample: what the planner times against each other (and raw rows). With ``method="auto"``
    and ``seg="auto"``, an exponent codec whose segments are longer than :data:`FAST_SEG` elements comes with a
    second one of :data:`FAST_SEG`-element segments (``"exponent_seg32"`` in the planner's choice)."""
    sample = _fit_sample(rows, options).to(device)
    codecs = [_fit_one(sample, m, options) for m in options.methods(rows.dtype)]
    if options.method == "auto" and options.seg == "auto":
        codecs += [_fit_one(sample, "exponent", replace(options, seg=FAST_SEG)) for c in codecs
                   if c.method == "exponent" and c.seg > FAST_SEG]  # type: ignore[attr-defined]
    return codecs


def plan_codec(rows: torch.Tensor, device: torch.device, options: FitOptions, allow_raw: bool,
               host_paths: bool = False, slots: str = "stored") -> tuple[Codec, LayoutChoice]:
    """The planner's codec for ``rows`` on ``device``: the candidates of ``options`` (and raw rows when
    ``allow_raw``), each timed on the store's own zero-copy fetch (CUDA) or sized (CPU); returns the chosen codec
    (a :class:`RawCodec` for raw rows) and why (:class:`LayoutChoice`). ``slots``: how a cache in front of the
    store may hold rows (``plan_layout.SLOT_FORMS``)."""
    candidates = fit_candidates(rows, device, options)
    choice = calibrate_layout(rows, candidates, device, host_paths=host_paths, allow_raw=allow_raw, slots=slots)
    if not choice.compress:
        return Codec.raw(rows.dtype, tuple(rows.shape[1:])), choice
    return pick_codec(candidates, choice), choice


_EMPTY_I32 = np.empty(0, np.int32)
_EMPTY_I64 = np.empty(0, np.int64)


@dataclass(frozen=True)
class CacheMirror:
    """A GPU cache's index as the host sees it, for the ``cpu_gather`` transfer: ``pos`` (int32 per table row: its
    position among the cached rows, -1 = not cached), and per cached row its absolute slab address (``src``) and
    stored length. Only a cache whose contents the host knows (a static one) has one."""

    pos: np.ndarray
    src: np.ndarray
    length: np.ndarray


_NO_HITS = CacheMirror(_EMPTY_I32, _EMPTY_I64, _EMPTY_I32)


@dataclass(frozen=True)
class StagedRows:
    """Decode descriptors on the device after :meth:`HostStore.stage` (views into one staged buffer): per id the
    source address, stored length and compressed flag; ``counters`` int64 [requests, hits, staged bytes, hit bytes]
    in FetchStats order."""

    src: torch.Tensor
    lengths: torch.Tensor
    compressed: torch.Tensor
    counters: torch.Tensor


class HostStore:
    """Rows of one table in host memory, compressed or raw, plus the tables a read needs.

    Args:
        rows: ``[N, ...]`` tensor (copied once with ``.contiguous()`` if strided), or a ``CompressedRows``.
        codec: the codec to compress with; or :class:`FitOptions` to fit one here (and at :meth:`refit`); None
            only with ``compress=False`` or a ``CompressedRows``.
        compress: True, False or ``"auto"`` (the planner decides; needs ``FitOptions`` or a codec). A codec
            given with ``"auto"`` is weighed against raw rows; ``FitOptions(method="auto")`` weighs IBP, exponent
            coding and raw rows (with ``compress=True``: IBP against exponent coding).
        device: where rows are read to (``cuda``: pinned host memory; ``cpu``: plain memory, Numba decoders).
        layout: ``inplace`` (writable) or ``packed`` (read-only, smallest) for rows compressed here.
        share_rows: serve raw rows from the caller's tensor itself when it is already where they would go (pinned on
            CUDA): no copy, for readers that never write back (FeatureCache). Writable stores copy.
        transfer: a :class:`Transfer` for CUDA reads, or ``"auto"``: the planner times zero-copy against cpu-gather
            reads of this store at construction and keeps the faster (``stats()['transfer']``). A CPU store
            always decodes on the host.
        slots: how the device cache in front of this store holds rows, for the planner's weighing of cache hits
            (``"stored"``: as stored; ``"decoded"``: decoded at admission; ``"auto"``: the planner says which,
            ``layout_choice.slots``; see ``plan_layout.slot_form``).
    """

    adopted: Optional[CompressedRows] = None

    def __init__(self, rows: "torch.Tensor | CompressedRows", *, codec: "Codec | FitOptions | None" = None,
                 compress: "bool | str" = True, device: torch.device, layout: "str | Layout" = Layout.INPLACE,
                 transfer: "str | Transfer" = "auto", share_rows: bool = False, slots: str = "stored") -> None:
        if compress not in (True, False, "auto"):
            raise InvalidArgumentError(f"compress must be True, False or 'auto', got {compress!r}")
        if slots not in SLOT_FORMS:
            raise InvalidArgumentError(f"slots must be one of {SLOT_FORMS}, got {slots!r}")
        self.slots_option = slots
        self.device = device
        auto = transfer == "auto"
        self.transfer = Transfer.ZERO_COPY if auto else Transfer.coerce(transfer)
        if device.type != "cuda":  # nothing crosses PCIe: rows are decoded where they are
            self.transfer = Transfer.HOST_GATHER
        self._pin = device.type == "cuda"
        self._share_rows = bool(share_rows)
        self.fit_options = codec if isinstance(codec, FitOptions) else None
        self.compress_option: "bool | str" = compress
        self.layout_choice: Optional[LayoutChoice] = None  # set when compress="auto" decided
        self.refits = 0
        self.rows_read = 0
        self.rows_written = 0
        self.bytes_read = torch.zeros((), dtype=torch.int64, device=device)
        self._flags_dev: Optional[torch.Tensor] = None
        # exponent decodes on the GPU report a malformed stored row here (1 + its position; read by check_errors)
        self.decode_errors = torch.zeros(2, dtype=torch.int64, device=device)
        if isinstance(rows, CompressedRows):
            self._from_compressed(rows, codec if isinstance(codec, Codec) else None, compress)
        else:
            self._load(check_rows(rows, "rows"), codec if isinstance(codec, Codec) else None, Layout.from_str(layout))
        self.transfer_choice: Optional[TransferChoice] = None  # set when transfer="auto" was timed
        if auto and device.type == "cuda":
            self._time_transfer()

    @classmethod
    def adopt(cls, rows: CompressedRows, *, device: torch.device,
              transfer: "str | Transfer" = Transfer.ZERO_COPY) -> "HostStore":
        """Serve ``rows`` as they are (no copy; an attached shared store is page-locked in place): read-only."""
        return cls(rows, compress=True, device=device, transfer=transfer)

    # -- construction -----------------------------------------------------------------------------

    def _from_compressed(self, packed: CompressedRows, codec: Optional[Codec], compress: "bool | str") -> None:
        if codec is not None and not codec.same_tables(packed.codec):
            raise InvalidArgumentError("codec differs from the codec the CompressedRows were made with")
        packed.check_shared()
        self._geometry(packed.n_rows, packed.row_bytes, packed.dtype, tuple(packed.codec.row_shape))
        if compress is False:  # the caller asked for raw host rows: a private decoded copy
            self._use_raw(as_row_bytes(packed.decompress(device="cpu")))
            self.compress = False
        else:
            self._use_packed(packed)
            self.adopted = packed
            self.compress = True

    def _geometry(self, n_rows: int, row_bytes: int, dtype: torch.dtype, row_shape: tuple[int, ...]) -> None:
        self.n_rows, self.row_bytes, self.dtype, self.row_shape = n_rows, row_bytes, dtype, row_shape

    def _load(self, rows: torch.Tensor, codec: Optional[Codec], layout: Layout) -> None:
        """(Re)build the stored bytes from dense rows: plan (``"auto"``), fit if needed, encode or copy."""
        u8 = as_row_bytes(rows)
        self._geometry(int(rows.shape[0]), int(u8.shape[1]), rows.dtype, tuple(rows.shape[1:]))
        self.adopted = None
        self.compress = self.compress_option is not False
        planned = self.compress_option == "auto" or (self.compress and codec is None and self.fit_options is not None
                                                     and self.fit_options.method == "auto")
        if planned and self.layout_choice is None:  # first load: the planner decides (refits keep its choice)
            if codec is not None:
                self.layout_choice = calibrate_layout(rows, codec, self.device, slots=self.slots_option)
            else:
                codec, self.layout_choice = plan_codec(rows, self.device, self.fit_options or FitOptions(),
                                                       allow_raw=self.compress_option == "auto",
                                                       slots=self.slots_option)
            self.compress = self.layout_choice.compress
        elif planned:
            self.compress = self.layout_choice.compress
        if not self.compress:
            self._use_raw(u8 if u8.device.type == "cpu" else u8.cpu())
            return
        if codec is None:
            if self.fit_options is None:
                raise InvalidArgumentError("compress=True needs a codec (or FitOptions to fit one)")
            codec = self._fit(rows)
        run_on = rows.device if rows.is_cuda else self.device
        self._use_packed(codec.compress(rows, layout=layout, pin=self._pin, device=run_on))

    def _fit(self, rows: torch.Tensor) -> Codec:
        """Fit the store's codec; after a planned choice, of the method the planner chose (a refit keeps it)."""
        options = self.fit_options or FitOptions()
        if options.method == "auto" and self.layout_choice is not None and self.layout_choice.compress:
            method, seg = named_fit(self.layout_choice.method)
            options = replace(options, method=method, **({} if seg is None else {"seg": seg}))
        return fit_codec(rows, self.device, options)

    def _use_packed(self, packed: CompressedRows) -> None:
        self.packed: Optional[CompressedRows] = packed
        self.codec = packed.codec
        self.data = packed.host_data_for_gpu() if self._pin else packed.data
        self.layout = packed.layout
        self.lengths_cpu: Optional[torch.Tensor] = packed.lengths
        self.offsets_cpu: Optional[torch.Tensor] = packed.offsets if packed.layout is Layout.PACKED else None
        meta = packed.device_meta(self.device)  # per-row tables on the read device (the same tensors on a CPU)
        self.lengths_dev: Optional[torch.Tensor] = meta["lengths"]
        self.offsets_dev: Optional[torch.Tensor] = meta.get("offsets")
        self._flags_dev = meta["flags"]
        self.compressed_fraction_at_fit = self.compressed_fraction()

    def _use_raw(self, rows_u8: torch.Tensor) -> None:
        flat = rows_u8.reshape(-1)
        if self._share_rows and (flat.is_pinned() or not self._pin):
            pass  # served in place: the caller's rows are already where they would go
        elif self._pin:  # a pinned copy the store owns (write-back may rewrite it)
            flat = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True).copy_(flat)
        else:
            flat = flat.clone()
        self.packed = None
        self.codec = Codec.raw(self.dtype, self.row_shape)
        self.data = flat
        self.layout = Layout.INPLACE
        self.lengths_cpu = self.offsets_cpu = None
        self.lengths_dev = self.offsets_dev = self._flags_dev = None
        self.compressed_fraction_at_fit = 0.0

    # -- sizes ------------------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        """Elements per row of a 1-D-row (embedding) table."""
        return int(np.prod(self.row_shape, dtype=np.int64)) if self.row_shape else 1

    @property
    def read_only(self) -> bool:
        """Serving adopted rows (see :meth:`adopt`): no write-back, no training."""
        return self.adopted is not None

    @property
    def raw_nbytes(self) -> int:
        return self.n_rows * self.row_bytes

    @property
    def stored_nbytes(self) -> int:
        """Row bytes a full read moves (compressed lengths summed; the raw size when uncompressed)."""
        return self.stored_bytes() if self.compress else self.raw_nbytes

    @property
    def ratio(self) -> float:
        return self.raw_nbytes / max(self.stored_nbytes, 1)

    @property
    def device_table_nbytes(self) -> int:
        """GPU bytes of the per-row tables (lengths, flags, offsets)."""
        return sum(t.numel() * t.element_size() for t in (self.lengths_dev, self._flags_dev, self.offsets_dev)
                   if t is not None)

    @property
    def lengths(self) -> torch.Tensor:
        """int32 [N] stored bytes per row on the CPU (current after :meth:`sync_host`)."""
        return self.stored_lengths()

    @property
    def compressed_cpu(self) -> Optional[torch.Tensor]:
        """uint8 [N] 1 = row stored compressed (CPU; None when raw): the format's flag, ``lengths < row_bytes``."""
        return None if self.lengths_cpu is None else (self.lengths_cpu < self.row_bytes).to(torch.uint8)

    def stored_lengths(self) -> torch.Tensor:
        """int32 [N] stored bytes per row, on the CPU (``row_bytes`` everywhere when raw)."""
        if self.lengths_cpu is not None:
            return self.lengths_cpu
        return torch.full((self.n_rows,), self.row_bytes, dtype=torch.int32)

    def _current_lengths(self) -> Optional[torch.Tensor]:
        """The authoritative lengths (device under zero-copy CUDA, else CPU); None when raw."""
        if self.lengths_cpu is None:
            return None
        return self.lengths_dev if self._device_lengths else self.lengths_cpu

    def compressed_fraction(self) -> float:
        lens = self._current_lengths()
        if lens is None or self.n_rows == 0:
            return 0.0
        return float((lens < self.row_bytes).sum()) / self.n_rows

    def stored_bytes(self) -> int:
        lens = self._current_lengths()
        return self.raw_nbytes if lens is None else int(lens.sum(dtype=torch.int64))

    @property
    def _device_lengths(self) -> bool:
        """Are the GPU lengths authoritative? On CUDA writes are GPU encodes that update them there (host-side
        transfer paths also get the written rows' lengths mirrored, see :meth:`write_rows`)."""
        return self.device.type == "cuda" and self.lengths_dev is not None

    # -- reads ------------------------------------------------------------------------------------

    def check_live(self) -> None:
        """Raise StaleStoreError if the rows are an attached shared store that was replaced or stopped (a few
        loads from the segment header): every read path calls it first, so rows of two generations never mix."""
        if self.adopted is not None:
            self.adopted.check_shared()

    def host_args(self) -> HostArgs:
        """What the probe kernel needs to address a miss (the base is valid on the GPU through UVA)."""
        if self.lengths_dev is not None and self._flags_dev is None:  # rows were rewritten: flags follow lengths
            self._flags_dev = _flags_from_lengths(self.lengths_dev, self.row_bytes)
        return HostArgs(base=int(self.data.data_ptr()), offsets=self.offsets_dev, stride=self.row_bytes,
                        lengths=self.lengths_dev, row_bytes=self.row_bytes, flags=self._flags_dev)

    def cpu_descriptors(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offsets int64, lengths int32, compressed uint8) of rows ``ids`` from the CPU tables."""
        if self.offsets_cpu is not None:
            offsets = self.offsets_cpu.numpy()[ids]
        else:
            offsets = ids.astype(np.int64) * self.row_bytes
        if self.lengths_cpu is None:
            return offsets, np.full(ids.shape, self.row_bytes, np.int32), np.zeros(ids.shape, np.uint8)
        lens = self.lengths_cpu.numpy()[ids]
        return offsets, lens, (lens < self.row_bytes).astype(np.uint8)

    def _gpu_descriptors(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(absolute source addresses, lengths, compressed) of rows ``ids`` (CUDA int64) for zero-copy decode."""
        base = self.data.data_ptr()
        src = (self.offsets_dev.index_select(0, ids) if self.offsets_dev is not None else ids * self.row_bytes) + base
        if self.lengths_dev is None:
            lens = torch.full_like(ids, self.row_bytes, dtype=torch.int32)
        else:
            lens = self.lengths_dev.index_select(0, ids)
        return src, lens, (lens < self.row_bytes).to(torch.uint8)

    def read_into(self, ids: torch.Tensor, out_u8: torch.Tensor, out_rows: Optional[torch.Tensor] = None) -> None:
        """Decode rows ``ids`` (int64, valid) into ``out_u8[out_rows]`` (``out_u8[0..M)`` when None); ``out_u8`` is
        uint8 ``[K, row_bytes]`` on the store's device. On CUDA this is enqueued on the current stream through the
        store's transfer path (``cpu_gather`` / ``host_gather`` first read the ids on the host)."""
        if ids.numel() == 0:
            return
        self.check_live()
        self.rows_read += int(ids.numel())
        if self.device.type != "cuda":
            self._decode_cpu(ids, out_u8, out_rows)
        elif self.transfer is Transfer.ZERO_COPY:
            from ..kernels.bitpack import decode_descriptors

            src, lens, comp = self._gpu_descriptors(ids.to(self.device))
            decode_descriptors(out_u8, src, lens, comp, out_rows, self.codec.kernel_tables(out_u8.device),
                               self.decode_errors)
            self.bytes_read += lens.sum(dtype=torch.int64)
        elif self.transfer is Transfer.CPU_GATHER:
            self.bytes_read += self.read_staged(ids.cpu().numpy(), out_u8, out_rows)[2]
        else:  # host gather: the CPU gathers (raw) or decodes (compressed) into pinned staging, one H2D copy
            idx = ids.cpu()
            staging = torch.empty((idx.numel(), self.row_bytes), dtype=torch.uint8, pin_memory=True)
            self._decode_cpu(idx, staging, None)
            if out_rows is None:  # straight into the caller's rows
                out_u8[: idx.numel()].copy_(staging, non_blocking=True)
            else:
                out_u8.index_copy_(0, out_rows, staging.to(self.device, non_blocking=True))

    def read_staged(self, ids: np.ndarray, out_u8: torch.Tensor, out_rows: Optional[torch.Tensor] = None,
                    hits: "CacheMirror | None" = None, tables: Any = None) -> torch.Tensor:
        """The ``cpu_gather`` read: :meth:`stage` the rows (hits of a GPU cache through its mirror), then ONE decode
        launch from device memory into ``out_u8[out_rows]``, with ``tables`` (default: the store's codec; a cache
        whose slab holds other bytes passes its own). Returns the device counters [requests, hits, staged bytes,
        hit bytes]."""
        from ..kernels.bitpack import decode_descriptors

        st = self.stage(ids, hits)
        decode_descriptors(out_u8, st.src, st.lengths, st.compressed, out_rows,
                           tables if tables is not None else self.codec.kernel_tables(out_u8.device),
                           self.decode_errors)
        return st.counters

    def stage(self, ids: np.ndarray, hits: "CacheMirror | None" = None) -> "StagedRows":
        """The ``cpu_gather`` transfer's host half: for each id (int64, valid) its decode descriptor -- the slab
        address of a GPU-cache hit (``hits``: the cache's host mirror) or the staged address of a row read here --
        and the staged rows' STORED bytes, packed into one pinned buffer that crosses PCIe in ONE copy, enqueued on
        the current stream. Three Numba passes over the ids (lengths, scan, descriptors + bytes), two in parallel.

        The device buffer is allocated first (stream-ordered), so the host writes final addresses; the pinned
        buffer comes from torch's caching host allocator, which does not hand a block out again before the copy
        that reads it has completed: nothing here waits for the GPU."""
        from ..kernels.bitpack_cpu import stage_lengths_cpu, stage_rows_cpu, stage_scan_cpu

        hits = hits or _NO_HITS
        b = int(ids.shape[0])
        lens = np.empty(b, np.int32)
        miss = np.empty(b, np.uint8)
        starts = np.empty(b, np.int64)
        host_lens = self.lengths_cpu.numpy() if self.lengths_cpu is not None else _EMPTY_I32
        stage_lengths_cpu(ids, hits.pos, hits.length, host_lens, self.row_bytes, lens, miss)
        n_hits, staged, hit_bytes = stage_scan_cpu(lens, miss, starts)
        cpos = _round_up(13 * b, 8)
        head = _round_up(cpos + 32, _STAGE_ALIGN)  # src | lengths | compressed | 4 counters | staged bytes
        size = head + _round_up(staged, _STAGE_ALIGN) + _STAGE_ALIGN
        dev = torch.empty(size, dtype=torch.uint8, device=self.device)
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
        h = buf.numpy()
        offsets = self.offsets_cpu.numpy() if self.offsets_cpu is not None else _EMPTY_I64
        raw = self.lengths_cpu is None  # raw rows are whole slots: torch's multithreaded row gather copies them
        stage_rows_cpu(ids, hits.pos, hits.src, offsets, self.row_bytes, self.data.numpy(), lens, miss, starts,
                       self.row_bytes, dev.data_ptr() + head, h[: 8 * b].view(np.int64), h[8 * b : 12 * b].view(np.int32),
                       h[12 * b : 13 * b], h[head:], not raw)
        if raw and staged:
            rows = torch.from_numpy(ids[miss.view(np.bool_)])
            torch.index_select(self.data.view(self.n_rows, self.row_bytes), 0, rows,
                               out=buf[head : head + staged].view(-1, self.row_bytes))
        h[cpos : cpos + 32].view(np.int64)[:] = (b, n_hits, staged, hit_bytes)
        dev[: head + staged].copy_(buf[: head + staged], non_blocking=True)
        return StagedRows(dev[: 8 * b].view(torch.int64), dev[8 * b : 12 * b].view(torch.int32), dev[12 * b : 13 * b],
                          dev[cpos : cpos + 32].view(torch.int64))

    def _decode_cpu(self, idx: torch.Tensor, out: torch.Tensor, out_rows: Optional[torch.Tensor]) -> None:
        """Rows ``idx`` into ``out[out_rows]`` (``out[0..M)`` when None) on the host, multithreaded."""
        if self.lengths_cpu is None:  # raw rows: torch's multithreaded row gather, no descriptors
            self.bytes_read += idx.numel() * self.row_bytes
            rows2d = self.data.view(self.n_rows, self.row_bytes)
            if out_rows is None:
                torch.index_select(rows2d, 0, idx, out=out[: idx.numel()])
            else:
                out.index_copy_(0, out_rows, rows2d.index_select(0, idx))
            return
        ids_np = idx.numpy()
        offs, lens, comp = self.cpu_descriptors(ids_np)
        self.bytes_read += int(lens.sum(dtype=np.int64))
        rows = np.arange(ids_np.shape[0], dtype=np.int64) if out_rows is None else out_rows.numpy()
        self.codec.decode_rows_at(self.data.numpy(), offs, lens, out.numpy(), rows, compressed=comp)

    def raw_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """uint8 [len(ids), row_bytes] raw bytes of rows ``ids`` on the store's device (cache fills; not a hot path)."""
        out = torch.empty((ids.numel(), self.row_bytes), dtype=torch.uint8, device=self.device)
        self.read_into(ids.to(self.device) if self.transfer is Transfer.ZERO_COPY else ids.cpu(), out)
        return out

    # -- writes -----------------------------------------------------------------------------------

    def write_rows(self, ids: torch.Tensor, rows_u8: torch.Tensor) -> None:
        """Store ``rows_u8`` (uint8 ``[M, row_bytes]``) as rows ``ids`` (distinct), re-encoded with the store's
        codec in place: coded if that shrinks a row (IBP: it still matches the mask), raw otherwise (training
        write-back). Rows of another width raise RowShapeError, of another dtype than uint8 bytes RowDtypeError,
        before anything is written."""
        self._check_write(ids, rows_u8)
        if self.read_only:
            raise StateError("this store serves adopted CompressedRows (read-only, inference only); build it "
                             "from the dense table to write rows back (e.g. to train an embedding table)")
        if self.layout is not Layout.INPLACE:
            raise UnsupportedError("rows can be written back only in the in-place layout (packed rows cannot grow)")
        if ids.numel() == 0:
            return
        self.rows_written += int(ids.numel())
        self._flags_dev = None  # recomputed from the lengths when the probe kernel next needs them
        if self.device.type == "cuda":  # GPU encode straight into the pinned slots (UVA), any transfer path
            ids = ids.to(self.device)
            lens = torch.empty(ids.numel(), dtype=torch.int32, device=self.device)
            dst = ids * self.row_bytes + self.data.data_ptr()
            # the codec's own encoder (IBP, exponent, raw: IBP's with an empty mask) writes each row's length as
            # it encodes it, so no separate size pass
            self.codec.encode_rows_gpu(rows_u8.to(self.device).contiguous(), dst, lens)
            if self.lengths_dev is not None:
                self.lengths_dev.index_copy_(0, ids, lens)
            if self.transfer is not Transfer.ZERO_COPY:  # host-side readers: mirror the lengths; waits for the write
                if self.lengths_cpu is not None:
                    self.lengths_cpu[ids.cpu()] = lens.cpu()
                else:
                    torch.cuda.current_stream(self.device).synchronize()
            return
        idx = ids.cpu().numpy()
        rows = rows_u8.cpu().contiguous().numpy()
        rows2d = self.data.view(self.n_rows, self.row_bytes).numpy()
        if not self.compress:
            rows2d[idx] = rows
            return
        rows2d[idx] = 0  # the format keeps each slot's tail after the stored bytes zero
        self.lengths_cpu.numpy()[idx] = self.codec.encode_rows_at(rows, self.data.numpy(), idx * self.row_bytes)

    def _check_write(self, ids: torch.Tensor, rows_u8: torch.Tensor) -> None:
        """Rows written back must be this store's rows as bytes, one per id: anything else would be stored wrong."""
        if not isinstance(rows_u8, torch.Tensor) or rows_u8.dtype != torch.uint8:
            raise RowDtypeError(f"rows_u8: expected the rows as uint8 bytes [M, {self.row_bytes}], got "
                                f"{getattr(rows_u8, 'dtype', type(rows_u8).__name__)}")
        if rows_u8.dim() != 2 or rows_u8.shape[1] != self.row_bytes:
            raise RowShapeError(f"rows_u8: expected [M, {self.row_bytes}] bytes (rows of {self.row_shape} "
                                f"{self.dtype}), got {tuple(rows_u8.shape)}")
        if ids.dim() != 1 or ids.numel() != rows_u8.shape[0]:
            raise RowShapeError(f"ids: expected one id per row ({rows_u8.shape[0]}), got shape {tuple(ids.shape)}")

    def check_errors(self) -> None:
        """Raise FormatError if a GPU decode of this store met a malformed stored row (exponent-coded rows can be
        told malformed; the report is sticky until read). Reads one device word: a host sync."""
        if self.device.type != "cuda":
            return
        bad = int(self.decode_errors[0])
        if bad:
            self.decode_errors.zero_()
            raise FormatError(f"a stored row of this {self.codec.method} store is corrupt: it does not decode "
                              f"within its stored length (row {bad - 1} of one read)")

    def sync_host(self) -> None:
        """Make the host bytes and CPU lengths current (waits for in-flight GPU writes)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.check_errors()
        if self._device_lengths and not self.read_only:
            self.lengths_cpu.copy_(self.lengths_dev.cpu())

    # -- whole table ------------------------------------------------------------------------------

    def dense(self) -> torch.Tensor:
        """The decoded table as a new CPU tensor ``[N, ...]``."""
        self.sync_host()
        out = torch.empty((self.n_rows, *self.row_shape), dtype=self.dtype)
        if self.n_rows:
            self._decode_cpu(torch.arange(self.n_rows), as_row_bytes(out), None)
        return out

    def refit(self, table: torch.Tensor) -> None:
        """Fit a new codec on ``table`` (the current full table) and re-encode every row with it (the planner's
        compressed/raw choice stands). An adopted store becomes a private, writable copy (``load_state_dict``)."""
        table = self._check_table(table)
        if self.fit_options is None and self.compress:  # adopted rows: refit like their codec was fitted
            self.fit_options = FitOptions.of(self.codec)
        self.sync_host()  # no kernel may still read the old buffer
        self._load(table.to("cpu"), None, self.layout)
        self.refits += 1

    def _check_table(self, table: torch.Tensor) -> torch.Tensor:
        """``table`` as the store's whole table (its dtype and shape), or the error naming what differs."""
        table = check_rows(table, "table")
        if table.dtype != self.dtype:
            raise RowDtypeError(f"table: expected {self.dtype} rows (the store's), got {table.dtype}")
        if tuple(table.shape) != (self.n_rows, *self.row_shape):
            raise RowShapeError(f"table: expected shape {(self.n_rows, *self.row_shape)} (the store's), got "
                                f"{tuple(table.shape)}")
        return table

    def keep_raw(self, table: torch.Tensor, reason: str) -> None:
        """Hold ``table`` (the current full table) as raw rows from now on, in place of the planner's coded ones, and
        say why in ``stats()['host_layout']``: a planned (``compress="auto"``) store whose rows start being written
        back. The planner times reads; a trained table also writes every evicted row, and coded write-back
        measured 7-11x slower per training step than raw rows at low hit rates (H200)."""
        table = self._check_table(table)
        self.sync_host()  # no kernel may still read the old buffer
        self._use_raw(as_row_bytes(table.to("cpu")))
        self.compress = False
        if self.layout_choice is not None:
            held, why = slot_form(self.slots_option, "raw", 1.0, {})
            self.layout_choice = replace(self.layout_choice, compress=False, method="raw", reason=reason, slots=held,
                                         slots_reason=why)
        if self.transfer_choice is not None:  # the fill path was timed on the coded rows: time it on the raw ones
            self._time_transfer()

    def _time_transfer(self) -> None:
        """Take the transfer path the planner times fastest for these stored rows (``transfer="auto"``)."""
        self.transfer_choice = calibrate_transfer(self)
        self.transfer = Transfer(self.transfer_choice.transfer)

    # -- statistics -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        self.check_errors()
        stored = self.stored_bytes()
        raw = self.raw_nbytes
        layout = (self.layout_choice.as_dict() if self.layout_choice is not None
                  else {"compress": self.compress, "reason": f"compress={self.compress_option!r} (set)"})
        return {
            "host_compress": self.compress,
            "host_layout": layout,
            "host_raw_bytes": raw,
            "host_stored_bytes": stored,
            "host_ratio": raw / max(stored, 1),
            "host_metadata_bytes": (self.codec.metadata_nbytes if self.compress else 0)
            + (4 * self.n_rows if self.lengths_cpu is not None else 0),
            "compressed_rows_fraction": self.compressed_fraction(),
            "compressed_rows_fraction_at_fit": self.compressed_fraction_at_fit,
            "codec_method": self.codec.method if self.compress else "raw",
            "chunk_bytes": getattr(self.codec, "chunk_bytes", None) if self.compress else None,
            "threshold": getattr(self.codec, "threshold", None) if self.compress else None,
            "segment_elems": getattr(self.codec, "seg", None) if self.compress else None,
            "refits": self.refits,
            "rows_fetched": self.rows_read,
            "bytes_fetched": int(self.bytes_read),
            "raw_bytes_fetched": self.rows_read * self.row_bytes,
            "rows_written_back": self.rows_written,
            "fetch_path": self.transfer.value,
            "transfer": (self.transfer_choice.as_dict() if self.transfer_choice is not None
                         else {"transfer": self.transfer.value, "reason": "set"}),
        }


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k
