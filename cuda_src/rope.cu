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
