// DDTree on the GPU: per-depth top-K, best-first tree builder, acceptance walk + commit.
// The specification is ddtree_cupy/reference/ddtree.py; every kernel here reproduces it exactly
// (top-K ids, tree rows, mask, walk, commit indices); only the log-sum-exp is float32 with its own
// summation order. One launch per stage covers all streams; per-stream values (budget, prefix length,
// bonus token) are read on the device, sizes are fixed, so the whole step can be captured in a graph.
// PDL: every kernel calls DDT_PDL_WAIT() before its first global read or write, so the spec may be
// launched with programmatic dependent launch.
#include "common.cuh"
#include "radix_select.cuh"

#define DDT_MAX_K 128          // top-K width supported (budget <= 128)
#define DDT_WALK_SLOTS ((DDT_MAX_TREE_ROWS + 31) / 32)   // tree rows per lane in the register walk
#define DDT_MAX_DEPTH 8        // rank-tuple key: 8 bits per depth in 64 bits
#define DDT_TOPK_THREADS 256   // threads per block of both top-K kernels
#define DDT_TOPK_VECS 4        // 8-logit vectors per thread: a chunk of <= 256 * 8 * 4 = 8192 in registers
#define DDT_SORT_CAP 256       // the merge's final sort: one warp, 8 keys per lane
#define DDT_FRONTIER (DDT_MAX_TREE_ROWS + DDT_MAX_DEPTH + 8)  // heap entries: pops + 1 <= budget + D + 1
// One module; the top-K comes in two kinds, a template parameter of its kernels (SCAN), both exact:
// scan (ddt_topk_partial<T, true>, ddt_topk_merge<true>; the engine's): a streaming top-K (stage 1 only reads:
//   per thread max, exp-sum, its largest key; the merge finds the bound from those maxima and re-reads the
//   few 32-logit groups that can hold the row's top-k, "Stage 2, scan kind" below) whose merge keeps each
//   thread's group keys in registers and places selected groups and candidates by block scans
//   (merge_scan_regs; rows of more than DDT_MREG chunks take merge_scan), the output placed by rank; the
//   shards' exact lists (parts_major) take this merge too.
// list (ddt_topk_partial<T, false>, ddt_topk_merge<false>): per-chunk candidate lists and a merge whose
//   final sort is sized to k, which the engine launches for small shapes (kernels/ddtree.py topk_kind:
//   <= 7 rows, k <= 8).
// The builder pops from a sorted 32-entry cache for budgets <= DDT_CACHE_BUDGET ("Builder, sorted cache",
// one info word stored per pop; larger budgets run builder v3's loop: only the frontier's ordered scores in
// registers, the popped position warp-uniform); the walk reads the tree and post tokens from registers.
// The designs measured and removed are in docs/history/2026-11-29-ddtree.md and 2026-12-02-ddtree.md.
typedef unsigned long long u64;
#define DDT_NEG_INF (__int_as_float(0xff800000))   // NVRTC has no <math.h> INFINITY
#define FULL_MASK 0xffffffffu

// ---------------------------------------------------------------------------------------------------
// a read of stage 1's output by the merge (a plain load: the merge starts after the whole stage-1 grid)
template <typename T>
__device__ __forceinline__ T ld_s1(const T* p) {
    return *p;
}

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

// Candidate list of one chunk (stage-1 output, k >= 2): [L, n, key_0 .. key_{n-1}] in a row of
// 2 + cand_cap(k) uint64 slots. L is a lower bound of the chunk's k-th largest key (0: none) and the keys
// are ALL the chunk's keys >= L, unsorted. For k == 1 the row is one slot: the chunk's largest key.
// kernels/ddtree.py (cand_cap, part_width) mirrors these two functions.
__device__ __forceinline__ int cand_cap(int k) { return k <= 32 ? 64 : (k <= 64 ? 128 : 256); }
__device__ __forceinline__ int part_width(int k) { return k == 1 ? 1 : 2 + cand_cap(k); }
// Scan kind, k >= 2: a row of 3 + 256 slots per chunk: [logits row address | 1 if bf16,
// V_local | id_offset << 32, chunk, then the 256 threads' largest keys (group g = thread g's 32 logits:
// its 4 vectors of 8 at (u * 256 + g) * 8; 0 = a group with no logit in range)]. The header lets the merge
// re-read logits without new launch arguments (the merge's signature is shared with the engine's CPU
// emulation of these kernels); it is rewritten on every launch, so a CUDA graph stays valid.
// kernels/ddtree.py (scan_width) mirrors it.
#define DDT_SCAN_HDR 3
__device__ __forceinline__ int scan_width(int k) { return k == 1 ? 1 : DDT_SCAN_HDR + DDT_TOPK_THREADS; }

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

// Sort the first `cnt` keys of buf (cnt <= 32 * E) descending in registers of one warp and hand element
// i = e * 32 + lane back in r[e] (0 past cnt).
template <int E, int LOG2N>
__device__ __forceinline__ void warp_sort_load(const u64* buf, int cnt, int lane, u64 (&r)[8]) {
    u64 t[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int i = (e << 5) + lane;
        t[e] = i < cnt ? buf[i] : 0ull;
    }
    warp_sort_regs<E, LOG2N>(t, lane);
#pragma unroll
    for (int e = 0; e < 8; ++e) r[e] = e < E ? t[e] : 0ull;
}

__device__ __forceinline__ void lse_combine(float& m, float& s, float m2, float s2) {
    float mm = fmaxf(m, m2);
    if (mm == DDT_NEG_INF) return;   // both empty
    s = s * __expf(m - mm) + s2 * __expf(m2 - mm);
    m = mm;
}

// A thread's 4 vectors of 8 logits, kept in registers in the input's own format (bf16 stays packed: half
// the registers), read back as float32 by at(u, i).
template <typename T> struct ChunkRegs;
template <> struct ChunkRegs<float> {
    float4 a[DDT_TOPK_VECS][2];
    __device__ __forceinline__ void load(const float* p, int u) {
        a[u][0] = *reinterpret_cast<const float4*>(p);
        a[u][1] = *reinterpret_cast<const float4*>(p + 4);
    }
    __device__ __forceinline__ void clear(int u) {
        a[u][0] = a[u][1] = make_float4(DDT_NEG_INF, DDT_NEG_INF, DDT_NEG_INF, DDT_NEG_INF);
    }
    __device__ __forceinline__ float at(int u, int i) const {
        const float4& q = a[u][i >> 2];
        const int j = i & 3;
        return j == 0 ? q.x : (j == 1 ? q.y : (j == 2 ? q.z : q.w));
    }
};
template <> struct ChunkRegs<bf16_bits> {
    uint4 a[DDT_TOPK_VECS];
    __device__ __forceinline__ void load(const bf16_bits* p, int u) { a[u] = *reinterpret_cast<const uint4*>(p); }
    __device__ __forceinline__ void clear(int u) { a[u] = make_uint4(0xff80ff80u, 0xff80ff80u, 0xff80ff80u, 0xff80ff80u); }
    __device__ __forceinline__ float at(int u, int i) const {
        const int j = i >> 1;
        const uint32_t w = j == 0 ? a[u].x : (j == 1 ? a[u].y : (j == 2 ? a[u].z : a[u].w));
        return __uint_as_float((i & 1) ? (w & 0xffff0000u) : (w << 16));
    }
};


