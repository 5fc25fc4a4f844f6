// requires: bitpack.cu hashmap.cu exponent.cu
// The engine's one lookup launch: for every bag (a run of ids; one id per bag for plain row fetches) probe the
// cache index, read each row from its slab (hit) or zero-copy from the pinned host store (miss), decode it, and
// either write it out (op ROWS) or pool the bag (SUM / MEAN / MAX, optional per-sample weights) straight into its
// place in a [samples, tables * row] output. Several embedding tables go in one launch: bag j belongs to table
// t and sample s by the layout (table-major bags, TorchRec/FBGEMM's KJT order, or sample-major [B, T] input).
//
// No host sync is needed around it: ids are range-checked here, per table; a bad id contributes nothing (its
// output row is zeros for ROWS) and sets err[0] = 1, err[1] = its table, in pinned host memory that the launcher
// reads lazily. Counters (requests, hits, host bytes, slab bytes) are device atomics, one per warp per counter;
// freq (optional) counts lookups per global row for frequency-driven cache refreshes.
//
// Bit-exactness of pooling against torch.nn.functional.embedding_bag on CUDA (and FBGEMM TBE): each element is
// accumulated in float32, starting from 0, over the bag's ids in order (acc + v, or fmaf(v, w, acc) with
// per-sample weights, as nvcc contracts torch's `acc += v * w`); MEAN divides by the number of ids at the end;
// MAX keeps the first value unless a later one compares greater (torch's rule, NaN included); the result is
// rounded to the row dtype with the hardware's round-to-nearest conversions, as torch's casts are.
//
// Codecs: every kernel that decodes rows (STAGE, ROWS, POOL) is a template over a codec kind, and each launch
// instantiates exactly one decoder: IbpRows<C> (IBP with C-byte chunks, and raw rows: kernels *_c{C}) or ExpRows<T>
// (exponent-coded float rows of 16- or 32-bit elements T: kernels *_e2 / *_e4). The kind brings its own per-warp
// shared memory, so an IBP kernel is the same code it would be without the exponent kinds. The launcher
// (lookup.py) picks the kind from the codec's kernel tables. The codec's arguments travel in three generic kernel
// parameters (codec_n, codec_a, codec_b): IBP n_chunks, mask, bitval; exponent max_bits, its decode table (int32
// [2^max_bits]) and its geometry words (int32 [IBP_EXP_GEOM_WORDS], ExponentTables.geom).

// index mode of a raw row cache (e.g. the trainable rows of an embedding bag): table_values is int32 [n_rows]
// holding each row's slot in slab 0 (-1 = not cached); keep in sync with IndexMode in lookup.py
#define IBP_INDEX_SLOTS 3
// index mode of a cache of STORED rows in fixed-stride slots (the embedding bags' inference cache, admitted per step
// by admit.cu): table_values is int32 [n_rows] slot table: v >= 0 = slot v of slab 0 at v * max_probes bytes (the
// slot stride rides in max_probes), v <= -2 = row -2 - v of this step's staging buffer (slab 1, row_bytes apart),
// -1 = host; table_keys is int32 [capacity + staging rows]: the stored length of every slot, then of every staging
// row (capacity = the number of slots). A row is compressed exactly when its length is below row_bytes, so raw and
// compressed slots mix. Keep in sync with SLOT_TABLE_INDEX in lookup.py.
#define IBP_INDEX_SLOT_TABLE 4

#define IBP_OP_ROWS 0
#define IBP_OP_SUM 1
#define IBP_OP_MEAN 2
#define IBP_OP_MAX 3

#define IBP_ELEM_F32 0
#define IBP_ELEM_F16 1
#define IBP_ELEM_BF16 2

#define IBP_POOL_WARPS 4           // warps per block of the pooling kernel
#define IBP_POOL_MAX_ROW 2048      // bytes of a pooled row (shared-memory row buffer per warp)
#define IBP_POOL_PER_LANE 16       // float accumulators per lane: rows of at most 512 elements ...
#define IBP_POOL_PER_LANE_WIDE 32  // ... or, in the wide variant (more registers), 1024 (e.g. 2 KB fp16 rows)

