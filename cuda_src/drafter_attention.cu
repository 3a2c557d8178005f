// DFlash drafter attention (docs/ATTENTION.md): GQA, head_dim 128, non-causal.
//
// Per stream b the block's BR rows (bonus + masks) attend the stream's drafter context K/V (positions
// [lo, len), lo = max(0, len - window) when a window is set, read from the ring cache slot p % C) and all
// BR block rows' own K/V. q/k arrive normed and rotated. One block per (split, kv head, stream): the
// G = Hq / Hkv query heads sharing a kv head and the BR rows form M = BR * G packed rows (m = row*G + g),
// so each K/V tile is read once for all of them. The work is small next to the MLA verify (one kv head
// per rank at TP8, 8 rows), so the arithmetic runs on CUDA cores in fp32; split-KV keeps long contexts
// spread over the SMs and drafter_attn_combine merges the splits by log-sum-exp. Register blocking
// (4x4 score blocks, 8x4 output blocks per thread) keeps shared-memory loads below one per two FMAs.
#include "common.cuh"
#include "attn_combine.cuh"
#include "attn_mma.cuh"

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define DR_D 128          // head_dim
#define DR_BN 64          // tokens per tile
#define DR_MAXM 64        // packed rows per block (BR * G)
#define DR_KSTR 130       // K row stride in bf16 (65 words: lanes reading different tokens hit different banks)
#define DR_SSTR (DR_BN + 1)
#define DR_THREADS 256

extern "C" __global__ void __launch_bounds__(DR_THREADS, 1) drafter_attn_fwd(
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
    float* Qs = reinterpret_cast<float*>(smem_raw);                       // [MAXM][128], pre-scaled
    float* Ss = Qs + DR_MAXM * DR_D;                                      // [MAXM][BN+1]
    float* m_s = Ss + DR_MAXM * DR_SSTR;                                  // [MAXM]
    float* l_s = m_s + DR_MAXM;
    float* a_s = l_s + DR_MAXM;
    bf16_bits* Ks = reinterpret_cast<bf16_bits*>(a_s + DR_MAXM);          // [BN][KSTR]
    bf16_bits* Vs = Ks + DR_BN * DR_KSTR;                                 // [BN][128]

    DDT_PDL_WAIT();  // q, the block's K/V, the cache and ctx_len may come from earlier kernels
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int G = Hq / Hkv;
    const int M = BR * G;
    const int len = ctx_len[b];
    const int lo = window > 0 ? max(0, len - window) : 0;
    const int nctx = len - lo;
    const int N = nctx + BR;
    const int n_tiles = (N + DR_BN - 1) / DR_BN;
    const int per_split = (n_tiles + num_splits - 1) / num_splits;
    const int tile_begin = split * per_split;
    const int tile_end = min(n_tiles, tile_begin + per_split);

    for (int e = tid; e < M * DR_D; e += DR_THREADS) {
        const int m = e / DR_D, d = e % DR_D;
        const int r = m / G, gi = m % G;
        Qs[e] = bf16_to_f32(q[(((size_t)b * BR + r) * Hq + kvh * G + gi) * DR_D + d]) * scale_log2;
    }
    if (tid < DR_MAXM) { m_s[tid] = -INFINITY; l_s[tid] = 0.f; }
    // P V ownership: warp w accumulates packed rows 8w .. 8w+7, lane l the columns 4l .. 4l+3.
    float acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

    for (int tile = tile_begin; tile < tile_end; ++tile) {
        __syncthreads();  // the previous tile's K/V/S are no longer read
        const int t0 = tile * DR_BN;
        // 16 chunks of 16 bytes per 128-wide row; invalid tokens become zeros (masked below).
        for (int e = tid; e < DR_BN * 16; e += DR_THREADS) {
            const int tok = e >> 4, c = e & 15;
            const int i = t0 + tok;
            uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
            if (i < N) {
                size_t off;
                if (i < nctx) off = (((size_t)b * capacity + (lo + i) % capacity) * Hkv + kvh) * DR_D;
                else off = (((size_t)b * BR + (i - nctx)) * Hkv + kvh) * DR_D;
                const bf16_bits* kp = (i < nctx ? kc : kb) + off;
                const bf16_bits* vp = (i < nctx ? vc : vb) + off;
                kv4 = reinterpret_cast<const uint4*>(kp)[c];
                vv4 = reinterpret_cast<const uint4*>(vp)[c];
            }
            unsigned* kd = reinterpret_cast<unsigned*>(Ks + tok * DR_KSTR + c * 8);
            kd[0] = kv4.x; kd[1] = kv4.y; kd[2] = kv4.z; kd[3] = kv4.w;
            reinterpret_cast<uint4*>(Vs + tok * DR_D)[c] = vv4;
        }
        __syncthreads();
        // Scores (log2 units: q was pre-scaled). Each thread computes a 4-row x 4-token block, tokens
        // tb, tb+16, tb+32, tb+48, so the 16 lanes of a half warp read 16 different K rows (KSTR = 65
        // words: different banks) while the row block's q values are broadcast.
        {
            const int rb = tid >> 4, tb = tid & 15;
            if (rb * 4 < M) {
                float sacc[4][4];
#pragma unroll
                for (int i = 0; i < 4; ++i) sacc[i][0] = sacc[i][1] = sacc[i][2] = sacc[i][3] = 0.f;
                const float* q0 = Qs + rb * 4 * DR_D;
                const unsigned* kw = reinterpret_cast<const unsigned*>(Ks);
#pragma unroll 4
                for (int d2 = 0; d2 < DR_D / 2; ++d2) {
                    float2 qv[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) qv[i] = *reinterpret_cast<const float2*>(q0 + i * DR_D + 2 * d2);
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const unsigned w = kw[(tb + 16 * j) * (DR_KSTR / 2) + d2];
                        const float k0 = __uint_as_float(w << 16), k1 = __uint_as_float(w & 0xffff0000u);
#pragma unroll
                        for (int i = 0; i < 4; ++i) sacc[i][j] = fmaf(qv[i].x, k0, fmaf(qv[i].y, k1, sacc[i][j]));
                    }
                }
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int t = tb + 16 * j;
                        Ss[(rb * 4 + i) * DR_SSTR + t] = t0 + t < N ? sacc[i][j] : -INFINITY;
                    }
            }
        }
        __syncthreads();
        // online softmax: one warp per packed row, two tokens per lane
        for (int m = warp; m < M; m += DR_THREADS / 32) {
            float x0 = Ss[m * DR_SSTR + lane], x1 = Ss[m * DR_SSTR + lane + 32];
            float mx = fmaxf(x0, x1);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_old = m_s[m];
            const float m_new = fmaxf(m_old, mx);
            const float m_use = m_new == -INFINITY ? 0.f : m_new;
            const float p0 = exp2f(x0 - m_use), p1 = exp2f(x1 - m_use);
            Ss[m * DR_SSTR + lane] = p0;
            Ss[m * DR_SSTR + lane + 32] = p1;
            float sm = p0 + p1;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sm += __shfl_xor_sync(0xffffffffu, sm, o);
            __syncwarp();
            if (lane == 0) {
                const float alpha = exp2f(m_old - m_use);
                a_s[m] = alpha;
                l_s[m] = l_s[m] * alpha + sm;
                m_s[m] = m_new;
            }
        }
        __syncthreads();
        // O += P V: per token one 8-byte V load (4 columns) and 8 broadcast P loads feed 32 FMAs.
        if (warp * 8 < M) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float al = a_s[warp * 8 + i];  // rows >= M hold garbage and are never written out
                acc[i][0] *= al; acc[i][1] *= al; acc[i][2] *= al; acc[i][3] *= al;
            }