// ---------------------------------------------------------------------------------------------------
// Stage 1: per (row, chunk): the chunk's log-sum-exp partial (max, sum exp(x - max)) and its candidate
// list (see cand_cap). Grid (P, rows), 256 threads; the chunk (<= 8192 logits, a multiple of 2048) is
// held in registers, 8 consecutive logits per thread and vector. Global id = id_offset + local index.
// The bound L: the k-th largest of the 256 per-thread maximum keys (k <= 256 distinct chunk elements are
// >= it, so the chunk's k-th largest key is too). Each warp sorts its 32 maxima; a maximum's rank among
// all 256 is its lane plus binary searches in the other warps' lists. About k * 1.2-1.4 keys pass L on
// random logits; if more than cand_cap(k) pass (long runs of equal logits), an exact radix select over
// the chunk's keys (8 passes of 8 bits) sets L to the k-th largest key itself, and exactly k pass.
// part_keys [rows, P, part_width(k)], part_ms [rows, P] (float2). SCAN (the scan kind): the same loads,
// lse partial and thread keys, then the 256 group keys and a header instead of the list (scan_width).
// ---------------------------------------------------------------------------------------------------
template <typename T, bool SCAN>
__device__ __forceinline__ void topk_partial(const T* __restrict__ logits, int rows, int V_local, int id_offset,
                                             int k, int chunk, u64* __restrict__ part_keys,
                                             float2* __restrict__ part_ms) {
    __shared__ u64 s_top[DDT_TOPK_THREADS / 32][32];
    __shared__ u64 s_cand[DDT_SORT_CAP];
    __shared__ unsigned s_hist[256];
    __shared__ float2 s_ms[DDT_TOPK_THREADS / 32];
    __shared__ u64 s_L;
    __shared__ int s_n, s_digit;
    __shared__ unsigned s_above, s_bin;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int P = (V_local + chunk - 1) / chunk;
    const int c = blockIdx.x, r = blockIdx.y;
    const int beg = c * chunk, n = min(chunk, V_local - beg);
    const int nv = chunk / (DDT_TOPK_THREADS * 8);
    const uint32_t id0 = (uint32_t)(id_offset + beg);
    const T* x = logits + (size_t)r * V_local + beg;
    DDT_PDL_WAIT();   // the logits come from the previous kernel

    // every load is issued before any use: 16-32 KB per block in flight
    ChunkRegs<T> v;
    bool ok[DDT_TOPK_VECS];
#pragma unroll
    for (int u = 0; u < DDT_TOPK_VECS; ++u) {
        const int i0 = (u * DDT_TOPK_THREADS + tid) * 8;
        ok[u] = u < nv && i0 < n;   // V_local % 8 == 0 (checked by the wrapper): a vector is all in or out
        if (ok[u]) v.load(x + i0, u);
        else v.clear(u);
    }
    float vm[DDT_TOPK_VECS], tm = DDT_NEG_INF;
#pragma unroll
    for (int u = 0; u < DDT_TOPK_VECS; ++u) {
        float a = v.at(u, 0);
#pragma unroll
        for (int i = 1; i < 8; ++i) a = fmaxf(a, v.at(u, i));
        vm[u] = a;
        tm = fmaxf(tm, a);
    }
    // log-sum-exp partial: the thread's values are all in registers, so one max then one exp-sum
    float ts = 0.f;
    if (tm != DDT_NEG_INF) {
#pragma unroll
        for (int u = 0; u < DDT_TOPK_VECS; ++u)
            if (ok[u]) {
#pragma unroll
                for (int i = 0; i < 8; ++i) ts += __expf(v.at(u, i) - tm);
            }
    }
    // the thread's largest key: its maximum at the lowest index holding it
    u64 tk = 0ull;
    // the scan kind's group key is nonzero for every group with a logit in range, -inf included (the
    // merge re-reads only groups with nonzero keys, and a row may need -inf entries to fill its top-k);
    // k == 1 keeps the list kind's key (0 when the thread's maximum is -inf)
    u64 tk_any = 0ull;
    if constexpr (SCAN) {
        int bi = -1;
#pragma unroll
        for (int u = DDT_TOPK_VECS - 1; u >= 0; --u)
#pragma unroll
            for (int i = 7; i >= 0; --i)
                if (ok[u] && v.at(u, i) == tm) bi = (u * DDT_TOPK_THREADS + tid) * 8 + i;
        if (bi >= 0) tk_any = make_key(tm, id0 + (uint32_t)bi);
        tk = tm != DDT_NEG_INF ? tk_any : 0ull;
    } else if (tm != DDT_NEG_INF) {
        int bi = 0;
#pragma unroll
        for (int u = DDT_TOPK_VECS - 1; u >= 0; --u)
#pragma unroll
            for (int i = 7; i >= 0; --i)
                if (ok[u] && v.at(u, i) == tm) bi = (u * DDT_TOPK_THREADS + tid) * 8 + i;
        tk = make_key(tm, id0 + (uint32_t)bi);
    }
    {
        float m = tm, s = ts;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            float m2 = __shfl_xor_sync(FULL_MASK, m, off), s2 = __shfl_xor_sync(FULL_MASK, s, off);
            lse_combine(m, s, m2, s2);
        }
        if (lane == 0) s_ms[warp] = make_float2(m, s);
    }
    const size_t slot = (size_t)r * P + c;
    if (k == 1) {   // the chunk's largest key is the whole candidate list
        u64 b = tk;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const u64 o = __shfl_xor_sync(FULL_MASK, b, off);
            b = o > b ? o : b;
        }
        if (lane == 0) s_top[warp][0] = b;
        __syncthreads();
        if (tid == 0) {
            float m = DDT_NEG_INF, s = 0.f;
            for (int w = 0; w < DDT_TOPK_THREADS / 32; ++w) {
                lse_combine(m, s, s_ms[w].x, s_ms[w].y);
                b = s_top[w][0] > b ? s_top[w][0] : b;
            }
            part_keys[slot] = b;
            part_ms[slot] = make_float2(m, s);
        }
        return;
    }
    if constexpr (SCAN) {   // the 256 group keys and the header; the chunk's (m, s) combined as below
        u64* out = part_keys + slot * (size_t)scan_width(k);
        out[DDT_SCAN_HDR + tid] = tk_any;
        if (tid == 0) {
            out[0] = (u64)(size_t)(logits + (size_t)r * V_local) | (sizeof(T) == 2 ? 1ull : 0ull);
            out[1] = (u64)(uint32_t)V_local | ((u64)(uint32_t)id_offset << 32);
            out[2] = (u64)(uint32_t)chunk;
        }
        __syncthreads();   // s_ms written by every warp
        if (tid == 0) {   // the same serial combine as the list kind: bit-identical log-probs
            float m = DDT_NEG_INF, s = 0.f;
            for (int w = 0; w < DDT_TOPK_THREADS / 32; ++w) lse_combine(m, s, s_ms[w].x, s_ms[w].y);
            part_ms[slot] = make_float2(m, s);
        }
        return;
    }

    u64 sk[1] = {tk};
    warp_sort_regs<1, 5>(sk, lane);
    s_top[warp][lane] = sk[0];
    if (tid == 0) { s_L = 0ull; s_n = 0; }
    __syncthreads();
    if (sk[0] != 0ull) {   // rank of this maximum among all 256 (keys are unique)
        int rank = lane;
#pragma unroll
        for (int w = 0; w < DDT_TOPK_THREADS / 32; ++w) {
            if (w == warp) continue;
            const u64* l = s_top[w];
            int pos = 0;   // entries of l (sorted descending) greater than sk
#pragma unroll
            for (int step = 32; step > 0; step >>= 1)
                if (pos + step <= 32 && l[pos + step - 1] > sk[0]) pos += step;
            rank += pos;
        }
        if (rank == k - 1) s_L = sk[0];
    }
    __syncthreads();
    const int cap = cand_cap(k);
    u64 L = s_L;
    // gather every key >= L (a vector is only looked at when its maximum's value reaches L's)
    auto gather = [&](u64 thr) {
        const uint32_t tv = (uint32_t)(thr >> 32);
#pragma unroll
        for (int u = 0; u < DDT_TOPK_VECS; ++u) {
            if (!ok[u] || f32_to_ordered(vm[u]) < tv) continue;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const u64 key = make_key(v.at(u, i), id0 + (uint32_t)((u * DDT_TOPK_THREADS + tid) * 8 + i));
                if (key >= thr) {
                    const int p = atomicAdd(&s_n, 1);
                    if (p < cap) s_cand[p] = key;
                }
            }
        }
    };
    gather(L);
    __syncthreads();
    int nc = s_n;
    if (nc > cap) {
        // exact k-th largest key of the chunk (nc > cap >= k, so the chunk has more than k keys)
        L = radix_select<false>((unsigned)k, 0u, s_hist, &s_digit, &s_above, &s_bin, tid, lane, warp,
                                [&](u64 hmask, u64 prefix, int shift) {
#pragma unroll
            for (int u = 0; u < DDT_TOPK_VECS; ++u) {
                if (!ok[u]) continue;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const u64 key = make_key(v.at(u, i), id0 + (uint32_t)((u * DDT_TOPK_THREADS + tid) * 8 + i));
                    if ((key & hmask) == prefix) atomicAdd(&s_hist[(key >> shift) & 255], 1u);
                }
            }
        });
        if (tid == 0) s_n = 0;
        __syncthreads();
        gather(L);
        __syncthreads();
        nc = s_n;   // == k
    }
    u64* out = part_keys + slot * part_width(k);
    for (int i = tid; i < nc; i += DDT_TOPK_THREADS) out[2 + i] = s_cand[i];
    if (tid == 0) {
        out[0] = L;
        out[1] = (u64)nc;
        float m = DDT_NEG_INF, s = 0.f;
        for (int w = 0; w < DDT_TOPK_THREADS / 32; ++w) lse_combine(m, s, s_ms[w].x, s_ms[w].y);
        part_ms[slot] = make_float2(m, s);
    }
}

// The stage-1 kernels: ddt_topk_partial<float | bf16_bits, SCAN>. Minimum blocks per SM: the scan kind keeps
// only its 32 logits in registers after the loads (4), the list kind keeps them for the gather (2).
template <typename T, bool SCAN>
__global__ void __launch_bounds__(DDT_TOPK_THREADS, SCAN ? 4 : 2)
ddt_topk_partial(const T* logits, int rows, int V_local, int id_offset, int k, int chunk, u64* part_keys,
                 float2* part_ms) {
    topk_partial<T, SCAN>(logits, rows, V_local, id_offset, k, chunk, part_keys, part_ms);
}

// ---------------------------------------------------------------------------------------------------
// Stage 2: the row's top-k, one block per row. Three input layouts:
//   candidate lists (parts_major = 0, k >= 2, the list kind): keys [rows, P, part_width(k)], stage 1's
//   output; group keys (parts_major = 0, k >= 2, the scan kind): keys [rows, P, scan_width(k)] (see the
//   scan section below); exact lists (parts_major = 1, or k == 1): keys [P, rows, k] (an all-gather of shards'
//   merged top-k, sorted, zero-padded) or [rows, P, 1]; there L = the list's k-th key (0 if it has fewer).
// ms [rows, P] / [P, rows] (float2). A list holds every key of its part >= its L, so the row's k-th largest
// key is >= L_row = max L, and the row's top-k is among the listed keys >= L_row (gathered into shared
// memory). A radix select (8-bit digits from the top) narrows them until at most DDT_SORT_CAP keys >= a
// threshold remain that include the k largest; one warp sorts those in registers.
// Outputs: out_keys [rows, k], out_ms [rows] (to merge again across shards), out_lp [rows, k] =
// value - (M + log S), out_id [rows, k] (-1 / -inf where the row has fewer than k candidates).
// Dynamic shared memory: P * list capacity * 8 + P * 4 bytes (the wrapper computes it; the scan layout's
// is in merge_scan).
// ---------------------------------------------------------------------------------------------------
struct MergeShared {
    u64 sel[DDT_SORT_CAP];
    unsigned hist[256];
    u64 red[DDT_TOPK_THREADS / 32];
    unsigned wa[DDT_TOPK_THREADS / 32], wb[DDT_TOPK_THREADS / 32], wc[DDT_TOPK_THREADS / 32],
             wd[DDT_TOPK_THREADS / 32];   // per-warp partials of merge_scan_regs (one array per phase)
    int n, digit, ng, nz;
    unsigned above, bin, top, near;
    float m, s;
};

