// Exponent coding of float rows (float32, bfloat16, float16). Format: docs/FORMAT.md ("Exponent-coded rows");
// codec: ibpcache/exponent.py; CPU twins: exponent_cpu.py (identical bytes). Self-contained: no other .cu needed.
//
// A row of d elements (T = unsigned short for 16-bit floats, unsigned int for float32) is one bit stream, least
// significant bit of each byte first:
//   [n_seg - 1 header fields of hdr_field bits: where segment s >= 1's first codeword starts, in bits from the start
//    of the code stream] [d raw fields of raw_bits: (sign << eshift) | mantissa] [d exponent codewords, canonical
//    Huffman, bits most significant first; segment s = elements [s*seg, min(d, (s+1)*seg))], zero-padded to bytes.
// A row that would not shrink is stored raw (length == row_bytes: little-endian elements). With n_seg == 1 there is
// no header: the format the KV append store's kernels (kv_packed.cu) read.
//
// Decoders peek max_bits stream bits and look the codeword up in a table of 2^max_bits ints ((symbol << 8) |
// length), built on the host from the code lengths. The code is complete (the codec checks it), so every peek
// finds a codeword; a row is malformed when a codeword ends past its stored length, and decoders report that
// instead of reading further.
//
// Kernels (E = element bytes, 2 or 4):
//   ibp_exp_sizes_e{E}          stored length of every row (thread per row)
//   ibp_exp_encode_e{E}         encode every row to its own address, device or pinned host (thread per row)
//   ibp_exp_decode_staged_e{E}  gather + decode, a row per lane (rows <= IBP_EXP_MAX_ROW bytes, one segment)
//   ibp_exp_gather_e{E}         gather + decode, a row per warp (any row; rows <= IBP_EXP_WARP_MAX_ROW staged)
//   ibp_exp_decode_desc_e{E}    decode rows given by descriptors (address, length, coded flag), a row per warp: the
//                               exponent form of bitpack.cu's ibp_decode_desc_c{C} (slab hits + host misses, staged
//                               rows)
// Device functions other sources use: ibp_exp_row_bytes, ibp_exp_encode_row, ibp_exp_decode_row,
// ibp_exp_decode_row_words, ibp_stage_rows (kv_packed.cu: 16-bit one-segment rows) and ibp_exp_decode_row_any
// (a warp decodes one row of any width and segment count: staged in shared memory up to IBP_EXP_WARP_MAX_ROW bytes;
// what the engine's lookup kernels in lookup.cu call).

typedef long long i64;
typedef unsigned long long u64;

#define IBP_EXP_FULL 0xffffffffu

// The geometry of one exponent code, as the device functions take it (uniform across a warp).
struct IbpExpGeom {
  int d;          // elements per row
  int eshift;     // mantissa bits: where the exponent field starts
  int emask;      // (1 << exponent bits) - 1
  int raw_bits;   // bits of a raw field: sign + mantissa
  int row_bytes;  // d * sizeof(T); a stored row of exactly this length is raw
  int seg;        // elements per segment
  int n_seg;      // ceil(d / seg)
  int hdr_field;  // bits per header field: 16 or 32
};

__device__ __forceinline__ IbpExpGeom ibp_exp_geom(int d, int eshift, int emask, int raw_bits, int row_bytes, int seg,
                                                   int n_seg, int hdr_field) {
  IbpExpGeom g;
  g.d = d;
  g.eshift = eshift;
  g.emask = emask;
  g.raw_bits = raw_bits;
  g.row_bytes = row_bytes;
  g.seg = seg;
  g.n_seg = n_seg;
  g.hdr_field = hdr_field;
  return g;
}

// ------------------------------------------------------------------------------------------------------------------
// Bit windows
// ------------------------------------------------------------------------------------------------------------------

// The 64 stream bits from bit `pos` of the row at `row` (bytes past `nbytes` read as zero; none is loaded).
__device__ __forceinline__ u64 ibp_exp_window(const unsigned char* __restrict__ row, i64 nbytes, i64 pos) {
  const i64 first = pos >> 3;
  u64 w = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const i64 b = first + k;
    if (b < nbytes) w |= (u64)row[b] << (8 * k);
  }
  return w >> (pos & 7);  // >= 57 valid bits: enough for a raw field (<= 24), a codeword (<= 15) or a header field
}

// The 64 stream bits from bit `pos` of a 4-byte aligned row whose memory can be read (any content) up to word
// (pos >> 5) + 2: three word loads instead of ibp_exp_window's eight byte loads with bounds checks.
__device__ __forceinline__ u64 ibp_exp_window_words(const unsigned int* __restrict__ w, i64 pos) {
  const int i = (int)(pos >> 5), sh = (int)(pos & 31);
  const u64 lo = (u64)w[i] | ((u64)w[i + 1] << 32);
  return sh ? (lo >> sh) | ((u64)w[i + 2] << (64 - sh)) : lo;
}

// Bits of the first-level decode table (LUT1_BITS in exponent.py; keep in sync).
#define IBP_EXP_LUT1_BITS 10

// The codeword at the head of a window: (symbol << 8) | length. `lut` is two tables (exponent.py's
// two_level_lut): 2^IBP_EXP_LUT1_BITS entries indexed by the next IBP_EXP_LUT1_BITS bits (-1: a longer codeword),
// then the full table of 2^max_bits entries. Why: codes run up to 15 bits (MAX_CODE_BITS), and a decode walk's
// lookups, indexed by the stream's next max_bits bits, land all over a 128 KB table, so each one of a segment's
// serial chain missed L1; the 4 KB first level holds every codeword of up to 10 bits (99.8% of MiniLM's
// exponents) and stays in L1.
__device__ __forceinline__ int ibp_exp_lookup(u64 window, const int* __restrict__ lut, int max_bits) {
  const u64 bits = __brevll(window);  // first bit on top
  const int e = __ldg(lut + (unsigned)(bits >> (64 - IBP_EXP_LUT1_BITS)));
  return e >= 0 ? e : __ldg(lut + (1 << IBP_EXP_LUT1_BITS) + (unsigned)(bits >> (64 - max_bits)));
}

// Element bits from a raw field and an exponent: sign back on top, exponent between it and the mantissa.
template <typename T>
__device__ __forceinline__ unsigned ibp_exp_element(unsigned raw, unsigned sym, int eshift) {
  return ((raw >> eshift) << (8 * sizeof(T) - 1)) | (raw & ((1u << eshift) - 1u)) | (sym << eshift);
}

// ------------------------------------------------------------------------------------------------------------------
// Size and encode (thread per row)
// ------------------------------------------------------------------------------------------------------------------

