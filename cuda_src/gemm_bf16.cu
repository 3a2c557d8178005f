// Skinny bf16 GEMM for decode: y[T, N] = x[T, K] @ W[N, K]^T, fp32 accumulate, bf16 (or fp32) out.
//
// T (tokens) is small (1..160) and W is large, so the kernel is built to stream W exactly once:
//  * the weight is the mma "A" operand (16 weight rows = 16 output features per m16 tile) and the tokens
//    are "B" (8 tokens per n8 tile), so T = 1 wastes nothing on the weight side;
//  * a block owns GEMM_BN = 64 weight rows (4 warps x 16) and one K-range (split-K), every token;
//  * weight and token tiles go global -> shared with cp.async in a STAGES-deep ring, so many bytes are
//    in flight per SM, and shared -> registers with ldmatrix from an XOR-swizzled layout (no bank
//    conflicts);
//  * split-K > 1 writes fp32 partials to a workspace [batch][split][T][N] and gemm_splitk_reduce sums
//    them in a fixed order (deterministic, graph-capturable, no atomics).
// A batch index (gridDim.z) with element strides serves per-head products (MLA absorbed W_UK / W_UV).
// PDL (common.cuh): both kernels wait before their first global access, and let the next kernel launch at
// once, so with programmatic dependent launch (kernels/launch.py) a kernel's launch and block scheduling
// overlap its predecessor's tail (docs/KERNELS.md "PDL").
#include "common.cuh"
#include "cluster.cuh"

#define GEMM_BN 64          // weight rows (output features) per block
#define GEMM_BK 64          // k per pipeline stage: 128 bytes per row = 8 chunks of 16 bytes
#define GEMM_THREADS 128    // 4 warps, one m16 tile of weight rows each

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// 16-byte async copy; src_bytes = 0 zero-fills the destination (rows past T or N).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// Row r, 16-byte chunk c of a [rows][8 chunks] tile: chunk index XOR (r & 7), so the 8 rows an ldmatrix
// phase reads at one logical chunk land in 8 different bank groups.
__device__ __forceinline__ int swz(int r, int c) { return r * 8 + (c ^ (r & 7)); }

// The cp.async ring of STAGES slots over k tiles kt0 .. kt0 + nkt - 1, shared by the GEMM bodies below.
// load(slot, k tile) issues one stage's copies. Fill: stages 0 .. STAGES - 2, one group each, committed even
// when empty so the group count stays in step.
template <int STAGES, typename Load>
__device__ __forceinline__ void cp_ring_fill(int nkt, int kt0, Load&& load) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nkt) load(s, kt0 + s);
        cp_async_commit();
    }
}
// Step `it`: this thread's copies of stage `it` have landed; the barrier of the threads that share the
// slots (BLOCK: the block, else the warp) makes every thread's visible and frees slot (it - 1) % STAGES,
// which takes stage it + STAGES - 1; its group is committed (even when empty).
template <int STAGES, bool BLOCK, typename Load>
__device__ __forceinline__ void cp_ring_step(int it, int nkt, int kt0, Load&& load) {
    cp_async_wait<STAGES - 2>();
    if constexpr (BLOCK) __syncthreads();
    else __syncwarp();
    const int nxt = it + STAGES - 1;
    if (nxt < nkt) load(nxt % STAGES, kt0 + nxt);
    cp_async_commit();
}

// Output element o: fp32, or bf16 (round to nearest even).
template <bool OUT_F32>
__device__ __forceinline__ void gemm_store_out(void* __restrict__ out, long long o, float v) {
    if (OUT_F32) ((float*)out)[o] = v;
    else ((bf16_bits*)out)[o] = f32_to_bf16(v);
}
// An accumulator's element (token t, feature n) of batch b, split sidx of `split`: the fp32 partial in the
// workspace [batch][split][T][N] when split > 1, else the output element.
template <bool OUT_F32>
__device__ __forceinline__ void gemm_store_acc(float v, int b, int t, int n, int T, int N, int split, int sidx,
                                               float* __restrict__ ws, void* __restrict__ out,
                                               long long out_batch_stride, int out_row_stride) {
    if (split > 1) ws[(((long long)b * split + sidx) * T + t) * N + n] = v;
    else gemm_store_out<OUT_F32>(out, b * out_batch_stride + (long long)t * out_row_stride + n, v);
}

