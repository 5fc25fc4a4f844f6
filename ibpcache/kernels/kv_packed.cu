// requires: bitpack.cu exponent.cu
// The packed KV append store (ibpcache/cache/append_store.py): a decoder layer's K and V rows encoded on the GPU
// and written BACK TO BACK into pinned host chunks, so host memory and PCIe sectors shrink with the codec ratio.
//
// An append of n tokens (rows i in [0, m), m = n * BH, row i = token i / BH, (b, h) = i % BH, slot = slot0 + i)
// stores 2m rows in the order K0 V0 K1 V1 ... (entry e = 2 i + side) at consecutive VIRTUAL byte offsets: row e at
// base + the stored lengths of the entries before it, and the next append starts where this one ends (a crop's
// rewrite starts at its first dropped K row instead: rows of later slots always follow). Every chunk holds
// C = 2^chunk_shift virtual bytes: the row at v lives in chunk v >> chunk_shift at offset v & (C - 1) and may run
// past C into the margin every chunk has (row_bytes + 16 bytes). So placing an append is a prefix sum (no rule
// that depends on what is left of a chunk), and chunks are fixed-size blocks a pool can hand out and take back.
// Two launches per append, no host sync:
//   ibp_kvp_size   stored length of every row (-> len[side][slot]); the LAST block to finish (a ticket counter in
//                  the state) scans the lengths into scratch offsets, places the append at the cursor, advances
//                  it and writes cursor + sequence number to a pinned mirror word pair (the host reads it without
//                  a sync to learn how far the device really is);
//   ibp_kvp_encode encodes every row at base + its offset (-> pos[side][slot] = chunk << 40 | offset), into its
//                  host chunk, or into a device staging buffer (a prompt: the store then copies that buffer to its
//                  chunks with DMA copies, which overlap the next layer's compute without holding SMs).
// ibp_kvp_fetch reads rows by (side, slot) -> (pos, len) and decodes them in one launch.
//
// Everything a kernel needs about the store comes from the descriptor D (int64, device; layout in
// kernels/layout.py KVP_D_*, keep in sync): growing a table rewrites D, so a captured CUDA graph stays valid.
// Per side the codec is raw (copy), IBP (warp per row) or exponent coding (lane per row, staged in shared memory
// so that host memory is read and written with coalesced accesses). No kernel traps: problems set status bits.

#define KVP_POS_SHIFT 40
#define KVP_OFF_MASK ((1ll << KVP_POS_SHIFT) - 1)
#define KVP_RAW 0
#define KVP_IBP 1
#define KVP_EXPONENT 2
#define KVP_D_TABLE 0
#define KVP_D_CHUNK_SHIFT 1
#define KVP_D_MAX_CHUNKS 2
#define KVP_D_POS 3
#define KVP_D_LEN 4
#define KVP_D_SLOT_CAP 5
#define KVP_D_STATE 6
#define KVP_D_MIRROR 7
#define KVP_D_SCRATCH 8
#define KVP_D_SCRATCH_CAP 9
#define KVP_D_ROW_BYTES 10
#define KVP_D_SIDE0 16
#define KVP_D_SIDE_WORDS 16
#define KVP_S_METHOD 0
#define KVP_S_MASK 1
#define KVP_S_BITVAL 2
#define KVP_S_CHUNK 3
#define KVP_S_NCHUNKS 4
#define KVP_S_CODE_LEN 5
#define KVP_S_CODE_REV 6
#define KVP_S_LUT 7
#define KVP_S_MAX_BITS 8
#define KVP_S_ESHIFT 9
#define KVP_S_EMASK 10
#define KVP_S_RAW_BITS 11
#define KVP_S_ELEMS 12
#define KVP_ST_CURSOR 0
#define KVP_ST_SEQ 1
#define KVP_ST_BASE 2
#define KVP_ST_TOTAL 3
#define KVP_ST_DONE 4
#define KVP_ST_STATUS 5
#define KVP_ST_TOKENS 6
#define KVP_ST_SLOT0 7
#define KVP_ST_T0 8
#define KVP_MR_CURSOR 0
#define KVP_MR_SEQ 1
#define KVP_MR_STATUS 2
#define KVP_STATUS_NO_CHUNK 1
#define KVP_STATUS_CORRUPT 2

