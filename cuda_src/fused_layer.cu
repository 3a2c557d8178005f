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
#include "layer_math.cuh"

#define FL_THREADS 256
#define FL_QMAXV 2          // c_q vectors of 8 per thread: q_lora <= 8 * 2 * 256 = 4096

// One block per row t. qkv row: [q_a (ql) | kv_a (512) | k_pe (64)]. Threads: c_q vectors i, i + 256;
// c_kv vector i (< 64); k_pe pair i - 64 (threads 64..95).
extern "C" __global__ void __launch_bounds__(FL_THREADS)
mla_qkv_a_post(const bf16_bits* __restrict__ qkv, long long qkv_stride, int ql,
               const bf16_bits* __restrict__ q_norm_w, const bf16_bits* __restrict__ kv_norm_w, float eps,
               bf16_bits* __restrict__ c_q, long long cq_stride,
               const int* __restrict__ positions, const float* __restrict__ inv_freq, float amplitude,
               const int* __restrict__ stream_ids, const int* __restrict__ kv_pos,
               bf16_bits* __restrict__ pool, const int* __restrict__ block_table, int max_pages) {
    __shared__ float red_q[FL_THREADS / 32], red_kv[FL_THREADS / 32];
    const int t = blockIdx.x, tid = threadIdx.x;
    const int nvq = ql / 8;
    // weights and frequencies first: they are not written by any kernel, so they may be read before the wait
    uint4 wq[FL_QMAXV], wkv = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < FL_QMAXV; ++j) {
        const int i = tid + j * FL_THREADS;
        wq[j] = i < nvq ? ((const uint4*)q_norm_w)[i] : make_uint4(0, 0, 0, 0);
    }
    if (tid < KV_LATENT_DIM / 8) wkv = ((const uint4*)kv_norm_w)[tid];
    const int pair = tid - KV_LATENT_DIM / 8;
    const bool is_rope = pair >= 0 && pair < KV_ROPE_DIM / 2;
    const float freq = is_rope ? inv_freq[pair] : 0.f;
    DDT_PDL_LAUNCH_DEPENDENTS();  // every block has started: the next kernel may launch and prefetch its weights
    DDT_PDL_WAIT();

    const bf16_bits* row = qkv + t * qkv_stride;
    // Every load of the row first (measured faster; docs/history/2026-11-29-kernels.md "Row loads issued one at a time" and "The row-preload builds measured"): with
    // the loads inside the loops ptxas issued the second c_q vector, the kv vector and the cache slot's loads
    // after the first vector's fmas (SASS), a chain of round trips.
    uint4 qa[FL_QMAXV], kva = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < FL_QMAXV; ++j) {
        const int i = tid + j * FL_THREADS;
        qa[j] = i < nvq ? ((const uint4*)row)[i] : make_uint4(0, 0, 0, 0);
    }
    if (tid < KV_LATENT_DIM / 8) kva = ((const uint4*)(row + ql))[tid];
    const uint32_t ab = is_rope ? ((const uint32_t*)(row + ql + KV_LATENT_DIM))[pair] : 0u;
    const int pos = is_rope ? positions[t] : 0;
    const int p = kv_pos[t];
    const int sid = stream_ids[t];
    float v[FL_QMAXV][8];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < FL_QMAXV; ++j) {
        const int i = tid + j * FL_THREADS;
        if (i < nvq) {
            const bf16_bits* ah = (const bf16_bits*)&qa[j];
#pragma unroll
            for (int e = 0; e < 8; ++e) { v[j][e] = bf16_to_f32(ah[e]); ss += v[j][e] * v[j][e]; }
        }
    }
    float kv[8];
    float ss_kv = 0.f;
    if (tid < KV_LATENT_DIM / 8) {
        const bf16_bits* ah = (const bf16_bits*)&kva;
#pragma unroll
        for (int e = 0; e < 8; ++e) { kv[e] = bf16_to_f32(ah[e]); ss_kv += kv[e] * kv[e]; }
    }
    bf16_bits* dst = nullptr;      // this row's cache row, or none (padding)
    if (p >= 0) {
        const int page = block_table[(long long)sid * max_pages + p / KV_PAGE_SIZE];
        dst = pool + ((long long)page * KV_PAGE_SIZE + p % KV_PAGE_SIZE) * KV_ROW_DIM;
    }
    const float rq = rsqrtf(block_sum<FL_THREADS>(ss, red_q) / (float)ql + eps);
    const float rkv = rsqrtf(block_sum<FL_THREADS>(ss_kv, red_kv) / (float)KV_LATENT_DIM + eps);
    rms_scale_store<FL_THREADS, FL_QMAXV>(v, rq, wq, nvq, (uint4*)(c_q + t * cq_stride));   // the norm kernel's store
    if (dst && tid < KV_LATENT_DIM / 8) {
        uint4 o;
        const bf16_bits* wh = (const bf16_bits*)&wkv;
        bf16_bits* oh = (bf16_bits*)&o;
#pragma unroll
        for (int e = 0; e < 8; ++e) oh[e] = f32_to_bf16(bf16_to_f32(wh[e]) * (kv[e] * rkv));
        ((uint4*)dst)[tid] = o;
    }
    // last: the angle reduction of large arguments (Payne-Hanek, a local array) runs with few live registers
    if (is_rope) {      // adjacent pair (2i, 2i+1), angle as rope_kernel<false, false>
        const float ang = (float)pos * freq;
        const float c = cosf(ang) * amplitude, s = sinf(ang) * amplitude;
        const float a = bf16_to_f32((bf16_bits)(ab & 0xffffu)), b = bf16_to_f32((bf16_bits)(ab >> 16));
        const uint32_t o = (uint32_t)f32_to_bf16(a * c - b * s) | ((uint32_t)f32_to_bf16(b * c + a * s) << 16);
        if (dst) ((uint32_t*)(dst + KV_LATENT_DIM))[pair] = o;
    }
}

