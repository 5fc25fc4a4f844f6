// IBP (Invariant Bit Packing) kernels: bit counting for the fit, size/encode, and decode.
// Format: docs/FORMAT.md. CPU twins: bitpack_cpu.py (identical bytes).
//
// Conventions
//  * A row is `row_bytes` bytes cut into little-endian chunks of C bytes (C in 1,2,4,8); the last chunk
//    may be partial (missing bytes read as 0, never written).
//  * Chunks go in groups of 32 (one warp iteration): 32 participation bits (fewer in the last group),
//    then each chunk's kept bits, LSB-first bit stream.
//  * mask/bitval: one uint64 per chunk position (low 8*C bits used), in device memory.
//  * Decoders read a row through a per-warp ring buffer in shared memory, filled with 16-byte loads from
//    16-byte aligned addresses (bounded: never past the 16-byte block holding the row's last stored
//    byte), several loads in flight per lane. Sources may be device memory or pinned host memory (UVA).
//  * No kernel traps or asserts: bad ids are reported through an error word.
//  * No shift is ever by >= the operand width.

// NVRTC has no libc headers: no #include here.

typedef unsigned long long u64;
typedef unsigned int u32;

#define IBP_GROUP 32
#define IBP_WARPS_PER_BLOCK 8
#define IBP_RING_BYTES 2048
#define IBP_RING_WORDS (IBP_RING_BYTES / 4)
#define IBP_RING_VEC (IBP_RING_BYTES / 16)
#define IBP_FULL 0xffffffffu

__device__ __forceinline__ u64 ibp_lowmask(int n) {
    return n >= 64 ? ~0ull : ((1ull << n) - 1ull);
}

// Gather the bits of v selected by m into the low bits (in order), run by run.
__device__ __forceinline__ u64 ibp_pext(u64 v, u64 m) {
    u64 r = 0;
    int outpos = 0;
    while (m) {
        int s = __ffsll((long long)m) - 1;
        u64 t = m >> s;
        int len = (t == ~0ull) ? (64 - s) : (__ffsll((long long)~t) - 1);
        u64 lm = ibp_lowmask(len);
        r |= ((v >> s) & lm) << outpos;
        outpos += len;
        m &= ~(lm << s);
    }
    return r;
}

// Scatter the low bits of v to the positions selected by m (inverse of ibp_pext).
__device__ __forceinline__ u64 ibp_pdep(u64 v, u64 m) {
    u64 r = 0;
    int inpos = 0;
    while (m) {
        int s = __ffsll((long long)m) - 1;
        u64 t = m >> s;
        int len = (t == ~0ull) ? (64 - s) : (__ffsll((long long)~t) - 1);
        u64 lm = ibp_lowmask(len);
        r |= ((v >> inpos) & lm) << s;
        inpos += len;
        m &= ~(lm << s);
    }
    return r;
}

template <int C>
__device__ __forceinline__ u64 ibp_load_chunk(const unsigned char* row, int j, int row_bytes) {
    int base = j * C;
    if (base + C <= row_bytes) {
        if (C == 1) return (u64)row[base];
        u64 v = 0;
#pragma unroll
        for (int b = 0; b < C; ++b) v |= (u64)row[base + b] << (8 * b);
        return v;
    }
    u64 v = 0;
#pragma unroll
    for (int b = 0; b < C; ++b)
        if (base + b < row_bytes) v |= (u64)row[base + b] << (8 * b);
    return v;
}

template <int C>
__device__ __forceinline__ void ibp_store_chunk(unsigned char* dst, int j, int row_bytes, u64 v, bool aligned) {
    int base = j * C;
    if (aligned && base + C <= row_bytes) {
        if (C == 1) dst[base] = (unsigned char)v;
        else if (C == 2) *reinterpret_cast<unsigned short*>(dst + base) = (unsigned short)v;
        else if (C == 4) *reinterpret_cast<u32*>(dst + base) = (u32)v;
        else *reinterpret_cast<u64*>(dst + base) = v;
        return;
    }
#pragma unroll
    for (int b = 0; b < C; ++b)
        if (base + b < row_bytes) dst[base + b] = (unsigned char)(v >> (8 * b));
}

