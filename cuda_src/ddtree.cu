// DDTree on the GPU: per-depth top-K, best-first tree builder, acceptance walk + commit.
// The specification is ddtree_cupy/reference/ddtree.py; every kernel here reproduces it exactly
// (top-K ids, tree rows, mask, walk, commit indices); only the log-sum-exp is float32 with its own
// summation order. One launch per stage covers all streams; per-stream values (budget, prefix length,
// bonus token) are read on the device, sizes are fixed, so the whole step can be captured in a graph.
#include "common.cuh"

#define DDT_MAX_K 128          // top-K width supported by the select buffers (budget <= 128)
#define DDT_MAX_DEPTH 8        // rank-tuple key: 8 bits per depth in 64 bits
#define DDT_SEL_CAP 256        // per-warp candidate buffer, >= next_pow2(K + 32)
#define DDT_TOPK_WARPS 4       // warps per block in the first top-K kernel
#define DDT_TOPK_UNROLL 4      // vectors of 8 logits in flight per lane
#define DDT_MERGE_WARPS 8      // warps per block (one row per block) in the merge kernel
#define DDT_MERGE_UNROLL 8     // candidate keys in flight per lane in the merge
#define DDT_FRONTIER (DDT_MAX_TREE_ROWS + DDT_MAX_DEPTH + 8)  // heap entries: pops + 1 <= budget + D + 1
// DDT_FAST=0: the variant verified on the H200 (shared-memory bitonic sort, one push per value slot,
// butterfly argmax). DDT_FAST=1: register bitonic sort, one push per passing value, argmax by warp
// reductions, top-K ids staged in shared memory. Same results by construction; see docs/DDTREE.md.
#ifndef DDT_FAST
#define DDT_FAST 0
#endif

typedef unsigned long long u64;
#define DDT_NEG_INF (__int_as_float(0xff800000))   // NVRTC has no <math.h> INFINITY
#define FULL_MASK 0xffffffffu

// ---------------------------------------------------------------------------------------------------
// Sort keys. A candidate (value, id) becomes one 64-bit key whose unsigned order is the reference order:
// value descending, then lower id first. The value's bits are made order-preserving (flip all bits of a
// negative float, set the sign bit of a positive one); -0.0 is canonicalised to +0.0 first (numpy treats
// them as equal, their raw bit patterns differ). Key 0 is never a real candidate: it is the empty slot.
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t f32_to_ordered(float f) {
    uint32_t b = __float_as_uint(f + 0.0f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float ordered_to_f32(uint32_t o) {
    return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
__device__ __forceinline__ u64 make_key(float v, uint32_t id) {
    return ((u64)f32_to_ordered(v) << 32) | (u64)(0xffffffffu - id);
}
__device__ __forceinline__ float key_value(u64 k) { return ordered_to_f32((uint32_t)(k >> 32)); }
__device__ __forceinline__ int key_id(u64 k) { return (int)(0xffffffffu - (uint32_t)k); }

#if !DDT_FAST
// Warp-wide bitonic sort of buf[0, n) descending (n a power of two, 64 <= n <= DDT_SEL_CAP).
__device__ __forceinline__ void warp_sort_desc(u64* buf, int n, int lane) {
    for (int k = 2; k <= n; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = lane; i < n; i += 32) {
                int l = i ^ j;
                if (l > i) {
                    u64 a = buf[i], b = buf[l];
                    bool desc = (i & k) == 0;
                    if (desc ? (a < b) : (a > b)) { buf[i] = b; buf[l] = a; }
                }
            }
            __syncwarp();
        }
    }
}
#endif

#if DDT_FAST
// Warp-wide bitonic sort, descending, of 32 * E keys held in registers: element i = e * 32 + lane is
// r[e] of lane `lane`. Partners i ^ j with j >= 32 are in the same lane (register compare-swap), with
// j < 32 in lane ^ j (shuffle; each side keeps the max or the min). Fully unrolled: E is a template
// parameter and the loops run over log2 sizes.
template <int E, int LOG2N>
__device__ __forceinline__ void warp_sort_regs(u64 (&r)[E], int lane) {
#pragma unroll
    for (int a = 1; a <= LOG2N; ++a) {
        const int kk = 1 << a;
#pragma unroll
        for (int b = a - 1; b >= 0; --b) {
            const int j = 1 << b;
            if (j >= 32) {
                const int je = j >> 5;
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    if (e & je) continue;
                    const bool desc = (((e << 5) + lane) & kk) == 0;
                    const u64 x = r[e], y = r[e | je];
                    const bool sw = desc ? (x < y) : (x > y);
                    r[e] = sw ? y : x;
                    r[e | je] = sw ? x : y;
                }
            } else {
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    const u64 o = __shfl_xor_sync(FULL_MASK, r[e], j);
                    const bool desc = (((e << 5) + lane) & kk) == 0;
                    const bool lower = (lane & j) == 0;
                    const bool keep_max = desc == lower;
                    r[e] = keep_max ? (r[e] > o ? r[e] : o) : (r[e] < o ? r[e] : o);
                }
            }
        }
    }
}

