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
//
// Partial element type PT: float (the default; the drafter and the MLA default) or bf16_bits (MLA with
// bf16 partials, kernels/attention.py PARTIAL_BF16: half the bytes written and read back). A lane always
// loads 16 bytes per chunk (4 fp32 or 8 bf16 columns), so a bf16 row is half the chunks of an fp32 one; the
// merge itself is fp32 either way (a bf16 value widens to fp32 exactly). For PT = float the operations and
// their order are those of the fp32-only version (same column ownership, same fma sequence).
#pragma once
#include "common.cuh"

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define ATTN_MAX_SPLITS 256      // kernels/attention.py MAX_SPLITS (the wrappers reject more)

// One 16-byte chunk of a partial row: CW columns, loaded through L2 and widened to fp32.
template <typename PT>
struct AttnPartChunk;
template <>
struct AttnPartChunk<float> {
    static constexpr int CW = 4;
    typedef float4 raw_t;
    // chunk i of the row at p (indexing in chunks, as the fp32-only version did: the same address arithmetic)
    static __device__ __forceinline__ raw_t load(const float* p, int i) { return __ldcg(reinterpret_cast<const float4*>(p) + i); }
    static __device__ __forceinline__ raw_t zero() { return make_float4(0.f, 0.f, 0.f, 0.f); }
    static __device__ __forceinline__ void widen(const raw_t& r, float (&x)[4]) {
        x[0] = r.x; x[1] = r.y; x[2] = r.z; x[3] = r.w;
    }
};
template <>
struct AttnPartChunk<bf16_bits> {
    static constexpr int CW = 8;
    typedef uint4 raw_t;
    static __device__ __forceinline__ raw_t load(const bf16_bits* p, int i) { return __ldcg(reinterpret_cast<const uint4*>(p) + i); }
    static __device__ __forceinline__ raw_t zero() { return make_uint4(0u, 0u, 0u, 0u); }
    static __device__ __forceinline__ void widen(const raw_t& r, float (&x)[8]) {
        // little endian: the lower 16 bits hold the even column (pack_bf16x2 / f32_to_bf16 order)
        const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            x[2 * i] = __uint_as_float(w[i] << 16);
            x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
};

template <int D, int NW>
struct AttnCombineSmem {
    float acc[NW][D];            // first: float4 stores need 16-byte alignment
    float w[ATTN_MAX_SPLITS];    // per-split weight 2^(lse - max), 0 for an empty split
    float red[NW];
};

// U: splits per warp whose loads are in flight together; PT: partial element type (float or bf16_bits)
template <int D, int NW, int U, typename PT = float>
__device__ __forceinline__ void attn_combine_row(const PT* __restrict__ part_o, const float* __restrict__ part_lse,
                                                 size_t stride, size_t row, int num_splits,
                                                 bf16_bits* __restrict__ dst, AttnCombineSmem<D, NW>& sm) {
    typedef AttnPartChunk<PT> Ch;
    constexpr int CW = Ch::CW;          // columns per 16-byte chunk
    static_assert(D % (32 * CW) == 0, "lanes hold whole 16-byte chunks of the row");
    static_assert(NW * 32 <= ATTN_MAX_SPLITS, "pass 1 keeps at most one lse per thread in a register");
    constexpr int NCH = D / (32 * CW);  // chunks per lane: lane owns columns CW * (lane + 32 k) .. + CW
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
    float acc[NCH][CW];
#pragma unroll
    for (int k = 0; k < NCH; ++k)
#pragma unroll
        for (int e = 0; e < CW; ++e) acc[k][e] = 0.f;
    float wsum = 0.f;
    for (int sp0 = warp; sp0 < num_splits; sp0 += U * NW) {
        typename Ch::raw_t v[U][NCH];
        float wu[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int sp = sp0 + u * NW;
            wu[u] = sp < num_splits ? sm.w[sp] : 0.f;
            // a zero weight skips the load: an empty split's partial is never read (it may be anything)
            const PT* src = part_o + ((size_t)sp * stride + row) * D;
#pragma unroll
            for (int k = 0; k < NCH; ++k)
                v[u][k] = wu[u] != 0.f ? Ch::load(src, lane + 32 * k) : Ch::zero();
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            wsum += wu[u];
#pragma unroll
            for (int k = 0; k < NCH; ++k) {
                float x[CW];
                Ch::widen(v[u][k], x);
#pragma unroll
                for (int e = 0; e < CW; ++e) acc[k][e] += wu[u] * x[e];
            }
        }
    }
#pragma unroll
    for (int k = 0; k < NCH; ++k)
#pragma unroll
        for (int e = 0; e < CW; e += 4)
            *reinterpret_cast<float4*>(&sm.acc[warp][CW * (lane + 32 * k) + e]) =
                make_float4(acc[k][e], acc[k][e + 1], acc[k][e + 2], acc[k][e + 3]);
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