// The row's log-sum-exp from its P partials, run by one warp; lane 0's (m, s) is stored (a butterfly
// leaves lane-dependent roundings; one value serves every log-prob of the row).
__device__ __forceinline__ void row_lse(const float2* in_ms, int rows, int r, int P, int parts_major, int lane,
                                        MergeShared& sh) {
    float m = DDT_NEG_INF, s = 0.f;
    for (int p = lane; p < P; p += 32) {
        const float2 ms = ld_s1(&in_ms[parts_major ? ((size_t)p * rows + r) : ((size_t)r * P + p)]);
        lse_combine(m, s, ms.x, ms.y);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_xor_sync(FULL_MASK, m, off), s2 = __shfl_xor_sync(FULL_MASK, s, off);
        lse_combine(m, s, m2, s2);
    }
    if (lane == 0) { sh.m = m; sh.s = s; }
}

// The row's outputs from ns <= 256 selected keys (unique, nonzero, in any order) that include its k largest:
// thread t places key t at its rank (keys greater than it), all warps at once: ns broadcast reads per thread
// instead of one warp's dependent bitonic network. Starts after a barrier that made sel visible.
__device__ __forceinline__ void rank_out(const u64* sel, int ns, int k, int r, int tid, const MergeShared& sh,
                                         u64* __restrict__ out_keys, float2* __restrict__ out_ms,
                                         float* __restrict__ out_lp, int* __restrict__ out_id) {
    const float lse = sh.m + logf(sh.s);
    if (tid < ns) {
        const u64 key = sel[tid];
        int rank = 0;
#pragma unroll 4
        for (int j = 0; j < ns; ++j) rank += sel[j] > key ? 1 : 0;
        if (rank < k) {
            out_keys[(size_t)r * k + rank] = key;
            out_lp[(size_t)r * k + rank] = key_value(key) - lse;
            out_id[(size_t)r * k + rank] = key_id(key);
        }
    }
    for (int i = ns + tid; i < k; i += DDT_TOPK_THREADS) {   // a row with fewer than k candidates
        out_keys[(size_t)r * k + i] = 0ull;
        out_lp[(size_t)r * k + i] = DDT_NEG_INF;
        out_id[(size_t)r * k + i] = -1;
    }
    if (tid == 0) out_ms[r] = make_float2(sh.m, sh.s);
}

// The N keys of s_keys (unique, nonzero) hold the row's top-k: narrow them to a threshold with at most
// scap keys above it that include the k largest, sort those with one warp, write the row's outputs.
// Starts after a barrier that made s_keys, N and sh.m / sh.s visible. BY_RANK (the scan kind's merge): the
// outputs placed by rank_out from up to DDT_SORT_CAP keys; else (the list kind's) a one-warp sort sized to k.
template <bool BY_RANK>
__device__ __forceinline__ void merge_finish(const u64* s_keys, int N, int k, int r, int tid, int lane, int warp,
                                             MergeShared& sh, u64* __restrict__ out_keys, float2* __restrict__ out_ms,
                                             float* __restrict__ out_lp, int* __restrict__ out_id) {
    // threshold: keys >= thr number at most scap (<= DDT_SORT_CAP) and include the k largest. The sort
    // narrows to a size fitted to k (the sort is one warp's dependent chain: 36 bitonic stages for 256
    // keys, 28 for 128, 21 for 64); a radix pass more may be needed to get there. Placed by rank, the
    // selection's size costs little.
    const unsigned scap = BY_RANK ? (unsigned)DDT_SORT_CAP
                                  : (k <= 32 ? 64u : (k <= 64 ? 128u : (unsigned)DDT_SORT_CAP));
    u64 thr = 0ull;
    if ((unsigned)N > scap)   // k <= scap: it stops at shift 0 at the latest
        thr = radix_select<true>((unsigned)k, scap, sh.hist, &sh.digit, &sh.above, &sh.bin, tid, lane, warp,
                                 [&](u64 hmask, u64 prefix, int shift) {
            for (int i = tid; i < N; i += DDT_TOPK_THREADS) {
                const u64 key = s_keys[i];
                if ((key & hmask) == prefix) atomicAdd(&sh.hist[(key >> shift) & 255], 1u);
            }
        });
    // by rank, no narrowing needed (uniform): the N keys themselves are the selection (rank_out needs only
    // the set), so the copy into sh.sel and its two barriers are skipped
    const bool direct = BY_RANK && (unsigned)N <= scap;
    if (!direct) {
        if (tid == 0) sh.n = 0;
        __syncthreads();
        for (int i = tid; i < N; i += DDT_TOPK_THREADS) {
            const u64 key = s_keys[i];
            if (key >= thr) sh.sel[atomicAdd(&sh.n, 1)] = key;
        }
        __syncthreads();
    }
    if constexpr (BY_RANK) {
        rank_out(direct ? s_keys : sh.sel, direct ? N : sh.n, k, r, tid, sh, out_keys, out_ms, out_lp, out_id);
        return;
    }
    if (warp != 0) return;
    const int ns = sh.n;
    u64 top[8];
    if (ns <= 32) warp_sort_load<1, 5>(sh.sel, ns, lane, top);
    else if (ns <= 64) warp_sort_load<2, 6>(sh.sel, ns, lane, top);
    else if (ns <= 128) warp_sort_load<4, 7>(sh.sel, ns, lane, top);
    else warp_sort_load<8, 8>(sh.sel, ns, lane, top);
    const float lse = sh.m + logf(sh.s);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int i = (e << 5) + lane;
        if (i < k) {
            const u64 key = top[e];
            out_keys[(size_t)r * k + i] = key;
            out_lp[(size_t)r * k + i] = key ? key_value(key) - lse : DDT_NEG_INF;
            out_id[(size_t)r * k + i] = key ? key_id(key) : -1;
        }
    }
    if (lane == 0) out_ms[r] = make_float2(sh.m, sh.s);
}

// ---------------------------------------------------------------------------------------------------
// Stage 2, scan kind (k >= 2, stage-1 group keys). Group g of the row (chunk g / 256, thread g % 256)
// holds 32 logits; its key is its largest element's key. With thr <= the k-th largest group key, at least
// k distinct elements are >= thr, so the row's k-th largest element key K_k >= thr; every element key >= K_k
// lies in a group whose key is >= it, hence >= thr. So the top-k is among the elements >= thr of the groups
// whose key is >= thr: a radix narrowing of the G = 256 P group keys (8-bit digits from the top) stops at
// the first threshold with k <= (groups >= thr) <= gcap(k) (= cand_cap(k)), those groups' 32 logits are
// re-read (from L2: stage 1 read them just before) and every element key >= thr is a candidate (at most
// 32 gcap(k); on random logits about k + a few). merge_finish does the rest.
// Dynamic shared memory: max(G, 32 gcap(k)) keys (the group keys, then the candidates in the same place)
// + gcap(k) ints (the selected groups): scan_merge_smem in kernels/ddtree.py.
// ---------------------------------------------------------------------------------------------------
// every lane of the warp calls it: the lanes with `take` store their value at consecutive slots of out
template <typename V>
__device__ __forceinline__ void warp_append(bool take, V val, V* out, int* counter, int lane) {
    const unsigned b = __ballot_sync(FULL_MASK, take);
    if (b == 0u) return;
    const int leader = __ffs(b) - 1;
    int base = 0;
    if (lane == leader) base = atomicAdd(counter, __popc(b));
    base = __shfl_sync(FULL_MASK, base, leader);
    if (take) out[base + __popc(b & ((1u << lane) - 1u))] = val;
}

// The selected groups' logits into registers (all loads issued before any use): item j = t * 256 + tid
// (< ng * nv, nv vectors per group) is vector u = j % nv of group s_gl[j / nv]; ok[t]: slot t holds a vector
// inside the row, base[t] its first logit's index. Returns the item count.
template <typename T>
__device__ __forceinline__ int load_groups(const T* xrow, int V_local, int chunk, const int* s_gl, int ng, int tid,
                                           ChunkRegs<T>& v, bool (&ok)[DDT_TOPK_VECS], int (&base)[DDT_TOPK_VECS]) {
    const int nv = chunk / (DDT_TOPK_THREADS * 8);
    const int items = ng * nv;
#pragma unroll
    for (int t = 0; t < DDT_TOPK_VECS; ++t) {
        const int j = t * DDT_TOPK_THREADS + tid;
        ok[t] = false;
        base[t] = 0;
        if (j < items) {
            const int q = j / nv, u = j - q * nv, g = s_gl[q];
            const int i = (g >> 8) * chunk + (u * DDT_TOPK_THREADS + (g & 255)) * 8;
            if (i < V_local) { ok[t] = true; base[t] = i; }
        }
        if (ok[t]) v.load(xrow + base[t], t);
        else v.clear(t);
    }
    return items;
}