// Sort buf[0, 32 * E) descending through registers (entries at index >= cnt read as the empty key 0).
template <int E, int LOG2N>
__device__ __forceinline__ void warp_sort_buf(u64* buf, int cnt, int lane) {
    u64 r[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int i = (e << 5) + lane;
        r[e] = i < cnt ? buf[i] : 0ull;
    }
    warp_sort_regs<E, LOG2N>(r, lane);
#pragma unroll
    for (int e = 0; e < E; ++e) buf[(e << 5) + lane] = r[e];
    __syncwarp();
}
#endif

// A warp's running top-k: unsorted candidates in buf[0, cnt), all > thr. When a batch would not fit,
// sort, keep the k best, and raise thr to the k-th key (keys are unique, so anything <= it cannot
// enter the top-k). The common case is one compare per element and a ballot.
struct WarpSelect {
    u64* buf;
    int cnt, k, cap;  // cap = power of two >= k + 32, so a whole 32-lane batch fits after a flush
    u64 thr;

    __device__ void init(u64* b, int k_, int lane) {
        buf = b; k = k_; cnt = 0; thr = 0ull;
        cap = 64;
        while (cap < k + 32) cap <<= 1;
    }
    __device__ void flush(int lane) {
#if DDT_FAST
        __syncwarp();   // every lane's candidate stores are visible
        if (cap == 64) warp_sort_buf<2, 6>(buf, cnt, lane);
        else if (cap == 128) warp_sort_buf<4, 7>(buf, cnt, lane);
        else warp_sort_buf<8, 8>(buf, cnt, lane);
#else
        for (int i = cnt + lane; i < cap; i += 32) buf[i] = 0ull;
        __syncwarp();
        warp_sort_desc(buf, cap, lane);
#endif
        if (cnt >= k) { cnt = k; thr = buf[k - 1]; }
    }
    // every lane calls with its candidate (0 = none)
    __device__ void push(u64 c, int lane) {
        bool pass = c > thr;
        unsigned m = __ballot_sync(FULL_MASK, pass);
        if (!m) return;
        if (cnt + __popc(m) > cap) {
            flush(lane);
            pass = c > thr;
            m = __ballot_sync(FULL_MASK, pass);
        }
        if (pass) buf[cnt + __popc(m & ((1u << lane) - 1u))] = c;
        cnt += __popc(m);
        __syncwarp();
    }
};

__device__ __forceinline__ void lse_combine(float& m, float& s, float m2, float s2) {
    float mm = fmaxf(m, m2);
    if (mm == DDT_NEG_INF) return;   // both empty
    s = s * __expf(m - mm) + s2 * __expf(m2 - mm);
    m = mm;
}

