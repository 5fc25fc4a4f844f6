"""Exponent coding for 16-bit floats (bf16, fp16): entropy-code the exponent field, keep sign and mantissa raw.

Why a second codec: IBP drops bits that (nearly) every row shares. In bf16 KV caches the sign and the 7 mantissa
bits are close to uniform, so IBP finds little (SmolLM2's real KV: K 1.17x, V 1.32x), but the 8 exponent bits
carry only ~2.8 bits of information: values of one tensor sit within a few binades. Coding just the exponent with
a per-dataset Huffman code (the observation behind DFloat11 and ZipCCL) reaches ~1.45x losslessly.

Format of one row of ``D`` elements (each row decodes on its own: the caches and KV fetches read arbitrary rows):

* the raw part first: ``D`` fields of ``R`` bits (bf16: sign + 7 mantissa bits, R = 8; fp16: sign + 10 mantissa
  bits, R = 11), then the ``D`` exponent codewords; one bit stream, least significant bit of each byte first,
  codeword bits most significant first; the row is padded to whole bytes with zero bits;
* a row whose stream would not be shorter than the raw row is stored raw; ``length == row_bytes`` says so (a
  coded row is always shorter), exactly as in IBP's format.

The code is canonical Huffman over every possible exponent value (unseen ones get a pseudo-count of one, so any
bit pattern is encodable: NaN payloads, infinities, -0.0, denormals), limited to ``MAX_CODE_BITS`` so a decoder
can use a fixed-size table. Only the code lengths are stored (canonical codes follow from them).

This module is the CPU reference (Numba) and the GPU entry points (``encode_gpu``/``decode_gpu``, kernels in
``kernels/exponent.cu``; same bytes). The packed KV append store (``cache/append_store.py``) takes it per layer and
K/V (``row_lengths``/``encode_rows_at``/``decode_rows_at``, the interface IBP's :class:`~ibpcache.codec.Codec` has;
on the GPU ``kernels/kv_packed.cu`` encodes on append and decodes inside the KV fetch). The feature caches and
``CompressedRows`` accept IBP codecs only and raise a clear TypeError for this one.
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import TYPE_CHECKING

import numba
import numpy as np
import torch

from .errors import FormatError
from .format import FileKind, dtype_to_name, name_to_dtype, read_container, write_container

__all__ = ["ExponentCodec", "MAX_CODE_BITS", "FORMATS"]

if TYPE_CHECKING:
    from .kernels.exponent import ExponentTables

MAX_CODE_BITS = 15
"""Longest codeword: a decoder's table then has 2**15 entries at most."""

FORMATS: dict[torch.dtype, tuple[int, int, int]] = {
    # dtype: (exponent bits, exponent shift, raw bits = sign + mantissa)
    torch.bfloat16: (8, 7, 8),
    torch.float16: (5, 10, 11),
}


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


@numba.njit(cache=True, nogil=True)
def _row_bits(u: np.ndarray, lengths: np.ndarray, eshift: int, emask: int, raw_bits: int) -> np.ndarray:
    n, d = u.shape
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        b = d * raw_bits
        for j in range(d):
            b += lengths[(u[i, j] >> eshift) & emask]
        out[i] = b
    return out


@numba.njit(cache=True, nogil=True)
def _put(buf: np.ndarray, base: int, bitpos: int, value: int, nbits: int) -> int:
    """Write ``nbits`` of ``value``, least significant first, at bit ``bitpos`` of the stream at ``buf[base:]``."""
    for k in range(nbits):
        if (value >> k) & 1:
            p = bitpos + k
            buf[base + (p >> 3)] |= np.uint8(1 << (p & 7))
    return bitpos + nbits