__device__ __forceinline__ float ibp_f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short ibp_f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ unsigned short ibp_f32_to_bf16(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// A 16-bit element's value (fp16 or bf16) and back, rounding to nearest.
__device__ __forceinline__ float ibp_half_to_f32(unsigned short h, int elem) {
    return elem == IBP_ELEM_F16 ? ibp_f16_to_f32(h) : __uint_as_float(((u32)h) << 16);
}

__device__ __forceinline__ unsigned short ibp_f32_to_half(float v, int elem) {
    return elem == IBP_ELEM_F16 ? ibp_f32_to_f16(v) : ibp_f32_to_bf16(v);
}

__device__ __forceinline__ float ibp_elem_load(const unsigned char* row, int e, int elem) {
    if (elem == IBP_ELEM_F32) return reinterpret_cast<const float*>(row)[e];
    return ibp_half_to_f32(reinterpret_cast<const unsigned short*>(row)[e], elem);
}

__device__ __forceinline__ void ibp_elem_store(unsigned char* row, int e, int elem, float v) {
    if (elem == IBP_ELEM_F32) {
        reinterpret_cast<float*>(row)[e] = v;
    } else {
        reinterpret_cast<unsigned short*>(row)[e] = ibp_f32_to_half(v, elem);
    }
}

// The pooled value of a bag of one id whose element is x (weight w where weighted), computed as the bag loop
// computes it: from 0 (one add or fma; MAX keeps the first value), MEAN divided by the count, 1.
__device__ __forceinline__ float ibp_pool_one_value(float x, int op, bool weighted, float w) {
    float v = op == IBP_OP_MAX ? x : (weighted ? fmaf(x, w, 0.0f) : 0.0f + x);
    if (op == IBP_OP_MEAN) v = v / 1.0f;
    return v;
}

// ibp_pool_one_value of every element of a 16-byte word of a row (4 fp32 or 8 fp16 / bf16 elements).
__device__ __forceinline__ uint4 ibp_pool_one_word(uint4 x, int op, int elem, bool weighted, float w) {
    u32 v[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (elem == IBP_ELEM_F32) {
            v[i] = __float_as_uint(ibp_pool_one_value(__uint_as_float(v[i]), op, weighted, w));
        } else {
            const u32 lo = ibp_f32_to_half(ibp_pool_one_value(ibp_half_to_f32((unsigned short)(v[i] & 0xFFFFu), elem),
                                                              op, weighted, w), elem);
            const u32 hi = ibp_f32_to_half(ibp_pool_one_value(ibp_half_to_f32((unsigned short)(v[i] >> 16), elem),
                                                              op, weighted, w), elem);
            v[i] = lo | (hi << 16);
        }
    }
    return make_uint4(v[0], v[1], v[2], v[3]);
}

// Where row `gid` is stored: its slab entry on a hit, its place in the host store on a miss.
struct IbpRowSource {
    const unsigned char* src;
    int len;
    bool comp;
    bool hit;
};

__device__ __forceinline__ IbpRowSource ibp_row_source(i64 gid, int mode, const i64* __restrict__ table_keys,
                                                       const i64* __restrict__ table_values, i64 capacity,
                                                       int max_probes, const i64* __restrict__ slab_bases,
                                                       i64 host_base, const i64* __restrict__ host_offsets,
                                                       i64 host_stride, const int* __restrict__ host_lengths,
                                                       int row_bytes) {
    IbpRowSource r;
    if (mode == IBP_INDEX_SLOT_TABLE) {  // served from device memory (a slot, or this step's staging) unless -1
        const int v = reinterpret_cast<const int*>(table_values)[gid];
        if (v != -1) {
            const int* lens = reinterpret_cast<const int*>(table_keys);
            if (v >= 0) {
                r.src = reinterpret_cast<const unsigned char*>(slab_bases[0] + (i64)v * (i64)max_probes);
                r.len = lens[v];
            } else {
                const i64 k = -2 - (i64)v;
                r.src = reinterpret_cast<const unsigned char*>(slab_bases[1] + k * (i64)row_bytes);
                r.len = lens[capacity + k];
            }
            r.comp = r.len < row_bytes;
            r.hit = true;
            if (!r.comp) r.len = row_bytes;
            return r;
        }
    }
    if (mode == IBP_INDEX_SLOTS) {  // a raw row cache: int32 slot per row (-1 = not cached), fixed-size slots
        const int slot = reinterpret_cast<const int*>(table_values)[gid];
        if (slot >= 0) {
            r.src = reinterpret_cast<const unsigned char*>(slab_bases[0] + (i64)slot * row_bytes);
            r.len = row_bytes;
            r.comp = false;
            r.hit = true;
            return r;
        }
    }
    const i64 entry = (mode == IBP_INDEX_SLOTS || mode == IBP_INDEX_SLOT_TABLE) ? IBP_EMPTY_ENTRY
                                              : ibp_index_find(mode, table_keys, table_values, capacity, max_probes, gid);
    if (entry != IBP_EMPTY_ENTRY) {
        const u64 e = (u64)entry;
        r.src = reinterpret_cast<const unsigned char*>(
            slab_bases[(e >> IBP_ENTRY_SLAB_SHIFT) & ((1ULL << IBP_ENTRY_SLAB_BITS) - 1ULL)] +
            (i64)(e & ((1ULL << IBP_ENTRY_OFFSET_BITS) - 1ULL)));
        r.len = (int)((e >> IBP_ENTRY_LENGTH_SHIFT) & ((1ULL << IBP_ENTRY_LENGTH_BITS) - 1ULL));
        r.comp = ((e >> IBP_ENTRY_COMPRESSED_SHIFT) & 1ULL) != 0;
        r.hit = true;
    } else {
        r.src = reinterpret_cast<const unsigned char*>(host_base +
                                                       (host_offsets != nullptr ? host_offsets[gid] : gid * host_stride));
        r.len = host_lengths != nullptr ? host_lengths[gid] : row_bytes;
        r.comp = r.len < row_bytes;  // a row is stored compressed exactly when it is shorter than raw
        r.hit = false;
    }
    if (!r.comp) r.len = row_bytes;
    return r;
}

// Bag j -> (table t, sample s) and its id range [start, end).
__device__ __forceinline__ void ibp_bag_place(i64 j, int n_tables, i64 per_table, int sample_major,
                                              const i64* __restrict__ bag_offsets, int bag_size, i64 n_bags,
                                              int include_last, i64 n_ids, int& t, i64& s, i64& start, i64& end,
                                              bool& bad_offsets) {
    if (n_tables <= 1) {
        t = 0;
        s = j;
    } else if (sample_major) {
        t = (int)(j % n_tables);
        s = j / n_tables;
    } else {
        t = (int)(j / per_table);
        s = j % per_table;
    }
    if (bag_offsets != nullptr) {
        start = bag_offsets[j];
        end = (j + 1 < n_bags || include_last) ? bag_offsets[j + 1] : n_ids;
        // torch's rules: offsets[0] == 0, non-decreasing, the last one <= len(input); a bad bag pools nothing
        bad_offsets = (j == 0 && start != 0) || start < 0 || end < start || end > n_ids;
        if (bad_offsets) end = start;
        if (start < 0) start = 0;
        if (end > n_ids) end = n_ids;
    } else {
        bad_offsets = false;
        start = j * (i64)bag_size;
        end = start + bag_size;
    }
}

__device__ __forceinline__ void ibp_flush_counters(u64* __restrict__ counters, int lane, u64 requests, u64 hits,
                                                   u64 host_bytes, u64 slab_bytes) {
    if (lane == 0 && counters != nullptr && requests != 0) {
        atomicAdd(&counters[IBP_COUNTER_REQUESTS], requests);
        atomicAdd(&counters[IBP_COUNTER_HITS], hits);
        atomicAdd(&counters[IBP_COUNTER_HOST_BYTES], host_bytes);
        atomicAdd(&counters[IBP_COUNTER_SLAB_BYTES], slab_bytes);
    }
}

// err[0]: 1 = an id outside its table (err[1] = the table), 2 = offsets break torch's rules (err[1] = the bag)
__device__ __forceinline__ void ibp_report_bad_id(volatile int* err, int t) {
    err[1] = t;
    err[0] = 1;
}

__device__ __forceinline__ void ibp_report_bad_offsets(volatile int* err, i64 bag) {
    err[1] = (int)bag;
    err[0] = 2;
}

// ---- codec kinds --------------------------------------------------------------------------------------
// What a kind provides: SMEM_VEC (uint4 of per-warp shared memory its decoder needs), a constructor from the row
// size and the three codec parameters, decode(src, len, coded, dst, smem, lane): the calling warp (all 32 lanes,
// uniform arguments) decodes one stored row into dst; false (every lane) if the row is malformed (dst then holds
// partial output); group_rows(cap): how many rows G (uniform, 1 <= G <= cap) the warp decodes at once; and
// decode_group(G, src, len, coded, dst, smem, lane): lane r < G holds row r (dst nullptr: no row), the warp decodes
// them all and returns (every lane) the mask of malformed rows, whose dst holds partial output (zeros must follow
// a __syncwarp). The lookup kernels are written once over groups: lane L works on row L % G of the group, so with
// G == 1 every lane holds the same row, as a warp-per-row loop has it. IBP rows cannot be told malformed (every bit
// string decodes), so IbpRows::decode is always true and its group_rows the constant 1. GROUPED says which loop a
// kind runs: the grouped ones (exponent rows) or the one-row-per-warp ones (IBP and raw rows).

template <int C>
struct IbpRows {
    static constexpr int SMEM_VEC = IBP_RING_VEC;  // the warp's ring buffer (bitpack.cu)
    static constexpr bool GROUPED = false;  // one row per warp (ibp_lookup_rows_one / ibp_lookup_pool_one)
    int row_bytes, n_chunks;
    const u64* mask;
    const u64* bitval;
    __device__ __forceinline__ IbpRows(int row_bytes_, int codec_n, const u64* codec_a, const u64* codec_b)
        : row_bytes(row_bytes_), n_chunks(codec_n), mask(codec_a), bitval(codec_b) {}
    __device__ __forceinline__ bool decode(const unsigned char* src, int len, bool coded, unsigned char* dst,
                                           uint4* smem, int lane) const {
        ibp_decode_row<C>(src, len, coded, dst, row_bytes, n_chunks, mask, bitval, smem, lane);
        return true;
    }
    __device__ __forceinline__ int group_rows(int) const { return 1; }
    __device__ __forceinline__ unsigned decode_group(int, const unsigned char* src, int len, bool coded,
                                                     unsigned char* dst, uint4* smem, int lane) const {
        if (dst != nullptr) decode(src, len, coded, dst, smem, lane);  // uniform: G == 1
        return 0u;
    }
};

// The geometry words of an exponent code (ExponentTables.geom; keep in sync with EXP_GEOM_FIELDS in exponent.py).
#define IBP_EXP_GEOM_WORDS 8

// Compile-time variants of the lookup kernels (the exponent kinds' ibp_lookup_{rows,pool,pool_wide,pool_single}_e*;
// IBP_MIN_WARPS: the IBP and raw kinds'), so one process can time them against the defaults (module options, e.g.
// -DIBP_EXP_LOOKUP_UNROLL=8; see scripts/experiments/exp_lookup_profile.py --variants). Why: a warp stages its group
// of rows from pinned host memory and decodes only once they arrived, so the host reads' latency is hidden only by
// other warps' work or by more loads in flight per warp.
//   IBP_EXP_LOOKUP_UNROLL  staged words per lane whose loads go out together (ibp_exp_stage_group's U); default
//                          the other kernels' IBP_EXP_GROUP_UNROLL
//   IBP_EXP_LOOKUP_SHFL    1: a staged word's successor comes from the next lane (ibp_exp_stage_group's SHFL:
//                          each host word requested about once, not twice); default 0
//   IBP_EXP_MIN_WARPS      resident warps per SM the kernels must allow (__launch_bounds__' min blocks: the
//                          compiler caps registers to fit); default none (registers as the code needs)
//   IBP_MIN_WARPS          the same for the IBP and raw kinds' kernels (ibp_lookup_{rows,pool,pool_wide}_c* and
//                          the several-bags ones, ibp_lookup_{pool,rows}_single_c*): resident warps bound how many
//                          cache-hit rows are in flight; default none
#ifndef IBP_EXP_LOOKUP_UNROLL
#define IBP_EXP_LOOKUP_UNROLL IBP_EXP_GROUP_UNROLL
#endif
#ifndef IBP_EXP_LOOKUP_SHFL
#define IBP_EXP_LOOKUP_SHFL 0
#endif
#ifdef IBP_MIN_WARPS
#define IBP_LB(THREADS) __launch_bounds__(THREADS, (IBP_MIN_WARPS * 32 + (THREADS) - 1) / (THREADS))
#else
#define IBP_LB(THREADS) __launch_bounds__(THREADS)
#endif
#ifdef IBP_EXP_MIN_WARPS
#define IBP_EXP_LB(THREADS) __launch_bounds__(THREADS, (IBP_EXP_MIN_WARPS * 32 + (THREADS) - 1) / (THREADS))
#else
#define IBP_EXP_LB(THREADS) __launch_bounds__(THREADS)
#endif

template <typename T>
struct ExpRows {
    static constexpr int SMEM_VEC = IBP_EXP_WARP_SMEM_VEC;  // staged row + exponent bytes (exponent.cu)
    static constexpr bool GROUPED = true;  // several narrow rows per warp (ibp_lookup_*_grouped)
    IbpExpGeom g;
    const int* lut;
    int max_bits;
    // codec_n = max_bits, codec_a = the decode table, codec_b = the geometry words (d, eshift, emask, raw_bits,
    // row_bytes, seg, n_seg, hdr_field), read once per thread.
    __device__ __forceinline__ ExpRows(int row_bytes, int codec_n, const u64* codec_a, const u64* codec_b) {
        const int* w = reinterpret_cast<const int*>(codec_b);
        g = ibp_exp_geom(__ldg(w + 0), __ldg(w + 1), __ldg(w + 2), __ldg(w + 3), row_bytes, __ldg(w + 5),
                         __ldg(w + 6), __ldg(w + 7));
        lut = reinterpret_cast<const int*>(codec_a);
        max_bits = codec_n;
    }
    __device__ __forceinline__ bool decode(const unsigned char* src, int len, bool coded, unsigned char* dst,
                                           uint4* smem, int lane) const {
        return ibp_exp_decode_row_any<T>(src, len, coded, reinterpret_cast<T*>(dst), g, lut, max_bits, smem, lane);
    }
    // Rows of few segments decode several per warp (ibp_exp_decode_rows_warp: up to 32 segment walks at once).
    __device__ __forceinline__ int group_rows(int cap) const { return ibp_exp_group_rows(g, cap); }
    __device__ __forceinline__ unsigned decode_group(int G, const unsigned char* src, int len, bool coded,
                                                     unsigned char* dst, uint4* smem, int lane) const {
        return ibp_exp_decode_group<T, IBP_EXP_LOOKUP_UNROLL, IBP_EXP_LOOKUP_SHFL != 0>(
            G, src, len, coded, reinterpret_cast<T*>(dst), g, lut, max_bits, smem, lane);
    }
};

// err[0] = 3: a stored row was malformed (err[1] = its table); its output row is zeros (ROWS) or it pooled nothing.
__device__ __forceinline__ void ibp_report_corrupt_row(volatile int* err, int t) {
    err[1] = t;
    err[0] = 3;
}

// Arguments shared by the kernels, in this order (see ibpcache/kernels/lookup.py):
#define IBP_LOOKUP_PARAMS                                                                                       \
    const i64 *ids, i64 n_ids, const i64 *bag_offsets, int bag_size, i64 n_bags, int include_last,             \
        int n_tables, i64 per_table, int sample_major, const i64 *table_base, const i64 *table_rows, i64 n_rows, \
        unsigned char *out, int index_mode, const i64 *table_keys, const i64 *table_values, i64 capacity,       \
        int max_probes, const i64 *slab_bases, i64 host_base, const i64 *host_offsets, i64 host_stride,         \
        const int *host_lengths, int row_bytes, int codec_n, const u64 *codec_a, const u64 *codec_b,           \
        u64 *counters, int *err, int *freq, i64 *stage_of, i64 *step_state, const unsigned char *staging,       \
        i64 stage_cap, const i64 *bag_order, const i64 *out_ref

// ... and as a call passes them on
#define IBP_LOOKUP_ARGS                                                                                           \
    ids, n_ids, bag_offsets, bag_size, n_bags, include_last, n_tables, per_table, sample_major, table_base,        \
        table_rows, n_rows, out, index_mode, table_keys, table_values, capacity, max_probes, slab_bases, host_base, \
        host_offsets, host_stride, host_lengths, row_bytes, codec_n, codec_a, codec_b, counters, err, freq, stage_of, \
        step_state, staging, stage_cap, bag_order, out_ref

// out_ref (optional): where the output goes is read from device memory (out_ref[0]) instead of `out`, so a step
// captured in a CUDA graph writes each replay straight into that replay's output tensor (the address is stored
// before the replay), with no copy out of a static buffer. Every kernel that writes `out` starts with this.
#define IBP_OUT_FROM_REF                                                                                           \
    if (out_ref != nullptr) out = reinterpret_cast<unsigned char*>(out_ref[0])

// ---- in-step deduplication of misses (optional: staging == nullptr turns it off) --------------------------
// A step with staging is three launches: CLAIM (thread per bag: every missed row claims a staging index once,
// tagged with the step's generation in stage_of[gid] = gen << 32 | index), STAGE (a warp per claimed row reads it
// once from host memory and decodes it into the staging buffer in device memory), then the lookup itself, which
// reads claimed rows from staging and only unclaimed ones (staging full) zero-copy. step_state (int64 [4]):
// [0] generation of the last finished step, [1]/[2] claim counters by generation parity, [3] the lookup's
// block ticket: its last block advances the generation and clears the next step's counter, so no host work is
// needed between steps (CUDA-graph replays included).
#define IBP_STAGE_CLAIMING 0xFFFFFFFFu
#define IBP_STAGE_FULL 0xFFFFFFFEu

__device__ __forceinline__ i64 ibp_stage_lookup(const i64* __restrict__ stage_of, const i64* step_state, i64 gid,
                                                i64 stage_cap) {
    const unsigned long long tag = (unsigned long long)(step_state[0] + 1) & 0xFFFFFFFFull;
    const unsigned long long e = (unsigned long long)stage_of[gid];
    if ((e >> 32) != tag) return -1;
    const unsigned int idx = (unsigned int)(e & 0xFFFFFFFFull);
    return (idx < (unsigned int)stage_cap) ? (i64)idx : -1;
}

__device__ __forceinline__ void ibp_finish_step(i64* step_state) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned long long ticket = atomicAdd((unsigned long long*)&step_state[3], 1ULL);
        if (ticket == (unsigned long long)gridDim.x - 1) {  // the last block of the lookup
            const i64 gen = step_state[0];
            step_state[1 + ((gen + 1) & 1)] = 0;  // the next step's claim counter (last used two steps ago)
            step_state[3] = 0;
            __threadfence();
            step_state[0] = gen + 1;
        }
    }
}

