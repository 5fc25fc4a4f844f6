// Cache index kernels for ibpcache: a GPU hash table  row id (int64) -> packed entry (int64), and the
// fetch probe that turns a batch of ids into decode descriptors for the codec's single decode launch.
//
// Hash table: open addressing, linear probing, power-of-two capacity, keys and values in two int64
// arrays. Every probe loop is bounded by `max_probes`: an insert that finds no bucket within the bound
// reports IBP_STATUS_FULL (the launcher raises CapacityError), and a lookup that reaches the bound
// reports "not cached". Kernels never assert or trap: they write status codes.
//
// No headers are included so NVRTC (CuPy RawModule) and nvcc both compile this file as is.
// Launched by ibpcache/kernels/hashmap.py on torch's current stream.

// ---- keep in sync with ibpcache/cache/entry.py ------------------------------------------------
#define IBP_ENTRY_OFFSET_BITS 40
#define IBP_ENTRY_SLAB_SHIFT 40
#define IBP_ENTRY_SLAB_BITS 3
#define IBP_ENTRY_COMPRESSED_SHIFT 43
#define IBP_ENTRY_LENGTH_SHIFT 44
#define IBP_ENTRY_LENGTH_BITS 20
#define IBP_EMPTY_ENTRY (-1LL)
#define IBP_EMPTY_KEY (-1LL)
#define IBP_TOMBSTONE_KEY (-2LL)

// ---- keep in sync with ibpcache/cache/stats.py (Counter) --------------------------------------
#define IBP_COUNTER_REQUESTS 0
#define IBP_COUNTER_HITS 1
#define IBP_COUNTER_HOST_BYTES 2
#define IBP_COUNTER_SLAB_BYTES 3
#define IBP_N_COUNTERS 4

// ---- keep in sync with ibpcache/kernels/hashmap.py (Status) -----------------------------------
#define IBP_STATUS_OK 0
#define IBP_STATUS_FULL 1
#define IBP_STATUS_DUPLICATE 2
#define IBP_STATUS_BAD_KEY 3
#define IBP_STATUS_NOT_FOUND 4

// ---- keep in sync with ibpcache/kernels/hashmap.py (IndexMode) --------------------------------
#define IBP_INDEX_HASH 0
#define IBP_INDEX_DIRECT 1
#define IBP_INDEX_NONE 2

typedef long long i64;
typedef unsigned long long u64;

// status[0]: worst status code seen (atomicMax); status[1]: longest probe sequence used by an insert.

__device__ __forceinline__ u64 ibp_hash_key(i64 key) {
  // murmur3 fmix64: spreads consecutive ids (the common case) over the whole table.
  u64 h = (u64)key;
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ULL;
  h ^= h >> 33;
  return h;
}

__device__ __forceinline__ i64 ibp_hash_find(const i64* __restrict__ table_keys,
                                             const i64* __restrict__ table_values, u64 mask,
                                             int max_probes, i64 key) {
  u64 slot = ibp_hash_key(key) & mask;
  for (int p = 0; p < max_probes; ++p) {
    i64 cur = table_keys[slot];
    if (cur == key) return table_values[slot];
    if (cur == IBP_EMPTY_KEY) return IBP_EMPTY_ENTRY;
    slot = (slot + 1) & mask;
  }
  return IBP_EMPTY_ENTRY;
}

__device__ __forceinline__ i64 ibp_index_find(int mode, const i64* __restrict__ table_keys,
                                              const i64* __restrict__ table_values, i64 capacity,
                                              int max_probes, i64 key) {
  if (mode == IBP_INDEX_HASH) return ibp_hash_find(table_keys, table_values, (u64)(capacity - 1), max_probes, key);
  if (mode == IBP_INDEX_DIRECT) return (key >= 0 && key < capacity) ? table_values[key] : IBP_EMPTY_ENTRY;
  return IBP_EMPTY_ENTRY;
}

