"""Numba CPU twins of the IBP kernels in ``bitpack.cu``: same format, same bytes.

These are what CI and GPU-less users run, and the reference the GPU output is compared against (the
golden vectors in ``tests/golden`` are made here). The layout is specified in docs/FORMAT.md:
rows are cut into little-endian chunks; chunks go in groups of 32; each group starts with one
participation bit per chunk, followed by each chunk's kept bits (LSB-first bit stream).

All uint64 arithmetic is kept explicitly unsigned: Numba turns mixed signed/unsigned integer math into
float64, which would silently corrupt bits.

The functions a fetch runs (``decode_rows_cpu`` and the three ``stage_*`` passes of the cpu-gather transfer) release
the GIL (``nogil=True``): a loader fetches in a side thread while the training thread launches its step, and a
Numba call holding the GIL for milliseconds would stall that thread.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from .layout import GROUP_CHUNKS

__all__ = [
    "bitcount_cpu",
    "fit_sizes_cpu",
    "size_rows_cpu",
    "encode_rows_cpu",
    "decode_rows_cpu",
    "stage_lengths_cpu",
    "stage_scan_cpu",
    "stage_rows_cpu",
]

_U0 = np.uint64(0)
_U1 = np.uint64(1)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


@nb.njit(inline="always", cache=True)
def _lowmask(nbits: int) -> np.uint64:
    """Mask of the low ``nbits`` bits (0..64), without ever shifting by 64."""
    if nbits >= 64:
        return _ALL
    return (_U1 << np.uint64(nbits)) - _U1


@nb.njit(inline="always", cache=True)
def _ctz(x: np.uint64) -> int:
    n = 0
    while (x & _U1) == _U0:
        x = x >> _U1
        n += 1
    return n


@nb.njit(inline="always", cache=True)
def _popc(x: np.uint64) -> int:
    n = 0
    while x != _U0:
        x &= x - _U1
        n += 1
    return n


@nb.njit(inline="always", cache=True)
def _pext(v: np.uint64, m: np.uint64) -> np.uint64:
    """Gather the bits of ``v`` selected by ``m`` into the low bits, in order (run by run)."""
    r = _U0
    outpos = 0
    while m != _U0:
        s = _ctz(m)
        t = m >> np.uint64(s)
        if t == _ALL:
            ln = 64 - s
        else:
            ln = _ctz(~t)
        lm = _lowmask(ln)
        r |= ((v >> np.uint64(s)) & lm) << np.uint64(outpos)
        outpos += ln
        m &= ~(lm << np.uint64(s))
    return r


@nb.njit(inline="always", cache=True)
def _pdep(v: np.uint64, m: np.uint64) -> np.uint64:
    """Scatter the low bits of ``v`` to the positions selected by ``m`` (inverse of _pext)."""
    r = _U0
    inpos = 0
    while m != _U0:
        s = _ctz(m)
        t = m >> np.uint64(s)
        if t == _ALL:
            ln = 64 - s
        else:
            ln = _ctz(~t)
        lm = _lowmask(ln)
        r |= ((v >> np.uint64(inpos)) & lm) << np.uint64(s)
        inpos += ln
        m &= ~(lm << np.uint64(s))
    return r


@nb.njit(inline="always", cache=True)
def _load_chunk(row, j: int, c: int, row_bytes: int) -> np.uint64:
    """Little-endian chunk j of a row; bytes past the row end read as zero."""
    v = _U0
    base = j * c
    for b in range(c):
        p = base + b
        if p < row_bytes:
            v |= np.uint64(row[p]) << np.uint64(8 * b)
    return v


@nb.njit(inline="always", cache=True)
def _row_bits(row, mask, bitval, c: int, row_bytes: int) -> int:
    """Bits the compressed stream of this row needs (participation bits included)."""
    n_chunks = mask.shape[0]
    cb = 8 * c
    bits = n_chunks
    for j in range(n_chunks):
        v = _load_chunk(row, j, c, row_bytes)
        if (v & mask[j]) == bitval[j]:
            bits += cb - _popc(mask[j])
        else:
            bits += cb
    return bits


@nb.njit(parallel=True, cache=True)
def size_rows_cpu(rows, mask, bitval, c: int):
    """int32 [N]: stored bytes of each row (``row_bytes`` when the row is kept raw)."""
    n, row_bytes = rows.shape
    out = np.empty(n, dtype=np.int32)
    for i in nb.prange(n):
        bits = _row_bits(rows[i], mask, bitval, c, row_bytes)
        nbytes = (bits + 7) // 8
        out[i] = nbytes if nbytes < row_bytes else row_bytes
    return out


@nb.njit(inline="always", cache=True)
def _put(buf, pos: int, acc: np.uint64, nacc: int, val: np.uint64, w: int):
    """Append ``w`` (<= 32) bits of ``val`` to the stream; flush whole bytes to ``buf[pos:]``."""
    if w > 0:
        acc |= (val & _lowmask(w)) << np.uint64(nacc)
        nacc += w
        while nacc >= 8:
            buf[pos] = np.uint8(acc & np.uint64(0xFF))
            pos += 1
            acc = acc >> np.uint64(8)
            nacc -= 8
    return pos, acc, nacc


@nb.njit(inline="always", cache=True)
def _put_wide(buf, pos: int, acc: np.uint64, nacc: int, val: np.uint64, w: int):
    """Append up to 64 bits, as at most two 32-bit pieces."""
    if w > 32:
        pos, acc, nacc = _put(buf, pos, acc, nacc, val, 32)
        return _put(buf, pos, acc, nacc, val >> np.uint64(32), w - 32)
    return _put(buf, pos, acc, nacc, val, w)


@nb.njit(cache=True)
def _encode_row(row, mask, bitval, c: int, row_bytes: int, buf, start: int) -> None:
    n_chunks = mask.shape[0]
    cb = 8 * c
    width = _lowmask(cb)
    pos = start
    acc = _U0
    nacc = 0
    for g0 in range(0, n_chunks, GROUP_CHUNKS):
        g1 = min(g0 + GROUP_CHUNKS, n_chunks)
        header = _U0
        for j in range(g0, g1):
            v = _load_chunk(row, j, c, row_bytes)
            if (v & mask[j]) == bitval[j]:
                header |= _U1 << np.uint64(j - g0)
        pos, acc, nacc = _put(buf, pos, acc, nacc, header, g1 - g0)
        for j in range(g0, g1):
            v = _load_chunk(row, j, c, row_bytes)
            if (header >> np.uint64(j - g0)) & _U1:
                keep = (~mask[j]) & width
                pos, acc, nacc = _put_wide(buf, pos, acc, nacc, _pext(v, keep), cb - _popc(mask[j]))
            else:
                pos, acc, nacc = _put_wide(buf, pos, acc, nacc, v, cb)
    if nacc > 0:
        buf[pos] = np.uint8(acc & np.uint64(0xFF))


@nb.njit(parallel=True, cache=True)
def encode_rows_cpu(rows, mask, bitval, c: int, out_buf, out_offsets, lengths) -> None:
    """Write each row's stored bytes (compressed stream, or the raw row) at ``out_buf[out_offsets[i]:]``.

    ``lengths`` must come from :func:`size_rows_cpu` with the same mask; exactly ``lengths[i]`` bytes
    are written per row, so packed rows may sit back to back.
    """
    n, row_bytes = rows.shape
    for i in nb.prange(n):
        off = out_offsets[i]
        ln = lengths[i]
        if ln >= row_bytes:
            for b in range(row_bytes):
                out_buf[off + b] = rows[i, b]
        else:
            for b in range(ln):
                out_buf[off + b] = 0
            _encode_row(rows[i], mask, bitval, c, row_bytes, out_buf, off)


@nb.njit(inline="always", cache=True)
def _read_bits(buf, start: int, bitoff: int, w: int) -> np.uint64:
    """``w`` (0..64) bits of the stream that starts at byte ``start``, from bit ``bitoff`` on."""
    if w == 0:
        return _U0
    r = _U0
    byte = start + (bitoff >> 3)
    sh = bitoff & 7
    got = -sh
    k = 0
    while got < w:
        r |= (np.uint64(buf[byte + k]) << np.uint64(got)) if got >= 0 else (np.uint64(buf[byte + k]) >> np.uint64(-got))
        got += 8
        k += 1
    return r & _lowmask(w)


@nb.njit(inline="always", cache=True)
def _store_chunk(out, row: int, j: int, c: int, row_bytes: int, v: np.uint64) -> None:
    base = j * c
    for b in range(c):
        p = base + b
        if p < row_bytes:
            out[row, p] = np.uint8((v >> np.uint64(8 * b)) & np.uint64(0xFF))


@nb.njit(parallel=True, cache=True, nogil=True)
def decode_rows_cpu(buf, offsets, lengths, compressed, mask, bitval, c: int, out, out_rows) -> None:
    """Decode row m (stored at ``buf[offsets[m]:]``, ``lengths[m]`` bytes) into ``out[out_rows[m]]``.

    Rows whose ``compressed[m]`` is 0 are copied verbatim. ``lengths`` bounds every read, so a corrupt
    length can never read outside ``buf`` (checked by the caller) but yields wrong bytes, as any codec.
    """
    m_rows = offsets.shape[0]
    row_bytes = out.shape[1]
    n_chunks = mask.shape[0]
    cb = 8 * c
    width = _lowmask(cb)
    for m in nb.prange(m_rows):
        start = offsets[m]
        dst = out_rows[m]
        if compressed[m] == 0:
            for b in range(row_bytes):
                out[dst, b] = buf[start + b]
            continue
        bitpos = 0
        limit = lengths[m] * 8
        for g0 in range(0, n_chunks, GROUP_CHUNKS):
            g1 = min(g0 + GROUP_CHUNKS, n_chunks)
            nh = g1 - g0
            header = _read_bits(buf, start, bitpos, nh)
            bitpos += nh
            for j in range(g0, g1):
                if (header >> np.uint64(j - g0)) & _U1:
                    w = cb - _popc(mask[j])
                    if bitpos + w > limit:
                        w = 0  # corrupt stream: never read past the stored length
                    kept = _read_bits(buf, start, bitpos, w)
                    v = _pdep(kept, (~mask[j]) & width) | bitval[j]
                else:
                    w = cb
                    if bitpos + w > limit:
                        w = 0
                    v = _read_bits(buf, start, bitpos, w)
                bitpos += w
                _store_chunk(out, dst, j, c, row_bytes, v)


@nb.njit(parallel=True, cache=True, nogil=True)
def stage_lengths_cpu(ids, hit_pos, hit_len, lengths, row_bytes: int, out_len, out_miss) -> None:
    """Pass 1 of the engine's ``cpu_gather`` transfer: per id, its stored length and whether it is staged.

    ``hit_pos`` (int32 per table row, -1 = not cached; empty = no cache) and ``hit_len`` (per cached row) describe
    the GPU cache; ``lengths`` (int32 per table row; empty = raw rows of ``row_bytes``) the host store.
    """
    cached = hit_pos.shape[0] > 0
    raw = lengths.shape[0] == 0
    for i in nb.prange(ids.shape[0]):
        r = ids[i]
        p = hit_pos[r] if cached else -1
        if p >= 0:
            out_len[i] = hit_len[p]
            out_miss[i] = 0
        else:
            out_len[i] = row_bytes if raw else lengths[r]
            out_miss[i] = 1


@nb.njit(cache=True, nogil=True)
def stage_scan_cpu(out_len, out_miss, starts):
    """Pass 2 (serial): byte offset of each staged row in the staging area; returns (hits, staged bytes, hit
    bytes)."""
    acc = 0
    hits = 0
    hit_bytes = 0
    for i in range(out_len.shape[0]):
        starts[i] = acc
        if out_miss[i]:
            acc += out_len[i]
        else:
            hits += 1
            hit_bytes += out_len[i]
    return hits, acc, hit_bytes


@nb.njit(parallel=True, cache=True, nogil=True)
def stage_rows_cpu(ids, hit_pos, hit_src, offsets, stride: int, data, out_len, out_miss, starts, row_bytes: int,
                   staged_base: int, src_out, len_out, comp_out, staged, copy_bytes: bool) -> None:
    """Pass 3: every id's decode descriptor (absolute device address, stored length, compressed flag) and the
    staged rows' STORED bytes packed into ``staged`` (whose device copy starts at ``staged_base``).

    The rows cross PCIe as stored (compressed), the host decodes nothing; ``offsets`` (int64 per row; empty = row r
    at ``r * stride``) locate a row in ``data``. Rows in parallel over the CPU's threads. ``copy_bytes=False`` writes
    the descriptors only (the caller copies whole raw rows with a faster gather).
    """
    packed = offsets.shape[0] > 0
    for i in nb.prange(ids.shape[0]):
        n = out_len[i]
        len_out[i] = n
        comp_out[i] = 1 if n < row_bytes else 0
        if out_miss[i]:
            r = ids[i]
            s = offsets[r] if packed else r * stride
            d = starts[i]
            if copy_bytes:
                staged[d : d + n] = data[s : s + n]
            src_out[i] = staged_base + d
        else:
            src_out[i] = hit_src[hit_pos[ids[i]]]


@nb.njit(parallel=True)
def bitcount_cpu(rows):
    """int64 [row_bytes * 8]: how many rows have each bit set (bit b = byte b // 8, bit b % 8)."""
    n, row_bytes = rows.shape
    nthreads = nb.get_num_threads()
    partial = np.zeros((nthreads, row_bytes * 8), dtype=np.int64)
    per = (n + nthreads - 1) // nthreads
    for t in nb.prange(nthreads):
        lo = t * per
        hi = min(n, lo + per)
        for i in range(lo, hi):
            for p in range(row_bytes):
                byte = rows[i, p]
                if byte != 0:
                    for b in range(8):
                        if (byte >> b) & 1:
                            partial[t, p * 8 + b] += 1
    return partial.sum(axis=0)


@nb.njit(parallel=True, cache=True)
def fit_sizes_cpu(rows, level, inv, pc, c: int):
    """int64 [K]: total stored bytes of ``rows`` at each of K candidate thresholds, for chunk size ``c``.

    ``level[b]`` (uint8, per bit of the padded row) is how many of the ascending thresholds mask bit b;
    ``inv`` (uint64 per chunk) holds each bit's majority value; ``pc[k, j]`` is how many bits of chunk j
    are masked at threshold k. A chunk matches at threshold k iff every bit where it differs from the
    majority has ``level <= k`` — so one pass evaluates all thresholds at once.
    """
    n, row_bytes = rows.shape
    n_chunks = inv.shape[0]
    k_count = pc.shape[0]
    cb = 8 * c
    per_row = np.zeros((n, k_count), dtype=np.int64)
    for i in nb.prange(n):
        saved = np.zeros(k_count, dtype=np.int64)
        row = rows[i]
        for j in range(n_chunks):
            diff = _load_chunk(row, j, c, row_bytes) ^ inv[j]
            need = 0
            while diff != _U0:
                b = _ctz(diff)
                lv = level[j * cb + b]
                if lv > need:
                    need = lv
                diff &= diff - _U1
            for k in range(need, k_count):
                p = pc[k, j]
                if p == 0:
                    break
                saved[k] += p
        for k in range(k_count):
            bits = n_chunks + n_chunks * cb - saved[k]
            nbytes = (bits + 7) // 8
            per_row[i, k] = nbytes if nbytes < row_bytes else row_bytes
    return per_row.sum(axis=0)
