// Sampling from logits with temperature, top-k and top-p, reproducible per stream: every random number is
// Philox4x32-10 (counter-based) keyed by the stream's 64-bit seed, with the stream's step counter and the
// vocabulary index in the counter, so a (seed, step) pair always gives the same token, on any grid shape.
//
//  sample_stats (grid chunks x rows): per chunk of a row, at that row's temperature,
//     the running max m and sum exp((l - m) / temp)        -> the softmax normaliser of the full row;
//     the Gumbel-max candidate argmax_i (l_i / temp + G_i) -> an exact sample from the full distribution.
//  sample_pick (grid rows, one warp): merges the chunk statistics, then
//     temp <= 0                  -> the argmax (candidate 0 of the top-K list);
//     top_k == 0 and top_p >= 1  -> the Gumbel-max token (exact, whole vocabulary);
//     otherwise                  -> among the sorted top-K candidates (from topk_chunk/topk_merge), keep the
//        first min(top_k, K) (all K when top_k == 0), cut at the smallest prefix whose probability (under
//        the full-row softmax) reaches top_p, and draw one of them in proportion to its probability.
// The candidate list has K = the wrapper's k_max entries: top-k beyond k_max, or a nucleus needing more
// than k_max tokens, is truncated there (documented in docs/KERNELS.md).
#include "common.cuh"

#define SAMPLE_THREADS 256
#define INFINITY_F __int_as_float(0x7f800000)

__device__ __forceinline__ uint4 philox4x32_10(uint4 ctr, uint2 key) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const uint32_t hi0 = __umulhi(0xD2511F53u, ctr.x), lo0 = 0xD2511F53u * ctr.x;
        const uint32_t hi1 = __umulhi(0xCD9E8D57u, ctr.z), lo1 = 0xCD9E8D57u * ctr.z;
        ctr = make_uint4(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
        key.x += 0x9E3779B9u;
        key.y += 0xBB67AE85u;
    }
    return ctr;
}
// Uniform in (0, 1): the top 24 bits, centred in their interval (never 0 or 1, so logs stay finite).
__device__ __forceinline__ float u01(uint32_t x) { return ((float)(x >> 8) + 0.5f) * (1.0f / 16777216.0f); }

__device__ __forceinline__ uint2 seed_key(unsigned long long seed) {
    return make_uint2((uint32_t)seed, (uint32_t)(seed >> 32));
}

template <typename T> __device__ __forceinline__ float logit_at(const T* p);
template <> __device__ __forceinline__ float logit_at<float>(const float* p) { return *p; }
template <> __device__ __forceinline__ float logit_at<bf16_bits>(const bf16_bits* p) { return bf16_to_f32(*p); }

// stats layout per (row, chunk): [m, s, gumbel_value, gumbel_id (as float bits)]
template <typename TIn>
__global__ void __launch_bounds__(SAMPLE_THREADS)
sample_stats(const TIn* __restrict__ logits, long long row_stride, int V, int chunk,
             const float* __restrict__ temperature, const unsigned long long* __restrict__ seeds,
             const long long* __restrict__ steps, float4* __restrict__ stats) {
    __shared__ float sm[SAMPLE_THREADS / 32], ss[SAMPLE_THREADS / 32], sg[SAMPLE_THREADS / 32];
    __shared__ int sgi[SAMPLE_THREADS / 32];
    const int row = blockIdx.y, c0 = blockIdx.x * chunk, n = min(chunk, V - c0);
    const float temp = temperature[row];
    const float inv_t = temp > 0.f ? 1.f / temp : 1.f;
    const uint2 key = seed_key(seeds[row]);
    const unsigned long long step = (unsigned long long)steps[row];
    const TIn* src = logits + row * row_stride + c0;
    float m = -INFINITY_F, s = 0.f, g = -INFINITY_F;
    int gi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
        const float z = logit_at(src + i) * inv_t;
        if (z > m) { s = s * expf(m - z) + 1.f; m = z; } else { s += expf(z - m); }
        const int id = c0 + i;
        const uint4 r = philox4x32_10(make_uint4((uint32_t)id, 0u, (uint32_t)step, (uint32_t)(step >> 32)), key);
        const float gz = z - logf(-logf(u01(r.x)));
        if (gz > g || (gz == g && id < gi)) { g = gz; gi = id; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        const float mm = fmaxf(m, m2);
        s = (m == -INFINITY_F ? 0.f : s * expf(m - mm)) + (m2 == -INFINITY_F ? 0.f : s2 * expf(m2 - mm));
        m = mm;
        const float g2 = __shfl_xor_sync(0xffffffffu, g, o);
        const int gi2 = __shfl_xor_sync(0xffffffffu, gi, o);
        if (g2 > g || (g2 == g && gi2 < gi)) { g = g2; gi = gi2; }
    }
    const int w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) { sm[w] = m; ss[w] = s; sg[w] = g; sgi[w] = gi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < SAMPLE_THREADS / 32; ++k) {
            const float mm = fmaxf(m, sm[k]);
            s = (m == -INFINITY_F ? 0.f : s * expf(m - mm)) + (sm[k] == -INFINITY_F ? 0.f : ss[k] * expf(sm[k] - mm));
            m = mm;
            if (sg[k] > g || (sg[k] == g && sgi[k] < gi)) { g = sg[k]; gi = sgi[k]; }
        }
        stats[(long long)row * gridDim.x + blockIdx.x] = make_float4(m, s, g, __int_as_float(gi));
    }
}

