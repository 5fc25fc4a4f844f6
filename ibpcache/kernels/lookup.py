"""Launchers of ``lookup.cu``: the engine's one lookup launch (probe + slab/zero-copy read + decode [+ pooling]).

The codec's kernel tables pick the kernels: IBP / raw :class:`KernelTables` launch the ``*_c{chunk_bytes}`` kernels,
exponent :class:`~ibpcache.kernels.exponent.ExponentTables` the ``*_e{2,4}`` ones (``codec_kind``); any other tables
raise :class:`~ibpcache.errors.CodecKindError` before a launch.

Nothing here synchronizes the device, allocates, or reads a tensor's values: every launch is CUDA-graph capturable
as long as its tensors stay alive and in place. Bad ids are reported by the kernel through ``err`` (a pinned host
int32 word pair the caller reads when it wants to, without a sync), never by a trap.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from ..errors import CodecKindError
from ._build import device_index, launch, sm_count
from .exponent import ExponentTables
from .hashmap import IndexArgs
from .tables import KernelTables

Tables = Union[KernelTables, ExponentTables]
"""The kernel tables a lookup takes: which one picks the kernels' decoder (``codec_kind``)."""

__all__ = ["PoolOp", "ElemType", "SLOTS_INDEX", "SLOT_TABLE_INDEX", "RowSource", "BagLayout", "Staging", "LookupErrors", "lookup_rows",
           "lookup_pool", "fill_rows", "codec_kind", "CORRUPT_ROW",
           "POOL_MAX_ROW_BYTES", "POOL_MAX_ELEMS", "pool_supported"]

_SRC = "lookup.cu"
_ROWS_WARPS = 8  # IBP_WARPS_PER_BLOCK in bitpack.cu
_POOL_WARPS = 4  # IBP_POOL_WARPS in lookup.cu
POOL_MAX_ROW_BYTES = 2048  # IBP_POOL_MAX_ROW
POOL_MAX_ELEMS = 32 * 32  # 32 lanes x IBP_POOL_PER_LANE_WIDE
_POOL_NARROW_ELEMS = 32 * 16  # 32 lanes x IBP_POOL_PER_LANE: rows this short take the kernel with fewer registers
SLOTS_INDEX = 3  # IBP_INDEX_SLOTS: int32 slot per row into slab 0 (a raw row cache)
SLOT_TABLE_INDEX = 4
"""IBP_INDEX_SLOT_TABLE: a cache of stored rows in fixed-stride slots (see lookup.cu): ``index.table_values`` is the
int32 slot table (v >= 0 slot v of slab 0, v <= -2 staging row -2 - v in slab 1, -1 host), ``index.table_keys`` the
int32 stored length of every slot and staging row, ``index.capacity`` the number of slots and ``index.max_probes``
the slot stride in bytes."""


class PoolOp(enum.IntEnum):
    """Keep in sync with IBP_OP_* in lookup.cu."""

    ROWS = 0
    SUM = 1
    MEAN = 2
    MAX = 3


class ElemType(enum.IntEnum):
    """Element types the pooling kernel folds (keep in sync with IBP_ELEM_* in lookup.cu)."""

    F32 = 0
    F16 = 1
    BF16 = 2

    @classmethod
    def of(cls, dtype: torch.dtype) -> "ElemType | None":
        return {torch.float32: cls.F32, torch.float16: cls.F16, torch.bfloat16: cls.BF16}.get(dtype)


def pool_supported(dtype: torch.dtype, row_bytes: int) -> bool:
    """Whether the fused pooling kernel takes rows of this dtype and size (else pool with torch)."""
    elem = ElemType.of(dtype)
    if elem is None or row_bytes > POOL_MAX_ROW_BYTES:
        return False
    return row_bytes // (4 if elem is ElemType.F32 else 2) <= POOL_MAX_ELEMS


