// RMSNorm over rows of bf16: y = bf16(w * x * rsqrt(mean(x^2) + eps)), fp32 math.
// Optional fused residual add (the decoder's "h = h + residual; x = norm(h)"): the sum is rounded to
// bf16 (the residual stream is bf16) and that rounded value is both written back as the new residual and
// normalised. Rows may be strided views, and out_rows (optional) scatters row t to out row out_rows[t]
// (the latent KV cache slot), so the kv_a norm can write straight into the paged cache.
#include "norm_row.cuh"

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_kernel(const bf16_bits* __restrict__ x, long long x_stride,
               const bf16_bits* __restrict__ res_in, long long res_in_stride,
               bf16_bits* __restrict__ res_out, long long res_out_stride,
               const bf16_bits* __restrict__ w, bf16_bits* __restrict__ out, long long out_stride,
               const int* __restrict__ out_rows, int H, float eps) {
    __shared__ float red[NORM_THREADS / 32];
    // PDL (common.cuh): let the next kernel launch now (it waits for this whole grid before reading); the
    // body waits for the previous kernel's outputs after loading the weights.
    DDT_PDL_LAUNCH_DEPENDENTS();
    rmsnorm_row(blockIdx.x, x, x_stride, res_in, res_in_stride, res_out, res_out_stride, w, out, out_stride,
                out_rows, H, eps, red);
}