// Insert keys[i] -> values[i] for every i with valid == nullptr or valid[i] != 0. Keys must be >= 0.
// Reuses tombstones; the caller guarantees keys are not already present outside this launch (duplicates
// within the launch, or with a key already stored, are found and reported as IBP_STATUS_DUPLICATE).
extern "C" __global__ void ibp_hashmap_insert(const i64* __restrict__ keys, const i64* __restrict__ values,
                                              const unsigned char* __restrict__ valid, i64 n,
                                              i64* table_keys, i64* table_values, i64 capacity,
                                              int max_probes, int* status) {
  const u64 mask = (u64)(capacity - 1);
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (valid != nullptr && valid[i] == 0) continue;
    const i64 key = keys[i];
    if (key < 0) {
      atomicMax(&status[0], IBP_STATUS_BAD_KEY);
      continue;
    }
    u64 slot = ibp_hash_key(key) & mask;
    int code = IBP_STATUS_FULL;
    for (int p = 0; p < max_probes; ++p) {
      const i64 cur = *((volatile i64*)&table_keys[slot]);
      if (cur == key) {
        code = IBP_STATUS_DUPLICATE;
        break;
      }
      if (cur == IBP_EMPTY_KEY || cur == IBP_TOMBSTONE_KEY) {
        const u64 prev = atomicCAS((u64*)&table_keys[slot], (u64)cur, (u64)key);
        if (prev == (u64)cur) {
          table_values[slot] = values[i];
          atomicMax(&status[1], p + 1);
          code = IBP_STATUS_OK;
          break;
        }
        if ((i64)prev == key) {
          code = IBP_STATUS_DUPLICATE;
          break;
        }
      }
      slot = (slot + 1) & mask;
    }
    if (code != IBP_STATUS_OK) atomicMax(&status[0], code);
  }
}

// Erase keys[i] (valid == nullptr or valid[i] != 0): the bucket becomes a tombstone so probe chains
// through it stay intact. A key that is not found reports IBP_STATUS_NOT_FOUND.
extern "C" __global__ void ibp_hashmap_erase(const i64* __restrict__ keys, const unsigned char* __restrict__ valid,
                                             i64 n, i64* table_keys, i64* table_values, i64 capacity,
                                             int max_probes, int* status) {
  const u64 mask = (u64)(capacity - 1);
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (valid != nullptr && valid[i] == 0) continue;
    const i64 key = keys[i];
    int code = IBP_STATUS_NOT_FOUND;
    if (key >= 0) {
      u64 slot = ibp_hash_key(key) & mask;
      for (int p = 0; p < max_probes; ++p) {
        const i64 cur = table_keys[slot];
        if (cur == key) {
          table_values[slot] = IBP_EMPTY_ENTRY;
          table_keys[slot] = IBP_TOMBSTONE_KEY;
          code = IBP_STATUS_OK;
          break;
        }
        if (cur == IBP_EMPTY_KEY) break;
        slot = (slot + 1) & mask;
      }
    } else {
      code = IBP_STATUS_BAD_KEY;
    }
    if (code != IBP_STATUS_OK) atomicMax(&status[0], code);
  }
}

// entries_out[i] = entry of ids[i], or IBP_EMPTY_ENTRY when it is not cached.
extern "C" __global__ void ibp_hashmap_lookup(const i64* __restrict__ ids, i64 n, int mode,
                                              const i64* __restrict__ table_keys,
                                              const i64* __restrict__ table_values, i64 capacity,
                                              int max_probes, i64* __restrict__ entries_out) {
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    entries_out[i] = ibp_index_find(mode, table_keys, table_values, capacity, max_probes, ids[i]);
  }
}

__device__ __forceinline__ u64 ibp_warp_sum(u64 v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;
}