// the selected groups' logits -> every element key >= thr appended to out (4 vectors per thread at most:
// ng * nv <= gcap * 4 <= 1024 items, all loads issued before any use)
template <typename T>
__device__ __forceinline__ void scan_gather(const T* xrow, int V_local, uint32_t id_offset, int chunk,
                                            const int* s_gl, int ng, u64 thr, u64* out, int* counter,
                                            int tid, int lane) {
    ChunkRegs<T> v;
    bool ok[DDT_TOPK_VECS];
    int base[DDT_TOPK_VECS];
    const int items = load_groups<T>(xrow, V_local, chunk, s_gl, ng, tid, v, ok, base);
#pragma unroll
    for (int t = 0; t < DDT_TOPK_VECS; ++t) {
        if (t * DDT_TOPK_THREADS >= items) break;   // uniform
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const u64 key = ok[t] ? make_key(v.at(t, e), id_offset + (uint32_t)(base[t] + e)) : 0ull;
            warp_append<u64>(key >= thr, key, out, counter, lane);
        }
    }
}

__device__ __forceinline__ int scan_gcap(int k) { return cand_cap(k); }

// The radix narrowing over the G group keys in s_keys (0 = an empty group, never counted), exact for any
// input: the first threshold with at most gcap groups >= it (k <= gcap: at shift 0 at the latest, where the
// bin is one key, nonzero keys being unique). The first digits put most keys in one bin (one exponent), so
// the histogram takes one atomic per warp and bin, not per key. The keys are read after its first barrier.
__device__ __forceinline__ u64 groups_radix_thr(const u64* s_keys, int G, int k, int gcap, int tid, int lane,
                                                int warp, MergeShared& sh) {
    return radix_select<true>((unsigned)k, (unsigned)gcap, sh.hist, &sh.digit, &sh.above, &sh.bin, tid, lane, warp,
                              [&](u64 hmask, u64 prefix, int shift) {
        for (int i = tid; i < G; i += DDT_TOPK_THREADS) {   // G is a multiple of 256: whole warps
            const u64 key = s_keys[i];
            const bool in = key != 0ull && (key & hmask) == prefix;
            const int bin = in ? (int)((key >> shift) & 255) : -1;
            const unsigned peers = __match_any_sync(FULL_MASK, bin);
            if (in && lane == __ffs(peers) - 1) atomicAdd(&sh.hist[bin], (unsigned)__popc(peers));
        }
    });
}

// The pick of a window of 256 top-16-bit values (bin 255 - d = distance d below wtop; `remaining` of the k
// largest keys lie in it, `above` above it): the bin of the k-th largest key; thr = that bin's top-16 value
// << 48 when at most gcap keys are >= it (then true; else false and thr untouched). After a barrier that
// made the window's histogram complete; ends after one that made radix_pick's outputs visible.
__device__ __forceinline__ bool window_thr(int wtop, unsigned remaining, unsigned above, int gcap, int lane,
                                           int warp, MergeShared& sh, u64& thr) {
    if (warp == 0) radix_pick(sh.hist, remaining, lane, &sh.digit, &sh.above, &sh.bin);
    __syncthreads();
    if (above + sh.above + sh.bin <= (unsigned)gcap) {
        thr = (u64)(unsigned)(wtop - (255 - sh.digit)) << 48;
        return true;
    }
    return false;
}

__device__ void merge_scan(const u64* __restrict__ in_keys, const float2* __restrict__ in_ms, int rows, int P,
                           int k, int r, int tid, int lane, int warp, u64* s_keys, MergeShared& sh,
                           u64* __restrict__ out_keys, float2* __restrict__ out_ms, float* __restrict__ out_lp,
                           int* __restrict__ out_id) {
    const int W = scan_width(k), G = P * DDT_TOPK_THREADS, gcap = scan_gcap(k);
    const int region = max(G, 32 * gcap);
    int* s_gl = reinterpret_cast<int*>(s_keys + region);
    const u64* row = in_keys + (size_t)r * P * W;
    // header (chunk 0's; every chunk writes the same)
    const u64 h0 = ld_s1(row), h1 = ld_s1(row + 1);
    const int chunk = (int)ld_s1(row + 2);
    const int V_local = (int)(uint32_t)h1;
    const uint32_t id_offset = (uint32_t)(h1 >> 32);
    if (tid == 0) { sh.nz = 0; sh.n = 0; sh.ng = 0; sh.top = 0u; }
    // the group keys into shared memory (8 loads in flight per thread), counting the nonzero ones and
    // taking the largest top-16-bit value (sign, exponent, 7 mantissa bits: a bf16 value)
    int nz = 0;
    unsigned top = 0u;
    for (int t0 = 0; t0 < G; t0 += 8 * DDT_TOPK_THREADS) {
        u64 kk[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int t = t0 + u * DDT_TOPK_THREADS + tid;
            kk[u] = t < G ? ld_s1(&row[(size_t)(t >> 8) * W + DDT_SCAN_HDR + (t & 255)]) : 0ull;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int t = t0 + u * DDT_TOPK_THREADS + tid;
            if (t < G) s_keys[t] = kk[u];
            nz += kk[u] != 0ull ? 1 : 0;
            top = max(top, (unsigned)(kk[u] >> 48));
        }
    }
    nz = __reduce_add_sync(FULL_MASK, nz);
    top = __reduce_max_sync(FULL_MASK, top);
    __syncthreads();   // sh initialised
    if (lane == 0) { atomicAdd(&sh.nz, nz); atomicMax(&sh.top, top); }
    if (warp == DDT_TOPK_THREADS / 32 - 1) row_lse(in_ms, rows, r, P, 0, lane, sh);
    __syncthreads();
    // thr: fewer than k groups have a logit in range -> all of them (a row may be shorter than 256 k).
    // Else, first, windows of 256 top-16-bit values from the largest down: a histogram of the nonzero keys
    // whose top 16 bits lie in the window (bin = distance below the window's top; random rows spread over
    // many bins, so plain shared atomics rarely collide) gives thr = (the k-th largest key's top 16 bits)
    // << 48 when at most gcap keys are >= it. That fails only when one top-16 value holds too many keys
    // (long runs of equal logits) or the k-th largest is more than 3 windows below the maximum; then the
    // radix narrowing over the whole keys decides (exact for any input; its first digits put most keys in
    // one bin, so its histogram updates are aggregated per warp and bin).
    u64 thr = 0ull;
    bool found = false;
    if (sh.nz < k) {
        thr = 1ull;
        found = true;
    } else {
        int wtop = (int)sh.top;
        unsigned remaining = (unsigned)k, above = 0;
#pragma unroll 1
        for (int w = 0; w < 3 && wtop >= 0; ++w, wtop -= 256) {   // uniform
            sh.hist[tid] = 0u;
            if (tid == 0) sh.near = 0u;
            __syncthreads();
            unsigned near = 0;
            for (int i = tid; i < G; i += DDT_TOPK_THREADS) {
                const u64 key = s_keys[i];
                const int d = wtop - (int)(key >> 48);
                if (key != 0ull && d >= 0 && d < 256) { atomicAdd(&sh.hist[255 - d], 1u); ++near; }
            }
            near = __reduce_add_sync(FULL_MASK, near);
            if (lane == 0 && near) atomicAdd(&sh.near, near);
            __syncthreads();
            const unsigned nw = sh.near;
            if (nw < remaining) {   // the k-th largest is below this window
                remaining -= nw;
                above += nw;
                __syncthreads();     // every thread has read sh.near before the next window clears it
                continue;
            }
            if (window_thr(wtop, remaining, above, gcap, lane, warp, sh, thr)) found = true;
            break;
        }
        __syncthreads();   // everybody has read sh.digit/above/bin (and hist) before they are reused
    }
    if (!found) thr = groups_radix_thr(s_keys, G, k, gcap, tid, lane, warp, sh);
    thr = thr > 1ull ? thr : 1ull;   // never the empty groups (key 0)
    for (int i = tid; i < G; i += DDT_TOPK_THREADS) warp_append<int>(s_keys[i] >= thr, i, s_gl, &sh.ng, lane);
    __syncthreads();   // s_gl complete; the group keys are read for the last time
    const int ng = sh.ng;
    if (h0 & 1ull)
        scan_gather<bf16_bits>(reinterpret_cast<const bf16_bits*>(h0 & ~1ull), V_local, id_offset, chunk, s_gl, ng,
                               thr, s_keys, &sh.n, tid, lane);
    else
        scan_gather<float>(reinterpret_cast<const float*>(h0), V_local, id_offset, chunk, s_gl, ng, thr, s_keys,
                           &sh.n, tid, lane);
    __syncthreads();
    merge_finish<true>(s_keys, sh.n, k, r, tid, lane, warp, sh, out_keys, out_ms, out_lp, out_id);
}

// ---------------------------------------------------------------------------------------------------
// Stage 2, scan kind with the group keys in registers (the same selection as merge_scan,
// fewer dependent phases): thread t holds the keys of groups j * 256 + t (its own slot in every chunk),
// all loaded at once; the counts, the window histogram and the group selection read those registers;
// the selected groups and the candidates are placed by block-wide exclusive scans of per-thread counts
// (one barrier each) instead of a ballot + shared atomic + shuffle per key slot. Rows with more than
// DDT_MREG chunks take merge_scan. Same thresholds, same candidate set (in another order: merge_finish
// selects and ranks keys, which are unique, so the outputs are bit-identical).
// ---------------------------------------------------------------------------------------------------
#define DDT_MREG 20   // group keys per thread in registers: P <= 20 chunks (V_local <= 163840 at 8192)
static_assert(DDT_MREG <= 32, "the lse partials: one per lane of one warp");

