// Top-K and argmax over long rows (V = 163840 logits), exact, ties broken by the lowest index.
//
// Every candidate becomes a unique 64-bit key: (order-preserving bits of the fp32 value) << 32 | ~id.
// A larger key is a larger value, or the same value with a smaller id, so "the K largest keys" is exactly
// the required order, with no tie rule left to apply. A block finds the K-th largest key of its items with
// an 8-pass radix select (8 bits per pass, shared-memory histogram: radix_select.cuh, the DDTree top-K's
// too), keeps the K items >= it, and sorts them (bitonic, descending).
//  stage 1 (topk_chunk): grid (chunks, rows): each block the top-K of one chunk of a row, ids + id_offset
//                        (a vocabulary shard's global ids);
//  stage 2 (topk_merge): grid (rows): the top-K of the chunks' (or the shards') candidate lists.
// Output per row: values fp32 [K] descending, ids int32 [K]; fewer than K items pad with (-inf, -1).
// NaN logits are not supported (a NaN ranks above +inf).
#include "common.cuh"
#include "radix_select.cuh"

#define TOPK_THREADS 256
#define TOPK_MAX_K 256
#define INFINITY_F __int_as_float(0x7f800000)
typedef unsigned long long u64;

__device__ __forceinline__ uint32_t f32_order_key(float f) {
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float order_key_f32(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ u64 make_key(float v, int id) {
    return ((u64)f32_order_key(v) << 32) | (u64)(~(uint32_t)id);
}
template <typename T> __device__ __forceinline__ float load_logit(const T* p);
template <> __device__ __forceinline__ float load_logit<float>(const float* p) { return *p; }
template <> __device__ __forceinline__ float load_logit<bf16_bits>(const bf16_bits* p) { return bf16_to_f32(*p); }

struct SelectShared {
    unsigned int hist[256];
    int digit, count;
    unsigned above, bin;   // radix_pick's outputs
    u64 best[TOPK_THREADS / 32];
};

// The K largest of items[0..n) (unique keys) -> out[0..kpad) sorted descending, zero-padded. K <= n.
__device__ void block_topk(const u64* items, int n, int K, int kpad, u64* out, SelectShared& sh) {
    const int tid = threadIdx.x;
    if (K == 1) {      // argmax: a max-reduction is enough
        u64 m = 0;
        for (int i = tid; i < n; i += TOPK_THREADS) m = max(m, items[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
        if ((tid & 31) == 0) sh.best[tid >> 5] = m;
        __syncthreads();
        if (tid < kpad) {
            u64 r = 0;
            if (tid == 0)
                for (int w = 0; w < TOPK_THREADS / 32; ++w) r = max(r, sh.best[w]);
            out[tid] = r;
        }
        __syncthreads();
        return;
    }
    static_assert(TOPK_THREADS == 256, "radix_select: one histogram bin per thread");
    const u64 prefix = radix_select<false>((unsigned)K, 0u, sh.hist, &sh.digit, &sh.above, &sh.bin, tid, tid & 31,
                                           tid >> 5, [&](u64 hmask, u64 pre, int shift) {
        for (int i = tid; i < n; i += TOPK_THREADS) {
            const u64 k = items[i];
            if ((k & hmask) == pre) atomicAdd(&sh.hist[(k >> shift) & 255], 1u);
        }
    });
    // prefix is now the K-th largest key itself; exactly K items are >= it.
    if (tid == 0) sh.count = 0;
    for (int i = tid; i < kpad; i += TOPK_THREADS) out[i] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += TOPK_THREADS) {
        const u64 k = items[i];
        if (k >= prefix) out[atomicAdd(&sh.count, 1)] = k;
    }
    for (int size = 2; size <= kpad; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int i = tid; i < kpad; i += TOPK_THREADS) {
                const int j = i ^ stride;
                if (j > i) {
                    const u64 a = out[i], b = out[j];
                    const bool desc = (i & size) == 0;
                    if (desc ? a < b : a > b) { out[i] = b; out[j] = a; }
                }
            }
        }
    }
    __syncthreads();
}

__device__ __forceinline__ void write_result(const u64* sel, int K, float* vals, int* ids) {
    for (int i = threadIdx.x; i < K; i += TOPK_THREADS) {
        const u64 k = sel[i];
        if (k == 0) { vals[i] = -INFINITY_F; ids[i] = -1; }
        else { vals[i] = order_key_f32((uint32_t)(k >> 32)); ids[i] = (int)(~(uint32_t)k); }
    }
}

// dynamic shared memory: chunk * 8 + kpad * 8 bytes
template <typename TIn>
__global__ void __launch_bounds__(TOPK_THREADS)
topk_chunk(const TIn* __restrict__ logits, long long row_stride, int V, int chunk, int K, int kpad,
           int id_offset, float* __restrict__ out_vals, int* __restrict__ out_ids) {
    extern __shared__ u64 topk_smem[];
    __shared__ SelectShared sh;
    u64* items = topk_smem;
    u64* sel = topk_smem + chunk;
    const int row = blockIdx.y, c = blockIdx.x;
    const int c0 = c * chunk;
    const int n = min(chunk, V - c0);
    const TIn* src = logits + row * row_stride + c0;
    for (int i = threadIdx.x; i < n; i += TOPK_THREADS) items[i] = make_key(load_logit(src + i), c0 + i + id_offset);
    __syncthreads();
    const int kk = min(K, n);
    block_topk(items, n, kk, kpad, sel, sh);
    const long long o = ((long long)row * gridDim.x + c) * K;
    write_result(sel, K, out_vals + o, out_ids + o);
}

// dynamic shared memory: n * 8 + kpad * 8 bytes. Candidates with id < 0 are padding.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
topk_merge(const float* __restrict__ vals, const int* __restrict__ ids, int n, int K, int kpad,
           float* __restrict__ out_vals, int* __restrict__ out_ids) {
    extern __shared__ u64 topk_smem[];
    __shared__ SelectShared sh;
    u64* items = topk_smem;
    u64* sel = topk_smem + n;
    const int row = blockIdx.x;
    for (int i = threadIdx.x; i < n; i += TOPK_THREADS) {
        const int id = ids[(long long)row * n + i];
        items[i] = id < 0 ? 0ull : make_key(vals[(long long)row * n + i], id);
    }
    __syncthreads();
    block_topk(items, n, min(K, n), kpad, sel, sh);
    write_result(sel, K, out_vals + (long long)row * K, out_ids + (long long)row * K);
}
