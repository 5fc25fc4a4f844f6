// Per-step admission of a device row cache, with no host sync (the slot policy's device contract, cache/policy.py;
// launched by ibpcache/kernels/admit.py; CPU twin: admit_cpu.py, the same decisions).
//
// A step (one lookup of the embedding bags' fused inference path, or a prefetch of the next one) is five launches
// over fixed-size buffers, so it can be captured in a CUDA graph:
//   (torch sorts the keys: equal keys become neighbours, rows come in address order)
//   count   thread per sorted key: count it into the frequency sketch (count-min, 4 rows, int32 counters; a run of
//           equal keys adds its length at once), stamp the slot of a resident row with the step, add requests /
//           hits to the statistics;
//   scan    thread per sorted position, the first of each distinct row decides: a resident row refreshes its slot's
//           frequency; a missed one estimates its frequency (or takes its static priority); while slots never used
//           since the cache was emptied remain (fill < n_slots) it is flagged to take one (torch ranks the flagged
//           positions: they take consecutive slots from fill on, no bids); otherwise it looks at `samples`
//           pseudo-random victim slots and picks the lowest key (free < used: LFU frequency or LRU stamp <
//           protected), and, if it is worth more than that victim (TinyLFU: strictly more frequent), bids for it
//           with (worth << 32 | position) by atomicMax;
//   apply   thread per sorted position: a flagged row takes slot fill + its rank (if below n_slots), the highest bid
//           of a slot wins it (policy state, row -> slot table, the
//           evicted row's entry cleared); other misses claim a row of the step's staging buffer; both go on the copy
//           list (warp-aggregated atomic counters);
//   copy    warp per list entry (count read on the device): the row's stored bytes from pinned host memory (UVA)
//           into its slot or staging row, as stored -- the lookup decodes them, so any codec works here;
//   unstage after the lookup, thread per staging row: staged rows leave the row -> slot table.
//
// Row -> slot table (int32 per row): -1 absent, v >= 0 in slot v, v <= -2 in staging row -2 - v (this step only).
// Every array the policy owns has one scratch element at its end; nothing here writes it.
//
// No headers are included so NVRTC (CuPy RawModule) and nvcc both compile this file as is.

typedef long long i64;
typedef unsigned long long u64;

#define IBP_ADM_DEPTH 4
// keep in sync with ibpcache/kernels/admit.py (SKETCH_MUL, SAMPLE_MUL, MIX_MUL)
#define IBP_ADM_MUL0 0x9E3779B97F4A7C15ULL
#define IBP_ADM_MUL1 0xC2B2AE3D27D4EB4FULL
#define IBP_ADM_MUL2 0x165667B19E3779F9ULL
#define IBP_ADM_MUL3 0x27D4EB2F165667C5ULL
#define IBP_ADM_SMUL0 0x9E3779B97F4A7C15ULL
#define IBP_ADM_SMUL1 0xC2B2AE3D27D4EB4FULL
#define IBP_ADM_SMUL2 0x165667B19E3779F9ULL
#define IBP_ADM_MIX 0xD6E8FEB86659FD93ULL
// keep in sync with admit.py (FREE_KEY, PROTECTED_KEY, FLAG_*, STAT_*, WS_*)
#define IBP_ADM_FREE_KEY (-(1LL << 62))
// admission modes of the scan (admit.py ADMIT_*): none, where the policy admits it, whatever the policy says
#define IBP_ADM_POLICY 1
#define IBP_ADM_FORCE 2
#define IBP_ADM_PROTECTED_KEY (1LL << 62)
#define IBP_ADM_FLAG_OK 1
#define IBP_ADM_FLAG_HIT 2
#define IBP_ADM_FLAG_MISS 4
#define IBP_ADM_FLAG_CAND 8
#define IBP_ADM_FLAG_FREE 16
#define IBP_ADM_STAT_REQUESTS 0
#define IBP_ADM_STAT_HITS 1
#define IBP_ADM_STAT_ADMITTED 2
#define IBP_ADM_STAT_STAGED 3
#define IBP_ADM_STAT_HOST_BYTES 4
#define IBP_ADM_WS_LIST 0
#define IBP_ADM_WS_STAGED 1
#define IBP_ADM_COPY_WARPS 8
#define IBP_ADM_FULL 0xffffffffu