@dataclass(frozen=True)
class RowSource:
    """Where rows live: the cache index (``index.mode`` may be ``SLOTS_INDEX``: ``index.table_values`` is then an
    int32 slot per row into ``slab_bases[0]``), the slab base addresses, and the host store (``host_base`` is its
    device-visible address; ``host_offsets`` int64 [N] or None for row i at ``i * host_stride``; ``host_lengths``
    int32 [N] or None when every row is stored raw). ``n_rows`` bounds ids when there is one table."""

    index: IndexArgs
    slab_bases: torch.Tensor
    host_base: int
    host_offsets: Optional[torch.Tensor]
    host_stride: int
    host_lengths: Optional[torch.Tensor]
    n_rows: int


@dataclass(frozen=True)
class BagLayout:
    """How bag j maps to (table t, sample s) and where its output goes (``out[s, t]`` of ``[S, T, row]``).

    One table (the default): bag j is sample j. Several tables: ``sample_major`` bags are ``j = s * T + t`` (a
    ``[B, T]`` id matrix), else table-major ``j = t * per_table + s`` (TorchRec's KJT / FBGEMM's TBE order).
    ``table_base`` / ``table_rows`` (int64 [T]) turn table-local ids into global rows and bound them."""

    n_tables: int = 1
    per_table: int = 0
    sample_major: bool = False
    table_base: Optional[torch.Tensor] = None
    table_rows: Optional[torch.Tensor] = None


_ONE_TABLE = BagLayout()


CORRUPT_ROW = 3
"""LookupErrors kind of a stored row the decoder found malformed (exponent rows; IBP cannot tell)."""


class LookupErrors:
    """The kernels' bad-input report: two int32 words (kind, where) that the kernel writes and the host reads
    without a sync (pinned host memory on CUDA). kind 1: an id outside its table (where = the table); kind 2:
    offsets that break torch's rules (where = the bag); kind 3 (:data:`CORRUPT_ROW`): a stored row that does not
    decode (a corrupt store; where = the table; its output row is zeros, or it pooled nothing)."""

    BAD_ID = 1
    BAD_OFFSETS = 2
    CORRUPT_ROW = CORRUPT_ROW

    def __init__(self, pin: bool) -> None:
        self.words = torch.zeros(2, dtype=torch.int32, pin_memory=pin)
        self._np = self.words.numpy()

    @property
    def ptr(self) -> int:
        return int(self.words.data_ptr())

    def take(self) -> "tuple[int, int] | None":
        """``(kind, where)`` of a report left by a recent launch, or None; clears it."""
        if not self._np[0]:
            return None
        kind, where = int(self._np[0]), int(self._np[1])
        self._np[:] = 0
        return kind, where


@dataclass(frozen=True)
class Staging:
    """Device buffers of the in-step miss deduplication (see lookup.cu): ``stage_of`` int64 [n_rows] (zeros at
    first), ``step_state`` int64 [4] (zeros at first), ``stage_gid`` int64 [cap], ``rows`` uint8 [cap * row_bytes +
    16]. Every missed row is read from host memory once per lookup step, however many bags ask for it."""

    stage_of: torch.Tensor
    step_state: torch.Tensor
    stage_gid: torch.Tensor
    rows: torch.Tensor
    cap: int

    @classmethod
    def allocate(cls, n_rows: int, row_bytes: int, stage_bytes: int, device: torch.device) -> "Staging":
        cap = max(1, min(stage_bytes // row_bytes, 0xFFFFFFF0))
        return cls(torch.zeros(n_rows, dtype=torch.int64, device=device),
                   torch.zeros(4, dtype=torch.int64, device=device),
                   torch.empty(cap, dtype=torch.int64, device=device),
                   torch.empty(cap * row_bytes + 16, dtype=torch.uint8, device=device), cap)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.stage_of, self.step_state, self.stage_gid, self.rows))


def _ptr(t: Optional[torch.Tensor]) -> np.uint64:
    return np.uint64(0 if t is None or t.numel() == 0 else t.data_ptr())