// Warp per bag: lanes take the bag's ids 32 at a time; one counter atomic per warp per round (warp-aggregated), so
// the claim counter is no hotspot even when a step has millions of misses.
extern "C" __global__ void ibp_lookup_claim(IBP_LOOKUP_PARAMS, i64* __restrict__ stage_gid) {
    const i64 gen = step_state[0];
    const unsigned long long tag = (unsigned long long)(gen + 1) & 0xFFFFFFFFull;
    unsigned long long* counter = (unsigned long long*)&step_state[1 + (gen & 1)];
    const int lane = threadIdx.x & 31;
    const i64 warp = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 k = warp; k < n_bags; k += nwarps) {
        const i64 j = bag_order != nullptr ? bag_order[k] : k;
        int t;
        i64 s, start, end;
        bool bad_offsets;
        ibp_bag_place(j, n_tables, per_table, sample_major, bag_offsets, bag_size, n_bags, include_last, n_ids, t, s,
                      start, end, bad_offsets);
        const i64 limit = table_rows != nullptr ? table_rows[t] : n_rows;
        const i64 base = table_base != nullptr ? table_base[t] : 0;
        for (i64 p0 = start; p0 < end; p0 += 32) {  // uniform trip count across the warp
            const i64 p = p0 + lane;
            bool claimed = false;
            i64 gid = -1;
            unsigned long long* slot = nullptr;
            if (p < end) {
                const i64 id = ids[p];
                if (id >= 0 && id < limit) {  // bad ids are reported by the lookup
                    gid = id + base;
                    if (freq != nullptr) atomicAdd(&freq[gid], 1);
                    bool hit;
                    if (index_mode == IBP_INDEX_SLOTS || index_mode == IBP_INDEX_SLOT_TABLE) {
                        hit = reinterpret_cast<const int*>(table_values)[gid] != -1;
                    } else {
                        hit = ibp_index_find(index_mode, table_keys, table_values, capacity, max_probes, gid) !=
                              IBP_EMPTY_ENTRY;
                    }
                    if (!hit) {
                        slot = (unsigned long long*)&stage_of[gid];
                        const unsigned long long old = *((volatile unsigned long long*)slot);
                        if ((old >> 32) != tag) {
                            const unsigned long long claim = (tag << 32) | IBP_STAGE_CLAIMING;
                            claimed = atomicCAS(slot, old, claim) == old;
                        }
                    }
                }
            }
            const unsigned int mask = __ballot_sync(IBP_FULL, claimed);
            if (mask == 0) continue;
            unsigned long long first = 0;
            if (lane == __ffs(mask) - 1) first = atomicAdd(counter, (unsigned long long)__popc(mask));
            first = __shfl_sync(IBP_FULL, first, __ffs(mask) - 1);
            if (claimed) {
                const unsigned long long idx = first + __popc(mask & ((1u << lane) - 1u));
                if (idx < (unsigned long long)stage_cap) {
                    stage_gid[idx] = gid;
                    *slot = (tag << 32) | idx;
                } else {
                    *slot = (tag << 32) | IBP_STAGE_FULL;
                }
            }
        }
    }
}

