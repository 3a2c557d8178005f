// Glue between the decode step's stages (ddtree_cupy/kernels/engine_glue.py): small gathers and scatters
// that move the tree builder's per-stream outputs into the target batch layout, the target's per-row
// choices back into the walk's layout, and the accepted rows' features into the drafter's append batch.
// All of them are a few KB of traffic; they exist so the whole step runs on the device without a host
// round trip (and so it can be one CUDA graph).
//
// The per-step control block `ctrl` is int32 [EG_FIELDS, S] uploaded by the host before each replay
// (ddtree_cupy/engine/scheduler.py pack_control): prefix_len, bonus, active, budget, step.
#include "common.cuh"

#define EG_PREFIX 0
#define EG_BONUS 1
#define EG_ACTIVE 2

// Root-only trees for autoregressive decoding: row 0 = the pending bonus at position s (the same layout
// ddt_build_tree writes for budget 0). grid (S), block 32.
extern "C" __global__ void eg_root_tree(const int32_t* __restrict__ ctrl, int S, int32_t* __restrict__ tokens,
                                        int32_t* __restrict__ parents, int32_t* __restrict__ depths,
                                        int32_t* __restrict__ positions, int32_t* __restrict__ n_rows,
                                        uint32_t* __restrict__ mask) {
    const int s = blockIdx.x;
    if (s >= S) return;
    const int t = threadIdx.x;
    const int base = s * DDT_MAX_TREE_ROWS;
    if (t == 0) {
        tokens[base] = ctrl[EG_BONUS * S + s];
        parents[base] = -1;
        depths[base] = 0;
        positions[base] = ctrl[EG_PREFIX * S + s];
        n_rows[s] = 1;
    }
    if (t < DDT_MASK_WORDS) mask[(size_t)base * DDT_MASK_WORDS + t] = (t == 0) ? 1u : 0u;
}

// Tree rows -> target batch rows (slot s, row r -> batch row s * R + r). Rows r < n (n = the tree's rows,
// 0 for an idle slot) write their KV at s_prefix + r; rows beyond are padding (kv_pos -1). The ancestor
// mask rows are copied when `mask_out` is not null. grid (S), block 128.
extern "C" __global__ void eg_tree_to_batch(const int32_t* __restrict__ ctrl, int S, int R,
                                            const int32_t* __restrict__ tr_tokens,
                                            const int32_t* __restrict__ tr_positions,
                                            const int32_t* __restrict__ tr_n_rows,
                                            const uint32_t* __restrict__ tr_mask,
                                            int32_t* __restrict__ tokens, int32_t* __restrict__ positions,
                                            int32_t* __restrict__ kv_pos, int32_t* __restrict__ stream_ids,
                                            int32_t* __restrict__ prefix_len, int32_t* __restrict__ n_rows,
                                            int32_t* __restrict__ row_start, uint32_t* __restrict__ mask_out) {
    const int s = blockIdx.x;
    if (s >= S) return;
    const bool active = ctrl[EG_ACTIVE * S + s] != 0;
    const int prefix = active ? ctrl[EG_PREFIX * S + s] : 0;
    int n = active ? tr_n_rows[s] : 0;
    n = n < 0 ? 0 : (n > R ? R : n);
    if (threadIdx.x == 0) {
        prefix_len[s] = prefix;
        n_rows[s] = n;
        row_start[s] = s * R;
    }
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        const int src = s * DDT_MAX_TREE_ROWS + r;
        const int dst = s * R + r;
        tokens[dst] = active ? tr_tokens[src] : 0;
        positions[dst] = active ? tr_positions[src] : 0;
        kv_pos[dst] = (r < n) ? prefix + r : -1;
        stream_ids[dst] = s;
        if (mask_out != nullptr) {
            for (int w = 0; w < DDT_MASK_WORDS; ++w) {
                // idle slots: the root bit and the row's own bit (the builder's padding pattern)
                uint32_t v = active ? tr_mask[(size_t)src * DDT_MASK_WORDS + w]
                                    : ((w == 0 ? 1u : 0u) | ((r >> 5) == w ? (1u << (r & 31)) : 0u));
                mask_out[(size_t)dst * DDT_MASK_WORDS + w] = v;
            }
        }
    }
}

// The target's per-row token (argmax id or sample) of batch row s * R + r -> post[s, r] (the walk's
// [S, 129] layout); rows r >= R get -1 (the walk never reads them). grid (S), block 128.
extern "C" __global__ void eg_post_scatter(const int32_t* __restrict__ ids, int S, int R,
                                           int32_t* __restrict__ post) {
    const int s = blockIdx.x;
    if (s >= S) return;
    for (int r = threadIdx.x; r < DDT_MAX_TREE_ROWS; r += blockDim.x)
        post[s * DDT_MAX_TREE_ROWS + r] = (r < R) ? ids[s * R + r] : -1;
}

