// Rotary position embedding (YaRN frequencies precomputed on the host) on bf16 rows.
//  * ADJACENT pairs (2i, 2i+1): MLA's q_pe / k_pe (DeepSeek-V3 / Kimi layout).
//  * NEOX (rotate-half) pairs (i, i + D/2): the DFlash drafter (Qwen3-style attention).
// cos/sin either come from fp32 tables [max_pos, D/2] (TABLE) or are computed as cos(p * inv_freq[i]) with
// the angle formed by one fp32 multiply, as HF computes it, times the YaRN amplitude.
// x is [T, heads, D] with element strides (a view into q or kv); out likewise (may alias x: each thread
// reads its own pair before writing it). out_rows (optional) scatters token t to out row out_rows[t], which
// writes rotated k_pe straight into the latent cache row.
#include "common.cuh"

template <bool NEOX, bool TABLE>
__global__ void rope_kernel(const bf16_bits* __restrict__ x, long long x_row_stride, int x_head_stride,
                            bf16_bits* out, long long out_row_stride, int out_head_stride,
                            const int* __restrict__ out_rows, const int* __restrict__ positions,
                            int T, int heads, int half,
                            const float* __restrict__ cos_tab, const float* __restrict__ sin_tab, int max_pos,
                            const float* __restrict__ inv_freq, float amplitude) {
    // PDL (common.cuh): let the next kernel launch now (it waits for this whole grid before reading),
    // then wait for the previous kernel's outputs before the first read of an input.
    DDT_PDL_LAUNCH_DEPENDENTS();
    DDT_PDL_WAIT();
    const long long total = (long long)T * heads * half;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < total;
         g += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(g % half);
        const int h = (int)((g / half) % heads);
        const int t = (int)(g / ((long long)half * heads));
        int p = positions[t];
        float c, s;
        if (TABLE) {
            p = min(max(p, 0), max_pos - 1);     // the wrapper sizes the table; clamp keeps a bad id in bounds
            c = cos_tab[(long long)p * half + i];
            s = sin_tab[(long long)p * half + i];
        } else {
            const float ang = (float)p * inv_freq[i];
            c = cosf(ang) * amplitude;
            s = sinf(ang) * amplitude;
        }
        const int i0 = NEOX ? i : 2 * i, i1 = NEOX ? i + half : 2 * i + 1;
        const bf16_bits* xr = x + t * x_row_stride + (long long)h * x_head_stride;
        const float a = bf16_to_f32(xr[i0]), b = bf16_to_f32(xr[i1]);
        const long long orow = out_rows ? (long long)out_rows[t] : (long long)t;
        bf16_bits* o = out + orow * out_row_stride + (long long)h * out_head_stride;
        o[i0] = f32_to_bf16(a * c - b * s);
        o[i1] = f32_to_bf16(b * c + a * s);
    }
}