#pragma unroll 2
            for (int t = 0; t < DR_BN; ++t) {
                const uint2 vw = *reinterpret_cast<const uint2*>(Vs + t * DR_D + 4 * lane);
                const float v0 = __uint_as_float(vw.x << 16), v1 = __uint_as_float(vw.x & 0xffff0000u);
                const float v2 = __uint_as_float(vw.y << 16), v3 = __uint_as_float(vw.y & 0xffff0000u);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float pr = Ss[(warp * 8 + i) * DR_SSTR + t];
                    acc[i][0] = fmaf(pr, v0, acc[i][0]); acc[i][1] = fmaf(pr, v1, acc[i][1]);
                    acc[i][2] = fmaf(pr, v2, acc[i][2]); acc[i][3] = fmaf(pr, v3, acc[i][3]);
                }
            }
        }
    }
    __syncthreads();
    const int total_rows = gridDim.z * BR * Hq;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int m = warp * 8 + i;
        if (m >= M) continue;
        const int r = m / G, gi = m % G;
        const size_t gr = ((size_t)b * BR + r) * Hq + kvh * G + gi;
        const float l = l_s[m];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        if (num_splits == 1) {
            uint2 pk;
            pk.x = (unsigned)f32_to_bf16(acc[i][0] * inv) | ((unsigned)f32_to_bf16(acc[i][1] * inv) << 16);
            pk.y = (unsigned)f32_to_bf16(acc[i][2] * inv) | ((unsigned)f32_to_bf16(acc[i][3] * inv) << 16);
            *reinterpret_cast<uint2*>(out + gr * DR_D + 4 * lane) = pk;
        } else {
            const size_t pr = (size_t)split * total_rows + gr;
            *reinterpret_cast<float4*>(part_o + pr * DR_D + 4 * lane) =
                make_float4(acc[i][0] * inv, acc[i][1] * inv, acc[i][2] * inv, acc[i][3] * inv);
            if (lane == 0) part_lse[pr] = l > 0.f ? m_s[m] + log2f(l) : -INFINITY;
        }
    }
}

