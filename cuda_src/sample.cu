// Exact sampling from logits with temperature, top-k and top-p over the whole vocabulary (no candidate cap),
// reproducible per stream and identical to ddtree_cupy/reference/ddtree.py's sample_from_logits fed with
// the same uniform: the reference sorts the ids by probability (descending, ties -> lower id), keeps the
// first top_k, then the shortest head whose mass reaches top_p x the kept mass, and returns the first id
// whose running mass exceeds u x the head's mass. This kernel finds the same boundaries without sorting:
//
//  * Every id gets an order key: the logit's bits mapped to a uint32 whose unsigned order is the float
//    order (descending key = descending probability at any temperature; equal keys = equal logits).
//  * Its weight is a fixed-point mass, p = exp((l - max) / T) in units of 2^-40 (at most 2^40 per id, so a
//    163840-id row sums to < 2^58): integer sums are exact and independent of the summation order, so
//    every run, grid shape and tensor-parallel rank takes the same decisions.
//  * A boundary ("the shortest prefix in sorted order whose count or mass reaches a target") is a radix
//    search over the key, 8 bits per pass, most significant first: a 256-bin histogram of count and mass
//    of the ids still in play, one warp scanning it from the top bin down. After four passes the boundary
//    key is known; ids sharing it have equal weight, so how many of them the prefix takes is arithmetic,
//    and which ones is "the lowest ids" (the reference's tie order).
//  * The kept set after a search is "keys above the boundary, plus the first `take` ids at the boundary":
//    top-k, then top-p, then the draw each search inside the previous kept set.
//  * The draw's uniform is Philox4x32-10 keyed by seeds[row] with counter (steps lo, steps hi, 0, 0),
//    u = ((x0 >> 8) + 0.5) / 2^24 (reference.ddtree.philox_uniform): the target mass is floor(u x kept) + 1,
//    computed exactly in 128-bit integer arithmetic.
//  * temperature <= 0: the argmax, lowest id on ties (the count search with target 1).
//
// Probabilities below 2^-41 of the row's maximum weigh 0 here: they are never drawn and do not count toward
// top-p (their summed mass is below 163840 x 2^-41 < 1e-7 of the maximum's).
//
// One block per row; 15 passes over the row at most (max, mass, 3 searches x 4, the id lookup).
#include "common.cuh"

#define SAMPLE_THREADS 512
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define MASS_ONE 1099511627776.0f   // 2^40

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

template <typename T> __device__ __forceinline__ float logit_at(const T* p);
template <> __device__ __forceinline__ float logit_at<float>(const float* p) { return *p; }
template <> __device__ __forceinline__ float logit_at<bf16_bits>(const bf16_bits* p) { return bf16_to_f32(*p); }