__device__ __forceinline__ int ibp_warp_incl_scan(int x, int lane) {
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        int y = __shfl_up_sync(IBP_FULL, x, d);
        if (lane >= d) x += y;
    }
    return x;
}

__device__ __forceinline__ long long ibp_warp_sum_ll(long long x) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(IBP_FULL, x, d);
    return x;
}

__device__ __forceinline__ int ibp_warp_sum(int x) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(IBP_FULL, x, d);
    return x;
}

// Bits this row's compressed stream needs (participation bits included); all lanes get the total.
template <int C>
__device__ long long ibp_row_bits(const unsigned char* row, int row_bytes, int n_chunks,
                                  const u64* __restrict__ mask, const u64* __restrict__ bitval, int lane) {
    long long bits = 0;
    for (int j = lane; j < n_chunks; j += 32) {
        u64 v = ibp_load_chunk<C>(row, j, row_bytes);
        u64 m = mask[j];
        bits += ((v & m) == bitval[j]) ? (8 * C - __popcll(m)) : 8 * C;
    }
    return ibp_warp_sum_ll(bits) + n_chunks;
}

// ------------------------------------------------------------------------------------------------
// Fit: per-bit set counts. Thread = one byte column; rows split over blockIdx.y.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void ibp_bitcount(const unsigned char* __restrict__ rows, long long n_rows, int row_bytes,
                                        u64* __restrict__ counts) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= row_bytes) return;
    u32 c[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (long long i = blockIdx.y; i < n_rows; i += gridDim.y) {
        u32 b = rows[i * (long long)row_bytes + col];
#pragma unroll
        for (int k = 0; k < 8; ++k) c[k] += (b >> k) & 1u;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k)
        if (c[k]) atomicAdd(&counts[col * 8 + k], (u64)c[k]);
}

// Fit: total stored bytes at each of K thresholds (K <= 32) for chunk size C. Warp per row, lane k of
// each warp keeps the running total of threshold k. See fit_sizes_cpu for the math.
template <int C>
__device__ void ibp_fit_sizes_impl(const unsigned char* __restrict__ rows, long long n_rows, int row_bytes,
                                   int n_chunks, const unsigned char* __restrict__ level,
                                   const u64* __restrict__ inv, const int* __restrict__ pc, int K,
                                   u64* __restrict__ totals) {
    int lane = threadIdx.x & 31;
    long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    u64 my_total = 0;  // lane k: total bytes at threshold k
    for (long long i = warp; i < n_rows; i += nwarps) {
        const unsigned char* row = rows + i * (long long)row_bytes;
        int saved[32];
#pragma unroll
        for (int k = 0; k < 32; ++k) saved[k] = 0;
        for (int j = lane; j < n_chunks; j += 32) {
            u64 diff = ibp_load_chunk<C>(row, j, row_bytes) ^ inv[j];
            int need = 0;
            while (diff) {
                int b = __ffsll((long long)diff) - 1;
                int lv = level[j * 8 * C + b];
                need = lv > need ? lv : need;
                diff &= diff - 1;
            }
#pragma unroll
            for (int k = 0; k < 32; ++k)
                if (k < K && k >= need) saved[k] += pc[k * n_chunks + j];
        }
        long long base_bits = (long long)n_chunks * (8 * C + 1);
#pragma unroll
        for (int k = 0; k < 32; ++k) {
            if (k < K) {
                int s = ibp_warp_sum(saved[k]);
                long long nbytes = (base_bits - s + 7) / 8;
                if (lane == k) my_total += (u64)(nbytes < row_bytes ? nbytes : row_bytes);
            }
        }
    }
    if (lane < K && my_total) atomicAdd(&totals[lane], my_total);
}

#define IBP_FOR_EACH_C(X) X(1) X(2) X(4) X(8)

#define IBP_FIT_SIZES(C)                                                                                   \
    extern "C" __global__ void ibp_fit_sizes_c##C(const unsigned char* rows, long long n_rows, int row_bytes, \
                                                  int n_chunks, const unsigned char* level, const u64* inv,  \
                                                  const int* pc, int K, u64* totals) {                       \
        ibp_fit_sizes_impl<C>(rows, n_rows, row_bytes, n_chunks, level, inv, pc, K, totals);               \
    }
