// MoE router (DeepSeek-V3 / Kimi "noaux_tc", sigmoid scoring) on precomputed fp32 gate logits
// (the skinny GEMM with fp32 output gives x @ gate^T with fp32 accumulation).
//   s = sigmoid(logit); choice = s + bias (bias only steers the choice)
//   groups: score(g) = sum of the top-2 choice values of the group's experts; keep the topk_group best
//   groups (ties: lower group), experts of other groups are out;
//   ids = the k best choice values among the kept experts (ties: lower expert id), in descending order;
//   weights = s[ids] / (sum s[ids] + 1e-20 when normalising) * routed_scaling_factor.
// One block per token; E <= ROUTER_MAX_E.
#include "common.cuh"

#define ROUTER_THREADS 256
#define ROUTER_MAX_E 1024
#define ROUTER_MAX_GROUPS 64
typedef unsigned long long u64;

__device__ __forceinline__ uint32_t ord_key(float f) {
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

extern "C" __global__ void __launch_bounds__(ROUTER_THREADS)
router_topk(const float* __restrict__ logits, int E, const float* __restrict__ bias, int n_group, int topk_group,
            int k, int normalize, float scale, int* __restrict__ out_ids, float* __restrict__ out_w) {
    __shared__ float s[ROUTER_MAX_E], choice[ROUTER_MAX_E];
    __shared__ float gscore[ROUTER_MAX_GROUPS];
    __shared__ int gkeep[ROUTER_MAX_GROUPS];
    __shared__ u64 best[ROUTER_THREADS / 32];
    __shared__ int picked[32];
    const int t = blockIdx.x, tid = threadIdx.x;
    for (int e = tid; e < E; e += ROUTER_THREADS) {
        const float l = logits[(long long)t * E + e];
        const float sg = 1.f / (1.f + expf(-l));
        s[e] = sg;
        choice[e] = sg + bias[e];
    }
    __syncthreads();
    const int gsize = E / n_group;
    if (tid < n_group) {           // top-2 sum per group
        float a = -__int_as_float(0x7f800000), b = -__int_as_float(0x7f800000);
        for (int e = tid * gsize; e < (tid + 1) * gsize; ++e) {
            const float c = choice[e];
            if (c > a) { b = a; a = c; } else if (c > b) { b = c; }
        }
        gscore[tid] = gsize >= 2 ? a + b : a;
        gkeep[tid] = 0;
    }
    __syncthreads();
    if (tid == 0 && topk_group < n_group) {
        for (int r = 0; r < topk_group; ++r) {
            int bi = -1;
            for (int g = 0; g < n_group; ++g)
                if (!gkeep[g] && (bi < 0 || gscore[g] > gscore[bi])) bi = g;
            gkeep[bi] = 1;
        }
    } else if (tid == 0) {
        for (int g = 0; g < n_group; ++g) gkeep[g] = 1;
    }
    __syncthreads();
    // k rounds of a block argmax over unique keys (value bits << 32 | ~id): ties go to the lower id.
    for (int r = 0; r < k; ++r) {
        u64 m = 0;
        for (int e = tid; e < E; e += ROUTER_THREADS) {
            if (!gkeep[e / gsize]) continue;
            bool taken = false;
            for (int q = 0; q < r; ++q) taken |= picked[q] == e;
            if (taken) continue;
            m = max(m, ((u64)ord_key(choice[e]) << 32) | (u64)(~(uint32_t)e));
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
        if ((tid & 31) == 0) best[tid >> 5] = m;
        __syncthreads();
        if (tid == 0) {
            u64 mm = 0;
            for (int w = 0; w < ROUTER_THREADS / 32; ++w) mm = max(mm, best[w]);
            picked[r] = (int)(~(uint32_t)mm);
        }
        __syncthreads();
    }
    if (tid == 0) {
        float sum = 0.f;
        for (int r = 0; r < k; ++r) sum += s[picked[r]];
        const float f = normalize ? scale / (sum + 1e-20f) : scale;
        for (int r = 0; r < k; ++r) {
            out_ids[(long long)t * k + r] = picked[r];
            out_w[(long long)t * k + r] = s[picked[r]] * f;
        }
    }
}
