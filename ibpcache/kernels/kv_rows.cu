// requires: bitpack.cu
// KV-cache rows of an LLM decoder in pinned host memory, moved by the GPU: one launch appends the new tokens'
// K AND V rows (encoded straight into their host slots), one launch fetches the K AND V rows of chosen tokens
// (slot and source address computed here from the token index: no descriptor tensors, no host work).
//
// Geometry (ibpcache/loaders/_kv_store.py): a row is one (token t, batch b, head h) vector of row_bytes bytes;
// its slot is t * BH + bh with bh = b * H + h, and slot s lives in host chunk s / spc at byte (s % spc) * row_bytes
// (fixed-size slots: the in-place layout). `table` holds the chunks' addresses. `lengths` (int32 per slot) is
// the stored length: < row_bytes means IBP-compressed; a null `lengths` means a raw store.
// Warps take rows [0, M) of K, then [M, 2M) of V; each tensor has its own codec (chunk size C, mask, bitval).

__device__ __forceinline__ unsigned char* ibp_kv_slot(const long long* __restrict__ table, long long slot,
                                                      long long spc, int row_bytes) {
    long long c = slot / spc;
    return reinterpret_cast<unsigned char*>(table[c] + (slot - c * spc) * (long long)row_bytes);
}

// Raw row copy by the warp: 4-byte words when both ends allow it.
__device__ __forceinline__ void ibp_copy_row(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                             int row_bytes, int lane) {
    if (((row_bytes | (int)(reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst))) &
         3) == 0) {
        const u32* s = reinterpret_cast<const u32*>(src);
        u32* d = reinterpret_cast<u32*>(dst);
        for (int w = lane; w < (row_bytes >> 2); w += 32) d[w] = s[w];
    } else {
        for (int b = lane; b < row_bytes; b += 32) dst[b] = src[b];
    }
    __syncwarp();
}

// Append n_tokens tokens: rows of the [B, H, n, D] tensors k_src / v_src (byte strides sb, sh, st; the D
// values of a row contiguous) go to slots slot0 + (t * BH + bh). `written` (nullable): += stored bytes.
// k_att / v_att (nullable): contiguous [B, H, att_width, D] attention buffers that also get the raw rows, at
// token att_pos0 + t (the current step's tokens after the fetched ones: saves the caller two copy kernels).
extern "C" __global__ void __launch_bounds__(32 * IBP_WARPS_PER_BLOCK)
    ibp_kv_append(const unsigned char* k_src, const unsigned char* v_src, long long k_sb, long long k_sh,
                  long long k_st, long long v_sb, long long v_sh, long long v_st, long long n_tokens, int heads,
                  int bh_count, long long slot0, long long spc, int row_bytes, const long long* k_table,
                  const long long* v_table, int* k_len, int* v_len, const u64* k_mask, const u64* k_bitval, int k_c,
                  int k_nchunks, const u64* v_mask, const u64* v_bitval, int v_c, int v_nchunks,
                  unsigned long long* written, unsigned char* k_att, unsigned char* v_att, long long att_width,
                  long long att_pos0) {
    __shared__ u32 sbuf[IBP_WARPS_PER_BLOCK][IBP_ENC_WORDS];
    int lane = threadIdx.x & 31;
    u32* buf = sbuf[threadIdx.x >> 5];
    long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    long long m = n_tokens * bh_count;
    for (long long i = warp; i < 2 * m; i += nwarps) {
        bool is_v = i >= m;
        long long r = is_v ? i - m : i;
        long long t = r / bh_count;
        int bh = (int)(r - t * bh_count);
        int b = bh / heads, h = bh - b * heads;
        const unsigned char* src = is_v ? v_src + b * v_sb + h * v_sh + t * v_st
                                        : k_src + b * k_sb + h * k_sh + t * k_st;
        long long slot = slot0 + r;
        unsigned char* dst = ibp_kv_slot(is_v ? v_table : k_table, slot, spc, row_bytes);
        int* len = is_v ? v_len : k_len;
        int L = row_bytes;
        if (len != nullptr) {
            L = is_v ? ibp_encode_row_any(v_c, src, dst, row_bytes, v_nchunks, v_mask, v_bitval, buf, lane)
                     : ibp_encode_row_any(k_c, src, dst, row_bytes, k_nchunks, k_mask, k_bitval, buf, lane);
            if (lane == 0) len[slot] = L;
        } else {
            ibp_copy_row(src, dst, row_bytes, lane);
        }
        if (written != nullptr && lane == 0) atomicAdd(written, (unsigned long long)L);
        unsigned char* att = is_v ? v_att : k_att;
        if (att != nullptr)
            ibp_copy_row(src, att + (bh * att_width + att_pos0 + t) * (long long)row_bytes, row_bytes, lane);
    }
}

// Fetch: for r = bh * k + j in [0, BH * k), token t = idx[r] (idx null: t = j) is decoded into row bh * width + j
// of k_out / v_out ([B, H, width, D] buffers). Indices are trusted (checked by the caller). `read_bytes`
// (nullable): += stored bytes read. `row0` (nullable, int64 [>= T, B] with B = bh_count / heads): the slot of
// (t, b, h = 0) after beam reorders / batch selections, which only rewrite this table; (t, b, h) is then at
// row0[t * B + b] + h instead of t * BH + bh (null: the identity layout).
extern "C" __global__ void __launch_bounds__(32 * IBP_WARPS_PER_BLOCK)
    ibp_kv_fetch(const long long* idx, long long k, int bh_count, long long width, long long spc, int row_bytes,
                 const long long* k_table, const long long* v_table, const int* k_len, const int* v_len,
                 const u64* k_mask, const u64* k_bitval, int k_c, int k_nchunks, const u64* v_mask,
                 const u64* v_bitval, int v_c, int v_nchunks, unsigned char* k_out, unsigned char* v_out,
                 unsigned long long* read_bytes, const long long* row0, int heads) {
    __shared__ uint4 sring[IBP_WARPS_PER_BLOCK][IBP_RING_VEC];
    int lane = threadIdx.x & 31;
    uint4* ring = sring[threadIdx.x >> 5];
    long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    long long m = k * bh_count;
    for (long long i = warp; i < 2 * m; i += nwarps) {
        bool is_v = i >= m;
        long long r = is_v ? i - m : i;
        long long bh = r / k;
        long long j = r - bh * k;
        long long t = idx != nullptr ? idx[r] : j;
        long long slot;
        if (row0 != nullptr) {
            long long b = bh / heads;
            slot = row0[t * (bh_count / heads) + b] + (bh - b * heads);
        } else {
            slot = t * bh_count + bh;
        }
        const unsigned char* src = ibp_kv_slot(is_v ? v_table : k_table, slot, spc, row_bytes);
        const int* len = is_v ? v_len : k_len;
        int L = len != nullptr ? len[slot] : row_bytes;
        bool comp = L < row_bytes;
        unsigned char* dst = (is_v ? v_out : k_out) + (bh * width + j) * (long long)row_bytes;
        if (is_v)
            ibp_decode_row_any(v_c, src, comp ? L : row_bytes, comp, dst, row_bytes, v_nchunks, v_mask, v_bitval,
                               ring, lane);
        else
            ibp_decode_row_any(k_c, src, comp ? L : row_bytes, comp, dst, row_bytes, k_nchunks, k_mask, k_bitval,
                               ring, lane);
        if (read_bytes != nullptr && lane == 0) atomicAdd(read_bytes, (unsigned long long)L);
    }
}