// Stored bytes of one row (row_bytes when it would not shrink).
template <typename T>
__device__ __forceinline__ int ibp_exp_row_len(const T* __restrict__ src, const IbpExpGeom& g,
                                               const unsigned char* __restrict__ code_len) {
  i64 bits = (i64)(g.n_seg - 1) * g.hdr_field + (i64)g.d * g.raw_bits;
  for (int j = 0; j < g.d; ++j) bits += code_len[((unsigned)src[j] >> g.eshift) & (unsigned)g.emask];
  const i64 bytes = (bits + 7) >> 3;
  return bytes >= g.row_bytes ? g.row_bytes : (int)bytes;
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

// Encode one row into exactly `len` bytes at `row` (len from ibp_exp_row_len; len == row_bytes: stored raw).
// Writes bytes in order, never reads `row`.
template <typename T>
__device__ __forceinline__ void ibp_exp_encode_row_t(const T* __restrict__ src, const IbpExpGeom& g, int len,
                                                     const unsigned char* __restrict__ code_len,
                                                     const unsigned int* __restrict__ code_rev,
                                                     unsigned char* __restrict__ row) {
  if (len == g.row_bytes) {
    const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
    for (int b = 0; b < g.row_bytes; ++b) row[b] = s[b];
    return;
  }
  const unsigned mant_mask = (1u << g.eshift) - 1u, emask = (unsigned)g.emask;
  const int sign_shift = 8 * sizeof(T) - 1;
  i64 byte = 0;
  u64 acc = 0;
  int fill = 0;
  if (g.n_seg > 1) {  // header: where each later segment's first codeword starts in the code stream
    unsigned off = 0;
    for (int j = 0; j < g.d; ++j) {
      if (j > 0 && j % g.seg == 0) ibp_exp_put(row, byte, acc, fill, off, g.hdr_field);
      off += code_len[((unsigned)src[j] >> g.eshift) & emask];
    }
  }
  for (int j = 0; j < g.d; ++j) {
    const unsigned v = src[j];
    ibp_exp_put(row, byte, acc, fill, ((v >> sign_shift) << g.eshift) | (v & mant_mask), g.raw_bits);
  }
  for (int j = 0; j < g.d; ++j) {
    const unsigned e = ((unsigned)src[j] >> g.eshift) & emask;
    ibp_exp_put(row, byte, acc, fill, code_rev[e], code_len[e]);  // codeword bit-reversed: its first bit goes first
  }
  if (fill > 0) row[byte++] = (unsigned char)(acc & 0xFF);
}

// 16-bit, one-segment forms (kv_packed.cu's append path).
__device__ __forceinline__ int ibp_exp_row_bytes(const unsigned short* __restrict__ src, int d, int eshift, int emask,
                                                 int raw_bits, int row_bytes,
                                                 const unsigned char* __restrict__ code_len) {
  return ibp_exp_row_len<unsigned short>(src, ibp_exp_geom(d, eshift, emask, raw_bits, row_bytes, d, 1, 16), code_len);
}

__device__ __forceinline__ void ibp_exp_encode_row(const unsigned short* __restrict__ src, int d, int eshift,
                                                   int emask, int raw_bits, int row_bytes, int len,
                                                   const unsigned char* __restrict__ code_len,
                                                   const unsigned int* __restrict__ code_rev,
                                                   unsigned char* __restrict__ row) {
  ibp_exp_encode_row_t<unsigned short>(src, ibp_exp_geom(d, eshift, emask, raw_bits, row_bytes, d, 1, 16), len,
                                       code_len, code_rev, row);
}

// ------------------------------------------------------------------------------------------------------------------
// Lane-per-row decode of one-segment rows (the KV path, and narrow rows of any store)
// ------------------------------------------------------------------------------------------------------------------

// Decode one 16-bit one-segment row (d elements) read byte by byte from anywhere into out; false if the stream runs
// past the row. kv_packed.cu's path for rows too wide to stage.
__device__ __forceinline__ bool ibp_exp_decode_row(const unsigned char* __restrict__ row, int len, int d,
                                                   int eshift, int raw_bits, int row_bytes,
                                                   const int* __restrict__ lut, int max_bits,
                                                   unsigned short* __restrict__ out) {
  if (len == row_bytes) {
    for (int j = 0; j < d; ++j) out[j] = (unsigned short)(row[2 * j] | (row[2 * j + 1] << 8));
    return true;
  }
  const u64 raw_mask = (1ull << raw_bits) - 1ull;
  i64 pos = 0;
  for (int j = 0; j < d; ++j, pos += raw_bits) {
    const unsigned raw = (unsigned)(ibp_exp_window(row, len, pos) & raw_mask);
    out[j] = (unsigned short)ibp_exp_element<unsigned short>(raw, 0u, eshift);
  }
  for (int j = 0; j < d; ++j) {
    const int e = ibp_exp_lookup(ibp_exp_window(row, len, pos), lut, max_bits);
    pos += e & 0xFF;
    if (pos > (i64)len * 8) return false;
    out[j] = (unsigned short)(out[j] | ((unsigned)(e >> 8) << eshift));
  }
  return true;
}

// Element j of a one-segment row staged as words: its raw field at bit rpos, its codeword at bit cpos (both
// advanced). False when the codeword ends past `lim` bits (a malformed row; the cursor then stops there).
template <typename T>
__device__ __forceinline__ bool ibp_exp_next(const unsigned int* __restrict__ w, i64& rpos, i64& cpos, i64 lim,
                                             int eshift, unsigned raw_mask, int raw_bits,
                                             const int* __restrict__ lut, int max_bits, unsigned& v) {
  const unsigned raw = (unsigned)ibp_exp_window_words(w, rpos) & raw_mask;
  rpos += raw_bits;
  const int e = ibp_exp_lookup(ibp_exp_window_words(w, cpos), lut, max_bits);
  cpos += e & 0xFF;
  v = ibp_exp_element<T>(raw, (unsigned)(e >> 8), eshift);
  return cpos <= lim;
}

// Decode a one-segment row staged in shared memory (4-byte aligned, readable up to 12 bytes past its stored length)
// in one pass that takes element j's raw field and codeword together, and, when `out` is 16-byte aligned and d a
// multiple of 16 / sizeof(T), stores 16 bytes at a time. Why: with a lane per row, 2-byte read-modify-writes of every
// output element are 32 scattered sectors per warp access, and a fetch of every KV token was bound by them.
template <typename T>
__device__ __forceinline__ bool ibp_exp_decode_row_words_t(const unsigned char* __restrict__ row, int len, int d,
                                                           int eshift, int raw_bits, int row_bytes,
                                                           const int* __restrict__ lut, int max_bits,
                                                           T* __restrict__ out) {
  constexpr int PER_VEC = 16 / sizeof(T);
  const unsigned int* w = reinterpret_cast<const unsigned int*>(row);
  const bool vec = ((reinterpret_cast<unsigned long long>(out) & 15) == 0) && (d % PER_VEC) == 0;
  if (len == row_bytes) {  // stored raw: little-endian elements
    if (vec) {
      for (int q = 0; q < d / PER_VEC; ++q)
        reinterpret_cast<uint4*>(out)[q] = make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
    } else if (sizeof(T) == 4) {
      for (int j = 0; j < d; ++j) out[j] = (T)w[j];
    } else {
      for (int j = 0; j < d; ++j) out[j] = (T)(row[2 * j] | (row[2 * j + 1] << 8));
    }
    return true;
  }
  const unsigned raw_mask = (1u << raw_bits) - 1u;
  const i64 lim = (i64)len * 8;
  i64 rpos = 0, cpos = (i64)d * raw_bits;
  if (cpos > lim) return false;
  if (vec) {
    for (int g = 0; g < d; g += PER_VEC) {
      unsigned v[PER_VEC];
#pragma unroll
      for (int t = 0; t < PER_VEC; ++t)
        if (!ibp_exp_next<T>(w, rpos, cpos, lim, eshift, raw_mask, raw_bits, lut, max_bits, v[t])) return false;
      uint4 q;
      if constexpr (sizeof(T) == 2) {
        q = make_uint4(v[0] | (v[1] << 16), v[2] | (v[3] << 16), v[4] | (v[5] << 16), v[6] | (v[7] << 16));
      } else {
        q = make_uint4(v[0], v[1], v[2], v[3]);
      }
      reinterpret_cast<uint4*>(out)[g / PER_VEC] = q;
    }
  } else {
    for (int j = 0; j < d; ++j) {
      unsigned v;
      if (!ibp_exp_next<T>(w, rpos, cpos, lim, eshift, raw_mask, raw_bits, lut, max_bits, v)) return false;
      out[j] = (T)v;
    }
  }
  return true;
}

// 16-bit form (kv_packed.cu's staged fetch).
__device__ __forceinline__ bool ibp_exp_decode_row_words(const unsigned char* __restrict__ row, int len, int d,
                                                         int eshift, int raw_bits, int row_bytes,
                                                         const int* __restrict__ lut, int max_bits,
                                                         unsigned short* __restrict__ out) {
  return ibp_exp_decode_row_words_t<unsigned short>(row, len, d, eshift, raw_bits, row_bytes, lut, max_bits, out);
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
      const int nr = __shfl_sync(IBP_EXP_FULL, n, r0 + u);
      const unsigned long long sp =
          __shfl_sync(IBP_EXP_FULL, reinterpret_cast<unsigned long long>(src), r0 + u);
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
        const unsigned int next_lane = __shfl_down_sync(IBP_EXP_FULL, v[u][k], 1);
        const unsigned int wrap = __shfl_sync(IBP_EXP_FULL, k + 1 < IBP_STAGE_WORDS ? v[u][k + 1] : 0u, 0);
        const unsigned int hi = lane == 31 ? wrap : next_lane;
        const int j = lane + 32 * k;
        if (j < out_words[u]) d[j] = __funnelshift_r(v[u][k], hi, shift[u]);
      }
    }
  }
}

