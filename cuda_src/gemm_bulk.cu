// Skinny bf16 GEMM, bulk-copy streaming variant (issue #4): y[T, N] = x[T, K] @ W[N, K]^T, fp32 accumulate.
//
// Same contract and argument list as gemm_bf16_kernel (gemm_bf16.cu), so the wrapper launches both alike and
// sums split-K partials with the same gemm_splitk_reduce (fixed split order: deterministic).
// Why a second design: the cp.async kernels spend registers and issue slots on 16-byte copies (one per
// thread per chunk), keep only a few stages in flight, and at T >= 32 every warp re-reads every token
// fragment. Here
//  * one producer warp moves a stage (BM weight rows x BK k, and the T token rows x BK k) global -> shared
//    with cp.async.bulk (the copy engine: no registers, one request per row segment, since each weight row's
//    k-segment is contiguous), completing on the stage's "full" mbarrier (expect_tx counts the bytes);
//  * the consumer warps only wait on "full", ldmatrix + mma, and release the stage by arriving on its
//    "empty" mbarrier, which the producer waits on before refilling the slot: STAGES-1 stages stay in flight
//    while one is consumed, with no block-wide barrier in the main loop;
//  * a consumer warp owns a 2-D tile: MT m16 weight tiles x NTW n8 token tiles, the warps laid out WM x WN,
//    so a block of BM = 16 MT WM rows reuses one token tile of TB = 8 NTW WN rows (x is read from L2 once per
//    block and stage, not once per warp);
//  * a row segment is copied as a whole into a row of pitch 2 BK + 16 bytes: the 16-byte pad puts the 8 rows
//    an ldmatrix phase reads at one k chunk into 8 different 4-bank groups (conflict-free) without a swizzle,
//    which a linear bulk copy could not apply;
//  * rows past N and tokens past T are not copied: their shared rows hold stale data that only reaches
//    output elements never stored (mma row i of D reads only row i of A, column j only column j of B).
// PDL: the producer issues the first STAGES weight stages before DDT_PDL_WAIT() (weights never depend on an
// earlier kernel), then waits and issues their token rows; each stage completes on its own barrier, so no
// stage waits for another's copies. Consumers wait (DDT_PDL_WAIT) before they write out / ws.
#include "common.cuh"

__device__ __forceinline__ uint32_t bulk_smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define DDT_HAS_BULK 1
#endif

