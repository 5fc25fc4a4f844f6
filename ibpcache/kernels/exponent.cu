// Exponent coding of bf16/fp16 rows (ibpcache/exponent.py holds the format and the CPU reference; the bytes
// these kernels write and read are the same). One thread per row: a row is one stream of raw (sign + mantissa)
// fields followed by canonical Huffman codewords of the exponents, LSB-first within bytes, codeword bits most
// significant first. A row that would not shrink is stored raw (length == row_bytes).
//
// Decode peeks `max_bits` stream bits through a 64-bit window and looks the symbol and its length up in a
// table of 2^max_bits entries ((symbol << 8) | length), built on the host from the code lengths.

typedef long long i64;
typedef unsigned long long u64;

// The 64 stream bits from bit `pos` of the row at `row` (bytes past `nbytes` read as zero).
__device__ __forceinline__ u64 ibp_exp_window(const unsigned char* __restrict__ row, i64 nbytes, i64 pos) {
  const i64 first = pos >> 3;
  u64 w = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const i64 b = first + k;
    if (b < nbytes) w |= (u64)row[b] << (8 * k);
  }
  return w >> (pos & 7);  // >= 57 valid bits: enough for a raw field (<= 11) or a codeword (<= 15)
}

// Decode one row (d elements) into out (uint16 [d]); returns false if the stream runs past the row.
__device__ __forceinline__ bool ibp_exp_decode_row(const unsigned char* __restrict__ row, int len, int d,
                                                   int eshift, int raw_bits, int row_bytes,
                                                   const int* __restrict__ lut, int max_bits,
                                                   unsigned short* __restrict__ out) {
  if (len == row_bytes) {
    for (int j = 0; j < d; ++j) out[j] = (unsigned short)(row[2 * j] | (row[2 * j + 1] << 8));
    return true;
  }
  const unsigned mant_mask = (1u << eshift) - 1u;
  const u64 raw_mask = (1ull << raw_bits) - 1ull;
  i64 pos = 0;
  for (int j = 0; j < d; ++j, pos += raw_bits) {
    const unsigned raw = (unsigned)(ibp_exp_window(row, len, pos) & raw_mask);
    out[j] = (unsigned short)(((raw >> eshift) << 15) | (raw & mant_mask));
  }
  for (int j = 0; j < d; ++j) {
    const u64 w = ibp_exp_window(row, len, pos);
    const unsigned peek = (unsigned)(__brevll(w) >> (64 - max_bits));  // next max_bits bits, MSB first
    const int e = lut[peek];
    pos += e & 0xFF;
    if (pos > (i64)len * 8) return false;
    out[j] = (unsigned short)(out[j] | ((unsigned)(e >> 8) << eshift));
  }
  return true;
}

// The 64 stream bits from bit `pos` of a 4-byte aligned row whose memory can be read (any content) up to word
// (pos >> 5) + 2: three word loads instead of ibp_exp_window's eight byte loads with bounds checks.
__device__ __forceinline__ u64 ibp_exp_window_words(const unsigned int* __restrict__ w, i64 pos) {
  const int i = (int)(pos >> 5), sh = (int)(pos & 31);
  const u64 lo = (u64)w[i] | ((u64)w[i + 1] << 32);
  return sh ? (lo >> sh) | ((u64)w[i + 2] << (64 - sh)) : lo;
}

// Element j of a compressed row: its raw field at bit rpos, its exponent codeword at bit cpos (both advanced).
// False when the codeword stream runs past `lim` bits (a corrupt row; the cursor then stops there).
__device__ __forceinline__ bool ibp_exp_next(const unsigned int* __restrict__ w, i64& rpos, i64& cpos, i64 lim,
                                             int eshift, unsigned mant_mask, unsigned raw_mask, int raw_bits,
                                             const int* __restrict__ lut, int max_bits, unsigned& v) {
  const unsigned raw = (unsigned)ibp_exp_window_words(w, rpos) & raw_mask;
  rpos += raw_bits;
  const unsigned peek = (unsigned)(__brevll(ibp_exp_window_words(w, cpos)) >> (64 - max_bits));
  const int e = __ldg(lut + peek);
  cpos += e & 0xFF;
  v = ((raw >> eshift) << 15) | (raw & mant_mask) | ((unsigned)(e >> 8) << eshift);
  return cpos <= lim;
}