// The group stager's 16-byte path (ibp_exp_stage_aligned16), on unless a build passes -DIBP_EXP_STAGE_VEC16=0 (how
// scripts/experiments/exp_lookup_profile.py --variants times the 4-byte path against it), and its 16-byte loads
// per lane issued before their stores: 2 (1 KB of a group per round trip) zero-copy-reads 512-byte rows within 4%
// of 4 (2 KB) and keeps the registers of the lookup kernels as the 4-byte path has them; with 4,
// ibp_lookup_pool_single_e4 took 128 instead of 96 (16 resident warps per SM instead of 20; its 2 KB hits decoded
// 19% slower, exp_lookup_profile on an H200).
#ifndef IBP_EXP_STAGE_VEC16
#define IBP_EXP_STAGE_VEC16 1
#endif
#ifndef IBP_EXP_VEC16_UNROLL
#define IBP_EXP_VEC16_UNROLL 2
#endif

// Item f (of `total`) of a group's staging loop: row r (lane r holds it), slot k of the row's `per_row`, and that
// row's length and address as lane r holds them (a shuffle: every lane calls it, uniform arguments but f).
struct IbpGroupItem {
  int r, k, n;
  unsigned long long src;
};
__device__ __forceinline__ IbpGroupItem ibp_group_item(int f, int total, int per_row, int n, const unsigned char* src) {
  IbpGroupItem it;
  it.r = f < total ? f / per_row : 0;
  it.k = f - it.r * per_row;
  it.n = __shfl_sync(IBP_EXP_FULL, n, it.r);
  it.src = __shfl_sync(IBP_EXP_FULL, reinterpret_cast<unsigned long long>(src), it.r);
  return it;
}