// ---- drafter_attn_mma: the same contract on tensor cores (mma.sync m16n8k16 bf16, fp32 accumulate) ----------
//
// 4 warps; warp w owns packed rows 16w .. 16w+15 (warps past M = BR * G skip the arithmetic but still load
// and meet the barriers). Per 64-token tile: S = Q K^T (16 x 64 per warp: 8 k-steps x 8 n-tiles, Q as
// A fragments in registers for the whole KV range, K B fragments by ldmatrix), the online softmax in
// registers (base 2, rows g / g+8 of the warp; the 4 lanes of a row reduce with shuffles), P rounded to bf16
// and reused directly as the A operand of P V (the m16n8 accumulator layout of two adjacent n-tiles is the
// m16n8k16 A layout), O (16 x 128 per warp, fp32 registers) += P V with V fragments by ldmatrix.trans. K and V
// tiles stream through a 2-stage cp.async ring (69.6 KB: fits sm_120's 99 KB). Out-of-range tokens are
// zero-filled and masked to -inf. The 64 x 64 x 128 S tile costs 256 mma per block instead of 512K FMAs on
// CUDA cores (drafter_attn_fwd above).
//
// Before DDT_PDL_WAIT() the block prefetches its first context tile into L2 (prefetch only: the context cache
// rows were written by earlier steps, and an address from a ctx_len that is still being written costs at most
// a wasted line; nothing read before the wait is used after it).
#define DM_THREADS 128
#define DM_STAGES 2
#define DM_STR (DR_D + 8)   // smem row stride (bf16): 272 B = 17 chunks (odd), ldmatrix rows hit distinct banks
#define DM_SMEM (DM_STAGES * 2 * DR_BN * DM_STR * 2)

extern "C" __global__ void __launch_bounds__(DM_THREADS) drafter_attn_mma(
    const bf16_bits* __restrict__ q, const bf16_bits* __restrict__ kb, const bf16_bits* __restrict__ vb,
    const bf16_bits* __restrict__ kc, const bf16_bits* __restrict__ vc, const int* __restrict__ ctx_len,
    int capacity, int window, int BR, int Hq, int Hkv, float scale_log2, int num_splits,
    bf16_bits* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_lse) {  // as drafter_attn_fwd
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_bits* Ks = reinterpret_cast<bf16_bits*>(smem_raw);      // [STAGES][BN][STR]
    bf16_bits* Vs = Ks + DM_STAGES * DR_BN * DM_STR;             // [STAGES][BN][STR]
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, q4 = lane & 3;
    const int G = Hq / Hkv;
    const int M = BR * G;

    // The tile range of this split (a function of the stream's context length; see drafter_attn_fwd).
    auto split_range = [&](int len, int& lo, int& nctx, int& N, int& tb, int& te) {
        lo = window > 0 ? max(0, len - window) : 0;
        nctx = len - lo;
        N = nctx + BR;
        const int n_tiles = (N + DR_BN - 1) / DR_BN;
        const int per_split = (n_tiles + num_splits - 1) / num_splits;
        tb = split * per_split;
        te = min(n_tiles, tb + per_split);
    };
    {   // L2 prefetch of the first tile's context rows (K and V: 2 x 256 B per token, one 128 B line per thread)
        int lo, nctx, N, tb, te;
        split_range(max(0, ctx_len[b]), lo, nctx, N, tb, te);
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
    split_range(ctx_len[b], lo, nctx, N, tile_begin, tile_end);

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
#define DR_COMBINE_THREADS 256
extern "C" __global__ void __launch_bounds__(DR_COMBINE_THREADS) drafter_attn_combine(
    const float* __restrict__ part_o, const float* __restrict__ part_lse, int total_rows, int num_splits,
    bf16_bits* __restrict__ out) {
    __shared__ __align__(16) AttnCombineSmem<DR_D, DR_COMBINE_THREADS / 32> sm;
    DDT_PDL_WAIT();
    const size_t row = blockIdx.x;
    attn_combine_row<DR_D, DR_COMBINE_THREADS / 32>(part_o, part_lse, (size_t)total_rows, row, num_splits,
                                                    out + row * DR_D, sm);
}
