// The small stages of the target's MLA block as device bodies, run by the fused kernels of fused_layer.cu
// (mla_qkv_a_post, mla_head_gemm) and by the persistent layer executor's row_post and head_gemm items
// (persistent_layer.cu): one source, so both produce identical bits. Each body loads what no kernel writes
// (weights, the RoPE table) first, then calls its wait hook (the kernels: PDL trigger + wait; the executor:
// the item's counter wait), then reads its inputs.
#pragma once
#include "layer_math.cuh"

#define FL_THREADS 256
#define FL_QMAXV 2          // c_q vectors of 8 per thread: q_lora <= 8 * 2 * 256 = 4096

// The fused kernels' wait point: let the next kernel launch (every block has started), then wait for the
// previous one.
struct PdlTriggerWaitHook {
    __device__ __forceinline__ void operator()() const {
        DDT_PDL_LAUNCH_DEPENDENTS();
        DDT_PDL_WAIT();
    }
};

// Loads of activations: CG = true reads through L2 only (ld.global.cg), as the executor must for rows other
// blocks of the same launch wrote (an SM's L1 is not coherent with their stores); the kernels read them
// plainly (written by an earlier launch).
template <bool CG> __device__ __forceinline__ uint4 ld_act16(const void* p) {
    return CG ? __ldcg(reinterpret_cast<const uint4*>(p)) : *reinterpret_cast<const uint4*>(p);
}
template <bool CG> __device__ __forceinline__ uint32_t ld_act4(const void* p) {
    return CG ? __ldcg(reinterpret_cast<const unsigned int*>(p)) : *reinterpret_cast<const uint32_t*>(p);
}
template <bool CG> __device__ __forceinline__ bf16_bits ld_act2(const bf16_bits* p) {
    return CG ? __ldcg(reinterpret_cast<const unsigned short*>(p)) : *p;
}

