// MoE router (DeepSeek-V3 / Kimi "noaux_tc", sigmoid scoring) on precomputed fp32 gate logits
// (the skinny GEMM with fp32 output gives x @ gate^T with fp32 accumulation).
//   s = sigmoid(logit); choice = s + bias (bias only steers the choice)
//   groups: score(g) = sum of the top-2 choice values of the group's experts; keep the topk_group best
//   groups (ties: lower group), experts of other groups are out;
//   ids = the k best choice values among the kept experts (ties: lower expert id), in descending order;
//   weights = s[ids] / (sum s[ids] + 1e-20 when normalising) * routed_scaling_factor.
//
// Selection (v2): one warp per token, every candidate in REGISTERS. Lane l owns experts l + 32 j
// (j < ROUTER_PER_LANE, coalesced loads) and keeps its own best live candidate (ord key, id, s). One pick
// is two warp reductions (__reduce_max_sync of the order-preserving 32-bit choice key, then
// __reduce_min_sync of the ids holding that key: ties go to the lowest id exactly as the reference) and one
// shuffle of the winner's s; only the owner lane retires the winner and rescans its 16 registers. v1 kept
// the candidates in shared memory and rescanned all of them every round (12 shared loads + a 64-bit
// shuffle butterfly of 10 shuffles per pick). The bias (a weight) is loaded before DDT_PDL_WAIT().
// Group-limited routing (n_group > 1, rare: Kimi K2 has n_group 1) scores the groups through a per-warp
// shared-memory copy of the choice values, one lane per group scanning its experts in id order.
//
// The same launch optionally runs the shared expert's SwiGLU: blocks >= route_blocks compute
// act[t, i] = bf16(silu(g) * u) with g, u = bf16(gate_up[t, i]), bf16(gate_up[t, I + i]) from the FP32
// columns of the fused router | shared gate_up GEMM (one GEMM reads the normed rows for both). Rounding
// the fp32 accumulators to bf16 first reproduces the bf16-output GEMM + silu_mul chain bit for bit
// (same f32_to_bf16, same silu_mul8 arithmetic as act.cu).
#include "layer_math.cuh"

#define ROUTER_WARPS 4
#define ROUTER_MAX_E 512
#define ROUTER_PER_LANE (ROUTER_MAX_E / 32)
typedef unsigned long long u64;

__device__ __forceinline__ uint32_t ord_key(float f) {
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ u64 warp_max(u64 m) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}
// 8 fp32 accumulators -> 8 bf16 values (16 bytes), the GEMM epilogue's rounding.
__device__ __forceinline__ uint4 round8_bf16(const float4 a, const float4 b) {
    uint4 o;
    o.x = (uint32_t)f32_to_bf16(a.x) | ((uint32_t)f32_to_bf16(a.y) << 16);
    o.y = (uint32_t)f32_to_bf16(a.z) | ((uint32_t)f32_to_bf16(a.w) << 16);
    o.z = (uint32_t)f32_to_bf16(b.x) | ((uint32_t)f32_to_bf16(b.y) << 16);
    o.w = (uint32_t)f32_to_bf16(b.z) | ((uint32_t)f32_to_bf16(b.w) << 16);
    return o;
}