// After the walk: (1) the accepted rows' features -> the drafter's append batch (row s * A + j holds the
// features of batch row feat_rows[s, j], position prefix + j; unused rows get position -1), and (2) the
// step's packed output row per slot: [n_acc (0 if idle), tree rows, out_tokens[0 .. A]].
// grid (A, S), block 128. `features` may be null (autoregressive mode: no drafter).
extern "C" __global__ void eg_after_walk(const int32_t* __restrict__ ctrl, int S, int A,
                                         const int32_t* __restrict__ n_acc, const int32_t* __restrict__ tr_n_rows,
                                         const int32_t* __restrict__ out_tokens,
                                         const int32_t* __restrict__ feat_rows,
                                         const uint16_t* __restrict__ features, long long feat_width,
                                         uint16_t* __restrict__ app_feats, int32_t* __restrict__ app_sid,
                                         int32_t* __restrict__ app_pos, int32_t* __restrict__ packed) {
    const int j = blockIdx.x, s = blockIdx.y;
    if (s >= S || j >= A) return;
    const bool active = ctrl[EG_ACTIVE * S + s] != 0;
    const int na = n_acc[s];
    const bool use = active && j < na;
    const int arow = s * A + j;
    if (threadIdx.x == 0) {
        if (features != nullptr) {
            app_sid[arow] = s;
            app_pos[arow] = use ? ctrl[EG_PREFIX * S + s] + j : -1;
        }
        const int W = A + 3;     // n_acc, n_rows, A + 1 tokens
        if (j == 0) {
            packed[s * W + 0] = active ? na : 0;
            packed[s * W + 1] = active ? tr_n_rows[s] : 0;
        }
        packed[s * W + 2 + j] = out_tokens[s * (A + 1) + j];
        if (j == A - 1) packed[s * W + 2 + A] = out_tokens[s * (A + 1) + A];
    }
    if (features == nullptr) return;
    uint16_t* dst = app_feats + (size_t)arow * feat_width;
    if (!use) return;            // rows at position -1 are skipped by the append: no need to clear them
    const uint16_t* src = features + (size_t)feat_rows[s * A + j] * feat_width;
    if ((feat_width & 7) == 0) {
        const uint4* s4 = reinterpret_cast<const uint4*>(src);
        uint4* d4 = reinterpret_cast<uint4*>(dst);
        for (long long i = threadIdx.x; i < feat_width / 8; i += blockDim.x) d4[i] = s4[i];
    } else {
        for (long long i = threadIdx.x; i < feat_width; i += blockDim.x) dst[i] = src[i];
    }
}

// Per-row sampling parameters of the verify batch from per-slot ones: row s * R + r gets the slot's
// temperature / top-k / top-p / seed and the Philox step (round << 8 | r), so every row of every round
// draws independent numbers and a replay with the same inputs draws the same ones. grid (S), block 128.
extern "C" __global__ void eg_sample_params(const int32_t* __restrict__ ctrl, int S, int R, int step_field,
                                            const float* __restrict__ slot_temp, const int32_t* __restrict__ slot_topk,
                                            const float* __restrict__ slot_topp,
                                            const unsigned long long* __restrict__ slot_seed,
                                            float* __restrict__ temp, int32_t* __restrict__ topk,
                                            float* __restrict__ topp, unsigned long long* __restrict__ seeds,
                                            long long* __restrict__ steps) {
    const int s = blockIdx.x;
    if (s >= S) return;
    const long long round = ctrl[step_field * S + s];
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        const int i = s * R + r;
        temp[i] = slot_temp[s];
        topk[i] = slot_topk[s];
        topp[i] = slot_topp[s];
        seeds[i] = slot_seed[s];
        steps[i] = (round << 8) | (long long)r;
    }
}

// All-gathered vocabulary shards [tp, T, Vl] -> whole rows [T, tp * Vl]. Only sampled decoding under tensor
// parallelism needs it (the sampler's top-k / top-p / normalisation are defined on whole rows); greedy
// decoding and the draft top-K merge per-shard results instead and never pay for this copy.
// grid (T, tp), block 256.
extern "C" __global__ void eg_vocab_rows(const float* __restrict__ parts, int tp, int T, int Vl,
                                         float* __restrict__ out) {
    const int t = blockIdx.x, r = blockIdx.y;
    const float* src = parts + ((size_t)r * T + t) * Vl;
    float* dst = out + ((size_t)t * tp + r) * Vl;
    for (int v = threadIdx.x; v < Vl; v += blockDim.x) dst[v] = src[v];
}