#define KVP_WARPS 4                       // warps per block of every kernel here
#define KVP_STAGE_ROW IBP_EXP_MAX_ROW     // exponent rows up to this many bytes are staged in shared memory
#define KVP_STAGE_STRIDE IBP_EXP_STRIDE
// >= IBP_RING_VEC: the IBP ring fits in the same space; +1: ibp_exp_decode_row_words may read 12 bytes past a row
#define KVP_STAGE_VEC IBP_EXP_STAGE_VEC

// One side's codec, as read from the descriptor.
struct KvpSide {
    int method;
    const u64* mask;
    const u64* bitval;
    int c;
    int nchunks;
    const unsigned char* code_len;
    const unsigned int* code_rev;
    const int* lut;
    int max_bits, eshift, emask, raw_bits, elems;
};

__device__ __forceinline__ KvpSide kvp_side(const long long* __restrict__ D, int side) {
    const long long* s = D + KVP_D_SIDE0 + side * KVP_D_SIDE_WORDS;
    KvpSide r;
    r.method = (int)s[KVP_S_METHOD];
    r.mask = reinterpret_cast<const u64*>(s[KVP_S_MASK]);
    r.bitval = reinterpret_cast<const u64*>(s[KVP_S_BITVAL]);
    r.c = (int)s[KVP_S_CHUNK];
    r.nchunks = (int)s[KVP_S_NCHUNKS];
    r.code_len = reinterpret_cast<const unsigned char*>(s[KVP_S_CODE_LEN]);
    r.code_rev = reinterpret_cast<const unsigned int*>(s[KVP_S_CODE_REV]);
    r.lut = reinterpret_cast<const int*>(s[KVP_S_LUT]);
    r.max_bits = (int)s[KVP_S_MAX_BITS];
    r.eshift = (int)s[KVP_S_ESHIFT];
    r.emask = (int)s[KVP_S_EMASK];
    r.raw_bits = (int)s[KVP_S_RAW_BITS];
    r.elems = (int)s[KVP_S_ELEMS];
    return r;
}

// Stored bytes of one IBP row, computed by the calling warp (all lanes get it).
__device__ __forceinline__ int kvp_ibp_row_bytes(const KvpSide& s, const unsigned char* row, int row_bytes,
                                                 int lane) {
    long long bits;
    switch (s.c) {
        case 1: bits = ibp_row_bits<1>(row, row_bytes, s.nchunks, s.mask, s.bitval, lane); break;
        case 2: bits = ibp_row_bits<2>(row, row_bytes, s.nchunks, s.mask, s.bitval, lane); break;
        case 4: bits = ibp_row_bits<4>(row, row_bytes, s.nchunks, s.mask, s.bitval, lane); break;
        default: bits = ibp_row_bits<8>(row, row_bytes, s.nchunks, s.mask, s.bitval, lane); break;
    }
    long long nbytes = (bits + 7) / 8;
    return nbytes < row_bytes ? (int)nbytes : row_bytes;
}

// Copy n bytes with the warp (4-byte words when both ends and n allow it).
__device__ __forceinline__ void kvp_copy(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                         int n, int lane) {
    if (((n | (int)(reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst))) & 3) ==
        0) {
        const u32* s = reinterpret_cast<const u32*>(src);
        u32* d = reinterpret_cast<u32*>(dst);
        for (int w = lane; w < (n >> 2); w += 32) d[w] = s[w];
    } else {
        for (int b = lane; b < n; b += 32) dst[b] = src[b];
    }
    __syncwarp();
}

// One side's source rows of an append: the [B, H, n, D] tensor at `base` with byte strides (sb, sh, st).
struct KvpRows {
    const unsigned char* base;
    long long sb, sh, st;
    // Row i of the append (token i / bh_count, (b, h) from i % bh_count).
    __device__ __forceinline__ const unsigned char* row(long long i, int bh_count, int heads) const {
        long long t = i / bh_count;
        int bh = (int)(i - t * bh_count);
        int b = bh / heads, h = bh - b * heads;
        return base + b * sb + h * sh + t * st;
    }
};