// The warp (all 32 lanes, uniform G) copies G rows that all start 16-byte aligned into shared memory: lane r < G's
// row (n_r bytes at src_r, n_r <= 16 * per_row16; 0 for none) goes to w + r * stride_words as its first
// ceil(n_r / 4) words (w 16-byte aligned). Reads only the aligned 16-byte chunks that overlap a row (each lies in
// the page, and the allocation granule, of a byte of the row). Why: every row of an inplace store whose row_bytes
// is a multiple of 16 starts aligned (the embedding bags' host rows and cache slots), and a lane's 16-byte load
// needs neither the realignment nor the successor word of the 4-byte path, so a group costs a quarter of the load
// instructions and, with V loads in flight per lane, one round trip over PCIe per 512 * V bytes instead of
// 128 * U. Measured (H200, 512-byte MiniLM rows, zero-copy): the exponent lookup went from 0.76x to 1.08x the raw
// rows' speed (fp32) and 0.75x to 1.06x (fp16). The one-row stager (ibp_exp_stage_row) keeps 4-byte loads: it
// already issues a whole row's loads at once, and 16-byte ones changed nothing there.
template <int V>
__device__ __forceinline__ void ibp_exp_stage_aligned16(int G, const unsigned char* src, int n, unsigned int* w,
                                                        int stride_words, int per_row16, int lane) {
  const int total = G * per_row16;
#pragma unroll 1
  for (int base = 0; base < total; base += 32 * V) {
    uint4 v[V];
    int at[V], nw[V];
#pragma unroll
    for (int u = 0; u < V; ++u) {
      const int f = base + 32 * u + lane;
      const IbpGroupItem it = ibp_group_item(f, total, per_row16, n, src);
      const bool live = f < total && 16 * it.k < it.n;
      v[u] = live ? reinterpret_cast<const uint4*>(it.src)[it.k] : make_uint4(0u, 0u, 0u, 0u);
      at[u] = live ? it.r * stride_words + 4 * it.k : -1;
      nw[u] = live ? min(4, ((it.n + 3) >> 2) - 4 * it.k) : 0;
    }
#pragma unroll
    for (int u = 0; u < V; ++u) {
      if (at[u] < 0) continue;
      unsigned int* d = w + at[u];
      if (nw[u] == 4 && (at[u] & 3) == 0) {
        *reinterpret_cast<uint4*>(d) = v[u];
      } else {
        d[0] = v[u].x;
        if (nw[u] > 1) d[1] = v[u].y;
        if (nw[u] > 2) d[2] = v[u].z;
        if (nw[u] > 3) d[3] = v[u].w;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------------------------
// Warp-per-row decode (any segment count): the engine's device function for wide rows
// ------------------------------------------------------------------------------------------------------------------

#define IBP_EXP_WARP_MAX_ROW 2048  // widest row ibp_exp_decode_row_warp takes (lookup.cu's IBP_POOL_MAX_ROW)
// Per-warp shared memory of ibp_exp_decode_row_warp: the staged row (+16 bytes: bit windows read up to 12 bytes
// past it) and one exponent byte per element (a row has at most IBP_EXP_WARP_MAX_ROW / 2 elements).
#define IBP_EXP_WARP_STAGE_BYTES (IBP_EXP_WARP_MAX_ROW + 16)
#define IBP_EXP_WARP_SMEM_BYTES (IBP_EXP_WARP_STAGE_BYTES + IBP_EXP_WARP_MAX_ROW / 2)
#define IBP_EXP_WARP_SMEM_VEC (IBP_EXP_WARP_SMEM_BYTES / 16)  // uint4 words per warp (3088 bytes)
#define IBP_EXP_WARP_WORDS ((IBP_EXP_WARP_MAX_ROW + 6 + 127) / 128)  // 4-byte loads per lane (<= 3 + n + 3 bytes)

// The warp copies one row (n <= IBP_EXP_WARP_MAX_ROW bytes at src: device or pinned host memory, any alignment)
// into dst (4-byte aligned shared memory) as whole words (bytes past n up to the word end get any content). All of
// a lane's loads are issued before any store (latency of zero-copy reads overlaps), each warp load covers 128
// contiguous bytes, and only the aligned words that overlap the row are read (as ibp_stage_rows does for 32 rows).
__device__ __forceinline__ void ibp_exp_stage_row(const unsigned char* src, int n, unsigned int* dst, int lane) {
  const unsigned long long sp = reinterpret_cast<unsigned long long>(src);
  const int a = (int)(sp & 3);
  const unsigned int* words = reinterpret_cast<const unsigned int*>(sp - a);
  const int nw = n > 0 ? (a + n + 3) >> 2 : 0;
  const int out_words = n > 0 ? (n + 3) >> 2 : 0;
  unsigned int v[IBP_EXP_WARP_WORDS];
#pragma unroll
  for (int k = 0; k < IBP_EXP_WARP_WORDS; ++k) {
    const int w = lane + 32 * k;
    v[k] = w < nw ? words[w] : 0u;
  }
#pragma unroll
  for (int k = 0; k < IBP_EXP_WARP_WORDS; ++k) {
    const unsigned int next_lane = __shfl_down_sync(IBP_EXP_FULL, v[k], 1);
    const unsigned int wrap = __shfl_sync(IBP_EXP_FULL, k + 1 < IBP_EXP_WARP_WORDS ? v[k + 1] : 0u, 0);
    const unsigned int hi = lane == 31 ? wrap : next_lane;
    const int j = lane + 32 * k;
    if (j < out_words) dst[j] = __funnelshift_r(v[k], hi, 8 * a);
  }
}

// Decode one stored row with the whole warp (all 32 lanes call it with the same arguments).
//   src, len     the stored row: len bytes at src (device memory, or pinned host memory read zero-copy; any
//                alignment). Only the aligned 4-byte words overlapping [src, src + n) are read, n = len for a
//                coded row, row_bytes for a raw one.
//   compressed   false: the row is stored raw (row_bytes bytes); true: coded, so 1 <= len < row_bytes.
//   dst          the output row, d elements of T (aligned to sizeof(T); 16-bit rows use 4-byte stores when dst is
//                4-byte aligned).
//   g, lut, max_bits   the code (IbpExpGeom; decode table of 2^max_bits entries); g.row_bytes <=
//                IBP_EXP_WARP_MAX_ROW.
//   smem         this warp's IBP_EXP_WARP_SMEM_VEC uint4 of shared memory (16-byte aligned), used only inside.
// Steps: the warp stages the row into smem (coalesced 4-byte loads); lanes s < n_seg decode segment s's codewords
// into one exponent byte per element in smem; then every lane assembles elements j = lane, lane + 32, ... from the
// raw field at its fixed bit position and the exponent byte, and stores them (coalesced).
// Returns true (every lane) when the row decoded; false (every lane) when it is malformed: len out of range, a
// segment starting past the row, or a codeword ending past len bytes; no read goes past the staged row then, and dst
// may hold partial output. Ends with __syncwarp(), so the caller may reuse smem for the next row at once.
template <typename T>
__device__ bool ibp_exp_decode_row_warp(const unsigned char* src, int len, bool compressed, T* __restrict__ dst,
                                        const IbpExpGeom g, const int* __restrict__ lut, int max_bits, uint4* smem,
                                        int lane) {
  unsigned int* w = reinterpret_cast<unsigned int*>(smem);
  unsigned char* ex = reinterpret_cast<unsigned char*>(smem) + IBP_EXP_WARP_STAGE_BYTES;
  if (compressed && (len < 1 || len >= g.row_bytes)) return false;
  ibp_exp_stage_row(src, compressed ? len : g.row_bytes, w, lane);
  __syncwarp();
  const bool pairs = sizeof(T) == 2 && (reinterpret_cast<unsigned long long>(dst) & 3) == 0;
  if (!compressed) {  // stored raw: little-endian elements
    if (sizeof(T) == 4) {
      for (int j = lane; j < g.d; j += 32) dst[j] = (T)w[j];
    } else if (pairs) {
      for (int p = lane; p < g.d / 2; p += 32) reinterpret_cast<unsigned int*>(dst)[p] = w[p];
      if ((g.d & 1) && lane == 0) dst[g.d - 1] = (T)(w[(g.d - 1) >> 1] & 0xFFFFu);
    } else {
      for (int j = lane; j < g.d; j += 32) dst[j] = (T)(w[j >> 1] >> (16 * (j & 1)));
    }
    __syncwarp();
    return true;
  }
  const i64 lim = (i64)len * 8;
  const int hdr_bits = (g.n_seg - 1) * g.hdr_field;
  const i64 code0 = hdr_bits + (i64)g.d * g.raw_bits;
  bool ok = code0 <= lim;
  if (ok) {
    const u64 field_mask = (1ull << g.hdr_field) - 1ull;
    for (int s = lane; s < g.n_seg; s += 32) {
      // pos <= lim before every window read: the read then stays within the staged words + 12 bytes
      i64 pos = code0 + (s > 0 ? (i64)(ibp_exp_window_words(w, (i64)(s - 1) * g.hdr_field) & field_mask) : 0);
      const int j1 = min(g.d, (s + 1) * g.seg);
      for (int j = s * g.seg; j < j1 && pos <= lim; ++j) {
        const int e = ibp_exp_lookup(ibp_exp_window_words(w, pos), lut, max_bits);
        pos += e & 0xFF;
        ex[j] = (unsigned char)(e >> 8);
      }
      if (pos > lim) ok = false;
    }
  }
  ok = __all_sync(IBP_EXP_FULL, ok);
  __syncwarp();  // the exponent bytes of every segment are visible to every lane
  if (ok) {
    const unsigned raw_mask = (1u << g.raw_bits) - 1u;
    if (sizeof(T) == 4) {
      for (int j = lane; j < g.d; j += 32) {
        const unsigned raw = (unsigned)ibp_exp_window_words(w, hdr_bits + (i64)j * g.raw_bits) & raw_mask;
        dst[j] = (T)ibp_exp_element<T>(raw, ex[j], g.eshift);
      }
    } else {
      for (int p = lane; 2 * p < g.d; p += 32) {
        const int j = 2 * p;
        const unsigned raw0 = (unsigned)ibp_exp_window_words(w, hdr_bits + (i64)j * g.raw_bits) & raw_mask;
        const unsigned v0 = ibp_exp_element<T>(raw0, ex[j], g.eshift);
        if (j + 1 < g.d) {
          const unsigned raw1 = (unsigned)ibp_exp_window_words(w, hdr_bits + (i64)(j + 1) * g.raw_bits) & raw_mask;
          const unsigned v1 = ibp_exp_element<T>(raw1, ex[j + 1], g.eshift);
          if (pairs) {
            reinterpret_cast<unsigned int*>(dst)[p] = v0 | (v1 << 16);
          } else {
            dst[j] = (T)v0;
            dst[j + 1] = (T)v1;
          }
        } else {
          dst[j] = (T)v0;
        }
      }
    }
  }
  __syncwarp();  // smem is free for the caller's next row
  return ok;
}

// ------------------------------------------------------------------------------------------------------------------
// Warp-per-group decode: several narrow rows per warp
// ------------------------------------------------------------------------------------------------------------------
// Why: ibp_exp_decode_row_warp walks a row's codewords with one lane per segment, so a row of 1-3 segments leaves
// 29-31 lanes idle during the serial walk (a 128-byte bf16 KV row decoded from HBM ran at a tenth of a raw copy). A
// group of G rows puts up to G * n_seg segment walks on the warp at once; staging and element assembly stay
// coalesced over the whole group. Same bytes, same per-row malformed semantics, same shared memory budget.
//
// Layout of the warp's IBP_EXP_WARP_SMEM_VEC uint4 for a group: G staged rows of ibp_exp_group_stride bytes each
// (the row's whole words + 16 bytes: bit windows read up to 12 bytes past a stored length), then G * d exponent
// bytes (row r's at G * stride + r * d).

// Bytes between two staged rows of a group (4-byte aligned; room for the windows' read past the row).
__device__ __forceinline__ int ibp_exp_group_stride(const IbpExpGeom& g) { return ((g.row_bytes + 3) & ~3) + 16; }

// Rows one warp decodes at once (uniform): as many as fit IBP_EXP_WARP_SMEM_BYTES (staged row + exponent bytes each)
// with G * n_seg <= 32 segment walks, and at most `cap` (what the caller's output buffer holds); 1 (the one-row path,
// ibp_exp_decode_row_any) for rows too wide to stage, and when only one row fits.
__device__ __forceinline__ int ibp_exp_group_rows(const IbpExpGeom& g, int cap) {
  if (g.row_bytes > IBP_EXP_WARP_MAX_ROW || g.n_seg > 16 || cap < 2) return 1;
  int G = IBP_EXP_WARP_SMEM_BYTES / (ibp_exp_group_stride(g) + g.d);
  G = min(G, 32 / g.n_seg);
  G = min(G, cap);
  return G < 1 ? 1 : G;
}

#define IBP_EXP_GROUP_UNROLL 2  // staged words per lane whose loads are issued before their stores

// The warp (all 32 lanes, uniform G) copies G rows into shared memory: lane r < G's row (n_r bytes at src_r, any
// alignment, n_r <= row_bytes; 0 for none) goes to w + r * stride / 4 as whole words (bytes past n_r up to the word
// end get any content). Lanes take (row, word) pairs of the group in turn, so a warp load covers 128 contiguous
// bytes of a row; a word is read with its aligned successor (the funnel shift realigns), and only the aligned words
// overlapping [src_r, src_r + n_r) are read. U (IBP_EXP_GROUP_UNROLL unless a caller picks another) words' loads
// go before their stores (latency of dependent reads overlaps, as in ibp_stage_rows): each pass of the loop waits
// one round trip, so over PCIe a group of G rows of row_bytes costs about G * row_bytes / (128 U) round trips;
// a larger U costs 4 registers per word. SHFL: a word's successor comes from the next lane (which loaded it as its
// own word) where that lane holds the same row, and is loaded only by lane 31 and a row's last lane, so each word
// is requested about once instead of twice (the same staged bytes).
template <int U = IBP_EXP_GROUP_UNROLL, bool SHFL = false>
__device__ __forceinline__ void ibp_exp_stage_group(int G, const unsigned char* src, int n, unsigned int* w,
                                                    int stride_words, int lane) {
#if IBP_EXP_STAGE_VEC16
  const bool aligned = n <= 0 || (reinterpret_cast<unsigned long long>(src) & 15ull) == 0;
  if (__all_sync(IBP_EXP_FULL, aligned)) {
    ibp_exp_stage_aligned16<IBP_EXP_VEC16_UNROLL>(G, src, n, w, stride_words, (stride_words - 1) >> 2, lane);
    return;
  }
#endif
  const int per_row = stride_words - 4;  // >= the words of any row (row_bytes rounded up)
  const int total = G * per_row;
#pragma unroll 1
  for (int base = 0; base < total; base += 32 * U) {
    unsigned int lo[U], hi[U];
    int at[U], sh[U];
    bool edge[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int f = base + 32 * u + lane;
      const IbpGroupItem it = ibp_group_item(f, total, per_row, n, src);
      const int r = it.r, k = it.k, nr = it.n;
      const unsigned long long sp = it.src;
      const int a = (int)(sp & 3);
      const unsigned int* words = reinterpret_cast<const unsigned int*>(sp - a);
      const int nw = nr > 0 ? (a + nr + 3) >> 2 : 0;
      const bool out = f < total && k < (nr + 3) >> 2;
      if constexpr (SHFL) {
        // every loaded word of the row (k < nw: the one past its last staged word too) is some lane's lo; the next
        // lane holds (r, k + 1) unless this is lane 31 or the row's last word slot
        edge[u] = lane == 31 || k + 1 >= per_row;
        lo[u] = f < total && k < nw ? words[k] : 0u;
        hi[u] = out && edge[u] && k + 1 < nw ? words[k + 1] : 0u;
      } else {
        lo[u] = out ? words[k] : 0u;
        hi[u] = out && k + 1 < nw ? words[k + 1] : 0u;
      }
      at[u] = out ? r * stride_words + k : -1;
      sh[u] = 8 * a;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if constexpr (SHFL) {
        const unsigned int next = __shfl_down_sync(IBP_EXP_FULL, lo[u], 1);  // 0 where (r, k + 1) is past the row
        if (!edge[u]) hi[u] = next;
      }
      if (at[u] >= 0) w[at[u]] = __funnelshift_r(lo[u], hi[u], sh[u]);
    }
  }
}

// Decode a group of G rows with the whole warp (all 32 lanes call it; G uniform, 1 <= G <= 32; G from
// ibp_exp_group_rows). Lane r < G holds row r (lanes >= G: ignored):
//   src, len, compressed   as ibp_exp_decode_row_warp's (raw rows: row_bytes bytes at src; coded: 1 <= len <
//                          row_bytes, else the row is malformed); only the aligned 4-byte words overlapping the
//                          row's bytes are read (16-byte chunks where every row of the group starts 16-byte
//                          aligned: ibp_exp_stage_aligned16).
//   dst                    its output row (aligned to sizeof(T)), or nullptr: no row (nothing read or written).
// Returns (every lane) the mask of malformed rows (bit r: row r), whose dst is left untouched; the other rows are
// decoded exactly as ibp_exp_decode_row_warp decodes them. Steps: stage the G rows (ibp_exp_stage_group); lane
// r * n_seg + s walks segment s of row r into the row's exponent bytes; then lanes take (row, element) pairs of the
// group in turn and assemble elements from the raw fields and exponent bytes (coalesced stores). Ends with
// __syncwarp(), so the caller may reuse smem at once. U, SHFL: ibp_exp_stage_group's loads in flight per lane and
// how a word's successor arrives.
template <typename T, int U = IBP_EXP_GROUP_UNROLL, bool SHFL = false>
__device__ unsigned ibp_exp_decode_rows_warp(int G, const unsigned char* src, int len, bool compressed,
                                             T* __restrict__ dst, const IbpExpGeom g, const int* __restrict__ lut,
                                             int max_bits, uint4* smem, int lane) {
  const int stride_words = ibp_exp_group_stride(g) >> 2;
  unsigned int* w = reinterpret_cast<unsigned int*>(smem);
  unsigned char* ex = reinterpret_cast<unsigned char*>(smem) + 4 * G * stride_words;
  const bool mine = lane < G && dst != nullptr;
  const bool len_ok = !compressed || (len >= 1 && len < g.row_bytes);
  const int n = mine && len_ok ? (compressed ? len : g.row_bytes) : 0;
  ibp_exp_stage_group<U, SHFL>(G, src, n, w, stride_words, lane);
  __syncwarp();
  // segment walks: lane -> (row r, segment s)
  const int hdr_bits = (g.n_seg - 1) * g.hdr_field;
  const i64 code0 = hdr_bits + (i64)g.d * g.raw_bits;
  const int wr = lane / g.n_seg, ws = lane - wr * g.n_seg;
  const int walk_row = wr < G ? wr : 0;
  const int rn = __shfl_sync(IBP_EXP_FULL, n, walk_row);
  const bool rcoded = __shfl_sync(IBP_EXP_FULL, compressed ? 1 : 0, walk_row) != 0;
  bool walk_bad = false;
  if (wr < G && rn > 0 && rcoded) {
    const unsigned int* rw = w + wr * stride_words;
    unsigned char* rex = ex + wr * g.d;
    const i64 lim = (i64)rn * 8;
    if (code0 > lim) {
      walk_bad = true;
    } else {
      const u64 field_mask = (1ull << g.hdr_field) - 1ull;
      // pos <= lim before every window read: the read then stays within the staged words + 12 bytes
      i64 pos = code0 + (ws > 0 ? (i64)(ibp_exp_window_words(rw, (i64)(ws - 1) * g.hdr_field) & field_mask) : 0);
      const int j1 = min(g.d, (ws + 1) * g.seg);
      for (int j = ws * g.seg; j < j1 && pos <= lim; ++j) {
        const int e = ibp_exp_lookup(ibp_exp_window_words(rw, pos), lut, max_bits);
        pos += e & 0xFF;
        rex[j] = (unsigned char)(e >> 8);
      }
      walk_bad = pos > lim;
    }
  }
  const unsigned walks_bad = __ballot_sync(IBP_EXP_FULL, walk_bad);  // bit r * n_seg + s
  const unsigned seg_bits = g.n_seg >= 32 ? IBP_EXP_FULL : (1u << g.n_seg) - 1u;
  const bool row_bad = mine && (!len_ok || ((walks_bad >> (lane * g.n_seg)) & seg_bits) != 0);
  const unsigned bad = __ballot_sync(IBP_EXP_FULL, lane < G && row_bad);
  const unsigned good = __ballot_sync(IBP_EXP_FULL, mine && !row_bad);
  __syncwarp();  // the exponent bytes of every row are visible to every lane
  // assembly: lane -> (row, element) for fp32, (row, element pair) for 16-bit elements
  const int per_row = sizeof(T) == 4 ? g.d : (g.d + 1) >> 1;
  const int total = G * per_row;
  const unsigned raw_mask = (1u << g.raw_bits) - 1u;
  for (int base = 0; base < total; base += 32) {
    const int f = base + lane;
    const int r = f < total ? f / per_row : 0;
    const int q = f - r * per_row;
    T* rdst = reinterpret_cast<T*>(
        __shfl_sync(IBP_EXP_FULL, reinterpret_cast<unsigned long long>(dst), r));
    const bool rc = __shfl_sync(IBP_EXP_FULL, compressed ? 1 : 0, r) != 0;
    if (f >= total || !((good >> r) & 1u)) continue;  // no shuffle below: lanes rejoin at the loop's top
    const unsigned int* rw = w + r * stride_words;
    const unsigned char* rex = ex + r * g.d;
    if (sizeof(T) == 4) {
      rdst[q] = (T)(rc ? ibp_exp_element<T>((unsigned)ibp_exp_window_words(rw, hdr_bits + (i64)q * g.raw_bits) &
                                                raw_mask,
                                            rex[q], g.eshift)
                       : rw[q]);
    } else {
      const int j = 2 * q;
      const bool two = j + 1 < g.d;
      unsigned v0, v1 = 0;
      if (rc) {
        v0 = ibp_exp_element<T>((unsigned)ibp_exp_window_words(rw, hdr_bits + (i64)j * g.raw_bits) & raw_mask, rex[j],
                                g.eshift);
        if (two)
          v1 = ibp_exp_element<T>((unsigned)ibp_exp_window_words(rw, hdr_bits + (i64)(j + 1) * g.raw_bits) & raw_mask,
                                  rex[j + 1], g.eshift);
      } else {  // stored raw: little-endian elements, element pair q is staged word q
        v0 = rw[q] & 0xFFFFu;
        v1 = rw[q] >> 16;
      }
      if (two && (reinterpret_cast<unsigned long long>(rdst) & 3) == 0) {
        reinterpret_cast<unsigned int*>(rdst)[q] = v0 | (v1 << 16);
      } else {
        rdst[j] = (T)v0;
        if (two) rdst[j + 1] = (T)v1;
      }
    }
  }
  __syncwarp();  // smem is free for the caller's next group
  return bad;
}

// The same decode for rows wider than IBP_EXP_WARP_MAX_ROW, without shared memory: lane s decodes segment s and
// writes its elements itself, reading the stored bytes with bounded byte loads. Correct for any width; slow over
// PCIe (many small reads), which is why rows up to IBP_EXP_WARP_MAX_ROW go through ibp_exp_decode_row_warp. Not
// inlined: a call on this rare path keeps the registers of the kernels that also hold the group decoder at what
// the staged paths need (the lookup's ROWS kernels: 80 instead of 128 on sm_90).
template <typename T>
__device__ __noinline__ bool ibp_exp_decode_row_direct(const unsigned char* src, int len, bool compressed,
                                                       T* __restrict__ dst, const IbpExpGeom g,
                                                       const int* __restrict__ lut, int max_bits, int lane) {
  if (!compressed) {
    unsigned char* out = reinterpret_cast<unsigned char*>(dst);
    for (int b = lane; b < g.row_bytes; b += 32) out[b] = src[b];
    return true;
  }
  if (len < 1 || len >= g.row_bytes) return false;
  const i64 lim = (i64)len * 8;
  const int hdr_bits = (g.n_seg - 1) * g.hdr_field;
  const i64 code0 = hdr_bits + (i64)g.d * g.raw_bits;
  bool ok = code0 <= lim;
  if (ok) {
    const u64 field_mask = (1ull << g.hdr_field) - 1ull;
    const unsigned raw_mask = (1u << g.raw_bits) - 1u;
    for (int s = lane; s < g.n_seg; s += 32) {
      i64 pos = code0 + (s > 0 ? (i64)(ibp_exp_window(src, len, (i64)(s - 1) * g.hdr_field) & field_mask) : 0);
      const int j1 = min(g.d, (s + 1) * g.seg);
      for (int j = s * g.seg; j < j1 && pos <= lim; ++j) {
        const int e = ibp_exp_lookup(ibp_exp_window(src, len, pos), lut, max_bits);
        pos += e & 0xFF;
        const unsigned raw = (unsigned)ibp_exp_window(src, len, hdr_bits + (i64)j * g.raw_bits) & raw_mask;
        dst[j] = (T)ibp_exp_element<T>(raw, (unsigned)(e >> 8), g.eshift);
      }
      if (pos > lim) ok = false;
    }
  }
  return __all_sync(IBP_EXP_FULL, ok);
}

// ------------------------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------------------------

// Where rows come from and go: out row i (or out_rows[i]) = stored row ids[i] (or i) of a store whose row id sits
// at base + offsets[id] (or id * row_bytes) with lengths[id] bytes. err[0] = 1 + the first i whose row is malformed,
// err[1] = 1 + the first i whose id is outside [0, n_rows) (nothing is written for it).
#define IBP_EXP_GATHER_PARAMS                                                                                          \
  const i64 *__restrict__ ids, i64 n, const unsigned char *base, const i64 *__restrict__ offsets,                     \
      const int *__restrict__ lengths, i64 n_rows, unsigned char *__restrict__ out, const i64 *__restrict__ out_rows,  \
      i64 *err
#define IBP_EXP_GEOM_PARAMS int d, int eshift, int emask, int raw_bits, int row_bytes, int seg, int n_seg, int hdr_field
#define IBP_EXP_GEOM_ARGS ibp_exp_geom(d, eshift, emask, raw_bits, row_bytes, seg, n_seg, hdr_field)

__device__ __forceinline__ void ibp_exp_flag(i64* err, int which, i64 i) {
  atomicCAS(reinterpret_cast<unsigned long long*>(err + which), 0ull, (unsigned long long)(i + 1));
}

template <typename T>
__device__ __forceinline__ void ibp_exp_sizes_impl(const unsigned char* __restrict__ x, i64 n, const IbpExpGeom g,
                                                   const unsigned char* __restrict__ code_len,
                                                   int* __restrict__ lengths) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    lengths[i] = ibp_exp_row_len<T>(reinterpret_cast<const T*>(x + i * (i64)g.row_bytes), g, code_len);
}

// Row i of x goes to address dst_ptrs[i] (room for its length; row_bytes when unknown); lengths[i] = its length.
template <typename T>
__device__ __forceinline__ void ibp_exp_encode_impl(const unsigned char* __restrict__ x, i64 n, const IbpExpGeom g,
                                                    const unsigned char* __restrict__ code_len,
                                                    const unsigned int* __restrict__ code_rev,
                                                    const i64* __restrict__ dst_ptrs, int* __restrict__ lengths) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const T* src = reinterpret_cast<const T*>(x + i * (i64)g.row_bytes);
    const int len = ibp_exp_row_len<T>(src, g, code_len);
    ibp_exp_encode_row_t<T>(src, g, len, code_len, code_rev, reinterpret_cast<unsigned char*>(dst_ptrs[i]));
    lengths[i] = len;
  }
}

// Staged decode of one-segment rows <= IBP_EXP_MAX_ROW bytes: a warp takes 32 rows, copies their stored bytes into
// shared memory (ibp_stage_rows: coalesced, batched loads, what a zero-copy read over PCIe needs), then every lane
// decodes one row from there in one pass (ibp_exp_decode_row_words_t). The KV fetch (kv_packed.cu) decodes the same
// way.
template <typename T>
__device__ __forceinline__ void ibp_exp_decode_staged_impl(IBP_EXP_GATHER_PARAMS, const IbpExpGeom g,
                                                           const int* __restrict__ lut, int max_bits) {
  __shared__ uint4 stage[IBP_EXP_WARPS][IBP_EXP_STAGE_VEC];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  unsigned char* mine = reinterpret_cast<unsigned char*>(stage[warp]);
  const i64 step = (i64)gridDim.x * IBP_EXP_WARPS * 32;
  for (i64 first = ((i64)blockIdx.x * IBP_EXP_WARPS + warp) * 32; first < n; first += step) {
    const i64 i = first + lane;
    const i64 id = i < n ? (ids ? ids[i] : i) : -1;
    const bool valid = id >= 0 && id < n_rows;
    if (i < n && !valid) ibp_exp_flag(err, 1, i);
    const int len = valid ? lengths[id] : 0;
    const int copy = len < 0 ? 0 : (len < g.row_bytes ? len : g.row_bytes);  // row_bytes <= IBP_EXP_MAX_ROW
    const unsigned char* src = valid ? base + (offsets ? offsets[id] : id * (i64)g.row_bytes) : base;
    ibp_stage_rows(src, copy, mine, IBP_EXP_STRIDE, lane);
    __syncwarp();
    if (valid) {
      T* o = reinterpret_cast<T*>(out + (out_rows ? out_rows[i] : i) * (i64)g.row_bytes);
      if (len > g.row_bytes || !ibp_exp_decode_row_words_t<T>(mine + lane * IBP_EXP_STRIDE, len, g.d, g.eshift,
                                                              g.raw_bits, g.row_bytes, lut, max_bits, o))
        ibp_exp_flag(err, 0, i);
    }
    __syncwarp();
  }
}

// One stored row decoded by the calling warp (all 32 lanes, uniform arguments), whatever its width: staged through
// `smem` (this warp's IBP_EXP_WARP_SMEM_VEC uint4) by ibp_exp_decode_row_warp up to IBP_EXP_WARP_MAX_ROW bytes, read
// directly past that (ibp_exp_decode_row_direct). The one row decoder of every warp-per-row kernel (gather,
// descriptors, and the engine's lookup kernels in lookup.cu). Same contract as ibp_exp_decode_row_warp: false (every
// lane) for a malformed row, and nothing is read past [src, src + len) rounded out to aligned 4-byte words.
template <typename T>
__device__ __forceinline__ bool ibp_exp_decode_row_any(const unsigned char* src, int len, bool coded,
                                                       T* __restrict__ dst, const IbpExpGeom g,
                                                       const int* __restrict__ lut, int max_bits, uint4* smem,
                                                       int lane) {
  return g.row_bytes <= IBP_EXP_WARP_MAX_ROW ? ibp_exp_decode_row_warp<T>(src, len, coded, dst, g, lut, max_bits,
                                                                          smem, lane)
                                             : ibp_exp_decode_row_direct<T>(src, len, coded, dst, g, lut, max_bits,
                                                                            lane);
}

// A group of G rows (ibp_exp_group_rows) decoded by the calling warp, lane r < G holding row r (dst nullptr: no
// row): G == 1 is the one-row path (ibp_exp_decode_row_any, any width; every lane holds row 0), G > 1
// ibp_exp_decode_rows_warp (its staging's U and SHFL). Returns (every lane) the mask of malformed rows.
template <typename T, int U = IBP_EXP_GROUP_UNROLL, bool SHFL = false>
__device__ __forceinline__ unsigned ibp_exp_decode_group(int G, const unsigned char* src, int len, bool coded,
                                                         T* __restrict__ dst, const IbpExpGeom g,
                                                         const int* __restrict__ lut, int max_bits, uint4* smem,
                                                         int lane) {
  if (G == 1) {
    if (dst == nullptr) return 0u;
    return ibp_exp_decode_row_any<T>(src, len, coded, dst, g, lut, max_bits, smem, lane) ? 0u : 1u;
  }
  return ibp_exp_decode_rows_warp<T, U, SHFL>(G, src, len, coded, dst, g, lut, max_bits, smem, lane);
}

#define IBP_EXP_GATHER_WARPS 8  // warps per block of ibp_exp_gather (8 * 3088 bytes of shared memory)

// A row per warp (ibp_exp_decode_row_warp up to IBP_EXP_WARP_MAX_ROW bytes, ibp_exp_decode_row_direct past), or a
// group of G narrow rows per warp (ibp_exp_group_rows): lane L resolves row i0 + L % G of the group.
template <typename T>
__device__ __forceinline__ void ibp_exp_gather_impl(IBP_EXP_GATHER_PARAMS, const IbpExpGeom g,
                                                    const int* __restrict__ lut, int max_bits) {
  __shared__ uint4 smem[IBP_EXP_GATHER_WARPS][IBP_EXP_WARP_SMEM_VEC];
  const int lane = threadIdx.x & 31;
  uint4* mine = smem[threadIdx.x >> 5];
  const int G = ibp_exp_group_rows(g, 32);
  const int r = lane % G;
  const i64 warp = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
  const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 i0 = warp * G; i0 < n; i0 += nwarps * G) {
    const i64 i = i0 + r;
    const bool live = i < n;  // the last group may be short
    const i64 id = live ? (ids ? ids[i] : i) : 0;
    const bool bad_id = live && (id < 0 || id >= n_rows);
    if (bad_id && lane < G) ibp_exp_flag(err, 1, i);
    const bool found = live && !bad_id;
    const int len = found ? lengths[id] : 0;
    const unsigned char* src = found ? base + (offsets ? offsets[id] : id * (i64)g.row_bytes) : nullptr;
    T* dst = reinterpret_cast<T*>(out + (out_rows && live ? out_rows[i] : i) * (i64)g.row_bytes);
    const bool fetch = found && len <= g.row_bytes;  // longer than raw: malformed, nothing read
    const unsigned bad = ibp_exp_decode_group<T>(G, src, len, len < g.row_bytes, fetch ? dst : nullptr, g, lut,
                                                 max_bits, mine, lane);
    if (found && (!fetch || ((bad >> r) & 1u)) && lane < G) ibp_exp_flag(err, 0, i);
  }
}