__device__ __forceinline__ void load8(const float* p, float* v) {
    float4 a = *reinterpret_cast<const float4*>(p);
    float4 b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void load8(const bf16_bits* p, float* v) {
    uint4 a = *reinterpret_cast<const uint4*>(p);
    uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// ---------------------------------------------------------------------------------------------------
// Stage 1: per (row, chunk) the chunk's top-k keys and its log-sum-exp partial (max, sum exp(x - max)).
// logits [rows, V_local] (row = stream * D + depth - 1), one warp per chunk of `chunk` elements
// (a multiple of 256). Global token id = id_offset + local index (vocabulary-parallel shards).
// part_keys [rows, P, k], part_ms [rows, P] with P = ceil(V_local / chunk).
// ---------------------------------------------------------------------------------------------------
template <typename T>
__device__ void topk_partial(const T* __restrict__ logits, int rows, int V_local, int id_offset, int k,
                             int chunk, u64* __restrict__ part_keys, float2* __restrict__ part_ms) {
    __shared__ u64 s_buf[DDT_TOPK_WARPS][DDT_SEL_CAP];
    __shared__ float s_scr[DDT_TOPK_WARPS][DDT_TOPK_UNROLL * 8 * 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int P = (V_local + chunk - 1) / chunk;
    const int c = blockIdx.x * DDT_TOPK_WARPS + warp;
    const int r = blockIdx.y;
    if (c >= P || r >= rows) return;   // whole warp leaves together; no block-wide barrier below
    const T* x = logits + (size_t)r * V_local;
    const int beg = c * chunk, end = min(V_local, beg + chunk);

    WarpSelect sel;
    sel.init(s_buf[warp], k, lane);
    float m = DDT_NEG_INF, s = 0.f;
    // DDT_TOPK_UNROLL vectors of 8 logits per lane are loaded before any is used, so each warp keeps
    // several 512-byte requests in flight (latency hiding without a deeper pipeline). Vectors that may
    // hold a top-k candidate (rare once the threshold has risen) go through shared scratch to a single,
    // not unrolled insertion loop: one inlined copy of the select code keeps registers low.
    float* scr = s_scr[warp];
    for (int base = beg; base < end; base += 256 * DDT_TOPK_UNROLL) {
        float v[DDT_TOPK_UNROLL][8];
        bool ok[DDT_TOPK_UNROLL];
#pragma unroll
        for (int u = 0; u < DDT_TOPK_UNROLL; ++u) {
            const int i0 = base + u * 256 + lane * 8;
            ok[u] = i0 < end;   // V_local % 8 == 0 (checked by the wrapper): a vector is all in or out
            if (ok[u]) load8(x + i0, v[u]);
        }
        unsigned need = 0;   // warp-uniform: bit u set if some lane's vector u may enter the top-k
#pragma unroll
        for (int u = 0; u < DDT_TOPK_UNROLL; ++u) {
            float vm = v[u][0];
#pragma unroll
            for (int i = 1; i < 8; ++i) vm = fmaxf(vm, v[u][i]);
            if (ok[u]) {   // log-sum-exp partial, rescaled once per vector
                if (vm > m) { s *= __expf(m - vm); m = vm; }
#pragma unroll
                for (int i = 0; i < 8; ++i) s += __expf(v[u][i] - m);
            }
            // make_key(vm, 0) bounds the lane's best key in this vector from above
            if (__any_sync(FULL_MASK, ok[u] && make_key(vm, 0u) > sel.thr)) {
                need |= 1u << u;
#pragma unroll
                for (int i = 0; i < 8; ++i) scr[(u * 8 + i) * 32 + lane] = ok[u] ? v[u][i] : DDT_NEG_INF;
            }
        }
        if (!need) continue;
        __syncwarp();
#pragma unroll 1
        for (int u = 0; u < DDT_TOPK_UNROLL; ++u) {
            if (!(need >> u & 1)) continue;
            const int i0 = base + u * 256 + lane * 8;
#if DDT_FAST
            const float* sv = scr + u * 8 * 32 + lane;
            // each lane offers one of its passing values per push: pushes = the busiest lane's count
            unsigned bits = 0;
            if (i0 < end) {
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    if (make_key(sv[i * 32], (uint32_t)(id_offset + i0 + i)) > sel.thr) bits |= 1u << i;
            }
            while (__any_sync(FULL_MASK, bits != 0)) {
                u64 c = 0ull;
                if (bits) {
                    const int i = __ffs(bits) - 1;
                    bits &= bits - 1;
                    c = make_key(sv[i * 32], (uint32_t)(id_offset + i0 + i));
                }
                sel.push(c, lane);
            }
#else
            const bool in = i0 < end;
#pragma unroll 1
            for (int i = 0; i < 8; ++i)
                sel.push(in ? make_key(scr[(u * 8 + i) * 32 + lane], (uint32_t)(id_offset + i0 + i)) : 0ull,
                         lane);
#endif
        }
        __syncwarp();   // scratch is read by every lane before the next batch overwrites it
    }
    sel.flush(lane);
    u64* out = part_keys + ((size_t)r * P + c) * k;
    for (int i = lane; i < k; i += 32) out[i] = s_buf[warp][i];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_xor_sync(FULL_MASK, m, off), s2 = __shfl_xor_sync(FULL_MASK, s, off);
        lse_combine(m, s, m2, s2);
    }
    if (lane == 0) part_ms[(size_t)r * P + c] = make_float2(m, s);
}

// DDT_FAST: min 4 blocks per SM, without which ptxas (sm_90) caps registers low and spills
#if DDT_FAST
#define DDT_PARTIAL_BOUNDS __launch_bounds__(32 * DDT_TOPK_WARPS, 4)
#else
#define DDT_PARTIAL_BOUNDS __launch_bounds__(32 * DDT_TOPK_WARPS)
#endif
extern "C" __global__ void DDT_PARTIAL_BOUNDS
ddt_topk_partial_f32(const float* logits, int rows, int V_local, int id_offset, int k, int chunk,
                     u64* part_keys, float2* part_ms) {
    topk_partial<float>(logits, rows, V_local, id_offset, k, chunk, part_keys, part_ms);
}
extern "C" __global__ void DDT_PARTIAL_BOUNDS
ddt_topk_partial_bf16(const bf16_bits* logits, int rows, int V_local, int id_offset, int k, int chunk,
                      u64* part_keys, float2* part_ms) {
    topk_partial<bf16_bits>(logits, rows, V_local, id_offset, k, chunk, part_keys, part_ms);
}

// ---------------------------------------------------------------------------------------------------
// Stage 2: merge P partial top-k lists (+ lse partials) per row into the row's top-k. One block of
// DDT_MERGE_WARPS warps per row: each warp selects from a slice, warp 0 merges the warps' lists.
// Layout of the inputs: parts_major = 0: keys [rows, P, k], ms [rows, P] (the output of stage 1);
// parts_major = 1: keys [P, rows, k], ms [P, rows] (an all-gather over vocabulary shards).
// Outputs: out_keys [rows, k], out_ms [rows] (to merge again across shards) and the log-probs
// out_lp [rows, k] = value - (M + log S), out_id [rows, k] (-1 / -inf where fewer than k candidates).
// ---------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(32 * DDT_MERGE_WARPS)
ddt_topk_merge(const u64* __restrict__ in_keys, const float2* __restrict__ in_ms, int rows, int P, int k,
               int parts_major, u64* __restrict__ out_keys, float2* __restrict__ out_ms,
               float* __restrict__ out_lp, int* __restrict__ out_id) {
    __shared__ u64 s_buf[DDT_MERGE_WARPS][DDT_SEL_CAP];
    __shared__ u64 s_scr[DDT_MERGE_WARPS][DDT_MERGE_UNROLL * 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = blockIdx.x;
    // Level 1: every warp selects from batches of 32 * DDT_MERGE_UNROLL candidates (all loads issued
    // before the first compare), candidate t = part t / k, entry t % k.
    {
        WarpSelect sel;
        sel.init(s_buf[warp], k, lane);
        const int total = P * k, batch = 32 * DDT_MERGE_UNROLL;
        for (int t0 = warp * batch; t0 < total; t0 += DDT_MERGE_WARPS * batch) {
            u64 c[DDT_MERGE_UNROLL];
#pragma unroll
            for (int u = 0; u < DDT_MERGE_UNROLL; ++u) {
                const int t = t0 + u * 32 + lane;
                const int p = t / k, i = t - p * k;
                c[u] = t < total ? in_keys[(parts_major ? ((size_t)p * rows + r) : ((size_t)r * P + p)) * k + i]
                                 : 0ull;
            }
            // stage through shared scratch so that only one copy of the select code is inlined
#pragma unroll
            for (int u = 0; u < DDT_MERGE_UNROLL; ++u) s_scr[warp][u * 32 + lane] = c[u];
            __syncwarp();
#pragma unroll 1
            for (int u = 0; u < DDT_MERGE_UNROLL; ++u) sel.push(s_scr[warp][u * 32 + lane], lane);
            __syncwarp();
        }
        sel.flush(lane);   // s_buf[warp][0, k) = this warp's top-k, zero-padded
    }
    __syncthreads();
    if (warp != 0) return;
    // Level 2: warp 0 merges the other warps' lists (shared memory) into its own.
    WarpSelect sel;
    sel.buf = s_buf[0]; sel.k = k; sel.cap = 64;
    while (sel.cap < k + 32) sel.cap <<= 1;
    sel.cnt = k; sel.thr = s_buf[0][k - 1];
    for (int w = 1; w < DDT_MERGE_WARPS; ++w)
        for (int i0 = 0; i0 < k; i0 += 32) {
            const int i = i0 + lane;
            sel.push(i < k ? s_buf[w][i] : 0ull, lane);
        }
    sel.flush(lane);
    float m = DDT_NEG_INF, s = 0.f;
    for (int p = lane; p < P; p += 32) {
        float2 ms = in_ms[parts_major ? ((size_t)p * rows + r) : ((size_t)r * P + p)];
        lse_combine(m, s, ms.x, ms.y);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_xor_sync(FULL_MASK, m, off), s2 = __shfl_xor_sync(FULL_MASK, s, off);
        lse_combine(m, s, m2, s2);
    }
    // A butterfly reduction leaves every lane with its own rounding of (m, s): use lane 0's on all
    // lanes, or log-probs of equal-ranked entries written by different lanes could be non-monotone.
    m = __shfl_sync(FULL_MASK, m, 0);
    s = __shfl_sync(FULL_MASK, s, 0);
    const float lse = m + logf(s);
    for (int i = lane; i < k; i += 32) {
        u64 key = s_buf[0][i];
        out_keys[(size_t)r * k + i] = key;
        out_lp[(size_t)r * k + i] = key ? key_value(key) - lse : DDT_NEG_INF;
        out_id[(size_t)r * k + i] = key ? key_id(key) : -1;
    }
    if (lane == 0) out_ms[r] = make_float2(m, s);
}

// ---------------------------------------------------------------------------------------------------
// Stage 3: the builder. One warp per stream. The frontier (the reference's heap) lives in shared
// memory; each pop is a warp argmax under the total order (score descending, then the rank-tuple key
// ascending). Every lane computes the same updates (warp-uniform control flow); lane 0 writes them.
// top_lp/top_id [S, D, K]. Outputs [S, R] with R = DDT_MAX_TREE_ROWS, mask [S, R, DDT_MASK_WORDS].
// Rows past n (n = node count): token = bonus, parent -1, depth 0, position = prefix, mask = {0, self}.
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ float score_add(float a, float b) {
    float r = __fadd_rn(a, b);
    // subnormal results flush to (signed) zero whether or not -ftz is on: the reference does the same
    if (fabsf(r) < 1.17549435e-38f) r = copysignf(0.0f, r);
    return r;
}
__device__ __forceinline__ float ftz_in(float a) {
    return fabsf(a) < 1.17549435e-38f ? copysignf(0.0f, a) : a;
}
__device__ __forceinline__ u64 tuple_digit(int depth, int rank) {
    return (u64)(rank + 1) << (8 * (DDT_MAX_DEPTH - depth));
}
// info word of a frontier entry: depth (4 bits) | rank (8) | parent row (8) | on-chain flag (1)
__device__ __forceinline__ int pack_info(int depth, int rank, int prow, int chain) {
    return depth | (rank << 4) | (prow << 12) | (chain << 20);
}

extern "C" __global__ void __launch_bounds__(32)
ddt_build_tree(const float* __restrict__ top_lp, const int* __restrict__ top_id, int D, int K,
               const int* __restrict__ budgets, const int* __restrict__ prefix_len,
               const int* __restrict__ bonus, int cap_k, int include_chain,
               int* __restrict__ tokens, int* __restrict__ parents, int* __restrict__ depths,
               int* __restrict__ positions, int* __restrict__ n_rows, uint32_t* __restrict__ mask) {
    __shared__ float s_lp[DDT_MAX_DEPTH * DDT_MAX_K];
#if DDT_FAST
    __shared__ int s_id[DDT_MAX_DEPTH * DDT_MAX_K];
#endif
    __shared__ float f_score[DDT_FRONTIER], f_pscore[DDT_FRONTIER];
    __shared__ u64 f_tup[DDT_FRONTIER];
    __shared__ int f_info[DDT_FRONTIER];
    __shared__ int t_tok[DDT_MAX_TREE_ROWS], t_par[DDT_MAX_TREE_ROWS], t_dep[DDT_MAX_TREE_ROWS];

    const int lane = threadIdx.x, st = blockIdx.x;
    const int R = DDT_MAX_TREE_ROWS;
    const int budget = min(max(budgets[st], 0), R - 1);
    const int kf = cap_k > 0 ? min(K, cap_k) : K;
    const float* lp = top_lp + (size_t)st * D * K;
    const int* ids = top_id + (size_t)st * D * K;
#if DDT_FAST
    for (int i = lane; i < D * K; i += 32) { s_lp[i] = ftz_in(lp[i]); s_id[i] = ids[i]; }
#define DDT_TOP_ID s_id
#else
    for (int i = lane; i < D * K; i += 32) s_lp[i] = ftz_in(lp[i]);
#define DDT_TOP_ID ids
#endif
    if (lane == 0) { t_tok[0] = bonus[st]; t_par[0] = -1; t_dep[0] = 0; }
    __syncwarp();

    // forced top-1 chain: rows 1..nc, row d = depth d
    const int nc = include_chain ? min(D, budget) : 0;
    for (int d = 1; d <= nc; ++d) {
        if (lane == 0) { t_tok[d] = DDT_TOP_ID[(d - 1) * K]; t_par[d] = d - 1; t_dep[d] = d; }
    }

    int nodes = nc, fsize = 0;
    if (budget > 0) {
        if (lane == 0) {
            f_score[0] = score_add(0.f, s_lp[0]); f_pscore[0] = 0.f;
            f_tup[0] = tuple_digit(1, 0); f_info[0] = pack_info(1, 0, 0, nc >= 1);
        }
        fsize = 1;
    }
    __syncwarp();
    while (fsize > 0 && nodes < budget) {
        // warp argmax over the frontier under the total order: each lane's best, then the warp's (a
        // butterfly; DDT_FAST: three reductions: max ordered score, then min tuple high, low word).
        int bi = -1; float bs = 0.f; u64 bt = 0ull;
        for (int i = lane; i < fsize; i += 32) {
            float sc = f_score[i]; u64 tp = f_tup[i];
            if (bi < 0 || sc > bs || (sc == bs && tp < bt)) { bi = i; bs = sc; bt = tp; }
        }
#if DDT_FAST
        const uint32_t os = bi >= 0 ? f32_to_ordered(bs) : 0u;   // 0 is below every real score
        const uint32_t ms = __reduce_max_sync(FULL_MASK, os);
        const bool c1 = bi >= 0 && os == ms;
        const uint32_t th = c1 ? (uint32_t)(bt >> 32) : 0xffffffffu;
        const uint32_t mh = __reduce_min_sync(FULL_MASK, th);
        const bool c2 = c1 && th == mh;
        const uint32_t tl = c2 ? (uint32_t)bt : 0xffffffffu;
        const uint32_t ml = __reduce_min_sync(FULL_MASK, tl);
        const unsigned who = __ballot_sync(FULL_MASK, c2 && tl == ml);   // exactly one: tuples are unique
        bi = __shfl_sync(FULL_MASK, bi, __ffs(who) - 1);
        bs = f_score[bi];     // exact bits (the ordered form folds -0 into +0)
        bt = ((u64)mh << 32) | ml;
#else
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            int oi = __shfl_xor_sync(FULL_MASK, bi, off);
            float os = __shfl_xor_sync(FULL_MASK, bs, off);
            u64 ot = __shfl_xor_sync(FULL_MASK, bt, off);
            if (oi >= 0 && (bi < 0 || os > bs || (os == bs && ot < bt))) { bi = oi; bs = os; bt = ot; }
        }
#endif
        const float psc = f_pscore[bi];
        const int info = f_info[bi];
        const int depth = info & 15, rank = (info >> 4) & 255, prow = (info >> 12) & 255;
        const int chain = (info >> 20) & 1;
        int row;
        if (chain) {
            row = depth;                          // already emitted by the chain prologue
        } else {
            row = ++nodes;
            if (lane == 0) { t_tok[row] = DDT_TOP_ID[(depth - 1) * K + rank]; t_par[row] = prow; t_dep[row] = depth; }
        }
        __syncwarp();   // every lane has read entry bi before lane 0 overwrites it
        if (rank + 1 < kf) {   // next sibling takes the popped slot
            if (lane == 0) {
                f_score[bi] = score_add(psc, s_lp[(depth - 1) * K + rank + 1]);
                f_pscore[bi] = psc;
                f_tup[bi] = bt + tuple_digit(depth, 0);   // rank digit + 1
                f_info[bi] = pack_info(depth, rank + 1, prow, 0);
            }
        } else {               // no sibling: the last entry fills the hole
            --fsize;
            if (lane == 0 && bi != fsize) {
                f_score[bi] = f_score[fsize]; f_pscore[bi] = f_pscore[fsize];
                f_tup[bi] = f_tup[fsize]; f_info[bi] = f_info[fsize];
            }
        }
        if (depth < D) {       // first child
            if (lane == 0) {
                f_score[fsize] = score_add(bs, s_lp[depth * K]);
                f_pscore[fsize] = bs;
                f_tup[fsize] = bt + tuple_digit(depth + 1, 0);
                f_info[fsize] = pack_info(depth + 1, 0, row, chain && depth + 1 <= nc);
            }
            ++fsize;
        }
        __syncwarp();
    }

    // write the tree rows (coalesced), then the ancestor masks word by word
    const int n = nodes;
    const int pre = prefix_len[st];
    const size_t o = (size_t)st * R;
    for (int i = lane; i < R; i += 32) {
        bool real = i <= n;
        int dep = real ? t_dep[i] : 0;
        tokens[o + i] = real ? t_tok[i] : t_tok[0];
        parents[o + i] = real ? t_par[i] : -1;
        depths[o + i] = dep;
        positions[o + i] = pre + dep;
    }
    for (int e = lane; e < R * DDT_MASK_WORDS; e += 32) {
        const int i = e / DDT_MASK_WORDS, w = e % DDT_MASK_WORDS;
        uint32_t word = 0;
        if (i <= n) {
            for (int a = i; a >= 0; a = t_par[a])   // self, parent, ..., root (depth <= 8 steps)
                if ((a >> 5) == w) word |= 1u << (a & 31);
        } else {
            if (w == 0) word |= 1u;
            if ((i >> 5) == w) word |= 1u << (i & 31);
        }
        mask[o * DDT_MASK_WORDS + e] = word;
    }
    if (lane == 0) n_rows[st] = n + 1;
}

// ---------------------------------------------------------------------------------------------------
// Stage 4: walk + commit, one warp per stream. post [S, R]: the target's token at every tree row
// (argmax for greedy, a sample otherwise). From the root follow the child (lowest row if several)
// whose token equals post[current]. Outputs ([S, A] padded with -1, A = max accepted = D + 1):
//   acc_rows, kv_src = prefix + row(j), kv_dst = prefix + j (copy in j order), feat_rows =
//   row_offset[s] + row(j) (the accepted rows in the verify batch, for the drafter's context),
//   out_tokens [S, A + 1] = accepted tokens then the new bonus, n_acc, new_len, new_bonus.
// upd_len / upd_bonus (may be null, may alias prefix_len / bonus): the stream state updated in place.
// ---------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(32)
ddt_walk_commit(const int* __restrict__ tokens, const int* __restrict__ parents,
                const int* __restrict__ n_rows, const int* __restrict__ post, const int* prefix_len,
                const int* __restrict__ row_offset, int A,
                int* __restrict__ acc_rows, int* __restrict__ n_acc, int* __restrict__ kv_src,
                int* __restrict__ kv_dst, int* __restrict__ feat_rows, int* __restrict__ out_tokens,
                int* __restrict__ new_len, int* __restrict__ new_bonus, int* upd_len, int* upd_bonus) {
    __shared__ int s_rows[DDT_MAX_DEPTH + 2];
    const int lane = threadIdx.x, st = blockIdx.x;
    const int R = DDT_MAX_TREE_ROWS;
    const int* tok = tokens + (size_t)st * R;
    const int* par = parents + (size_t)st * R;
    const int* pst = post + (size_t)st * R;
    const int n = min(max(n_rows[st], 1), R);
    const int pre = prefix_len[st];
    int cur = 0, a = 1;
    if (lane == 0) s_rows[0] = 0;
    while (a < A) {
        const int want = pst[cur];
        int found = -1;
        for (int base = cur + 1; base < n && found < 0; base += 32) {
            const int c = base + lane;
            unsigned m = __ballot_sync(FULL_MASK, c < n && par[c] == cur && tok[c] == want);
            if (m) found = base + __ffs(m) - 1;
        }
        if (found < 0) break;
        cur = found;
        if (lane == 0) s_rows[a] = cur;
        ++a;
    }
    __syncwarp();
    const int bonus_tok = pst[cur];
    const int roff = row_offset[st];
    for (int j = lane; j < A; j += 32) {
        const bool in = j < a;
        const int r = in ? s_rows[j] : -1;
        acc_rows[(size_t)st * A + j] = r;
        kv_src[(size_t)st * A + j] = in ? pre + r : -1;
        kv_dst[(size_t)st * A + j] = in ? pre + j : -1;
        feat_rows[(size_t)st * A + j] = in ? roff + r : -1;
    }
    for (int j = lane; j <= A; j += 32)
        out_tokens[(size_t)st * (A + 1) + j] = j < a ? tok[s_rows[j]] : (j == a ? bonus_tok : -1);
    __syncwarp();   // all lanes have read prefix_len before it may be overwritten
    if (lane == 0) {
        n_acc[st] = a;
        new_len[st] = pre + a;
        new_bonus[st] = bonus_tok;
        if (upd_len) upd_len[st] = pre + a;
        if (upd_bonus) upd_bonus[st] = bonus_tok;
    }
}