// Unsigned order == float order; -0 and +0 share one key (equal logits tie, as in the reference); NaN gets
// key 0 (below every number) and weight 0.
__device__ __forceinline__ uint32_t order_key(float f) {
    if (f != f) return 0u;
    if (f == 0.f) return 0x80000000u;
    const uint32_t b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ unsigned long long fixed_mass(float l, float m, float inv_t) {
    if (l != l) return 0ull;
    const float d = l - m;
    if (d == 0.f) return 1ull << 40;                 // the maximum (also when inv_t is huge: no 0 * inf)
    const float p = expf(d * inv_t);                 // d < 0: p in [0, 1)
    return (unsigned long long)(p * MASS_ONE);
}

// The kept set: every id with key > key_floor, plus the first `take` ids (lowest) with key == key_floor,
// each of weight `unit` (active == 0: every id).
struct Kept {
    uint32_t key_floor, take;
    unsigned long long unit;
    unsigned long long count, mass;                  // totals of the kept set
    int active;
};

struct SearchSmem {
    unsigned int cnt[256];
    unsigned long long mass[256];
    uint32_t prefix;
    unsigned long long above_cnt, above_mass, bin_cnt, bin_mass;
};

template <typename T> __device__ __forceinline__ T warp_incl_scan(T v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
    return v;
}

// Shortest prefix (descending key, ties by lower id) of the kept set `k` whose weight (mass when by_mass,
// else count) reaches `target` (1 <= target <= the kept set's weight). Returns the new kept set (its mass
// is tracked when with_mass).
template <typename TIn>
__device__ Kept search(const TIn* __restrict__ row, int V, float m, float inv_t, const Kept& k, bool by_mass,
                       unsigned long long target, SearchSmem& sm, bool with_mass) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) { sm.prefix = 0u; sm.above_cnt = 0ull; sm.above_mass = 0ull; }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += SAMPLE_THREADS) { sm.cnt[b] = 0u; sm.mass[b] = 0ull; }
        __syncthreads();
        const uint32_t prefix = sm.prefix;
        const uint32_t hi_mask = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
        for (int i = tid; i < V; i += SAMPLE_THREADS) {
            const float l = logit_at(row + i);
            const uint32_t key = order_key(l);
            if ((key & hi_mask) != (prefix & hi_mask)) continue;
            if (k.active && key <= k.key_floor) continue;      // the boundary group is added below, whole
            const int bin = (key >> shift) & 255;
            atomicAdd(&sm.cnt[bin], 1u);
            if (with_mass) atomicAdd(&sm.mass[bin], fixed_mass(l, m, inv_t));
        }
        if (tid == 0 && k.active && k.take > 0 && (k.key_floor & hi_mask) == (prefix & hi_mask)) {
            const int bin = (k.key_floor >> shift) & 255;
            atomicAdd(&sm.cnt[bin], k.take);
            if (with_mass) atomicAdd(&sm.mass[bin], k.unit * k.take);
        }
        __syncthreads();
        if (warp == 0) {
            // lane L owns bins 255 - 8L ... 248 - 8L (descending key order across the warp)
            unsigned long long c = 0ull, s = 0ull;
#pragma unroll
            for (int j = 0; j < 8; ++j) { const int b = 255 - 8 * lane - j; c += sm.cnt[b]; s += sm.mass[b]; }
            const unsigned long long ci = warp_incl_scan(c, lane), si = warp_incl_scan(s, lane);
            const unsigned long long a_c = sm.above_cnt, a_s = sm.above_mass;
            const unsigned long long reach = by_mass ? a_s + si : a_c + ci;
            unsigned int hit = __ballot_sync(0xffffffffu, reach >= target);
            // target never exceeds the kept weight, so some lane reaches it; guard against a bad input anyway
            const int first = hit ? __ffs(hit) - 1 : 31;
            if (lane == first) {
                unsigned long long acc_c = a_c + ci - c, acc_s = a_s + si - s;
                int chosen = 248 - 8 * lane;
                for (int j = 0; j < 8; ++j) {
                    const int b = 255 - 8 * lane - j;
                    const unsigned long long wc = sm.cnt[b], ws = sm.mass[b];
                    if (wc > 0 && (by_mass ? acc_s + ws : acc_c + wc) >= target) { chosen = b; break; }
                    acc_c += wc;
                    acc_s += ws;
                }
                sm.prefix = prefix | ((uint32_t)chosen << shift);
                sm.above_cnt = acc_c;
                sm.above_mass = acc_s;
                sm.bin_cnt = sm.cnt[chosen];
                sm.bin_mass = sm.mass[chosen];
            }
        }
        __syncthreads();
    }
    Kept r;
    r.key_floor = sm.prefix;
    r.active = 1;
    const unsigned long long n = sm.bin_cnt, gm = sm.bin_mass;
    r.unit = n ? gm / n : 0ull;                       // every id of one key has the same weight
    const unsigned long long need = target - (by_mass ? sm.above_mass : sm.above_cnt);
    unsigned long long take;
    if (!by_mass) take = need;
    else take = r.unit ? (need + r.unit - 1) / r.unit : n;
    take = take < 1ull ? 1ull : (take > n ? n : take);
    r.take = (uint32_t)take;
    r.count = sm.above_cnt + take;
    r.mass = sm.above_mass + take * r.unit;
    __syncthreads();                                  // sm is reused by the next search
    return r;
}