// Per-head RMSNorm + NeoX RoPE for 128-wide heads (the DFlash drafter's q / k after the batched q|k|v
// GEMM), one launch instead of rms_norm + rope per head group. x is head-major [n_heads, T, 128]; heads
// [0, n_a) use norm weight w_a and go to out_a [T, n_a, 128], heads [n_a, n_heads) use w_b -> out_b.
// Bit-identical to rmsnorm_kernel (rounded to bf16) followed by rope_kernel<true, false>: a HALF-warp per
// row, lanes 0..15 holding 8 consecutive values each, is exactly rmsnorm_kernel's reduction at H = 128
// (its 16 active threads, the xor-16 butterfly step adds zeros, the warp partials 1..7 are zeros); the
// rotation is the rope kernel's expression. The NeoX partner of value i (< 64) is i + 64: 8 lanes further,
// one shuffle. Weights and inv_freq are read before DDT_PDL_WAIT().
#define HNR_D 128
extern "C" __global__ void __launch_bounds__(256)
head_norm_rope_kernel(const bf16_bits* __restrict__ x, long long x_head_stride, long long x_row_stride, int T,
                      int n_heads, int n_a, const bf16_bits* __restrict__ w_a, const bf16_bits* __restrict__ w_b,
                      float eps, bf16_bits* __restrict__ out_a, long long oa_row_stride, long long oa_head_stride,
                      bf16_bits* __restrict__ out_b, long long ob_row_stride, long long ob_head_stride,
                      const int* __restrict__ positions, const float* __restrict__ inv_freq, float amplitude) {
    DDT_PDL_LAUNCH_DEPENDENTS();
    const int sub = threadIdx.x & 15;                          // lane within the half-warp
    const long long row = (long long)blockIdx.x * (blockDim.x / 16) + (threadIdx.x >> 4);
    const bool active = row < (long long)n_heads * T;
    const int h = active ? (int)(row / T) : 0, t = active ? (int)(row % T) : 0;
    const bool first = h < n_a;
    const bf16_bits* w = first ? w_a : w_b;
    const uint4 wv = active && (first || w_b) ? ((const uint4*)w)[sub] : make_uint4(0, 0, 0, 0);
    const int f0 = (sub & 7) * 8;                              // frequency index of this lane's first value
    const float4 fa = ((const float4*)inv_freq)[f0 / 4], fb = ((const float4*)inv_freq)[f0 / 4 + 1];
    DDT_PDL_WAIT();
    uint4 xv = make_uint4(0, 0, 0, 0);
    if (active) xv = ((const uint4*)(x + h * x_head_stride + t * x_row_stride))[sub];
    const bf16_bits* xh = (const bf16_bits*)&xv;
    float v[8], ss = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) { v[e] = bf16_to_f32(xh[e]); ss += v[e] * v[e]; }
    // rmsnorm_kernel's block_sum at H = 128: its xor-16 step adds the zero upper half-warp (exact), then
    // 8, 4, 2, 1 as here; its sum of the 8 warp partials adds zeros to this value
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float rstd = rsqrtf(ss / (float)HNR_D + eps);
    const bf16_bits* wh = (const bf16_bits*)&wv;
    uint4 nv;
    bf16_bits* nh = (bf16_bits*)&nv;
#pragma unroll
    for (int e = 0; e < 8; ++e) nh[e] = f32_to_bf16(bf16_to_f32(wh[e]) * (v[e] * rstd));
    uint4 pv;                                                  // the partner lane's normed values
    pv.x = __shfl_xor_sync(0xffffffffu, nv.x, 8);
    pv.y = __shfl_xor_sync(0xffffffffu, nv.y, 8);
    pv.z = __shfl_xor_sync(0xffffffffu, nv.z, 8);
    pv.w = __shfl_xor_sync(0xffffffffu, nv.w, 8);
    if (!active) return;
    const bf16_bits* ph = (const bf16_bits*)&pv;
    const float fr[8] = {fa.x, fa.y, fa.z, fa.w, fb.x, fb.y, fb.z, fb.w};
    const int p = positions[t];
    uint4 ov;
    bf16_bits* oh = (bf16_bits*)&ov;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float ang = (float)p * fr[e];
        const float c = cosf(ang) * amplitude;
        const float s = sinf(ang) * amplitude;
        if (sub < 8) {          // value i = f0 + e: a = own, b = partner (i + 64)
            const float a = bf16_to_f32(nh[e]), b = bf16_to_f32(ph[e]);
            oh[e] = f32_to_bf16(a * c - b * s);
        } else {                // value i + 64: b = own, a = partner
            const float a = bf16_to_f32(ph[e]), b = bf16_to_f32(nh[e]);
            oh[e] = f32_to_bf16(b * c + a * s);
        }
    }
    bf16_bits* o = first ? out_a + t * oa_row_stride + h * oa_head_stride
                         : out_b + t * ob_row_stride + (h - n_a) * ob_head_stride;
    ((uint4*)o)[sub] = ov;
}
