// One hop of ibpcache.loaders.sampling.NeighborSampler's uniform neighbour draws, fused: one thread per node.
//
// The torch path spends about 100 small ops per hop on the hash and on Floyd's algorithm (the sampler's host time
// is its launches); this kernel computes the same draws in one launch. Keep in sync with sampling.py (a CPU test
// checks the constants below against it; a GPU test compares the two paths bit for bit):
//
//   node key  = mix32(mix32(node) + batch key)                       (all mod 2**32)
//   draw j    = mix32(node key + j * GOLDEN)
//   hi_j      = deg - k + j;  t_j = (draw j * (hi_j + 1)) >> 32        (64-bit product)
//   Floyd     : chosen_j = hi_j if t_j is among chosen_0..j-1 else t_j; chosen sorted ascending
//
// A node with deg <= k (or k < 0) takes all its in-edges in CSC order; k == 0 takes none. Output: per edge its CSC
// position and the index of its node, node after node (edges of node i start at first[i]).

#define IBP_SMP_GOLDEN 0x9E3779B9u
#define IBP_SMP_FMIX1 0x85EBCA6Bu
#define IBP_SMP_FMIX2 0xC2B2AE35u
#define IBP_SMP_KMAX 64

__device__ __forceinline__ unsigned int ibp_smp_mix32(unsigned int x) {
    x ^= x >> 16;
    x *= IBP_SMP_FMIX1;
    x ^= x >> 13;
    x *= IBP_SMP_FMIX2;
    x ^= x >> 16;
    return x;
}

extern "C" __global__ void ibp_smp_hop(const long long* __restrict__ colptr, const long long* __restrict__ nodes,
                                       const long long* __restrict__ batch_keys,
                                       const long long* __restrict__ first, long long n, int k,
                                       long long* __restrict__ pos, long long* __restrict__ seg) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long v = nodes[i];
    const long long start = colptr[v];
    const long long deg = colptr[v + 1] - start;
    const long long at = first[i];
    if (k > 0 && deg > k) {
        const unsigned int key = ibp_smp_mix32(ibp_smp_mix32((unsigned int)v) + (unsigned int)batch_keys[i]);
        long long chosen[IBP_SMP_KMAX];
        const long long low = deg - k;
        for (int j = 0; j < k; ++j) {
            const long long hi = low + j;
            const unsigned int draw = ibp_smp_mix32(key + (unsigned int)j * IBP_SMP_GOLDEN);
            const long long t = (long long)(((unsigned long long)draw * (unsigned long long)(hi + 1)) >> 32);
            bool taken = false;
            for (int q = 0; q < j; ++q) taken |= chosen[q] == t;
            chosen[j] = taken ? hi : t;
        }
        for (int a = 1; a < k; ++a) {  // insertion sort: k is small
            const long long x = chosen[a];
            int b = a - 1;
            while (b >= 0 && chosen[b] > x) {
                chosen[b + 1] = chosen[b];
                --b;
            }
            chosen[b + 1] = x;
        }
        for (int j = 0; j < k; ++j) {
            pos[at + j] = start + chosen[j];
            seg[at + j] = i;
        }
        return;
    }
    const long long count = k < 0 ? deg : (deg < k ? deg : (long long)k);
    for (long long j = 0; j < count; ++j) {
        pos[at + j] = start + j;
        seg[at + j] = i;
    }
}