IBP_FOR_EACH_C(IBP_FIT_SIZES)

// ------------------------------------------------------------------------------------------------
// Size: stored bytes per row (row_bytes when it would not shrink). Warp per row.
// ------------------------------------------------------------------------------------------------
#define IBP_SIZE(C)                                                                                        \
    extern "C" __global__ void ibp_size_c##C(const unsigned char* rows, long long n_rows, int row_bytes,    \
                                             int n_chunks, const u64* mask, const u64* bitval, int* lengths) { \
        int lane = threadIdx.x & 31;                                                                       \
        long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;                          \
        long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;                                       \
        for (long long i = warp; i < n_rows; i += nwarps) {                                                \
            long long bits = ibp_row_bits<C>(rows + i * (long long)row_bytes, row_bytes, n_chunks, mask,    \
                                             bitval, lane);                                                \
            long long nbytes = (bits + 7) / 8;                                                             \
            if (lane == 0) lengths[i] = (int)(nbytes < row_bytes ? nbytes : row_bytes);                    \
        }                                                                                                  \
    }
IBP_FOR_EACH_C(IBP_SIZE)

// ------------------------------------------------------------------------------------------------
// Encode: each row written to dst_ptrs[i] (device or pinned host through UVA); lengths_out[i] = stored
// bytes. Warp per row; the bit stream is assembled one group at a time in a per-warp shared-memory
// word buffer (shared atomicOr), and finished words are flushed as bytes.
// ------------------------------------------------------------------------------------------------
#define IBP_ENC_WORDS 72  // one group: <= 32 + 32*64 bits = 65 words, plus the carried partial word

// Encode one row with the calling warp: the stored length (all lanes get it). Rows that would not shrink
// are copied raw (length == row_bytes). `buf` is this warp's IBP_ENC_WORDS words of shared memory.
template <int C>
__device__ int ibp_encode_row(const unsigned char* __restrict__ row, unsigned char* __restrict__ dst, int row_bytes,
                              int n_chunks, const u64* __restrict__ mask, const u64* __restrict__ bitval, u32* buf,
                              int lane) {
    const u64 width = ibp_lowmask(8 * C);
    long long bits = ibp_row_bits<C>(row, row_bytes, n_chunks, mask, bitval, lane);
    long long nbytes = (bits + 7) / 8;
    if (nbytes >= row_bytes) {
        for (int b = lane; b < row_bytes; b += 32) dst[b] = row[b];
        __syncwarp();
        return row_bytes;
    }
    int L = (int)nbytes;
    for (int w = lane; w < IBP_ENC_WORDS; w += 32) buf[w] = 0;
    __syncwarp();
    long long bitpos = 0;    // bits of the stream written so far
    long long flushed = 0;   // words already written to dst
    for (int g0 = 0; g0 < n_chunks; g0 += IBP_GROUP) {
        int j = g0 + lane;
        int nh = min(IBP_GROUP, n_chunks - g0);
        bool valid = j < n_chunks;
        u64 v = 0, m = 0;
        bool p = false;
        if (valid) {
            v = ibp_load_chunk<C>(row, j, row_bytes);
            m = mask[j];
            p = (v & m) == bitval[j];
        }
        u32 header = __ballot_sync(IBP_FULL, p);
        int w = valid ? (p ? 8 * C - __popcll(m) : 8 * C) : 0;
        u64 val = p ? ibp_pext(v, (~m) & width) : v;
        int incl = ibp_warp_incl_scan(w, lane);
        int total = __shfl_sync(IBP_FULL, incl, 31);
        long long base_word = bitpos >> 5;  // == flushed: buf[0] is word `flushed`
        // header bits at bitpos
        if (lane == 0) {
            int off = (int)(bitpos - base_word * 32);
            u64 h = (u64)header & ibp_lowmask(nh);
            atomicOr(&buf[off >> 5], (u32)(h << (off & 31)));
            if ((off & 31) + nh > 32) atomicOr(&buf[(off >> 5) + 1], (u32)(h >> (32 - (off & 31))));
        }
        if (w > 0) {
            int off = (int)(bitpos + nh + (incl - w) - base_word * 32);
            int wi = off >> 5, s = off & 31;
            val &= ibp_lowmask(w);
            atomicOr(&buf[wi], (u32)(val << s));
            if (s + w > 32) atomicOr(&buf[wi + 1], (u32)(val >> (32 - s)));
            if (s + w > 64) atomicOr(&buf[wi + 2], (u32)(val >> (64 - s)));
        }
        __syncwarp();
        long long new_bitpos = bitpos + nh + total;
        int done_words = (int)((new_bitpos >> 5) - base_word);
        // flush finished words as bytes
        for (int b = lane; b < done_words * 4; b += 32) {
            dst[(flushed + (b >> 2)) * 4 + (b & 3)] = (unsigned char)(buf[b >> 2] >> (8 * (b & 3)));
        }
        __syncwarp();
        u32 carry = buf[done_words];
        __syncwarp();
        for (int ww = lane; ww < IBP_ENC_WORDS; ww += 32) buf[ww] = (ww == 0) ? carry : 0u;
        __syncwarp();
        flushed += done_words;
        bitpos = new_bitpos;
    }
    // tail: bytes of the last partial word up to L
    long long first = flushed * 4;
    for (long long b = first + lane; b < L; b += 32) dst[b] = (unsigned char)(buf[0] >> (8 * (int)(b - first)));
    __syncwarp();
    return L;
}

