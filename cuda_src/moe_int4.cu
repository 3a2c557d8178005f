// Fused INT4 (W4A16) routed-expert MoE for one layer: register-ring gate/up grouped GEMM (the routing sorted in its
// prologue) with SiLU(gate)*up in the epilogue -> down grouped GEMM with the routing weight -> deterministic
// per-token sum (+ residual); moe_route, the routing kernel of the bulk-copy GEMMs (moe_bulk.cu) above 256 pairs.
// Layout, pipeline and partitioning are described in docs/MOE.md; the numpy model of the weight layout is
// ddtree_cupy/kernels/moe/layout.py (repack_numpy), checked by tests/test_moe_layout.py.
//
// mma.sync.m16n8k16 with the WEIGHT in the 16-row A slot and up to 8 tokens in the 8-wide B slot: at decode
// sizes an expert sees 1..8 tokens, so the 16-row slot is always full of useful weight rows and only the
// cheap activation operand is padded.
#include "moe_common.cuh"

// ---------------------------------------------------------------------------------------------------------
// Load-time repack: compressed-tensors weight_packed [E][Nsrc][K/8] (+ optional second source interleaved by
// 16-row tiles: fused tile 2r = src0 tile r, 2r+1 = src1 tile r) -> wp [E][Nf/16][Kp/64][32][4] uint32.
// One thread per output word. Padding columns (k >= K) get nibble 8 (q = 0).
// ---------------------------------------------------------------------------------------------------------

// One 16 x 64 block of the repacked layout, [E][ntiles][KS] in that order, from its flat index.
struct LayoutBlock {
    int e, tile, step;
};

__device__ __forceinline__ LayoutBlock layout_block(long long blk, int KS, int ntiles) {
    LayoutBlock b;
    b.step = (int)(blk % KS); blk /= KS;
    b.tile = (int)(blk % ntiles);
    b.e = (int)(blk / ntiles);
    return b;
}

// One grid-stride pass over a repacked tensor of 2^SHIFT elements per 16 x 64 block: f(i, r, block, src, stile)
// for output element i, its index r inside the block, the block, and the source tensor and 16-row tile the block
// reads (fused: tile 2r is src0's tile r, 2r+1 src1's tile r; else src0's own tile).
template <int SHIFT, typename T, typename F>
__device__ __forceinline__ void repack_elements(const T* src0, const T* src1, int E, int Nsrc, int KS, int fused,
                                                F&& f) {
    const int ntiles = (fused ? 2 * Nsrc : Nsrc) / 16;
    const long long total = ((long long)E * ntiles * KS) << SHIFT;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const LayoutBlock b = layout_block(i >> SHIFT, KS, ntiles);
        const int stile = fused ? b.tile >> 1 : b.tile;
        const T* src = (fused && (b.tile & 1)) ? src1 : src0;
        f(i, (int)(i & ((1 << SHIFT) - 1)), b, src, stile);
    }
}

extern "C" __global__ void moe_repack_weights(const uint32_t* __restrict__ src0, const uint32_t* __restrict__ src1,
                                              int E, int Nsrc, int K, int KS, int fused,
                                              uint32_t* __restrict__ dst) {
    DDT_PDL_WAIT();
    const int kw = K / 8;
    // 128 words per block: word w = r & 3 of lane r >> 2
    repack_elements<7>(src0, src1, E, Nsrc, KS, fused,
                       [&](long long i, int r, const LayoutBlock& b, const uint32_t* src, int stile) {
        const int w = r & 3, lane = r >> 2;
        const int g = lane >> 2, t = lane & 3;
        uint32_t out = 0;
#pragma unroll
        for (int p = 0; p < 8; ++p) {
            const int idx = 2 * (p & 3) + (p >> 2);
            const int n = stile * 16 + frag_row(g, idx);
            const int k = b.step * 64 + nat_k(w, frag_col(t, idx));
            uint32_t nib = 8u;
            if (k < K) nib = (src[((long long)b.e * Nsrc + n) * kw + (k >> 3)] >> (4 * (k & 7))) & 0xFu;
            out |= nib << (4 * p);
        }
        dst[i] = out;
    });
}