template <int NT, int STAGES, bool OUT_F32>
__global__ void __launch_bounds__(GEMM_THREADS, (NT <= 8 ? 2 : 0))
gemm_bf16_kernel(const bf16_bits* __restrict__ x, long long x_batch_stride, int x_row_stride,
                 const bf16_bits* __restrict__ w, long long w_batch_stride,
                 void* __restrict__ out, long long out_batch_stride, int out_row_stride,
                 float* __restrict__ ws, int T, int N, int K, int k_tiles_per_split) {
    extern __shared__ uint4 smem[];
    uint4* w_s = smem;                                   // [STAGES][GEMM_BN * 8]
    uint4* x_s = smem + STAGES * GEMM_BN * 8;            // [STAGES][NT * 8 * 8]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n0 = blockIdx.x * GEMM_BN;
    const int split = gridDim.y, sidx = blockIdx.y, b = blockIdx.z;
    const int k_tiles = K / GEMM_BK;
    const int kt0 = sidx * k_tiles_per_split;
    const int nkt = min(k_tiles_per_split, k_tiles - kt0);
    x += b * x_batch_stride;
    w += b * w_batch_stride;
    DDT_PDL_LAUNCH_DEPENDENTS();            // the next kernel may launch; its DDT_PDL_WAIT() covers this grid
    DDT_PDL_WAIT();                         // x, ws and out belong to earlier kernels in the stream

    auto load_stage = [&](int slot, int kt) {
        uint4* ws_ = w_s + slot * GEMM_BN * 8;
        const int k = kt * GEMM_BK;
#pragma unroll
        for (int j = 0; j < GEMM_BN * 8 / GEMM_THREADS; ++j) {
            const int i = tid + j * GEMM_THREADS, r = i >> 3, c = i & 7;
            const int n = n0 + r;
            const bf16_bits* src = n < N ? w + (long long)n * K + k + c * 8 : w;
            cp_async16(smem_addr(ws_ + swz(r, c)), src, n < N ? 16 : 0);
        }
        uint4* xs_ = x_s + slot * NT * 64;
#pragma unroll
        for (int j = 0; j < (NT * 64 + GEMM_THREADS - 1) / GEMM_THREADS; ++j) {
            const int i = tid + j * GEMM_THREADS;
            if (i < NT * 64) {
                const int r = i >> 3, c = i & 7;
                const bf16_bits* src = r < T ? x + (long long)r * x_row_stride + k + c * 8 : x;
                cp_async16(smem_addr(xs_ + swz(r, c)), src, r < T ? 16 : 0);
            }
        }
    };

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

    cp_ring_fill<STAGES>(nkt, kt0, load_stage);

    for (int it = 0; it < nkt; ++it) {
        cp_ring_step<STAGES, true>(it, nkt, kt0, load_stage);   // stage `it` visible to the block

        const uint4* ws_ = w_s + (it % STAGES) * GEMM_BN * 8;
        const uint4* xs_ = x_s + (it % STAGES) * NT * 64;
#pragma unroll
        for (int kk = 0; kk < GEMM_BK / 16; ++kk) {
            uint32_t a0, a1, a2, a3;
            {   // A: 16 weight rows x 16 k; lanes 0-15 address rows at k 0-7, lanes 16-31 at k 8-15
                const int r = warp * 16 + (lane & 15), c = kk * 2 + (lane >> 4);
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(smem_addr(ws_ + swz(r, c))));
            }
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                uint32_t b0, b1, b2 = 0, b3 = 0;
                const int c = kk * 2 + ((lane >> 3) & 1);
                if (j + 1 < NT) {   // two n8 token tiles at once: matrices (t0-7,k0-7) (t0-7,k8-15) (t8-15,..)
                    const int r = j * 8 + (lane & 7) + ((lane >> 4) << 3);
                    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                                 : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(smem_addr(xs_ + swz(r, c))));
                } else {
                    const int r = j * 8 + (lane & 7);
                    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                                 : "=r"(b0), "=r"(b1) : "r"(smem_addr(xs_ + swz(r, c))));
                }
                asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                             "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                             : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
                             : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
                if (j + 1 < NT) {
                    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                                 : "+f"(acc[j + 1][0]), "+f"(acc[j + 1][1]), "+f"(acc[j + 1][2]),
                                   "+f"(acc[j + 1][3])
                                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b2), "r"(b3));
                }
            }
        }
    }
    cp_async_wait<0>();

    // D fragment: c0,c1 = (feature lane/4, tokens 2*(lane%4)+{0,1}); c2,c3 = feature + 8.
    const int nf = n0 + warp * 16 + (lane >> 2);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int n = nf + (e >> 1) * 8, t = j * 8 + 2 * (lane & 3) + (e & 1);
            if (n < N && t < T)
                gemm_store_acc<OUT_F32>(acc[j][e], b, t, n, T, N, split, sidx, ws, out, out_batch_stride,
                                        out_row_stride);
        }
    }
}

// Sum the split-K partials in split order (deterministic) and write bf16 or fp32.
template <bool OUT_F32>
__global__ void gemm_splitk_reduce(const float* __restrict__ ws, int split, int T, int N,
                                   void* __restrict__ out, long long out_batch_stride, int out_row_stride) {
    DDT_PDL_LAUNCH_DEPENDENTS();
    DDT_PDL_WAIT();                         // the partials come from the GEMM just before
    const int b = blockIdx.y;
    const long long tn = (long long)T * N;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < tn; i += (long long)gridDim.x * blockDim.x) {
        const float* p = ws + (long long)b * split * tn + i;
        float s = 0.f;
        for (int k = 0; k < split; ++k) s += p[k * tn];
        const int t = (int)(i / N), n = (int)(i % N);
        gemm_store_out<OUT_F32>(out, b * out_batch_stride + (long long)t * out_row_stride + n, s);
    }
}