// exclusive prefix of v over the block (thread order) and the block total; s_w holds one partial per warp
// and must not be read by anyone else between this call's barrier and the next barrier
__device__ __forceinline__ int block_excl_scan(int v, int lane, int warp, unsigned* s_w, int& total) {
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += t;
    }
    if (lane == 31) s_w[warp] = (unsigned)incl;
    __syncthreads();
    int base = 0, tot = 0;
#pragma unroll
    for (int w = 0; w < DDT_TOPK_THREADS / 32; ++w) {
        const int x = (int)s_w[w];
        base += w < warp ? x : 0;
        tot += x;
    }
    total = tot;
    return base + incl - v;
}

// the selected groups' logits (as scan_gather) -> every element key >= thr written at the thread's offset
// of a block scan; returns the candidate count (uniform)
template <typename T>
__device__ __forceinline__ int scan_gather_regs(const T* xrow, int V_local, uint32_t id_offset, int chunk,
                                                const int* s_gl, int ng, u64 thr, u64* out, unsigned* s_w,
                                                int tid, int lane, int warp) {
    ChunkRegs<T> v;
    bool ok[DDT_TOPK_VECS];
    int base[DDT_TOPK_VECS];
    load_groups<T>(xrow, V_local, chunk, s_gl, ng, tid, v, ok, base);
    int cnt = 0;
#pragma unroll
    for (int t = 0; t < DDT_TOPK_VECS; ++t)
#pragma unroll
        for (int e = 0; e < 8; ++e)
            cnt += (ok[t] && make_key(v.at(t, e), id_offset + (uint32_t)(base[t] + e)) >= thr) ? 1 : 0;
    int total;
    int o = block_excl_scan(cnt, lane, warp, s_w, total);
#pragma unroll
    for (int t = 0; t < DDT_TOPK_VECS; ++t)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const u64 key = ok[t] ? make_key(v.at(t, e), id_offset + (uint32_t)(base[t] + e)) : 0ull;
            if (ok[t] && key >= thr) out[o++] = key;
        }
    return total;
}

// merge_scan's threshold search over the group keys in registers: windows of 256 top-16-bit values from the
// largest down, else the radix narrowing over the whole keys (stored to shared memory for it). Needs a clear
// sh.hist after a barrier, nz_all >= k; returns thr (0 never: the caller raises it to 1).
__device__ __forceinline__ u64 regs_window_radix_thr(const u64 (&gk)[DDT_MREG], int P, int G, int k, int gcap,
                                                     unsigned top_all, int tid, int lane, int warp, u64* s_keys,
                                                     MergeShared& sh) {
    u64 thr = 0ull;
    bool found = false;
    {
        int wtop = (int)top_all;
        unsigned remaining = (unsigned)k, above = 0;
#pragma unroll 1
        for (int w = 0; w < 3 && wtop >= 0; ++w, wtop -= 256) {   // uniform; hist is clear here
            unsigned near = 0;
#pragma unroll
            for (int j = 0; j < DDT_MREG; ++j) {
                const int d = wtop - (int)(gk[j] >> 48);
                if (gk[j] != 0ull && d >= 0 && d < 256) { atomicAdd(&sh.hist[255 - d], 1u); ++near; }
            }
            near = __reduce_add_sync(FULL_MASK, near);
            if (lane == 0) sh.wb[warp] = near;
            __syncthreads();
            unsigned nw = 0;
#pragma unroll
            for (int q = 0; q < DDT_TOPK_THREADS / 32; ++q) nw += sh.wb[q];
            if (nw < remaining) {   // the k-th largest is below this window
                remaining -= nw;
                above += nw;
                sh.hist[tid] = 0u;   // every atomic of this window is done (barrier above)
                __syncthreads();     // cleared, and sh.wb read by all, before the next window
                continue;
            }
            if (window_thr(wtop, remaining, above, gcap, lane, warp, sh, thr)) found = true;
            break;
        }
    }
    if (!found) {   // rare (runs of equal logits, a far k-th key): merge_scan's radix over the keys in shared
        __syncthreads();   // sh.digit / above / bin read by all before radix_pick rewrites them
#pragma unroll
        for (int j = 0; j < DDT_MREG; ++j)
            if (j < P) s_keys[j * DDT_TOPK_THREADS + tid] = gk[j];
        thr = groups_radix_thr(s_keys, G, k, gcap, tid, lane, warp, sh);
    }
    return thr;
}

__device__ void merge_scan_regs(const u64* __restrict__ in_keys, const float2* __restrict__ in_ms, int rows,
                                int P, int k, int r, int tid, int lane, int warp, u64* s_keys, MergeShared& sh,
                                u64* __restrict__ out_keys, float2* __restrict__ out_ms,
                                float* __restrict__ out_lp, int* __restrict__ out_id) {
    const int W = scan_width(k), G = P * DDT_TOPK_THREADS, gcap = scan_gcap(k);
    const int region = max(G, 32 * gcap);
    int* s_gl = reinterpret_cast<int*>(s_keys + region);
    const u64* row = in_keys + (size_t)r * P * W;
    // the last warp's lse partial (one per lane: P <= DDT_MREG < 32) is loaded with the group keys; it is
    // combined below exactly as row_lse does (one lse_combine from (-inf, 0) per lane, then the butterfly)
    const bool lse_warp = warp == DDT_TOPK_THREADS / 32 - 1;
    float2 msv = make_float2(DDT_NEG_INF, 0.f);
    if (lse_warp && lane < P) msv = ld_s1(&in_ms[(size_t)r * P + lane]);
    u64 gk[DDT_MREG];   // group j * 256 + tid (0 past P: an empty group)
#pragma unroll
    for (int j = 0; j < DDT_MREG; ++j) gk[j] = j < P ? ld_s1(&row[(size_t)j * W + DDT_SCAN_HDR + tid]) : 0ull;
    const u64 h0 = ld_s1(row), h1 = ld_s1(row + 1);   // header (chunk 0's; every chunk writes the same)
    const int chunk = (int)ld_s1(row + 2);
    const int V_local = (int)(uint32_t)h1;
    const uint32_t id_offset = (uint32_t)(h1 >> 32);
    int nz = 0;
    unsigned top = 0u;
#pragma unroll
    for (int j = 0; j < DDT_MREG; ++j) {
        nz += gk[j] != 0ull ? 1 : 0;
        top = max(top, (unsigned)(gk[j] >> 48));
    }
    nz = __reduce_add_sync(FULL_MASK, nz);
    top = __reduce_max_sync(FULL_MASK, top);
    if (lane == 0) { sh.wa[warp] = (unsigned)nz; sh.red[warp] = top; }
    sh.hist[tid] = 0u;
    if (lse_warp) {
        float m = DDT_NEG_INF, s = 0.f;
        if (lane < P) lse_combine(m, s, msv.x, msv.y);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            float m2 = __shfl_xor_sync(FULL_MASK, m, off), s2 = __shfl_xor_sync(FULL_MASK, s, off);
            lse_combine(m, s, m2, s2);
        }
        if (lane == 0) { sh.m = m; sh.s = s; }
    }
    __syncthreads();
    int nz_all = 0;
    unsigned top_all = 0u;
#pragma unroll
    for (int w = 0; w < DDT_TOPK_THREADS / 32; ++w) {
        nz_all += (int)sh.wa[w];
        top_all = max(top_all, (unsigned)sh.red[w]);
    }
    // thr (<= the row's k-th largest group key, so every element key of the top-k lies in a group >= thr,
    // and at most gcap groups >= thr). Fewer than k nonempty groups: all of them. Else, first, the k-th
    // largest of the 256 threads' maxima (k distinct group keys are >= it): its top 16 bits, from a
    // histogram of one key per thread (merge_scan's window histogram takes every key, most of them in a few
    // crowded bins), accepted when at most gcap groups pass it (counted by the selection's own block scan);
    // else merge_scan's windows and radix over every key (regs_window_radix_thr).
    u64 thr = 0ull;
    int ng = 0, o = 0;
    bool placed = false;   // thr is final and the selected groups are counted (ng) with this thread's offset (o)
    if (nz_all < k) {
        thr = 1ull;
    } else {
        u64 tmax = 0ull;
#pragma unroll
        for (int j = 0; j < DDT_MREG; ++j) tmax = gk[j] > tmax ? gk[j] : tmax;
        const int dm = (int)top_all - (int)(tmax >> 48);   // >= 0: top_all is the largest top-16 value
        const bool inw = tmax != 0ull && dm < 256;
        if (inw) atomicAdd(&sh.hist[255 - dm], 1u);
        const unsigned cw = (unsigned)__popc(__ballot_sync(FULL_MASK, inw));
        if (lane == 0) sh.wb[warp] = cw;
        __syncthreads();
        unsigned nw = 0;
#pragma unroll
        for (int q = 0; q < DDT_TOPK_THREADS / 32; ++q) nw += sh.wb[q];
        if (nw >= (unsigned)k) {   // uniform
            if (warp == 0) radix_pick(sh.hist, (unsigned)k, lane, &sh.digit, &sh.above, &sh.bin);
            __syncthreads();
            u64 t0 = (u64)(unsigned)((int)top_all - (255 - sh.digit)) << 48;
            t0 = t0 > 1ull ? t0 : 1ull;   // never the empty groups (key 0); still <= the thread maximum
            int c0 = 0;
#pragma unroll
            for (int j = 0; j < DDT_MREG; ++j) c0 += gk[j] >= t0 ? 1 : 0;
            int n0;
            const int o0 = block_excl_scan(c0, lane, warp, sh.wc, n0);
            if (n0 <= gcap) { thr = t0; ng = n0; o = o0; placed = true; }   // uniform
        }
        if (!placed) {
            sh.hist[tid] = 0u;   // hist, wb and digit were read by all before the barriers above
            __syncthreads();
            thr = regs_window_radix_thr(gk, P, G, k, gcap, top_all, tid, lane, warp, s_keys, sh);
        }
    }
    if (!placed) {
        thr = thr > 1ull ? thr : 1ull;   // never the empty groups (key 0)
        int cnt = 0;
#pragma unroll
        for (int j = 0; j < DDT_MREG; ++j) cnt += gk[j] >= thr ? 1 : 0;
        o = block_excl_scan(cnt, lane, warp, sh.wc, ng);   // wc: its last reads precede the barriers above
    }
    // the selected groups (<= gcap) at the block scan's offsets
