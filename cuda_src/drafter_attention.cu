// DFlash drafter attention (docs/ATTENTION.md): GQA, head_dim 128, non-causal, on tensor cores.
//
// Per stream b the block's BR rows (bonus + masks) attend the stream's drafter context K/V (positions
// [lo, len), lo = max(0, len - window) when a window is set, read from the ring cache slot p % C) and all
// BR block rows' own K/V. q/k arrive normed and rotated. One block per (split, kv head, stream): the
// G = Hq / Hkv query heads sharing a kv head and the BR rows form M = BR * G <= 64 packed rows (m = r*G + g),
// so each K/V tile is read once for all of them. Split-KV spreads long contexts over the SMs and
// drafter_attn_combine merges the splits by log-sum-exp (attn_combine.cuh).
//
// (was: an fp32 CUDA-core kernel with register blocking; the mma version below measured 2.3-5.1x faster on
// the H200 at every benchmarked shape, docs/ATTENTION.md, and replaced it.)
#include "common.cuh"
#include "attn_combine.cuh"
#include "attn_mma.cuh"

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define DR_D 128          // head_dim
#define DR_BN 64          // tokens per tile

// ---- drafter_attn_fwd: mma.sync m16n8k16 bf16, fp32 accumulate -------------------------------------------
//
// 4 warps; warp w owns packed rows 16w .. 16w+15 (warps past M = BR * G skip the arithmetic but still load
// and meet the barriers). Per 64-token tile: S = Q K^T (16 x 64 per warp: 8 k-steps x 8 n-tiles, Q as
// A fragments in registers for the whole KV range, K B fragments by ldmatrix), the online softmax in
// registers (base 2, rows g / g+8 of the warp; the 4 lanes of a row reduce with shuffles), P rounded to bf16
// and reused directly as the A operand of P V (the m16n8 accumulator layout of two adjacent n-tiles is the
// m16n8k16 A layout), O (16 x 128 per warp, fp32 registers) += P V with V fragments by ldmatrix.trans. K and V
// tiles stream through a 2-stage cp.async ring (69.6 KB: fits sm_120's 99 KB). Out-of-range tokens are
// zero-filled and masked to -inf. The 64 x 64 x 128 S tile costs 256 mma per block (was 512K FMAs on CUDA
// cores). Split s of n_tiles 64-token tiles covers tiles [s * per_split, +per_split), per_split =
// ceil(n_tiles / num_splits); an empty split writes lse = -inf.
//
// Before DDT_PDL_WAIT() the block prefetches its first context tile into L2 (prefetch only: the context cache
// rows were written by earlier steps, and an address from a ctx_len that is still being written costs at most
// a wasted line; nothing read before the wait is used after it).
#define DM_THREADS 128
#define DM_STAGES 2
#define DM_STR (DR_D + 8)   // smem row stride (bf16): 272 B = 17 chunks (odd), ldmatrix rows hit distinct banks
#define DM_SMEM (DM_STAGES * 2 * DR_BN * DM_STR * 2)