// ---------------------------------------------------------------------------------------------------------
// Decode family (T <= 16): parallel over output rows, K split inside the block and, optionally,
// across the CS blocks of a thread-block cluster.
//  * a block = RT m16 tiles of weight rows (16 RT output features) x its K range x all tokens (NT <= 2 n8
//    tiles); its DEC_WARPS warps are RT row tiles x KS = DEC_WARPS / RT contiguous K slices (sizes differ
//    by at most one 64-wide tile). RT > 1 serves short K (o_proj K = 1024: 2 tiles per warp at RT = 1, so
//    the ring's fill and drain were most of a block's life) and fits a grid into one wave of resident
//    blocks (dense down: 448 -> 224 blocks for 264 slots);
//  * CS > 1 (RT = 1): the CS blocks of a cluster (grid.y) split K further, for weights with too few row
//    tiles to fill the GPU (drafter qkv: 80 row tiles on 132 SMs; router 24). Their partial sums meet
//    through distributed shared memory (no workspace, no counters, nothing to reset between graph replays)
//    and every output is summed in cluster-rank order: deterministic, bit-identical run to run;
//  * each warp streams its slice through its own cp.async ring (weights + token tile per stage), so the
//    main loop synchronises with __syncwarp only;
//  * the first STAGES-1 weight stages are issued before DDT_PDL_WAIT() (weights never depend on earlier
//    kernels), one cp.async group each; the token tiles of those stages follow after the wait as one more
//    group, all in flight at once, and one wait for every prologue group precedes the main loop;
//  * at the end the warps' fp32 fragments meet in shared memory (reusing the rings) and are summed in
//    K-slice order, one output per thread: no second launch.
// Same argument list as gemm_bf16_kernel (ws and the last int unused), so all launch alike.
#define DEC_WARPS 8
#define DEC_THREADS (DEC_WARPS * 32)

// The decode GEMM's stage copies (gemm_decode_body; the persistent executor's GEMM runs do the same with
// their addresses computed once per run), by one warp: 16 weight rows x 64 k from `src` (row stride K) into
// the swizzled stage `d`; the NT x 8 token rows of x at column k (rows past T zero-filled), both as
// cp.async.cg.
__device__ __forceinline__ void decode_load_w(uint4* d, const bf16_bits* src, int K, int lane) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int i = lane + 32 * j, r = i >> 3, c = i & 7;
        cp_async16(smem_addr(d + swz(r, c)), src + (long long)r * K + c * 8, 16);
    }
}
template <int NT>
__device__ __forceinline__ void decode_load_x(uint4* d, const bf16_bits* x, int x_row_stride, int k, int T, int lane) {
#pragma unroll
    for (int j = 0; j < 2 * NT; ++j) {
        const int i = lane + 32 * j, r = i >> 3, c = i & 7;
        const bf16_bits* src = x + (long long)r * x_row_stride + k + c * 8;
        cp_async16(smem_addr(d + swz(r, c)), r < T ? src : x, r < T ? 16 : 0);
    }
}

// One ring stage of the decode GEMM (gemm_decode_body; the executor's GEMM runs do the same on shared
// addresses): the 16 weight rows x 64 k of `ws_` times the NT x 8 token rows of `xs_` (both XOR-swizzled)
// into the warp's accumulators.
template <int NT>
__device__ __forceinline__ void decode_mma_stage(const uint4* ws_, const uint4* xs_, int lane, float (&acc)[NT][4]) {
#pragma unroll
    for (int kk = 0; kk < GEMM_BK / 16; ++kk) {
        uint32_t a0, a1, a2, a3, b0, b1, b2 = 0, b3 = 0;
        {   // A: 16 weight rows x 16 k; lanes 0-15 address rows at k 0-7, lanes 16-31 at k 8-15
            const int r = lane & 15, c = kk * 2 + (lane >> 4);
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                         : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(smem_addr(ws_ + swz(r, c))));
        }
        const int c = kk * 2 + ((lane >> 3) & 1);
        if (NT == 2) {      // matrices (t0-7,k0-7) (t0-7,k8-15) (t8-15,k0-7) (t8-15,k8-15)
            const int r = (lane & 7) + ((lane >> 4) << 3);
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                         : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(smem_addr(xs_ + swz(r, c))));
        } else {
            const int r = lane & 7;
            asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                         : "=r"(b0), "=r"(b1) : "r"(smem_addr(xs_ + swz(r, c))));
        }
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(acc[0][0]), "+f"(acc[0][1]), "+f"(acc[0][2]), "+f"(acc[0][3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        if (NT == 2) {
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                         "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                         : "+f"(acc[NT - 1][0]), "+f"(acc[NT - 1][1]), "+f"(acc[NT - 1][2]),
                           "+f"(acc[NT - 1][3])
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b2), "r"(b3));
        }
    }
}

