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
