"""Exponent coding for floats (float32, bfloat16, float16): entropy-code the exponent field, keep sign and mantissa raw.

Why a second codec: IBP drops bits that (nearly) every row shares. In dense float rows (embedding tables, KV
caches) the sign and mantissa bits are close to uniform, so IBP finds little (MiniLM fp32 1.15x, SmolLM2's bf16 KV
K 1.17x / V 1.32x), but the 8 exponent bits carry only ~2.6-2.9 bits of information: values of one tensor sit
within a few binades. Coding just the exponent with a per-dataset Huffman code (the observation behind DFloat11
and ZipCCL) stores fp32 rows at ~1.19x and bf16 at ~1.49x, losslessly.

Format of one row of ``D`` elements (docs/FORMAT.md has the bit layout; each row decodes on its own, because
caches and KV fetches read arbitrary rows): header (where each of ``S = ceil(D / seg)`` segments of codewords
starts; empty for ``S = 1``), ``D`` raw fields (sign + mantissa), the ``D`` exponent codewords; a row that would not
shrink is stored raw (``length == row_bytes``). Segments let a warp decode one row with ``S`` lanes in parallel;
with ``S = 1`` (what :meth:`ExponentCodec.fit` makes unless asked) the format is the one the KV append store's
kernels read.

The code is canonical Huffman over every possible exponent value (unseen ones get a pseudo-count of one, so any
bit pattern is encodable: NaN payloads, infinities, -0.0, denormals), limited to ``MAX_CODE_BITS`` so a decoder
can use a table of ``2**max_bits`` entries. Only the code lengths are stored (canonical codes follow from them).

The CPU reference is ``kernels/exponent_cpu.py`` (Numba), the GPU kernels ``kernels/exponent.cu``; same bytes.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np
import torch

from .codec import Codec
from .errors import FormatError, InvalidArgumentError, RowDtypeError, RowShapeError
from .fit import sample_rows
from .format import dtype_to_name, name_to_dtype
from .kernels import exponent_cpu as cpu
from ._validation import check_rows

__all__ = ["ExponentCodec", "MAX_CODE_BITS", "FORMATS", "ALL_FORMATS", "MIN_SEGMENT", "HEADER_BUDGET",
           "limited_lengths", "canonical_codes", "segment_size"]

if TYPE_CHECKING:
    from .kernels.exponent import ExponentTables

MAX_CODE_BITS = 15
"""Longest codeword: a decoder's table then has 2**15 entries at most. A 12-bit limit (a table small enough for
shared memory) was measured and costs too much: even optimal length-limited codes spend ~0.1 more bits per 8-bit
exponent (about 230 exponent values never occur and still need codewords), 0.4% of MiniLM's fp32 ratio and 0.9%
of its bf16 ratio. The GPU decoders keep the long codes and look up in two levels instead (``two_level_lut``: a
4 KB table of the codewords up to 10 bits first)."""

ALL_FORMATS: dict[torch.dtype, tuple[int, int, int]] = {
    # dtype: (exponent bits, exponent shift = mantissa bits, raw bits = sign + mantissa)
    torch.bfloat16: (8, 7, 8),
    torch.float16: (5, 10, 11),
    torch.float32: (8, 23, 24),
}
"""Every dtype the exponent codec takes."""

FORMATS: dict[torch.dtype, tuple[int, int, int]] = {dt: ALL_FORMATS[dt] for dt in (torch.bfloat16, torch.float16)}
"""The 16-bit formats: what the KV append store's kernels (``kernels/kv_packed.cu``, one segment, 16-bit elements)
decode, so what the KV codec planner offers exponent coding for."""

MIN_SEGMENT = 32
"""The smallest segment ``seg="auto"`` considers (elements); it tries 32, 64, 128, ... (most parallel first)."""

HEADER_BUDGET = 0.0075
"""``seg="auto"``'s default ``header_budget``: the row header (segment offsets) may cost at most this share of an
expected stored row. Why 0.75%: a dense fp32 table of 384-wide rows (MiniLM) then gets 3 segments of 128 (32 header
bits, 0.3% of a row) and stores at 1.185x with every table of the packed layout counted, where 1% allowed 6
segments of 64 (80 bits) and 1.17996x; its bf16 cast gets 3 segments either way (1.455x). Fewer segments mean
fewer lanes decoding a row in parallel: ``scripts/bench_codec.py`` measures both sides of that trade."""


def _huffman_lengths(counts: np.ndarray) -> np.ndarray:
    """Code length of every symbol (all counts >= 1)."""
    n = counts.size
    heap = [(int(c), i, [i]) for i, c in enumerate(counts)]
    heapq.heapify(heap)
    lengths = np.zeros(n, dtype=np.int64)
    tie = n
    while len(heap) > 1:
        c1, _, a = heapq.heappop(heap)
        c2, _, b = heapq.heappop(heap)
        lengths[a + b] += 1
        heapq.heappush(heap, (c1 + c2, tie, a + b))
        tie += 1
    return lengths


def limited_lengths(counts: np.ndarray, max_bits: int = MAX_CODE_BITS) -> np.ndarray:
    """Huffman code lengths of ``counts`` (each symbol >= 1 count), flattened until none exceeds ``max_bits``."""
    c = np.maximum(np.asarray(counts, dtype=np.int64), 1)
    while True:
        lengths = _huffman_lengths(c)
        if lengths.max() <= max_bits:
            return lengths.astype(np.uint8)
        c = np.maximum((c + 1) // 2, 1)  # halving keeps the order and shrinks the spread


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical codewords (right-aligned ints) for code ``lengths``: by (length, symbol), consecutive codes."""
    order = np.lexsort((np.arange(lengths.size), lengths))
    codes = np.zeros(lengths.size, dtype=np.int64)
    code, prev = 0, int(lengths[order[0]])
    for k, s in enumerate(order):
        ln = int(lengths[s])
        if k:
            code = (code + 1) << (ln - prev)
        codes[s] = code
        prev = ln
    return codes


