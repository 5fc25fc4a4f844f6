"""The engine's append-only row store: a decoder layer's K and V rows, encoded and packed back to back in host memory.

Why packed: a KV row is small (128 B at head_dim 64 in bf16). Kept in a fixed slot, a row the codec shrank to
~87 bytes still occupies its whole slot in host memory and still spans four 32-byte PCIe sectors, so compression
saved nothing. Here every append's encoded rows are written back to back, so host memory and the bytes a fetch
reads shrink with the codec ratio.

Layout. Rows are addressed by (side, slot): side 0 is K, 1 is V; the slot of (token t, batch b, head h) is chosen by
the caller (the KV manager numbers them token-major). An append of m rows per side stores its 2m rows in the order
K0 V0 K1 V1 ... at consecutive *virtual* byte offsets: a running sum of stored lengths, continued by the next
append (rewriting slots after a crop starts at the first rewritten K row instead: everything after it is dead).
The virtual space is cut into chunks of ``chunk_bytes`` (a power of two, fixed per store): the row at virtual
offset v lives in chunk ``v // chunk_bytes`` at offset ``v % chunk_bytes`` and may run past the chunk's end into
its *margin* (every chunk is allocated with ``row_bytes + 16`` spare bytes: a row never straddles two
allocations). Per (side, slot) the store keeps a *position* (int64: chunk << 40 | offset, ``kernels/layout.py``)
and a stored length (int32), on the device on CUDA.

Why this placement: it is a prefix sum, so a whole prompt is placed in parallel and may span any number of chunks,
and every chunk is the same size, so page-locked chunks come from a per-process pool
(:mod:`~ibpcache.cache.host_pool`): blocks pinned once, ahead of need on a background thread, and reused by the
next store. The CPU path (Numba encoders, plain memory) and the GPU path place every row at the same position with
the same bytes (:meth:`AppendStore.snapshot`; tests compare them).

CUDA, no host sync per decode step. Two launches per append (``kernels/kv_packed.cu``): lengths, whose last block
scans them and places the append on the device, then the encode. The host never learns where an append went until
later; it keeps an upper bound of the cursor instead: every append issued moves the bound by its worst case (all
rows raw), and the size kernel writes the real cursor and an append sequence number to a pinned mirror that the
host reads without a sync (it can only lag, which keeps the bound conservative). A chunk is added when the bound
says an append might reach it, after re-reading the mirror; so the host holds at most about one chunk more than
the rows need.

A large append (worst case above one chunk: a prompt, a prefill piece) waits once between its two launches for its
placement, has the encode write its rows into a device buffer and copies that buffer to its chunks with DMA copies
(``cudaMemcpyAsync``): host memory is exactly the chunks the stored bytes need, the SMs are not held for the PCIe
transfer, and on a side stream (the KV manager's prefill worker) the copy overlaps the model's next layer.

Both backends hold their bytes in numpy views of the chunks, so inspecting a store (:meth:`AppendStore.snapshot`)
is the same code on both.
"""

from __future__ import annotations

import ctypes
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from ..codec import Codec
from ..errors import CapacityError, FormatError, InvalidArgumentError, InvalidTypeError, RowShapeError, UnsupportedError
from ..exponent import ExponentCodec
from ..kernels import layout as L
from .host_pool import host_pool
from .plan_codecs import ScatteredCost

__all__ = ["AppendStore", "StagedChunks", "stage_layout", "copy_runs", "staged_copies", "measure_scattered", "RowCodec",
           "chunk_bytes_for",
           "chunk_margin", "to_position", "to_virtual", "chunks_needed", "codec_method", "MIN_CHUNK_BYTES",
           "CHUNKS_PER_PROMPT"]

RowCodec = Union[Codec, ExponentCodec]

MIN_CHUNK_BYTES = 16 << 10
"""Floor of the smallest chunk; the real minimum also holds 8 tokens' worst case (see :func:`chunk_bytes_for`)."""

CHUNKS_PER_PROMPT = 64
"""A store sized for a prompt of W worst-case bytes gets chunks of about W / 64 (within the size limits): the last,
partly filled chunk (all the slack over the stored bytes) stays a small share of the store, while a long prompt
gets the largest chunks (few copies, few table entries)."""

_PAD = 16
"""Spare bytes after a row's margin: the IBP decoder reads whole aligned 16-byte blocks."""

_SHIFT = L.KVP_POS_SHIFT
_OFF = L.KVP_OFF_MASK


def _pow2ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def codec_method(codec: RowCodec) -> int:
    """The kernels' method code for ``codec``: raw (an IBP codec with an empty mask), IBP or exponent."""
    if isinstance(codec, ExponentCodec):
        return L.KVP_EXPONENT
    if isinstance(codec, Codec):
        return L.KVP_IBP if bool(np.any(codec.mask)) else L.KVP_RAW
    raise InvalidTypeError(f"codec: expected an ibpcache Codec or ExponentCodec, got {type(codec).__name__}")