// ---------------------------------------------------------------------------------------------------
// Per-head GEMM. grid (nh, N / 32, token groups), 128 threads = 4 warps. The block owns head h, output
// columns n0 .. n0 + 31 (4 n8 tiles) and token tiles of 16 (blockIdx.z, + gridDim.z, ...). The 4 warps
// split K (warp w: k in [w K/4, (w+1) K/4), KS k16 steps each) and hold their weight fragments in
// registers for every token tile; partial sums meet in shared memory and are added in warp order
// (deterministic). x rows / out rows are strided views (element strides; 32-bit aligned pairs).
#define HG_WARPS 4

__device__ __forceinline__ uint32_t ld_pair(const bf16_bits* p) { return *(const uint32_t*)p; }

template <int KS>
__global__ void __launch_bounds__(HG_WARPS * 32)
mla_head_gemm(const bf16_bits* __restrict__ x, long long x_row, long long x_head,
              const bf16_bits* __restrict__ w, bf16_bits* __restrict__ out, long long out_row, long long out_head,
              int T, int N,
              const bf16_bits* __restrict__ pe, long long pe_row, long long pe_head,
              bf16_bits* __restrict__ pe_out, long long pe_out_row, long long pe_out_head,
              const int* __restrict__ positions, const float* __restrict__ inv_freq, float amplitude, int half) {
    constexpr int K = 64 * KS;
    __shared__ float red[HG_WARPS][16][33];
    const int h = blockIdx.x, n0 = blockIdx.y * 32;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tig = lane & 3;
    const int kw = warp * 16 * KS + 2 * tig;
    // B fragments (W[n][k], k contiguous = the .col operand): b0 = (k 2tig..+1, n g), b1 = k + 8
    uint32_t b[KS][4][2];
    const bf16_bits* wh = w + (long long)h * N * K;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const bf16_bits* wr = wh + (long long)(n0 + j * 8 + g) * K + kw;
#pragma unroll
        for (int s = 0; s < KS; ++s) { b[s][j][0] = ld_pair(wr + s * 16); b[s][j][1] = ld_pair(wr + s * 16 + 8); }
    }
    const bool rope_here = pe != nullptr && blockIdx.y == 0;
    DDT_PDL_LAUNCH_DEPENDENTS();  // every block has started: the next kernel may launch and prefetch its weights
    DDT_PDL_WAIT();

    const bf16_bits* xh = x + (long long)h * x_head + kw;
    for (int tile = blockIdx.z; tile * 16 < T; tile += gridDim.z) {
        const int r0 = tile * 16 + g, r1 = r0 + 8;
        float acc[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            // A fragment (tokens x k, row-major): a0 (r0, k), a1 (r1, k), a2 (r0, k + 8), a3 (r1, k + 8)
            const uint32_t a0 = r0 < T ? ld_pair(xh + r0 * x_row + s * 16) : 0u;
            const uint32_t a1 = r1 < T ? ld_pair(xh + r1 * x_row + s * 16) : 0u;
            const uint32_t a2 = r0 < T ? ld_pair(xh + r0 * x_row + s * 16 + 8) : 0u;
            const uint32_t a3 = r1 < T ? ld_pair(xh + r1 * x_row + s * 16 + 8) : 0u;
#pragma unroll
            for (int j = 0; j < 4; ++j)
                mma_16816_bf16(acc[j], a0, a1, a2, a3, b[s][j][0], b[s][j][1]);
        }
        park_c_tile(red[warp], acc, g, tig);
        __syncthreads();
#pragma unroll
        for (int i = tid; i < 16 * 32; i += HG_WARPS * 32) {
            const int r = i >> 5, c = i & 31, t = tile * 16 + r;
            if (t < T) {
                const float sum = sum_parked<HG_WARPS>(red, r, c);
                out[t * out_row + h * out_head + n0 + c] = f32_to_bf16(sum);
            }
        }
        __syncthreads();   // red is rewritten by the next tile
    }
    // q_pe of this block's tokens (adjacent pairs, as rope_kernel<false, false>), after the GEMM loop so the
    // angle reduction's local array does not compete with the weight fragments for registers
    if (rope_here) {
        for (int tile = blockIdx.z; tile * 16 < T; tile += gridDim.z) {
            for (int i = tid; i < 16 * half; i += HG_WARPS * 32) {
                const int t = tile * 16 + i / half, k = i % half;
                if (t < T) {
                    const float ang = (float)positions[t] * inv_freq[k];
                    const float c = cosf(ang) * amplitude, sn = sinf(ang) * amplitude;
                    const bf16_bits* src = pe + t * pe_row + h * pe_head + 2 * k;
                    const float a = bf16_to_f32(src[0]), bb = bf16_to_f32(src[1]);
                    bf16_bits* o = pe_out + t * pe_out_row + h * pe_out_head + 2 * k;
                    o[0] = f32_to_bf16(a * c - bb * sn);
                    o[1] = f32_to_bf16(bb * c + a * sn);
                }
            }
        }
    }
}