// Scales: weight_scale [E][Nsrc][K/32] bf16 -> sp [E][Nf/16][Kp/64][8][4] bf16. Padding groups get 0.
extern "C" __global__ void moe_repack_scales(const bf16_bits* __restrict__ src0, const bf16_bits* __restrict__ src1,
                                             int E, int Nsrc, int K, int KS, int fused,
                                             bf16_bits* __restrict__ dst) {
    DDT_PDL_WAIT();
    const int kg = K / 32;
    // 32 scales per block: entry q = r & 3 of row group g = r >> 2
    repack_elements<5>(src0, src1, E, Nsrc, KS, fused,
                       [&](long long i, int r, const LayoutBlock& b, const bf16_bits* src, int stile) {
        const int q = r & 3, g = r >> 2;
        const int n = stile * 16 + g + 8 * (q & 1);
        const int grp = 2 * b.step + (q >> 1);
        dst[i] = grp < kg ? src[((long long)b.e * Nsrc + n) * kg + grp] : (bf16_bits)0;
    });
}

// Self-check: decode the repacked tensors through the GEMM's own data path (dequant_word + fp32 scale) into
// dense fp32 W[E][Nf][Kp]; q * scale is exact in fp32, so the host compares bit for bit.
extern "C" __global__ void moe_dequant_check(const uint4* __restrict__ wp, const uint2* __restrict__ sp,
                                             int E, int Nf, int KS, float* __restrict__ out) {
    DDT_PDL_WAIT();
    const int ntiles = Nf / 16, Kp = KS * 64;
    const long long total = (long long)E * ntiles * KS * 32;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int lane = (int)(i & 31);
        const long long blk = i >> 5;          // = (e * ntiles + tile) * KS + step
        const LayoutBlock b = layout_block(blk, KS, ntiles);
        const int g = lane >> 2, t = lane & 3;
        const uint4 a = wp[blk * 32 + lane];
        const uint2 s = sp[blk * 8 + g];
        const float sc[4] = {bf_lo(s.x), bf_hi(s.x), bf_lo(s.y), bf_hi(s.y)};
        const uint32_t words[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            uint32_t r[4];
            dequant_word(words[w], r);
#pragma unroll
            for (int idx = 0; idx < 8; ++idx) {
                const uint32_t reg = r[idx >> 1];
                const float q = (idx & 1) ? bf_hi(reg) : bf_lo(reg);
                const int row = frag_row(g, idx);
                const float v = q * sc[(w >> 1) * 2 + ((idx >> 1) & 1)];
                const int k = b.step * 64 + nat_k(w, frag_col(t, idx));
                out[((long long)b.e * Nf + b.tile * 16 + row) * Kp + k] = v;
            }
        }
    }
}

// Weight regions one expert streams, for the L2 prefetch blocks of moe_route.
struct ExpertRegions {
    const char* base[4];          // w13, s13, w2, s2 of expert 0
    long long bytes[4];           // per expert
};

// Blocks 1..: build the set of touched experts from the ids (order irrelevant) and prefetch their weights
// into L2 while block 0 sorts, so DRAM streaming starts at the first kernel of the layer. gate/up first
// (whole experts, or the same leading fraction of each: the GEMM visits tiles in that order), then down if
// what remains of ``budget`` holds all of it.
__device__ void route_prefetch(const int* __restrict__ ids, int n, int E, const ExpertRegions& rg,
                               long long budget, int* flag, int* list, int* count) {
    const int tid = threadIdx.x;
    for (int e = tid; e < E; e += blockDim.x) flag[e] = 0;
    if (tid == 0) *count = 0;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
        const int e = ids[i];
        if (e >= 0 && e < E) flag[e] = 1;
    }
    __syncthreads();
    for (int e = tid; e < E; e += blockDim.x)
        if (flag[e]) list[atomicAdd(count, 1)] = e;
    __syncthreads();
    const int nt = *count;
    if (nt == 0 || budget <= 0) return;
    long long take[4];
    const long long gu = (long long)nt * (rg.bytes[0] + rg.bytes[1]);
    const long long dn = (long long)nt * (rg.bytes[2] + rg.bytes[3]);
    if (gu <= budget) {
        take[0] = rg.bytes[0]; take[1] = rg.bytes[1];
        const bool all_down = dn <= budget - gu;
        take[2] = all_down ? rg.bytes[2] : 0; take[3] = all_down ? rg.bytes[3] : 0;
    } else {
        const double f = (double)budget / (double)gu;
        take[0] = (long long)(f * rg.bytes[0]); take[1] = (long long)(f * rg.bytes[1]);
        take[2] = 0; take[3] = 0;
    }
    long long lines[4], per = 0;