#pragma unroll
    for (int j = 0; j < DDT_MREG; ++j)
        if (gk[j] >= thr) s_gl[o++] = j * DDT_TOPK_THREADS + tid;
    __syncthreads();   // s_gl complete (and the fallback's s_keys reads are long done)
    int N;
    if (h0 & 1ull)
        N = scan_gather_regs<bf16_bits>(reinterpret_cast<const bf16_bits*>(h0 & ~1ull), V_local, id_offset, chunk,
                                        s_gl, ng, thr, s_keys, sh.wd, tid, lane, warp);
    else
        N = scan_gather_regs<float>(reinterpret_cast<const float*>(h0), V_local, id_offset, chunk, s_gl, ng, thr,
                                    s_keys, sh.wd, tid, lane, warp);
    __syncthreads();
    merge_finish<true>(s_keys, N, k, r, tid, lane, warp, sh, out_keys, out_ms, out_lp, out_id);
}

// The merge of both kinds: SCAN takes stage 1's group keys (merge_scan_regs / merge_scan) and places the
// output by rank; exact lists (parts_major, or k == 1) are merged below by both, each with its finish.
template <bool SCAN>
__device__ __forceinline__ void topk_merge(const u64* __restrict__ in_keys, const float2* __restrict__ in_ms,
                                           int rows, int P, int k, int parts_major, u64* __restrict__ out_keys,
                                           float2* __restrict__ out_ms, float* __restrict__ out_lp,
                                           int* __restrict__ out_id) {
    extern __shared__ u64 s_keys[];   // [P * lcap] gathered keys, then int [P] list lengths
    __shared__ MergeShared sh;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int r = blockIdx.x;
    const bool cand = !parts_major && k > 1;
    DDT_PDL_WAIT();
    if constexpr (SCAN) {
        if (cand) {
            if (P <= DDT_MREG)
                merge_scan_regs(in_keys, in_ms, rows, P, k, r, tid, lane, warp, s_keys, sh, out_keys, out_ms,
                                out_lp, out_id);
            else
                merge_scan(in_keys, in_ms, rows, P, k, r, tid, lane, warp, s_keys, sh, out_keys, out_ms, out_lp,
                           out_id);
            return;
        }
    }
    const int W = parts_major ? k : part_width(k);       // slots per list in memory
    const int lcap = cand ? cand_cap(k) : k;              // keys per list at most
    const int koff = cand ? 2 : 0;                        // first key slot
    int* s_len = reinterpret_cast<int*>(s_keys + (size_t)P * lcap);
    auto list = [&](int c) -> const u64* {
        return in_keys + (parts_major ? ((size_t)c * rows + r) : ((size_t)r * P + c)) * W;
    };
    // lists' bounds and lengths; the last warp also combines the log-sum-exp partials
    u64 lb = 0ull;
    for (int c = tid; c < P; c += DDT_TOPK_THREADS) {
        const u64* l = list(c);
        u64 bound;
        int len;
        if (cand) { bound = ld_s1(l); len = (int)ld_s1(l + 1); }
        else { bound = ld_s1(l + k - 1); len = k; }
        s_len[c] = len;
        lb = bound > lb ? bound : lb;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const u64 o = __shfl_xor_sync(FULL_MASK, lb, off);
        lb = o > lb ? o : lb;
    }
    if (lane == 0) sh.red[warp] = lb;
    if (warp == DDT_TOPK_THREADS / 32 - 1) row_lse(in_ms, rows, r, P, parts_major, lane, sh);
    if (tid == 0) sh.n = 0;
    __syncthreads();
    u64 L = 0ull;
#pragma unroll
    for (int w = 0; w < DDT_TOPK_THREADS / 32; ++w) L = sh.red[w] > L ? sh.red[w] : L;
    // gather the keys >= L (nonzero), 8 loads in flight per thread
    const int total = P * lcap;
    for (int t0 = 0; t0 < total; t0 += 8 * DDT_TOPK_THREADS) {
        u64 kk[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int t = t0 + u * DDT_TOPK_THREADS + tid;
            kk[u] = 0ull;
            if (t < total) {
                const int c = t / lcap, j = t - c * lcap;
                if (j < s_len[c]) kk[u] = ld_s1(list(c) + koff + j);
            }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u)
            if (kk[u] != 0ull && kk[u] >= L) s_keys[atomicAdd(&sh.n, 1)] = kk[u];
    }
    __syncthreads();
    merge_finish<SCAN>(s_keys, sh.n, k, r, tid, lane, warp, sh, out_keys, out_ms, out_lp, out_id);
}

// The merge kernels: ddt_topk_merge<SCAN>.
template <bool SCAN>
__global__ void __launch_bounds__(DDT_TOPK_THREADS)
ddt_topk_merge(const u64* __restrict__ in_keys, const float2* __restrict__ in_ms, int rows, int P, int k,
               int parts_major, u64* __restrict__ out_keys, float2* __restrict__ out_ms,
               float* __restrict__ out_lp, int* __restrict__ out_id) {
    topk_merge<SCAN>(in_keys, in_ms, rows, P, k, parts_major, out_keys, out_ms, out_lp, out_id);
}

// ---------------------------------------------------------------------------------------------------
// Stage 3: the builder, one warp per stream. Best-first over a frontier (the reference's heap): each pop
// takes the best entry under the total order (score descending, then the rank-tuple key ascending),
// emits it (unless it is a forced-chain node, emitted up front), and inserts its next sibling and its
// first child. top_lp/top_id [S, D, K]. Outputs [S, R] with R = DDT_MAX_TREE_ROWS, mask [S, R,
// DDT_MASK_WORDS]. Rows past n (n = node count): token = bonus, parent -1, depth 0, position = prefix,
// mask = {0, self}.
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

// The tree rows (coalesced) and each row's ancestor-or-self mask: one lane per row walks its ancestors
// once (depth <= 8 steps) into five register words.
__device__ __forceinline__ void write_tree(int st, int n, int pre, int lane, const int* t_tok, const int* t_par,
                                           const int* t_dep, int* tokens, int* parents, int* depths,
                                           int* positions, int* n_rows, uint32_t* mask) {
    const int R = DDT_MAX_TREE_ROWS;
    const size_t o = (size_t)st * R;
    for (int i = lane; i < R; i += 32) {
        const bool real = i <= n;
        const int dep = real ? t_dep[i] : 0;
        tokens[o + i] = real ? t_tok[i] : t_tok[0];
        parents[o + i] = real ? t_par[i] : -1;
        depths[o + i] = dep;
        positions[o + i] = pre + dep;
        uint32_t w[DDT_MASK_WORDS];
#pragma unroll
        for (int j = 0; j < DDT_MASK_WORDS; ++j) w[j] = 0u;
        if (real) {
            for (int a = i; a >= 0; a = t_par[a])   // self, parent, ..., root
#pragma unroll
                for (int j = 0; j < DDT_MASK_WORDS; ++j)
                    if ((a >> 5) == j) w[j] |= 1u << (a & 31);
        } else {
            w[0] = 1u;
#pragma unroll
            for (int j = 0; j < DDT_MASK_WORDS; ++j)
                if ((i >> 5) == j) w[j] |= 1u << (i & 31);
        }
#pragma unroll
        for (int j = 0; j < DDT_MASK_WORDS; ++j) mask[(o + i) * DDT_MASK_WORDS + j] = w[j];
    }
    if (lane == 0) n_rows[st] = n + 1;
}

