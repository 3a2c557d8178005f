// MoE router (DeepSeek-V3 / Kimi "noaux_tc", sigmoid scoring) on precomputed fp32 gate logits
// (the skinny GEMM with fp32 output gives x @ gate^T with fp32 accumulation).
//   s = sigmoid(logit); choice = s + bias (bias only steers the choice)
//   groups: score(g) = sum of the top-2 choice values of the group's experts; keep the topk_group best
//   groups (ties: lower group), experts of other groups are out;
//   ids = the k best choice values among the kept experts (ties: lower expert id), in descending order;
//   weights = s[ids] / (sum s[ids] + 1e-20 when normalising) * routed_scaling_factor.
//
// Selection (v2): one warp per token, every candidate in REGISTERS. Lane l owns experts l + 32 j
// (j < ROUTER_PER_LANE, coalesced loads) and keeps its own best live candidate (ord key, id, s). One pick
// is two warp reductions (__reduce_max_sync of the order-preserving 32-bit choice key, then
// __reduce_min_sync of the ids holding that key: ties go to the lowest id exactly as the reference) and one
// shuffle of the winner's s; only the owner lane retires the winner and rescans its 16 registers. v1 kept
// the candidates in shared memory and rescanned all of them every round (12 shared loads + a 64-bit
// shuffle butterfly of 10 shuffles per pick). The bias (a weight) is loaded before DDT_PDL_WAIT().
// Group-limited routing (n_group > 1, rare: Kimi K2 has n_group 1) scores the groups through a per-warp
// shared-memory copy of the choice values, one lane per group scanning its experts in id order.
//
// The same launch optionally runs the shared expert's SwiGLU: blocks >= route_blocks compute
// act[t, i] = bf16(silu(g) * u) with g, u = bf16(gate_up[t, i]), bf16(gate_up[t, I + i]) from the FP32
// columns of the fused router | shared gate_up GEMM (one GEMM reads the normed rows for both). Rounding
// the fp32 accumulators to bf16 first reproduces the bf16-output GEMM + silu_mul chain bit for bit
// (same f32_to_bf16, same silu_mul8 arithmetic as act.cu).
//
// router_topk_down<KS> (E2 of docs/MODELS.md) goes one step further at small T: its extra blocks compute the
// shared expert's DOWN projection out[t, n] = act[t, :] . W_down[n, :] with the SwiGLU formed on the fly
// from the fp32 gate|up (per element the same arithmetic as above, so act holds the same bf16 values),
// which removes the shared down GEMM's launch. A down block owns 32 output columns and a 16-token tile:
// its 32 weight rows stream into shared memory by cp.async BEFORE the PDL wait, then it forms the tile's
// act in shared memory, and its 4 warps split K = I = 64 KS (KS k16 steps each, mma.sync m16n8k16);
// partial sums meet in shared memory and are added in warp order (deterministic). Every column block of a
// tile recomputes the tile's SwiGLU (16 x I values): cheap at the token counts the wrapper's rule sends
// here (T <= 64), and what buys the launch.
#include "layer_math.cuh"

#define ROUTER_WARPS 4
#define ROUTER_MAX_E 512
#define ROUTER_PER_LANE (ROUTER_MAX_E / 32)
typedef unsigned long long u64;

__device__ __forceinline__ uint32_t ord_key(float f) {
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ u64 warp_max(u64 m) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}
// 8 fp32 accumulators -> 8 bf16 values (16 bytes), the GEMM epilogue's rounding.
__device__ __forceinline__ uint4 round8_bf16(const float4 a, const float4 b) {
    uint4 o;
    o.x = (uint32_t)f32_to_bf16(a.x) | ((uint32_t)f32_to_bf16(a.y) << 16);
    o.y = (uint32_t)f32_to_bf16(a.z) | ((uint32_t)f32_to_bf16(a.w) << 16);
    o.z = (uint32_t)f32_to_bf16(b.x) | ((uint32_t)f32_to_bf16(b.y) << 16);
    o.w = (uint32_t)f32_to_bf16(b.z) | ((uint32_t)f32_to_bf16(b.w) << 16);
    return o;
}

