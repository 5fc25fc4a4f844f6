// InfiniGen-style speculation for the KV manager (ibpcache/loaders/_kv_select.py), in two launches per layer:
//
// ibp_partial_scores: approximate attention logits of one decode query from the partial key cache. Grid
//   (B * Hkv rows, token tiles): the tokens of a row are split over many blocks, so a 32k-token layer keeps every
//   SM busy (one block per row left 64 blocks on 132 SMs and took 17x its memory time). Query head
//   hq = h * groups + g contributes its r chosen dimensions q_dims[hq]; a token's score is the max over the group
//   of scale * sum_d q[dims[d]] * kp[t, d], accumulated in fp32; tokens with valid[b, t] == 0 score -inf.
//   dt: 0 = fp32, 1 = fp16, 2 = bf16 (q and kp share it).
// ibp_select_top: per row, the number of critical tokens (score >= max - alpha) and the k highest-scoring
//   tokens, written in ascending token order (radix select of the k-th largest key, then an ordered compaction).
//   Ties at the k-th value go to the lowest token indices, so the choice is deterministic and the same as the CPU
//   reference (a stable descending sort); NaN ranks above everything and -0.0 equals 0.0, as in torch.sort.
//
// Both read the token count from n_dev when it is not null (a device counter: a CUDA graph captured once stays
// valid while the cache grows), else from n_tokens. Scores rows are s_stride floats apart.

#define IBP_SEL_THREADS 256
#define IBP_SEL_TILE 1024    // tokens per ibp_partial_scores block
#define IBP_SEL_MAX_QR 1024  // groups * r query values kept in shared memory
#define IBP_TOP_THREADS 1024