def codec_kind(tables: object) -> tuple[str, tuple]:
    """The kernel-name suffix of a codec's tables and their three codec arguments (``codec_n, codec_a, codec_b`` in
    lookup.cu): IBP / raw ``("c{C}", (n_chunks, mask, bitval))``, exponent ``("e{2,4}", (max_bits, lut, geom))``.
    Other tables raise CodecKindError: a kernel must never decode rows of a format it does not read."""
    if isinstance(tables, KernelTables):
        return f"c{tables.chunk_bytes}", (np.int32(tables.n_chunks), _ptr(tables.mask), _ptr(tables.bitval))
    if isinstance(tables, ExponentTables):
        return f"e{tables.elem_bytes}", (np.int32(tables.max_bits), _ptr(tables.lut), _ptr(tables.geom))
    raise CodecKindError(f"the lookup kernels decode IBP, raw and exponent-coded rows; got tables of type "
                         f"{type(tables).__name__}")


def _common_args(ids: torch.Tensor, bag_offsets: Optional[torch.Tensor], bag_size: int, n_bags: int,
                 include_last: bool, layout: Optional[BagLayout], out: torch.Tensor, src: RowSource, tables: Tables,
                 counters: Optional[torch.Tensor], err_ptr: int, freq: Optional[torch.Tensor],
                 staging: Optional[Staging], bag_order: Optional[torch.Tensor] = None,
                 out_ref: Optional[torch.Tensor] = None) -> tuple:
    idx = src.index
    layout = layout if layout is not None else _ONE_TABLE
    st = staging
    return (
        _ptr(ids), np.int64(ids.numel()), _ptr(bag_offsets), np.int32(bag_size), np.int64(n_bags),
        np.int32(int(include_last)), np.int32(layout.n_tables), np.int64(layout.per_table),
        np.int32(int(layout.sample_major)), _ptr(layout.table_base), _ptr(layout.table_rows), np.int64(src.n_rows),
        _ptr(out), np.int32(int(idx.mode)), _ptr(idx.table_keys), _ptr(idx.table_values), np.int64(idx.capacity),
        np.int32(idx.max_probes), _ptr(src.slab_bases), *_host_args(src, tables), _ptr(counters), np.uint64(err_ptr),
        _ptr(freq),
        _ptr(st.stage_of if st else None), _ptr(st.step_state if st else None), _ptr(st.rows if st else None),
        np.int64(st.cap if st else 0), _ptr(bag_order), _ptr(out_ref))