// Warp per listed row: host row gids[k] -> its decoded row at dsts[k] (or base + k * row_bytes without dsts). A
// malformed row is reported (err) and written as zeros, so a reader taking it as raw gets zeros, never garbage.
// Stored bytes read are added to *host_bytes.
template <class K>
__device__ void ibp_decode_list(const i64* __restrict__ gids, const i64* __restrict__ dsts, unsigned char* base, i64 n,
                                i64 host_base, const i64* __restrict__ host_offsets, i64 host_stride,
                                const int* __restrict__ host_lengths, int row_bytes, int codec_n,
                                const u64* __restrict__ codec_a, const u64* __restrict__ codec_b,
                                u64* __restrict__ host_bytes_out, int* err) {
    __shared__ uint4 sdec[IBP_WARPS_PER_BLOCK][K::SMEM_VEC];
    const K codec(row_bytes, codec_n, codec_a, codec_b);
    const int lane = threadIdx.x & 31;
    uint4* smem = sdec[threadIdx.x >> 5];
    const i64 warp = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
    u64 host_bytes = 0;
    for (i64 k = warp; k < n; k += nwarps) {
        const i64 gid = gids[k];
        const unsigned char* src =
            reinterpret_cast<const unsigned char*>(host_base + (host_offsets != nullptr ? host_offsets[gid] : gid * host_stride));
        int len = host_lengths != nullptr ? host_lengths[gid] : row_bytes;
        const bool comp = len < row_bytes;
        if (!comp) len = row_bytes;
        unsigned char* dst = dsts != nullptr ? reinterpret_cast<unsigned char*>(dsts[k]) : base + k * (i64)row_bytes;
        if (!codec.decode(src, len, comp, dst, smem, lane)) {
            if (lane == 0) ibp_report_corrupt_row(err, 0);
            __syncwarp();  // partial output some lanes wrote is ordered before the zeros (a vote does not order memory)
            for (int b = lane; b < row_bytes; b += 32) dst[b] = 0;
        }
        host_bytes += (u64)len;
    }
    if (lane == 0 && host_bytes_out != nullptr && host_bytes != 0) atomicAdd(host_bytes_out, host_bytes);
}

// STAGE: warp per claimed row, host -> decoded row in the staging buffer (device memory).
// FILL: warp per entry of a row cache's admission list (kernels/admit.cu: list_gid, list_dst, the count at *count),
// host row -> decoded row in its slot or staging row. Why: a cache holding decoded rows in front of compressed host
// rows serves its hits at copy speed (dense float rows decode several times slower than they copy from device
// memory) and decodes each admitted row once, while its misses still cross PCIe compressed.
#define IBP_LOOKUP_STAGE(NAME, K)                                                                               \
    extern "C" __global__ void __launch_bounds__(32 * IBP_WARPS_PER_BLOCK) ibp_lookup_stage_##NAME(             \
        const i64* stage_gid, const i64* step_state, i64 stage_cap, unsigned char* staging, i64 host_base,      \
        const i64* host_offsets, i64 host_stride, const int* host_lengths, int row_bytes, int codec_n,          \
        const u64* codec_a, const u64* codec_b, u64* counters, int* err) {                                      \
        const i64 n = step_state[1 + (step_state[0] & 1)];                                                      \
        ibp_decode_list<K>(stage_gid, nullptr, staging, n < stage_cap ? n : stage_cap, host_base, host_offsets,  \
                           host_stride, host_lengths, row_bytes, codec_n, codec_a, codec_b,                     \
                           counters != nullptr ? counters + IBP_COUNTER_HOST_BYTES : nullptr, err);             \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * IBP_WARPS_PER_BLOCK) ibp_lookup_fill_##NAME(              \
        const i64* list_gid, const i64* list_dst, const i64* count, i64 max_n, i64 host_base,                   \
        const i64* host_offsets, i64 host_stride, const int* host_lengths, int row_bytes, int codec_n,          \
        const u64* codec_a, const u64* codec_b, u64* host_bytes, int* err) {                                    \
        const i64 n = *count;                                                                                   \
        ibp_decode_list<K>(list_gid, list_dst, nullptr, n < max_n ? n : max_n, host_base, host_offsets,         \
                           host_stride, host_lengths, row_bytes, codec_n, codec_a, codec_b, host_bytes, err);   \
    }

// Where a row is read by the lookup: its slab entry on a hit, else its staging row (claimed this step), else the
// host store. Host bytes of staged rows were counted by STAGE; a staged row counts as a miss with 0 host bytes here.
__device__ __forceinline__ IbpRowSource ibp_lookup_source(i64 gid, int index_mode, const i64* table_keys,
                                                          const i64* table_values, i64 capacity, int max_probes,
                                                          const i64* slab_bases, i64 host_base,
                                                          const i64* host_offsets, i64 host_stride,
                                                          const int* host_lengths, int row_bytes,
                                                          const i64* stage_of, const i64* step_state,
                                                          const unsigned char* staging, i64 stage_cap,
                                                          bool& staged) {
    IbpRowSource r = ibp_row_source(gid, index_mode, table_keys, table_values, capacity, max_probes, slab_bases,
                                    host_base, host_offsets, host_stride, host_lengths, row_bytes);
    staged = false;
    if (!r.hit && staging != nullptr) {
        const i64 k = ibp_stage_lookup(stage_of, step_state, gid, stage_cap);
        if (k >= 0) {
            r.src = staging + k * (i64)row_bytes;
            r.len = row_bytes;
            r.comp = false;
            staged = true;
        }
    }
    return r;
}

// The sum over the group's lanes r < G of a per-lane count (every lane gets it); with G == 1 lane 0's own count,
// which every lane shares then (no shuffle: IBP kernels, whose G is the constant 1, keep their uniform counts).
__device__ __forceinline__ u64 ibp_group_sum(u64 v, int G, int lane) {
    if (G == 1) return v;
    v = lane < G ? v : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(IBP_FULL, v, o);
    return v;
}

// Zero the output rows of the group whose bit is set in `rows` (dst of row r held by lane r), with the whole warp.
__device__ __forceinline__ void ibp_zero_group_rows(unsigned rows, unsigned char* dst, int row_bytes, int lane) {
    if (rows == 0u) return;
    __syncwarp();  // partial output some lanes wrote is ordered before the zeros (a vote does not order memory)
    while (rows != 0u) {
        const int r = __ffs(rows) - 1;
        unsigned char* d = reinterpret_cast<unsigned char*>(
            __shfl_sync(IBP_FULL, reinterpret_cast<unsigned long long>(dst), r));
        for (int b = lane; b < row_bytes; b += 32) d[b] = 0;
        rows &= rows - 1u;
    }
}

// ROWS: one id per bag, decoded straight into its output row. A warp takes G consecutive bags of its loop at a
// time (K::group_rows: 1 for IBP, several narrow exponent rows); lane L resolves bag L % G (index probe, source),
// then the warp decodes the group. 8 warps per block.
template <class K>
__device__ __forceinline__ void ibp_lookup_rows_grouped(IBP_LOOKUP_PARAMS) {
    __shared__ uint4 sdec[IBP_WARPS_PER_BLOCK][K::SMEM_VEC];
    const K codec(row_bytes, codec_n, codec_a, codec_b);
    const int lane = threadIdx.x & 31;
    uint4* smem = sdec[threadIdx.x >> 5];
    const int G = codec.group_rows(32);
    const int r = lane % G;  // the group's row this lane resolves
    const i64 warp = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
    u64 requests = 0, hits = 0, host_bytes = 0, slab_bytes = 0;  // of this lane's rows (summed over lanes r < G)
    for (i64 k0 = warp * G; k0 < n_bags; k0 += nwarps * G) {
        const i64 k = k0 + r;
        const bool live = k < n_bags;  // the last group may be short
        unsigned char* dst = nullptr;
        bool bad = false, staged = false;
        int t = 0;
        i64 gid = 0;
        IbpRowSource src = {nullptr, 0, false, false};
        if (live) {
            const i64 j = bag_order != nullptr ? bag_order[k] : k;  // bags sorted by row: host reads in address order
            i64 s, start, end;
            bool bad_offsets;
            ibp_bag_place(j, n_tables, per_table, sample_major, bag_offsets, bag_size, n_bags, include_last, n_ids, t,
                          s, start, end, bad_offsets);
            dst = out + ((i64)s * n_tables + t) * (i64)row_bytes;
            const i64 limit = table_rows != nullptr ? table_rows[t] : n_rows;
            const i64 id = start < end ? ids[start] : -1;
            bad = id < 0 || id >= limit;
            if (bad) {
                if (lane < G) ibp_report_bad_id(err, t);
            } else {
                gid = id + (table_base != nullptr ? table_base[t] : 0);
                src = ibp_lookup_source(gid, index_mode, table_keys, table_values, capacity, max_probes, slab_bases,
                                        host_base, host_offsets, host_stride, host_lengths, row_bytes, stage_of,
                                        step_state, staging, stage_cap, staged);
            }
        }
        const bool fetch = live && !bad;
        const unsigned corrupt = codec.decode_group(G, src.src, src.len, src.comp, fetch ? dst : nullptr, smem, lane);
        const bool mine_corrupt = fetch && ((corrupt >> r) & 1u);
        if (mine_corrupt && lane < G) ibp_report_corrupt_row(err, t);
        // a bad id's output row is zeros, as is a malformed row's
        ibp_zero_group_rows(__ballot_sync(IBP_FULL, lane < G && live && (bad || mine_corrupt)), dst, row_bytes, lane);
        if (fetch) {
            requests += 1;
            if (src.hit) {
                hits += 1;
                slab_bytes += (u64)src.len;
            } else if (!staged) {
                host_bytes += (u64)src.len;
            }
            if (freq != nullptr && staging == nullptr && lane < G) atomicAdd(&freq[gid], 1);
        }
    }
    ibp_flush_counters(counters, lane, ibp_group_sum(requests, G, lane), ibp_group_sum(hits, G, lane),
                       ibp_group_sum(host_bytes, G, lane), ibp_group_sum(slab_bytes, G, lane));
    if (staging != nullptr) ibp_finish_step(step_state);
}