// One warp per row. cand_vals/cand_ids [rows, K] sorted descending (topk_merge output, raw logits).
extern "C" __global__ void sample_pick(const float4* __restrict__ stats, int n_chunks,
                                       const float* __restrict__ cand_vals, const int* __restrict__ cand_ids, int K,
                                       const float* __restrict__ temperature, const int* __restrict__ top_k,
                                       const float* __restrict__ top_p, const unsigned long long* __restrict__ seeds,
                                       const long long* __restrict__ steps, int* __restrict__ out) {
    const int row = blockIdx.x, lane = threadIdx.x;
    const float temp = temperature[row];
    const float* cv = cand_vals + (long long)row * K;
    const int* ci = cand_ids + (long long)row * K;
    if (temp <= 0.f) { if (lane == 0) out[row] = ci[0]; return; }
    float M = -INFINITY_F, Z = 0.f, g = -INFINITY_F;
    int gi = 0x7fffffff;
    for (int c = 0; c < n_chunks; ++c) {     // every lane merges the same few values: no shuffles needed
        const float4 st = stats[(long long)row * n_chunks + c];
        const float mm = fmaxf(M, st.x);
        Z = (M == -INFINITY_F ? 0.f : Z * expf(M - mm)) + (st.x == -INFINITY_F ? 0.f : st.y * expf(st.x - mm));
        M = mm;
        const int id = __float_as_int(st.w);
        if (st.z > g || (st.z == g && id < gi)) { g = st.z; gi = id; }
    }
    const int tk = top_k[row];
    const float tp = top_p[row];
    if (tk <= 0 && tp >= 1.f) { if (lane == 0) out[row] = gi; return; }
    if (lane != 0) return;
    // Serial over <= K candidates (K <= 256): cheap next to the stats pass, and exact in order.
    const int kk = tk > 0 ? min(tk, K) : K;
    const float inv_t = 1.f / temp;
    // The nucleus is measured against the mass top-k kept (the whole row's, 1, when top_k is off), as in
    // ddtree_cupy/reference/ddtree.py's sample_from_logits.
    float kept = 0.f;
    if (tk > 0)
        for (int j = 0; j < kk && ci[j] >= 0; ++j) kept += expf(cv[j] * inv_t - M) / Z;
    else
        kept = 1.f;
    const float thresh = tp * kept;
    float cum = 0.f;
    int n = 0;
    for (; n < kk && ci[n] >= 0; ++n) {
        cum += expf(cv[n] * inv_t - M) / Z;
        if (cum >= thresh) { ++n; break; }
    }
    if (n == 0) { out[row] = ci[0]; return; }
    const unsigned long long step = (unsigned long long)steps[row];
    const uint4 r = philox4x32_10(make_uint4(0xffffffffu, 1u, (uint32_t)step, (uint32_t)(step >> 32)), seed_key(seeds[row]));
    const float target = u01(r.x) * cum;
    float acc = 0.f;
    int pick = n - 1;
    for (int j = 0; j < n; ++j) {
        acc += expf(cv[j] * inv_t - M) / Z;
        if (acc > target) { pick = j; break; }
    }
    out[row] = ci[pick];
}