#ifdef DDT_HAS_BULK
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
// Arrive once and add `bytes` to the phase's expected transaction count (the producer, per stage fill).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    uint64_t state;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;\n"
                 : "=l"(state) : "r"(bar), "r"(bytes) : "memory");
    (void)state;
}
// Plain arrive (release: this thread's earlier shared-memory reads are ordered before the slot's refill).
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    uint64_t state;
    asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n" : "=l"(state) : "r"(bar) : "memory");
    (void)state;
}
// Spin until the phase with the given parity has completed (acquire: its copies / reads are visible).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// One bulk copy global -> this block's shared memory, completing `bytes` on mbarrier `bar`. `policy` is an
// L2 cache policy (weights: evict-first, they are read once per step; tokens: normal, every block reads them).
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                         uint64_t policy) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                 " [%0], [%1], %2, [%3], %4;\n"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(policy) : "memory");
}
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
    uint64_t p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
    return p;
}
__device__ __forceinline__ uint64_t l2_policy_evict_normal() {
    uint64_t p;
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(p));
    return p;
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(uint32_t addr, uint32_t& r0, uint32_t& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}
__device__ __forceinline__ void mma_bf16(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    // not volatile: a pure register operation the scheduler may move (ldmatrix stays volatile: it reads
    // shared memory and must not move above the mbarrier wait)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif

#define BULK_BAR_BYTES 128   // 2 x STAGES mbarriers (8 B each, STAGES <= 8) before the tiles (16 B aligned)

// Resident blocks per SM the register allocation must allow (2 on the H200 by shared memory; the largest
// token tiles hold 80 fp32 accumulators per thread and get the whole register file of one block).
template <int MT, int NTW>
struct BulkOcc { static constexpr int value = (MT * NTW <= 8) ? 2 : 1; };

// MT m16 weight tiles x NTW n8 token tiles per consumer warp; WM x WN consumer warps (+1 producer warp);
// BK k per stage; STAGES slots. Grid: (ceil(N / BM), split, batch); ws / k_stages_per_split as in the
// split-K kernel (per = k stages of BK per split, split > 1 writes fp32 partials to ws).
template <int MT, int NTW, int WM, int WN, int BK, int STAGES, bool OUT_F32>
__global__ void __launch_bounds__(32 * (WM * WN + 1), (BulkOcc<MT, NTW>::value))
gemm_bf16_kernel_bulk(const bf16_bits* __restrict__ x, long long x_batch_stride, int x_row_stride,
                      const bf16_bits* __restrict__ w, long long w_batch_stride,
                      void* __restrict__ out, long long out_batch_stride, int out_row_stride,
                      float* __restrict__ ws, int T, int N, int K, int k_stages_per_split) {
#ifdef DDT_HAS_BULK
    constexpr int CW = WM * WN;                   // consumer warps
    constexpr int BM = 16 * MT * WM;              // weight rows per block
    constexpr int TB = 8 * NTW * WN;              // token rows per block (>= T, chosen by the wrapper)
    constexpr int PITCH = 2 * BK + 16;            // bytes per shared row (16-byte pad: conflict-free ldmatrix)
    constexpr int WSTAGE = BM * PITCH, XSTAGE = TB * PITCH;
    static_assert(BK % 64 == 0 || BK == 32, "BK: 32 or a multiple of 64");
    static_assert(STAGES >= 2 && 2 * STAGES * 8 <= BULK_BAR_BYTES, "STAGES: 2..8");
    static_assert(NTW % 2 == 0 || NTW == 1, "NTW: 1 or even (token fragments are loaded in pairs)");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const uint32_t sbase = bulk_smem_addr(smem_raw);
    const uint32_t full0 = sbase, empty0 = sbase + 8 * STAGES;          // mbarrier addresses: + 8 * slot
    const uint32_t w_s = sbase + BULK_BAR_BYTES;                          // [STAGES][BM][PITCH]
    const uint32_t x_s = w_s + STAGES * WSTAGE;                           // [STAGES][TB][PITCH]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n0 = blockIdx.x * BM;
    const int split = gridDim.y, sidx = blockIdx.y, b = blockIdx.z;
    const int k_stages = K / BK;
    const int ks0 = sidx * k_stages_per_split;
    const int nks = min(k_stages_per_split, k_stages - ks0);             // >= 1 (the wrapper: no empty split)
    x += b * x_batch_stride;
    w += b * w_batch_stride;

    DDT_PDL_LAUNCH_DEPENDENTS();            // the next kernel may launch; its DDT_PDL_WAIT() covers this grid
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);     // the producer's arrive.expect_tx; then the copies' bytes
            mbar_init(empty0 + 8 * s, CW);   // one arrive per consumer warp
        }
        // make the initialised barriers visible to the copy engine (async proxy) and the other threads
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();                        // the only block-wide barrier: roles split below

    if (warp == CW) {
        // ---------------- producer warp ----------------
        const int rows = min(BM, N - n0);                  // weight rows that exist (N % 16 == 0)
        const uint32_t seg = 2 * BK;                       // bytes per row segment (multiple of 16)
        const uint32_t stage_bytes = (uint32_t)(rows + T) * seg;
        const uint64_t pol_w = l2_policy_evict_first(), pol_x = l2_policy_evict_normal();
        const bf16_bits* wrow = w + (long long)n0 * K;
        auto issue_w = [&](int slot, int kst) {
            const bf16_bits* src = wrow + (long long)kst * BK;
            const uint32_t dst = w_s + slot * WSTAGE, bar = full0 + 8 * slot;
            for (int r = lane; r < rows; r += 32)
                bulk_g2s(dst + r * PITCH, src + (long long)r * K, seg, bar, pol_w);
        };
        auto issue_x = [&](int slot, int kst) {
            const bf16_bits* src = x + (long long)kst * BK;
            const uint32_t dst = x_s + slot * XSTAGE, bar = full0 + 8 * slot;
            for (int t = lane; t < T; t += 32)
                bulk_g2s(dst + t * PITCH, src + (long long)t * x_row_stride, seg, bar, pol_x);
        };
        const int pro = min(STAGES, nks);
        for (int s = 0; s < pro; ++s) {                    // weights only: allowed before the wait
            if (lane == 0) mbar_arrive_expect_tx(full0 + 8 * s, stage_bytes);
            __syncwarp();                                  // expect_tx before any of the stage's copies land
            issue_w(s, ks0 + s);
        }
        DDT_PDL_WAIT();                                    // x belongs to an earlier kernel in the stream
        for (int s = 0; s < pro; ++s) issue_x(s, ks0 + s);
        for (int it = STAGES; it < nks; ++it) {
            const int slot = it % STAGES;
            mbar_wait(empty0 + 8 * slot, (uint32_t)((it / STAGES - 1) & 1));   // consumers released it
            if (lane == 0) mbar_arrive_expect_tx(full0 + 8 * slot, stage_bytes);
            __syncwarp();
            issue_w(slot, ks0 + it);
            issue_x(slot, ks0 + it);
        }
        return;                             // the block lives on until the consumers have drained every stage
    }

    // ---------------- consumer warps ----------------
    DDT_PDL_WAIT();                         // ws and out may still be read by earlier kernels
    const int wm = warp % WM, wn = warp / WM;
    const int r0 = wm * 16 * MT, t0 = wn * 8 * NTW;     // this warp's first weight row / token in the block
    float acc[MT][NTW][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NTW; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
    // ldmatrix lane addresses (byte offsets in a stage): A rows r0 + 16 i + (lane & 15), k chunk + (lane >> 4);
    // B pairs of n8 tiles: token rows t0 + 8 j + (lane & 7) + 8 (lane >> 4), k chunk + ((lane >> 3) & 1).
    const uint32_t a_off = (uint32_t)((r0 + (lane & 15)) * PITCH + (lane >> 4) * 16);
    const uint32_t b_off = NTW == 1 ? (uint32_t)((t0 + (lane & 7)) * PITCH + ((lane >> 3) & 1) * 16)
                                    : (uint32_t)((t0 + (lane & 7) + ((lane >> 4) << 3)) * PITCH
                                                 + ((lane >> 3) & 1) * 16);

    for (int it = 0; it < nks; ++it) {
        const int slot = it % STAGES;
        mbar_wait(full0 + 8 * slot, (uint32_t)((it / STAGES) & 1));     // this stage's bytes have landed
        const uint32_t ws_ = w_s + slot * WSTAGE + a_off, xs_ = x_s + slot * XSTAGE + b_off;
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            uint32_t a[MT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i)
                ldsm_x4(ws_ + i * 16 * PITCH + kk * 32, a[i][0], a[i][1], a[i][2], a[i][3]);
            if constexpr (NTW == 1) {
                uint32_t b0, b1;
                ldsm_x2(xs_ + kk * 32, b0, b1);
#pragma unroll
                for (int i = 0; i < MT; ++i) mma_bf16(acc[i][0], a[i][0], a[i][1], a[i][2], a[i][3], b0, b1);
            } else {
#pragma unroll
                for (int j = 0; j < NTW; j += 2) {
                    if (t0 + 8 * j < T) {           // warp-uniform: token tiles past T are never stored
                        uint32_t b0, b1, b2, b3;
                        ldsm_x4(xs_ + j * 8 * PITCH + kk * 32, b0, b1, b2, b3);
#pragma unroll
                        for (int i = 0; i < MT; ++i) {
                            mma_bf16(acc[i][j], a[i][0], a[i][1], a[i][2], a[i][3], b0, b1);
                            mma_bf16(acc[i][j + 1], a[i][0], a[i][1], a[i][2], a[i][3], b2, b3);
                        }
                    }
                }
            }
        }
        __syncwarp();                       // every lane's ldmatrix of this slot is done ...
        if (lane == 0) mbar_arrive(empty0 + 8 * slot);   // ... so the producer may refill it
    }

    // D fragment: c0,c1 = (row lane/4, tokens 2*(lane%4)+{0,1}); c2,c3 = row + 8. One base pointer and row
    // stride for the three destinations (split partials, fp32 out, bf16 out) keeps the epilogue's registers low.
    const bool to_ws = split > 1;
    const long long base = to_ws ? ((long long)b * split + sidx) * T * N : b * out_batch_stride;
    const long long stride = to_ws ? (long long)N : (long long)out_row_stride;
    const int nl = n0 + r0 + (lane >> 2), tl = t0 + 2 * (lane & 3);
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int j = 0; j < NTW; ++j) {
            if (t0 + 8 * j >= T) continue;          // warp-uniform: a token tile past T
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int n = nl + i * 16 + (e >> 1) * 8, t = tl + j * 8 + (e & 1);
                if (n < N && t < T) {
                    const long long o = base + t * stride + n;
                    if (to_ws) ws[o] = acc[i][j][e];
                    else if (OUT_F32) ((float*)out)[o] = acc[i][j][e];
                    else ((bf16_bits*)out)[o] = f32_to_bf16(acc[i][j][e]);
                }
            }
        }
    }
#endif
}