extern "C" __global__ void __launch_bounds__(ROUTER_WARPS * 32)
router_topk(const float* __restrict__ logits, long long lg_stride, int T, int E, const float* __restrict__ bias,
            int n_group, int topk_group, int k, int normalize, float scale, int* __restrict__ out_ids,
            float* __restrict__ out_w, int route_blocks, const float* __restrict__ gate_up, long long gu_stride,
            bf16_bits* __restrict__ act, long long act_stride, int I) {
    // PDL: the next kernel (the shared down GEMM / the MoE) may start its weight prefetch now; its own
    // DDT_PDL_WAIT() still waits for this whole grid.
    DDT_PDL_LAUNCH_DEPENDENTS();
    if ((int)blockIdx.x >= route_blocks) {      // shared expert SwiGLU, 8 values per step
        DDT_PDL_WAIT();
        const int nv = I / 8;
        const long long total = (long long)T * nv;
        for (long long gi = (long long)(blockIdx.x - route_blocks) * blockDim.x + threadIdx.x; gi < total;
             gi += (long long)(gridDim.x - route_blocks) * blockDim.x) {
            const int t = (int)(gi / nv), v = (int)(gi % nv);
            const float4* g = (const float4*)(gate_up + t * gu_stride) + 2 * v;
            const float4* u = (const float4*)(gate_up + t * gu_stride + I) + 2 * v;
            ((uint4*)(act + t * act_stride))[v] = silu_mul8(round8_bf16(g[0], g[1]), round8_bf16(u[0], u[1]));
        }
        return;
    }
    __shared__ float c_s[ROUTER_WARPS][ROUTER_MAX_E];      // choice values, group-limited path only
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * ROUTER_WARPS + warp;
    float b_r[ROUTER_PER_LANE];
#pragma unroll
    for (int j = 0; j < ROUTER_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        b_r[j] = e < E ? bias[e] : 0.f;
    }
    DDT_PDL_WAIT();
    if (t >= T) return;             // only warp-level synchronisation below: an idle warp may leave
    uint32_t key[ROUTER_PER_LANE];
    float s_r[ROUTER_PER_LANE];
    uint32_t live = 0;              // bit j: expert lane + 32 j is still a candidate
    const float* lg = logits + (long long)t * lg_stride;
#pragma unroll
    for (int j = 0; j < ROUTER_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        const float x = e < E ? lg[e] : 0.f;
        s_r[j] = 1.f / (1.f + expf(-x));
        key[j] = ord_key(s_r[j] + b_r[j]);
        if (e < E) live |= 1u << j;
    }
    if (topk_group < n_group) {
        float* c = c_s[warp];
#pragma unroll
        for (int j = 0; j < ROUTER_PER_LANE; ++j)
            if (lane + 32 * j < E) c[lane + 32 * j] = s_r[j] + b_r[j];
        __syncwarp();
        const int gsize = E / n_group;
        u64 gkey = 0;
        if (lane < n_group) {       // lane g scores group g: the sum of its two best choice values
            float a = -__int_as_float(0x7f800000), b = a;
            for (int e = lane * gsize; e < (lane + 1) * gsize; ++e) {
                const float v = c[e];
                if (v > a) { b = a; a = v; } else if (v > b) { b = v; }
            }
            gkey = ((u64)ord_key(gsize >= 2 ? a + b : a) << 32) | (u64)(~(uint32_t)lane);
        }
        bool kept = false;
        for (int r = 0; r < topk_group; ++r) {
            const u64 m = warp_max(gkey);
            if (lane == (int)(~(uint32_t)m)) { kept = true; gkey = 0; }
        }
        const unsigned int kept_mask = __ballot_sync(0xffffffffu, kept);
#pragma unroll
        for (int j = 0; j < ROUTER_PER_LANE; ++j) {
            const int e = lane + 32 * j;
            if (e < E && !((kept_mask >> (e / gsize)) & 1u)) live &= ~(1u << j);
        }
    }
    // the lane's best live candidate: highest key, ties to the lower j (= lower expert id)
    uint32_t best_key = 0;
    int best_j = -1;
    float best_s = 0.f;
#pragma unroll
    for (int j = 0; j < ROUTER_PER_LANE; ++j)
        if (((live >> j) & 1u) && (best_j < 0 || key[j] > best_key)) { best_key = key[j]; best_j = j; best_s = s_r[j]; }
    float sum = 0.f, my_s = 0.f;
    int my_id = 0;
    for (int r = 0; r < k; ++r) {
        const bool has = best_j >= 0;
        const uint32_t m = __reduce_max_sync(0xffffffffu, has ? best_key : 0u);
        const uint32_t cand = (has && best_key == m) ? (uint32_t)(lane + 32 * best_j) : 0xffffffffu;
        const int id = (int)__reduce_min_sync(0xffffffffu, cand);
        const int owner = id & 31;
        const float sw = __shfl_sync(0xffffffffu, best_s, owner);
        sum += sw;
        if (lane == r) { my_id = id; my_s = sw; }
        if (lane == owner) {        // retire the winner, rescan the lane's registers
            live &= ~(1u << best_j);
            best_j = -1;
            best_key = 0;
#pragma unroll
            for (int j = 0; j < ROUTER_PER_LANE; ++j)
                if (((live >> j) & 1u) && (best_j < 0 || key[j] > best_key)) {
                    best_key = key[j]; best_j = j; best_s = s_r[j];
                }
        }
    }
    const float f = normalize ? scale / (sum + 1e-20f) : scale;
    if (lane < k) {
        out_ids[(long long)t * k + lane] = my_id;
        out_w[(long long)t * k + lane] = my_s * f;
    }
}