template <typename TIn>
__global__ void __launch_bounds__(SAMPLE_THREADS)
sample_exact(const TIn* __restrict__ logits, long long row_stride, int V, const float* __restrict__ temperature,
             const int* __restrict__ top_k, const float* __restrict__ top_p,
             const unsigned long long* __restrict__ seeds, const long long* __restrict__ steps,
             int* __restrict__ out) {
    __shared__ SearchSmem sm;
    __shared__ float red_f[SAMPLE_WARPS];
    __shared__ unsigned long long red_u[SAMPLE_WARPS];
    __shared__ int wbase[SAMPLE_WARPS], s_total, s_found;
    const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const TIn* row = logits + (long long)r * row_stride;
    const float temp = temperature[r];
    const float inv_t = temp > 0.f ? 1.f / temp : 0.f;
    const bool greedy = !(temp > 0.f) || isinf(inv_t);

    // the row's maximum logit (NaN ignored)
    float m = -__int_as_float(0x7f800000);
    for (int i = tid; i < V; i += SAMPLE_THREADS) { const float l = logit_at(row + i); if (l > m) m = l; }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red_f[warp] = m;
    __syncthreads();
    m = red_f[0];
    for (int w = 1; w < SAMPLE_WARPS; ++w) m = fmaxf(m, red_f[w]);

    Kept k;
    k.active = 0; k.key_floor = 0u; k.take = 0u; k.unit = 0ull; k.count = (unsigned long long)V; k.mass = 0ull;
    if (greedy) {
        k = search(row, V, m, 1.f, k, false, 1ull, sm, false);
    } else {
        // total mass of the row
        unsigned long long s = 0ull;
        for (int i = tid; i < V; i += SAMPLE_THREADS) s += fixed_mass(logit_at(row + i), m, inv_t);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) red_u[warp] = s;
        __syncthreads();
        s = 0ull;
        for (int w = 0; w < SAMPLE_WARPS; ++w) s += red_u[w];
        k.mass = s;
        const int tk = top_k[r];
        if (tk > 0 && tk < V) k = search(row, V, m, inv_t, k, false, (unsigned long long)tk, sm, true);
        const float tp = top_p[r];
        if (tp < 1.f) {
            double thr = ceil((double)tp * (double)k.mass);
            unsigned long long t = thr < 1.0 ? 1ull : (unsigned long long)thr;
            if (t > k.mass) t = k.mass;
            k = search(row, V, m, inv_t, k, true, t, sm, true);
        }
        // the draw: target = floor(u * kept) + 1 with u = (2a + 1) / 2^25, a = x0 >> 8
        const unsigned long long ctr = (unsigned long long)steps[r], key = seeds[r];
        const uint4 x = philox4x32_10(make_uint4((uint32_t)ctr, (uint32_t)(ctr >> 32), 0u, 0u),
                                      make_uint2((uint32_t)key, (uint32_t)(key >> 32)));
        const unsigned long long odd = 2ull * (unsigned long long)(x.x >> 8) + 1ull;
        const unsigned long long lo = k.mass * odd, hi = __umul64hi(k.mass, odd);
        unsigned long long t = ((hi << 39) | (lo >> 25)) + 1ull;
        if (t > k.mass) t = k.mass;
        k = search(row, V, m, inv_t, k, true, t, sm, true);
    }

    // the k.take-th lowest id whose key is k.key_floor
    if (tid == 0) s_found = -1;
    int base = 0;
    for (int c0 = 0; c0 < V; c0 += SAMPLE_THREADS) {
        const int i = c0 + tid;
        const bool hit = i < V && order_key(logit_at(row + i)) == k.key_floor;
        const unsigned int ballot = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) wbase[warp] = __popc(ballot);
        __syncthreads();
        if (warp == 0) {
            const int v = lane < SAMPLE_WARPS ? wbase[lane] : 0;
            const int inc = warp_incl_scan(v, lane);
            if (lane < SAMPLE_WARPS) wbase[lane] = inc - v;
            if (lane == 31) s_total = inc;
        }
        __syncthreads();
        const int pos = base + wbase[warp] + __popc(ballot & ((1u << lane) - 1u)) + 1;
        if (hit && pos == (int)k.take) s_found = i;
        base += s_total;
        __syncthreads();
        if (s_found >= 0) break;
    }
    if (tid == 0) out[r] = s_found >= 0 ? s_found : 0;
}

template __global__ void sample_exact<float>(const float*, long long, int, const float*, const int*, const float*,
                                             const unsigned long long*, const long long*, int*);
template __global__ void sample_exact<bf16_bits>(const bf16_bits*, long long, int, const float*, const int*,
                                                 const float*, const unsigned long long*, const long long*, int*);