// The light ring (NT = 1, 3 stages, 72 KB) exists so 3 blocks fit an H200 SM: cap registers at 80 for it.
template <int NT, int STAGES>
struct DecOcc { static constexpr int value = (NT == 1 && STAGES == 3) ? 3 : 2; };

template <int NT, int STAGES, bool OUT_F32, int RT, int CS, typename WaitHook = PdlWaitHook>
__device__ __forceinline__ void gemm_decode_body(
        const bf16_bits* __restrict__ x, long long x_batch_stride, int x_row_stride,
        const bf16_bits* __restrict__ w, long long w_batch_stride,
        void* __restrict__ out, long long out_batch_stride, int out_row_stride, int T, int N, int K,
        int tile_x, int tile_z, WaitHook wait_inputs = WaitHook()) {
    // tile_x / tile_z: the block's row tile and batch index (blockIdx.x / .z of the decode kernels; a work
    // item's tile in the persistent executor, cuda_src/persistent_layer.cu). wait_inputs (common.cuh) runs
    // after the weight prologue, before the first read of x: the PDL wait, or the executor's counter wait.
    constexpr int WST = 16 * 8;                 // uint4 per weight stage: 16 rows x 8 chunks of 16 B
    constexpr int XST = NT * 64;                // uint4 per token stage: NT*8 rows x 8 chunks
    constexpr int RS = NT * 8 + 1;              // reduction row stride in floats (+1: no bank conflicts)
    constexpr int KS = DEC_WARPS / RT;          // K slices per block
    constexpr int OUTS = 16 * RT * NT * 8;      // outputs per block (incl. token padding)
    static_assert(DEC_WARPS % RT == 0 && (CS == 1 || RT == 1), "RT divides the warps; clusters use RT = 1");
    static_assert((DEC_WARPS * 16 * RS + (CS > 1 ? OUTS : 0)) * 4 <= DEC_WARPS * STAGES * (WST + XST) * 16,
                  "reduction fits the rings");
    extern __shared__ uint4 smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rt = warp % RT, ks = warp / RT;
    uint4* w_s = smem + warp * STAGES * (WST + XST);    // this warp's ring: [STAGES][WST] then [STAGES][XST]
    uint4* x_s = w_s + STAGES * WST;
    const int n0 = tile_x * 16 * RT, b = tile_z;
    const int crank = CS > 1 ? (int)cluster_rank() : 0;
    const int k_tiles = K / GEMM_BK;
    const int kb0 = crank * k_tiles / CS, nb = (crank + 1) * k_tiles / CS - kb0;   // this block's K tiles
    const int kt0 = kb0 + ks * nb / KS;                 // this warp's slice
    const int nkt = kb0 + (ks + 1) * nb / KS - kt0;
    x += b * x_batch_stride;
    w += b * w_batch_stride + (long long)(n0 + rt * 16) * K;   // N % (16 RT) == 0 (wrapper): rows exist

    auto load_w = [&](int slot, int kt) { decode_load_w(w_s + slot * WST, w + kt * GEMM_BK, K, lane); };
    auto load_x = [&](int slot, int kt) {
        decode_load_x<NT>(x_s + slot * XST, x, x_row_stride, kt * GEMM_BK, T, lane);
    };

    DDT_PDL_LAUNCH_DEPENDENTS();            // the next kernel may launch; its DDT_PDL_WAIT() covers this grid
    cp_ring_fill<STAGES>(nkt, kt0, load_w);   // weights only: allowed before the wait
    wait_inputs();                          // x and out belong to earlier kernels / items
    // the prologue stages' token rows as cp.async, all in flight at once, then one wait (plain loads went a
    // round trip each where the compiler did not batch them: measured 0.1-0.8 us per launch)
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        if (s < nkt) load_x(s, kt0 + s);
    cp_async_commit();
    cp_async_wait<0>();                     // the weight prologue was requested before the wait: long landed

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

    for (int it = 0; it < nkt; ++it) {
        cp_ring_step<STAGES, false>(it, nkt, kt0, [&](int slot, int kt) {   // stage `it` visible to the warp
            load_w(slot, kt);
            load_x(slot, kt);
        });

        decode_mma_stage<NT>(w_s + (it % STAGES) * WST, x_s + (it % STAGES) * XST, lane, acc);
    }
    cp_async_wait<0>();                     // only empty groups can remain; keep the count clean anyway
    __syncthreads();                        // every warp is done with its ring: reuse it for the reduction

    // D fragment: c0,c1 = (row lane/4, tokens 2*(lane%4)+{0,1}); c2,c3 = row + 8.
    float* red = reinterpret_cast<float*>(smem);        // [DEC_WARPS][16 rows][RS]
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            red[(warp * 16 + (lane >> 2) + (e >> 1) * 8) * RS + j * 8 + 2 * (lane & 3) + (e & 1)] = acc[j][e];
    __syncthreads();
    // Output i of the block: feature row r = i % (16 RT) (consecutive threads -> consecutive features),
    // token t = i / (16 RT). The block's sum over its K slices, in slice order.
    auto block_sum = [&](int i) {
        const int r = i % (16 * RT), t = i / (16 * RT);
        const float* p = red + ((r >> 4) * 16 + (r & 15)) * RS + t;     // warp (ks = 0, rt = r / 16)
        float s = 0.f;
#pragma unroll
        for (int q = 0; q < KS; ++q) s += p[q * RT * 16 * RS];
        return s;
    };
    auto store = [&](int i, float s) {
        const int r = i % (16 * RT), t = i / (16 * RT);
        if (t < T) {
            const long long o = b * out_batch_stride + (long long)t * out_row_stride + n0 + r;
            if (OUT_F32) ((float*)out)[o] = s;
            else ((bf16_bits*)out)[o] = f32_to_bf16(s);
        }
    };
    if (CS == 1) {
        for (int i = tid; i < OUTS; i += DEC_THREADS)
            if (i / (16 * RT) < T) store(i, block_sum(i));
    } else {
        float* part = red + DEC_WARPS * 16 * RS;        // [OUTS] this block's partial, read by the cluster
        for (int i = tid; i < OUTS; i += DEC_THREADS) part[i] = block_sum(i);
        cluster_sync_all();                 // every block's partial is written and visible cluster-wide
        // Block `crank` finishes the outputs [crank, crank + 1) * OUTS / CS, summing ranks 0..CS-1 in order.
        const int i0 = crank * OUTS / CS, i1 = (crank + 1) * OUTS / CS;
        for (int i = i0 + tid; i < i1; i += DEC_THREADS) {
            if (i / (16 * RT) >= T) continue;
            float s = 0.f;
#pragma unroll
            for (int q = 0; q < CS; ++q) s += ld_cluster_f32(part + i, (uint32_t)q);
            store(i, s);
        }
        cluster_sync_all();                 // no block leaves (freeing its shared memory) while read remotely
    }
}

