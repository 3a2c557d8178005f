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

// The RMSNorm row pieces shared by rmsnorm_row (norm_row.cuh), the all-reduce's fused add + RMSNorm
// (ar_add_norm_row, allreduce.cuh) and mla_qkv_a_post's q norm (fused_layer.cu), which must agree bit for bit.
// h = bf16(a + r) on 8 bf16 pairs (the residual stream is bf16); hf = h as fp32.
__device__ __forceinline__ uint4 add_residual8(const uint4& av, const uint4& rv, float (&hf)[8]) {
    const bf16_bits* ah = (const bf16_bits*)&av;
    const bf16_bits* rh = (const bf16_bits*)&rv;
    uint4 s;
    bf16_bits* sh = (bf16_bits*)&s;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        sh[e] = f32_to_bf16(bf16_to_f32(ah[e]) + bf16_to_f32(rh[e]));
        hf[e] = bf16_to_f32(sh[e]);
    }
    return s;
}
// rsqrt(mean(h^2) + eps) of a row held by a block of THREADS threads: ss = the thread's sum of squares.
template <int THREADS>
__device__ __forceinline__ float rms_rstd(float ss, float* red, int H, float eps) {
    return rsqrtf(block_sum<THREADS>(ss, red) / (float)H + eps);
}
// The scale and store of that row: thread-owned vectors i = threadIdx.x + j * THREADS (< nv) of 8 values,
// v(j, e) the fp32 value of element e of vector j; out[i] = bf16(w * (v * rstd)). A functor so that a row
// held as fp32 (rms_scale_store) and one held as bf16 (rmsnorm_row: half the registers) share the store.
template <int THREADS, int MAXV, typename RowValue>
__device__ __forceinline__ void rms_scale_store_row(RowValue v, float rstd, const uint4 (&wv)[MAXV], int nv,
                                                    uint4* out) {
#pragma unroll
    for (int j = 0; j < MAXV; ++j) {
        const int i = threadIdx.x + j * THREADS;
        if (i < nv) {
            uint4 o;
            const bf16_bits* wh = (const bf16_bits*)&wv[j];
            bf16_bits* oh = (bf16_bits*)&o;
#pragma unroll
            for (int e = 0; e < 8; ++e) oh[e] = f32_to_bf16(bf16_to_f32(wh[e]) * (v(j, e) * rstd));
            out[i] = o;
        }
    }
}
template <int THREADS, int MAXV>
__device__ __forceinline__ void rms_scale_store(const float (&v)[MAXV][8], float rstd, const uint4 (&wv)[MAXV], int nv,
                                                uint4* out) {
    rms_scale_store_row<THREADS, MAXV>([&](int j, int e) { return v[j][e]; }, rstd, wv, nv, out);
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

// --- the split-K warp tile of the small GEMMs in fused_layer.cu (mla_head_gemm) and router.cu (the shared
// expert's down projection): each warp accumulates a 16-row x 32-column tile over its own k slice with four
// m16n8k16 MMAs per k step, parks it in shared memory, and the block sums the warps' tiles in a fixed order.

// acc (16 x 8 fp32 C fragment) += A (16 x 16 bf16, row-major fragment a0..a3) * B (16 x 8, .col fragment).
__device__ __forceinline__ void mma_16816_bf16(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A warp's NJ C fragments (16 x 8 NJ fp32; park_c_tile: four) into its slot of the block's [warps][16][33]
// tile: c0, c1 = (row g, cols 2 tig, +1), c2, c3 = row g + 8 (lane = 4 g + tig). Row stride 33 keeps the later
// column reads conflict-free.
template <int NJ>
__device__ __forceinline__ void park_c_tiles(float (*red)[33], const float (&acc)[NJ][4], int g, int tig) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        red[g][j * 8 + 2 * tig] = acc[j][0];
        red[g][j * 8 + 2 * tig + 1] = acc[j][1];
        red[g + 8][j * 8 + 2 * tig] = acc[j][2];
        red[g + 8][j * 8 + 2 * tig + 1] = acc[j][3];
    }
}
__device__ __forceinline__ void park_c_tile(float (*red)[33], const float (&acc)[4][4], int g, int tig) {
    park_c_tiles<4>(red, acc, g, tig);
}

// The block's sum of element (r, c) over the WARPS parked tiles, in warp order (a fixed summation order: the
// result does not depend on scheduling).
template <int WARPS>
__device__ __forceinline__ float sum_parked(const float (*red)[16][33], int r, int c) {
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < WARPS; ++q) sum += red[q][r][c];
    return sum;
}