// Builder v3 (budgets above DDT_CACHE_BUDGET).
// Position p = slot p / 32 of lane p % 32; only the ordered scores are in registers (the removed variant 2
// kept the rest of an entry for the winning lane alone). Here the popped
// position is made known to every lane (one ballot per slot: in the usual case of a single holder
// of the maximum the slot and the lane follow without a per-lane search), so every lane reads the entry
// from shared memory (a broadcast), computes both successors, and no branch diverges: no shuffles, no
// divergent winner block. An entry also carries the log-probs its successors need (next sibling's and
// first child's, written when the entry is created), so one 16-byte shared load feeds the scores of the
// next pop; the loads for the new entries' log-probs are off that path.
#define DDT_SLOTS 5
// f32_to_ordered(score_add(a, b)) in fewer dependent steps: a zero or subnormal sum (either sign) is the
// key of +0.0; otherwise the same bit map (negative: flip all bits, positive: set the sign bit).
__device__ __forceinline__ uint32_t ordered_sum(float a, float b) {
    const float r = __fadd_rn(a, b);
    const uint32_t u = fabsf(r) < 1.17549435e-38f ? 0u : __float_as_uint(r);
    return u ^ ((uint32_t)((int)u >> 31) | 0x80000000u);
}
// ---------------------------------------------------------------------------------------------------
// Builder, sorted cache (budgets <= DDT_CACHE_BUDGET; docs/history/2026-11-29-ddtree.md "Builder: sorted
// cache"). The frontier is a list sorted in pop order, entry j in lane j (every field in registers), the head
// (entry 0) also known to every lane. A pop takes the head; its next sibling and first child are placed by rank: each lane
// compares its entry with both (two ballots), and one shuffle round moves every entry to its new index.
// The next head is the sibling or the child if one of them ranks first, else the old entry 1 (broadcast
// at the start of the pop, off the critical path): no reduction, no shared memory in the loop.
// Why 32 entries are enough for budget <= 64: a pop removes one entry and adds at most two, so after q
// pops the frontier holds <= q + 1 entries and an entry falls off the end (index 32) only at pop q >= 32.
// At most budget pops happen in all (chain pops included), so <= budget - q <= 32 remain, while the 32
// entries ahead of the dropped one all pop before it: the dropped entry (and its successors) never pops.
#define DDT_CACHE_BUDGET 64
// the total order: a pops before b (score descending, then the rank tuple ascending; tuples are unique)
__device__ __forceinline__ bool pops_before(uint32_t oa, u64 ta, uint32_t ob, u64 tb) {
    return oa > ob || (oa == ob && ta < tb);
}
// One frontier entry: ordered score, rank tuple, info word, parent score, next sibling's log-prob, first
// child's log-prob (the last three feed its successors' scores when it pops).
struct CEnt {
    uint32_t os; u64 tup; int info; float ps, ls, lc;
};
__device__ __forceinline__ CEnt cent_shfl(const CEnt& e, int src) {
    CEnt o;
    o.os = __shfl_sync(FULL_MASK, e.os, src);
    o.tup = __shfl_sync(FULL_MASK, e.tup, src);
    o.info = __shfl_sync(FULL_MASK, e.info, src);
    o.ps = __shfl_sync(FULL_MASK, e.ps, src);
    o.ls = __shfl_sync(FULL_MASK, e.ls, src);
    o.lc = __shfl_sync(FULL_MASK, e.lc, src);
    return o;
}
__device__ __forceinline__ CEnt cent_sel(bool c, const CEnt& a, const CEnt& b) {
    CEnt o;
    o.os = c ? a.os : b.os; o.tup = c ? a.tup : b.tup; o.info = c ? a.info : b.info;
    o.ps = c ? a.ps : b.ps; o.ls = c ? a.ls : b.ls; o.lc = c ? a.lc : b.lc;
    return o;
}
// Pops until `budget` rows are emitted or the frontier is empty; lane 0 writes rows nc + 1 .. (the chain
// rows 1..nc are written by the caller). Returns the node count (warp-uniform).
__device__ __forceinline__ int cache_pops(const float* s_lp, const int* s_id, int D, int K, int kf, int budget,
                                          int nc, int lane, int* t_tok, int* t_par, int* t_dep, int* t_info) {
    int nodes = nc;
    if (budget <= 0) return nodes;
    // the root's first child: depth 1, rank 0 (indices clamped: unused when K or D is 1)
    CEnt h;
    h.os = ordered_sum(0.f, s_lp[0]);
    h.tup = tuple_digit(1, 0);
    h.info = pack_info(1, 0, 0, nc >= 1);
    h.ps = 0.f;
    h.ls = s_lp[min(1, K - 1)];
    h.lc = s_lp[min(1, D - 1) * K];
    CEnt c = h;   // lane j: entry j (only lane 0 is meaningful while n == 1)
    int n = 1;
    while (n > 0 && nodes < budget) {
        const CEnt e1 = cent_shfl(c, 1);   // the entry after the head, needed only to pick the next head
        const int d = h.info & 15, r = (h.info >> 4) & 255, prow = (h.info >> 12) & 255, chain = (h.info >> 20) & 1;
        const bool has_sib = r + 1 < kf, has_child = d < D;
        const float sc = ordered_to_f32(h.os);
        CEnt sib, ch;
        sib.os = ordered_sum(h.ps, h.ls);
        sib.tup = h.tup + tuple_digit(d, 0);   // rank digit + 1
        ch.os = ordered_sum(sc, h.lc);
        ch.tup = h.tup + (has_child ? tuple_digit(min(d + 1, DDT_MAX_DEPTH), 0) : 0ull);   // d < D <= 8 there
        // ranks among the entries after the head (lanes 1 .. n-1), then between the two new entries
        const bool valid = lane >= 1 && lane < n;
        const unsigned bs = __ballot_sync(FULL_MASK, valid && pops_before(c.os, c.tup, sib.os, sib.tup));
        const unsigned bc = __ballot_sync(FULL_MASK, valid && pops_before(c.os, c.tup, ch.os, ch.tup));
        const bool child_first = pops_before(ch.os, ch.tup, sib.os, sib.tup);
        const int pos_s = has_sib ? __popc(bs) + (has_child && child_first ? 1 : 0) : 64;
        const int pos_c = has_child ? __popc(bc) + (has_sib && !child_first ? 1 : 0) : 64;
        // payloads (shared loads, off the ranking path)
        const int row = chain ? d : nodes + 1;
        sib.info = pack_info(d, r + 1, prow, 0);
        sib.ps = h.ps;
        sib.ls = s_lp[(d - 1) * K + min(r + 2, K - 1)];   // the sibling's own next sibling
        sib.lc = h.lc;                                     // same depth: same first-child log-prob
        ch.info = pack_info(d + 1, 0, row, chain && d + 1 <= nc);
        ch.ps = sc;
        ch.ls = s_lp[min(d, D - 1) * K + min(1, K - 1)];  // the child's next sibling
        ch.lc = s_lp[min(d + 1, D - 1) * K];              // the child's first child
        // the row's info word only (one store, no branch: the other lanes and chain pops write scratch slots
        // past the rows); token, parent and depth are decoded by all lanes after the loop
        t_info[lane == 0 && !chain ? row : DDT_MAX_TREE_ROWS + lane] = h.info;
        // new entry j: the sibling at pos_s, the child at pos_c, else old entry j + 1 - (new entries
        // before j); index 32 and beyond falls off (lane 31's source 32 reads lane 0: unused then)
        const int src = lane + 1 - (pos_s < lane ? 1 : 0) - (pos_c < lane ? 1 : 0);
        const CEnt moved = cent_shfl(c, src);
        c = cent_sel(lane == pos_s, sib, cent_sel(lane == pos_c, ch, moved));
        h = cent_sel(pos_s == 0, sib, cent_sel(pos_c == 0, ch, e1));
        n = min(n - 1 + (has_sib ? 1 : 0) + (has_child ? 1 : 0), 32);
        nodes += chain ? 0 : 1;
    }
    __syncwarp();   // lane 0's info words are visible to every lane
    for (int i = nc + 1 + lane; i <= nodes; i += 32) {   // rows emitted by the loop
        const int info = t_info[i];
        const int d = info & 15, r = (info >> 4) & 255;
        t_tok[i] = s_id[(d - 1) * K + r];
        t_par[i] = (info >> 12) & 255;
        t_dep[i] = d;
    }
    return nodes;
}
extern "C" __global__ void __launch_bounds__(32)
ddt_build_tree(const float* __restrict__ top_lp, const int* __restrict__ top_id, int D, int K,
               const int* __restrict__ budgets, const int* __restrict__ prefix_len,
               const int* __restrict__ bonus, int cap_k, int include_chain,
               int* __restrict__ tokens, int* __restrict__ parents, int* __restrict__ depths,
               int* __restrict__ positions, int* __restrict__ n_rows, uint32_t* __restrict__ mask) {
    __shared__ float s_lp[DDT_MAX_DEPTH * DDT_MAX_K];
    __shared__ int s_id[DDT_MAX_DEPTH * DDT_MAX_K];
    // entry p: {info word, parent score, next sibling's log-prob, first child's log-prob} (floats as bits)
    __shared__ int4 e_ent[32 * DDT_SLOTS];
    __shared__ u64 e_tup[32 * DDT_SLOTS];
    __shared__ int t_tok[DDT_MAX_TREE_ROWS], t_par[DDT_MAX_TREE_ROWS], t_dep[DDT_MAX_TREE_ROWS];

    const int lane = threadIdx.x, st = blockIdx.x;
    const int R = DDT_MAX_TREE_ROWS;
    DDT_PDL_WAIT();
    const int budget = min(max(budgets[st], 0), R - 1);
    const int kf = cap_k > 0 ? min(K, cap_k) : K;
    const int nkd = D * K;
    {   // every load issued before the first store (D * K <= 1024: 32 per lane)
        const float* lp = top_lp + (size_t)st * nkd;
        const int* ids = top_id + (size_t)st * nkd;
        float a[DDT_MAX_DEPTH * DDT_MAX_K / 32];
        int b[DDT_MAX_DEPTH * DDT_MAX_K / 32];
#pragma unroll
        for (int j = 0; j < DDT_MAX_DEPTH * DDT_MAX_K / 32; ++j) {
            const int i = j * 32 + lane;
            if (i < nkd) { a[j] = lp[i]; b[j] = ids[i]; }
        }
#pragma unroll
        for (int j = 0; j < DDT_MAX_DEPTH * DDT_MAX_K / 32; ++j) {
            const int i = j * 32 + lane;
            if (i < nkd) { s_lp[i] = ftz_in(a[j]); s_id[i] = b[j]; }
        }
    }
    const int nc = include_chain ? min(D, budget) : 0;
    const int bon = bonus[st], pre = prefix_len[st];
    if (lane == 0) { t_tok[0] = bon; t_par[0] = -1; t_dep[0] = 0; }
    __syncwarp();
    // forced top-1 chain: rows 1..nc, row d = depth d
    if (lane >= 1 && lane <= nc) { t_tok[lane] = s_id[(lane - 1) * K]; t_par[lane] = lane - 1; t_dep[lane] = lane; }

    int nodes = nc;
    if (budget <= DDT_CACHE_BUDGET) {
        __shared__ int t_info[DDT_MAX_TREE_ROWS + 32];   // + a scratch slot per lane
        nodes = cache_pops(s_lp, s_id, D, K, kf, budget, nc, lane, t_tok, t_par, t_dep, t_info);
    } else
    {   // v3's pop loop (budgets > DDT_CACHE_BUDGET)
    uint32_t os[DDT_SLOTS];
#pragma unroll
    for (int s = 0; s < DDT_SLOTS; ++s) os[s] = 0u;
    int live = 0, npos = 0;
    if (budget > 0) {   // the root's first child: depth 1, rank 0 (indices clamped: unused when K or D is 1)
        if (lane == 0) {
            os[0] = ordered_sum(0.f, s_lp[0]);
            e_ent[0] = make_int4(pack_info(1, 0, 0, nc >= 1), __float_as_int(0.f), __float_as_int(s_lp[min(1, K - 1)]),
                                 __float_as_int(s_lp[min(1, D - 1) * K]));
            e_tup[0] = tuple_digit(1, 0);
        }
        live = npos = 1;
    }
    __syncwarp();
    while (live > 0 && nodes < budget) {
        uint32_t bo = os[0];
#pragma unroll
        for (int s = 1; s < DDT_SLOTS; ++s) bo = max(bo, os[s]);
        const uint32_t M = __reduce_max_sync(FULL_MASK, bo);   // > 0: the frontier is not empty
        unsigned w[DDT_SLOTS], any = 0u;
        int cnt = 0;
#pragma unroll
        for (int s = 0; s < DDT_SLOTS; ++s) {
            w[s] = __ballot_sync(FULL_MASK, os[s] == M);
            any |= w[s];
            cnt += __popc(w[s]);
        }
        int bs, wl;   // warp-uniform: the popped slot and lane
        if (cnt == 1) {
            bs = 0;
#pragma unroll
            for (int s = 1; s < DDT_SLOTS; ++s) bs = w[s] ? s : bs;
            wl = __ffs(any) - 1;
        } else {   // equal best scores: the smallest rank tuple among them (tuples are unique)
            u64 bt = ~0ull;
            int lbs = -1;
#pragma unroll
            for (int s = 0; s < DDT_SLOTS; ++s)
                if (os[s] == M) {
                    const u64 t = e_tup[s * 32 + lane];
                    if (t < bt) { bt = t; lbs = s; }
                }
            const uint32_t mh = __reduce_min_sync(FULL_MASK, (uint32_t)(bt >> 32));
            const uint32_t tl = (uint32_t)(bt >> 32) == mh ? (uint32_t)bt : 0xffffffffu;
            const uint32_t ml = __reduce_min_sync(FULL_MASK, tl);
            wl = __ffs(__ballot_sync(FULL_MASK, lbs >= 0 && bt == (((u64)mh << 32) | ml))) - 1;
            bs = __shfl_sync(FULL_MASK, lbs, wl);
        }
        const int p = bs * 32 + wl;
        const int4 e = e_ent[p];   // every lane reads the same entry (broadcast)
        const u64 tup = e_tup[p];
        const int d = e.x & 15, r = (e.x >> 4) & 255, prow = (e.x >> 12) & 255, chain = (e.x >> 20) & 1;
        const bool has_sib = r + 1 < kf, has_child = d < D;
        const float sc = ordered_to_f32(M);
        const uint32_t sib_os = has_sib ? ordered_sum(__int_as_float(e.y), __int_as_float(e.z)) : 0u;
        const uint32_t child_os = ordered_sum(sc, __int_as_float(e.w));
        // registers: the popped slot takes the next sibling (same parent score) or empties; the first
        // child goes to the next position
        // (selects, not branches: no divergent region in the loop; the two targets are different slots)
        const int sp = lane == wl ? bs : -1;
        const int cp = has_child && lane == (npos & 31) ? npos >> 5 : -1;
#pragma unroll
        for (int s = 0; s < DDT_SLOTS; ++s) os[s] = s == sp ? sib_os : (s == cp ? child_os : os[s]);
        // shared memory (lane 0): the emitted row, the sibling's entry in place, the child's entry
        const int row = chain ? d : nodes + 1;
        const int tok = s_id[(d - 1) * K + r];
        const float l_sib2 = s_lp[(d - 1) * K + min(r + 2, K - 1)];   // the sibling's own next sibling
        const float l_c1 = s_lp[min(d, D - 1) * K + min(1, K - 1)];     // the child's next sibling
        const float l_cc = s_lp[min(d + 1, D - 1) * K];                 // the child's first child
        __syncwarp();   // every lane has read entry p before lane 0 overwrites it
        if (lane == 0) {
            if (!chain) { t_tok[row] = tok; t_par[row] = prow; t_dep[row] = d; }
            if (has_sib) {
                e_ent[p].x = pack_info(d, r + 1, prow, 0);
                e_ent[p].z = __float_as_int(l_sib2);
                e_tup[p] = tup + tuple_digit(d, 0);   // rank digit + 1
            }
            if (has_child) {
                e_ent[npos] = make_int4(pack_info(d + 1, 0, row, chain && d + 1 <= nc), __float_as_int(sc),
                                        __float_as_int(l_c1), __float_as_int(l_cc));
                e_tup[npos] = tup + tuple_digit(d + 1, 0);
            }
        }
        nodes += chain ? 0 : 1;
        live += (has_child ? 1 : 0) - (has_sib ? 0 : 1);
        npos += has_child ? 1 : 0;
        __syncwarp();   // lane 0's entries are visible to every lane before the next pop reads them
    }
    }
    __syncwarp();
    write_tree(st, nodes, pre, lane, t_tok, t_par, t_dep, tokens, parents, depths, positions, n_rows, mask);
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
    DDT_PDL_WAIT();
    const int R = DDT_MAX_TREE_ROWS;
    const int* tok = tokens + (size_t)st * R;
    const int* par = parents + (size_t)st * R;
    const int* pst = post + (size_t)st * R;
    const int n = min(max(n_rows[st], 1), R);
    const int pre = prefix_len[st];
    int cur = 0, a = 1;
    if (lane == 0) s_rows[0] = 0;
    // Every row's parent, token and post token in registers first (row i = slot i / 32 of lane i % 32: one
    // batch of loads), so a step of the walk is a shuffle and five ballots instead of two dependent global
    // round trips. A step: want = post[cur] (from lane cur % 32), then the lowest row c < n with parent
    // cur and token want (parents precede their children, so c > cur); its token is `want`, recorded for
    // out_tokens.
    __shared__ int s_tokv[DDT_MAX_DEPTH + 2];
    int r_par[DDT_WALK_SLOTS], r_tok[DDT_WALK_SLOTS], r_pst[DDT_WALK_SLOTS];
#pragma unroll
    for (int q = 0; q < DDT_WALK_SLOTS; ++q) {
        const int i = q * 32 + lane;
        r_par[q] = i < n ? par[i] : -2;   // -2: never a row index
        r_tok[q] = i < n ? tok[i] : 0;
        r_pst[q] = i < n ? pst[i] : 0;
    }
    const int root_tok = __shfl_sync(FULL_MASK, r_tok[0], 0);
    int want;
    for (;;) {
        int pv = r_pst[0];
#pragma unroll
        for (int q = 1; q < DDT_WALK_SLOTS; ++q) pv = (cur >> 5) == q ? r_pst[q] : pv;
        want = __shfl_sync(FULL_MASK, pv, cur & 31);   // post[cur]
        if (a >= A) break;
        int found = -1;
#pragma unroll
        for (int q = DDT_WALK_SLOTS - 1; q >= 0; --q) {   // the lowest slot with a match wins
            const unsigned m = __ballot_sync(FULL_MASK, r_par[q] == cur && r_tok[q] == want);
            found = m ? q * 32 + __ffs(m) - 1 : found;
        }
        if (found < 0) break;
        cur = found;
        if (lane == 0) { s_rows[a] = cur; s_tokv[a] = want; }
        ++a;
    }
    if (lane == 0) s_tokv[0] = root_tok;
    __syncwarp();
    const int bonus_tok = want;   // post[cur] of the last accepted row
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
        out_tokens[(size_t)st * (A + 1) + j] = j < a ? s_tokv[j] : (j == a ? bonus_tok : -1);
    __syncwarp();   // all lanes have read prefix_len before it may be overwritten
    if (lane == 0) {
        n_acc[st] = a;
        new_len[st] = pre + a;
        new_bonus[st] = bonus_tok;
        if (upd_len) upd_len[st] = pre + a;
        if (upd_bonus) upd_bonus[st] = bonus_tok;
    }
}