#pragma unroll
    for (int r = 0; r < 4; ++r) { lines[r] = (take[r] + 127) / 128; per += lines[r]; }
    const long long total = per * nt;
    const long long stride = (long long)(gridDim.x - 1) * blockDim.x;
    for (long long L = (long long)(blockIdx.x - 1) * blockDim.x + tid; L < total; L += stride) {
        const int e = list[L / per];
        long long off = L % per;
        // unrolled region select (a dynamic index would put the arrays in local memory)
        const char* p;
        if (off < lines[0]) p = rg.base[0] + (long long)e * rg.bytes[0] + off * 128;
        else if ((off -= lines[0]) < lines[1]) p = rg.base[1] + (long long)e * rg.bytes[1] + off * 128;
        else if ((off -= lines[1]) < lines[2]) p = rg.base[2] + (long long)e * rg.bytes[2] + off * 128;
        else p = rg.base[3] + (long long)e * rg.bytes[3] + (off - lines[2]) * 128;
        prefetch_l2(p);
    }
}

extern "C" __global__ void __launch_bounds__(1024) moe_route(
        const int* __restrict__ ids, int T, int k, int E, int chunk,
        int* __restrict__ slot_pair, int* __restrict__ rank_tmp, int4* __restrict__ chunks, int* __restrict__ meta,
        const void* w13, const void* s13, const void* w2, const void* s2,
        long long w13_eb, long long s13_eb, long long w2_eb, long long s2_eb, long long l2_budget) {
    __shared__ int cnt[1024];
    __shared__ int poff[1024];
    __shared__ int2 warp_tot[32];
    __shared__ int2 total;
    __shared__ int bad;
    DDT_PDL_WAIT();                 // ids come from the router kernel
    DDT_PDL_LAUNCH_DEPENDENTS();    // one sorting block: the gate/up grid may start launching now
    if (blockIdx.x > 0) {
        ExpertRegions rg;
        rg.base[0] = (const char*)w13; rg.base[1] = (const char*)s13;
        rg.base[2] = (const char*)w2;  rg.base[3] = (const char*)s2;
        rg.bytes[0] = w13_eb; rg.bytes[1] = s13_eb; rg.bytes[2] = w2_eb; rg.bytes[3] = s2_eb;
        route_prefetch(ids, T * k, E, rg, l2_budget, cnt, poff, &bad);
        return;
    }
    const int tid = threadIdx.x;
    cnt[tid] = 0;
    if (tid == 0) bad = 0;
    __syncthreads();
    const int n = T * k;
    for (int i = tid; i < n; i += blockDim.x) {
        const int e = ids[i];
        if (e < 0 || e >= E) { rank_tmp[i] = -1; atomicAdd(&bad, 1); }
        else rank_tmp[i] = atomicAdd(&cnt[e], 1);   // order inside an expert is irrelevant: columns are independent
    }
    __syncthreads();
    const int c = tid < E ? cnt[tid] : 0;
    const int nch = (c + chunk - 1) / chunk;
    const int2 ex = block_exclusive_scan2(make_int2((c + 7) & ~7, nch), warp_tot, &total);
    if (tid < E) {
        poff[tid] = ex.x;
        for (int j = 0; j < nch; ++j)
            chunks[ex.y + j] = make_int4(tid, ex.x + j * chunk, min(chunk, c - j * chunk), 0);
    }
    __syncthreads();
    if (tid == 0) { meta[0] = total.y; meta[1] = bad; }
    for (int i = tid; i < n; i += blockDim.x) {
        const int r = rank_tmp[i];
        if (r >= 0) slot_pair[poff[ids[i]] + r] = i;
    }
}