__device__ __forceinline__ u64 ibp_adm_mul(int d) {
    return d == 0 ? IBP_ADM_MUL0 : d == 1 ? IBP_ADM_MUL1 : d == 2 ? IBP_ADM_MUL2 : IBP_ADM_MUL3;
}

// Counter of row x in sketch row d (admit.py sketch_index).
__device__ __forceinline__ i64 ibp_adm_sketch_slot(i64 x, int d, u64 mask) {
    u64 h = (u64)x * ibp_adm_mul(d);
    h ^= h >> 31;
    h *= ibp_adm_mul((d + 1) & 3);
    return (i64)((h >> 24) & mask) + (i64)d * (i64)(mask + 1);
}

__device__ __forceinline__ i64 ibp_adm_estimate(const int* __restrict__ sketch, i64 x, u64 mask) {
    int best = sketch[ibp_adm_sketch_slot(x, 0, mask)];
#pragma unroll
    for (int d = 1; d < IBP_ADM_DEPTH; ++d) {
        const int c = sketch[ibp_adm_sketch_slot(x, d, mask)];
        best = c < best ? c : best;
    }
    return (i64)best;
}

__device__ __forceinline__ u64 ibp_adm_mix(u64 h) {
    h ^= h >> 32;
    h *= IBP_ADM_MIX;
    return h ^ (h >> 32);
}

// Victim slot number t (0-based) of row x in the step stamped `stamp`, in [lo, lo + range) (admit.py sample_slots).
// A later round of one pass samples t from round * samples on: other slots than the round before.
__device__ __forceinline__ i64 ibp_adm_sample_slot(i64 x, i64 stamp, int t, i64 lo, i64 range) {
    const u64 h = ((u64)x * IBP_ADM_SMUL0) ^ ((u64)stamp * IBP_ADM_SMUL1) ^ ((u64)(t + 1) * IBP_ADM_SMUL2);
    return lo + (i64)((ibp_adm_mix(h) & 0x7FFFFFFFFFFFFFFFULL) % (u64)range);
}

// One atomicAdd per warp for a per-lane 0/1 event; every lane of the warp must call it (full-warp ballot).
__device__ __forceinline__ void ibp_adm_warp_count(bool event, i64* counter) {
    const unsigned int m = __ballot_sync(IBP_ADM_FULL, event);
    if ((threadIdx.x & 31) == 0 && m != 0) atomicAdd((unsigned long long*)counter, (unsigned long long)__popc(m));
}

// A slot index from a warp-aggregated counter for every lane with `want`; -1 for the others.
__device__ __forceinline__ i64 ibp_adm_warp_claim(bool want, i64* counter) {
    const unsigned int m = __ballot_sync(IBP_ADM_FULL, want);
    if (m == 0) return -1;
    const int lane = threadIdx.x & 31;
    const int leader = __ffs(m) - 1;
    unsigned long long first = 0;
    if (lane == leader) first = atomicAdd((unsigned long long*)counter, (unsigned long long)__popc(m));
    first = __shfl_sync(IBP_ADM_FULL, first, leader);
    return want ? (i64)(first + __popc(m & ((1u << lane) - 1u))) : -1;
}