def _decode_tables(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Canonical decoding tables: per length, first code, count and offset into the symbols sorted by code."""
    order = np.lexsort((np.arange(lengths.size), lengths)).astype(np.int64)
    first = np.zeros(MAX_CODE_BITS + 2, dtype=np.int64)
    count = np.zeros(MAX_CODE_BITS + 2, dtype=np.int64)
    offset = np.zeros(MAX_CODE_BITS + 2, dtype=np.int64)
    for ln in lengths:
        count[int(ln)] += 1
    code = 0
    pos = 0
    for ln in range(1, MAX_CODE_BITS + 1):
        first[ln] = code
        offset[ln] = pos
        code = (code + count[ln]) << 1
        pos += count[ln]
    return order, first, count, offset


def header_field_bits(row_elems: int, max_code_bits: int) -> int:
    """Bits of one segment offset: 16 while every offset (< D codewords of at most ``max_code_bits``) fits."""
    return 16 if row_elems * max_code_bits < (1 << 16) else 32


def segment_size(row_elems: int, raw_bits: int, mean_code_bits: float, hdr_field: int,
                 header_budget: float = HEADER_BUDGET) -> int:
    """``seg="auto"``: the smallest power of two from :data:`MIN_SEGMENT` (the most lanes decoding a row in
    parallel) whose header, ``(S - 1) * hdr_field`` bits, is at most ``header_budget`` (a share, default
    :data:`HEADER_BUDGET`) of the expected stored row; one segment when none is (narrow rows, or a budget of 0)."""
    if not (isinstance(header_budget, (int, float)) and not isinstance(header_budget, bool)
            and 0.0 <= float(header_budget) < 1.0):
        raise InvalidArgumentError(f"header_budget must be a share in [0, 1), got {header_budget!r}")
    expected = row_elems * (raw_bits + mean_code_bits)
    seg = MIN_SEGMENT
    while seg < row_elems:
        if (-(-row_elems // seg) - 1) * hdr_field <= header_budget * expected:
            return seg
        seg *= 2
    return row_elems


def _int_view(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of float rows as a signed integer tensor of the same width (a view)."""
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


def _uint_rows(rows_u8: np.ndarray, elem_bytes: int) -> np.ndarray:
    """uint8 [M, row_bytes] rows as their unsigned elements [M, D] (a view)."""
    return rows_u8.view(np.uint32 if elem_bytes == 4 else np.uint16)


class ExponentCodec(Codec):
    """A fitted exponent code for rows of ``row_shape`` float32/bfloat16/float16 values; see the module docstring.

    ``code_lengths`` (uint8, one per exponent value) is the whole table; ``seg`` is the segment size in elements
    (``None``: the whole row, one segment).
    """

    method = "exponent"
    section_names = ("code_lengths",)

    def __init__(self, code_lengths: np.ndarray, *, dtype: torch.dtype, row_shape: tuple[int, ...],
                 seg: "int | None" = None, fitted_rows: int = 0) -> None:
        if dtype not in ALL_FORMATS:
            raise RowDtypeError(f"the exponent codec takes float32, bfloat16 or float16 rows, got {dtype}")
        ebits, self.eshift, self.raw_bits = ALL_FORMATS[dtype]
        lengths = np.asarray(code_lengths, dtype=np.uint8)
        if lengths.shape != (1 << ebits,) or lengths.min() < 1 or lengths.max() > MAX_CODE_BITS:
            raise FormatError(f"code lengths: expected {1 << ebits} values in [1, {MAX_CODE_BITS}]")
        # complete (Kraft sum exactly 1; exact in float64): every bit pattern starts a codeword, so a decoder's
        # table has no holes and the CPU and GPU decoders agree on every input
        if float(np.sum(2.0 ** -lengths.astype(np.float64))) != 1.0:
            raise FormatError("code lengths do not form a complete prefix code (Kraft sum != 1)")
        self.code_lengths = lengths
        self.emask = (1 << ebits) - 1
        self.dtype = dtype
        self.elem_bytes = torch.empty((), dtype=dtype).element_size()
        self.sign_shift = 8 * self.elem_bytes - 1
        self.row_shape = tuple(int(s) for s in row_shape)
        if self.row_elems < 1:
            raise RowShapeError(f"rows of zero elements cannot be stored (row shape {self.row_shape})")
        self._row_bytes = self.elem_bytes * self.row_elems
        if seg is not None and (isinstance(seg, bool) or not isinstance(seg, (int, np.integer)) or seg < 1):
            raise InvalidArgumentError(f"seg must be a positive number of elements or None, got {seg!r}")
        self.seg = min(int(seg), self.row_elems) if seg is not None else self.row_elems
        self.n_seg = -(-self.row_elems // self.seg)
        self.max_code_bits = int(lengths.max())
        self.hdr_field = header_field_bits(self.row_elems, self.max_code_bits)
        self.hdr_bits = (self.n_seg - 1) * self.hdr_field
        self.fitted_rows = int(fitted_rows)
        self._codes = canonical_codes(lengths)
        self._code_rev = np.array([int(format(int(c), f"0{int(ln)}b")[::-1], 2) for c, ln in zip(self._codes, lengths)],
                                  dtype=np.int32)
        self._tables = _decode_tables(lengths)
        self._kernel_tables: dict[str, "ExponentTables"] = {}

    @property
    def row_bytes(self) -> int:
        return self._row_bytes

    @property
    def metadata_nbytes(self) -> int:
        """Bytes of the code (its lengths) a store keeps per codec."""
        return int(self.code_lengths.nbytes)

    def __repr__(self) -> str:
        return (f"ExponentCodec(dtype={dtype_to_name(self.dtype)}, row_shape={self.row_shape}, seg={self.seg}, "
                f"max_code_bits={self.max_code_bits})")

    @staticmethod
    def takes(dtype: torch.dtype) -> bool:
        """Whether rows of ``dtype`` can be exponent-coded."""
        return dtype in ALL_FORMATS

    # -- fit --------------------------------------------------------------------------------------
    @classmethod
    def fit(cls, x: torch.Tensor, max_code_bits: int = MAX_CODE_BITS, *,  # type: ignore[override]
            seg: "int | str | None" = None, sample: "float | int | None" = None, seed: int = 0,
            header_budget: float = HEADER_BUDGET) -> "ExponentCodec":
        """Count the exponents of ``x`` ([N, ...] float32/bf16/fp16, any device; counted where it lives) and build
        a length-limited code.

        ``seg``: elements per segment; ``None`` (default) one segment per row, the format the KV append store's
        kernels read; ``"auto"`` the most parallel decode whose header costs at most ``header_budget`` of a row
        (:func:`segment_size`; what ``Codec.fit(method="exponent")`` asks for). ``sample``/``seed`` fit on a
        random subset of rows, as :meth:`Codec.fit` does.
        """
        x = check_rows(x)
        if x.dtype not in ALL_FORMATS:
            raise RowDtypeError(f"the exponent codec takes float32, bfloat16 or float16 rows, got {x.dtype}")
        if x.shape[0] == 0:
            raise InvalidArgumentError("cannot fit a codec on zero rows")
        idx = sample_rows(int(x.shape[0]), sample, seed)
        if idx is not None:
            x = x[torch.from_numpy(idx).to(x.device)]
        ebits, eshift, raw_bits = ALL_FORMATS[x.dtype]
        counts = _exponent_counts(x, ebits, eshift)
        lengths = limited_lengths(counts + 1, min(int(max_code_bits), MAX_CODE_BITS))  # +1: unseen stay encodable
        row_shape = tuple(x.shape[1:])
        d = int(np.prod(row_shape, dtype=np.int64)) if row_shape else 1
        if seg == "auto":
            mean = float((counts * lengths).sum() / max(1, counts.sum()))
            seg = segment_size(d, raw_bits, mean, header_field_bits(d, int(lengths.max())), header_budget)
        elif isinstance(seg, str):
            raise InvalidArgumentError(f"seg must be a positive int, 'auto' or None, got {seg!r}")
        return cls(lengths, dtype=x.dtype, row_shape=row_shape, seg=seg, fitted_rows=int(x.shape[0]))

    # -- host rows --------------------------------------------------------------------------------
    def _elements(self, rows_u8: np.ndarray) -> np.ndarray:
        return _uint_rows(self._check_u8_rows(rows_u8), self.elem_bytes)

    def row_lengths(self, rows_u8: np.ndarray) -> np.ndarray:
        """CPU: int32 stored bytes of each row of ``rows_u8`` (uint8 [M, row_bytes]); ``row_bytes`` where raw."""
        bits = cpu.row_bits_cpu(self._elements(rows_u8), self.code_lengths, self.eshift, self.emask,
                                self.hdr_bits + self.row_elems * self.raw_bits)
        return np.minimum((bits + 7) >> 3, self.row_bytes).astype(np.int32)

    def encode_rows_at(self, rows_u8: np.ndarray, buf: np.ndarray, offsets: np.ndarray,
                       lengths: "np.ndarray | None" = None) -> np.ndarray:
        """CPU: store row m of ``rows_u8`` at ``buf[offsets[m]:]`` (exactly ``lengths[m]`` bytes); return lengths."""
        u = self._elements(rows_u8)
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        out_len = np.empty(u.shape[0], dtype=np.int32)
        if lengths is None:
            lengths = self.row_lengths(rows_u8)
        if u.shape[0]:
            ends = offsets + np.asarray(lengths, dtype=np.int64)
            if offsets.shape != (u.shape[0],) or offsets.min() < 0 or ends.max() > buf.size:
                raise FormatError("encode_rows_at: offsets/lengths point outside the buffer")
            cpu.encode_rows_cpu(u, self.code_lengths, self._code_rev, self.eshift, self.emask, self.raw_bits,
                                self.sign_shift, self.seg, self.hdr_field, self.row_bytes, self.elem_bytes, buf,
                                offsets, out_len)
            if not np.array_equal(out_len, lengths):
                raise FormatError("encode_rows_at: the lengths passed are not this code's lengths for these rows")
        return out_len

    def decode_rows_at(self, buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, out_u8: np.ndarray,
                       out_rows: np.ndarray, compressed: "np.ndarray | None" = None) -> None:
        """CPU: decode the row at ``buf[offsets[m]:]`` (``lengths[m]`` bytes) into ``out_u8[out_rows[m]]``.

        ``compressed`` (1 = coded) must agree with the lengths (coded iff shorter than ``row_bytes``); a row that is
        malformed or lies outside ``buf`` raises FormatError."""
        offs = np.ascontiguousarray(offsets, dtype=np.int64).reshape(-1)
        lens = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
        n = offs.size
        if n == 0:
            return
        if lens.size != n or lens.min() < 1 or lens.max() > self.row_bytes or offs.min() < 0 \
                or (offs + lens).max() > buf.size:
            raise FormatError("exponent rows: lengths/offsets point outside the stored bytes")
        if compressed is not None and not np.array_equal(np.asarray(compressed).reshape(-1) != 0,
                                                         lens < self.row_bytes):
            raise FormatError("exponent rows: a row's coded flag disagrees with its length (coded iff shorter "
                              "than the raw row)")
        tmp = np.empty((n, self.row_elems), dtype=np.uint32 if self.elem_bytes == 4 else np.uint16)
        self._decode_into(buf, offs, lens, tmp)
        _uint_rows(out_u8.reshape(out_u8.shape[0], -1), self.elem_bytes)[out_rows] = tmp

    def _decode_into(self, buf: np.ndarray, offs: np.ndarray, lens: np.ndarray, out: np.ndarray) -> None:
        order, first, count, offset = self._tables
        bad = cpu.decode_rows_cpu(buf, offs, lens, self.row_elems, self.eshift, self.raw_bits, self.sign_shift,
                                  self.seg, self.hdr_field, self.row_bytes, self.elem_bytes, order, first, count,
                                  offset, MAX_CODE_BITS, out)
        if bad >= 0:
            raise FormatError(f"corrupt exponent-coded row {bad}: no codeword ends inside the row")

    # -- whole tensors (rows back to back) -----------------------------------------------------------
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of ``x`` packed back to back on the CPU: ``(data uint8, lengths int32 [N], offsets int64 [N])``."""
        rows = self.check_compatible(x).cpu().numpy()
        lengths = self.row_lengths(rows)
        offsets = np.zeros(rows.shape[0], dtype=np.int64)
        if rows.shape[0] > 1:
            np.cumsum(lengths[:-1], out=offsets[1:])
        buf = np.zeros(int(lengths.sum(dtype=np.int64)), dtype=np.uint8)
        out_len = self.encode_rows_at(rows, buf, offsets, lengths)
        return torch.from_numpy(buf), torch.from_numpy(out_len), torch.from_numpy(offsets)

    def decode(self, data: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The rows :meth:`encode` produced, bit-identical (any subset: pass their lengths and offsets)."""
        lens = lengths.to(torch.int64).numpy()
        out = np.empty((lens.size, self.row_bytes), dtype=np.uint8)
        self.decode_rows_at(data.numpy(), offsets.to(torch.int64).numpy(), lens, out,
                            np.arange(lens.size, dtype=np.int64))
        return torch.from_numpy(out).view(self.dtype).reshape(lens.size, *self.row_shape)

    # -- GPU ----------------------------------------------------------------------------------------
    def kernel_tables(self, device: "str | torch.device") -> "ExponentTables":
        """The code as the GPU kernels take it, built once per device: lengths, bit-reversed codewords, the decode
        table of ``2**max_bits`` entries ``(symbol << 8) | length`` behind its first level (``two_level_lut``), and
        the row geometry."""
        from .kernels.exponent import ExponentTables, two_level_lut

        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if str(dev) not in self._kernel_tables:
            max_bits = self.max_code_bits
            lut = np.zeros(1 << max_bits, dtype=np.int32)
            for s, (ln, code) in enumerate(zip(self.code_lengths.astype(int), self._codes)):
                lo = int(code) << (max_bits - ln)
                lut[lo: lo + (1 << (max_bits - ln))] = (s << 8) | ln
            self._kernel_tables[str(dev)] = ExponentTables(
                torch.from_numpy(self.code_lengths.copy()).to(dev), torch.from_numpy(self._code_rev.copy()).to(dev),
                torch.from_numpy(two_level_lut(lut, max_bits)).to(dev), max_bits, self.eshift, self.emask,
                self.raw_bits, self.row_elems, self.row_bytes, self.elem_bytes, self.seg, self.n_seg, self.hdr_field)
        return self._kernel_tables[str(dev)]

    def size_rows_gpu(self, rows_u8: torch.Tensor) -> torch.Tensor:
        from .kernels.exponent import exp_sizes

        return exp_sizes(rows_u8, self.kernel_tables(rows_u8.device))

    def encode_rows_gpu(self, rows_u8: torch.Tensor, dst_ptrs: torch.Tensor, lengths: torch.Tensor) -> None:
        from .kernels.exponent import exp_encode

        exp_encode(rows_u8, self.kernel_tables(rows_u8.device), dst_ptrs, lengths)

    def gather_rows_gpu(self, base: torch.Tensor, offsets: "torch.Tensor | None", lengths: torch.Tensor,
                        flags: torch.Tensor, n_rows: int, ids: torch.Tensor, out_u8: torch.Tensor) -> None:
        """Coded iff shorter than ``row_bytes`` (``flags`` say the same and are not read). One host sync: a corrupt
        row raises FormatError."""
        from .kernels.exponent import exp_gather

        tab = self.kernel_tables(out_u8.device)
        err = torch.zeros(2, dtype=torch.int64, device=out_u8.device)
        exp_gather(base.data_ptr(), offsets, lengths, ids, n_rows, tab, out_u8, err)
        _raise_gpu_err(err)

    def encode_gpu(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`encode` on the GPU (``x`` on CUDA), same bytes: ``(data, lengths, offsets)`` on x's device.
        Two launches and one host sync (the total size sizes ``data``)."""
        rows = self.check_compatible(x)
        if not rows.is_cuda:
            raise InvalidArgumentError("encode_gpu: expected rows on a CUDA device")
        lengths = self.size_rows_gpu(rows)
        offsets = torch.zeros(lengths.numel(), dtype=torch.int64, device=rows.device)
        if lengths.numel() > 1:
            torch.cumsum(lengths[:-1].to(torch.int64), 0, out=offsets[1:])
        total = int(lengths.sum(dtype=torch.int64)) if lengths.numel() else 0
        data = torch.empty(total + 16, dtype=torch.uint8, device=rows.device)[:total]
        self.encode_rows_gpu(rows, offsets + data.data_ptr(), lengths)
        return data, lengths, offsets

    def decode_gpu(self, data: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor,
                   device: "str | torch.device" = "cuda") -> torch.Tensor:
        """:meth:`decode` on the GPU: ``data`` on the device or in pinned host memory (read zero-copy); row i is
        ``lengths[i]`` bytes at ``offsets[i]``. Narrow one-segment rows decode a row per lane; wider or segmented
        rows a row per warp (several narrow rows per warp where they fit its shared memory). A malformed row raises
        FormatError (one sync, to check)."""
        from .kernels.exponent import exp_gather

        tab = self.kernel_tables(device)
        dev = tab.lut.device
        if not (data.is_cuda or data.is_pinned()):
            raise InvalidArgumentError("data: expected a CUDA tensor or pinned host memory (zero-copy reads)")
        n = offsets.numel()
        if lengths.numel() != n:
            raise InvalidArgumentError(f"lengths: expected {n} values (one per offset), got {lengths.numel()}")
        if n:  # bounds first (one sync): the kernels trust them
            lo_off, lo_len = int(offsets.min()), int(lengths.min())
            hi_len, hi_end = int(lengths.max()), int((offsets.to(torch.int64) + lengths.to(offsets.device,
                                                                                         torch.int64)).max())
            if lo_off < 0 or lo_len < 1 or hi_len > self.row_bytes or hi_end > data.numel():
                raise FormatError("exponent rows: lengths/offsets point outside the stored bytes")
        out = torch.empty((n, *self.row_shape), dtype=self.dtype, device=dev)
        err = torch.zeros(2, dtype=torch.int64, device=dev)
        exp_gather(data.data_ptr(), offsets.to(dev, torch.int64).contiguous(),
                   lengths.to(dev, torch.int32).contiguous(), None, n, tab,
                   out.view(torch.uint8).reshape(n, self.row_bytes), err)
        _raise_gpu_err(err)
        return out

    # -- tables and files -------------------------------------------------------------------------
    def same_tables(self, other: object) -> bool:
        return (isinstance(other, ExponentCodec) and self.dtype == other.dtype and self.row_shape == other.row_shape
                and self.seg == other.seg and np.array_equal(self.code_lengths, other.code_lengths))

    def header(self) -> dict:
        return {"method": self.method, "dtype": dtype_to_name(self.dtype), "row_shape": list(self.row_shape),
                "row_bytes": self.row_bytes, "seg": self.seg, "fitted_rows": self.fitted_rows}

    def sections(self) -> list[np.ndarray]:
        return [self.code_lengths]

    @classmethod
    def _from_sections(cls, hdr: dict, sections: list[np.ndarray]) -> "ExponentCodec":
        """Files without ``seg`` hold one-segment codes (the format before segments)."""
        try:
            codec = ExponentCodec(np.asarray(sections[0], dtype=np.uint8), dtype=name_to_dtype(hdr["dtype"]),
                                  row_shape=tuple(hdr["row_shape"]), seg=hdr.get("seg"),
                                  fitted_rows=int(hdr.get("fitted_rows", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, FormatError):
                raise
            raise FormatError(f"bad exponent codec header: {exc}") from None
        if int(hdr.get("row_bytes", codec.row_bytes)) != codec.row_bytes:
            raise FormatError(f"bad exponent codec header: row_bytes {hdr['row_bytes']} is not {codec.row_bytes}")
        return codec


def _exponent_counts(x: torch.Tensor, ebits: int, eshift: int) -> np.ndarray:
    """How often each exponent value occurs in ``x`` (int64 [2**ebits]), counted on x's device a slice at a time."""
    flat = _int_view(x).reshape(-1)
    counts = torch.zeros(1 << ebits, dtype=torch.int64, device=x.device)
    step = 1 << 24
    for a in range(0, flat.numel(), step):
        e = (flat[a: a + step].to(torch.int64) >> eshift) & ((1 << ebits) - 1)
        counts += torch.bincount(e, minlength=1 << ebits)
    return counts.cpu().numpy()


def _raise_gpu_err(err: torch.Tensor) -> None:
    """The GPU decoders' error words (1 + the first bad row, 1 + the first bad id; 0 = none), read with one sync."""
    bad_row, bad_id = (int(v) for v in err.tolist())
    if bad_id:
        raise FormatError(f"row id at position {bad_id - 1} is outside the store")
    if bad_row:
        raise FormatError(f"corrupt exponent-coded row {bad_row - 1}: no codeword ends inside the row")