// ---------------------------------------------------------------------------------------------------------
// Grouped GEMM over (chunk, m-group) units. Block = WM x WK warps; warp (wm, kw) owns the m32 unit
// (m16 tiles 2r, 2r+1 with r = mg*WM + wm) over the kw-th slice of K, for up to NT*8 tokens of the chunk.
// MODE 0 (gate/up, fused tiles 2r = gate rows 16r.., 2r+1 = up rows 16r..): h[slot][row] = silu(g)*u, bf16;
//   the block sorts the routing itself first (sort_pairs_block) and block 0 publishes it for the down kernel.
// MODE 1 (down): y[pair][row] = wts[pair] * acc, fp32.
// Weights stream global -> registers through a U-stage register ring; partials over K meet in shared
// memory in a fixed order (deterministic). A rolling L2 prefetch runs pf_steps ahead of the ring and, with
// pf_next, carries on into the warp's tiles of its next unit, so a unit starts on L2 hits instead of
// one DRAM round trip.
// LEAN, the k loop's memory pattern (the arithmetic and its order are the same in both, so results are
// bit-identical): absent token columns are not zeroed, loads come from running pointers with immediate offsets,
// and one predicated L2 prefetch per step from a per-lane pointer. LEAN 1 loads activations one step ahead and
// prefetches the next unit at the unit start (the table's loop at T = 1); LEAN 2 loads activations U steps ahead
// with the weights and lets the rolling prefetch cross the unit boundary (from T = 2 up). docs/MOE.md.
// Dynamic shared memory: the SortSmem of the gate/up kernel (none in the down kernel). (An S-deep
// per-warp cp.async ring for the weights measured 3-15% slower on the H200 and was removed:
// docs/history/2026-11-29-moe.md.)
// Two resident 256-thread blocks per SM (16 warps) for the one-token-tile configurations.
// ---------------------------------------------------------------------------------------------------------