// The bias of this lane's experts (a weight: read before DDT_PDL_WAIT()).
__device__ __forceinline__ void load_bias(const float* __restrict__ bias, int E, float (&b_r)[ROUTER_PER_LANE]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < ROUTER_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        b_r[j] = e < E ? bias[e] : 0.f;
    }
}

// The lane's best live candidate: highest key, ties to the lower j (= lower expert id); best_j = -1 when
// none is live. A linear scan (16 dependent compare-selects). A 4-level tournament with a ballot pick was
// tried and measured slower on the H200 (route launch 5.6 -> 9.6 us; docs/MODELS.md), so removed.
__device__ __forceinline__ void lane_best(const uint32_t (&key)[ROUTER_PER_LANE], const float (&s_r)[ROUTER_PER_LANE],
                                          uint32_t live, uint32_t& best_key, int& best_j, float& best_s) {
    best_key = 0;
    best_j = -1;
    best_s = 0.f;
#pragma unroll
    for (int j = 0; j < ROUTER_PER_LANE; ++j)
        if (((live >> j) & 1u) && (best_j < 0 || key[j] > best_key)) { best_key = key[j]; best_j = j; best_s = s_r[j]; }
}

// The selection of token t by one warp (all 32 lanes; t < T). c: the warp's ROUTER_MAX_E floats of shared
// memory (group-limited path only).
__device__ __forceinline__ void route_token(const float (&b_r)[ROUTER_PER_LANE], const float* __restrict__ logits,
                                            long long lg_stride, int t, int E, int n_group, int topk_group, int k,
                                            int normalize, float scale, int* __restrict__ out_ids,
                                            float* __restrict__ out_w, float* c) {
    const int lane = threadIdx.x & 31;
    uint32_t key[ROUTER_PER_LANE];
    float s_r[ROUTER_PER_LANE];
    uint32_t live = 0;              // bit j: expert lane + 32 j is still a candidate
    const float* lg = logits + (long long)t * lg_stride;
#pragma unroll
    for (int j = 0; j < ROUTER_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        const float x = e < E ? lg[e] : 0.f;
        s_r[j] = 1.f / (1.f + expf(-x));
        key[j] = ord_key(s_r[j] + b_r[j]);
        if (e < E) live |= 1u << j;
    }
    if (topk_group < n_group) {
#pragma unroll
        for (int j = 0; j < ROUTER_PER_LANE; ++j)
            if (lane + 32 * j < E) c[lane + 32 * j] = s_r[j] + b_r[j];
        __syncwarp();
        const int gsize = E / n_group;
        u64 gkey = 0;
        if (lane < n_group) {       // lane g scores group g: the sum of its two best choice values
            float a = -__int_as_float(0x7f800000), b = a;
            for (int e = lane * gsize; e < (lane + 1) * gsize; ++e) {
                const float v = c[e];
                if (v > a) { b = a; a = v; } else if (v > b) { b = v; }
            }
            gkey = ((u64)ord_key(gsize >= 2 ? a + b : a) << 32) | (u64)(~(uint32_t)lane);
        }
        bool kept = false;
        for (int r = 0; r < topk_group; ++r) {
            const u64 m = warp_max(gkey);
            if (lane == (int)(~(uint32_t)m)) { kept = true; gkey = 0; }
        }
        const unsigned int kept_mask = __ballot_sync(0xffffffffu, kept);
#pragma unroll
        for (int j = 0; j < ROUTER_PER_LANE; ++j) {
            const int e = lane + 32 * j;
            if (e < E && !((kept_mask >> (e / gsize)) & 1u)) live &= ~(1u << j);
        }
    }
    uint32_t best_key;
    int best_j;
    float best_s;
    lane_best(key, s_r, live, best_key, best_j, best_s);
    float sum = 0.f, my_s = 0.f;
    int my_id = 0;
    for (int r = 0; r < k; ++r) {
        const bool has = best_j >= 0;
        const uint32_t m = __reduce_max_sync(0xffffffffu, has ? best_key : 0u);
        const uint32_t cand = (has && best_key == m) ? (uint32_t)(lane + 32 * best_j) : 0xffffffffu;
        const int id = (int)__reduce_min_sync(0xffffffffu, cand);
        const int owner = id & 31;
        const float sw = __shfl_sync(0xffffffffu, best_s, owner);
        sum += sw;
        if (lane == r) { my_id = id; my_s = sw; }
        if (lane == owner) {        // retire the winner, rescan the lane's registers
            live &= ~(1u << best_j);
            lane_best(key, s_r, live, best_key, best_j, best_s);
        }
    }
    const float f = normalize ? scale / (sum + 1e-20f) : scale;
    if (lane < k) {
        out_ids[(long long)t * k + lane] = my_id;
        out_w[(long long)t * k + lane] = my_s * f;
    }
}

