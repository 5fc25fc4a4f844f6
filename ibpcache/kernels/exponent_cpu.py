"""CPU twins (Numba) of ``exponent.cu``: stored sizes, encode and decode of exponent-coded rows.

The format (docs/FORMAT.md, "Exponent-coded rows"): a row of ``d`` elements of ``elem_bytes`` bytes is one bit
stream, least significant bit of each byte first: ``n_seg - 1`` header fields of ``hdr_field`` bits (where segment
s >= 1 starts, in bits from the start of the code stream), then ``d`` raw fields of ``raw_bits`` bits
(``(sign << eshift) | mantissa``), then the ``d`` exponent codewords in element order, codeword bits most
significant first, zero-padded to whole bytes. A row whose stream would not be shorter than the raw row is stored
raw (its little-endian element bytes; length == ``row_bytes``).

The encoder writes the same bytes as the GPU encoder; the decoder is independent of the GPU's table-driven one
(canonical first-code/count decoding, bit by bit), so the two check each other. Rows are read from their own
segment offsets, as the GPU reads them, so a corrupt header fails the same way on both.
"""

from __future__ import annotations

import numba as nb
import numpy as np

__all__ = ["row_bits_cpu", "encode_rows_cpu", "decode_rows_cpu"]


@nb.njit(cache=True, nogil=True)
def row_bits_cpu(u: np.ndarray, code_len: np.ndarray, eshift: int, emask: int, fixed_bits: int) -> np.ndarray:
    """Stream bits of every row of ``u`` (uint16/uint32 [n, d]): ``fixed_bits`` (header + raw fields) + codewords."""
    n, d = u.shape
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        b = fixed_bits
        for j in range(d):
            b += code_len[(int(u[i, j]) >> eshift) & emask]
        out[i] = b
    return out


@nb.njit(inline="always", cache=True)
def _put(buf: np.ndarray, pos: int, acc: int, fill: int, value: int, nbits: int) -> tuple:
    """Append ``nbits`` (<= 32) of ``value``, least significant first, to the accumulator; flush whole bytes."""
    acc |= value << fill
    fill += nbits
    while fill >= 8:
        buf[pos] = acc & 0xFF
        acc >>= 8
        fill -= 8
        pos += 1
    return pos, acc, fill


@nb.njit(cache=True, nogil=True)
def encode_rows_cpu(u: np.ndarray, code_len: np.ndarray, code_rev: np.ndarray, eshift: int, emask: int,
                    raw_bits: int, sign_shift: int, seg: int, hdr_field: int, row_bytes: int, elem_bytes: int,
                    buf: np.ndarray, offsets: np.ndarray, out_len: np.ndarray) -> None:
    """Write row i of ``u`` at ``buf[offsets[i]:]``; ``out_len[i]`` = its stored bytes. ``code_rev`` holds each
    codeword bit-reversed over its length, so appending it least significant bit first puts its first bit first."""
    n, d = u.shape
    mant_mask = (1 << eshift) - 1
    n_seg = (d + seg - 1) // seg
    fixed = (n_seg - 1) * hdr_field + d * raw_bits
    for i in range(n):
        base = offsets[i]
        nbits = fixed
        for j in range(d):
            nbits += code_len[(int(u[i, j]) >> eshift) & emask]
        nbytes = (nbits + 7) >> 3
        if nbytes >= row_bytes:  # would not shrink: stored raw, little-endian elements
            for j in range(d):
                v = int(u[i, j])
                for b in range(elem_bytes):
                    buf[base + j * elem_bytes + b] = (v >> (8 * b)) & 0xFF
            out_len[i] = row_bytes
            continue
        pos, acc, fill = base, 0, 0
        if n_seg > 1:  # header: where each later segment's first codeword starts in the code stream
            off = 0
            for j in range(d):
                if j > 0 and j % seg == 0:
                    pos, acc, fill = _put(buf, pos, acc, fill, off, hdr_field)
                off += code_len[(int(u[i, j]) >> eshift) & emask]
        for j in range(d):
            v = int(u[i, j])
            pos, acc, fill = _put(buf, pos, acc, fill, ((v >> sign_shift) << eshift) | (v & mant_mask), raw_bits)
        for j in range(d):
            e = (int(u[i, j]) >> eshift) & emask
            pos, acc, fill = _put(buf, pos, acc, fill, int(code_rev[e]), int(code_len[e]))
        if fill > 0:
            buf[pos] = acc & 0xFF
        out_len[i] = nbytes


@nb.njit(inline="always", cache=True)
def _bits(buf: np.ndarray, base: int, pos: int, nbits: int) -> int:
    """``nbits`` (1..32) stream bits from bit ``pos`` of the row at ``buf[base:]``, reading only the bytes they
    occupy."""
    byte = base + (pos >> 3)
    sh = pos & 7
    v = 0
    got = 0
    while got < nbits + sh:
        v |= int(buf[byte]) << got
        got += 8
        byte += 1
    return (v >> sh) & ((1 << nbits) - 1)


@nb.njit(cache=True, nogil=True)
def decode_rows_cpu(buf: np.ndarray, offsets: np.ndarray, lens: np.ndarray, d: int, eshift: int, raw_bits: int,
                    sign_shift: int, seg: int, hdr_field: int, row_bytes: int, elem_bytes: int, order: np.ndarray,
                    first: np.ndarray, count: np.ndarray, offset: np.ndarray, max_bits: int,
                    out: np.ndarray) -> int:
    """Decode the row stored at ``buf[offsets[i]:]`` (``lens[i]`` bytes) into ``out[i]`` (uint16/uint32 [n, d]).

    Returns -1, or the first row whose stream is malformed (shorter than its raw fields, or a codeword that does
    not end inside the row); nothing is read outside ``[offsets[i], offsets[i] + lens[i])``."""
    n = offsets.size
    mant_mask = (1 << eshift) - 1
    n_seg = (d + seg - 1) // seg
    hdr_bits = (n_seg - 1) * hdr_field
    code0 = hdr_bits + d * raw_bits
    for i in range(n):
        base = offsets[i]
        ln_i = lens[i]
        if ln_i == row_bytes:
            for j in range(d):
                v = 0
                for b in range(elem_bytes):
                    v |= int(buf[base + j * elem_bytes + b]) << (8 * b)
                out[i, j] = v
            continue
        lim = ln_i * 8
        if ln_i < 1 or ln_i > row_bytes or code0 > lim:
            return i
        for j in range(d):
            raw = _bits(buf, base, hdr_bits + j * raw_bits, raw_bits)
            out[i, j] = ((raw >> eshift) << sign_shift) | (raw & mant_mask)
        for s in range(n_seg):
            pos = code0
            if s > 0:
                pos += _bits(buf, base, (s - 1) * hdr_field, hdr_field)
            for j in range(s * seg, min(d, (s + 1) * seg)):
                code = 0
                ln = 0
                e = 0
                while True:
                    ln += 1
                    if ln > max_bits or pos >= lim:
                        return i
                    code = (code << 1) | ((int(buf[base + (pos >> 3)]) >> (pos & 7)) & 1)
                    pos += 1
                    if code - first[ln] < count[ln]:
                        e = order[offset[ln] + code - first[ln]]
                        break
                out[i, j] = int(out[i, j]) | (e << eshift)
    return -1
