// Split-KV combine shared by the MLA and the drafter attention kernels (docs/ATTENTION.md).
//
// Each split i of an output row wrote its normalised fp32 partial o_i [D] and its log2-sum-exp lse_i
// (-inf when the split saw no visible key). The row is o = sum_i 2^(lse_i - max) o_i / sum_i 2^(lse_i - max).
// Partials live at part_o[(i * stride + row) * D], part_lse[i * stride + row].
//
// attn_combine_row: one block (NW warps) merges one row; the warps share the splits (a single warp walking
// 100+ splits one after the other is latency bound), each lane holds D / 32 columns as float4s, the NW
// partial sums meet in shared memory. Reads go through L2 (__ldcg): the partials were written by other
// blocks of an earlier kernel.
#pragma once
#include "common.cuh"

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

template <int D, int NW>
struct AttnCombineSmem {
    float red_max[NW];
    float red_w[NW];
    float acc[NW][D];
};

template <int D, int NW>
__device__ __forceinline__ void attn_combine_row(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                                                 size_t stride, size_t row, int num_splits,
                                                 bf16_bits* __restrict__ dst, AttnCombineSmem<D, NW>& sm) {
    static_assert(D % 128 == 0, "lanes hold whole float4s of the row");
    constexpr int V4 = D / 128;  // float4s per lane
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float mx = -INFINITY;
    for (int sp = tid; sp < num_splits; sp += NW * 32) mx = fmaxf(mx, __ldcg(part_lse + sp * stride + row));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) sm.red_max[warp] = mx;
    __syncthreads();
    mx = sm.red_max[0];
#pragma unroll
    for (int w = 1; w < NW; ++w) mx = fmaxf(mx, sm.red_max[w]);

    float4 acc[V4];
#pragma unroll
    for (int k = 0; k < V4; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    float wsum = 0.f;
    for (int sp = warp; sp < num_splits; sp += NW) {
        const float lse = __ldcg(part_lse + sp * stride + row);
        if (lse == -INFINITY) continue;  // an empty split (no visible key) contributes nothing
        const float w = exp2f(lse - mx);
        wsum += w;
        const float4* src = reinterpret_cast<const float4*>(part_o + (sp * stride + row) * D);
#pragma unroll
        for (int k = 0; k < V4; ++k) {
            const float4 v = __ldcg(src + lane + 32 * k);
            acc[k].x += w * v.x; acc[k].y += w * v.y; acc[k].z += w * v.z; acc[k].w += w * v.w;
        }
    }
#pragma unroll
    for (int k = 0; k < V4; ++k) *reinterpret_cast<float4*>(&sm.acc[warp][4 * (lane + 32 * k)]) = acc[k];
    if (lane == 0) sm.red_w[warp] = wsum;
    __syncthreads();
    float wt = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) wt += sm.red_w[w];
    const float inv = wt > 0.f ? 1.f / wt : 0.f;
    for (int c = 2 * tid; c < D; c += 2 * NW * 32) {
        float x0 = 0.f, x1 = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) { x0 += sm.acc[w][c]; x1 += sm.acc[w][c + 1]; }
        *reinterpret_cast<unsigned*>(dst + c) =
            (unsigned)f32_to_bf16(x0 * inv) | ((unsigned)f32_to_bf16(x1 * inv) << 16);
    }
}