// Over the SORTED keys (equal keys adjacent): a run of m keys of row x adds m to x's sketch counters with at most two
// atomics per counter (the run's first key adds -p, its last p + 1; a lone key adds 1), and its first key stamps x's
// slot. Why: on a Zipf step the hottest rows come thousands of times, and one atomic per key on their counters
// serialized the pass. The counters only hold their sums once the pass ended; nothing reads them before.
extern "C" __global__ void ibp_adm_count(const i64* __restrict__ s, i64 n, i64 n_rows,
                                         const int* __restrict__ slot_of, int* __restrict__ sketch, u64 mask,
                                         int count_sketch, i64* __restrict__ last, const i64* __restrict__ stamp,
                                         i64* __restrict__ stats, int count_stats) {
    const i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    const i64 key = i < n ? s[i] : -1;
    const bool valid = key >= 0 && key < n_rows;
    int slot = -1;
    if (valid) {
        const bool run_first = i == 0 || s[i - 1] != key;
        const bool run_last = i == n - 1 || s[i + 1] != key;
        if (count_sketch && (run_first || run_last)) {
            const int add = run_first && run_last ? 1 : (run_first ? -(int)i : (int)(i + 1));
#pragma unroll
            for (int d = 0; d < IBP_ADM_DEPTH; ++d) atomicAdd(&sketch[ibp_adm_sketch_slot(key, d, mask)], add);
        }
        slot = slot_of[key];
        if (slot >= 0 && run_first) last[slot] = *stamp;
    }
    if (count_stats) {  // no thread returned early: the ballots see the whole warp
        ibp_adm_warp_count(valid, &stats[IBP_ADM_STAT_REQUESTS]);
        ibp_adm_warp_count(slot >= 0, &stats[IBP_ADM_STAT_HITS]);
    }
}

extern "C" __global__ void ibp_adm_scan(const i64* __restrict__ s, i64 n, i64 n_rows, const int* __restrict__ slot_of,
                                        const int* __restrict__ sketch, u64 mask, const i64* __restrict__ prio,
                                        const i64* __restrict__ ids, i64* __restrict__ freq,
                                        const i64* __restrict__ last, i64 n_slots, i64 n_pinned, int lru,
                                        int samples, const i64* __restrict__ fill_p, const i64* __restrict__ stamp_p,
                                        const i64* __restrict__ protect_p,
                                        const int* __restrict__ host_len, int row_bytes, int slot_bytes, int admit, int round,
                                        i64* __restrict__ bid, i64* __restrict__ victim_out, i64* __restrict__ key_out,
                                        unsigned char* __restrict__ flags_out) {
    const i64 p = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (p >= n) return;
    const i64 x = s[p];
    if (x < 0 || x >= n_rows || (p > 0 && s[p - 1] == x)) {  // not a row, or not the first of its run
        flags_out[p] = 0;
        return;
    }
    const i64 worth = prio != nullptr ? prio[x] : ibp_adm_estimate(sketch, x, mask);
    const int slot = slot_of[x];
    if (slot >= 0) {  // resident: its slot's frequency follows the sketch (count stamped it already)
        freq[slot] = worth;
        flags_out[p] = IBP_ADM_FLAG_OK | IBP_ADM_FLAG_HIT;
        return;
    }
    unsigned char flags = IBP_ADM_FLAG_OK;
    if (slot == -1) {
        flags |= IBP_ADM_FLAG_MISS;
        const int len = host_len != nullptr ? host_len[x] : row_bytes;
        const i64 w = worth < 0 ? 0 : (worth < 0x7FFFFFFFLL ? worth : 0x7FFFFFFFLL);
        if (admit && len <= slot_bytes && n_slots > n_pinned && *fill_p < n_slots) {
            flags |= IBP_ADM_FLAG_FREE;  // never-used slots remain: they go to the misses in sorted order, no bids
            key_out[p] = (w << 32) | p;
        } else if (admit && len <= slot_bytes && n_slots > n_pinned) {
            const i64 stamp = *stamp_p;
            const i64 protect = *protect_p;
            i64 best = IBP_ADM_PROTECTED_KEY + 1;
            i64 bv = -1;
            for (int t = 0; t < samples; ++t) {
                const i64 v = ibp_adm_sample_slot(x, stamp, round * samples + t, n_pinned, n_slots - n_pinned);
                const i64 lv = last[v];
                i64 k;
                if (ids[v] < 0) {
                    k = IBP_ADM_FREE_KEY;
                } else if (lv >= protect) {  // used by this step or a pending prefetched one
                    k = IBP_ADM_PROTECTED_KEY;
                } else {
                    k = lru ? lv : freq[v];
                }
                if (k < best) {
                    best = k;
                    bv = v;
                }
            }
            if (best < IBP_ADM_PROTECTED_KEY) {
                const i64 vworth = ids[bv] < 0 ? -1 : freq[bv];
                if (admit == IBP_ADM_FORCE || worth > vworth) {  // a prefetch admits what it is asked
                    const i64 key = (w << 32) | p;
                    atomicMax((long long*)&bid[bv], (long long)key);
                    victim_out[p] = bv;
                    key_out[p] = key;
                    flags |= IBP_ADM_FLAG_CAND;
                }
            }
        }
    }
    flags_out[p] = flags;
}

