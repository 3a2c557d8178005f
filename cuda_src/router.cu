// MoE router (DeepSeek-V3 / Kimi "noaux_tc", sigmoid scoring) on precomputed fp32 gate logits
// (the skinny GEMM with fp32 output gives x @ gate^T with fp32 accumulation).
//   s = sigmoid(logit); choice = s + bias (bias only steers the choice)
//   groups: score(g) = sum of the top-2 choice values of the group's experts; keep the topk_group best
//   groups (ties: lower group), experts of other groups are out;
//   ids = the k best choice values among the kept experts (ties: lower expert id), in descending order;
//   weights = s[ids] / (sum s[ids] + 1e-20 when normalising) * routed_scaling_factor.
// One warp per token, no block-wide barriers: each candidate is a unique 64-bit key
// (order-preserving bits of choice << 32 | ~id) in the warp's shared-memory slice; k rounds of a warp
// max-reduction pick the experts (the winner's key is zeroed). E <= ROUTER_MAX_E, n_group <= 32.
//
// The same launch optionally runs the shared expert's SwiGLU activation (act.cu's silu_mul arithmetic,
// bit-identical): blocks >= route_blocks compute act[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]. The
// router and the shared expert's gate_up GEMM both read the normed rows and are independent, so issuing
// the router GEMM and the gate_up GEMM first lets one small launch finish both (one launch per MoE layer
// fewer). Everything read here comes from earlier kernels except the bias: DDT_PDL_WAIT() comes first.
#include "layer_math.cuh"

#define ROUTER_WARPS 4
#define ROUTER_MAX_E 512
typedef unsigned long long u64;

__device__ __forceinline__ uint32_t ord_key(float f) {
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float ord_val(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ u64 warp_max(u64 m) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

extern "C" __global__ void __launch_bounds__(ROUTER_WARPS * 32)
router_topk(const float* __restrict__ logits, int T, int E, const float* __restrict__ bias, int n_group,
            int topk_group, int k, int normalize, float scale, int* __restrict__ out_ids, float* __restrict__ out_w,
            int route_blocks, const bf16_bits* __restrict__ gate_up, long long gu_stride,
            bf16_bits* __restrict__ act, long long act_stride, int I) {
    DDT_PDL_WAIT();
    if ((int)blockIdx.x >= route_blocks) {      // shared expert SwiGLU, 8 values (16 bytes) per step
        const int nv = I / 8;
        const long long total = (long long)T * nv;
        for (long long gi = (long long)(blockIdx.x - route_blocks) * blockDim.x + threadIdx.x; gi < total;
             gi += (long long)(gridDim.x - route_blocks) * blockDim.x) {
            const int t = (int)(gi / nv), v = (int)(gi % nv);
            const uint4 gv = ((const uint4*)(gate_up + t * gu_stride))[v];
            const uint4 uv = ((const uint4*)(gate_up + t * gu_stride + I))[v];
            ((uint4*)(act + t * act_stride))[v] = silu_mul8(gv, uv);
        }
        return;
    }
    __shared__ u64 keys_s[ROUTER_WARPS][ROUTER_MAX_E];
    __shared__ float s_s[ROUTER_WARPS][ROUTER_MAX_E];
    __shared__ int pick_s[ROUTER_WARPS][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * ROUTER_WARPS + warp;
    if (t >= T) return;             // only warp-level synchronisation below: an idle warp may leave
    u64* keys = keys_s[warp];
    float* s = s_s[warp];
    for (int e = lane; e < E; e += 32) {
        const float sg = 1.f / (1.f + expf(-logits[(long long)t * E + e]));
        s[e] = sg;
        keys[e] = ((u64)ord_key(sg + bias[e]) << 32) | (u64)(~(uint32_t)e);
    }
    __syncwarp();
    if (topk_group < n_group) {
        const int gsize = E / n_group;
        u64 gkey = 0;
        if (lane < n_group) {       // lane g scores group g: the sum of its two best choice values
            float a = -__int_as_float(0x7f800000), b = a;
            for (int e = lane * gsize; e < (lane + 1) * gsize; ++e) {
                const float c = ord_val((uint32_t)(keys[e] >> 32));
                if (c > a) { b = a; a = c; } else if (c > b) { b = c; }
            }
            gkey = ((u64)ord_key(gsize >= 2 ? a + b : a) << 32) | (u64)(~(uint32_t)lane);
        }
        bool kept = false;
        for (int r = 0; r < topk_group; ++r) {
            const u64 m = warp_max(gkey);
            if (lane == (int)(~(uint32_t)m)) { kept = true; gkey = 0; }
        }
        const unsigned int kept_mask = __ballot_sync(0xffffffffu, kept);
        for (int e = lane; e < E; e += 32)
            if (!((kept_mask >> (e / gsize)) & 1u)) keys[e] = 0;
        __syncwarp();
    }
    float sum = 0.f;
    for (int r = 0; r < k; ++r) {
        u64 m = 0;
        for (int e = lane; e < E; e += 32) m = max(m, keys[e]);
        m = warp_max(m);
        const int id = (int)(~(uint32_t)m);
        if (lane == (id & 31)) keys[id] = 0;     // the owner lane retires the winner
        if (lane == 0) pick_s[warp][r] = id;
        sum += s[id];
        __syncwarp();
    }
    const float f = normalize ? scale / (sum + 1e-20f) : scale;
    if (lane < k) {
        const int id = pick_s[warp][lane];
        out_ids[(long long)t * k + lane] = id;
        out_w[(long long)t * k + lane] = s[id] * f;
    }
}