// ---- qkv_a post: one row by FL_THREADS threads ------------------------------------------------------------
// qkv row t: [q_a (ql) | kv_a (512) | k_pe (64)] -> c_q row t = RMSNorm(q_a) * q_norm_w, and the latent row
// RMSNorm(kv_a) * kv_norm_w | RoPE(k_pe) into the paged cache at kv_pos[t] (< 0: no write). Same arithmetic
// and reduction order as rmsnorm_kernel / rope_kernel<false, false> (norm.cu / rope.cu). Threads: c_q vectors
// i, i + 256; c_kv vector i (< 64); k_pe pair i - 64 (threads 64..95). red_q / red_kv: FL_THREADS / 32 floats
// of shared memory each.
template <bool CG, typename WaitHook>
__device__ __forceinline__ void qkv_a_post_row(
        int t, const bf16_bits* __restrict__ qkv, long long qkv_stride, int ql,
        const bf16_bits* __restrict__ q_norm_w, const bf16_bits* __restrict__ kv_norm_w, float eps,
        bf16_bits* __restrict__ c_q, long long cq_stride,
        const int* __restrict__ positions, const float* __restrict__ inv_freq, float amplitude,
        const int* __restrict__ stream_ids, const int* __restrict__ kv_pos,
        bf16_bits* __restrict__ pool, const int* __restrict__ block_table, int max_pages,
        float* red_q, float* red_kv, WaitHook wait_inputs) {
    const int tid = threadIdx.x;
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
    wait_inputs();

    const bf16_bits* row = qkv + t * qkv_stride;
    // Every load of the row first (measured faster; docs/history/2026-11-29-kernels.md "Row loads issued one at
    // a time" and "The row-preload builds measured"): with the loads inside the loops ptxas issued the second
    // c_q vector, the kv vector and the cache slot's loads after the first vector's fmas (SASS), a chain of
    // round trips.
    uint4 qa[FL_QMAXV], kva = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < FL_QMAXV; ++j) {
        const int i = tid + j * FL_THREADS;
        qa[j] = i < nvq ? ld_act16<CG>(row + 8 * i) : make_uint4(0, 0, 0, 0);
    }
    if (tid < KV_LATENT_DIM / 8) kva = ld_act16<CG>(row + ql + 8 * tid);
    const uint32_t ab = is_rope ? ld_act4<CG>(row + ql + KV_LATENT_DIM + 2 * pair) : 0u;
    const int pos = is_rope ? positions[t] : 0;
    const int p = kv_pos[t];
    const int sid = stream_ids[t];
    // The row is kept as bf16 and widened again for the stores (bf16 -> fp32 is exact: the same floats), as
    // rmsnorm_row does: 24 registers fewer, so the body fits the executor's 128-register budget (sm_90).
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < FL_QMAXV; ++j) {
        const int i = tid + j * FL_THREADS;
        if (i < nvq) {
            const bf16_bits* ah = (const bf16_bits*)&qa[j];
#pragma unroll
            for (int e = 0; e < 8; ++e) { const float f = bf16_to_f32(ah[e]); ss += f * f; }
        }
    }
    float ss_kv = 0.f;
    if (tid < KV_LATENT_DIM / 8) {
        const bf16_bits* ah = (const bf16_bits*)&kva;
#pragma unroll
        for (int e = 0; e < 8; ++e) { const float f = bf16_to_f32(ah[e]); ss_kv += f * f; }
    }
    bf16_bits* dst = nullptr;      // this row's cache row, or none (padding)
    if (p >= 0) {
        const int page = block_table[(long long)sid * max_pages + p / KV_PAGE_SIZE];
        dst = pool + ((long long)page * KV_PAGE_SIZE + p % KV_PAGE_SIZE) * KV_ROW_DIM;
    }
    const float rq = rsqrtf(block_sum<FL_THREADS>(ss, red_q) / (float)ql + eps);
    const float rkv = rsqrtf(block_sum<FL_THREADS>(ss_kv, red_kv) / (float)KV_LATENT_DIM + eps);
    rms_scale_store_row<FL_THREADS, FL_QMAXV>(                  // the norm kernel's store
        [&](int j, int e) { return bf16_to_f32(((const bf16_bits*)&qa[j])[e]); }, rq, wq, nvq,
        (uint4*)(c_q + t * cq_stride));
    if (dst && tid < KV_LATENT_DIM / 8) {
        uint4 o;
        const bf16_bits* wh = (const bf16_bits*)&wkv;
        const bf16_bits* kh = (const bf16_bits*)&kva;
        bf16_bits* oh = (bf16_bits*)&o;
#pragma unroll
        for (int e = 0; e < 8; ++e) oh[e] = f32_to_bf16(bf16_to_f32(wh[e]) * (bf16_to_f32(kh[e]) * rkv));
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

// ---- per-head GEMM: 8 NJ output columns of one head by a group of HG_WARPS warps ----------------------------
// out[t, h, n0 .. n0 + 8 NJ) = x[t, h, :] @ W[h][n0 .. n0 + 8 NJ, :]^T, W [nh, N, K]. The group's 4 warps split K
// (warp w: k in [w K/4, (w+1) K/4), KS k16 steps each) and hold their weight fragments in registers for
// every token tile; the partial sums meet in shared memory and are added in warp order (deterministic: an
// element's bits depend on the K split alone, not on NJ). x rows / out rows are strided views (element
// strides; 32-bit aligned pairs). mla_head_gemm runs one group of NJ = 4 (32 columns) per block; the
// executor's head_gemm item two groups (W_UK: NJ = 4, 64 columns; W_UV: NJ = 1, 16 columns, whose K = 512
// holds 16 fragment registers per lane at NJ = 1 against 64 at NJ = 4).
#define HG_WARPS 4

__device__ __forceinline__ uint32_t ld_pair(const bf16_bits* p) { return *(const uint32_t*)p; }

// This lane's B fragments (W[n][k], k contiguous = the .col operand): b0 = (k 2tig..+1, n g), b1 = k + 8.
template <int KS, int NJ>
__device__ __forceinline__ void head_gemm_weights(const bf16_bits* __restrict__ w, int h, int N, int n0, int warp,
                                                  int lane, uint32_t (&b)[KS][NJ][2]) {
    constexpr int K = 64 * KS;
    const int g = lane >> 2, tig = lane & 3;
    const int kw = warp * 16 * KS + 2 * tig;
    const bf16_bits* wh = w + (long long)h * N * K;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        const bf16_bits* wr = wh + (long long)(n0 + j * 8 + g) * K + kw;
#pragma unroll
        for (int s = 0; s < KS; ++s) { b[s][j][0] = ld_pair(wr + s * 16); b[s][j][1] = ld_pair(wr + s * 16 + 8); }
    }
}