// ibp_exp_decode_row for a row staged in shared memory (4-byte aligned, readable up to 12 bytes past its stored
// length): one pass that takes element j's raw field and codeword together, and, when `out` is 16-byte aligned and
// d a multiple of 8, stores 8 elements per 16-byte store. Why: the two-pass version ORs every exponent into `out`
// with a 2-byte load and store per element; with a lane per row those are 32 scattered sectors per warp access,
// and a fetch of every token was bound by them. Same bytes out for every row that decodes; false where
// ibp_exp_decode_row returns false.
__device__ __forceinline__ bool ibp_exp_decode_row_words(const unsigned char* __restrict__ row, int len, int d,
                                                         int eshift, int raw_bits, int row_bytes,
                                                         const int* __restrict__ lut, int max_bits,
                                                         unsigned short* __restrict__ out) {
  const unsigned int* w = reinterpret_cast<const unsigned int*>(row);
  const bool vec = ((reinterpret_cast<unsigned long long>(out) & 15) == 0) && (d & 7) == 0;
  if (len == row_bytes) {  // stored raw: little-endian elements
    if (vec) {
      for (int q = 0; q < d / 8; ++q)
        reinterpret_cast<uint4*>(out)[q] = make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
    } else {
      for (int j = 0; j < d; ++j) out[j] = (unsigned short)(row[2 * j] | (row[2 * j + 1] << 8));
    }
    return true;
  }
  const unsigned mant_mask = (1u << eshift) - 1u, raw_mask = (1u << raw_bits) - 1u;
  const i64 lim = (i64)len * 8;
  i64 rpos = 0, cpos = (i64)d * raw_bits;
  if (cpos > lim) return false;
  if (vec) {
    for (int g = 0; g < d; g += 8) {
      unsigned v[8];
#pragma unroll
      for (int t = 0; t < 8; ++t)
        if (!ibp_exp_next(w, rpos, cpos, lim, eshift, mant_mask, raw_mask, raw_bits, lut, max_bits, v[t]))
          return false;
      reinterpret_cast<uint4*>(out)[g >> 3] =
          make_uint4(v[0] | (v[1] << 16), v[2] | (v[3] << 16), v[4] | (v[5] << 16), v[6] | (v[7] << 16));
    }
  } else {
    for (int j = 0; j < d; ++j) {
      unsigned v;
      if (!ibp_exp_next(w, rpos, cpos, lim, eshift, mant_mask, raw_mask, raw_bits, lut, max_bits, v)) return false;
      out[j] = (unsigned short)v;
    }
  }
  return true;
}

#define IBP_EXP_WARPS 4        // warps per block of the staged decode
#define IBP_EXP_MAX_ROW 256    // rows up to this many bytes are staged in shared memory (head_dim <= 128)
#define IBP_EXP_STRIDE (IBP_EXP_MAX_ROW + 8)
// uint4 words of one warp's stage: 32 rows, +1 because ibp_exp_decode_row_words may read 12 bytes past a row
#define IBP_EXP_STAGE_VEC ((32 * IBP_EXP_STRIDE + 15) / 16 + 1)

#define IBP_STAGE_BATCH 8  // rows whose loads ibp_stage_rows issues before any of their stores
#define IBP_STAGE_WORDS ((IBP_EXP_MAX_ROW + 6 + 127) / 128)  // 4-byte loads per lane per row (<= 3 + n + 3 bytes)