def chunk_margin(row_bytes: int) -> int:
    """Bytes allocated after every chunk: a row that starts before the chunk's end may run up to ``row_bytes - 1``
    past it, and decoders read up to 16 bytes past a row (whole aligned blocks)."""
    return -(-int(row_bytes) // 16) * 16 + _PAD


def chunk_bytes_for(rows_per_token: int, row_bytes: int, min_bytes: "int | None" = None,
                    max_bytes: int = 4 << 20, expected_bytes: int = 0) -> int:
    """Virtual bytes per chunk of a store (a power of two): about ``expected_bytes / CHUNKS_PER_PROMPT`` (the worst
    case of the append the store is created for), at least ``min_bytes`` (default: 16 KiB or 8 tokens' worst case,
    whichever is larger) and at most ``max_bytes`` (rounded up to powers of two)."""
    lo = _pow2ceil(max(MIN_CHUNK_BYTES, 2 * 8 * rows_per_token * row_bytes) if min_bytes is None else min_bytes)
    hi = max(lo, _pow2ceil(max_bytes))
    return min(hi, max(lo, _pow2ceil(int(expected_bytes) // CHUNKS_PER_PROMPT)))


def to_position(v: "int | np.ndarray", shift: int) -> "int | np.ndarray":
    """The position (chunk << 40 | offset) of virtual offset ``v`` in a store of ``2**shift``-byte chunks."""
    return ((v >> shift) << _SHIFT) | (v & ((1 << shift) - 1))


def to_virtual(p: "int | np.ndarray", shift: int) -> "int | np.ndarray":
    """The virtual offset of position ``p`` (inverse of :func:`to_position`)."""
    return ((p >> _SHIFT) << shift) | (p & _OFF)


def chunks_needed(end: int, shift: int) -> int:
    """Chunks that rows placed below virtual offset ``end`` can start in (each may run into its chunk's margin)."""
    return 0 if end <= 0 else ((int(end) - 1) >> shift) + 1


def staged_copies(base: int, end: int, shift: int, row_bytes: int) -> "list[tuple[int, int, int, int]]":
    """The DMA copies that move a large append's rows, encoded into a device buffer that holds virtual bytes
    ``[base, end)``, to their chunks: ``(chunk, offset in the chunk, offset in the buffer, bytes)``.

    Chunk c gets the append's bytes from ``max(c * C, base)`` up to where the last row starting in it may end
    (``(c + 1) * C + row_bytes``, inside its margin); bytes copied past a row's end belong to rows of the next chunk
    and are never read there. Bytes before ``base`` (earlier appends' rows) are never touched."""
    size = 1 << shift
    out = []
    for c in range(base >> shift, chunks_needed(end, shift)):
        lo, hi = max(c * size, base), min(end, (c + 1) * size + row_bytes)
        if hi > lo:
            out.append((c, lo - c * size, lo - base, hi - lo))
    return out


@dataclass
class StagedChunks:
    """A device copy of a store's chunks (:meth:`AppendStore.stage_chunks`) that a fetch decodes from.

    Why: a fetch of every stored token reads every stored byte anyway. Read in place (zero-copy), each warp pulls
    rows of ~100-250 bytes scattered across the chunks, one row in flight at a time, and PCIe stays at about half
    its bulk rate; one DMA copy per chunk moves the same bytes at the bulk rate and the decode then reads HBM.
    """

    buffer: torch.Tensor  # uint8 on the device: the chunks back to back (16-byte aligned), padding included
    offsets: torch.Tensor  # int64 [n] on the device: where chunk c starts in ``buffer``
    nbytes: int  # bytes the copies move host -> device
    ready: "torch.cuda.Event"  # recorded on ``stream`` after the copies
    stream: "torch.cuda.Stream"  # where the copies were enqueued


def stage_layout(n_chunks: int, shift: int, row_bytes: int, bound: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes to copy of each chunk and where each goes in a staging buffer (:meth:`AppendStore.stage_chunks`).

    ``n_chunks`` chunks of ``2**shift`` virtual bytes exist, each allocated as ``block`` bytes (the chunk and its
    margin); ``bound``: a virtual offset at or past the end of every stored row. Chunk c goes to ``c * block`` in the
    buffer, as in a run of blocks in host memory (so copies of blocks adjacent in host memory merge into one,
    :func:`copy_runs`); every chunk below the bound's is copied whole, the bound's up to where its rows may end (at
    most ``row_bytes`` into its margin) plus the decoder's padding, whose bytes exist in host memory after every row
    that can end there. Offsets are 16-byte aligned, as chunks are in host memory, so the decoder's aligned block
    reads stay inside. Returns int64 (sizes, offsets), one entry per chunk a row can start in (at least one)."""
    size = 1 << shift
    n = min(n_chunks, chunks_needed(bound, shift))
    sizes = np.zeros(max(n, 1), dtype=np.int64)
    for c in range(n):
        used = min(bound, (c + 1) * size + row_bytes) - c * size
        sizes[c] = block if c < n - 1 else min(block, used + _PAD)
    offsets = np.arange(sizes.size, dtype=np.int64) * block
    return sizes, offsets


def copy_runs(ptrs: "list[int]", sizes: np.ndarray, offsets: np.ndarray, block: int) -> "list[tuple[int, int, int]]":
    """The copies of :func:`stage_layout`'s plan as (buffer offset, host address, bytes), merging chunks whose blocks
    follow each other in host memory (a pool's blocks mostly do): a dense read of a 358 MB layer in 4 MiB chunks is a
    few copies instead of ~90 (each a host call on the decode step's critical path)."""
    runs: "list[list[int]]" = []
    for c in range(min(len(ptrs), sizes.size)):
        n = int(sizes[c])
        if n == 0:
            continue
        last = runs[-1] if runs else None
        if last is not None and last[2] == block * (c - last[3]) and last[1] + last[2] == ptrs[c] \
                and last[0] + last[2] == int(offsets[c]):
            last[2] += n
            continue
        runs.append([int(offsets[c]), ptrs[c], n, c])
    return [(off, ptr, n) for off, ptr, n, _ in runs]


class _Chunks:
    """A store's host chunks, all of one block size (chunk + margin): numpy views for the host side; page-locked
    blocks from the process's :func:`~ibpcache.cache.host_pool.host_pool` on CUDA, so kernels read and write them in
    place and a released store's blocks serve the next one."""

    def __init__(self, pinned: bool, block: int) -> None:
        self.pinned = pinned
        self.block = block
        self.arrays: "list[np.ndarray]" = []
        self.ptrs: list[int] = []  # pool blocks still held (pinned only)

    def __len__(self) -> int:
        return len(self.arrays)

    @property
    def nbytes(self) -> int:
        return len(self.arrays) * self.block

    def add(self) -> int:
        """One more chunk; its address."""
        if self.pinned:
            ptr = host_pool().take(self.block)
            self.ptrs.append(ptr)
            self.arrays.append(np.ctypeslib.as_array((ctypes.c_uint8 * self.block).from_address(ptr)))
            return ptr
        arr = np.zeros(self.block, dtype=np.uint8)
        self.arrays.append(arr)
        return arr.ctypes.data


def _give_back(ptrs: list[int], block: int, device: "torch.device | None") -> None:
    """Return a store's blocks to the pool once the device is done with them (a weakref finalizer and
    :meth:`AppendStore.release`): a kernel or copy enqueued earlier may still read or write them."""
    if not ptrs:
        return
    try:
        if device is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize(device)
        pool = host_pool()
        for p in ptrs:
            pool.give(block, p)
    except Exception:  # noqa: BLE001 - interpreter teardown: the process is going away with its memory
        pass
    ptrs.clear()


class AppendStore:
    """One decoder layer's K and V rows, appended by slot, packed back to back in host chunks.

    Args:
        k_codec, v_codec: how each side is stored: an IBP :class:`~ibpcache.codec.Codec` (``Codec.raw`` for raw rows)
            or an :class:`~ibpcache.exponent.ExponentCodec`; both sides have rows of the same size.
        device: "cpu" (Numba encoders, plain memory) or a CUDA device (kernels, page-locked memory).
        rows_per_token: rows per side one token adds (batch x KV heads) when the store is created.
        min_chunk_bytes, max_chunk_bytes, expected_bytes: the chunk size (:func:`chunk_bytes_for`): about
            ``expected_bytes`` (the worst case of the first append: the prompt) / 64, within [min, max]
            (defaults: 16 KiB or 8 tokens' worst case, whichever is larger, and 4 MiB).
        slots: slot capacity to allocate up front.
    """

    def __init__(self, k_codec: RowCodec, v_codec: RowCodec, device: "str | torch.device", *, rows_per_token: int,
                 min_chunk_bytes: "int | None" = None, max_chunk_bytes: int = 4 << 20, slots: int = 0,
                 expected_bytes: int = 0) -> None:
        self.methods = (codec_method(k_codec), codec_method(v_codec))
        if k_codec.row_bytes != v_codec.row_bytes:
            raise InvalidArgumentError(f"K and V rows differ in size: {k_codec.row_bytes} vs {v_codec.row_bytes}")
        if not isinstance(rows_per_token, int) or rows_per_token < 1:
            raise InvalidArgumentError(f"rows_per_token: expected a positive int, got {rows_per_token!r}")
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.codecs = (k_codec, v_codec)
        self.device = dev
        self.cuda = dev.type == "cuda"
        self.row_bytes = int(k_codec.row_bytes)
        self.chunk_bytes = chunk_bytes_for(rows_per_token, self.row_bytes, min_chunk_bytes, max_chunk_bytes,
                                           expected_bytes)
        self.chunk_shift = self.chunk_bytes.bit_length() - 1
        self._chunks = _Chunks(self.cuda, self.chunk_bytes + chunk_margin(self.row_bytes))
        self.slot_cap = 0
        self.high_water = 0  # slots ever written: rewriting below it rewinds the cursor
        self.cursor = 0  # virtual offset where the next append goes (CPU: exact; CUDA: see _bound)
        self._staged: "tuple[torch.Tensor, int, int] | None" = None  # a large append's device buffer, base, end
        if self.cuda:
            self._init_device()
            self._finalizer = weakref.finalize(self, _give_back, self._chunks.ptrs, self._chunks.block, dev)
        else:
            self._pos = np.zeros((2, 0), dtype=np.int64)
            self._len = np.zeros((2, 0), dtype=np.int32)
        self.reserve(max(int(slots), rows_per_token))

    # -- CUDA bookkeeping --------------------------------------------------------------------------------------
    def _init_device(self) -> None:
        dev = self.device
        self._desc_host = np.zeros(L.KVP_D_WORDS, dtype=np.int64)
        self._state = torch.zeros(L.KVP_STATE_WORDS, dtype=torch.int64, device=dev)
        self._mirror = torch.zeros(L.KVP_MIRROR_WORDS, dtype=torch.int64, pin_memory=True)
        self._mirror_np = self._mirror.numpy()
        self._max_chunks = 64
        self._table = torch.zeros(self._max_chunks, dtype=torch.int64, device=dev)
        self._pos = torch.zeros((2, 0), dtype=torch.int64, device=dev)
        self._len = torch.zeros((2, 0), dtype=torch.int32, device=dev)
        self._scratch = torch.zeros(0, dtype=torch.int64, device=dev)
        self._tables: list[Any] = []  # device tables of the codecs, kept alive with the descriptor
        d = self._desc_host
        d[L.KVP_D_TABLE] = self._table.data_ptr()
        d[L.KVP_D_CHUNK_SHIFT] = self.chunk_shift
        d[L.KVP_D_MAX_CHUNKS] = self._max_chunks
        d[L.KVP_D_STATE] = self._state.data_ptr()
        d[L.KVP_D_MIRROR] = self._mirror.data_ptr()
        d[L.KVP_D_ROW_BYTES] = self.row_bytes
        for side, codec in enumerate(self.codecs):
            self._side_fields(d[L.KVP_D_SIDE0 + side * L.KVP_D_SIDE_WORDS:][: L.KVP_D_SIDE_WORDS], codec,
                              self.methods[side])
        self._desc = torch.from_numpy(d.copy()).to(dev)  # one upload at creation (a prompt's sync)
        # cursor bound (see module docstring): appends issued, the last mirror reading, the worst cases since
        self._issued = 0
        self._known_seq = 0
        self._known_cursor = 0
        self._history: deque[int] = deque()  # worst case of each append issued after _known_seq, in order
        self._bound = 0

    def _side_fields(self, f: np.ndarray, codec: RowCodec, method: int) -> None:
        f[L.KVP_S_METHOD] = method
        if method == L.KVP_IBP:
            tab = codec.kernel_tables(self.device)  # type: ignore[union-attr]
            self._tables.append(tab)
            f[L.KVP_S_MASK], f[L.KVP_S_BITVAL] = tab.mask.data_ptr(), tab.bitval.data_ptr()
            f[L.KVP_S_CHUNK], f[L.KVP_S_NCHUNKS] = tab.chunk_bytes, tab.n_chunks
        elif method == L.KVP_EXPONENT:
            tab = codec.kernel_tables(self.device)  # type: ignore[union-attr]
            self._tables.append(tab)
            f[L.KVP_S_CODE_LEN], f[L.KVP_S_CODE_REV], f[L.KVP_S_LUT] = (
                tab.code_len.data_ptr(), tab.code_rev.data_ptr(), tab.lut.data_ptr())
            f[L.KVP_S_MAX_BITS], f[L.KVP_S_ESHIFT], f[L.KVP_S_EMASK] = tab.max_bits, tab.eshift, tab.emask
            f[L.KVP_S_RAW_BITS], f[L.KVP_S_ELEMS] = tab.raw_bits, tab.row_elems

    def _set_desc(self, word: int, value: int) -> None:
        """Rewrite one descriptor word, ordered on the current stream (a fill kernel: no sync, graphs stay valid)."""
        self._desc_host[word] = value
        self._desc[word].fill_(int(value))

    def _refresh(self) -> None:
        """Read the pinned mirror (no sync): sequence number first, so the cursor read after is at least as new."""
        seq = int(self._mirror_np[L.KVP_MR_SEQ])
        cur = int(self._mirror_np[L.KVP_MR_CURSOR])
        if seq <= self._known_seq:
            return
        for _ in range(min(seq - self._known_seq, len(self._history))):
            self._history.popleft()
        self._known_seq, self._known_cursor = seq, cur
        self._bound = cur + sum(self._history)

    def _table_room(self, n_chunks: int) -> None:
        """Grow the device chunk table to hold ``n_chunks`` entries (copy, then point the descriptor at it)."""
        if n_chunks <= self._max_chunks:
            return
        size = max(n_chunks, 2 * self._max_chunks)
        new = torch.zeros(size, dtype=torch.int64, device=self.device)
        new[: self._table.numel()].copy_(self._table)
        self._table = new
        self._set_desc(L.KVP_D_TABLE, new.data_ptr())
        self._max_chunks = size
        self._set_desc(L.KVP_D_MAX_CHUNKS, size)

    def _chunks_for(self, end: int) -> None:
        """Add chunks until every row placed below virtual offset ``end`` has its chunk."""
        need = chunks_needed(end, self.chunk_shift)
        if need > len(self._chunks) and self.cuda:
            self._table_room(need)
        while len(self._chunks) < need:
            c = len(self._chunks)
            ptr = self._chunks.add()
            if self.cuda:
                self._table[c].fill_(ptr)

    # -- capacity ------------------------------------------------------------------------------------------------
    def reserve(self, n_slots: int) -> None:
        """Make sure slots ``[0, n_slots)`` can be written (per-slot positions and lengths; bytes are per append)."""
        if n_slots <= self.slot_cap:
            return
        cap = max(int(n_slots), 2 * self.slot_cap)
        if self.cuda:
            pos = torch.zeros((2, cap), dtype=torch.int64, device=self.device)
            lens = torch.zeros((2, cap), dtype=torch.int32, device=self.device)
            pos[:, : self.slot_cap].copy_(self._pos)
            lens[:, : self.slot_cap].copy_(self._len)
            self._pos, self._len = pos, lens
            self._set_desc(L.KVP_D_POS, pos.data_ptr())
            self._set_desc(L.KVP_D_LEN, lens.data_ptr())
            self._set_desc(L.KVP_D_SLOT_CAP, cap)
        else:
            pos = np.zeros((2, cap), dtype=np.int64)
            lens = np.zeros((2, cap), dtype=np.int32)
            pos[:, : self.slot_cap] = self._pos
            lens[:, : self.slot_cap] = self._len
            self._pos, self._len = pos, lens
        self.slot_cap = cap

    def _scratch_room(self, n: int) -> None:
        if n > self._scratch.numel():
            self._scratch = torch.zeros(max(n, 2 * self._scratch.numel()), dtype=torch.int64, device=self.device)
            self._set_desc(L.KVP_D_SCRATCH, self._scratch.data_ptr())
            self._set_desc(L.KVP_D_SCRATCH_CAP, self._scratch.numel())

    def live_tensors(self) -> tuple[torch.Tensor, ...]:
        """Device tensors a fetch reads that growth may replace: a reader on another stream keeps them alive."""
        if not self.cuda:
            return ()
        return (self._desc, self._pos, self._len, self._table, self._state)

    # -- append ----------------------------------------------------------------------------------------------------
    def _check_append(self, keys: torch.Tensor, values: torch.Tensor, slot0: int) -> int:
        if keys.shape != values.shape or keys.dim() != 4 or keys.dtype != values.dtype:
            raise InvalidArgumentError(f"keys/values: expected two [B, H, n, D] tensors of one shape and dtype, got "
                                       f"{tuple(keys.shape)} {keys.dtype} and {tuple(values.shape)} {values.dtype}")
        if keys.dtype != self.codecs[0].dtype or keys.shape[3] * keys.element_size() != self.row_bytes:
            raise RowShapeError(f"keys/values: expected {self.codecs[0].dtype} rows of {self.row_bytes} bytes, got "
                                f"{keys.dtype} rows of {keys.shape[3] * keys.element_size()} bytes")
        if keys.device != self.device or values.device != self.device:
            raise InvalidArgumentError(f"keys/values: expected tensors on {self.device}, got {keys.device}")
        m = keys.shape[0] * keys.shape[1] * keys.shape[2]
        if slot0 < 0 or slot0 > self.high_water:
            raise CapacityError(f"append at slot {slot0}: slots must be written in order (next free: "
                                f"{self.high_water})")
        if slot0 + m > self.slot_cap:
            raise CapacityError(f"append of slots [{slot0}, {slot0 + m}) past capacity {self.slot_cap}; reserve first")
        return m

    def append(self, keys: torch.Tensor, values: torch.Tensor, slot0: int, t0: int = 0, *,
               into: "tuple[torch.Tensor, torch.Tensor] | None" = None, att_pos0: int = 0,
               written: "torch.Tensor | None" = None) -> int:
        """Store [B, H, n, D] keys/values as slots ``slot0 + t * B * H + b * H + h`` (t < n) of K and V.

        ``t0`` is the first token's index (the device keeps the token count for graph replays, see
        :meth:`launch_dynamic`). ``into``/``att_pos0``: attention buffers that also get the
        rows (CUDA: in the same launch). ``written`` (CUDA, int64 [1]): += stored bytes. Returns the stored bytes on
        the CPU (0 on CUDA: counted on the device). No host sync on CUDA unless the append's worst case exceeds one
        chunk (a prompt): then one, between its two launches, on the current stream.
        """
        m = self._check_append(keys, values, slot0)
        if m == 0:
            return 0
        rewind = slot0 < self.high_water
        self.high_water = slot0 + m
        if not self.cuda:
            return self._append_cpu(keys, values, slot0, rewind, into, att_pos0)
        self._append_cuda(keys, values, slot0, t0, rewind, into, att_pos0, written)
        return 0

    def _append_cpu(self, keys: torch.Tensor, values: torch.Tensor, slot0: int, rewind: bool,
                    into: "tuple[torch.Tensor, torch.Tensor] | None", att_pos0: int) -> int:
        rows = [x.permute(2, 0, 1, 3).reshape(-1, x.shape[3]).contiguous().view(torch.uint8).numpy()
                for x in (keys, values)]
        m = rows[0].shape[0]
        lens = [codec.row_lengths(r) for codec, r in zip(self.codecs, rows)]
        inter = np.empty(2 * m, dtype=np.int64)
        inter[0::2], inter[1::2] = lens[0], lens[1]
        rel = np.zeros(2 * m, dtype=np.int64)
        np.cumsum(inter[:-1], out=rel[1:])
        total = int(inter.sum())
        shift = self.chunk_shift
        base = int(to_virtual(int(self._pos[0, slot0]), shift)) if rewind else self.cursor
        self._chunks_for(base + total)
        for side in (0, 1):
            v = base + rel[side::2]
            chunk = v >> shift
            for c in np.unique(chunk):
                sel = chunk == c
                self.codecs[side].encode_rows_at(rows[side][sel], self._chunks.arrays[int(c)],
                                                 v[sel] & (self.chunk_bytes - 1), lens[side][sel])
            self._pos[side, slot0 : slot0 + m] = to_position(v, shift)
            self._len[side, slot0 : slot0 + m] = lens[side]
        self.cursor = base + total
        if into is not None:
            n = keys.shape[2]
            into[0][:, :, att_pos0 : att_pos0 + n].copy_(keys)
            into[1][:, :, att_pos0 : att_pos0 + n].copy_(values)
        return total

    def _append_cuda(self, keys: torch.Tensor, values: torch.Tensor, slot0: int, t0: int, rewind: bool,
                     into: "tuple[torch.Tensor, torch.Tensor] | None", att_pos0: int,
                     written: "torch.Tensor | None") -> None:
        from ..kernels.kv_packed import kvp_append

        m = keys.shape[0] * keys.shape[1] * keys.shape[2]
        worst = 2 * m * self.row_bytes
        self._scratch_room(2 * m)
        if keys.stride(3) != 1:
            keys = keys.contiguous()
        if values.stride(3) != 1:
            values = values.contiguous()
        if worst <= self.chunk_bytes:
            self.note_append(worst)
            kvp_append(self._desc, keys, values, slot0, t0, rewind=rewind, written=written, into=into,
                       att_pos0=att_pos0)
            return
        # A large append: place it, wait for its total, encode into a device buffer, copy that to its chunks.
        kvp_append(self._desc, keys, values, slot0, t0, rewind=rewind, written=written, into=into,
                   att_pos0=att_pos0, before_encode=self._place_staged)
        self._copy_staged()

    def _place_staged(self) -> torch.Tensor:
        """Between the two launches of a large append: read where it went (one sync on the current stream), add the
        chunks it needs and return the device buffer its rows are encoded into."""
        st = self._state[: L.KVP_ST_TOTAL + 1].cpu()
        base, total = int(st[L.KVP_ST_BASE]), int(st[L.KVP_ST_TOTAL])
        end = base + total
        self._chunks_for(end)
        self._issued += 1
        self._known_seq, self._known_cursor = self._issued, end
        self._history.clear()
        self._bound = end
        buffer = torch.empty(max(total, 1), dtype=torch.uint8, device=self.device)
        self._staged = (buffer, base, end)
        return buffer

    def _copy_staged(self) -> None:
        """Enqueue the DMA copies of the large append just encoded from its device buffer to its chunks (on the
        current stream, after the encode; the buffer is freed to torch's allocator on that stream, which orders
        its reuse after the copies)."""
        from ..kernels._build import copy_device_to_host

        buffer, base, end = self._staged
        self._staged = None
        stream = torch.cuda.current_stream(self.device).cuda_stream
        src = buffer.data_ptr()
        for c, c_off, b_off, n in staged_copies(base, end, self.chunk_shift, self.row_bytes):
            copy_device_to_host(self._chunks.ptrs[c] + c_off, src + b_off, n, stream)

    def note_append(self, worst: int) -> None:
        """Host bookkeeping of one small append about to be enqueued (or replayed from a graph): move the cursor
        bound by its worst case and make sure every chunk it might reach exists. Never waits for the device."""
        bound = self._bound + worst
        if chunks_needed(bound, self.chunk_shift) > len(self._chunks):  # first see how far the device really is
            self._refresh()
            bound = self._bound + worst
        self._chunks_for(bound)
        self._bound = bound
        self._issued += 1
        self._history.append(worst)

    # -- read ----------------------------------------------------------------------------------------------------
    def fetch(self, idx: "torch.Tensor | None", k: int, out_k: torch.Tensor, out_v: torch.Tensor, *,
              read: "torch.Tensor | None" = None, row0: "torch.Tensor | None" = None, k_dyn: bool = False,
              staged: "StagedChunks | None" = None) -> None:
        """CUDA: decode tokens into [B, H, >= k, D] buffers (see ``kernels.kv_packed.kvp_fetch``); one launch.

        ``staged``: decode from that device copy of the chunks (:meth:`stage_chunks`, made after the rows were
        appended) instead of reading host memory; the current stream waits for its copies."""
        from ..kernels.kv_packed import kvp_fetch

        if not self.cuda:
            raise UnsupportedError("AppendStore.fetch is the CUDA path; on the CPU use read_rows")
        stage = None
        if staged is not None:
            current = torch.cuda.current_stream(self.device)
            if staged.stream != current:
                current.wait_event(staged.ready)
                staged.buffer.record_stream(current)  # freed by the caller; reused only after this decode
                staged.offsets.record_stream(current)
            stage = (staged.buffer, staged.offsets)
        kvp_fetch(self._desc, idx, k, out_k, out_v, k_dyn=k_dyn, read=read, row0=row0, heads=out_k.shape[1],
                  stage=stage)

    def stage_chunks(self, stream: "torch.cuda.Stream | None" = None) -> StagedChunks:
        """CUDA: enqueue on ``stream`` (default: the current one) DMA copies of every chunk that may hold a stored
        row into one new device buffer, for :meth:`fetch` (``staged=``). Never waits for the device.

        What is copied (:func:`stage_layout`): every chunk up to the host's bound of the device cursor, up to where
        its rows may end (plus the decoder's padding): every row appended before this call, whatever appends are
        still in flight on the device, as long as ``stream`` is ordered after them (the caller's job). Dead rows
        (rewritten after a crop) are copied too; a store whose rows are mostly live reads ~its stored bytes.
        """
        from ..kernels._build import copy_host_to_device

        if not self.cuda:
            raise UnsupportedError("AppendStore.stage_chunks is the CUDA path; on the CPU use read_rows")
        stream = torch.cuda.current_stream(self.device) if stream is None else stream
        chunks = self._chunks
        sizes, offsets = stage_layout(len(chunks), self.chunk_shift, self.row_bytes, self._bound, chunks.block)
        total = int(offsets[-1] + sizes[-1])
        with torch.cuda.stream(stream):
            buffer = torch.empty(total + _PAD, dtype=torch.uint8, device=self.device)
            offs_dev = torch.from_numpy(offsets).pin_memory().to(self.device, non_blocking=True)
            base = buffer.data_ptr()
            for off, ptr, n in copy_runs(chunks.ptrs, sizes, offsets, chunks.block):
                copy_host_to_device(base + off, ptr, n, stream.cuda_stream)
            ready = torch.cuda.Event()
            ready.record(stream)
        return StagedChunks(buffer, offs_dev, int(sizes.sum()), ready, stream)

    def read_rows(self, side: int, slots: np.ndarray, out_u8: np.ndarray, out_rows: "np.ndarray | None") -> int:
        """CPU: decode the rows of ``slots`` of ``side`` into ``out_u8[out_rows]`` (or in order); the bytes read."""
        if self.cuda:
            raise UnsupportedError("AppendStore.read_rows is the CPU path; on CUDA use fetch")
        m = slots.size
        if m == 0:
            return 0
        pos = self._pos[side][slots]
        lens = self._len[side][slots]
        rows = np.arange(m, dtype=np.int64) if out_rows is None else out_rows
        chunk = pos >> _SHIFT
        codec = self.codecs[side]
        for c in np.unique(chunk):
            sel = chunk == c
            codec.decode_rows_at(self._chunks.arrays[int(c)], pos[sel] & _OFF, lens[sel], out_u8, rows[sel])
        return int(lens.sum(dtype=np.int64))

    # -- graphs ----------------------------------------------------------------------------------------------------
    def launch_dynamic(self, keys: torch.Tensor, values: torch.Tensor, slot0: int, t0: int, *,
                       into: "tuple[torch.Tensor, torch.Tensor] | None" = None, att_pos0: int = 0,
                       written: "torch.Tensor | None" = None) -> None:
        """CUDA, for capture in a graph: enqueue an append of one decode step whose first token is the device's token
        count (slots ``slot0 + (T - t0) * B * H + ...``, attention position ``att_pos0 + T - t0``). No bookkeeping
        here: call :meth:`prepare_dynamic` before every run (replay) of what was captured."""
        from ..kernels.kv_packed import kvp_append

        m = self._check_append(keys, values, slot0) if slot0 <= self.high_water else -1
        if m < 0 or 2 * m * self.row_bytes > self.chunk_bytes:
            raise InvalidArgumentError(f"a captured append must be a decode step starting at the next free slot "
                                       f"({self.high_water}) whose worst case fits one chunk ({self.chunk_bytes} "
                                       f"bytes)")
        if 2 * m > self._scratch.numel():  # growing it here would be captured (and replayed) too
            raise InvalidArgumentError("launch_dynamic: call prepare_capture first (scratch room)")
        kvp_append(self._desc, keys, values, slot0, t0, dyn=True, written=written, into=into, att_pos0=att_pos0)

    def prepare_capture(self, slot0: int, m: int) -> None:
        """Before capturing :meth:`launch_dynamic` of ``m`` slots from ``slot0``: grow what it reads now, outside the
        capture (growth allocates and copies: captured, it would be replayed over later appends)."""
        self.reserve(slot0 + m)
        self._scratch_room(2 * m)

    def prepare_dynamic(self, slots_per_step: int) -> None:
        """Before each run of a captured decode step: room for its slots and chunks (host only, never waits)."""
        self.reserve(self.high_water + slots_per_step)
        self.note_append(2 * slots_per_step * self.row_bytes)
        self.high_water += slots_per_step

    # -- reporting ------------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise if a kernel reported a problem (reads the pinned mirror and, on CUDA, the device state: syncs)."""
        if not self.cuda:
            return
        status = int(self._state[L.KVP_ST_STATUS].item()) | int(self._mirror_np[L.KVP_MR_STATUS])
        if status & L.KVP_STATUS_NO_CHUNK:
            raise CapacityError("packed KV store: an append was placed in a chunk the host had not allocated "
                                "(host headroom bookkeeping is wrong; nothing was written)")
        if status & L.KVP_STATUS_CORRUPT:
            raise FormatError("packed KV store: an exponent-coded row ran past its stored length")

    def lengths(self, n_slots: int) -> np.ndarray:
        """int32 [2, n_slots]: stored bytes per (side, slot) (synchronises on CUDA)."""
        lens = self._len[:, :n_slots]
        return lens.cpu().numpy() if self.cuda else lens.copy()

    def positions(self, n_slots: int) -> np.ndarray:
        """int64 [2, n_slots]: position per (side, slot) (synchronises on CUDA)."""
        pos = self._pos[:, :n_slots]
        return pos.cpu().numpy() if self.cuda else pos.copy()

    def stored_bytes(self, n_slots: int) -> int:
        """K plus V bytes that slots ``[0, n_slots)`` occupy (synchronises on CUDA)."""
        if self.cuda:
            return int(self._len[:, :n_slots].sum(dtype=torch.int64))
        return int(self._len[:, :n_slots].sum(dtype=np.int64))

    def snapshot(self, n_slots: int) -> dict:
        """What the store holds for slots ``[0, n_slots)``, identical on both backends for the same appends:
        positions, lengths and every row's stored bytes (K then V per slot, in slot order). Synchronises."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        pos, lens = self.positions(n_slots), self.lengths(n_slots)
        parts = []
        for s in range(n_slots):
            for side in (0, 1):
                p, n = int(pos[side, s]), int(lens[side, s])
                arr = self._chunks.arrays[p >> _SHIFT]
                parts.append(arr[(p & _OFF) : (p & _OFF) + n])
        data = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
        return {"pos": pos, "len": lens, "data": data.copy(), "chunks": len(self._chunks),
                "chunk_bytes": self.chunk_bytes}

    @property
    def host_nbytes(self) -> int:
        """Host memory the chunks hold (each chunk with its margin)."""
        return self._chunks.nbytes

    @property
    def host_slack_bound(self) -> int:
        """What the chunks may hold beyond the stored bytes by design: the free part of one chunk (the last) and
        every chunk's margin (CUDA may hold a chunk more, added ahead of a bound the rows did not reach)."""
        return self.chunk_bytes + len(self._chunks) * (self._chunks.block - self.chunk_bytes)

    @property
    def device_nbytes(self) -> int:
        """GPU bytes of metadata: per-slot positions and lengths, chunk tables, descriptor, codec tables."""
        if not self.cuda:
            return 0
        total = self.slot_cap * 2 * (8 + 4) + self._max_chunks * 8 + self._scratch.numel() * 8
        return total + sum(c.metadata_nbytes for c in self.codecs if codec_method(c) != L.KVP_RAW)

    def release(self, stream_only: bool = False) -> None:
        """Give the host chunks back now (CUDA: to the pool, after the device finished with them). The store is
        unusable after. ``stream_only``: every kernel and copy that used the store was on the current stream, so
        waiting for that stream is enough (a device-wide sync would also wait for another thread's work)."""
        if self.cuda:
            if stream_only:
                torch.cuda.current_stream(self.device).synchronize()
                self._finalizer.detach()
                _give_back(self._chunks.ptrs, self._chunks.block, None)
            else:
                self._finalizer()  # synchronises the device first
        self._chunks = _Chunks(self.cuda, self._chunks.block)


def measure_scattered(codec: Any, sample: torch.Tensor, rows_per_token: int, *, store_bytes: int = 64 << 20,
                      tokens: int = 400, repeats: int = 7) -> ScatteredCost:
    """Time the packed store's fetch of ``tokens`` selected tokens per (batch, head) row, raw rows against rows of
    ``codec``, on ``sample``'s GPU (CUDA events on the current stream; the fastest of ``repeats`` rounds).

    The stores hold ~``store_bytes`` of raw rows (``sample`` [N, D] tiled, in the real token-major slot layout of
    ``rows_per_token`` rows per token), so the reads miss caches and translation buffers as a real layer's do.
    Every round draws new random tokens (a decode step's selection is new each step, so repeating one would time
    what L2 and the translation buffers kept) and reads them from both stores, in alternating order. The fastest
    round counts, so a round that shared the GPU with other work does not decide (the KV manager runs this with the
    device drained: beside a 32k prefill it read raw rows at 352.8 ns/row, 7-8 idle); the margin of
    :func:`~ibpcache.cache.plan_codecs.prefer_raw_for_scattered` covers what a decode step adds. The pinned blocks
    go back to the pool afterwards."""
    dev = sample.device
    raw_codec = Codec.raw(sample.dtype, tuple(sample.shape[1:]))
    row_bytes = raw_codec.row_bytes
    n_tok = max(tokens + 1, store_bytes // (2 * row_bytes * rows_per_token))
    reps = -(-(n_tok * rows_per_token) // sample.shape[0])
    x = sample.repeat(reps, 1)[: n_tok * rows_per_token].view(n_tok, 1, rows_per_token, -1).permute(1, 2, 0, 3)
    gen = torch.Generator(device=dev).manual_seed(0)
    draws = [torch.rand((1, rows_per_token, n_tok), device=dev, generator=gen).argsort(-1)[..., :tokens]
             .sort(-1).values.contiguous() for _ in range(repeats + 2)]
    out = [torch.empty((1, rows_per_token, tokens, x.shape[-1]), dtype=x.dtype, device=dev) for _ in range(2)]
    stores = []
    for c in (raw_codec, codec):
        store = AppendStore(c, c, dev, rows_per_token=rows_per_token, slots=n_tok * rows_per_token,
                            expected_bytes=2 * x.numel() * x.element_size())
        store.append(x, x, 0, 0)
        stores.append(store)
    times: "list[list[float]]" = [[], []]
    try:
        for r, idx in enumerate(draws):  # two untimed rounds: kernels loaded
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                stores[i].fetch(idx, tokens, out[0], out[1])
                b.record()
                b.synchronize()
                if r >= 2:
                    times[i].append(a.elapsed_time(b) / 1e3)
        coded_bytes = stores[1].stored_bytes(n_tok * rows_per_token)
    finally:
        for store in stores:  # everything here ran on the current stream (the prefill worker's: not the model's)
            store.release(stream_only=True)
    rows = 2 * rows_per_token * tokens
    best = [min(t) / rows for t in times]
    ratio = 2 * n_tok * rows_per_token * row_bytes / max(1, coded_bytes)
    return ScatteredCost(best[0], best[1], ratio, codec.method)