// A padding row (row_pos != NULL and row_pos[t] < 0: the batch's kv_pos, -1 on rows beyond a stream's tree
// and on idle slots) selects no expert: ids -1 (the MoE skips them, so the row pulls no expert bytes and the
// unique-expert count follows the real rows) and weights 0. Returns whether token t was such a row.
__device__ __forceinline__ bool route_padding(const int* __restrict__ row_pos, int t, int k, int* __restrict__ out_ids,
                                              float* __restrict__ out_w) {
    if (row_pos == nullptr || row_pos[t] >= 0) return false;
    const int lane = threadIdx.x & 31;
    if (lane < k) {
        out_ids[(long long)t * k + lane] = -1;
        out_w[(long long)t * k + lane] = 0.f;
    }
    return true;
}

// min blocks 1: see router_topk_down (ptxas otherwise caps sm_90 at ~72-80 registers and spills)
extern "C" __global__ void __launch_bounds__(ROUTER_WARPS * 32, 1)
router_topk(const float* __restrict__ logits, long long lg_stride, int T, int E, const float* __restrict__ bias,
            int n_group, int topk_group, int k, int normalize, float scale, int* __restrict__ out_ids,
            float* __restrict__ out_w, int route_blocks, const float* __restrict__ gate_up, long long gu_stride,
            bf16_bits* __restrict__ act, long long act_stride, int I, const int* __restrict__ row_pos) {
    // PDL: the next kernel (the shared down GEMM / the MoE) may start its weight prefetch now; its own
    // DDT_PDL_WAIT() still waits for this whole grid.
    DDT_PDL_LAUNCH_DEPENDENTS();
    if ((int)blockIdx.x >= route_blocks) {      // shared expert SwiGLU, 8 values per step
        DDT_PDL_WAIT();
        const int nv = I / 8;
        const long long total = (long long)T * nv;
        for (long long gi = (long long)(blockIdx.x - route_blocks) * blockDim.x + threadIdx.x; gi < total;
             gi += (long long)(gridDim.x - route_blocks) * blockDim.x) {
            const int t = (int)(gi / nv), v = (int)(gi % nv);
            const float4* g = (const float4*)(gate_up + t * gu_stride) + 2 * v;
            const float4* u = (const float4*)(gate_up + t * gu_stride + I) + 2 * v;
            ((uint4*)(act + t * act_stride))[v] = silu_mul8(round8_bf16(g[0], g[1]), round8_bf16(u[0], u[1]));
        }
        return;
    }
    __shared__ float c_s[ROUTER_WARPS][ROUTER_MAX_E];      // choice values, group-limited path only
    const int warp = threadIdx.x >> 5;
    const int t = blockIdx.x * ROUTER_WARPS + warp;
    float b_r[ROUTER_PER_LANE];
    load_bias(bias, E, b_r);
    DDT_PDL_WAIT();
    if (t >= T) return;             // only warp-level synchronisation below: an idle warp may leave
    if (route_padding(row_pos, t, k, out_ids, out_w)) return;
    route_token(b_r, logits, lg_stride, t, E, n_group, topk_group, k, normalize, scale, out_ids, out_w, c_s[warp]);
}