extern "C" __global__ void ibp_adm_apply(const i64* __restrict__ s, i64 n, const unsigned char* __restrict__ flags,
                                         const i64* __restrict__ victim, const i64* __restrict__ key,
                                         const i64* __restrict__ bid, const i64* __restrict__ rank,
                                         const i64* __restrict__ fill_p, i64* __restrict__ ids, i64* __restrict__ freq,
                                         i64* __restrict__ last, const i64* __restrict__ stamp_p,
                                         int* __restrict__ slot_of, int* __restrict__ slot_len, i64 n_slots,
                                         i64 slot_stride, i64 slab_base, const int* __restrict__ host_len,
                                         int row_bytes, i64 stage_cap, i64 stage_base, i64* __restrict__ stage_gid,
                                         i64* __restrict__ ws, i64* __restrict__ list_gid, i64* __restrict__ list_dst,
                                         int* __restrict__ list_len, i64* __restrict__ stats) {
    const i64 p = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    const unsigned char f = p < n ? flags[p] : 0;
    const bool miss = (f & IBP_ADM_FLAG_MISS) != 0;
    const bool fresh = (f & IBP_ADM_FLAG_FREE) != 0 && *fill_p + rank[p] < n_slots;
    const bool take = fresh || ((f & IBP_ADM_FLAG_CAND) != 0 && bid[victim[p]] == key[p]);
    i64 x = 0;
    int len = 0;
    i64 dst = 0;
    if (miss) {
        x = s[p];
        len = host_len != nullptr ? host_len[x] : row_bytes;
    }
    if (take) {  // the slot's one winner: no other thread touches this slot, its old row or this row
        const i64 v = fresh ? *fill_p + rank[p] : victim[p];
        const i64 old = ids[v];
        ids[v] = x;
        freq[v] = key[p] >> 32;
        last[v] = *stamp_p;
        if (old >= 0) slot_of[old] = -1;
        slot_of[x] = (int)v;
        slot_len[v] = len;
        dst = slab_base + v * slot_stride;
    }
    const i64 k = ibp_adm_warp_claim(miss && !take && stage_cap > 0, &ws[IBP_ADM_WS_STAGED]);
    const bool staged = k >= 0 && k < stage_cap;
    if (staged) {
        stage_gid[k] = x;
        slot_len[n_slots + k] = len;
        slot_of[x] = (int)(-2 - k);
        dst = stage_base + k * (i64)row_bytes;
    }
    const i64 e = ibp_adm_warp_claim(take || staged, &ws[IBP_ADM_WS_LIST]);
    if (e >= 0) {
        list_gid[e] = x;
        list_dst[e] = dst;
        list_len[e] = len;
    }
    ibp_adm_warp_count(take, &stats[IBP_ADM_STAT_ADMITTED]);
    ibp_adm_warp_count(staged, &stats[IBP_ADM_STAT_STAGED]);
}

