// InfiniGen-style speculation for the KV manager (ibpcache/loaders/_kv_select.py): approximate attention logits of
// one decode query from the partial key cache, and per (batch, KV head) the number of critical tokens
// (score >= max - alpha), in ONE launch (the torch formulation takes about ten small kernels per layer).
//
// Block per (b, h) KV-head row. Query head hq = h * groups + g contributes its r chosen dimensions q_dims[hq];
// a token's score is the max over the group of scale * sum_d q[dims[d]] * kp[t, d], accumulated in fp32;
// tokens with valid[b, t] == 0 score -inf. dt: 0 = fp32, 1 = fp16, 2 = bf16 (q and kp share it).

#define IBP_SEL_THREADS 256
#define IBP_SEL_MAX_QR 1024  // groups * r query values kept in shared memory

__device__ __forceinline__ float ibp_sel_load(const void* base, long long i, int dt) {
    if (dt == 0) return reinterpret_cast<const float*>(base)[i];
    unsigned short x = reinterpret_cast<const unsigned short*>(base)[i];
    if (dt == 2) return __uint_as_float(((unsigned int)x) << 16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

__device__ __forceinline__ float ibp_sel_block_max(float v, float* red) {
    for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, d));
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) red[w] = v;
    __syncthreads();
    v = lane < (blockDim.x >> 5) ? red[lane] : __int_as_float(0xff800000);
    for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, d));
    __syncthreads();
    return v;
}

__device__ __forceinline__ int ibp_sel_block_sum(int v, int* red) {
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) red[w] = v;
    __syncthreads();
    v = lane < (blockDim.x >> 5) ? red[lane] : 0;
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    __syncthreads();
    return v;
}

extern "C" __global__ void __launch_bounds__(IBP_SEL_THREADS)
    ibp_partial_scores(const void* q, long long q_sb, long long q_sh, const long long* q_dims, const void* kp,
                       long long cap, int r, long long n_tokens, int hkv, int groups, float scale, int dt,
                       const unsigned char* valid, long long valid_sb, float alpha, float* scores, int* counts) {
    __shared__ float qs[IBP_SEL_MAX_QR];
    __shared__ float redf[32];
    __shared__ int redi[32];
    const float neg_inf = __int_as_float(0xff800000);
    int row = blockIdx.x;  // b * hkv + h
    int b = row / hkv, h = row - b * hkv;
    for (int i = threadIdx.x; i < groups * r; i += blockDim.x) {
        int g = i / r, d = i - g * r;
        int hq = h * groups + g;
        long long dim = q_dims[(long long)hq * r + d];
        qs[i] = ibp_sel_load(q, b * q_sb + hq * q_sh + dim, dt) * scale;
    }
    __syncthreads();
    const long long kbase = (long long)row * cap * r;
    float* srow = scores + (long long)row * n_tokens;
    float mx = neg_inf;
    for (long long t = threadIdx.x; t < n_tokens; t += blockDim.x) {
        float best = neg_inf;
        if (valid == nullptr || valid[b * valid_sb + t]) {
            for (int g = 0; g < groups; ++g) {
                float acc = 0.f;
                for (int d = 0; d < r; ++d) acc += qs[g * r + d] * ibp_sel_load(kp, kbase + t * r + d, dt);
                best = fmaxf(best, acc);
            }
        }
        srow[t] = best;
        mx = fmaxf(mx, best);
    }
    mx = ibp_sel_block_max(mx, redf);
    float thr = mx - alpha;
    int cnt = 0;
    for (long long t = threadIdx.x; t < n_tokens; t += blockDim.x) cnt += srow[t] >= thr ? 1 : 0;
    cnt = ibp_sel_block_sum(cnt, redi);
    if (threadIdx.x == 0) counts[row] = cnt;
}
