// DFlash drafter attention (docs/ATTENTION.md): GQA, head_dim 128, non-causal.
//
// Per stream b the block's BR rows (bonus + masks) attend the stream's drafter context K/V (positions
// [lo, len), lo = max(0, len - window) when a window is set, read from the ring cache slot p % C) and all
// BR block rows' own K/V. q/k arrive normed and rotated. One block per (split, kv head, stream): the
// G = Hq / Hkv query heads sharing a kv head and the BR rows form M = BR * G packed rows (m = row*G + g),
// so each K/V tile is read once for all of them. The work is small next to the MLA verify (one kv head
// per rank at TP8, 8 rows), so the arithmetic runs on CUDA cores in fp32; split-KV keeps long contexts
// spread over the SMs and drafter_attn_combine merges the splits by log-sum-exp.
#include "common.cuh"

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
    float acc[DR_MAXM / 2];
#pragma unroll
    for (int k = 0; k < DR_MAXM / 2; ++k) acc[k] = 0.f;
    const int d_own = tid & (DR_D - 1);
    const int r_off = tid >> 7;  // this thread accumulates packed rows r_off, r_off + 2, ...

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
        // scores (already in log2 units: q was pre-scaled)
        for (int e = tid; e < M * DR_BN; e += DR_THREADS) {
            const int m = e >> 6, t = e & (DR_BN - 1);
            float x = -INFINITY;
            if (t0 + t < N) {
                const float* qr = Qs + m * DR_D;
                const unsigned* kr = reinterpret_cast<const unsigned*>(Ks + t * DR_KSTR);
                // four independent partial sums: a single FMA chain of 128 would be latency bound
                float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll 4
                for (int d2 = 0; d2 < DR_D / 2; d2 += 2) {
                    const unsigned w0 = kr[d2], w1 = kr[d2 + 1];
                    s0 = fmaf(qr[2 * d2], __uint_as_float(w0 << 16), s0);
                    s1 = fmaf(qr[2 * d2 + 1], __uint_as_float(w0 & 0xffff0000u), s1);
                    s2 = fmaf(qr[2 * d2 + 2], __uint_as_float(w1 << 16), s2);
                    s3 = fmaf(qr[2 * d2 + 3], __uint_as_float(w1 & 0xffff0000u), s3);
                }
                x = (s0 + s1) + (s2 + s3);
            }
            Ss[m * DR_SSTR + t] = x;
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
        // O += P V
#pragma unroll
        for (int k = 0; k < DR_MAXM / 2; ++k) {
            const int m = r_off + 2 * k;
            if (m < M) acc[k] *= a_s[m];
        }
        for (int t = 0; t < DR_BN; ++t) {
            const float v = bf16_to_f32(Vs[t * DR_D + d_own]);
#pragma unroll
            for (int k = 0; k < DR_MAXM / 2; ++k) {
                const int m = r_off + 2 * k;
                if (m < M) acc[k] += Ss[m * DR_SSTR + t] * v;
            }
        }
    }
    __syncthreads();
    const int total_rows = gridDim.z * BR * Hq;
#pragma unroll
    for (int k = 0; k < DR_MAXM / 2; ++k) {
        const int m = r_off + 2 * k;
        if (m >= M) continue;
        const int r = m / G, gi = m % G;
        const size_t gr = ((size_t)b * BR + r) * Hq + kvh * G + gi;
        const float l = l_s[m];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        if (num_splits == 1) {
            out[gr * DR_D + d_own] = f32_to_bf16(acc[k] * inv);
        } else {
            const size_t pr = (size_t)split * total_rows + gr;
            part_o[pr * DR_D + d_own] = acc[k] * inv;
            if (d_own == 0) part_lse[pr] = l > 0.f ? m_s[m] + log2f(l) : -INFINITY;
        }
    }
}

// Merge split partials: one warp per output row (128 columns, 4 per lane). grid ceil(rows / 4), 128 threads.
extern "C" __global__ void __launch_bounds__(128) drafter_attn_combine(
    const float* __restrict__ part_o, const float* __restrict__ part_lse, int total_rows, int num_splits,
    bf16_bits* __restrict__ out) {
    const int row = blockIdx.x * 4 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= total_rows) return;
    float mx = -INFINITY;
    for (int sp = 0; sp < num_splits; ++sp) mx = fmaxf(mx, part_lse[(size_t)sp * total_rows + row]);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float wsum = 0.f;
    for (int sp = 0; sp < num_splits; ++sp) {
        const float lse = part_lse[(size_t)sp * total_rows + row];
        if (lse == -INFINITY) continue;
        const float w = exp2f(lse - mx);
        wsum += w;
        const float4 v = reinterpret_cast<const float4*>(part_o + ((size_t)sp * total_rows + row) * DR_D)[lane];
        acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    bf16_bits* dst = out + (size_t)row * DR_D + 4 * lane;
    dst[0] = f32_to_bf16(acc.x * inv); dst[1] = f32_to_bf16(acc.y * inv);
    dst[2] = f32_to_bf16(acc.z * inv); dst[3] = f32_to_bf16(acc.w * inv);
}