// SUM / MEAN / MAX over each bag, rows of at most IBP_POOL_MAX_ROW bytes and 32 * PER_LANE elements. A warp takes
// the bag's ids G at a time (K::group_rows, capped by the row buffer; 1 for IBP): lane L resolves id L % G, the
// warp decodes the G rows into its shared row buffer (row r at r * row_bytes), then folds them in the bag's order,
// every lane its elements (e = lane + 32 k) into float registers, so the summation order is the one of a
// row-by-row loop (torch's).
template <class K, int PER_LANE>
__device__ __forceinline__ void ibp_lookup_pool_grouped(int op, int elem, const float* __restrict__ psw, IBP_LOOKUP_PARAMS) {
    __shared__ uint4 sdec[IBP_POOL_WARPS][K::SMEM_VEC];
    __shared__ uint4 srow[IBP_POOL_WARPS][IBP_POOL_MAX_ROW / 16];
    const K codec(row_bytes, codec_n, codec_a, codec_b);
    const int lane = threadIdx.x & 31;
    uint4* smem = sdec[threadIdx.x >> 5];
    unsigned char* rowbuf = reinterpret_cast<unsigned char*>(srow[threadIdx.x >> 5]);
    const int G = codec.group_rows(IBP_POOL_MAX_ROW / row_bytes);
    const int r = lane % G;  // the group's row this lane resolves
    unsigned char* myrow = rowbuf + r * row_bytes;
    const int elem_bytes = elem == IBP_ELEM_F32 ? 4 : 2;
    const int dim = row_bytes / elem_bytes;
    const i64 warp = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
    u64 requests = 0, hits = 0, host_bytes = 0, slab_bytes = 0;  // of this lane's rows (summed over lanes r < G)
    for (i64 k = warp; k < n_bags; k += nwarps) {
        const i64 j = bag_order != nullptr ? bag_order[k] : k;  // e.g. bags sorted by row: host reads in address order
        int t;
        i64 s, start, end;
        bool bad_offsets;
        ibp_bag_place(j, n_tables, per_table, sample_major, bag_offsets, bag_size, n_bags, include_last, n_ids, t, s,
                      start, end, bad_offsets);
        if (bad_offsets && lane == 0) ibp_report_bad_offsets(err, j);
        const i64 limit = table_rows != nullptr ? table_rows[t] : n_rows;
        const i64 base = table_base != nullptr ? table_base[t] : 0;
        float acc[PER_LANE];  // acc[q]: element lane + 32 q of the bag's output row
#pragma unroll
        for (int q = 0; q < PER_LANE; ++q) acc[q] = 0.0f;
        int count = 0;
        for (i64 p0 = start; p0 < end; p0 += G) {
            const i64 p = p0 + r;
            const bool live = p < end;  // the bag's last group may be short
            const i64 id = live ? ids[p] : 0;
            const bool bad = live && (id < 0 || id >= limit);
            if (bad && lane < G) ibp_report_bad_id(err, t);
            const bool fetch = live && !bad;
            const i64 gid = id + base;
            bool staged = false;
            IbpRowSource src = {nullptr, 0, false, false};
            if (fetch)
                src = ibp_lookup_source(gid, index_mode, table_keys, table_values, capacity, max_probes, slab_bases,
                                        host_base, host_offsets, host_stride, host_lengths, row_bytes, stage_of,
                                        step_state, staging, stage_cap, staged);
            const unsigned corrupt =
                codec.decode_group(G, src.src, src.len, src.comp, fetch ? myrow : nullptr, smem, lane);
            const bool used = fetch && !((corrupt >> r) & 1u);  // a malformed row pools nothing
            if (fetch && !used && lane < G) ibp_report_corrupt_row(err, t);
            const unsigned use = __ballot_sync(IBP_FULL, lane < G && used);
            __syncwarp();
            for (int q0 = 0; q0 < G; ++q0) {  // the group's rows in the bag's order
                if (!((use >> q0) & 1u)) continue;  // uniform
                const unsigned char* row = rowbuf + q0 * row_bytes;
                const float w = psw != nullptr ? psw[p0 + q0] : 1.0f;
#pragma unroll
                for (int q = 0; q < PER_LANE; ++q) {
                    const int e = lane + 32 * q;
                    if (e < dim) {
                        const float v = ibp_elem_load(row, e, elem);
                        if (op == IBP_OP_MAX) {
                            if (count == 0 || v > acc[q]) acc[q] = v;
                        } else if (psw != nullptr) {
                            acc[q] = fmaf(v, w, acc[q]);
                        } else {
                            acc[q] = acc[q] + v;
                        }
                    }
                }
                count += 1;
            }
            __syncwarp();
            if (used) {
                requests += 1;
                if (src.hit) {
                    hits += 1;
                    slab_bytes += (u64)src.len;
                } else if (!staged) {
                    host_bytes += (u64)src.len;
                }
                if (freq != nullptr && staging == nullptr && lane < G) atomicAdd(&freq[gid], 1);
            }
        }
        unsigned char* dst = out + ((i64)s * n_tables + t) * (i64)row_bytes;
#pragma unroll
        for (int q = 0; q < PER_LANE; ++q) {
            const int e = lane + 32 * q;
            if (e < dim) {
                float v = acc[q];
                if (op == IBP_OP_MEAN && count > 0) v = v / (float)count;
                ibp_elem_store(dst, e, elem, v);
            }
        }
    }
    ibp_flush_counters(counters, lane, ibp_group_sum(requests, G, lane), ibp_group_sum(hits, G, lane),
                       ibp_group_sum(host_bytes, G, lane), ibp_group_sum(slab_bytes, G, lane));
    if (staging != nullptr) ibp_finish_step(step_state);
}

// One-row-per-warp forms of the two loops above, for codec kinds that never group rows (IBP, raw rows): the grouped
// loops with G == 1 compute the same bytes, but their per-row vote and group bookkeeping cost about a fifth of the
// throughput of raw 128-768 B cache hits (measured on an H200), so those kinds keep this plain loop.
template <class K>
__device__ __forceinline__ void ibp_lookup_rows_one(IBP_LOOKUP_PARAMS) {
    __shared__ uint4 sdec[IBP_WARPS_PER_BLOCK][K::SMEM_VEC];
    const K codec(row_bytes, codec_n, codec_a, codec_b);
    const int lane = threadIdx.x & 31;
    uint4* smem = sdec[threadIdx.x >> 5];
    const i64 warp = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
    u64 requests = 0, hits = 0, host_bytes = 0, slab_bytes = 0;
    for (i64 k = warp; k < n_bags; k += nwarps) {
        const i64 j = bag_order != nullptr ? bag_order[k] : k;  // e.g. bags sorted by row: host reads in address order
        int t;
        i64 s, start, end;
        bool bad_offsets;
        ibp_bag_place(j, n_tables, per_table, sample_major, bag_offsets, bag_size, n_bags, include_last, n_ids, t, s,
                      start, end, bad_offsets);
        unsigned char* dst = out + ((i64)s * n_tables + t) * (i64)row_bytes;
        const i64 limit = table_rows != nullptr ? table_rows[t] : n_rows;
        const i64 id = start < end ? ids[start] : -1;
        if (id < 0 || id >= limit) {
            if (lane == 0) ibp_report_bad_id(err, t);
            for (int b = lane; b < row_bytes; b += 32) dst[b] = 0;
            continue;
        }
        const i64 gid = id + (table_base != nullptr ? table_base[t] : 0);
        bool staged;
        IbpRowSource r = ibp_lookup_source(gid, index_mode, table_keys, table_values, capacity, max_probes, slab_bases,
                                           host_base, host_offsets, host_stride, host_lengths, row_bytes, stage_of,
                                           step_state, staging, stage_cap, staged);
        if (!codec.decode(r.src, r.len, r.comp, dst, smem, lane)) {
            if (lane == 0) ibp_report_corrupt_row(err, t);
            __syncwarp();  // partial output some lanes wrote is ordered before the zeros (a vote does not order memory)
            for (int b = lane; b < row_bytes; b += 32) dst[b] = 0;
        }
        requests += 1;
        if (r.hit) {
            hits += 1;
            slab_bytes += (u64)r.len;
        } else if (!staged) {
            host_bytes += (u64)r.len;
        }
        if (freq != nullptr && staging == nullptr && lane == 0) atomicAdd(&freq[gid], 1);
    }
    ibp_flush_counters(counters, lane, requests, hits, host_bytes, slab_bytes);
    if (staging != nullptr) ibp_finish_step(step_state);
}

