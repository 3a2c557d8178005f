// Peer-to-peer all-reduce kernels (one-shot / two-shot / two-level, plain or fused with the residual add + RMSNorm).
// The protocol and the buffer layout are described in allreduce.cuh; each kernel is one ArItem run by
// every block of the grid (a persistent kernel can run the same item as one of its work items).
#include "allreduce.cuh"

template <int ALGO, bool FUSED>
__global__ void __launch_bounds__(AR_THREADS, 1)
p2p_allreduce_kernel(const unsigned long long* __restrict__ peers, long long cap, int rank, int n, int island,
                     const bf16_bits* x, bf16_bits* out, long long N, int unit,
                     const bf16_bits* residual, bf16_bits* residual_out, const bf16_bits* __restrict__ weight,
                     bf16_bits* normed, float eps, long long timeout_ns, int* err) {
    __shared__ float red[AR_THREADS / 32];
    __shared__ unsigned int e_sh[2];
    ArItem a;
    a.peers = peers; a.cap = cap; a.rank = rank; a.n = n; a.island = island;
    a.x = x; a.out = out; a.N = N; a.unit = unit;
    a.residual = residual; a.residual_out = residual_out; a.weight = weight; a.normed = normed; a.eps = eps;
    a.timeout_ns = timeout_ns; a.err = err;
    ar_allreduce_item<ALGO, FUSED>(a, blockIdx.x, gridDim.x, red, e_sh);
}
// Instantiated through the wrapper's name expressions (kernels/allreduce.py AR_NAMES).