// Warp per entry: `len` bytes from host row gid (UVA) to dst. 16-byte loads where both ends are 16-byte aligned
// (whole 16-byte blocks of the row only: never past its last byte), bytes otherwise; each lane issues all its loads
// of a 2 KB piece before any store, so a row costs one PCIe round trip, not one per load.
extern "C" __global__ void __launch_bounds__(32 * IBP_ADM_COPY_WARPS)
    ibp_adm_copy(const i64* __restrict__ list_gid, const i64* __restrict__ list_dst, const int* __restrict__ list_len,
                 const i64* __restrict__ ws, i64 max_n, i64 host_base, const i64* __restrict__ host_offsets,
                 i64 row_bytes, i64* __restrict__ stats) {
    const int lane = threadIdx.x & 31;
    const i64 warp = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
    i64 count = ws[IBP_ADM_WS_LIST];
    if (count > max_n) count = max_n;
    u64 bytes = 0;
    for (i64 e = warp; e < count; e += nwarps) {
        const i64 gid = list_gid[e];
        const int len = list_len[e];
        const unsigned char* src = reinterpret_cast<const unsigned char*>(
            host_base + (host_offsets != nullptr ? host_offsets[gid] : gid * row_bytes));
        unsigned char* dst = reinterpret_cast<unsigned char*>(list_dst[e]);
        bytes += (u64)len;
        int head = 0;
        if (((reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst)) & 15ULL) == 0) {
            const int n16 = len >> 4;
            const uint4* s16 = reinterpret_cast<const uint4*>(src);
            uint4* d16 = reinterpret_cast<uint4*>(dst);
            for (int b0 = 0; b0 < n16; b0 += 128) {
                uint4 tmp[4];
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    const int b = b0 + lane + 32 * t;
                    if (b < n16) tmp[t] = s16[b];
                }
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    const int b = b0 + lane + 32 * t;
                    if (b < n16) d16[b] = tmp[t];
                }
            }
            head = n16 << 4;
        }
        for (int b0 = head; b0 < len; b0 += 256) {
            unsigned char tmp[8];
#pragma unroll
            for (int t = 0; t < 8; ++t) {
                const int b = b0 + lane + 32 * t;
                if (b < len) tmp[t] = src[b];
            }
#pragma unroll
            for (int t = 0; t < 8; ++t) {
                const int b = b0 + lane + 32 * t;
                if (b < len) dst[b] = tmp[t];
            }
        }
    }
    if (lane == 0 && bytes != 0) atomicAdd((unsigned long long*)&stats[IBP_ADM_STAT_HOST_BYTES], bytes);
}

extern "C" __global__ void ibp_adm_unstage(const i64* __restrict__ stage_gid, const i64* __restrict__ ws,
                                           i64 stage_cap, int* __restrict__ slot_of) {
    const i64 k = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    i64 staged = ws[IBP_ADM_WS_STAGED];
    if (staged > stage_cap) staged = stage_cap;
    if (k < staged) slot_of[stage_gid[k]] = -1;
}

// The row cache's frequency sketch on its training and Colossal-AI paths (cache/policy.py FrequencySketch and
// SlotPolicy.touch), one launch per call: the torch expression of sketch_index takes a dozen launches, and a training
// step counts, estimates and touches several times. The same counters and estimates, bit for bit (integer atomics
// commute). Thread per id (per slot for touch).

// Count ids[i] weights[i] times (once each when weights is null) into every sketch row.
extern "C" __global__ void ibp_adm_sketch_add(const i64* __restrict__ ids, const i64* __restrict__ weights, i64 n,
                                              int* __restrict__ sketch, u64 mask) {
    const i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int w = weights != nullptr ? (int)weights[i] : 1;
    if (w == 0) return;
    const i64 x = ids[i];
#pragma unroll
    for (int d = 0; d < IBP_ADM_DEPTH; ++d) atomicAdd(&sketch[ibp_adm_sketch_slot(x, d, mask)], w);
}

// out[i] = the sketch's estimate of ids[i] (the minimum over its rows).
extern "C" __global__ void ibp_adm_sketch_estimate(const i64* __restrict__ ids, i64 n, const int* __restrict__ sketch,
                                                   u64 mask, i64* __restrict__ out) {
    const i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i < n) out[i] = ibp_adm_estimate(sketch, ids[i], mask);
}

// Slots slots[i] (duplicates allowed; outside [0, n_entries) skipped) were used now: stamped with `clock`, their
// frequency refreshed from the sketch estimate of the row each holds.
extern "C" __global__ void ibp_adm_touch(const i64* __restrict__ slots, i64 n, i64 n_entries,
                                         const i64* __restrict__ slot_ids, i64* __restrict__ freq,
                                         i64* __restrict__ last, i64 clock, const int* __restrict__ sketch, u64 mask) {
    const i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const i64 s = slots[i];
    if (s < 0 || s >= n_entries) return;
    last[s] = clock;
    freq[s] = ibp_adm_estimate(sketch, slot_ids[s], mask);
}