// ---------------------------------------------------------------------------------------------------
// Selection + shared expert SwiGLU + shared down projection in one launch (see the top of the file).
// Blocks [0, route_blocks): selection, one warp per token. Blocks route_blocks + z * col_blocks + c:
// output columns 32 c .. 32 c + 31, token tiles z, z + zgroups, ... (zgroups = the down blocks / col_blocks).
#define RD_WARPS 4
#define RD_PAD 8                    // bf16 row padding of the shared tiles: rows 16 B apart mod 128 B

__device__ __forceinline__ void rd_cp_async16(void* smem, const void* gmem) {
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(a), "l"(gmem));
}
__device__ __forceinline__ uint32_t lds_pair(const bf16_bits* p) { return *(const uint32_t*)p; }

template <int KS>
// min blocks 1: without it ptxas caps sm_90 at 80 registers and spills (the selection path)
__global__ void __launch_bounds__(RD_WARPS * 32, 1)
router_topk_down(const float* __restrict__ logits, long long lg_stride, int T, int E, const float* __restrict__ bias,
                 int n_group, int topk_group, int k, int normalize, float scale, int* __restrict__ out_ids,
                 float* __restrict__ out_w, int route_blocks, const float* __restrict__ gate_up, long long gu_stride,
                 const bf16_bits* __restrict__ wd, bf16_bits* __restrict__ out, long long out_stride, int N,
                 int col_blocks, const int* __restrict__ row_pos) {
    constexpr int I = 64 * KS, LD = I + RD_PAD;
    // W_s: the block's 32 weight rows; A_s: one 16-token tile of act; red: the 4 warps' partial sums. The
    // selection blocks use the front of the same buffer for their choice values (4 x 512 floats).
    constexpr int W_BYTES = 32 * LD * 2, A_BYTES = 16 * LD * 2, RED_BYTES = RD_WARPS * 16 * 33 * 4;
    static_assert(W_BYTES + A_BYTES + RED_BYTES >= RD_WARPS * ROUTER_MAX_E * 4, "selection scratch");
    __shared__ __align__(16) unsigned char smem[W_BYTES + A_BYTES + RED_BYTES];
    DDT_PDL_LAUNCH_DEPENDENTS();    // the MoE may launch and prefetch its weights; it waits for this grid
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if ((int)blockIdx.x < route_blocks) {
        const int t = blockIdx.x * RD_WARPS + warp;
        float b_r[ROUTER_PER_LANE];
        load_bias(bias, E, b_r);
        DDT_PDL_WAIT();
        if (t >= T) return;
        if (route_padding(row_pos, t, k, out_ids, out_w)) return;
        route_token(b_r, logits, lg_stride, t, E, n_group, topk_group, k, normalize, scale, out_ids, out_w,
                    (float*)smem + warp * ROUTER_MAX_E);
        return;
    }
    bf16_bits* W_s = (bf16_bits*)smem;
    bf16_bits* A_s = (bf16_bits*)(smem + W_BYTES);
    float (*red)[16][33] = (float (*)[16][33])(smem + W_BYTES + A_BYTES);
    const int bi = blockIdx.x - route_blocks;
    const int zgroups = (gridDim.x - route_blocks) / col_blocks;
    const int n0 = (bi % col_blocks) * 32, z = bi / col_blocks;
    // the weight rows (never written by a kernel) stream into shared memory BEFORE the PDL wait: 32 rows x
    // I bf16 = 4 KS 16-byte chunks per thread
#pragma unroll
    for (int q = 0; q < 32 * (I / 8) / (RD_WARPS * 32); ++q) {
        const int i = tid + q * RD_WARPS * 32, r = i / (I / 8), c = i % (I / 8);
        rd_cp_async16(W_s + r * LD + c * 8, wd + (long long)(n0 + r) * I + c * 8);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    DDT_PDL_WAIT();
    const int g = lane >> 2, tig = lane & 3;
    const int kw = warp * 16 * KS + 2 * tig;
    for (int tile = z; tile * 16 < T; tile += zgroups) {
        // act of the tile's 16 rows (zeros past T): the gate / up fp32 accumulators rounded to bf16 (the bf16
        // GEMM epilogue), then silu_mul1 (act.cu's arithmetic), two columns per step (coalesced float2).
        // All loads are issued first (a constant trip count, unrolled) so their L2 latencies overlap
        // instead of one per step; rows past T store act 0.
        constexpr int STEPS = 16 * (I / 2) / (RD_WARPS * 32);
        float2 gv[STEPS], uv[STEPS];
#pragma unroll
        for (int q = 0; q < STEPS; ++q) {
            const int i = tid + q * RD_WARPS * 32, r = i / (I / 2), c = 2 * (i % (I / 2)), t = tile * 16 + r;
            gv[q] = uv[q] = make_float2(0.f, 0.f);
            if (t < T) {
                const float* row = gate_up + (long long)t * gu_stride;
                gv[q] = *(const float2*)(row + c);
                uv[q] = *(const float2*)(row + I + c);
            }
        }
#pragma unroll
        for (int q = 0; q < STEPS; ++q) {     // a warp covers 32 consecutive pairs of one row: r is warp-uniform
            const int i = tid + q * RD_WARPS * 32, r = i / (I / 2), c = 2 * (i % (I / 2));
            uint32_t v = 0u;
            if (tile * 16 + r < T)            // rows past T skip the SwiGLU (half the tile at T = 8)
                v = (uint32_t)silu_mul1(f32_to_bf16(gv[q].x), f32_to_bf16(uv[q].x)) |
                    ((uint32_t)silu_mul1(f32_to_bf16(gv[q].y), f32_to_bf16(uv[q].y)) << 16);
            *(uint32_t*)(A_s + r * LD + c) = v;
        }
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        __syncthreads();
        float acc[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            // A fragment (tokens x k, row-major): a0 (g, k), a1 (g + 8, k), a2 (g, k + 8), a3 (g + 8, k + 8);
            // B fragment (W[n][k], k contiguous = the .col operand): b0 = (k 2tig..+1, n g), b1 = k + 8
            const int kk = kw + s * 16;
            const uint32_t a0 = lds_pair(A_s + g * LD + kk), a1 = lds_pair(A_s + (g + 8) * LD + kk);
            const uint32_t a2 = lds_pair(A_s + g * LD + kk + 8), a3 = lds_pair(A_s + (g + 8) * LD + kk + 8);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint32_t b0 = lds_pair(W_s + (j * 8 + g) * LD + kk), b1 = lds_pair(W_s + (j * 8 + g) * LD + kk + 8);
                mma_16816_bf16(acc[j], a0, a1, a2, a3, b0, b1);
            }
        }
        park_c_tile(red[warp], acc, g, tig);
        __syncthreads();
#pragma unroll
        for (int i = tid; i < 16 * 32; i += RD_WARPS * 32) {
            const int r = i >> 5, c = i & 31, t = tile * 16 + r;
            if (t < T) {
                const float sum = sum_parked<RD_WARPS>(red, r, c);
                out[t * out_stride + n0 + c] = f32_to_bf16(sum);
            }
        }
        __syncthreads();            // A_s and red are rewritten by the next tile
    }
}