@numba.njit(cache=True, nogil=True)
def _encode(u: np.ndarray, lengths: np.ndarray, codes: np.ndarray, eshift: int, emask: int, raw_bits: int,
            row_bytes: int, buf: np.ndarray, offsets: np.ndarray, out_len: np.ndarray) -> None:
    n, d = u.shape
    mant_mask = (1 << eshift) - 1
    for i in range(n):
        base = offsets[i]
        nbits = d * raw_bits
        for j in range(d):
            nbits += lengths[(u[i, j] >> eshift) & emask]
        nbytes = (nbits + 7) >> 3
        if nbytes >= row_bytes:  # would not shrink: stored raw, little-endian elements
            for j in range(d):
                buf[base + 2 * j] = np.uint8(u[i, j] & 0xFF)
                buf[base + 2 * j + 1] = np.uint8(u[i, j] >> 8)
            out_len[i] = row_bytes
            continue
        for k in range(nbytes):
            buf[base + k] = 0
        pos = 0
        for j in range(d):
            v = int(u[i, j])
            raw = ((v >> 15) << eshift) | (v & mant_mask)
            pos = _put(buf, base, pos, raw, raw_bits)
        for j in range(d):
            e = (int(u[i, j]) >> eshift) & emask
            ln = int(lengths[e])
            c = int(codes[e])
            for k in range(ln):  # most significant codeword bit first
                if (c >> (ln - 1 - k)) & 1:
                    p = pos + k
                    buf[base + (p >> 3)] |= np.uint8(1 << (p & 7))
            pos += ln
        out_len[i] = nbytes


@numba.njit(cache=True, nogil=True)
def _decode(buf: np.ndarray, offsets: np.ndarray, lens: np.ndarray, d: int, eshift: int, raw_bits: int,
            row_bytes: int, order: np.ndarray, first: np.ndarray, count: np.ndarray, offset: np.ndarray,
            out: np.ndarray) -> None:
    n = offsets.size
    mant_mask = (1 << eshift) - 1
    for i in range(n):
        base = offsets[i]
        if lens[i] == row_bytes:
            for j in range(d):
                out[i, j] = np.uint16(buf[base + 2 * j]) | (np.uint16(buf[base + 2 * j + 1]) << 8)
            continue
        pos = 0
        for j in range(d):
            raw = 0
            for k in range(raw_bits):
                p = pos + k
                raw |= ((int(buf[base + (p >> 3)]) >> (p & 7)) & 1) << k
            pos += raw_bits
            out[i, j] = np.uint16(((raw >> eshift) << 15) | (raw & mant_mask))
        for j in range(d):
            code = 0
            ln = 0
            while True:
                ln += 1
                if ln > MAX_CODE_BITS or (pos >> 3) >= lens[i]:
                    raise ValueError("corrupt exponent-coded row: no codeword ends inside the row")
                code = (code << 1) | ((int(buf[base + (pos >> 3)]) >> (pos & 7)) & 1)
                pos += 1
                if code - first[ln] < count[ln]:
                    e = order[offset[ln] + code - first[ln]]
                    break
            out[i, j] = np.uint16(int(out[i, j]) | (e << eshift))