template <int MODE, int WM, int WK, int NT, int U, int LEAN>
__global__ void __launch_bounds__(WM * WK * 32, (NT == 1 && WM * WK <= 8) ? 2 : 1) moe_gemm(
        const uint4* __restrict__ wp, const uint2* __restrict__ sp, int N, int KS,
        const bf16_bits* __restrict__ act, int act_stride,
        const int* __restrict__ ids, const float* __restrict__ wts, int T, int k, int E,
        int* __restrict__ slot_pair, int4* __restrict__ chunks, int* __restrict__ meta,
        bf16_bits* __restrict__ h_out, int h_stride,
        float* __restrict__ y, int pf_steps, int pf_next) {
    static_assert(LEAN == 1 || LEAN == 2, "moe_gemm: the k loop is 1 or 2");
    // pf_steps (multiple of 4, 0 = off): how far the L2 prefetch runs ahead of the register ring.
    constexpr int RED = WK > 1 ? WM * WK * 2 * NT * 4 * 32 : 1;
    __shared__ float red[RED];
    extern __shared__ __align__(16) uint4 moe_dyn[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = warp % WM, kw = warp / WM;
    const int g = lane >> 2, t = lane & 3;
    const int ntiles = N / 16;
    const int n_mg = (ntiles / 2 + WM - 1) / WM;
    const int spw = (KS + WK - 1) / WK;
    const int sb = kw * spw;
    const int nsteps = max(0, min(KS, sb + spw) - sb);

    DDT_PDL_WAIT();     // everything below reads routing / activations of earlier kernels
    const int4* chs = chunks;
    const int* spair = slot_pair;
    int n_chunks;
    if constexpr (MODE == 0) {
        SortSmem& so = *reinterpret_cast<SortSmem*>(moe_dyn);
        sort_pairs_block(ids, T * k, E, 8 * NT, so);
        n_chunks = so.total.y;
        if (blockIdx.x == 0) {     // publish for the down kernel (same deterministic result in every block)
            for (int c = threadIdx.x; c < n_chunks; c += blockDim.x) chunks[c] = so.chunks[c];
            for (int s = threadIdx.x; s < so.total.x; s += blockDim.x) slot_pair[s] = so.slot_pair[s];
            if (threadIdx.x == 0) { meta[0] = n_chunks; meta[1] = so.bad; }
        }
        chs = so.chunks;
        spair = so.slot_pair;
    } else {
        n_chunks = meta[0];
    }
    const int n_units = n_chunks * n_mg;
    int pf_done = 0;     // k64 steps of this unit's tiles already prefetched by the previous unit

    for (int u = blockIdx.x; u < n_units; u += gridDim.x) {
        // Consecutive units are consecutive chunks of the same m-group: chunks of one expert run side by side
        // and share its weight tiles through L2.
        const int mg = u / n_chunks, cidx = u - mg * n_chunks;
        if (u + (int)gridDim.x >= n_units) DDT_PDL_LAUNCH_DEPENDENTS();   // last unit: SMs are freeing up
        const int4 ch = chs[cidx];
        const int e = ch.x, slot0 = ch.y, ntok = ch.z;
        const int tile0 = (mg * WM + wm) * 2;
        const bool wactive = tile0 < ntiles;
        // this warp's tiles in the block's next unit (for the prefetch across the unit boundary)
        // (two ints, not pointers: the gate/up kernel sits at the 128-register cap)
        const int un = u + gridDim.x;
        int nx_e = -1, nx_t = 0;
        if (pf_next && pf_steps > 0 && un < n_units) {
            const int mgn = un / n_chunks;
            nx_t = (mgn * WM + wm) * 2;
            if (nx_t < ntiles) nx_e = chs[un - mgn * n_chunks].x;
        }
        const bool nx = nx_e >= 0;
        int next_done = 0;
        // MODE 1: lane j < ntok holds token column j's pair and routing weight for the epilogue (taken by
        // shuffle). The pair load is issued now; the dependent weight load only after the first weight loads
        // are in flight (an address that waits on a load stalls the warp's in-order issue).
        int my_pair = 0;
        float my_w = 0.f;
        if (MODE == 1 && lane < ntok) my_pair = spair[slot0 + lane];

        float acc[2][NT][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int q = 0; q < 4; ++q) acc[mt][nt][q] = 0.f;

        if (wactive && nsteps > 0) {
            const size_t blk0 = ((size_t)e * ntiles + tile0) * KS + sb;
            const uint4* pa0 = wp + blk0 * 32 + lane;
            const uint4* pa1 = pa0 + (size_t)KS * 32;
            const uint2* ps0 = sp + blk0 * 8 + g;
            const uint2* ps1 = ps0 + (size_t)KS * 8;
            const bf16_bits* pb[NT];
            bool bval[NT];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int j = nt * 8 + g;
                bval[nt] = j < ntok;
                const int row = bval[nt] ? (MODE == 0 ? spair[slot0 + j] / k : slot0 + j) : 0;
                pb[nt] = act + (size_t)row * act_stride + (size_t)sb * 64 + 8 * t;
            }
            const uint4* pt0 = wp + blk0 * 32;
            const uint2* st0 = sp + blk0 * 8;
            uint4 rb[U][NT][2];
            // Absent token columns (j >= ntok) load token 0's row (pb[] points there, and it exists): MMA
            // columns are independent, so whatever they hold never reaches a stored column (no zeroing).
            auto compute = [&](const uint4 (&a)[2], const uint2 (&sc)[2], const uint4 (&b)[NT][2]) {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    uint32_t A[4][4];
                    dequant_word(a[mt].x, A[0]);
                    dequant_word(a[mt].y, A[1]);
                    dequant_word(a[mt].z, A[2]);
                    dequant_word(a[mt].w, A[3]);
                    const float s00 = bf_lo(sc[mt].x), s08 = bf_hi(sc[mt].x);
                    const float s10 = bf_lo(sc[mt].y), s18 = bf_hi(sc[mt].y);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        if (nt == 0 || nt * 8 < ntok) {    // ntok >= 1: token tile 0 always exists
                            float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
                            mma_bf16(d0, A[0], b[nt][0].x, b[nt][0].y);
                            mma_bf16(d0, A[1], b[nt][0].z, b[nt][0].w);
                            mma_bf16(d1, A[2], b[nt][1].x, b[nt][1].y);
                            mma_bf16(d1, A[3], b[nt][1].z, b[nt][1].w);
                            acc[mt][nt][0] += s00 * d0[0] + s10 * d1[0];
                            acc[mt][nt][1] += s00 * d0[1] + s10 * d1[1];
                            acc[mt][nt][2] += s08 * d0[2] + s18 * d1[2];
                            acc[mt][nt][3] += s08 * d0[3] + s18 * d1[3];
                        }
                    }
                }
            };
            // Per-step L2 prefetch, one predicated instruction per warp and step: lanes 0..7 request the
            // step's 8 weight lines (tile lane>>2, 128-B line lane&3), lanes 8, 9 its two scale half-lines
            // (tile lane&1), from a per-lane byte pointer: step s is at ppf + s * stride (no division, no
            // 64-bit product per step). pf_next, LEAN 1: the block's next unit's first pf_steps steps are
            // requested at the unit start (a whole unit ahead); LEAN 2: the rolling prefetch crosses the
            // unit boundary.
            const unsigned pstride = lane < 8 ? 512u : 64u;
            const char* ppf = lane < 8 ? reinterpret_cast<const char*>(pt0 + (size_t)(lane >> 2) * KS * 32 + (lane & 3) * 8)
                                       : reinterpret_cast<const char*>(st0 + (size_t)(lane & 1) * KS * 8);
            auto next_unit_ptr = [&]() {   // this lane's line of the next unit's first step
                const size_t nb = ((size_t)nx_e * ntiles + nx_t) * KS + sb;
                return lane < 8 ? reinterpret_cast<const char*>(wp + nb * 32 + (size_t)(lane >> 2) * KS * 32 + (lane & 3) * 8)
                                : reinterpret_cast<const char*>(sp + nb * 8 + (size_t)(lane & 1) * KS * 8);
            };
            if constexpr (LEAN == 1) {
                // LEAN 1: the next unit's first steps are requested here, once per unit
                const int plim = (lane < 10 && pf_steps > 0) ? nsteps : 0;
                for (int s = pf_done; s < pf_steps; ++s)
                    if (s < plim) prefetch_l2(ppf + (size_t)(unsigned)s * pstride);
                next_done = 0;
                if (nx && pf_steps > 0) {
                    const char* pn = next_unit_ptr();
                    next_done = min(nsteps, pf_steps);
                    for (int s = 0; s < next_done; ++s)
                        if (lane < 10) prefetch_l2(pn + (size_t)(unsigned)s * pstride);
                }
            }
            // LEAN 2: the rolling prefetch runs on across the unit boundary (the same
            // distance into the next unit); ppf is re-aimed there once, when the prefetch reaches step nsteps
            const int plim = (lane < 10 && pf_steps > 0) ? (LEAN == 2 && nx ? 2 * nsteps : nsteps) : 0;
            auto prefetch_step = [&](int s) {
                if constexpr (LEAN == 2) {
                    if (s == nsteps && s < plim)      // (s < plim at s = nsteps: nx; once per unit)
                        ppf = next_unit_ptr() - (size_t)(unsigned)nsteps * pstride;
                }
                if (s < plim) prefetch_l2(ppf + (size_t)(unsigned)s * pstride);
            };
            if constexpr (LEAN == 2) {
                for (int s = pf_done; s < pf_steps; ++s) prefetch_step(s);
                next_done = nx ? min(nsteps, pf_steps) : 0;
            }

            uint4 ra[U][2];
            uint2 rs[U][2];
            // Running pointers at step `base` (advanced by U steps per ring turn): every load in the loops
            // below is [pointer + compile-time offset], no per-load address arithmetic, and no address
            // registers kept for steps in flight (NVRTC's sm_120 allocation spilled with per-load products).
            const uint4* qa0 = pa0;
            const uint4* qa1 = pa1;
            const uint2* qs0 = ps0;
            const uint2* qs1 = ps1;
            const bf16_bits* qb[NT];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) qb[nt] = pb[nt];
            // Weights (DRAM/L2) go U steps ahead into ring slot i. Activations (L1/L2 hits, shared by every
            // warp): LEAN 1 one step ahead into slot (i + 1) % U (~8 registers fewer in flight), LEAN 2 U steps
            // ahead with the weights (measured on the H200: LEAN 1 wins at T = 1 and loses 1-17% from T = 8 up).
            auto load_w = [&](int r, int i) {      // ring slot r <- weights of step base + i (i compile-time)
                ra[r][0] = ld_stream_v4(qa0 + i * 32);
                ra[r][1] = ld_stream_v4(qa1 + i * 32);
                rs[r][0] = ld_stream_v2(qs0 + i * 8);
                rs[r][1] = ld_stream_v2(qs1 + i * 8);
            };
            auto load_x = [&](int r, int i) {      // slot r <- activations of step base + i
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    if (nt == 0 || nt * 8 < ntok) {
                        const uint4* p = reinterpret_cast<const uint4*>(qb[nt] + i * 64);
                        rb[r][nt][0] = __ldg(p);
                        rb[r][nt][1] = __ldg(p + 4);
                    }
                }
            };
            auto advance = [&]() {
                qa0 += U * 32; qa1 += U * 32; qs0 += U * 8; qs1 += U * 8;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) qb[nt] += U * 64;
            };
            // LEAN 1: activations one step ahead (slot (i + 1) % U); LEAN 2: U steps ahead with the weights
            if (LEAN == 1) load_x(0, 0);