// The fetch probe: for every requested id write the decode descriptor of its row.
//   hit  (entry found): src = slab_bases[slab id] + offset, length and compressed flag from the entry;
//   miss            : src = host_base + host offset of the row (host_offsets[id], or id * host_stride
//                     when host_offsets is null), length = host_lengths[id] (or host_row_bytes),
//                     compressed = bit (id % 8) of host_flags[id / 8] (or 0 when host_flags is null).
// host_base is the device-visible address of the pinned host store (UVA). Ids were range-checked by
// the caller; an id outside [0, n_rows) is still kept from faulting: it reports IBP_STATUS_BAD_KEY and
// reads row 0. counters (u64 [IBP_N_COUNTERS]) accumulate requests, hits, host and slab bytes (one
// atomic per warp). entries_out may be null; else it receives each id's entry (EMPTY on a miss).
// Block size must be a multiple of 32 (the warp reduction uses full masks).
extern "C" __global__ void ibp_cache_probe(
    const i64* __restrict__ ids, i64 n, i64 n_rows, int mode, const i64* __restrict__ table_keys,
    const i64* __restrict__ table_values, i64 capacity, int max_probes, const i64* __restrict__ slab_bases,
    i64 host_base, const i64* __restrict__ host_offsets, i64 host_stride, const int* __restrict__ host_lengths,
    int host_row_bytes, const unsigned char* __restrict__ host_flags, i64* __restrict__ src_ptrs,
    int* __restrict__ lengths, unsigned char* __restrict__ compressed, i64* __restrict__ entries_out,
    u64* __restrict__ counters, int* __restrict__ status) {
  const u64 offset_mask = (1ULL << IBP_ENTRY_OFFSET_BITS) - 1ULL;
  const u64 slab_mask = (1ULL << IBP_ENTRY_SLAB_BITS) - 1ULL;
  const u64 length_mask = (1ULL << IBP_ENTRY_LENGTH_BITS) - 1ULL;
  u64 hits = 0, host_bytes = 0, slab_bytes = 0, requests = 0;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    i64 id = ids[i];
    if (id < 0 || id >= n_rows) {
      atomicMax(&status[0], IBP_STATUS_BAD_KEY);
      id = 0;
    }
    const i64 entry = ibp_index_find(mode, table_keys, table_values, capacity, max_probes, id);
    i64 src;
    int len;
    unsigned char comp;
    if (entry != IBP_EMPTY_ENTRY) {
      const u64 e = (u64)entry;
      src = slab_bases[(e >> IBP_ENTRY_SLAB_SHIFT) & slab_mask] + (i64)(e & offset_mask);
      len = (int)((e >> IBP_ENTRY_LENGTH_SHIFT) & length_mask);
      comp = (unsigned char)((e >> IBP_ENTRY_COMPRESSED_SHIFT) & 1ULL);
      hits += 1;
      slab_bytes += (u64)len;
    } else {
      src = host_base + (host_offsets != nullptr ? host_offsets[id] : id * host_stride);
      len = host_lengths != nullptr ? host_lengths[id] : host_row_bytes;
      comp = host_flags != nullptr ? (unsigned char)((host_flags[id >> 3] >> (id & 7)) & 1) : (unsigned char)0;
      host_bytes += (u64)len;
    }
    src_ptrs[i] = src;
    lengths[i] = len;
    compressed[i] = comp;
    if (entries_out != nullptr) entries_out[i] = entry;
    requests += 1;
  }
  requests = ibp_warp_sum(requests);
  hits = ibp_warp_sum(hits);
  host_bytes = ibp_warp_sum(host_bytes);
  slab_bytes = ibp_warp_sum(slab_bytes);
  if ((threadIdx.x & 31) == 0 && requests != 0) {
    atomicAdd(&counters[IBP_COUNTER_REQUESTS], requests);
    atomicAdd(&counters[IBP_COUNTER_HITS], hits);
    atomicAdd(&counters[IBP_COUNTER_HOST_BYTES], host_bytes);
    atomicAdd(&counters[IBP_COUNTER_SLAB_BYTES], slab_bytes);
  }
}