// The warp stages 32 stored rows into shared memory: lane r's row (n bytes at src, any alignment, n <=
// IBP_EXP_MAX_ROW; n = 0 for none) goes to dst + r * stride (4-byte aligned), as whole 4-byte words (the bytes
// past n up to the word end get any content). Every row is read with the warp's 4-byte loads of the aligned words
// that overlap it (never more: such a word lies in the page, and the allocation granule, of a byte of the row) and
// realigned in registers (funnel shift with the next lane's word). Why: a zero-copy read over PCIe costs a round
// trip of about a microsecond; 128 bytes per warp load instead of 32, and the loads of IBP_STAGE_BATCH rows all
// issued before their stores (a generic store may alias the next load, so a row-by-row loop waits a round trip per
// load), make 32 rows of ~180 bytes cost 4 round trips instead of 64 (or 192 with byte loads). Shared with
// kv_packed.cu.
__device__ __forceinline__ void ibp_stage_rows(const unsigned char* src, int n, unsigned char* dst, int stride,
                                               int lane) {
#pragma unroll 1
  for (int r0 = 0; r0 < 32; r0 += IBP_STAGE_BATCH) {
    unsigned int v[IBP_STAGE_BATCH][IBP_STAGE_WORDS];
    int shift[IBP_STAGE_BATCH], out_words[IBP_STAGE_BATCH];
#pragma unroll
    for (int u = 0; u < IBP_STAGE_BATCH; ++u) {
      const int nr = __shfl_sync(0xffffffffu, n, r0 + u);
      const unsigned long long sp =
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(src), r0 + u);
      const int a = (int)(sp & 3);
      const unsigned int* words = reinterpret_cast<const unsigned int*>(sp - a);
      const int nw = nr > 0 ? (a + nr + 3) >> 2 : 0;
#pragma unroll
      for (int k = 0; k < IBP_STAGE_WORDS; ++k) {
        const int w = lane + 32 * k;
        v[u][k] = w < nw ? words[w] : 0u;
      }
      shift[u] = 8 * a;
      out_words[u] = nr > 0 ? (nr + 3) >> 2 : 0;
    }
#pragma unroll
    for (int u = 0; u < IBP_STAGE_BATCH; ++u) {
      unsigned int* d = reinterpret_cast<unsigned int*>(dst + (r0 + u) * stride);
#pragma unroll
      for (int k = 0; k < IBP_STAGE_WORDS; ++k) {
        const unsigned int next_lane = __shfl_down_sync(0xffffffffu, v[u][k], 1);
        const unsigned int wrap = __shfl_sync(0xffffffffu, k + 1 < IBP_STAGE_WORDS ? v[u][k + 1] : 0u, 0);
        const unsigned int hi = lane == 31 ? wrap : next_lane;
        const int j = lane + 32 * k;
        if (j < out_words[u]) d[j] = __funnelshift_r(v[u][k], hi, shift[u]);
      }
    }
  }
}

// Staged decode (rows <= IBP_EXP_MAX_ROW bytes): a warp takes 32 rows, copies their stored bytes into shared
// memory with coalesced, batched 4-byte loads (ibp_stage_rows: what a zero-copy read over PCIe needs), then every lane
// decodes one row from there in one pass (ibp_exp_decode_row_words). Reading each row's bits straight from host
// memory, thread by thread, would cost hundreds of tiny PCIe reads per row. The KV fetch (kv_packed.cu) decodes
// the same way.
extern "C" __global__ void __launch_bounds__(32 * IBP_EXP_WARPS)
ibp_exp_decode_staged(const unsigned char* __restrict__ base, const i64* __restrict__ offsets,
                      const int* __restrict__ lengths, i64 n, int d, int eshift, int raw_bits, int row_bytes,
                      const int* __restrict__ lut, int max_bits, unsigned short* __restrict__ out,
                      i64* __restrict__ err) {
  __shared__ uint4 stage[IBP_EXP_WARPS][IBP_EXP_STAGE_VEC];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  unsigned char* mine = reinterpret_cast<unsigned char*>(stage[warp]);
  const i64 step = (i64)gridDim.x * IBP_EXP_WARPS * 32;
  for (i64 first = ((i64)blockIdx.x * IBP_EXP_WARPS + warp) * 32; first < n; first += step) {
    const i64 i = first + lane;
    const int len = i < n ? lengths[i] : 0;
    const int copy = len < 0 ? 0 : (len < IBP_EXP_MAX_ROW ? len : IBP_EXP_MAX_ROW);
    ibp_stage_rows(i < n ? base + offsets[i] : base, copy, mine, IBP_EXP_STRIDE, lane);
    __syncwarp();
    if (i < n) {
      if (len > row_bytes || !ibp_exp_decode_row_words(mine + lane * IBP_EXP_STRIDE, len, d, eshift, raw_bits,
                                                       row_bytes, lut, max_bits, out + i * d)) {
        atomicCAS(reinterpret_cast<unsigned long long*>(err), 0ull, (unsigned long long)(i + 1));
      }
    }
    __syncwarp();
  }
}

