// The RMSNorm of one row by a block of NORM_THREADS threads (rmsnorm_kernel in norm.cu and the persistent
// executor's norm item, cuda_src/persistent_layer.cu, run this same body: identical bits). norm.cu's header
// comment describes the arithmetic; `t` is the row, `red` NORM_THREADS / 32 floats of shared memory.
// wait_inputs (common.cuh: the PDL wait, or the executor's counter wait) sits between the weight and the
// row loads.
#pragma once
#include "layer_math.cuh"

#define NORM_THREADS 256
#define NORM_MAXV 4          // 16-byte vectors per thread held in registers: H <= 8 * 4 * 256 = 8192

template <typename WaitHook = PdlWaitHook>
__device__ __forceinline__ void rmsnorm_row(
        int t, const bf16_bits* __restrict__ x, long long x_stride,
        const bf16_bits* __restrict__ res_in, long long res_in_stride,
        bf16_bits* __restrict__ res_out, long long res_out_stride,
        const bf16_bits* __restrict__ w, bf16_bits* __restrict__ out, long long out_stride,
        const int* __restrict__ out_rows, int H, float eps, float* red, WaitHook wait_inputs = WaitHook()) {
    const int nv = H / 8;
    // the weight vectors (never written by a kernel) load BEFORE the wait: their latency (an HBM miss in a
    // step's layer sequence) overlaps the previous kernel instead of following the row's reduction
    uint4 wv[NORM_MAXV];
#pragma unroll
    for (int j = 0; j < NORM_MAXV; ++j) {
        const int i = threadIdx.x + j * NORM_THREADS;
        if (i < nv) wv[j] = ((const uint4*)w)[i];
    }
    wait_inputs();                          // earlier kernels' (or items') outputs from here on
    const uint4* xr = (const uint4*)(x + t * x_stride);
    const uint4* rr = res_in ? (const uint4*)(res_in + t * res_in_stride) : nullptr;
    // Every row vector (and its residual) is requested before any is used (docs/history/2026-11-29-kernels.md
    // "Row loads issued one at a time"): written as one loop, ptxas (sm_90 and sm_120) issued x[j + 1] only after vector j's
    // fmas, one round trip per vector, 4 per row at H = 7168 (SASS). Measured on the H200: the
    // step 1 x 8 -2.7 to -3.7%, every shape faster or equal.
    uint4 xa[NORM_MAXV], ra[NORM_MAXV];
#pragma unroll
    for (int j = 0; j < NORM_MAXV; ++j) {
        const int i = threadIdx.x + j * NORM_THREADS;
        if (i < nv) {
            xa[j] = xr[i];
            if (rr) ra[j] = rr[i];
        }
    }
    // The row is kept as bf16 (the residual sum as stored, or x) and widened again for the output: the
    // same floats (bf16 -> f32 is exact) in 16 registers instead of 32 floats, so the body also fits the
    // persistent executor's budget at two blocks per SM (128 registers).
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_MAXV; ++j) {
        const int i = threadIdx.x + j * NORM_THREADS;
        if (i < nv) {
            float hv[8];
            if (rr) {
                xa[j] = add_residual8(xa[j], ra[j], hv);          // the bf16 sum: stored, and kept as the row
                ((uint4*)(res_out + t * res_out_stride))[i] = xa[j];
            } else {
                const bf16_bits* ah = (const bf16_bits*)&xa[j];
#pragma unroll
                for (int e = 0; e < 8; ++e) hv[e] = bf16_to_f32(ah[e]);
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) ss += hv[e] * hv[e];
        }
    }
    const float rstd = rms_rstd<NORM_THREADS>(ss, red, H, eps);
    const long long orow = out_rows ? (long long)out_rows[t] : (long long)t;
    rms_scale_store_row<NORM_THREADS, NORM_MAXV>(
        [&](int j, int e) { return bf16_to_f32(((const bf16_bits*)&xa[j])[e]); }, rstd, wv, nv,
        (uint4*)(out + orow * out_stride));
}