// The group's token tiles tile0, tile0 + tile_step, ... (16 rows each). warp / gtid: the warp (0..3) and the
// thread (0..127) within the group; red: the group's [HG_WARPS][16][33] floats of shared memory. Every thread
// of the block runs the same tile loop (its barriers are block-wide). ONE_TILE: tile0 only (the executor).
template <int KS, int NJ, bool CG, bool ONE_TILE = false>
__device__ __forceinline__ void head_gemm_tiles(const bf16_bits* __restrict__ x, long long x_row, long long x_head,
                                                bf16_bits* __restrict__ out, long long out_row, long long out_head,
                                                int T, int h, int n0, int tile0, int tile_step, int warp, int gtid,
                                                const uint32_t (&b)[KS][NJ][2], float (*red)[16][33]) {
    const int lane = gtid & 31, g = lane >> 2, tig = lane & 3;
    const int kw = warp * 16 * KS + 2 * tig;
    const bf16_bits* xh = x + (long long)h * x_head + kw;
    for (int tile = tile0; tile * 16 < T && (!ONE_TILE || tile == tile0); tile += tile_step) {
        const int r0 = tile * 16 + g, r1 = r0 + 8;
        const bf16_bits* x0 = xh + r0 * x_row;
        const bf16_bits* x1 = xh + r1 * x_row;
        float acc[NJ][4];
#pragma unroll
        for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            // A fragment (tokens x k, row-major): a0 (r0, k), a1 (r1, k), a2 (r0, k + 8), a3 (r1, k + 8)
            const uint32_t a0 = r0 < T ? ld_act4<CG>(x0 + s * 16) : 0u;
            const uint32_t a1 = r1 < T ? ld_act4<CG>(x1 + s * 16) : 0u;
            const uint32_t a2 = r0 < T ? ld_act4<CG>(x0 + s * 16 + 8) : 0u;
            const uint32_t a3 = r1 < T ? ld_act4<CG>(x1 + s * 16 + 8) : 0u;
#pragma unroll
            for (int j = 0; j < NJ; ++j)
                mma_16816_bf16(acc[j], a0, a1, a2, a3, b[s][j][0], b[s][j][1]);
        }
        park_c_tiles<NJ>(red[warp], acc, g, tig);
        __syncthreads();
        constexpr int COLS = 8 * NJ;
#pragma unroll
        for (int i = gtid; i < 16 * COLS; i += HG_WARPS * 32) {
            const int r = i / COLS, c = i % COLS, t = tile * 16 + r;
            if (t < T) {
                const float sum = sum_parked<HG_WARPS>(red, r, c);
                out[t * out_row + h * out_head + n0 + c] = f32_to_bf16(sum);
            }
        }
        __syncthreads();   // red is rewritten by the next tile
    }
}

// pe_out = RoPE(pe) of head h for the group's token tiles (adjacent pairs, as rope_kernel<false, false>), after
// the GEMM loop so the angle reduction's local array does not compete with the weight fragments for registers.
template <bool CG>
__device__ __forceinline__ void head_gemm_rope(const bf16_bits* __restrict__ pe, long long pe_row, long long pe_head,
                                               bf16_bits* __restrict__ pe_out, long long pe_out_row,
                                               long long pe_out_head, const int* __restrict__ positions,
                                               const float* __restrict__ inv_freq, float amplitude, int half,
                                               int T, int h, int tile0, int tile_step, int gtid) {
    for (int tile = tile0; tile * 16 < T; tile += tile_step) {
        for (int i = gtid; i < 16 * half; i += HG_WARPS * 32) {
            const int t = tile * 16 + i / half, k = i % half;
            if (t < T) {
                const float ang = (float)positions[t] * inv_freq[k];
                const float c = cosf(ang) * amplitude, sn = sinf(ang) * amplitude;
                const bf16_bits* src = pe + t * pe_row + h * pe_head + 2 * k;
                const float a = bf16_to_f32(ld_act2<CG>(src)), bb = bf16_to_f32(ld_act2<CG>(src + 1));
                bf16_bits* o = pe_out + t * pe_out_row + h * pe_out_head + 2 * k;
                o[0] = f32_to_bf16(a * c - bb * sn);
                o[1] = f32_to_bf16(bb * c + a * sn);
            }
        }
    }
}