// RT row tiles per block, no cluster. (OUT_F32 is the last template argument of every GEMM kernel: the CPU
// emulation in tests/_kernel_emul.py reads the output type from it.)
template <int NT, int STAGES, int RT, bool OUT_F32>
__global__ void __launch_bounds__(DEC_THREADS, (DecOcc<NT, STAGES>::value))
gemm_bf16_kernel_decode(const bf16_bits* __restrict__ x, long long x_batch_stride, int x_row_stride,
                        const bf16_bits* __restrict__ w, long long w_batch_stride,
                        void* __restrict__ out, long long out_batch_stride, int out_row_stride,
                        float* __restrict__ ws_unused, int T, int N, int K, int unused) {
    gemm_decode_body<NT, STAGES, OUT_F32, RT, 1>(x, x_batch_stride, x_row_stride, w, w_batch_stride, out,
                                                 out_batch_stride, out_row_stride, T, N, K,
                                                 blockIdx.x, blockIdx.z);
}

#ifdef DDT_HAS_CLUSTERS
// One m16 row tile per block, K split over a cluster of CS blocks along grid.y (compile-time cluster shape:
// an ordinary launch, or the PDL one, needs no cluster attribute).
template <int NT, int STAGES, int CS, bool OUT_F32>
__global__ void __cluster_dims__(1, CS, 1) __launch_bounds__(DEC_THREADS, 2)
gemm_bf16_kernel_decode_cl(const bf16_bits* __restrict__ x, long long x_batch_stride, int x_row_stride,
                           const bf16_bits* __restrict__ w, long long w_batch_stride,
                           void* __restrict__ out, long long out_batch_stride, int out_row_stride,
                           float* __restrict__ ws_unused, int T, int N, int K, int unused) {
    gemm_decode_body<NT, STAGES, OUT_F32, 1, CS>(x, x_batch_stride, x_row_stride, w, w_batch_stride, out,
                                                 out_batch_stride, out_row_stride, T, N, K,
                                                 blockIdx.x, blockIdx.z);
}
#endif

