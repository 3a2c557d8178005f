// SwiGLU activation: out[t, i] = bf16(silu(gate[t, i]) * up[t, i]) with in = [gate | up] ([T, 2I], the fused
// gate+up GEMM output), fp32 math. 8 elements (16 bytes) per thread step.
#include "layer_math.cuh"

extern "C" __global__ void silu_mul_kernel(const bf16_bits* __restrict__ in, long long in_stride,
                                           bf16_bits* __restrict__ out, long long out_stride, int T, int I) {
    // PDL (common.cuh): let the next kernel launch now (it waits for this whole grid before reading),
    // then wait for the previous kernel's outputs before the first read of an input.
    DDT_PDL_LAUNCH_DEPENDENTS();
    DDT_PDL_WAIT();
    const int nv = I / 8;
    const long long total = (long long)T * nv;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < total;
         g += (long long)gridDim.x * blockDim.x) {
        const int t = (int)(g / nv), v = (int)(g % nv);
        const uint4 gv = ((const uint4*)(in + t * in_stride))[v];
        const uint4 uv = ((const uint4*)(in + t * in_stride + I))[v];
        ((uint4*)(out + t * out_stride))[v] = silu_mul8(gv, uv);
    }
}