extern "C" __global__ void __launch_bounds__(DM_THREADS) drafter_attn_fwd(
    const bf16_bits* __restrict__ q,      // [S, BR, Hq, 128]
    const bf16_bits* __restrict__ kb,     // [S, BR, Hkv, 128] the block's own keys
    const bf16_bits* __restrict__ vb,     // [S, BR, Hkv, 128]
    const bf16_bits* __restrict__ kc,     // [S, C, Hkv, 128] context keys (ring of capacity C)
    const bf16_bits* __restrict__ vc,     // [S, C, Hkv, 128]
    const int* __restrict__ ctx_len,      // [S] committed context length
    int capacity, int window, int BR, int Hq, int Hkv, float scale_log2, int num_splits,
    bf16_bits* __restrict__ out,          // [S, BR, Hq, 128]        (num_splits == 1)
    float* __restrict__ part_o,           // [num_splits, S*BR*Hq, 128]
    float* __restrict__ part_lse) {       // [num_splits, S*BR*Hq]
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_bits* Ks = reinterpret_cast<bf16_bits*>(smem_raw);      // [STAGES][BN][STR]
    bf16_bits* Vs = Ks + DM_STAGES * DR_BN * DM_STR;             // [STAGES][BN][STR]
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, q4 = lane & 3;
    const int G = Hq / Hkv;
    const int M = BR * G;

    // The tile range of this split: the context window then the BR block rows, 64-token tiles.
    auto split_range = [&](int len, int& lo, int& nctx, int& N, int& tb, int& te) {
        lo = window > 0 ? max(0, len - window) : 0;
        nctx = len - lo;
        N = nctx + BR;
        const int n_tiles = (N + DR_BN - 1) / DR_BN;
        const int per_split = (n_tiles + num_splits - 1) / num_splits;
        tb = split * per_split;
        te = min(n_tiles, tb + per_split);
    };
    {   // L2 prefetch of the first tile's context rows (K and V: 2 x 256 B per token, one 128 B line per thread).
        // A volatile read: a plain one of the const __restrict__ ctx_len compiles to ld.global.nc, which the
        // compiler treats as invariant and reused after the wait (seen in the PTX): the length used below
        // must be the one read after DDT_PDL_WAIT().
        int lo, nctx, N, tb, te;
        split_range(max(0, *reinterpret_cast<const volatile int*>(ctx_len + b)), lo, nctx, N, tb, te);
        if (tb < te) {
            for (int e = tid; e < DR_BN * 4; e += DM_THREADS) {
                const int i = tb * DR_BN + (e >> 2);
                if (i < nctx) {
                    const size_t off = (((size_t)b * capacity + (lo + i) % capacity) * Hkv + kvh) * DR_D + (e & 1) * 64;
                    prefetch_l2(((e >> 1) & 1 ? vc : kc) + off);
                }
            }
        }
    }
    DDT_PDL_WAIT();  // q, the block's K/V, the cache and ctx_len may come from earlier kernels
    int lo, nctx, N, tile_begin, tile_end;
    split_range(__ldcg(ctx_len + b), lo, nctx, N, tile_begin, tile_end);   // through L2, after the wait

    auto load_tile = [&](int tile, int st) {
        const int t0 = tile * DR_BN;
        for (int e = tid; e < DR_BN * 16; e += DM_THREADS) {
            const int tok = e >> 4, c = e & 15;
            const int i = t0 + tok;
            const bool ok = i < N;
            const bf16_bits *kp = kc, *vp = vc;   // any valid address for a zero fill
            if (ok) {
                if (i < nctx) {
                    const size_t off = (((size_t)b * capacity + (lo + i) % capacity) * Hkv + kvh) * DR_D;
                    kp = kc + off; vp = vc + off;
                } else {
                    const size_t off = (((size_t)b * BR + (i - nctx)) * Hkv + kvh) * DR_D;
                    kp = kb + off; vp = vb + off;
                }
            }
            const int d = (st * DR_BN + tok) * DM_STR + c * 8;
            cp_async16(Ks + d, kp + c * 8, ok);
            cp_async16(Vs + d, vp + c * 8, ok);
        }
    };
    if (tile_begin < tile_end) load_tile(tile_begin, 0);
    cp_async_commit();

    // Q A fragments of rows 16w + g / + 8 (padded rows are zero): a0 / a1 = rows g / g+8 at columns
    // kk*16 + 2*q4, a2 / a3 the same 8 columns on. Packed row m = r * G + gi -> q[b, r, kvh * G + gi].
    const bool active = warp * 16 < M;
    unsigned qf[DR_D / 16][4];
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
        const int m = warp * 16 + g + 8 * hi;
        const bool ok = m < M;
        const unsigned* src = reinterpret_cast<const unsigned*>(
            q + (((size_t)b * BR + (ok ? m / G : 0)) * Hq + kvh * G + (ok ? m % G : 0)) * DR_D + 2 * q4);
#pragma unroll
        for (int kk = 0; kk < DR_D / 16; ++kk) {
            qf[kk][hi] = ok ? src[kk * 8] : 0u;
            qf[kk][2 + hi] = ok ? src[kk * 8 + 4] : 0u;
        }
    }
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};   // l_run: this lane's share of the row
    float o[DR_D / 8][4];
#pragma unroll
    for (int j = 0; j < DR_D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

    for (int tile = tile_begin; tile < tile_end; ++tile) {
        const int st = (tile - tile_begin) & 1;
        if (tile + 1 < tile_end) load_tile(tile + 1, st ^ 1);   // its stage was last read before the end barrier
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();   // this tile has landed for every thread
        if (active) {
            const bf16_bits* Kb = Ks + st * DR_BN * DM_STR;
            const bf16_bits* Vb = Vs + st * DR_BN * DM_STR;
            float sacc[DR_BN / 8][4];
#pragma unroll
            for (int j = 0; j < DR_BN / 8; ++j) sacc[j][0] = sacc[j][1] = sacc[j][2] = sacc[j][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < DR_D / 16; ++kk) {
#pragma unroll
                for (int j = 0; j < DR_BN / 8; j += 2) {
                    unsigned b0, b1, b2, b3;
                    ldsm_x4(b0, b1, b2, b3, Kb + (j * 8 + (lane & 7) + (lane >> 4) * 8) * DM_STR + kk * 16 +
                                            ((lane >> 3) & 1) * 8);
                    mma_bf16(sacc[j], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b0, b1);
                    mma_bf16(sacc[j + 1], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b2, b3);
                }
            }
            // mask (non-causal: only tokens past the end), scale, row maxima
            const int t0 = tile * DR_BN;
            float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int j = 0; j < DR_BN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float x = t0 + j * 8 + 2 * q4 + (e & 1) < N ? sacc[j][e] * scale_log2 : -INFINITY;
                    sacc[j][e] = x;
                    tmax[e >> 1] = fmaxf(tmax[e >> 1], x);
                }
            float alpha[2], m_use[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(0xffffffffu, tmax[i], 1));
                tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(0xffffffffu, tmax[i], 2));
                const float m_new = fmaxf(m_run[i], tmax[i]);
                m_use[i] = m_new == -INFINITY ? 0.f : m_new;   // nothing visible yet: keep p = 0
                alpha[i] = exp2f(m_run[i] - m_use[i]);
                m_run[i] = m_new;
                l_run[i] *= alpha[i];
            }