template <class K, int PER_LANE>
__device__ __forceinline__ void ibp_lookup_pool_one(int op, int elem, const float* __restrict__ psw, IBP_LOOKUP_PARAMS) {
    __shared__ uint4 sdec[IBP_POOL_WARPS][K::SMEM_VEC];
    __shared__ uint4 srow[IBP_POOL_WARPS][IBP_POOL_MAX_ROW / 16];
    const K codec(row_bytes, codec_n, codec_a, codec_b);
    const int lane = threadIdx.x & 31;
    uint4* smem = sdec[threadIdx.x >> 5];
    unsigned char* rowbuf = reinterpret_cast<unsigned char*>(srow[threadIdx.x >> 5]);
    const int elem_bytes = elem == IBP_ELEM_F32 ? 4 : 2;
    const int dim = row_bytes / elem_bytes;
    const i64 warp = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
    u64 requests = 0, hits = 0, host_bytes = 0, slab_bytes = 0;
    for (i64 k = warp; k < n_bags; k += nwarps) {
        const i64 j = bag_order != nullptr ? bag_order[k] : k;  // e.g. bags sorted by row: host reads in address order
        int t;
        i64 s, start, end;
        bool bad_offsets;
        ibp_bag_place(j, n_tables, per_table, sample_major, bag_offsets, bag_size, n_bags, include_last, n_ids, t, s,
                      start, end, bad_offsets);
        if (bad_offsets && lane == 0) ibp_report_bad_offsets(err, j);
        const i64 limit = table_rows != nullptr ? table_rows[t] : n_rows;
        const i64 base = table_base != nullptr ? table_base[t] : 0;
        float acc[PER_LANE];  // acc[q]: element lane + 32 q of the bag's output row
#pragma unroll
        for (int q = 0; q < PER_LANE; ++q) acc[q] = 0.0f;
        int count = 0;
        for (i64 p = start; p < end; ++p) {
            const i64 id = ids[p];
            if (id < 0 || id >= limit) {
                if (lane == 0) ibp_report_bad_id(err, t);
                continue;
            }
            const i64 gid = id + base;
            bool staged;
            IbpRowSource r = ibp_lookup_source(gid, index_mode, table_keys, table_values, capacity, max_probes,
                                               slab_bases, host_base, host_offsets, host_stride, host_lengths,
                                               row_bytes, stage_of, step_state, staging, stage_cap, staged);
            if (!codec.decode(r.src, r.len, r.comp, rowbuf, smem, lane)) {  // uniform across the warp
                if (lane == 0) ibp_report_corrupt_row(err, t);
                continue;  // a malformed row pools nothing (rowbuf is rewritten by the next decode)
            }
            __syncwarp();
            const float w = psw != nullptr ? psw[p] : 1.0f;
#pragma unroll
            for (int q = 0; q < PER_LANE; ++q) {
                const int e = lane + 32 * q;
                if (e < dim) {
                    const float v = ibp_elem_load(rowbuf, e, elem);
                    if (op == IBP_OP_MAX) {
                        if (count == 0 || v > acc[q]) acc[q] = v;
                    } else if (psw != nullptr) {
                        acc[q] = fmaf(v, w, acc[q]);
                    } else {
                        acc[q] = acc[q] + v;
                    }
                }
            }
            __syncwarp();
            count += 1;
            requests += 1;
            if (r.hit) {
                hits += 1;
                slab_bytes += (u64)r.len;
            } else if (!staged) {
                host_bytes += (u64)r.len;
            }
            if (freq != nullptr && staging == nullptr && lane == 0) atomicAdd(&freq[gid], 1);
        }
        unsigned char* dst = out + ((i64)s * n_tables + t) * (i64)row_bytes;
#pragma unroll
        for (int q = 0; q < PER_LANE; ++q) {
            const int e = lane + 32 * q;
            if (e < dim) {
                float v = acc[q];
                if (op == IBP_OP_MEAN && count > 0) v = v / (float)count;
                ibp_elem_store(dst, e, elem, v);
            }
        }
    }
    ibp_flush_counters(counters, lane, requests, hits, host_bytes, slab_bytes);
    if (staging != nullptr) ibp_finish_step(step_state);
}

// ---- one-id bags of the IBP and raw kinds, several per warp ----------------------------------------------
// Bags of one id (one-hot features, the embedding bags' "single" step; op ROWS is the plain row fetch) with G bags
// per warp at once: lane r < G resolves bag r (index probe, source), then the warp reads the group's raw rows
// together, IBP_SINGLE_UNROLL 16-byte words per lane loaded before any is stored, and pools (or copies) them from
// registers straight into the output rows. Why: the bag loop serves a one-id bag with one row per warp in flight
// (probe, read, pool, one after another), so raw cache hits from HBM were latency-bound (~400 GB/s of 512 B rows
// on an H200); a group keeps G probes and G rows in flight per warp. A group holding a compressed row, or a row
// not 16-byte aligned, is decoded one row at a time through the warp's row buffer, as the bag loop does. Values
// are the bag loop's (ibp_pool_one_value); a bag that pooled nothing (bad id) is zeros.
#ifndef IBP_SINGLE_UNROLL
#define IBP_SINGLE_UNROLL 8
#endif
#define IBP_SINGLE_MIN_BAGS 4

// G for rows of row_bytes: one round of IBP_SINGLE_UNROLL words per lane covers the group, 4 <= G <= 32.
__device__ __forceinline__ int ibp_single_bags(int row_bytes) {
    const int n16 = (row_bytes + 15) >> 4;
    return max(IBP_SINGLE_MIN_BAGS, min(32, 32 * IBP_SINGLE_UNROLL / n16));
}

// One one-id bag as the lane resolving it sees it.
struct IbpSingleBag {
    unsigned char* dst;  // its output row
    IbpRowSource src;
    i64 gid;
    float w;  // its per-sample weight (1 without)
    int t;
    bool live, bad, staged;
};

__device__ __forceinline__ IbpSingleBag ibp_single_bag(i64 k, const float* __restrict__ psw, IBP_LOOKUP_PARAMS) {
    IbpSingleBag b;
    b.dst = nullptr;
    b.src = {nullptr, 0, false, false};
    b.gid = 0;
    b.w = 1.0f;
    b.t = 0;
    b.live = k < n_bags;  // the last group may be short
    b.bad = false;
    b.staged = false;
    if (!b.live) return b;
    const i64 j = bag_order != nullptr ? bag_order[k] : k;  // e.g. bags sorted by row: host reads in address order
    i64 s, start, end;
    bool bad_offsets;  // never: fixed bags of one id
    ibp_bag_place(j, n_tables, per_table, sample_major, bag_offsets, bag_size, n_bags, include_last, n_ids, b.t, s,
                  start, end, bad_offsets);
    b.dst = out + ((i64)s * n_tables + b.t) * (i64)row_bytes;
    const i64 limit = table_rows != nullptr ? table_rows[b.t] : n_rows;
    const i64 id = ids[start];
    b.bad = id < 0 || id >= limit;
    if (!b.bad) {
        b.gid = id + (table_base != nullptr ? table_base[b.t] : 0);
        b.src = ibp_lookup_source(b.gid, index_mode, table_keys, table_values, capacity, max_probes, slab_bases,
                                  host_base, host_offsets, host_stride, host_lengths, row_bytes, stage_of, step_state,
                                  staging, stage_cap, b.staged);
    }
    if (psw != nullptr) b.w = psw[start];
    return b;
}

// What a one-id bag's lane adds up: a fetched row that pooled nothing was malformed (reported once, by the lane
// `mine` resolving it); a used row is a request, and a hit (slab bytes) or a host read (host bytes; staged rows were
// counted when staged), and adds to freq (nullptr: no counting).
__device__ __forceinline__ void ibp_single_account(const IbpSingleBag& b, bool fetch, bool used, bool mine, int* err,
                                                   int* freq, u64& requests, u64& hits, u64& host_bytes,
                                                   u64& slab_bytes) {
    if (fetch && !used && mine) ibp_report_corrupt_row(err, b.t);
    if (!used) return;
    requests += 1;
    if (b.src.hit) {
        hits += 1;
        slab_bytes += (u64)b.src.len;
    } else if (!b.staged) {
        host_bytes += (u64)b.src.len;
    }
    if (freq != nullptr && mine) atomicAdd(&freq[b.gid], 1);
}

// May the group take ibp_single_group_direct? (every lane votes; `mine`: the lane resolves one of the group's bags)
// Its output row is 16-byte aligned and, if it fetches a row, that row is raw and 16-byte aligned too.
__device__ __forceinline__ bool ibp_single_direct_ok(const IbpSingleBag& b, bool fetch, int row_bytes, bool mine) {
    if (!mine || !b.live) return true;
    return fetch ? (!b.src.comp && ibp_copy_aligned(b.src.src, b.dst, row_bytes))
                 : ibp_copy_aligned(b.dst, b.dst, row_bytes);
}