// rows i in [0, n): out[i] = decode(base + offsets[i], lengths[i]); a row that overruns sets *err to 1 + i.
// Any row size; reads the stored bytes thread by thread (device-resident data, or rows > IBP_EXP_MAX_ROW).
extern "C" __global__ void ibp_exp_decode(const unsigned char* __restrict__ base, const i64* __restrict__ offsets,
                                          const int* __restrict__ lengths, i64 n, int d, int eshift, int raw_bits,
                                          int row_bytes, const int* __restrict__ lut, int max_bits,
                                          unsigned short* __restrict__ out, i64* __restrict__ err) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    if (!ibp_exp_decode_row(base + offsets[i], lengths[i], d, eshift, raw_bits, row_bytes, lut, max_bits,
                            out + i * d)) {
      atomicCAS(reinterpret_cast<unsigned long long*>(err), 0ull, (unsigned long long)(i + 1));
    }
  }
}

// Stored bytes of one row of d elements (row_bytes when it would not shrink). Shared with kv_packed.cu.
__device__ __forceinline__ int ibp_exp_row_bytes(const unsigned short* __restrict__ src, int d, int eshift,
                                                 int emask, int raw_bits, int row_bytes,
                                                 const unsigned char* __restrict__ code_len) {
  i64 bits = (i64)d * raw_bits;
  for (int j = 0; j < d; ++j) bits += code_len[(src[j] >> eshift) & emask];
  const i64 bytes = (bits + 7) >> 3;
  return bytes >= row_bytes ? row_bytes : (int)bytes;
}

// Stored length of every row (bytes; row_bytes when it would not shrink).
extern "C" __global__ void ibp_exp_sizes(const unsigned short* __restrict__ x, i64 n, int d, int eshift, int emask,
                                         int raw_bits, int row_bytes, const unsigned char* __restrict__ code_len,
                                         int* __restrict__ lengths) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    lengths[i] = ibp_exp_row_bytes(x + i * d, d, eshift, emask, raw_bits, row_bytes, code_len);
  }
}

// Append `nbits` (<= 32) of `value`, least significant first, to the bit accumulator; flush whole bytes.
__device__ __forceinline__ void ibp_exp_put(unsigned char* __restrict__ dst, i64& byte, u64& acc, int& fill,
                                            u64 value, int nbits) {
  acc |= value << fill;
  fill += nbits;
  while (fill >= 8) {
    dst[byte++] = (unsigned char)(acc & 0xFF);
    acc >>= 8;
    fill -= 8;
  }
}

// Encode one row (d elements at src) into exactly `len` bytes at row (len from ibp_exp_row_bytes; len ==
// row_bytes: stored raw, little-endian elements). Writes bytes in order, never reads row. Shared with kv_packed.cu.
__device__ __forceinline__ void ibp_exp_encode_row(const unsigned short* __restrict__ src, int d, int eshift,
                                                   int emask, int raw_bits, int row_bytes, int len,
                                                   const unsigned char* __restrict__ code_len,
                                                   const unsigned int* __restrict__ code_rev,
                                                   unsigned char* __restrict__ row) {
  if (len == row_bytes) {
    for (int j = 0; j < d; ++j) {
      row[2 * j] = (unsigned char)(src[j] & 0xFF);
      row[2 * j + 1] = (unsigned char)(src[j] >> 8);
    }
    return;
  }
  const unsigned mant_mask = (1u << eshift) - 1u;
  i64 byte = 0;
  u64 acc = 0;
  int fill = 0;
  for (int j = 0; j < d; ++j) {
    const unsigned v = src[j];
    ibp_exp_put(row, byte, acc, fill, ((v >> 15) << eshift) | (v & mant_mask), raw_bits);
  }
  for (int j = 0; j < d; ++j) {
    const unsigned e = (src[j] >> eshift) & (unsigned)emask;
    ibp_exp_put(row, byte, acc, fill, code_rev[e], code_len[e]);  // codeword bit-reversed: MSB goes first
  }
  if (fill > 0) row[byte++] = (unsigned char)(acc & 0xFF);
}

// Encode row i of x (uint16 [n, d]) at dst + offsets[i]; lengths from ibp_exp_sizes.
extern "C" __global__ void ibp_exp_encode(const unsigned short* __restrict__ x, i64 n, int d, int eshift, int emask,
                                          int raw_bits, int row_bytes, const unsigned char* __restrict__ code_len,
                                          const unsigned int* __restrict__ code_rev,
                                          const i64* __restrict__ offsets, const int* __restrict__ lengths,
                                          unsigned char* __restrict__ dst) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    ibp_exp_encode_row(x + i * d, d, eshift, emask, raw_bits, row_bytes, lengths[i], code_len, code_rev,
                       dst + offsets[i]);
  }
}