template <int C>
__device__ void ibp_encode_impl(const unsigned char* __restrict__ rows, long long n_rows, int row_bytes,
                                int n_chunks, const u64* __restrict__ mask, const u64* __restrict__ bitval,
                                const long long* __restrict__ dst_ptrs, int* __restrict__ lengths_out) {
    __shared__ u32 sbuf[IBP_WARPS_PER_BLOCK][IBP_ENC_WORDS];
    int lane = threadIdx.x & 31;
    u32* buf = sbuf[threadIdx.x >> 5];
    long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long i = warp; i < n_rows; i += nwarps) {
        unsigned char* dst = reinterpret_cast<unsigned char*>(dst_ptrs[i]);
        int L = ibp_encode_row<C>(rows + i * (long long)row_bytes, dst, row_bytes, n_chunks, mask, bitval, buf, lane);
        if (lane == 0) lengths_out[i] = L;
    }
}

#define IBP_ENCODE(C)                                                                                      \
    extern "C" __global__ void ibp_encode_c##C(const unsigned char* rows, long long n_rows, int row_bytes,  \
                                               int n_chunks, const u64* mask, const u64* bitval,          \
                                               const long long* dst_ptrs, int* lengths_out) {             \
        ibp_encode_impl<C>(rows, n_rows, row_bytes, n_chunks, mask, bitval, dst_ptrs, lengths_out);       \
    }
IBP_FOR_EACH_C(IBP_ENCODE)

// ------------------------------------------------------------------------------------------------
// Decode one row with a warp: stage the stored bytes through a ring buffer in shared memory
// (aligned, bounded 16-byte loads, up to 4 per lane in flight), then each lane rebuilds one chunk per
// group: participation bit from the group header, bit offset by warp prefix scan, kept bits re-spread
// over the non-invariant positions (pdep) and OR-ed with bitval.
// ------------------------------------------------------------------------------------------------
struct IbpRing {
    const unsigned char* abase;  // src rounded down to 16 bytes
    int skew;                    // src - abase
    int aend;                    // bytes to load, rounded up to 16, counted from abase
    int loaded;                  // bytes loaded so far (multiple of 16)
};

__device__ __forceinline__ void ibp_ring_fill(IbpRing& r, uint4* ring, int upto, int lane) {
    // load [r.loaded, upto) (both multiples of 16, upto - r.loaded <= 16 * 128)
    int n16 = (upto - r.loaded) >> 4;
    const uint4* src = reinterpret_cast<const uint4*>(r.abase + r.loaded);
    uint4 tmp[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        int k = lane + 32 * t;
        if (k < n16) tmp[t] = src[k];
    }
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        int k = lane + 32 * t;
        if (k < n16) ring[((r.loaded >> 4) + k) & (IBP_RING_VEC - 1)] = tmp[t];
    }
    r.loaded = upto;
    __syncwarp();
}