class ExponentCodec:
    """A fitted exponent code for rows of ``row_elems`` bf16/fp16 values; see the module docstring."""

    method = "exponent"

    def __init__(self, code_lengths: np.ndarray, *, dtype: torch.dtype, row_shape: tuple[int, ...],
                 fitted_rows: int = 0) -> None:
        if dtype not in FORMATS:
            raise TypeError(f"the exponent codec takes bfloat16 or float16 rows, got {dtype}")
        ebits, self.eshift, self.raw_bits = FORMATS[dtype]
        lengths = np.asarray(code_lengths, dtype=np.uint8)
        if lengths.shape != (1 << ebits,) or lengths.min() < 1 or lengths.max() > MAX_CODE_BITS:
            raise FormatError(f"code lengths: expected {1 << ebits} values in [1, {MAX_CODE_BITS}]")
        if float(np.sum(2.0 ** -lengths.astype(np.float64))) > 1.0 + 1e-12:
            raise FormatError("code lengths do not form a prefix code (Kraft sum > 1)")
        self.code_lengths = lengths
        self.emask = (1 << ebits) - 1
        self.dtype = dtype
        self.row_shape = tuple(int(s) for s in row_shape)
        self.row_elems = int(np.prod(self.row_shape)) if self.row_shape else 1
        self.row_bytes = 2 * self.row_elems
        self.fitted_rows = int(fitted_rows)
        self._codes = canonical_codes(lengths)
        self._tables = _decode_tables(lengths)

    def __repr__(self) -> str:
        return (f"ExponentCodec(dtype={self.dtype}, row_shape={self.row_shape}, "
                f"max_code_bits={int(self.code_lengths.max())})")

    # -- fit --------------------------------------------------------------------------------------
    @classmethod
    def fit(cls, x: torch.Tensor, max_code_bits: int = MAX_CODE_BITS) -> "ExponentCodec":
        """Count the exponents of ``x`` ([N, ...] bf16/fp16, any device) and build a length-limited code."""
        rows = cls._u16(x)
        ebits, eshift, _ = FORMATS[x.dtype]
        exps = (rows.reshape(-1) >> eshift) & ((1 << ebits) - 1)
        counts = np.bincount(exps, minlength=1 << ebits).astype(np.int64) + 1  # unseen: still encodable
        return cls(limited_lengths(counts, min(int(max_code_bits), MAX_CODE_BITS)), dtype=x.dtype,
                   row_shape=tuple(x.shape[1:]), fitted_rows=int(x.shape[0]))

    @staticmethod
    def _u16(x: torch.Tensor) -> np.ndarray:
        if x.dtype not in FORMATS:
            raise TypeError(f"the exponent codec takes bfloat16 or float16 rows, got {x.dtype}")
        if x.dim() < 1:
            raise ValueError("x: expected rows [N, ...]")
        n = int(x.shape[0])
        return x.detach().to("cpu").contiguous().view(torch.int16).reshape(n, -1).numpy().view(np.uint16)

    def _rows(self, x: torch.Tensor) -> np.ndarray:
        if x.dtype != self.dtype or tuple(x.shape[1:]) != self.row_shape:
            raise ValueError(f"x: expected rows of shape {self.row_shape} and dtype {self.dtype}, got "
                             f"{tuple(x.shape[1:])} {x.dtype}")
        return self._u16(x)

    # -- sizes ------------------------------------------------------------------------------------
    def stored_lengths(self, x: torch.Tensor) -> torch.Tensor:
        """Bytes each row of ``x`` would take (``row_bytes`` where a row is stored raw)."""
        bits = _row_bits(self._rows(x), self.code_lengths, self.eshift, self.emask, self.raw_bits)
        return torch.from_numpy(np.minimum((bits + 7) >> 3, self.row_bytes).astype(np.int32))

    # -- encode / decode --------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of ``x`` packed back to back: ``(data uint8, lengths int32 [N], offsets int64 [N])``."""
        rows = self._rows(x)
        lengths = self.stored_lengths(x).numpy().astype(np.int64)
        offsets = np.zeros(rows.shape[0], dtype=np.int64)
        if rows.shape[0] > 1:
            np.cumsum(lengths[:-1], out=offsets[1:])
        buf = np.zeros(int(lengths.sum()), dtype=np.uint8)
        out_len = np.zeros(rows.shape[0], dtype=np.int32)
        _encode(rows, self.code_lengths.astype(np.int64), self._codes, self.eshift, self.emask, self.raw_bits,
                self.row_bytes, buf, offsets, out_len)
        return torch.from_numpy(buf), torch.from_numpy(out_len), torch.from_numpy(offsets)

    def decode(self, data: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The rows :meth:`encode` produced, bit-identical (any subset: pass their lengths and offsets)."""
        lens = lengths.to(torch.int64).numpy()
        offs = offsets.to(torch.int64).numpy()
        buf = data.numpy()
        if lens.size and (lens.min() < 1 or lens.max() > self.row_bytes or (offs + lens).max() > buf.size
                          or offs.min() < 0):
            raise FormatError("lengths/offsets point outside the stored bytes")
        out = np.empty((lens.size, self.row_elems), dtype=np.uint16)
        order, first, count, offset = self._tables
        try:
            _decode(buf, offs, lens, self.row_elems, self.eshift, self.raw_bits, self.row_bytes, order, first, count,
                    offset, out)
        except ValueError as exc:
            raise FormatError(str(exc)) from None
        return torch.from_numpy(out.view(np.int16)).view(self.dtype).reshape(lens.size, *self.row_shape)

    # -- the store interface (same methods as Codec's: stores place, encode and decode rows by offset) ---------
    @property
    def metadata_nbytes(self) -> int:
        """Bytes of the code (its lengths) a store keeps per codec."""
        return int(self.code_lengths.nbytes)

    def same_tables(self, other: object) -> bool:
        return (isinstance(other, ExponentCodec) and self.dtype == other.dtype and self.row_shape == other.row_shape
                and np.array_equal(self.code_lengths, other.code_lengths))

    def _u16_rows(self, rows_u8: np.ndarray) -> np.ndarray:
        if rows_u8.ndim != 2 or rows_u8.shape[1] != self.row_bytes or rows_u8.dtype != np.uint8:
            raise ValueError(f"rows: expected uint8 [M, {self.row_bytes}], got {rows_u8.dtype} {rows_u8.shape}")
        return np.ascontiguousarray(rows_u8).view(np.uint16)

    def row_lengths(self, rows_u8: np.ndarray) -> np.ndarray:
        """CPU: int32 stored bytes of each row of ``rows_u8`` (uint8 [M, row_bytes]); ``row_bytes`` where raw."""
        bits = _row_bits(self._u16_rows(rows_u8), self.code_lengths, self.eshift, self.emask, self.raw_bits)
        return np.minimum((bits + 7) >> 3, self.row_bytes).astype(np.int32)

    def encode_rows_at(self, rows_u8: np.ndarray, buf: np.ndarray, offsets: np.ndarray,
                       lengths: "np.ndarray | None" = None) -> np.ndarray:
        """CPU: store row m of ``rows_u8`` at ``buf[offsets[m]:]`` (exactly ``lengths[m]`` bytes); return lengths."""
        if lengths is None:
            lengths = self.row_lengths(rows_u8)
        out_len = np.empty(rows_u8.shape[0], dtype=np.int32)
        if rows_u8.shape[0]:
            _encode(self._u16_rows(rows_u8), self.code_lengths.astype(np.int64), self._codes, self.eshift, self.emask,
                    self.raw_bits, self.row_bytes, buf, np.ascontiguousarray(offsets, dtype=np.int64), out_len)
            if not np.array_equal(out_len, lengths):
                raise FormatError("encode_rows_at: the lengths passed are not this code's lengths for these rows")
        return out_len

    def decode_rows_at(self, buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, out_u8: np.ndarray,
                       out_rows: np.ndarray, compressed: "np.ndarray | None" = None) -> None:
        """CPU: decode the row at ``buf[offsets[m]:]`` (``lengths[m]`` bytes) into ``out_u8[out_rows[m]]``.
        ``compressed`` is implied by the lengths (accepted for the Codec signature, ignored)."""
        n = int(np.asarray(offsets).size)
        if n == 0:
            return
        tmp = np.empty((n, self.row_elems), dtype=np.uint16)
        order, first, count, offset = self._tables
        try:
            _decode(buf, np.ascontiguousarray(offsets, dtype=np.int64), np.ascontiguousarray(lengths, dtype=np.int64),
                    self.row_elems, self.eshift, self.raw_bits, self.row_bytes, order, first, count, offset, tmp)
        except ValueError as exc:
            raise FormatError(str(exc)) from None
        out_u8.view(np.uint16).reshape(out_u8.shape[0], -1)[out_rows] = tmp

    # -- GPU ----------------------------------------------------------------------------------------
    def kernel_tables(self, device: "str | torch.device") -> "ExponentTables":
        """The code as the GPU kernels take it, built once per device: lengths, bit-reversed codewords and the
        decode table of ``2**max_bits`` entries ``(symbol << 8) | length``."""
        from .kernels.exponent import ExponentTables

        dev = torch.device(device)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        cache = self.__dict__.setdefault("_kernel_tables", {})
        if str(dev) not in cache:
            max_bits = int(self.code_lengths.max())
            lut = np.zeros(1 << max_bits, dtype=np.int32)
            rev = np.zeros(self.code_lengths.size, dtype=np.int32)
            for s, (ln, code) in enumerate(zip(self.code_lengths.astype(int), self._codes)):
                lo = int(code) << (max_bits - ln)
                lut[lo: lo + (1 << (max_bits - ln))] = (s << 8) | ln
                rev[s] = int(format(int(code), f"0{ln}b")[::-1], 2)
            cache[str(dev)] = ExponentTables(
                torch.from_numpy(self.code_lengths.copy()).to(dev), torch.from_numpy(rev).to(dev),
                torch.from_numpy(lut).to(dev), max_bits, self.eshift, self.emask, self.raw_bits, self.row_elems,
                self.row_bytes)
        return cache[str(dev)]

    def encode_gpu(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`encode` on the GPU (``x`` on CUDA), same bytes: ``(data, lengths, offsets)`` on x's device.
        Two launches and one host sync (the total size sizes ``data``)."""
        from .kernels.exponent import exp_encode, exp_sizes

        if x.dtype != self.dtype or tuple(x.shape[1:]) != self.row_shape:
            raise ValueError(f"x: expected rows of shape {self.row_shape} and dtype {self.dtype}")
        tab = self.kernel_tables(x.device)
        x = x.contiguous()
        lengths = exp_sizes(x, tab)
        offsets = torch.zeros(lengths.numel(), dtype=torch.int64, device=x.device)
        if lengths.numel() > 1:
            torch.cumsum(lengths[:-1].to(torch.int64), 0, out=offsets[1:])
        total = int(lengths.sum(dtype=torch.int64)) if lengths.numel() else 0
        data = torch.empty(total, dtype=torch.uint8, device=x.device)
        exp_encode(x, tab, offsets, lengths, data)
        return data, lengths, offsets

    def decode_gpu(self, data: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor,
                   device: "str | torch.device" = "cuda") -> torch.Tensor:
        """:meth:`decode` on the GPU: ``data`` on the device or in pinned host memory (read zero-copy); lengths
        and offsets on the device. A stream that overruns its row raises FormatError (one sync, to check)."""
        from .kernels.exponent import exp_decode

        dev = torch.device(device)
        tab = self.kernel_tables(dev)
        if not (data.is_cuda or data.is_pinned()):
            raise ValueError("data: expected a CUDA tensor or pinned host memory (zero-copy reads)")
        n = offsets.numel()
        out = torch.empty((n, *self.row_shape), dtype=self.dtype, device=tab.lut.device)
        err = torch.zeros(1, dtype=torch.int64, device=tab.lut.device)
        exp_decode(data.data_ptr(), offsets.to(tab.lut.device, torch.int64).contiguous(),
                   lengths.to(tab.lut.device, torch.int32).contiguous(), tab, out, err)
        bad = int(err.item())
        if bad:
            raise FormatError(f"corrupt exponent-coded row {bad - 1}: no codeword ends inside the row")
        return out

    # -- save / load ------------------------------------------------------------------------------
    def header(self) -> dict:
        return {"method": self.method, "dtype": dtype_to_name(self.dtype), "row_shape": list(self.row_shape),
                "row_bytes": self.row_bytes, "fitted_rows": self.fitted_rows}

    def save(self, path: "str | Path") -> None:
        """A checksummed codec file (the IBP container; ``Codec.load`` reads either method)."""
        write_container(path, FileKind.CODEC, self.header(), [self.code_lengths])

    @classmethod
    def from_header(cls, hdr: dict, sections: list) -> "ExponentCodec":
        if len(sections) != 1:
            raise FormatError(f"exponent codec: expected 1 section (code lengths), found {len(sections)}")
        try:
            return cls(np.asarray(sections[0], dtype=np.uint8), dtype=name_to_dtype(hdr["dtype"]),
                       row_shape=tuple(hdr["row_shape"]), fitted_rows=int(hdr.get("fitted_rows", 0)))
        except (KeyError, TypeError) as exc:
            raise FormatError(f"bad exponent codec header: {exc}") from None

    @classmethod
    def load(cls, path: "str | Path") -> "ExponentCodec":
        hdr, sections = read_container(path, FileKind.CODEC)
        if hdr.get("method") != cls.method:
            raise FormatError(f"{path}: holds a {hdr.get('method', 'ibp')!r} codec, not an exponent codec")
        return cls.from_header(hdr, sections)