def _stage(args: tuple, n_bags: int, dev: int, src: RowSource, tables: Tables, counters: Optional[torch.Tensor],
           staging: Staging, err_ptr: int) -> None:
    """CLAIM (warp per bag) then STAGE (warp per claimed row): the unique misses of this step, read once."""
    grid = max(1, min(-(-n_bags // _ROWS_WARPS), sm_count(dev) * 16))
    launch(_SRC, "ibp_lookup_claim", dev, grid, 32 * _ROWS_WARPS, args + (_ptr(staging.stage_gid),))
    stage_args = (_ptr(staging.stage_gid), _ptr(staging.step_state), np.int64(staging.cap), _ptr(staging.rows),
                  *_host_args(src, tables), _ptr(counters), np.uint64(err_ptr))
    launch(_SRC, f"ibp_lookup_stage_{codec_kind(tables)[0]}", dev, sm_count(dev) * 8, 32 * _ROWS_WARPS, stage_args)


def _host_args(src: RowSource, tables: Tables) -> tuple:
    """The host store and codec arguments, in the order every lookup.cu kernel takes them."""
    return (np.int64(src.host_base), _ptr(src.host_offsets), np.int64(src.host_stride), _ptr(src.host_lengths),
            np.int32(tables.row_bytes), *codec_kind(tables)[1])


def fill_rows(list_gid: torch.Tensor, list_dst: torch.Tensor, count: torch.Tensor, max_entries: int, src: RowSource,
              tables: Tables, host_bytes: Optional[torch.Tensor], err_ptr: int) -> None:
    """Decode host rows into device addresses (FILL, warp per entry): row ``list_gid[e]`` of ``src``'s host store
    becomes a decoded ``row_bytes`` row at address ``list_dst[e]``, for ``e < min(count[0], max_entries)`` (the
    count read on the device: a row cache's admission list, ``kernels/admit.cu``). ``host_bytes`` (int64 [1] on the
    device, or None) gains the stored bytes read; a malformed row is reported through ``err`` and written as zeros."""
    kind = codec_kind(tables)[0]
    assert list_gid.dtype == torch.int64 and list_dst.dtype == torch.int64 and count.dtype == torch.int64
    assert list_gid.is_cuda and list_dst.device == list_gid.device and count.device == list_gid.device
    assert host_bytes is None or (host_bytes.dtype == torch.int64 and host_bytes.device == list_gid.device)
    assert err_ptr != 0, "err must point at pinned host memory (two int32 words)"
    if max_entries <= 0:
        return
    dev = device_index(list_gid)
    grid = max(1, min(-(-max_entries // _ROWS_WARPS), sm_count(dev) * 16))
    launch(_SRC, f"ibp_lookup_fill_{kind}", dev, grid, 32 * _ROWS_WARPS,
           (_ptr(list_gid), _ptr(list_dst), _ptr(count), np.int64(max_entries), *_host_args(src, tables),
            _ptr(host_bytes), np.uint64(err_ptr)))


def _check(ids: torch.Tensor, out: torch.Tensor, tables: Tables, err_ptr: int,
           staging: Optional[Staging] = None, out_ref: Optional[torch.Tensor] = None) -> str:
    """Cheap launch invariants; returns the kernels' codec suffix (raises CodecKindError for unknown tables)."""
    kind = codec_kind(tables)[0]  # another codec's tables are an error, never garbage
    assert ids.dtype == torch.int64 and ids.is_cuda and ids.is_contiguous()
    assert out.dtype == torch.uint8 and out.is_cuda and out.is_contiguous()
    if out_ref is not None:  # the output's address, read by the kernels at run time (CUDA-graph replays)
        assert out_ref.dtype == torch.int64 and out_ref.device == out.device and out_ref.numel() == 1
    assert err_ptr != 0, "err must point at pinned host memory (two int32 words)"
    assert tables.row_bytes > 0
    if isinstance(tables, ExponentTables):  # its decoder stores whole elements: rows start element-aligned
        assert tables.device == out.device, f"tables on {tables.device}, output on {out.device}"
        assert out.data_ptr() % tables.elem_bytes == 0 and tables.row_bytes % tables.elem_bytes == 0
        if staging is not None:
            assert staging.rows.data_ptr() % tables.elem_bytes == 0
    return kind


ROWS_BLOCKS_PER_SM = 16
"""The rows lookup's grid: at most this many blocks of ``_ROWS_WARPS`` warps per streaming multiprocessor."""


def rows_grid(n: int, sms: int, blocks_per_sm: int = ROWS_BLOCKS_PER_SM) -> int:
    """Blocks of the rows lookup for ``n`` ids on a GPU of ``sms`` multiprocessors: a warp per row, grid-stride,
    at most ``blocks_per_sm`` blocks per multiprocessor."""
    return max(1, min(-(-n // _ROWS_WARPS), sms * blocks_per_sm))


def lookup_rows(ids: torch.Tensor, out: torch.Tensor, src: RowSource, tables: Tables,
                counters: Optional[torch.Tensor], err_ptr: int, freq: Optional[torch.Tensor] = None,
                layout: Optional[BagLayout] = None, staging: Optional[Staging] = None,
                out_ref: Optional[torch.Tensor] = None, blocks_per_sm: int = ROWS_BLOCKS_PER_SM) -> None:
    """``out`` (uint8, one ``row_bytes`` row per id, in ``layout``'s output order) = the rows of ``ids``.
    With ``staging``: three launches that read every missed row from host memory once (else one launch). Raw
    stores (``tables.raw``) take the kernel with several rows per warp. ``out_ref`` (int64 [1] on the device, or
    None): the kernel writes to the address it holds when it runs, ``out`` giving only the shape (see lookup.cu).
    ``blocks_per_sm``: the lookup's grid bound (:func:`rows_grid`)."""
    kind = _check(ids, out, tables, err_ptr, staging, out_ref)
    dev = device_index(out)
    n = ids.numel()
    if n == 0:
        return
    grid = rows_grid(n, sm_count(dev), blocks_per_sm)
    args = _common_args(ids, None, 1, n, False, layout, out, src, tables, counters, err_ptr, freq, staging,
                        out_ref=out_ref)
    if staging is not None:
        _stage(args, n, dev, src, tables, counters, staging, err_ptr)
    single = isinstance(tables, KernelTables) and tables.raw  # raw rows: several per warp in flight
    launch(_SRC, f"ibp_lookup_rows_{'single_' if single else ''}{kind}", dev, grid, 32 * _ROWS_WARPS, args)


def lookup_pool(ids: torch.Tensor, bag_offsets: Optional[torch.Tensor], bag_size: int, n_bags: int,
                include_last: bool, op: PoolOp, elem: ElemType, per_sample_weights: Optional[torch.Tensor],
                out: torch.Tensor, src: RowSource, tables: Tables, counters: Optional[torch.Tensor],
                err_ptr: int, freq: Optional[torch.Tensor] = None, layout: Optional[BagLayout] = None,
                staging: Optional[Staging] = None, bag_order: Optional[torch.Tensor] = None,
                out_ref: Optional[torch.Tensor] = None) -> None:
    """Pool each bag (``bag_offsets`` as torch.nn.functional.embedding_bag takes them, or fixed ``bag_size``)
    into its output row; see lookup.cu for the exact arithmetic. ``bag_order`` (int64 [n_bags], a permutation) is
    the order in which warps take bags (e.g. sorted by row id, so host rows are read in address order);
    ``out_ref`` as for :func:`lookup_rows`."""
    kind = _check(ids, out, tables, err_ptr, staging, out_ref)
    dev = device_index(out)
    assert op is not PoolOp.ROWS
    assert tables.row_bytes <= POOL_MAX_ROW_BYTES
    if per_sample_weights is not None:
        assert per_sample_weights.dtype == torch.float32 and per_sample_weights.is_contiguous()
    if bag_offsets is not None:
        assert bag_offsets.dtype == torch.int64 and bag_offsets.is_contiguous()
    if n_bags == 0:
        return
    grid = max(1, min(-(-n_bags // _POOL_WARPS), sm_count(dev) * 32))
    if bag_order is not None:
        assert bag_order.dtype == torch.int64 and bag_order.numel() == n_bags and bag_order.is_contiguous()
    common = _common_args(ids, bag_offsets, bag_size, n_bags, include_last, layout, out, src, tables, counters,
                          err_ptr, freq, staging, bag_order, out_ref)
    if staging is not None:
        _stage(common, n_bags, dev, src, tables, counters, staging, err_ptr)
    args = (np.int32(int(op)), np.int32(int(elem)), _ptr(per_sample_weights)) + common
    launch(_SRC, _pool_kernel(kind, tables, elem, bag_offsets is None and bag_size == 1), dev, grid,
           32 * _POOL_WARPS, args)


def _pool_kernel(kind: str, tables: Tables, elem: ElemType, one_id_bags: bool) -> str:
    """The pooling kernel of a launch: bags of one id take ``ibp_lookup_pool_single_*``, which works on several bags
    per warp (exponent rows: their segment walks grouped across bags; IBP and raw rows: several probes and rows in
    flight per warp), other bags the bag loop, in its wide form (more accumulators) for rows of more than 512
    elements."""
    if one_id_bags:
        return f"ibp_lookup_pool_single_{kind}"
    wide = tables.row_bytes // (4 if elem is ElemType.F32 else 2) > _POOL_NARROW_ELEMS
    return f"ibp_lookup_pool_{'wide_' if wide else ''}{kind}"