// Make sure bytes [.., need) of the row (counted from abase) are in the ring, reading ahead as far as the
// ring allows without overwriting bytes at or after `keep` (the oldest byte still needed).
__device__ __forceinline__ void ibp_ring_ensure(IbpRing& r, uint4* ring, int keep, int need, int lane) {
    if (need > r.aend) need = r.aend;
    while (r.loaded < need) {
        int limit = (keep & ~15) + IBP_RING_BYTES;
        int upto = r.loaded + 16 * 128;
        if (upto > limit) upto = limit;
        if (upto > r.aend) upto = r.aend;
        ibp_ring_fill(r, ring, upto, lane);
    }
}

// w (0..64) bits starting at stream bit `bit` (counted from abase, i.e. skew*8 included).
__device__ __forceinline__ u64 ibp_ring_bits(const u32* ring32, long long bit, int w) {
    if (w == 0) return 0;
    long long wi = bit >> 5;
    int s = (int)(bit & 31);
    u64 w0 = ring32[wi & (IBP_RING_WORDS - 1)];
    u64 w1 = ring32[(wi + 1) & (IBP_RING_WORDS - 1)];
    u64 lo = w0 | (w1 << 32);
    u64 v = lo >> s;
    if (s + w > 64) {
        u64 w2 = ring32[(wi + 2) & (IBP_RING_WORDS - 1)];
        v |= w2 << (64 - s);
    }
    return v & ibp_lowmask(w);
}

// A raw row whose source, destination and length are 16-byte multiples: a warp copy of 16-byte words, up to
// IBP_COPY_UNROLL per lane loaded before any is stored (a 2 KB row in one round trip). Why: a raw row is a copy, and
// the ring decoder below spends a shared-memory pass and a warp scan per 32 chunks on it; cache hits of raw rows
// (and zero-copy reads of the inplace host store) are latency-bound, so the fewer dependent steps, the faster.
// IBP_RAW_COPY=0 (a variant for timing, default 1) sends raw rows through the ring decoder too.
#define IBP_COPY_UNROLL 4
#ifndef IBP_RAW_COPY
#define IBP_RAW_COPY 1
#endif
__device__ __forceinline__ bool ibp_copy_aligned(const unsigned char* src, const unsigned char* dst, int row_bytes) {
    return ((reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst) |
             (unsigned long long)row_bytes) & 15ull) == 0ull;
}

__device__ __forceinline__ void ibp_copy_row16(const unsigned char* src, unsigned char* dst, int row_bytes, int lane) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    const int n16 = row_bytes >> 4;
    for (int k0 = 0; k0 < n16; k0 += 32 * IBP_COPY_UNROLL) {
        uint4 t[IBP_COPY_UNROLL];
#pragma unroll
        for (int u = 0; u < IBP_COPY_UNROLL; ++u) {
            const int k = k0 + lane + 32 * u;
            if (k < n16) t[u] = s[k];
        }
#pragma unroll
        for (int u = 0; u < IBP_COPY_UNROLL; ++u) {
            const int k = k0 + lane + 32 * u;
            if (k < n16) d[k] = t[u];
        }
    }
}