// The cluster reduction of the wide family (CS > 1). Every block parks its fp32 tile in its drained ring as
// [BT tokens][BM + 4 rows] (row stride = 4 mod 32 banks: the fragment stores of a warp hit 32 distinct banks,
// and a token row is 16-byte aligned for the float4 reads), the cluster syncs, and block `rank` finishes the
// float4 groups [rank, rank + 1) x BT BM / 4 / CS of the tile (token-major: consecutive threads -> consecutive
// features, coalesced stores), summing ranks 0..CS-1 in order: deterministic, bit-identical run to run.
template <int WM, int WN, int WARPS_M, int WARPS_N, bool OUT_F32, int CS>
__device__ __forceinline__ void wide_cluster_reduce(
        const float (&acc)[WM][WN][4], uint4* smem, int rank, int t0, int n0, int b,
        void* __restrict__ out, long long out_batch_stride, int out_row_stride, int T, int N) {
    constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int BM = 16 * WM * WARPS_M, BT = 8 * WN * WARPS_N, RS = BM + 4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp % WARPS_M, wn = warp / WARPS_M;
    float* red = reinterpret_cast<float*>(smem);
    __syncthreads();                        // every warp is done reading the ring
    // D fragment: c0,c1 = (row lane/4, tokens 2*(lane%4)+{0,1}); c2,c3 = row + 8. Idle warps store zeros.
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
        for (int j = 0; j < WN; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                red[(wn * WN * 8 + j * 8 + 2 * (lane & 3) + (e & 1)) * RS + (wm * WM + i) * 16 + (lane >> 2) +
                    (e >> 1) * 8] = acc[i][j][e];
    cluster_sync_all();                     // every block's tile is written and visible cluster-wide
    constexpr int Q = BT * BM / 4;
    for (int q = rank * Q / CS + (int)threadIdx.x; q < (rank + 1) * Q / CS; q += THREADS) {
        const int t = q / (BM / 4), r = (q % (BM / 4)) * 4;
        if (t0 + t >= T || n0 + r >= N) continue;          // N % 16 == 0: the 4 features all exist or none
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int c = 0; c < CS; ++c) {
            const float4 v = ld_cluster_f32x4(red + t * RS + r, (uint32_t)c);
            s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
        }
        const long long o = b * out_batch_stride + (long long)(t0 + t) * out_row_stride + n0 + r;
        if (OUT_F32) {
            float* d = (float*)out + o;
            d[0] = s.x; d[1] = s.y; d[2] = s.z; d[3] = s.w;
        } else {
            bf16_bits* d = (bf16_bits*)out + o;
            d[0] = f32_to_bf16(s.x); d[1] = f32_to_bf16(s.y); d[2] = f32_to_bf16(s.z); d[3] = f32_to_bf16(s.w);
        }
    }
    cluster_sync_all();                     // no block leaves (freeing its shared memory) while read remotely
}