// Decode descriptors (a row per warp, or a group of G narrow rows per warp as ibp_exp_gather_impl): row i is
// lengths[i] bytes at the absolute address src_ptrs[i] (device memory, or pinned host memory read zero-copy), coded
// iff compressed[i] != 0 (a raw row is row_bytes bytes, whatever lengths[i] says), and goes to out row out_rows[i]
// (or i). Slab hits and host misses of one fetch decode in one launch, as do the stored bytes the CPU staged
// (HostStore.stage): the exponent form of bitpack.cu's ibp_decode_desc_c{C}. err[0] = 1 + the first i whose row is
// malformed (its output row is then partial).
template <typename T>
__device__ __forceinline__ void ibp_exp_decode_desc_impl(const i64* __restrict__ src_ptrs,
                                                         const int* __restrict__ lengths,
                                                         const unsigned char* __restrict__ compressed,
                                                         const i64* __restrict__ out_rows,
                                                         unsigned char* __restrict__ out, i64 n, const IbpExpGeom g,
                                                         const int* __restrict__ lut, int max_bits, i64* err) {
  __shared__ uint4 smem[IBP_EXP_GATHER_WARPS][IBP_EXP_WARP_SMEM_VEC];
  const int lane = threadIdx.x & 31;
  uint4* mine = smem[threadIdx.x >> 5];
  const int G = ibp_exp_group_rows(g, 32);
  const int r = lane % G;
  const i64 warp = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
  const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 i0 = warp * G; i0 < n; i0 += nwarps * G) {
    const i64 i = i0 + r;
    const bool live = i < n;  // the last group may be short
    const bool coded = live && compressed[i] != 0;
    const int len = coded ? lengths[i] : g.row_bytes;
    const unsigned char* src = live ? reinterpret_cast<const unsigned char*>(src_ptrs[i]) : nullptr;
    T* dst = live ? reinterpret_cast<T*>(out + (out_rows ? out_rows[i] : i) * (i64)g.row_bytes) : nullptr;
    const unsigned bad = ibp_exp_decode_group<T>(G, src, len, coded, dst, g, lut, max_bits, mine, lane);
    if (live && ((bad >> r) & 1u) && lane < G) ibp_exp_flag(err, 0, i);
  }
}