// The grid-stride walk every kernel here makes: warp q of the grid takes the 32 rows of group q >> 1 on side
// q & 1 (K, V interleaved), for groups of m rows per side.
struct KvpWalk {
    long long q, step, end;
    __device__ __forceinline__ explicit KvpWalk(long long m)
        : q((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5),
          step(((long long)gridDim.x * blockDim.x) >> 5),
          end(2 * ((m + 31) >> 5)) {}
    __device__ __forceinline__ bool more() const { return q < end; }
    __device__ __forceinline__ void next() { q += step; }
    __device__ __forceinline__ int side() const { return (int)(q & 1); }
    __device__ __forceinline__ long long first() const { return (q >> 1) << 5; }
};

// The append's first slot and first token: given (slot0, t0), or, with dyn, t0 = the tokens the device state says
// are stored and slot0 moved by as many tokens (a graph captured at token t0 replays at later tokens).
__device__ __forceinline__ void kvp_where(const long long* state, int dyn, long long slot0, long long t0,
                                         int bh_count, long long& slot0_eff, long long& t0_eff) {
    if (dyn) {
        t0_eff = state[KVP_ST_TOKENS];
        slot0_eff = slot0 + (t0_eff - t0) * bh_count;
    } else {
        t0_eff = t0;
        slot0_eff = slot0;
    }
}

// Virtual offset <-> position (chunk << KVP_POS_SHIFT | offset inside the chunk), for chunks of 2^shift bytes.
__device__ __forceinline__ long long kvp_virtual(long long p, int shift) {
    return ((p >> KVP_POS_SHIFT) << shift) | (p & KVP_OFF_MASK);
}

__device__ __forceinline__ long long kvp_position(long long v, int shift) {
    return ((v >> shift) << KVP_POS_SHIFT) | (v & ((1ll << shift) - 1));
}

// Where the encoder writes the row at virtual offset v: stage + (v - base) when a staging buffer is given, else its
// host chunk; nullptr when that chunk is not allocated (the host keeps chunks ahead of the cursor; never seen
// unless that bookkeeping is wrong).
__device__ __forceinline__ unsigned char* kvp_dst(const long long* __restrict__ table, long long n_table, int shift,
                                                  long long v, long long base, unsigned char* stage) {
    if (stage != nullptr) return stage + (v - base);
    const long long c = v >> shift;
    const long long chunk = c < n_table ? table[c] : 0;
    return chunk != 0 ? reinterpret_cast<unsigned char*>(chunk) + (v & ((1ll << shift) - 1)) : nullptr;
}

// A row fell in an unallocated chunk: sticky status bit, mirrored for the host.
__device__ __forceinline__ void kvp_no_chunk(const long long* __restrict__ D, long long* state) {
    atomicOr(reinterpret_cast<unsigned long long*>(state + KVP_ST_STATUS), (unsigned long long)KVP_STATUS_NO_CHUNK);
    reinterpret_cast<volatile long long*>(D[KVP_D_MIRROR])[KVP_MR_STATUS] = KVP_STATUS_NO_CHUNK;
}

// ------------------------------------------------------------------------------------------------
// Append, launch 1: lengths, then (last block) offsets and placement.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(32 * KVP_WARPS)
    ibp_kvp_size(const long long* __restrict__ D, const unsigned char* k_src, const unsigned char* v_src,
                 long long k_sb, long long k_sh, long long k_st, long long v_sb, long long v_sh, long long v_st,
                 long long n_tokens, int heads, int bh_count, long long slot0_arg, long long t0_arg, int dyn,
                 int rewind) {
    __shared__ long long part[32 * KVP_WARPS];
    __shared__ int is_last;
    const int lane = threadIdx.x & 31;
    const int row_bytes = (int)D[KVP_D_ROW_BYTES];
    const long long slot_cap = D[KVP_D_SLOT_CAP];
    int* len_all = reinterpret_cast<int*>(D[KVP_D_LEN]);
    long long* state = reinterpret_cast<long long*>(D[KVP_D_STATE]);
    long long slot0, t0;
    kvp_where(state, dyn, slot0_arg, t0_arg, bh_count, slot0, t0);
    const long long m = n_tokens * bh_count;
    const KvpRows k_rows{k_src, k_sb, k_sh, k_st}, v_rows{v_src, v_sb, v_sh, v_st};
    for (KvpWalk g(m); g.more(); g.next()) {
        const int side = g.side();
        const long long i0 = g.first();
        const KvpSide s = kvp_side(D, side);
        const KvpRows& rows = side ? v_rows : k_rows;
        int* len = len_all + side * slot_cap + slot0;
        if (s.method == KVP_EXPONENT) {
            const long long i = i0 + lane;
            if (i < m) {
                const unsigned short* row = reinterpret_cast<const unsigned short*>(
                    rows.row(i, bh_count, heads));
                len[i] = ibp_exp_row_bytes(row, s.elems, s.eshift, s.emask, s.raw_bits, row_bytes, s.code_len);
            }
        } else {
            for (int r = 0; r < 32 && i0 + r < m; ++r) {
                const long long i = i0 + r;
                int L = row_bytes;
                if (s.method == KVP_IBP)
                    L = kvp_ibp_row_bytes(s, rows.row(i, bh_count, heads), row_bytes, lane);
                if (lane == 0) len[i] = L;
            }
        }
    }
    // The last block to finish places the append (the threadFenceReduction pattern: no block ever waits).
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long ticket = atomicAdd(reinterpret_cast<unsigned long long*>(state + KVP_ST_DONE), 1ull);
        is_last = ticket == (unsigned long long)(gridDim.x - 1);
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // Exclusive scan of the 2m lengths in entry order (e = 2 i + side) into scratch.
    long long* scratch = reinterpret_cast<long long*>(D[KVP_D_SCRATCH]);
    const long long n2 = 2 * m;
    const long long per = (n2 + blockDim.x - 1) / blockDim.x;
    const long long e0 = per * threadIdx.x;
    const long long e1 = e0 + per < n2 ? e0 + per : n2;
    long long sum = 0;
    for (long long e = e0; e < e1; ++e) sum += __ldcg(len_all + (e & 1) * slot_cap + slot0 + (e >> 1));
    part[threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        long long run = 0;
        for (int t = 0; t < (int)blockDim.x; ++t) {
            long long v = part[t];
            part[t] = run;
            run += v;
        }
        // placement: at the cursor, or, rewriting slots after a crop, where the first rewritten K row was
        const long long total = run;
        const long long base =
            rewind ? kvp_virtual(__ldcg(reinterpret_cast<const long long*>(D[KVP_D_POS]) + slot0),
                                 (int)D[KVP_D_CHUNK_SHIFT])
                   : state[KVP_ST_CURSOR];
        state[KVP_ST_BASE] = base;
        state[KVP_ST_TOTAL] = total;
        state[KVP_ST_CURSOR] = base + total;
        state[KVP_ST_SEQ] += 1;
        state[KVP_ST_SLOT0] = slot0;
        state[KVP_ST_T0] = t0;
        state[KVP_ST_TOKENS] = t0 + n_tokens;
        state[KVP_ST_DONE] = 0;
        volatile long long* mirror = reinterpret_cast<volatile long long*>(D[KVP_D_MIRROR]);
        mirror[KVP_MR_STATUS] = state[KVP_ST_STATUS];
        mirror[KVP_MR_CURSOR] = base + total;
        __threadfence_system();  // the host reads seq first: the cursor it then reads is at least as new
        mirror[KVP_MR_SEQ] = state[KVP_ST_SEQ];
    }
    __syncthreads();
    long long run = part[threadIdx.x];
    for (long long e = e0; e < e1; ++e) {
        scratch[e] = run;
        run += __ldcg(len_all + (e & 1) * slot_cap + slot0 + (e >> 1));
    }
}

// ------------------------------------------------------------------------------------------------
// Append, launch 2: encode every row at its place: its host chunk, or stage + (v - base) when stage is not null
// (the caller then copies the stage to the chunks). att_k / att_v (nullable): contiguous [B, H, att_width, D]
// attention buffers that also get the raw rows, token t of the append at att_pos0 + t (moved with the token
// position when dyn, like the slots).
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(32 * KVP_WARPS)
    ibp_kvp_encode(const long long* __restrict__ D, const unsigned char* k_src, const unsigned char* v_src,
                   long long k_sb, long long k_sh, long long k_st, long long v_sb, long long v_sh, long long v_st,
                   long long n_tokens, int heads, int bh_count, long long t0_arg, int dyn,
                   unsigned long long* written, unsigned char* k_att, unsigned char* v_att, long long att_width,
                   long long att_pos0, unsigned char* stage) {
    __shared__ uint4 smem[KVP_WARPS][KVP_STAGE_VEC];
    __shared__ u32 encbuf[KVP_WARPS][IBP_ENC_WORDS];
    const int lane = threadIdx.x & 31;
    const int wib = threadIdx.x >> 5;
    unsigned char* stg = reinterpret_cast<unsigned char*>(smem[wib]);
    const int row_bytes = (int)D[KVP_D_ROW_BYTES];
    const long long slot_cap = D[KVP_D_SLOT_CAP];
    int* len_all = reinterpret_cast<int*>(D[KVP_D_LEN]);
    long long* pos_all = reinterpret_cast<long long*>(D[KVP_D_POS]);
    long long* state = reinterpret_cast<long long*>(D[KVP_D_STATE]);
    const long long* scratch = reinterpret_cast<const long long*>(D[KVP_D_SCRATCH]);
    const long long slot0 = state[KVP_ST_SLOT0];
    const long long t0 = state[KVP_ST_T0];
    const long long base = state[KVP_ST_BASE];
    const int shift = (int)D[KVP_D_CHUNK_SHIFT];
    const long long* table = reinterpret_cast<const long long*>(D[KVP_D_TABLE]);
    const long long n_table = D[KVP_D_MAX_CHUNKS];
    const long long att_shift = att_pos0 + (dyn ? t0 - t0_arg : 0);
    const long long m = n_tokens * bh_count;
    const KvpRows k_rows{k_src, k_sb, k_sh, k_st}, v_rows{v_src, v_sb, v_sh, v_st};
    for (KvpWalk g(m); g.more(); g.next()) {
        const int side = g.side();
        const long long i0 = g.first();
        const KvpSide s = kvp_side(D, side);
        const KvpRows& rows = side ? v_rows : k_rows;
        const int* len = len_all + side * slot_cap + slot0;
        long long* pos = pos_all + side * slot_cap + slot0;
        if (s.method == KVP_EXPONENT) {
            const long long i = i0 + lane;
            const bool mine = i < m;
            const int L = mine ? len[i] : 0;
            const long long v = mine ? base + scratch[2 * i + side] : 0;
            unsigned char* dst = mine ? kvp_dst(table, n_table, shift, v, base, stage) : nullptr;
            if (mine) {
                pos[i] = kvp_position(v, shift);
                if (dst == nullptr) kvp_no_chunk(D, state);
                const unsigned short* row = reinterpret_cast<const unsigned short*>(rows.row(i, bh_count, heads));
                if (row_bytes <= KVP_STAGE_ROW)
                    ibp_exp_encode_row(row, s.elems, s.eshift, s.emask, s.raw_bits, row_bytes, L, s.code_len,
                                       s.code_rev, stg + lane * KVP_STAGE_STRIDE);
                else if (dst != nullptr)
                    ibp_exp_encode_row(row, s.elems, s.eshift, s.emask, s.raw_bits, row_bytes, L, s.code_len,
                                       s.code_rev, dst);
                if (written != nullptr && dst != nullptr) atomicAdd(written, (unsigned long long)L);
            }
            __syncwarp();
            if (row_bytes <= KVP_STAGE_ROW) {  // coalesced write-out of the staged rows
                for (int r = 0; r < 32; ++r) {
                    const int Lr = __shfl_sync(IBP_FULL, L, r);
                    unsigned char* d = reinterpret_cast<unsigned char*>(
                        __shfl_sync(IBP_FULL, reinterpret_cast<unsigned long long>(dst), r));
                    if (d == nullptr) continue;  // the same for every lane: row r has no place (or no row)
                    for (int b = lane; b < Lr; b += 32) d[b] = stg[r * KVP_STAGE_STRIDE + b];
                }
                __syncwarp();
            }
        } else {
            for (int r = 0; r < 32 && i0 + r < m; ++r) {
                const long long i = i0 + r;
                const long long v = base + scratch[2 * i + side];
                unsigned char* dst = kvp_dst(table, n_table, shift, v, base, stage);  // the same for every lane
                if (lane == 0) pos[i] = kvp_position(v, shift);
                if (dst == nullptr) {
                    if (lane == 0) kvp_no_chunk(D, state);
                    continue;
                }
                const unsigned char* row = rows.row(i, bh_count, heads);
                int L = row_bytes;
                if (s.method == KVP_IBP)
                    L = ibp_encode_row_any(s.c, row, dst, row_bytes, s.nchunks, s.mask, s.bitval, encbuf[wib], lane);
                else
                    kvp_copy(row, dst, row_bytes, lane);
                if (lane == 0 && written != nullptr) atomicAdd(written, (unsigned long long)L);
            }
        }
        unsigned char* att = side ? v_att : k_att;
        if (att != nullptr) {
            for (int r = 0; r < 32 && i0 + r < m; ++r) {
                const long long i = i0 + r;
                const long long t = i / bh_count;
                const int bh = (int)(i - t * bh_count);
                kvp_copy(rows.row(i, bh_count, heads),
                         att + (bh * att_width + att_shift + t) * (long long)row_bytes, row_bytes, lane);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Fetch: for r = bh * k + j in [0, BH * k), token t = idx[r] (idx null: t = j) is decoded into row bh * width + j
// of k_out / v_out ([B, H, width, D] buffers). k_dyn: k = the tokens the device state says are stored (a captured
// graph fetches every token of a later step; idx must be null then). row0 (nullable, int64 [>= T, B]): slot of
// (t, b, head 0) after beam reorders / batch selections (else slot t * BH + bh). Indices are trusted (checked by the
// caller). read_bytes (nullable): += stored bytes read. dev_chunks (nullable): a device copy of the chunks
// (AppendStore.stage_chunks: one DMA copy per chunk instead of scattered zero-copy reads), chunk c at
// dev_chunks + dev_off[c]; the rows are then decoded from device memory.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(32 * KVP_WARPS)
    ibp_kvp_fetch(const long long* __restrict__ D, const long long* idx, long long k_arg, int k_dyn, int bh_count,
                  long long width, unsigned char* k_out, unsigned char* v_out, unsigned long long* read_bytes,
                  const long long* row0, int heads, const unsigned char* dev_chunks, const long long* dev_off) {
    __shared__ uint4 smem[KVP_WARPS][KVP_STAGE_VEC];
    const int lane = threadIdx.x & 31;
    const int wib = threadIdx.x >> 5;
    uint4* ring = smem[wib];
    unsigned char* stage = reinterpret_cast<unsigned char*>(smem[wib]);
    const int row_bytes = (int)D[KVP_D_ROW_BYTES];
    const long long slot_cap = D[KVP_D_SLOT_CAP];
    const int* len_all = reinterpret_cast<const int*>(D[KVP_D_LEN]);
    const long long* pos_all = reinterpret_cast<const long long*>(D[KVP_D_POS]);
    const long long* table = reinterpret_cast<const long long*>(D[KVP_D_TABLE]);
    long long* state = reinterpret_cast<long long*>(D[KVP_D_STATE]);
    const long long k = k_dyn ? state[KVP_ST_TOKENS] : k_arg;
    const long long m = k * bh_count;
    for (KvpWalk g(m); g.more(); g.next()) {
        const int side = g.side();
        const long long r0 = g.first();
        const KvpSide s = kvp_side(D, side);
        const int* len = len_all + side * slot_cap;
        const long long* pos = pos_all + side * slot_cap;
        unsigned char* out = side ? v_out : k_out;
        // this lane's row: where it is stored and where it goes
        const long long r = r0 + lane;
        const bool mine = r < m;
        int L = 0;
        const unsigned char* src = nullptr;
        unsigned char* dst = nullptr;
        if (mine) {
            const long long bh = r / k;
            const long long j = r - bh * k;
            const long long t = idx != nullptr ? idx[r] : j;
            long long slot;
            if (row0 != nullptr) {
                const long long b = bh / heads;
                slot = row0[t * (bh_count / heads) + b] + (bh - b * heads);
            } else {
                slot = t * bh_count + bh;
            }
            const long long p = pos[slot];
            L = len[slot];
            const long long c = p >> KVP_POS_SHIFT;
            src = (dev_chunks != nullptr ? dev_chunks + dev_off[c] : reinterpret_cast<const unsigned char*>(table[c])) +
                  (p & KVP_OFF_MASK);
            dst = out + (bh * width + j) * (long long)row_bytes;
            if (read_bytes != nullptr) atomicAdd(read_bytes, (unsigned long long)L);
        }
        if (s.method == KVP_EXPONENT) {
            const bool staged = row_bytes <= KVP_STAGE_ROW;
            if (staged) {  // the 32 rows' stored bytes into shared memory (coalesced, batched loads)
                ibp_stage_rows(src, L, stage, KVP_STAGE_STRIDE, lane);
                __syncwarp();
            }
            if (mine) {
                unsigned short* o = reinterpret_cast<unsigned short*>(dst);
                const bool ok = staged ? ibp_exp_decode_row_words(stage + lane * KVP_STAGE_STRIDE, L, s.elems,
                                                                  s.eshift, s.raw_bits, row_bytes, s.lut,
                                                                  s.max_bits, o)
                                       : ibp_exp_decode_row(src, L, s.elems, s.eshift, s.raw_bits, row_bytes, s.lut,
                                                            s.max_bits, o);
                if (!ok)
                    atomicOr(reinterpret_cast<unsigned long long*>(state + KVP_ST_STATUS),
                             (unsigned long long)KVP_STATUS_CORRUPT);
            }
            __syncwarp();
        } else if (s.method == KVP_RAW && row_bytes <= KVP_STAGE_ROW) {
            // Raw rows are staged like exponent rows: the loads of 8 rows are in flight together (a zero-copy read
            // costs a PCIe round trip; copied one row at a time, a warp waited 32 of them, and rows at unaligned
            // offsets (a raw side beside a coded one) went byte by byte). Then each row leaves shared memory as
            // coalesced word stores, the warp on one row at a time.
            ibp_stage_rows(src, L, stage, KVP_STAGE_STRIDE, lane);
            __syncwarp();
            for (int rr = 0; rr < 32 && r0 + rr < m; ++rr) {
                unsigned char* dr = reinterpret_cast<unsigned char*>(
                    __shfl_sync(IBP_FULL, reinterpret_cast<unsigned long long>(dst), rr));
                kvp_copy(stage + rr * KVP_STAGE_STRIDE, dr, row_bytes, lane);
            }
        } else {
            for (int rr = 0; rr < 32 && r0 + rr < m; ++rr) {
                const int Lr = __shfl_sync(IBP_FULL, L, rr);
                const unsigned char* sr = reinterpret_cast<const unsigned char*>(
                    __shfl_sync(IBP_FULL, reinterpret_cast<unsigned long long>(src), rr));
                unsigned char* dr = reinterpret_cast<unsigned char*>(
                    __shfl_sync(IBP_FULL, reinterpret_cast<unsigned long long>(dst), rr));
                if (s.method == KVP_IBP) {
                    const bool comp = Lr < row_bytes;
                    ibp_decode_row_any(s.c, sr, Lr, comp, dr, row_bytes, s.nchunks, s.mask, s.bitval, ring, lane);
                } else {
                    kvp_copy(sr, dr, row_bytes, lane);
                }
            }
        }
    }
}
