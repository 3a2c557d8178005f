// Split-KV combine shared by the MLA and the drafter attention kernels (docs/ATTENTION.md).
//
// Each split i of an output row wrote its normalised fp32 partial o_i [D] and its log2-sum-exp lse_i
// (-inf when the split saw no visible key). The row is o = sum_i 2^(lse_i - max) o_i / sum_i 2^(lse_i - max).
// Partials live at part_o[(i * stride + row) * D], part_lse[i * stride + row].
//
// attn_combine_row: one block (NW warps) merges one row in two passes.
//   1. every thread takes splits tid, tid + NW*32, ...: reads lse, the block reduces the maximum, and the
//      weights w_i = 2^(lse_i - max) (0 for an empty split) go to shared memory with their sum.
//   2. the warps share the splits (warp w: splits w, w + NW, ...), each lane holds D / 32 columns as float4s.
//      The loads of U splits are issued before any is used and nothing they depend on is read in the loop
//      (the weights are already in shared memory), so a warp has U x D / 32 floats per lane in flight; the
//      first version (lse load -> branch -> partial load, one split at a time) paid two L2 latencies per
//      split. U = 4 costs registers (MLA: 124 vs 56 on sm_90, 2 resident blocks per SM instead of 4), which
//      loses where the grid has many rows and few splits: the wrappers take U = 4 only while the grid fits
//      2 blocks per SM (kernels/attention.py combine_unroll; H200 run in docs/ATTENTION.md).
// The NW partial sums meet in shared memory. Reads go through L2 (__ldcg): the partials were written by
// other blocks of an earlier kernel. The order of the additions is fixed by (num_splits, NW, UNROLL) alone,
// so the result is deterministic (graph replay == eager bit for bit; U = 1 and U = 4 add in different orders).
#pragma once
#include "common.cuh"

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define ATTN_MAX_SPLITS 256      // kernels/attention.py MAX_SPLITS (the wrappers reject more)

template <int D, int NW>
struct AttnCombineSmem {
    float acc[NW][D];            // first: float4 stores need 16-byte alignment
    float w[ATTN_MAX_SPLITS];    // per-split weight 2^(lse - max), 0 for an empty split
    float red[NW];
};

template <int D, int NW, int U>   // U: splits per warp whose loads are in flight together
__device__ __forceinline__ void attn_combine_row(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                                                 size_t stride, size_t row, int num_splits,
                                                 bf16_bits* __restrict__ dst, AttnCombineSmem<D, NW>& sm) {
    static_assert(D % 128 == 0, "lanes hold whole float4s of the row");
    static_assert(NW * 32 <= ATTN_MAX_SPLITS, "pass 1 keeps at most one lse per thread in a register");
    constexpr int V4 = D / 128;  // float4s per lane
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    // ---- pass 1: weights ------------------------------------------------------------------------------
    float lse[ATTN_MAX_SPLITS / (NW * 32)];
    float mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < ATTN_MAX_SPLITS / (NW * 32); ++k) {
        const int sp = tid + k * NW * 32;
        lse[k] = sp < num_splits ? __ldcg(part_lse + sp * stride + row) : -INFINITY;
        mx = fmaxf(mx, lse[k]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) sm.red[warp] = mx;
    __syncthreads();
    mx = sm.red[0];
#pragma unroll
    for (int w = 1; w < NW; ++w) mx = fmaxf(mx, sm.red[w]);
#pragma unroll
    for (int k = 0; k < ATTN_MAX_SPLITS / (NW * 32); ++k) {
        const int sp = tid + k * NW * 32;
        // an empty split (no visible key: lse = -inf) weighs 0; so does every split if all are empty
        if (sp < num_splits) sm.w[sp] = lse[k] == -INFINITY ? 0.f : exp2f(lse[k] - mx);
    }
    __syncthreads();   // the weights are complete; sm.red is free again

    // ---- pass 2: weighted sum of the partials ---------------------------------------------------------
    float4 acc[V4];
#pragma unroll
    for (int k = 0; k < V4; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    float wsum = 0.f;
    for (int sp0 = warp; sp0 < num_splits; sp0 += U * NW) {
        float4 v[U][V4];
        float wu[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int sp = sp0 + u * NW;
            wu[u] = sp < num_splits ? sm.w[sp] : 0.f;
            // a zero weight skips the load: an empty split's partial is never read (it may be anything)
            const float4* src = reinterpret_cast<const float4*>(part_o + ((size_t)sp * stride + row) * D);
#pragma unroll
            for (int k = 0; k < V4; ++k)
                v[u][k] = wu[u] != 0.f ? __ldcg(src + lane + 32 * k) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            wsum += wu[u];
#pragma unroll
            for (int k = 0; k < V4; ++k) {
                acc[k].x += wu[u] * v[u][k].x; acc[k].y += wu[u] * v[u][k].y;
                acc[k].z += wu[u] * v[u][k].z; acc[k].w += wu[u] * v[u][k].w;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < V4; ++k) *reinterpret_cast<float4*>(&sm.acc[warp][4 * (lane + 32 * k)]) = acc[k];
    if (lane == 0) sm.red[warp] = wsum;
    __syncthreads();
    float wt = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) wt += sm.red[w];
    const float inv = wt > 0.f ? 1.f / wt : 0.f;
    for (int c = 2 * tid; c < D; c += 2 * NW * 32) {
        float x0 = 0.f, x1 = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) { x0 += sm.acc[w][c]; x1 += sm.acc[w][c + 1]; }
        *reinterpret_cast<unsigned*>(dst + c) =
            (unsigned)f32_to_bf16(x0 * inv) | ((unsigned)f32_to_bf16(x1 * inv) << 16);
    }
}