#define IBP_EXP_KERNELS(E, T)                                                                                          \
  extern "C" __global__ void ibp_exp_sizes_e##E(const unsigned char* x, i64 n, IBP_EXP_GEOM_PARAMS,                   \
                                                const unsigned char* code_len, int* lengths) {                        \
    ibp_exp_sizes_impl<T>(x, n, IBP_EXP_GEOM_ARGS, code_len, lengths);                                                \
  }                                                                                                                    \
  extern "C" __global__ void ibp_exp_encode_e##E(const unsigned char* x, i64 n, IBP_EXP_GEOM_PARAMS,                  \
                                                 const unsigned char* code_len, const unsigned int* code_rev,          \
                                                 const i64* dst_ptrs, int* lengths) {                                 \
    ibp_exp_encode_impl<T>(x, n, IBP_EXP_GEOM_ARGS, code_len, code_rev, dst_ptrs, lengths);                          \
  }                                                                                                                    \
  extern "C" __global__ void __launch_bounds__(32 * IBP_EXP_WARPS)                                                     \
      ibp_exp_decode_staged_e##E(IBP_EXP_GATHER_PARAMS, IBP_EXP_GEOM_PARAMS, const int* lut, int max_bits) {          \
    ibp_exp_decode_staged_impl<T>(ids, n, base, offsets, lengths, n_rows, out, out_rows, err, IBP_EXP_GEOM_ARGS, lut, \
                                  max_bits);                                                                           \
  }                                                                                                                    \
  extern "C" __global__ void __launch_bounds__(32 * IBP_EXP_GATHER_WARPS)                                              \
      ibp_exp_gather_e##E(IBP_EXP_GATHER_PARAMS, IBP_EXP_GEOM_PARAMS, const int* lut, int max_bits) {                 \
    ibp_exp_gather_impl<T>(ids, n, base, offsets, lengths, n_rows, out, out_rows, err, IBP_EXP_GEOM_ARGS, lut,        \
                           max_bits);                                                                                  \
  }                                                                                                                    \
  extern "C" __global__ void __launch_bounds__(32 * IBP_EXP_GATHER_WARPS)                                              \
      ibp_exp_decode_desc_e##E(const i64* src_ptrs, const int* lengths, const unsigned char* compressed,               \
                               const i64* out_rows, unsigned char* out, i64 n, IBP_EXP_GEOM_PARAMS, const int* lut,    \
                               int max_bits, i64* err) {                                                               \
    ibp_exp_decode_desc_impl<T>(src_ptrs, lengths, compressed, out_rows, out, n, IBP_EXP_GEOM_ARGS, lut, max_bits,     \
                                err);                                                                                  \
  }

IBP_EXP_KERNELS(2, unsigned short)
IBP_EXP_KERNELS(4, unsigned int)