#pragma unroll
            for (int j = 0; j < DR_D / 8; ++j) {
                o[j][0] *= alpha[0]; o[j][1] *= alpha[0];
                o[j][2] *= alpha[1]; o[j][3] *= alpha[1];
            }
            // P V: k-step kk covers tokens 16kk .. +16 = S n-tiles 2kk, 2kk+1
#pragma unroll
            for (int kk = 0; kk < DR_BN / 16; ++kk) {
                float p[2][4];
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        p[h][e] = exp2f(sacc[2 * kk + h][e] - m_use[e >> 1]);
                        l_run[e >> 1] += p[h][e];
                    }
                const unsigned a0 = pack_bf16x2(p[0][0], p[0][1]), a1 = pack_bf16x2(p[0][2], p[0][3]);
                const unsigned a2 = pack_bf16x2(p[1][0], p[1][1]), a3 = pack_bf16x2(p[1][2], p[1][3]);
                const bf16_bits* vrow = Vb + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * DM_STR + (lane >> 4) * 8;
#pragma unroll
                for (int j = 0; j < DR_D / 8; j += 2) {
                    unsigned b0, b1, b2, b3;
                    ldsm_x4_t(b0, b1, b2, b3, vrow + j * 8);
                    mma_bf16(o[j], a0, a1, a2, a3, b0, b1);
                    mma_bf16(o[j + 1], a0, a1, a2, a3, b2, b3);
                }
            }
        }
        __syncthreads();   // every warp is done with this stage before the next iteration refills it
    }
    cp_async_wait<0>();
    DDT_PDL_LAUNCH_DEPENDENTS();   // the combine may launch; it waits for this grid's writes below

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
        l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
    }
    if (!active) return;
    const int total_rows = gridDim.z * BR * Hq;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int m = warp * 16 + g + 8 * i;
        if (m >= M) continue;
        const size_t gr = ((size_t)b * BR + m / G) * Hq + kvh * G + m % G;
        const float inv = l_run[i] > 0.f ? 1.f / l_run[i] : 0.f;
        if (num_splits == 1) {
            bf16_bits* orow = out + gr * DR_D + 2 * q4;
#pragma unroll
            for (int j = 0; j < DR_D / 8; ++j)
                *reinterpret_cast<unsigned*>(orow + j * 8) = pack_bf16x2(o[j][2 * i] * inv, o[j][2 * i + 1] * inv);
        } else {
            const size_t pr = (size_t)split * total_rows + gr;
            float* orow = part_o + pr * DR_D + 2 * q4;
#pragma unroll
            for (int j = 0; j < DR_D / 8; ++j)
                *reinterpret_cast<float2*>(orow + j * 8) = make_float2(o[j][2 * i] * inv, o[j][2 * i + 1] * inv);
            if (q4 == 0) part_lse[pr] = l_run[i] > 0.f ? m_run[i] + log2f(l_run[i]) : -INFINITY;
        }
    }
}

// Merge split partials (attn_combine.cuh): one block of 8 warps per output row. grid (rows).
// U = splits per warp in flight (the wrapper instantiates 4: with 128-wide rows it costs no registers).
#define DR_COMBINE_THREADS 256
template <int U>
__global__ void __launch_bounds__(DR_COMBINE_THREADS) drafter_attn_combine(
    const float* __restrict__ part_o, const float* __restrict__ part_lse, int total_rows, int num_splits,
    bf16_bits* __restrict__ out) {
    __shared__ __align__(16) AttnCombineSmem<DR_D, DR_COMBINE_THREADS / 32> sm;
    DDT_PDL_WAIT();
    const size_t row = blockIdx.x;
    attn_combine_row<DR_D, DR_COMBINE_THREADS / 32, U>(part_o, part_lse, (size_t)total_rows, row, num_splits,
                                                       out + row * DR_D, sm);
}