// The group's rows, all raw and 16-byte aligned, read and pooled (op ROWS: copied) word by word: word i of the
// group is word i % n16 of row i / n16, held by lane q = i / n16's bag (fetch: its bit in `fetched`; live bags
// without a row get zeros). U: 16-byte words per lane loaded before any is stored.
template <int U>
__device__ __forceinline__ void ibp_single_group_direct(int G, int row_bytes, const unsigned char* src,
                                                        unsigned char* dst, float w, unsigned live, unsigned fetched,
                                                        int op, int elem, bool weighted, int lane) {
    const int n16 = row_bytes >> 4;
    const int total = G * n16;
    for (int i0 = 0; i0 < total; i0 += 32 * U) {
        uint4 x[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = i0 + lane + 32 * u;
            const int q = min(i, total - 1) / n16;
            const uint4* s = reinterpret_cast<const uint4*>(
                __shfl_sync(IBP_FULL, reinterpret_cast<unsigned long long>(src), q));
            x[u] = make_uint4(0u, 0u, 0u, 0u);
            if (i < total && ((fetched >> q) & 1u)) x[u] = s[i - q * n16];
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = i0 + lane + 32 * u;
            const int q = min(i, total - 1) / n16;
            uint4* d = reinterpret_cast<uint4*>(__shfl_sync(IBP_FULL, reinterpret_cast<unsigned long long>(dst), q));
            const float wq = __shfl_sync(IBP_FULL, w, q);
            if (i < total && ((live >> q) & 1u)) {
                const bool has = (fetched >> q) & 1u;
                d[i - q * n16] = (has && op != IBP_OP_ROWS) ? ibp_pool_one_word(x[u], op, elem, weighted, wq) : x[u];
            }
        }
    }
}

// A group with a compressed or unaligned row: row by row, decoded by the whole warp (ROWS: into its output row;
// pooling: into the row buffer, then pooled). Returns the mask of the group's bags that pooled (or fetched) a row.
template <class K>
__device__ __forceinline__ unsigned ibp_single_group_rows(const K& codec, uint4* smem, unsigned char* rowbuf, int G,
                                                          const IbpSingleBag& b, unsigned live, unsigned fetched,
                                                          int op, int elem, bool weighted, int row_bytes, int lane) {
    const int dim = row_bytes / (elem == IBP_ELEM_F32 ? 4 : 2);
    unsigned used = 0u;
    for (int q = 0; q < G; ++q) {
        if (!((live >> q) & 1u)) continue;  // uniform
        const unsigned char* src = reinterpret_cast<const unsigned char*>(
            __shfl_sync(IBP_FULL, reinterpret_cast<unsigned long long>(b.src.src), q));
        const int len = __shfl_sync(IBP_FULL, b.src.len, q);
        const bool comp = __shfl_sync(IBP_FULL, (int)b.src.comp, q) != 0;
        unsigned char* dst = reinterpret_cast<unsigned char*>(
            __shfl_sync(IBP_FULL, reinterpret_cast<unsigned long long>(b.dst), q));
        const float w = __shfl_sync(IBP_FULL, b.w, q);
        const bool has = (fetched >> q) & 1u;
        bool ok = false;
        if (has) ok = codec.decode(src, len, comp, op == IBP_OP_ROWS ? dst : rowbuf, smem, lane);  // uniform
        __syncwarp();  // the decoded row (or a malformed row's partial output) is visible to every lane
        if (op == IBP_OP_ROWS) {
            if (!ok) for (int c = lane; c < row_bytes; c += 32) dst[c] = 0;
        } else {
            for (int e = lane; e < dim; e += 32) {
                const float v = ok ? ibp_pool_one_value(ibp_elem_load(rowbuf, e, elem), op, weighted, w) : 0.0f;
                ibp_elem_store(dst, e, elem, v);
            }
        }
        __syncwarp();  // the row buffer is free for the next row
        used |= (ok ? 1u : 0u) << q;
    }
    return used;
}

// SUM / MEAN / MAX of one-id bags of the grouped exponent kinds (bag_offsets == nullptr, bag_size == 1: one-hot
// features, the embedding bags' "single" step, and what the layout planner times; kernels
// ibp_lookup_pool_single_NAME, picked by lookup.py): G bags per warp at once (ibp_lookup_single_bags), the warp
// decoding the G rows into its row buffer before writing each bag's output row. Why: ibp_lookup_pool_grouped groups
// the ids of ONE bag, so a bag of one id decodes one row per warp and only its n_seg lanes walk codewords (2 of 32 for
// a 512 B exponent row); grouping across bags, as ibp_lookup_rows_grouped does, puts G * n_seg walks on the warp.
// Each value is computed as the bag loop computes a bag of one id (from 0: one add, fma or first-value max; MEAN
// divides by the count, 1); a bag that pooled nothing (bad id, malformed row) is zeros, as there.
// Words per lane in flight on the exponent kinds' direct path: fewer than the IBP kinds' IBP_SINGLE_UNROLL, which
// would raise ibp_lookup_pool_single_e4 from 96 to 128 registers (fewer resident warps for its misses' decode).
#ifndef IBP_EXP_SINGLE_UNROLL
#define IBP_EXP_SINGLE_UNROLL 4
#endif
// One group of exponent-kind one-id bags the direct path cannot take: the warp decodes the G rows at once
// (decode_group: G * n_seg codeword walks) into its row buffer, then writes each bag's output row; returns the bags
// that pooled.
template <class K>
__device__ __forceinline__ unsigned ibp_single_group_decoded(const K& codec, uint4* smem, unsigned char* rowbuf,
                                                             int G, const IbpSingleBag& b, unsigned live,
                                                             unsigned fetched, int op, int elem, bool weighted,
                                                             int row_bytes, int lane) {
    const int r = lane % G;
    const bool fetch = (fetched >> r) & 1u;
    const int dim = row_bytes / (elem == IBP_ELEM_F32 ? 4 : 2);
    const unsigned corrupt = codec.decode_group(G, b.src.src, b.src.len, b.src.comp,
                                                fetch ? rowbuf + r * row_bytes : nullptr, smem, lane);
    const unsigned use = __ballot_sync(IBP_FULL, lane < G && fetch && !((corrupt >> r) & 1u));  // malformed: nothing
    __syncwarp();  // the decoded rows are visible to every lane
    for (int q0 = 0; q0 < G; ++q0) {
        if (!((live >> q0) & 1u)) continue;  // uniform
        unsigned char* bag_dst = reinterpret_cast<unsigned char*>(
            __shfl_sync(IBP_FULL, reinterpret_cast<unsigned long long>(b.dst), q0));
        const float bw = __shfl_sync(IBP_FULL, b.w, q0);
        const bool pooled = (use >> q0) & 1u;
        const unsigned char* row = rowbuf + q0 * row_bytes;
        for (int e = lane; e < dim; e += 32) {
            const float v = pooled ? ibp_pool_one_value(ibp_elem_load(row, e, elem), op, weighted, bw)
                                   : 0.0f;  // a bag that pooled nothing
            ibp_elem_store(bag_dst, e, elem, v);
        }
    }
    __syncwarp();  // the row buffer is free for the next group
    return use;
}

// The one-id-bag loop of every kind: groups of G bags per warp, lane L resolving bag L % G (ibp_single_bag). A group
// whose rows are all raw and 16-byte aligned is read and pooled word by word (ibp_single_group_direct); any other
// group is decoded row by row (IBP and raw kinds: ibp_single_group_rows) or all at once (the grouped exponent
// kinds: ibp_single_group_decoded). A bad id or malformed row pools nothing (zeros).
template <class K>
__device__ __forceinline__ void ibp_lookup_single_bags(const K& codec, uint4* smem, unsigned char* rowbuf, int op,
                                                       int elem, const float* __restrict__ psw, IBP_LOOKUP_PARAMS) {
    const int lane = threadIdx.x & 31;
    int G;
    if constexpr (K::GROUPED) {
        G = codec.group_rows(IBP_POOL_MAX_ROW / row_bytes);
    } else {
        G = ibp_single_bags(row_bytes);
    }
    const int r = lane % G;  // the group's bag this lane resolves
    const bool weighted = psw != nullptr;
    const i64 warp = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
    u64 requests = 0, hits = 0, host_bytes = 0, slab_bytes = 0;  // of this lane's bags (summed over lanes r < G)
    for (i64 k0 = warp * G; k0 < n_bags; k0 += nwarps * G) {
        const IbpSingleBag b = ibp_single_bag(k0 + r, psw, IBP_LOOKUP_ARGS);
        if (b.bad && lane < G) ibp_report_bad_id(err, b.t);
        const bool fetch = b.live && !b.bad;
        const unsigned live = __ballot_sync(IBP_FULL, lane < G && b.live);
        const unsigned fetched = __ballot_sync(IBP_FULL, lane < G && fetch);
        unsigned used;
        if (__all_sync(IBP_FULL, ibp_single_direct_ok(b, fetch, row_bytes, lane < G))) {
            ibp_single_group_direct<K::GROUPED ? IBP_EXP_SINGLE_UNROLL : IBP_SINGLE_UNROLL>(
                G, row_bytes, b.src.src, b.dst, b.w, live, fetched, op, elem, weighted, lane);
            used = fetched;
        } else if constexpr (K::GROUPED) {
            used = ibp_single_group_decoded<K>(codec, smem, rowbuf, G, b, live, fetched, op, elem, weighted,
                                               row_bytes, lane);
        } else {
            used = ibp_single_group_rows<K>(codec, smem, rowbuf, G, b, live, fetched, op, elem, weighted, row_bytes,
                                            lane);
        }
        ibp_single_account(b, fetch, (used >> r) & 1u, lane < G, err, staging == nullptr ? freq : nullptr, requests,
                           hits, host_bytes, slab_bytes);
    }
    ibp_flush_counters(counters, lane, ibp_group_sum(requests, G, lane), ibp_group_sum(hits, G, lane),
                       ibp_group_sum(host_bytes, G, lane), ibp_group_sum(slab_bytes, G, lane));
    if (staging != nullptr) ibp_finish_step(step_state);
}