__device__ __forceinline__ float ibp_sel_load(const void* base, long long i, int dt) {
    if (dt == 0) return reinterpret_cast<const float*>(base)[i];
    unsigned short x = reinterpret_cast<const unsigned short*>(base)[i];
    if (dt == 2) return __uint_as_float(((unsigned int)x) << 16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

__device__ __forceinline__ long long ibp_sel_count(const long long* n_dev, long long n_tokens) {
    return n_dev != nullptr ? *n_dev : n_tokens;
}

extern "C" __global__ void __launch_bounds__(IBP_SEL_THREADS)
    ibp_partial_scores(const void* q, long long q_sb, long long q_sh, const long long* q_dims, const void* kp,
                       long long cap, int r, long long n_tokens, const long long* n_dev, int hkv, int groups,
                       float scale, int dt, const unsigned char* valid, long long valid_sb, float* scores,
                       long long s_stride) {
    __shared__ float qs[IBP_SEL_MAX_QR];
    const long long n = ibp_sel_count(n_dev, n_tokens);
    const long long t0 = (long long)blockIdx.y * IBP_SEL_TILE;
    if (t0 >= n) return;  // the whole block: a graph launches tiles for the largest count it may see
    int row = blockIdx.x;  // b * hkv + h
    int b = row / hkv, h = row - b * hkv;
    for (int i = threadIdx.x; i < groups * r; i += blockDim.x) {
        int g = i / r, d = i - g * r;
        int hq = h * groups + g;
        long long dim = q_dims[(long long)hq * r + d];
        qs[i] = ibp_sel_load(q, b * q_sb + hq * q_sh + dim, dt) * scale;
    }
    __syncthreads();
    const float neg_inf = __int_as_float(0xff800000);
    const long long kbase = (long long)row * cap * r;
    float* srow = scores + (long long)row * s_stride;
    long long end = min(n, t0 + IBP_SEL_TILE);
    for (long long t = t0 + threadIdx.x; t < end; t += blockDim.x) {
        float best = neg_inf;
        if (valid == nullptr || valid[b * valid_sb + t]) {
            for (int g = 0; g < groups; ++g) {
                float acc = 0.f;
                for (int d = 0; d < r; ++d) acc += qs[g * r + d] * ibp_sel_load(kp, kbase + t * r + d, dt);
                best = fmaxf(best, acc);
            }
        }
        srow[t] = best;
    }
}

// Order-preserving unsigned key of a score: larger score, larger key; every NaN the largest; -0.0 == 0.0.
__device__ __forceinline__ unsigned int ibp_top_key(float s) {
    if (s != s) return 0xffffffffu;
    unsigned int u = s == 0.f ? 0u : __float_as_uint(s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Block-wide exclusive prefix sums of two per-thread counts (in thread order); also returns the totals.
__device__ __forceinline__ void ibp_top_scan2(int a, int b, int* a_ex, int* b_ex, int* warp_a, int* warp_b) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int ia = a, ib = b;
    for (int d = 1; d < 32; d <<= 1) {
        int xa = __shfl_up_sync(0xffffffffu, ia, d), xb = __shfl_up_sync(0xffffffffu, ib, d);
        if (lane >= d) { ia += xa; ib += xb; }
    }
    if (lane == 31) { warp_a[w] = ia; warp_b[w] = ib; }
    __syncthreads();
    if (w == 0) {
        int va = lane < nw ? warp_a[lane] : 0, vb = lane < nw ? warp_b[lane] : 0;
        for (int d = 1; d < 32; d <<= 1) {
            int xa = __shfl_up_sync(0xffffffffu, va, d), xb = __shfl_up_sync(0xffffffffu, vb, d);
            if (lane >= d) { va += xa; vb += xb; }
        }
        if (lane < nw) { warp_a[lane] = va; warp_b[lane] = vb; }  // inclusive per warp
    }
    __syncthreads();
    int base_a = w > 0 ? warp_a[w - 1] : 0, base_b = w > 0 ? warp_b[w - 1] : 0;
    *a_ex = base_a + ia - a;
    *b_ex = base_b + ib - b;
}

extern "C" __global__ void __launch_bounds__(IBP_TOP_THREADS)
    ibp_select_top(const float* scores, long long s_stride, long long n_tokens, const long long* n_dev, int k,
                   float alpha, long long* idx, int* counts) {
    __shared__ int hist[256];
    __shared__ int warp_a[32], warp_b[32];
    __shared__ float redf[32];
    __shared__ int redi[32];
    __shared__ unsigned int sh_prefix;
    __shared__ int sh_remaining;
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, w = tid >> 5, nw = blockDim.x >> 5;
    const long long n = ibp_sel_count(n_dev, n_tokens);
    const float* srow = scores + (long long)row * s_stride;
    long long* out = idx + (long long)row * k;

    // 1. row max, then how many tokens are critical (score >= max - alpha)
    float mx = __int_as_float(0xff800000);
    for (long long t = tid; t < n; t += blockDim.x) mx = fmaxf(mx, srow[t]);
    for (int d = 16; d > 0; d >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
    if (lane == 0) redf[w] = mx;
    __syncthreads();
    mx = redf[0];
    for (int i = 1; i < nw; ++i) mx = fmaxf(mx, redf[i]);
    const float thr = mx - alpha;
    int cnt = 0;
    for (long long t = tid; t < n; t += blockDim.x) cnt += srow[t] >= thr ? 1 : 0;
    for (int d = 16; d > 0; d >>= 1) cnt += __shfl_xor_sync(0xffffffffu, cnt, d);
    if (lane == 0) redi[w] = cnt;
    __syncthreads();
    if (tid == 0) {
        int total = 0;
        for (int i = 0; i < nw; ++i) total += redi[i];
        counts[row] = total;
        sh_prefix = 0u;
        sh_remaining = (int)min((long long)k, n);
    }

    // 2. radix select, 8 bits at a time from the top: the key of the k-th largest score
    unsigned int mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const unsigned int prefix = sh_prefix;
        for (long long t = tid; t < n; t += blockDim.x) {
            unsigned int u = ibp_top_key(srow[t]);
            if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1);
        }
        __syncthreads();
        if (w == 0) {  // lane l sums bins 255 - 8l .. 248 - 8l; the digit is where the count from the top reaches k
            int base = 255 - 8 * lane, sum = 0;
            for (int j = 0; j < 8; ++j) sum += hist[base - j];
            int incl = sum;
            for (int d = 1; d < 32; d <<= 1) {
                int x = __shfl_up_sync(0xffffffffu, incl, d);
                if (lane >= d) incl += x;
            }
            const int rem = sh_remaining;
            unsigned int hit = __ballot_sync(0xffffffffu, incl >= rem);
            __syncwarp();  // every lane has read sh_remaining before one lane rewrites it
            int first = hit ? __ffs(hit) - 1 : 31;
            if (lane == first) {
                int above = incl - sum;
                int digit = base - 7;
                for (int j = 0; j < 8; ++j) {
                    if (above + hist[base - j] >= rem) { digit = base - j; break; }
                    above += hist[base - j];
                }
                sh_prefix = prefix | ((unsigned int)digit << shift);
                sh_remaining = rem - above;
            }
        }
        mask |= 255u << shift;
        __syncthreads();
    }
    const unsigned int kth = sh_prefix;
    const int need_eq = sh_remaining;  // tokens with exactly the k-th key to take, lowest indices first

    // 3. ordered compaction: each thread owns a contiguous run of tokens
    const long long seg = (n + blockDim.x - 1) / blockDim.x;
    const long long lo = min(n, tid * seg), hi = min(n, lo + seg);
    int gt = 0, eq = 0;
    for (long long t = lo; t < hi; ++t) {
        unsigned int u = ibp_top_key(srow[t]);
        gt += u > kth ? 1 : 0;
        eq += u == kth ? 1 : 0;
    }
    int gt_before, eq_before;
    ibp_top_scan2(gt, eq, &gt_before, &eq_before, warp_a, warp_b);
    long long pos = gt_before + min(eq_before, need_eq);
    for (long long t = lo; t < hi; ++t) {
        unsigned int u = ibp_top_key(srow[t]);
        if (u > kth || (u == kth && eq_before++ < need_eq)) out[pos++] = t;
    }
}