template <int C>
__device__ void ibp_decode_row(const unsigned char* src, int L, bool compressed, unsigned char* dst, int row_bytes,
                               int n_chunks, const u64* __restrict__ mask, const u64* __restrict__ bitval,
                               uint4* ring, int lane) {
    if (IBP_RAW_COPY && !compressed && ibp_copy_aligned(src, dst, row_bytes)) {  // uniform: the warp's one row
        ibp_copy_row16(src, dst, row_bytes, lane);
        __syncwarp();  // as the ring path ends: the row is written before the warp moves on
        return;
    }
    IbpRing r;
    r.abase = reinterpret_cast<const unsigned char*>(reinterpret_cast<unsigned long long>(src) & ~(unsigned long long)15);
    r.skew = (int)(src - r.abase);
    r.aend = (r.skew + L + 15) & ~15;
    r.loaded = 0;
    const u32* ring32 = reinterpret_cast<const u32*>(ring);
    const u64 width = ibp_lowmask(8 * C);
    bool aligned = (reinterpret_cast<unsigned long long>(dst) % C) == 0;
    long long bit = (long long)r.skew * 8;  // stream position, counted from abase
    const int group_max_bytes = 4 + 32 * C + 16;
    for (int g0 = 0; g0 < n_chunks; g0 += IBP_GROUP) {
        int keep = (int)(bit >> 3);
        ibp_ring_ensure(r, ring, keep, keep + group_max_bytes + 8, lane);
        int j = g0 + lane;
        int nh = min(IBP_GROUP, n_chunks - g0);
        bool valid = j < n_chunks;
        u64 m = (valid && compressed) ? mask[j] : 0;  // raw rows may pass mask == nullptr
        bool p = false;
        if (compressed) {
            u32 header = (u32)ibp_ring_bits(ring32, bit, nh);
            p = valid && ((header >> lane) & 1u);
            bit += nh;
        }
        int w = valid ? (p ? 8 * C - __popcll(m) : 8 * C) : 0;
        int incl = ibp_warp_incl_scan(w, lane);
        int total = __shfl_sync(IBP_FULL, incl, 31);
        if (valid) {
            u64 v = ibp_ring_bits(ring32, bit + (incl - w), w);
            if (p) v = ibp_pdep(v, (~m) & width) | bitval[j];
            ibp_store_chunk<C>(dst, j, row_bytes, v, aligned);
        }
        bit += total;
        __syncwarp();
    }
}

// Chunk size chosen at run time (uniform across the warp): kernels that serve two codecs in one launch.
__device__ __forceinline__ int ibp_encode_row_any(int C, const unsigned char* row, unsigned char* dst, int row_bytes,
                                                  int n_chunks, const u64* mask, const u64* bitval, u32* buf,
                                                  int lane) {
    switch (C) {
        case 1: return ibp_encode_row<1>(row, dst, row_bytes, n_chunks, mask, bitval, buf, lane);
        case 2: return ibp_encode_row<2>(row, dst, row_bytes, n_chunks, mask, bitval, buf, lane);
        case 4: return ibp_encode_row<4>(row, dst, row_bytes, n_chunks, mask, bitval, buf, lane);
        default: return ibp_encode_row<8>(row, dst, row_bytes, n_chunks, mask, bitval, buf, lane);
    }
}

__device__ __forceinline__ void ibp_decode_row_any(int C, const unsigned char* src, int L, bool compressed,
                                                   unsigned char* dst, int row_bytes, int n_chunks, const u64* mask,
                                                   const u64* bitval, uint4* ring, int lane) {
    switch (C) {
        case 1: ibp_decode_row<1>(src, L, compressed, dst, row_bytes, n_chunks, mask, bitval, ring, lane); break;
        case 2: ibp_decode_row<2>(src, L, compressed, dst, row_bytes, n_chunks, mask, bitval, ring, lane); break;
        case 4: ibp_decode_row<4>(src, L, compressed, dst, row_bytes, n_chunks, mask, bitval, ring, lane); break;
        default: ibp_decode_row<8>(src, L, compressed, dst, row_bytes, n_chunks, mask, bitval, ring, lane); break;
    }
}

// Decode M rows given descriptors: absolute source address, stored length, compressed flag, and the
// output row (out_rows may be null: row m goes to out[m]). Slab hits and host misses share one launch.
template <int C>
__device__ void ibp_decode_desc_impl(const long long* __restrict__ src_ptrs, const int* __restrict__ lengths,
                                     const unsigned char* __restrict__ compressed,
                                     const long long* __restrict__ out_rows, unsigned char* __restrict__ out,
                                     long long n, int row_bytes, int n_chunks, const u64* __restrict__ mask,
                                     const u64* __restrict__ bitval) {
    __shared__ uint4 sring[IBP_WARPS_PER_BLOCK][IBP_RING_VEC];
    int lane = threadIdx.x & 31;
    uint4* ring = sring[threadIdx.x >> 5];
    long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long i = warp; i < n; i += nwarps) {
        long long orow = out_rows ? out_rows[i] : i;
        const unsigned char* src = reinterpret_cast<const unsigned char*>(src_ptrs[i]);
        int L = lengths[i];
        bool comp = compressed[i] != 0;
        if (!comp) L = row_bytes;
        ibp_decode_row<C>(src, L, comp, out + orow * (long long)row_bytes, row_bytes, n_chunks, mask, bitval, ring,
                          lane);
    }
}