// ---------------------------------------------------------------------------------------------------------
// Wide-token family (T = 17..160, docs/KERNELS.md "Wide-token kernel"): a block owns a
// tile of BM = 16 WM WARPS_M weight rows x BT = 8 WN WARPS_N tokens and one K range (split-K across blocks);
// its WARPS_M x WARPS_N warps (8: 4 x 2 with 32 x BT/2 warp tiles, or 4: 2 x 2 with 64 x BT/2 warp tiles,
// fewer ldmatrix per mma and fewer warps to hide latency).
//  * Operand reuse: each warp holds a 2-D fragment tile (WM m16 weight tiles x WN n8 token tiles), so per
//    k16 it issues WM + ceil(WN / 2) ldmatrix for WM x WN mma; the split-K kernel's warps own one m16 tile
//    against every token (ratio ~0.55 ldmatrix per mma at T = 160, and all 4 warps re-read the whole token
//    tile); here 0.5 at WM 2 x WN 4, 0.375 at WM 4 x WN 4.
//  * L2 -> shared traffic: each block reads its weight tile once per token tile and the token tile once per
//    BM rows; with BM = 128 the token side is half that of the split-K kernel's 64-row blocks.
//  * Grid: blockIdx.x = split * token_tiles + token tile (token tiles fastest), so the blocks that share a
//    weight tile are adjacent in launch order and run together: the weight crosses DRAM once, the
//    siblings hit L2. blockIdx.y = BM row block, blockIdx.z = batch.
//  * split > 1 writes fp32 partials [batch][split][T][N] summed by gemm_splitk_reduce in split order
//    (deterministic, no atomics); split == 1 writes the output directly.
//  * PDL: the first STAGES-1 weight stages are issued before DDT_PDL_WAIT(), one cp.async group each; the
//    token tiles of those stages are plain loads after the wait (no weight group queued behind a token
//    group), as in the decode family.
//  * CS > 1 (gemm_bf16_kernel_wide_cl): the K split is the CS blocks of a thread-block cluster along grid.x
//    instead (blockIdx.x = token tile x CS + cluster rank); their fp32 tiles meet through distributed shared
//    memory and each block sums its CS-th of the tile in rank order: no workspace, no reduce launch, and no
//    partials through L2 (o_proj at T = 32, split 4: 7 MB written and read against a 15 MB weight).
// Same argument list as gemm_bf16_kernel, the last int being the split count (the K range of split s is
// k tiles [s kt / split, (s + 1) kt / split)), output type last (tests/_kernel_emul.py).
template <int WM, int WN, int WARPS_M, int WARPS_N, int STAGES, bool OUT_F32, int CS>
__device__ __forceinline__ void gemm_wide_body(
        const bf16_bits* __restrict__ x, long long x_batch_stride, int x_row_stride,
        const bf16_bits* __restrict__ w, long long w_batch_stride,
        void* __restrict__ out, long long out_batch_stride, int out_row_stride,
        float* __restrict__ ws, int T, int N, int K, int split) {
    constexpr int WIDE_THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int BM = 16 * WM * WARPS_M, BT = 8 * WN * WARPS_N;
    constexpr int WST = BM * 8, XST = BT * 8;           // uint4 per stage: rows x 8 chunks of 16 bytes
    static_assert(WST % WIDE_THREADS == 0, "weight stage: whole chunks per thread");
    static_assert(STAGES >= 2 && STAGES * (WST + XST) * 16 <= 99 * 1024, "ring fits 99 KB");
    static_assert(CS == 1 || BT * (BM + 4) * 4 <= STAGES * (WST + XST) * 16, "cluster tile fits the ring");
    extern __shared__ uint4 smem[];
    uint4* w_s = smem;                                   // [STAGES][WST]
    uint4* x_s = smem + STAGES * WST;                    // [STAGES][XST]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp % WARPS_M, wn = warp / WARPS_M;
    const int tiles = (T + BT - 1) / BT;
    if (CS > 1) split = CS;
    const int tt = CS > 1 ? (int)blockIdx.x / CS : (int)blockIdx.x % tiles;
    const int sidx = CS > 1 ? (int)cluster_rank() : (int)blockIdx.x / tiles;
    const int t0 = tt * BT, n0 = blockIdx.y * BM, b = blockIdx.z;
    const int k_tiles = K / GEMM_BK;
    const int kt0 = sidx * k_tiles / split, nkt = (sidx + 1) * k_tiles / split - kt0;
    x += b * x_batch_stride + (long long)t0 * x_row_stride;
    w += b * w_batch_stride;
    // Warps whose rows lie past N or whose tokens lie past T (a padded token tile) skip the mma: the
    // copies and barriers stay block-wide, and their fragments (zero) are never stored.
    const bool active = (n0 + wm * WM * 16 < N) && (t0 + wn * WN * 8 < T);

    auto load_w = [&](int slot, int kt) {
        uint4* d = w_s + slot * WST;
        const int k = kt * GEMM_BK;
#pragma unroll
        for (int j = 0; j < WST / WIDE_THREADS; ++j) {
            const int i = tid + j * WIDE_THREADS, r = i >> 3, c = i & 7;
            const int n = n0 + r;
            cp_async16(smem_addr(d + swz(r, c)), n < N ? w + (long long)n * K + k + c * 8 : w, n < N ? 16 : 0);
        }
    };
    auto load_x = [&](int slot, int kt, bool async) {
        uint4* d = x_s + slot * XST;
        const int k = kt * GEMM_BK;
#pragma unroll
        for (int j = 0; j < (XST + WIDE_THREADS - 1) / WIDE_THREADS; ++j) {
            const int i = tid + j * WIDE_THREADS;
            if (XST % WIDE_THREADS == 0 || i < XST) {
                const int r = i >> 3, c = i & 7;
                const bool ok = t0 + r < T;
                const bf16_bits* src = x + (long long)r * x_row_stride + k + c * 8;
                if (async) cp_async16(smem_addr(d + swz(r, c)), ok ? src : x, ok ? 16 : 0);
                else d[swz(r, c)] = ok ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
            }
        }
    };

    DDT_PDL_LAUNCH_DEPENDENTS();            // the next kernel may launch; its DDT_PDL_WAIT() covers this grid
    cp_ring_fill<STAGES>(nkt, kt0, load_w);   // weights only: allowed before the wait
    DDT_PDL_WAIT();                         // x, ws and out belong to earlier kernels in the stream
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        if (s < nkt) load_x(s, kt0 + s, false);

    float acc[WM][WN][4];
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
        for (int j = 0; j < WN; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

    for (int it = 0; it < nkt; ++it) {
        cp_ring_step<STAGES, true>(it, nkt, kt0, [&](int slot, int kt) {   // stage `it` visible to the block
            load_w(slot, kt);
            load_x(slot, kt, true);
        });
        if (!active) continue;

        const uint4* ws_ = w_s + (it % STAGES) * WST;
        const uint4* xs_ = x_s + (it % STAGES) * XST;
#pragma unroll
        for (int kk = 0; kk < GEMM_BK / 16; ++kk) {
            uint32_t a[WM][4];
#pragma unroll
            for (int i = 0; i < WM; ++i) {   // A: 16 weight rows x 16 k; lanes 0-15 rows at k 0-7, 16-31 at k 8-15
                const int r = (wm * WM + i) * 16 + (lane & 15), c = kk * 2 + (lane >> 4);
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(a[i][0]), "=r"(a[i][1]), "=r"(a[i][2]), "=r"(a[i][3])
                             : "r"(smem_addr(ws_ + swz(r, c))));
            }
            const int c = kk * 2 + ((lane >> 3) & 1);
#pragma unroll
            for (int j = 0; j < WN; j += 2) {
                uint32_t b0, b1, b2 = 0, b3 = 0;
                const int tb = wn * WN * 8 + j * 8;
                if (j + 1 < WN) {   // two n8 token tiles: matrices (t0-7,k0-7) (t0-7,k8-15) (t8-15,..)
                    const int r = tb + (lane & 7) + ((lane >> 4) << 3);
                    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                                 : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(smem_addr(xs_ + swz(r, c))));
                } else {
                    const int r = tb + (lane & 7);
                    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                                 : "=r"(b0), "=r"(b1) : "r"(smem_addr(xs_ + swz(r, c))));
                }
#pragma unroll
                for (int i = 0; i < WM; ++i) {
                    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                                 : "+f"(acc[i][j][0]), "+f"(acc[i][j][1]), "+f"(acc[i][j][2]), "+f"(acc[i][j][3])
                                 : "r"(a[i][0]), "r"(a[i][1]), "r"(a[i][2]), "r"(a[i][3]), "r"(b0), "r"(b1));
                    if (j + 1 < WN) {
                        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                                     : "+f"(acc[i][j + 1][0]), "+f"(acc[i][j + 1][1]), "+f"(acc[i][j + 1][2]),
                                       "+f"(acc[i][j + 1][3])
                                     : "r"(a[i][0]), "r"(a[i][1]), "r"(a[i][2]), "r"(a[i][3]), "r"(b2), "r"(b3));
                    }
                }
            }
        }
    }
    cp_async_wait<0>();                     // only empty groups can remain; keep the count clean anyway
    if (CS > 1) {
        wide_cluster_reduce<WM, WN, WARPS_M, WARPS_N, OUT_F32, CS>(acc, smem, sidx, t0, n0, b, out,
                                                                   out_batch_stride, out_row_stride, T, N);
        return;
    }
    if (!active) return;

    // D fragment: c0,c1 = (row lane/4, tokens 2*(lane%4)+{0,1}); c2,c3 = row + 8.