template <class K>
__device__ __forceinline__ void ibp_lookup_rows_impl(IBP_LOOKUP_PARAMS) {
    if constexpr (K::GROUPED) {
        ibp_lookup_rows_grouped<K>(IBP_LOOKUP_ARGS);
    } else {
        ibp_lookup_rows_one<K>(IBP_LOOKUP_ARGS);
    }
}

template <class K, int PER_LANE>
__device__ __forceinline__ void ibp_lookup_pool_impl(int op, int elem, const float* __restrict__ psw,
                                                     IBP_LOOKUP_PARAMS) {
    if constexpr (K::GROUPED) {
        ibp_lookup_pool_grouped<K, PER_LANE>(op, elem, psw, IBP_LOOKUP_ARGS);
    } else {
        ibp_lookup_pool_one<K, PER_LANE>(op, elem, psw, IBP_LOOKUP_ARGS);
    }
}

// The kernels of one codec kind: ibp_lookup_{stage,rows,pool,pool_wide}_NAME; LB: their launch bounds (IBP_LB, or
// IBP_EXP_LB for the exponent kinds).
#define IBP_LOOKUP(NAME, K, LB)                                                                                 \
    IBP_LOOKUP_STAGE(NAME, K)                                                                                   \
    extern "C" __global__ void LB(32 * IBP_WARPS_PER_BLOCK)                                                     \
        ibp_lookup_rows_##NAME(IBP_LOOKUP_PARAMS) {                                                             \
        IBP_OUT_FROM_REF;                                                                                       \
        ibp_lookup_rows_impl<K>(IBP_LOOKUP_ARGS);                                                               \
    }                                                                                                           \
    extern "C" __global__ void LB(32 * IBP_POOL_WARPS)                                                          \
        ibp_lookup_pool_##NAME(int op, int elem, const float* psw, IBP_LOOKUP_PARAMS) {                         \
        IBP_OUT_FROM_REF;                                                                                       \
        ibp_lookup_pool_impl<K, IBP_POOL_PER_LANE>(op, elem, psw, IBP_LOOKUP_ARGS);                             \
    }                                                                                                           \
    extern "C" __global__ void LB(32 * IBP_POOL_WARPS)                                                          \
        ibp_lookup_pool_wide_##NAME(int op, int elem, const float* psw, IBP_LOOKUP_PARAMS) {                    \
        IBP_OUT_FROM_REF;                                                                                       \
        ibp_lookup_pool_impl<K, IBP_POOL_PER_LANE_WIDE>(op, elem, psw, IBP_LOOKUP_ARGS);                        \
    }
#define IBP_LOOKUP_IBP(C) IBP_LOOKUP(c##C, IbpRows<C>, IBP_LB)
IBP_FOR_EACH_C(IBP_LOOKUP_IBP)
IBP_LOOKUP(e2, ExpRows<unsigned short>, IBP_EXP_LB)
IBP_LOOKUP(e4, ExpRows<unsigned int>, IBP_EXP_LB)

// One-id bags of the grouped kinds (ibp_lookup_single_bags): ibp_lookup_pool_single_NAME, a kernel of its own: the
// two loops inlined in one kernel take ~166 registers on sm_90, the bag loop alone 128. Its launch bounds keep
// IBP_EXP_SINGLE_WARPS resident warps per SM (96 registers on sm_90, no spills): the direct path for raw groups
// would otherwise take it to 115-119 registers and 16 warps, fewer in flight for the misses' host reads.
#define IBP_EXP_SINGLE_WARPS 20
#ifdef IBP_EXP_MIN_WARPS
#define IBP_EXP_SINGLE_LB(THREADS) IBP_EXP_LB(THREADS)
#else
#define IBP_EXP_SINGLE_LB(THREADS) __launch_bounds__(THREADS, (IBP_EXP_SINGLE_WARPS * 32) / (THREADS))
#endif
#define IBP_LOOKUP_POOL_SINGLE(NAME, K)                                                                         \
    extern "C" __global__ void IBP_EXP_SINGLE_LB(32 * IBP_POOL_WARPS)                                           \
        ibp_lookup_pool_single_##NAME(int op, int elem, const float* psw, IBP_LOOKUP_PARAMS) {                  \
        IBP_OUT_FROM_REF;                                                                                       \
        __shared__ uint4 sdec[IBP_POOL_WARPS][K::SMEM_VEC];                                                     \
        __shared__ uint4 srow[IBP_POOL_WARPS][IBP_POOL_MAX_ROW / 16];                                           \
        const K codec(row_bytes, codec_n, codec_a, codec_b);                                                    \
        ibp_lookup_single_bags<K>(codec, sdec[threadIdx.x >> 5],                                                \
                                  reinterpret_cast<unsigned char*>(srow[threadIdx.x >> 5]), op, elem, psw,      \
                                  IBP_LOOKUP_ARGS);                                                             \
    }
IBP_LOOKUP_POOL_SINGLE(e2, ExpRows<unsigned short>)
IBP_LOOKUP_POOL_SINGLE(e4, ExpRows<unsigned int>)

// One-id bags of the IBP and raw kinds (ibp_lookup_single_bags): ibp_lookup_pool_single_c{C}.
#define IBP_LOOKUP_POOL_SINGLE_IBP(C)                                                                           \
    extern "C" __global__ void IBP_LB(32 * IBP_POOL_WARPS)                                                      \
        ibp_lookup_pool_single_c##C(int op, int elem, const float* psw, IBP_LOOKUP_PARAMS) {                    \
        IBP_OUT_FROM_REF;                                                                                       \
        __shared__ uint4 sdec[IBP_POOL_WARPS][IbpRows<C>::SMEM_VEC];                                            \
        __shared__ uint4 srow[IBP_POOL_WARPS][IBP_POOL_MAX_ROW / 16];                                           \
        const IbpRows<C> codec(row_bytes, codec_n, codec_a, codec_b);                                           \
        ibp_lookup_single_bags<IbpRows<C>>(codec, sdec[threadIdx.x >> 5],                                       \
                                           reinterpret_cast<unsigned char*>(srow[threadIdx.x >> 5]), op, elem, \
                                           psw, IBP_LOOKUP_ARGS);                                               \
    }
IBP_FOR_EACH_C(IBP_LOOKUP_POOL_SINGLE_IBP)

// ROWS of stores whose rows are all raw (KernelTables.raw), several rows per warp (ibp_lookup_single_bags, op ROWS):
// ibp_lookup_rows_single_c{C}. Why only those: on an H200 it read raw 512 B cache hits 1.6x faster than the one-row
// loop, but decoded coded IBP hits 8-12% slower (row by row after the group's probes, with fewer resident warps).
#define IBP_LOOKUP_ROWS_SINGLE_IBP(C)                                                                           \
    extern "C" __global__ void IBP_LB(32 * IBP_WARPS_PER_BLOCK) ibp_lookup_rows_single_c##C(IBP_LOOKUP_PARAMS) { \
        IBP_OUT_FROM_REF;                                                                                       \
        __shared__ uint4 sdec[IBP_WARPS_PER_BLOCK][IbpRows<C>::SMEM_VEC];                                       \
        const IbpRows<C> codec(row_bytes, codec_n, codec_a, codec_b);                                           \
        ibp_lookup_single_bags<IbpRows<C>>(codec, sdec[threadIdx.x >> 5], nullptr, IBP_OP_ROWS, IBP_ELEM_F32,   \
                                           nullptr, IBP_LOOKUP_ARGS);                                           \
    }
IBP_FOR_EACH_C(IBP_LOOKUP_ROWS_SINGLE_IBP)