#define IBP_DECODE_DESC(C)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * IBP_WARPS_PER_BLOCK)                                  \
        ibp_decode_desc_c##C(const long long* src_ptrs, const int* lengths, const unsigned char* compressed, \
                             const long long* out_rows, unsigned char* out, long long n, int row_bytes,     \
                             int n_chunks, const u64* mask, const u64* bitval) {                            \
        ibp_decode_desc_impl<C>(src_ptrs, lengths, compressed, out_rows, out, n, row_bytes, n_chunks, mask,  \
                                bitval);                                                                    \
    }
IBP_FOR_EACH_C(IBP_DECODE_DESC)

// Fused gather + decode: out[i] = row ids[i] of a CompressedRows store (in place: offset id*row_bytes;
// packed: offsets[id]); flags is the 1-bit-per-row "is compressed" bitmask. Ids out of [0, n_rows)
// set *err = 1 and write nothing for that row (the launcher has already range-checked them).
template <int C>
__device__ void ibp_gather_impl(const long long* __restrict__ ids, long long n, const unsigned char* base,
                                const long long* __restrict__ offsets, const int* __restrict__ lengths,
                                const unsigned char* __restrict__ flags, long long n_rows,
                                unsigned char* __restrict__ out, int row_bytes, int n_chunks,
                                const u64* __restrict__ mask, const u64* __restrict__ bitval, int* err) {
    __shared__ uint4 sring[IBP_WARPS_PER_BLOCK][IBP_RING_VEC];
    int lane = threadIdx.x & 31;
    uint4* ring = sring[threadIdx.x >> 5];
    long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long i = warp; i < n; i += nwarps) {
        long long id = ids[i];
        if (id < 0 || id >= n_rows) {
            if (lane == 0) atomicExch(err, 1);
            continue;
        }
        long long off = offsets ? offsets[id] : id * (long long)row_bytes;
        bool comp = (flags[id >> 3] >> (id & 7)) & 1;
        int L = comp ? lengths[id] : row_bytes;
        ibp_decode_row<C>(base + off, L, comp, out + i * (long long)row_bytes, row_bytes, n_chunks, mask, bitval,
                          ring, lane);
    }
}

#define IBP_GATHER(C)                                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * IBP_WARPS_PER_BLOCK)                                  \
        ibp_gather_c##C(const long long* ids, long long n, const unsigned char* base, const long long* offsets, \
                        const int* lengths, const unsigned char* flags, long long n_rows, unsigned char* out, \
                        int row_bytes, int n_chunks, const u64* mask, const u64* bitval, int* err) {       \
        ibp_gather_impl<C>(ids, n, base, offsets, lengths, flags, n_rows, out, row_bytes, n_chunks, mask,    \
                           bitval, err);                                                                    \
    }
IBP_FOR_EACH_C(IBP_GATHER)

// Plain zero-copy gather of raw rows (no compression): the "(a)" baseline and raw host stores.
// Warp per row, 16-byte aligned bounded loads through the same ring.
extern "C" __global__ void __launch_bounds__(32 * IBP_WARPS_PER_BLOCK)
    ibp_gather_raw(const long long* ids, long long n, const unsigned char* base, long long n_rows,
                   unsigned char* out, int row_bytes, int* err) {
    __shared__ uint4 sring[IBP_WARPS_PER_BLOCK][IBP_RING_VEC];
    int lane = threadIdx.x & 31;
    uint4* ring = sring[threadIdx.x >> 5];
    long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long i = warp; i < n; i += nwarps) {
        long long id = ids[i];
        if (id < 0 || id >= n_rows) {
            if (lane == 0) atomicExch(err, 1);
            continue;
        }
        // raw rows decode as C=4 chunks that never participate
        ibp_decode_row<4>(base + id * (long long)row_bytes, row_bytes, false, out + i * (long long)row_bytes,
                          row_bytes, (row_bytes + 3) / 4, nullptr, nullptr, ring, lane);
    }
}
