// Shared by the INT4 MoE GEMM families (moe_int4.cu: register-ring GEMMs and the routing kernel;
// moe_bulk.cu: the bulk-copy GEMMs): the weight layout's fragment helpers, dequantisation, mma, and the
// deterministic shared-memory routing sort. docs/MOE.md.
#pragma once
#include "common.cuh"

namespace moe {

// ---------------------------------------------------------------------------------------------------------
// Weight layout (per expert, per linear W[N, K], K padded to Kp = multiple of 64):
//   wp[N/16][Kp/64][32 lanes] uint4: word w of lane (g = lane/4, t = lane%4) holds the 8 A-fragment nibbles
//     of k16 sub-tile w of that 16x64 block; nibble position p (bits 4p..4p+3) holds fragment element
//     idx = 2*(p%4) + p/4, so one lop3 of (word >> 4j) yields fragment register j (elements 2j, 2j+1).
//   sp[N/16][Kp/64][8 g] uint2: the scales of rows g and g+8 for the two 32-groups of the 64-block:
//     (g, grp0), (g+8, grp0), (g, grp1), (g+8, grp1).
// MMA k-index kappa (0..15) of sub-tile w maps to the natural k inside the 64-block as
//   nat(w, kappa) = 32*(w>>1) + 8*((kappa&7)>>1) + 4*(w&1) + 2*(kappa>>3) + (kappa&1)
// which is what lets lane t load its B fragments as two plain 16-byte vectors x[k0+8t .. +7] and
// x[k0+32+8t .. +7] from a natural row-major activation row (no activation permutation pass), and keeps
// each mma inside one 32-group so the scale is applied once per group in fp32.
// ---------------------------------------------------------------------------------------------------------

__device__ __forceinline__ int nat_k(int w, int kappa) {
    return 32 * (w >> 1) + 8 * ((kappa & 7) >> 1) + 4 * (w & 1) + 2 * (kappa >> 3) + (kappa & 1);
}
// A-fragment element idx (0..7) of lane (g, t): row and MMA column (PTX ISA, m16n8k16 .bf16 A layout).
__device__ __forceinline__ int frag_row(int g, int idx) { return g + 8 * ((idx >> 1) & 1); }
__device__ __forceinline__ int frag_col(int t, int idx) { return 2 * t + (idx & 1) + 8 * (idx >> 2); }

__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));   // (a & b) | c
    return d;
}