#pragma unroll
    for (int i = 0; i < WM; ++i) {
#pragma unroll
        for (int j = 0; j < WN; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int n = n0 + (wm * WM + i) * 16 + (lane >> 2) + (e >> 1) * 8;
                const int t = t0 + wn * WN * 8 + j * 8 + 2 * (lane & 3) + (e & 1);
                if (n < N && t < T)
                    gemm_store_acc<OUT_F32>(acc[i][j][e], b, t, n, T, N, split, sidx, ws, out, out_batch_stride,
                                            out_row_stride);
            }
        }
    }
}

template <int WM, int WN, int WARPS_M, int WARPS_N, int STAGES, bool OUT_F32>
__global__ void __launch_bounds__(32 * WARPS_M * WARPS_N, 2)
gemm_bf16_kernel_wide(const bf16_bits* __restrict__ x, long long x_batch_stride, int x_row_stride,
                      const bf16_bits* __restrict__ w, long long w_batch_stride,
                      void* __restrict__ out, long long out_batch_stride, int out_row_stride,
                      float* __restrict__ ws, int T, int N, int K, int split) {
    gemm_wide_body<WM, WN, WARPS_M, WARPS_N, STAGES, OUT_F32, 1>(x, x_batch_stride, x_row_stride, w, w_batch_stride,
                                                                 out, out_batch_stride, out_row_stride, ws, T, N, K,
                                                                 split);
}

#ifdef DDT_HAS_CLUSTERS
// The K split over a cluster of CS blocks along grid.x (compile-time cluster shape: an ordinary or PDL launch
// needs no cluster attribute); ws and the split argument are unused (the split is CS).
template <int WM, int WN, int WARPS_M, int WARPS_N, int STAGES, int CS, bool OUT_F32>
__global__ void __cluster_dims__(CS, 1, 1) __launch_bounds__(32 * WARPS_M * WARPS_N, 2)
gemm_bf16_kernel_wide_cl(const bf16_bits* __restrict__ x, long long x_batch_stride, int x_row_stride,
                         const bf16_bits* __restrict__ w, long long w_batch_stride,
                         void* __restrict__ out, long long out_batch_stride, int out_row_stride,
                         float* __restrict__ ws_unused, int T, int N, int K, int unused) {
    gemm_wide_body<WM, WN, WARPS_M, WARPS_N, STAGES, OUT_F32, CS>(x, x_batch_stride, x_row_stride, w,
                                                                  w_batch_stride, out, out_batch_stride,
                                                                  out_row_stride, nullptr, T, N, K, CS);
}
#endif