#pragma unroll
            for (int i = 0; i < U; ++i)
                if (i < nsteps) { load_w(i, i); if (LEAN == 2) load_x(i, i); }
            if (MODE == 1 && lane < ntok) my_w = wts[my_pair];
            // One loop with per-step guards (compiled to predicates, ~4 branches per 3 steps): a second,
            // unchecked copy for the bulk of the steps measured spill-prone under NVRTC 12.9 at the
            // 128-register cap (sm_90 and sm_120), so there is none.
            for (int base = 0; base < nsteps; base += U) {     // ring slot i holds step base + i
#pragma unroll
                for (int i = 0; i < U; ++i) {
                    if (base + i < nsteps) {
                        if (LEAN == 1 && base + i + 1 < nsteps) load_x((i + 1) % U, i + 1);
                        compute(ra[i], rs[i], rb[i]);
                        if (base + i + U < nsteps) { load_w(i, i + U); if (LEAN == 2) load_x(i, i + U); }
                        prefetch_step(base + i + pf_steps);
                    }
                }
                advance();
            }
        }
        pf_done = next_done;

        if (WK > 1) {
            float* mine = red + (size_t)(warp * 2 * NT * 4) * 32 + lane;
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int q = 0; q < 4; ++q) mine[((mt * NT + nt) * 4 + q) * 32] = acc[mt][nt][q];
            __syncthreads();
            if (kw == 0) {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int q = 0; q < 4; ++q) {
                            float sum = 0.f;
                            for (int k2 = 0; k2 < WK; ++k2)   // fixed order: deterministic
                                sum += red[((size_t)((k2 * WM + wm) * 2 * NT * 4) + (mt * NT + nt) * 4 + q) * 32 + lane];
                            acc[mt][nt][q] = sum;
                        }
            }
        }

        if (kw == 0 && wactive) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int j = nt * 8 + 2 * t + (q & 1);
                    const int pair = MODE == 1 ? __shfl_sync(0xFFFFFFFFu, my_pair, j & 31) : 0;
                    const float wgt = MODE == 1 ? __shfl_sync(0xFFFFFFFFu, my_w, j & 31) : 0.f;
                    if (j >= ntok) continue;
                    const int slot = slot0 + j;
                    if (MODE == 0) {
                        const int row = (tile0 >> 1) * 16 + g + 8 * (q >> 1);
                        const float gv = acc[0][nt][q], uv = acc[1][nt][q];
                        const float hv = gv / (1.f + expf(-gv)) * uv;
                        h_out[(size_t)slot * h_stride + row] = f32_to_bf16(hv);
                    } else {
#pragma unroll
                        for (int mt = 0; mt < 2; ++mt) {
                            const int row = (tile0 + mt) * 16 + g + 8 * (q >> 1);
                            y[(size_t)pair * N + row] = wgt * acc[mt][nt][q];
                        }
                    }
                }
        }
        if (WK > 1) __syncthreads();   // red[] is reused by the next unit
    }
}