__device__ __forceinline__ uint32_t bf16x2_fma(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// One repacked word -> four bf16x2 A registers holding q = nibble - 8 exactly. OR-ing a nibble into the
// mantissa of 128.0 (0x4300) gives 128 + nib; one fma with -136 removes both the 128 and the -8 offset.
__device__ __forceinline__ void dequant_word(uint32_t w, uint32_t (&r)[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint32_t v = lop3_and_or(w >> (4 * j), 0x000F000Fu, 0x43004300u);
        r[j] = bf16x2_fma(v, 0x3F803F80u, 0xC308C308u);
    }
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Weights are read exactly once per unit by exactly one lane: bypass L1.
__device__ __forceinline__ uint4 ld_stream_v4(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 ld_stream_v2(const uint2* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// prefetch_l2: common.cuh

__device__ __forceinline__ float bf_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

}  // namespace moe

using namespace moe;

// ---------------------------------------------------------------------------------------------------------
// Routing. Slot s of the sorted order holds pair index slot_pair[s] = t*k + j (token t = pair / k, routing
// weight wts[pair]); the chunk list (expert, first slot, tokens <= chunk) is what the GEMMs stride over.
// Two producers of the same contract:
//  * moe_route (large T): one 1024-thread block, counting sort with atomic ranks, every expert's run of slots
//    padded to a multiple of 8; extra blocks prefetch the touched experts into L2 meanwhile.
//  * sort_pairs_block (small T, T*k <= FUSED_MAX_PAIRS): every gate/up block sorts in its own shared memory
//    in its prologue (saves a launch and three dependent global round trips), block 0 publishes the result
//    for the down kernel. Every block must derive the SAME slot assignment (gate/up block A writes h[slot]
//    that the down kernel reads through block 0's slot_pair), so the ranks there are deterministic:
//    rank of pair i = number of earlier pairs with the same expert.
// meta[0] = number of chunks, meta[1] = number of bad expert ids.
// ---------------------------------------------------------------------------------------------------------
__device__ __forceinline__ int2 block_exclusive_scan2(int2 v, int2* warp_tot, int2* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int2 inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int a = __shfl_up_sync(0xFFFFFFFFu, inc.x, o), b = __shfl_up_sync(0xFFFFFFFFu, inc.y, o);
        if (lane >= o) { inc.x += a; inc.y += b; }
    }
    if (lane == 31) warp_tot[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int2 wv = lane < nw ? warp_tot[lane] : make_int2(0, 0);
        int2 wi = wv;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(0xFFFFFFFFu, wi.x, o), b = __shfl_up_sync(0xFFFFFFFFu, wi.y, o);
            if (lane >= o) { wi.x += a; wi.y += b; }
        }
        if (lane < nw) warp_tot[lane] = make_int2(wi.x - wv.x, wi.y - wv.y);
        if (lane == 31) *total = wi;
    }
    __syncthreads();
    const int2 base = warp_tot[warp];
    return make_int2(base.x + inc.x - v.x, base.y + inc.y - v.y);
}


// Shared-memory sort of the gate/up prologue (small T). Sizes: FUSED_MAX_PAIRS pairs, MAX_E experts, and at
// most min(pairs, E) + pairs / 8 chunks (every touched expert's last chunk may be partial).
constexpr int FUSED_MAX_PAIRS = 256;
constexpr int MAX_E = 1024;
constexpr int FUSED_MAX_CHUNKS = FUSED_MAX_PAIRS + FUSED_MAX_PAIRS / 8;

struct SortSmem {
    int cnt[MAX_E];                      // per-expert counts, then the first slot of each expert's run
    int ids[FUSED_MAX_PAIRS];
    int slot_pair[FUSED_MAX_PAIRS];
    int4 chunks[FUSED_MAX_CHUNKS];
    int2 warp_tot[32];
    int2 total;
    int bad;
};

// Unpadded runs (slots 0..valid pairs - 1): the gather through slot_pair means chunks need no 8-alignment.
// MOE_SORT_MARK(k): the timeline build's phase stamps (moe_bulk.cu); nothing elsewhere.
#ifndef MOE_SORT_MARK
#define MOE_SORT_MARK(k)
#endif
__device__ void sort_pairs_block(const int* __restrict__ ids, int n, int E, int chunk, SortSmem& s) {
    const int tid = threadIdx.x, nth = blockDim.x;
    MOE_SORT_MARK(0);
    for (int e = tid; e < E; e += nth) s.cnt[e] = 0;
    if (tid == 0) s.bad = 0;
    for (int i = tid; i < n; i += nth) s.ids[i] = ids[i];
    __syncthreads();
    MOE_SORT_MARK(1);
    for (int i = tid; i < n; i += nth) {
        const int e = s.ids[i];
        if (e >= 0 && e < E) atomicAdd(&s.cnt[e], 1);     // counts do not depend on the order of the atomics
        else atomicAdd(&s.bad, 1);
    }
    __syncthreads();
    MOE_SORT_MARK(2);
    const int per = (E + nth - 1) / nth;                   // experts owned by this thread: [e0, e0 + per)
    const int e0 = tid * per;
    int csum = 0, chsum = 0;
    for (int q = 0; q < per; ++q) {
        const int e = e0 + q;
        if (e < E) { const int c = s.cnt[e]; csum += c; chsum += (c + chunk - 1) / chunk; }
    }
    const int2 ex = block_exclusive_scan2(make_int2(csum, chsum), s.warp_tot, &s.total);
    MOE_SORT_MARK(3);
    int off = ex.x, ci = ex.y;
    for (int q = 0; q < per; ++q) {
        const int e = e0 + q;
        if (e < E) {
            const int c = s.cnt[e];
            for (int j = 0; j * chunk < c; ++j) s.chunks[ci++] = make_int4(e, off + j * chunk, min(chunk, c - j * chunk), 0);
            s.cnt[e] = off;
            off += c;
        }
    }
    __syncthreads();
    MOE_SORT_MARK(4);
    for (int i = tid; i < n; i += nth) {
        const int e = s.ids[i];
        if (e < 0 || e >= E) continue;
        int r = 0;                                         // deterministic rank: earlier pairs of expert e
        for (int i2 = 0; i2 < i; ++i2) r += s.ids[i2] == e;
        s.slot_pair[s.cnt[e] + r] = i;
    }
    __syncthreads();
    MOE_SORT_MARK(5);
}

