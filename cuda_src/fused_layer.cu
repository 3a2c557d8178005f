// Fused kernels of the target's MLA block (docs/MODELS.md "Per-layer kernel sequence"). Each one replaces a
// chain of small launches between the big GEMMs: at decode sizes every launch costs ~2-3 us of latency
// while moving only a few KB, so the chain, not the bytes, set the time.
//
//  * mla_qkv_a_post: after the fused q_a | kv_a GEMM, per row: c_q = RMSNorm(q_a), c_kv = RMSNorm(kv_a),
//    k_pe = RoPE(k_pe) and the latent row (c_kv | k_pe) written to the paged cache at kv_pos (< 0: no
//    write). Replaces 2 rms_norm + rope + kv_write_latent. Same arithmetic and the same reduction order as
//    rmsnorm_kernel / rope_kernel<false, false> (norm.cu / rope.cu), so the results are bit-identical.
//  * mla_head_gemm<KS>: per-head products of the absorbed MLA, out[t, h, :] = x[t, h, :] @ W[h]^T with
//    W [nh, N, K] (W_UK^T: N 512, K 128; W_UV: N 128, K 512), and optionally RoPE(q_pe) of the same
//    tokens (the W_UK step produces q_full = q_lat | rope(q_pe)). Replaces a batched skinny GEMM + its
//    split-K reduce (+ the q_pe rope). mma.sync m16n8k16 with fragments loaded straight from global
//    memory: the head's weight slice is tiny (32 columns x K per block), so no shared-memory pipeline is
//    needed; the weight fragments are loaded before DDT_PDL_WAIT() (weights never change).
#include "mla_small.cuh"

// One block per row t: the row body qkv_a_post_row (mla_small.cuh), shared with the persistent executor.
extern "C" __global__ void __launch_bounds__(FL_THREADS)
mla_qkv_a_post(const bf16_bits* __restrict__ qkv, long long qkv_stride, int ql,
               const bf16_bits* __restrict__ q_norm_w, const bf16_bits* __restrict__ kv_norm_w, float eps,
               bf16_bits* __restrict__ c_q, long long cq_stride,
               const int* __restrict__ positions, const float* __restrict__ inv_freq, float amplitude,
               const int* __restrict__ stream_ids, const int* __restrict__ kv_pos,
               bf16_bits* __restrict__ pool, const int* __restrict__ block_table, int max_pages) {
    __shared__ float red_q[FL_THREADS / 32], red_kv[FL_THREADS / 32];
    qkv_a_post_row<false>(blockIdx.x, qkv, qkv_stride, ql, q_norm_w, kv_norm_w, eps, c_q, cq_stride, positions, inv_freq,
                   amplitude, stream_ids, kv_pos, pool, block_table, max_pages, red_q, red_kv, PdlTriggerWaitHook());
}

// ---------------------------------------------------------------------------------------------------
// Per-head GEMM. grid (nh, N / 32, token groups), 128 threads = 4 warps: one group of mla_small.cuh's
// head_gemm bodies. The block owns head h, output columns n0 .. n0 + 31 (4 n8 tiles) and token tiles of 16
// (blockIdx.z, + gridDim.z, ...); blockIdx.y == 0 also rotates q_pe when pe is given.
template <int KS>
__global__ void __launch_bounds__(HG_WARPS * 32)
mla_head_gemm(const bf16_bits* __restrict__ x, long long x_row, long long x_head,
              const bf16_bits* __restrict__ w, bf16_bits* __restrict__ out, long long out_row, long long out_head,
              int T, int N,
              const bf16_bits* __restrict__ pe, long long pe_row, long long pe_head,
              bf16_bits* __restrict__ pe_out, long long pe_out_row, long long pe_out_head,
              const int* __restrict__ positions, const float* __restrict__ inv_freq, float amplitude, int half) {
    __shared__ float red[HG_WARPS][16][33];
    const int h = blockIdx.x, n0 = blockIdx.y * 32;
    const int tid = threadIdx.x, warp = tid >> 5;
    uint32_t b[KS][4][2];
    head_gemm_weights<KS, 4>(w, h, N, n0, warp, tid & 31, b);
    PdlTriggerWaitHook()();
    head_gemm_tiles<KS, 4, false>(x, x_row, x_head, out, out_row, out_head, T, h, n0, blockIdx.z, gridDim.z, warp, tid,
                                  b, red);
    if (pe != nullptr && blockIdx.y == 0)
        head_gemm_rope<false>(pe, pe_row, pe_head, pe_out, pe_out_row, pe_out_head, positions, inv_freq, amplitude, half, T,
                       h, blockIdx.z, gridDim.z, tid);
}