// ---------------------------------------------------------------------------------------------------------
// out[t][n] = bf16( sum_{j < k valid, in order} y[t*k+j][n] (+ residual[t][n]) ). Deterministic (no atomics);
// a token without any valid id gets the residual (or 0). grid (ceil(H/1024), T), 256 threads x 4 columns.
// (Folding this sum into the down GEMM -- the warp that brings a token's last pair reduces it, behind a
// fence and an arrival counter -- measured 6-67% slower on the H200 at every T but one: docs/MOE.md.)
// ---------------------------------------------------------------------------------------------------------
// The first COMBINE_KU pairs' ids, then their y rows and the residual, are all requested before
// any is added (the loop over a runtime k issued one dependent ids -> y round trip per pair: 3.5 us at T = 8 on
// the H200 for 1.8 MB); the sum keeps the pair order, so the output is the same bits.
#define COMBINE_KU 8
extern "C" __global__ void moe_combine(const float* __restrict__ y, const int* __restrict__ ids, int k, int E,
                                       int H, const bf16_bits* __restrict__ residual, int has_res,
                                       bf16_bits* __restrict__ out) {
    DDT_PDL_WAIT();
    const int t = blockIdx.y;
    const int n = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (n >= H) return;
    bool ok[COMBINE_KU];
#pragma unroll
    for (int j = 0; j < COMBINE_KU; ++j) {
        const int e = j < k ? ids[t * k + j] : -1;
        ok[j] = e >= 0 && e < E;
    }
    float4 v[COMBINE_KU];
#pragma unroll
    for (int j = 0; j < COMBINE_KU; ++j)
        if (ok[j]) v[j] = *reinterpret_cast<const float4*>(y + (size_t)(t * k + j) * H + n);
    const uint2 r = has_res ? *reinterpret_cast<const uint2*>(residual + (size_t)t * H + n) : make_uint2(0u, 0u);
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < COMBINE_KU; ++j)
        if (ok[j]) { s.x += v[j].x; s.y += v[j].y; s.z += v[j].z; s.w += v[j].w; }
    for (int j = COMBINE_KU; j < k; ++j) {           // (top-k above COMBINE_KU: the rest one by one, in order)
        const int e = ids[t * k + j];
        if (e < 0 || e >= E) continue;
        const float4 w = *reinterpret_cast<const float4*>(y + (size_t)(t * k + j) * H + n);
        s.x += w.x; s.y += w.y; s.z += w.z; s.w += w.w;
    }
    if (has_res) {
        s.x += bf_lo(r.x); s.y += bf_hi(r.x); s.z += bf_lo(r.y); s.w += bf_hi(r.y);
    }
    uint2 o;
    o.x = (uint32_t)f32_to_bf16(s.x) | ((uint32_t)f32_to_bf16(s.y) << 16);
    o.y = (uint32_t)f32_to_bf16(s.z) | ((uint32_t)f32_to_bf16(s.w) << 16);
    *reinterpret_cast<uint2*>(out + (size_t)t * H + n) = o;
}
