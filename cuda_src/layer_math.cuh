// Small device functions shared by several kernel families, so that kernels which must agree bit for bit
// (a fused kernel and the unfused chain it replaces) use literally the same arithmetic and order.
#pragma once
#include "common.cuh"

// Sum of one float per thread over a block of THREADS threads (a multiple of 32): warp butterflies, then
// one partial per warp in red[THREADS / 32], summed in warp order by every thread. The order is fixed, so
// every caller reduces identically (rmsnorm_kernel and mla_qkv_a_post rely on it). `red` must not be
// reused by a later call without a barrier in between.
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < THREADS / 32; ++i) s += red[i];
    return s;
}

// SwiGLU on 8 bf16 values (16 bytes): bf16(silu(g) * u), fp32 math (silu_mul_kernel and the router's
// shared-expert path compute it identically).
__device__ __forceinline__ uint4 silu_mul8(const uint4 gv, const uint4 uv) {
    const bf16_bits* gh = (const bf16_bits*)&gv;
    const bf16_bits* uh = (const bf16_bits*)&uv;
    uint4 o;
    bf16_bits* oh = (bf16_bits*)&o;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float gf = bf16_to_f32(gh[e]);
        oh[e] = f32_to_bf16(gf / (1.f + expf(-gf)) * bf16_to_f32(uh[e]));
    }
    return o;
}

// One value of silu_mul8: bf16(silu(g) * u), the same expression (router_topk_down forms its MMA operands
// element by element and must produce the same bf16 act values as silu_mul8 / silu_mul_kernel).
__device__ __forceinline__ bf16_bits silu_mul1(const bf16_bits g, const bf16_bits u) {
    const float gf = bf16_to_f32(g);
    return f32_to_bf16(gf / (1.f + expf(-gf)) * bf16_to_f32(u));
}
