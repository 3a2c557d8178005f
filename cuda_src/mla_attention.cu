// Absorbed MLA attention over the paged latent KV cache (docs/ATTENTION.md).
//
// One latent "head" (576 = c_kv 512 | k_pe 64) is shared by every query head, so the (query row, head)
// pairs of one stream are packed into the MMA M dimension: packed row m = row * H + head, which is also
// the memory order of q [total_rows, H, 576] and of the output o_lat [total_rows, H, 512]. Each K/V tile
// is loaded once per block (cp.async from the paged pool) and serves all BM packed rows of the block.
//
// Block = MG x VG warps. Warp (mg, vg) owns packed rows mg*16..+16 and
//   * in S = Q K^T: the tokens vg*BN/VG..+BN/VG of the tile (full 576-wide reduction),
//   * in O += P V:  the output columns vg*512/VG..+512/VG (all BN tokens of the tile).
// The VG warps of one row group exchange row maxima, row sums and P through shared memory, so every warp
// of the group keeps the same online-softmax state (m, l) for its rows.
//
// Split-KV: blockIdx.y = split; each split covers a contiguous run of KV tiles of the stream and writes a
// partial (normalised O, fp32 or -- built with MLA_PART_BF16=1 -- bf16, and an fp32 log2-sum-exp) that
// mla_attn_combine merges. With one split the block writes bf16 o_lat directly. Two kernels share this contract: mla_attn_fwd (below; rows x tokens split
// over the warps) and mla_attn_ksplit (Q in registers, S split over the reduction; used for decode).
//
// Visibility of KV position t for query row r of a stream with committed length s and n rows:
//   t < s: visible;  t = s + j (0 <= j < n): tree mode bit j of mask[stream][r]; causal mode j <= r.
#include "common.cuh"
#include "attn_combine.cuh"
#include "attn_mma.cuh"

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define MLA_QK_DIM KV_ROW_DIM        // 576
#define MLA_V_DIM KV_LATENT_DIM      // 512
#define MLA_CHUNKS (MLA_QK_DIM / 8)  // 16-byte chunks per latent row
// Shared-memory row stride (bf16 elements): 576 + 8 so that 8 consecutive rows start in 8 different
// 16-byte bank groups (1168 B = 73 chunks, odd) and ldmatrix is conflict free.
#define MLA_SROW (MLA_QK_DIM + 8)

// Element type of the split partials O (kernels/attention.py PARTIAL_BF16 / DDT_MLA_PARTIAL_BF16 pick the
// build): fp32 by default; bf16 halves the bytes the main kernels write and the combine reads back. Each
// partial row is a normalised (convex-combination) O row, so rounding it to bf16 costs at most 2^-8 relative
// per element before the weighted merge (docs/history/2026-11-29-attention.md, "bf16 split partials"). The log2-sum-exp stays fp32.
#ifndef MLA_PART_BF16
#define MLA_PART_BF16 0
#endif
#if MLA_PART_BF16
typedef bf16_bits mla_part_t;
#else
typedef float mla_part_t;
#endif

// Two adjacent columns (a, b) of a partial row: one 8-byte (fp32) or 4-byte (bf16, round to nearest even)
// store, like the one-split path's bf16 o_lat store.
__device__ __forceinline__ void mla_store_part2(mla_part_t* p, float a, float b) {
#if MLA_PART_BF16
    *reinterpret_cast<unsigned*>(p) = pack_bf16x2(a, b);
#else
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
#endif
}

#if MLA_PART_BF16
// One row's bf16 partial columns held in the mma accumulator layout: lane q4 of the quad holds columns
// j * 8 + 2 * q4 (+1) of n-tiles j = 0 .. NT-1 (o[j][2 * hi], o[j][2 * hi + 1]). Stored pairwise as 4-byte words
// a warp instruction would write 8 rows x 16 B, half of each 32-byte sector: as many L2 write transactions as
// the fp32 stores for half the bytes. One shuffle per tile pair instead: the even lane of a pair stores 4
// columns of tile j, the odd lane 4 of tile j + 1, so every store is 8 bytes and fills whole sectors. The
// values and their rounding are those of mla_store_part2 (o * inv, round to nearest even). Every lane of the
// warp must call it (the shuffle); ``ok`` (same for both lanes of a pair: same row) gates the stores.
template <int NT>
__device__ __forceinline__ void mla_store_part_bf16_row(bf16_bits* row, const float (&o)[NT][4], int hi, float inv,
                                                        int q4, bool ok) {
    static_assert(NT % 2 == 0, "n-tiles are stored in pairs");
    const bool odd = q4 & 1;
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
        const unsigned a = pack_bf16x2(o[j][2 * hi] * inv, o[j][2 * hi + 1] * inv);
        const unsigned b = pack_bf16x2(o[j + 1][2 * hi] * inv, o[j + 1][2 * hi + 1] * inv);
        const unsigned got = __shfl_xor_sync(0xffffffffu, odd ? a : b, 1);   // the partner's other tile
        const int col = odd ? (j + 1) * 8 + 2 * (q4 - 1) : j * 8 + 2 * q4;
        if (ok) *reinterpret_cast<uint2*>(row + col) = odd ? make_uint2(got, b) : make_uint2(a, got);
    }
}
#endif

// A block's place in the batch, the same in both attention kernels: stream b = blockIdx.z, split =
// blockIdx.y, packed rows m0 .. m0 + BM - 1 (row-major over the stream's n rows x H heads), and the KV tiles
// [tile_begin, tile_end) of BN tokens this split reads. Split boundaries come from s + n, not from the
// clipped causal range, so a chain in tree mode and the same rows in causal mode add the same terms in the
// same order (fully masked tiles add exact zeros).
struct MlaTile {
    int b, split, n, s, rs, m0, kv_len, n_tiles, tile_begin, tile_end;
    const int* table;   // the stream's page table
};
// Waits for the inputs first (DDT_PDL_WAIT: the lengths, tables, q and the cache rows may come from earlier
// kernels). false: the tile lies past the stream's rows (the grid covers the largest stream of the bucket).
template <int BM, int BN>
__device__ __forceinline__ bool mla_tile(const int* __restrict__ block_table, const int* __restrict__ prefix_len,
                                         const int* __restrict__ n_rows_arr, const int* __restrict__ row_start,
                                         const unsigned* __restrict__ mask, int max_pages, int H, int num_splits,
                                         MlaTile& t) {
    DDT_PDL_WAIT();
    t.b = blockIdx.z;
    t.split = blockIdx.y;
    // The three per-stream scalars are loaded together (one L2 round trip, not two behind the exit test):
    // the block's serial start-up chain is scalars -> page-table entry -> first KV tile.
    t.n = n_rows_arr[t.b];
    t.s = prefix_len[t.b];
    t.rs = row_start[t.b];
    t.m0 = blockIdx.x * BM;
    if (t.m0 >= t.n * H) return false;
    t.table = block_table + (size_t)t.b * max_pages;
    // KV positions this row tile can see: causal rows stop at s + (last row of the tile) + 1.
    if (mask == nullptr) t.kv_len = t.s + min(t.n - 1, (t.m0 + BM - 1) / H) + 1;
    else t.kv_len = t.s + t.n;
    t.n_tiles = (t.kv_len + BN - 1) / BN;
    const int per_split = ((t.s + t.n + BN - 1) / BN + num_splits - 1) / num_splits;
    t.tile_begin = t.split * per_split;
    t.tile_end = min(t.n_tiles, t.tile_begin + per_split);
    return true;
}

template <int MG, int VG, int BN, int STAGES>
struct MlaCfg {
    static constexpr int BM = MG * 16;
    static constexpr int THREADS = MG * VG * 32;
    static constexpr int TOK_W = BN / VG;          // tokens per warp in S
    static constexpr int NT_S = TOK_W / 8;         // n-tiles per warp in S
    static constexpr int COL_W = MLA_V_DIM / VG;   // output columns per warp
    static constexpr int NT_O = COL_W / 8;         // n-tiles per warp in O
    static constexpr int PSTR = BN + 8;            // P row stride (bf16): odd number of 16 B chunks
    static constexpr int Q_ELEMS = BM * MLA_SROW;
    static constexpr int K_ELEMS = BN * MLA_SROW;
    static constexpr int P_ELEMS = BM * PSTR;
    static constexpr int SMEM = (Q_ELEMS + STAGES * K_ELEMS + P_ELEMS) * 2 + 2 * VG * BM * 4;
    static_assert(TOK_W % 8 == 0, "each warp needs whole 8-token n-tiles");
    static_assert(BN % 16 == 0, "PV k-steps are 16 tokens");
    static_assert(NT_O % 2 == 0, "V tiles are loaded in pairs");
    static_assert(STAGES >= 2, "cp.async pipeline needs at least two stages");
};

template <int MG, int VG, int BN, int STAGES>
__global__ void __launch_bounds__(MG * VG * 32, 1) mla_attn_fwd(
    const bf16_bits* __restrict__ q,           // [total_rows, H, 576]
    const bf16_bits* __restrict__ pool,        // [num_pages, 64, 576]
    const int* __restrict__ block_table,       // [S, max_pages]
    const int* __restrict__ prefix_len,        // [S] committed length s
    const int* __restrict__ n_rows_arr,        // [S] query rows (tree rows, chunk rows, 1 for decode)
    const int* __restrict__ row_start,         // [S] first row of the stream in q / out
    const unsigned* __restrict__ mask,         // [S, mask_rows, DDT_MASK_WORDS] (tree) or nullptr (causal)
    bf16_bits* __restrict__ out,               // [total_rows, H, 512]            (num_splits == 1)
    mla_part_t* __restrict__ part_o,           // [num_splits, total_rows*H, 512] (num_splits > 1)
    float* __restrict__ part_lse,              // [num_splits, total_rows*H]
    int max_pages, int mask_rows, int H, int total_packed, int num_splits,
    float scale_log2) {                        // softmax_scale * log2(e)
    using C = MlaCfg<MG, VG, BN, STAGES>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_bits* Qs = reinterpret_cast<bf16_bits*>(smem_raw);
    bf16_bits* Ks = Qs + C::Q_ELEMS;
    bf16_bits* Ps = Ks + STAGES * C::K_ELEMS;
    float* red_max = reinterpret_cast<float*>(Ps + C::P_ELEMS);   // [VG][BM]
    float* red_sum = red_max + VG * C::BM;                         // [VG][BM]

    DDT_PDL_LAUNCH_DEPENDENTS();  // the combine (or next kernel) may launch; it waits for this whole grid
    MlaTile tl;   // after the wait for the inputs
    if (!mla_tile<C::BM, BN>(block_table, prefix_len, n_rows_arr, row_start, mask, max_pages, H, num_splits, tl))
        return;
    const int b = tl.b, split = tl.split, n = tl.n, s = tl.s, rs = tl.rs, m0 = tl.m0, kv_len = tl.kv_len,
              n_tiles = tl.n_tiles, tile_begin = tl.tile_begin, tile_end = tl.tile_end;
    const int* table = tl.table;

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    const int mg = warp % MG, vg = warp / MG;
    const int g = lane >> 2, q4 = lane & 3;

    // ---- loads -----------------------------------------------------------------------------------
    // A tile never straddles a page (BN divides the page size), so one page-table read per tile.
    static_assert(KV_PAGE_SIZE % BN == 0, "tiles must not straddle pages");
    auto load_tile = [&](int tile, int buf) {
        bf16_bits* dst0 = Ks + buf * C::K_ELEMS;
        const int t0 = tile * BN;
        const int page = __ldg(table + t0 / KV_PAGE_SIZE);  // t0 < kv_len: the tile holds a valid token
        const bf16_bits* base = pool + ((size_t)page * KV_PAGE_SIZE + (t0 % KV_PAGE_SIZE)) * MLA_QK_DIM;
        for (int i = tid; i < BN * MLA_CHUNKS; i += C::THREADS) {
            const int tok = i / MLA_CHUNKS, c = i - tok * MLA_CHUNKS;
            const bool ok = t0 + tok < kv_len;
            cp_async16(dst0 + tok * MLA_SROW + c * 8, ok ? base + tok * MLA_QK_DIM + c * 8 : pool, ok);
        }
    };
    {
        const int valid_m = n * H - m0;
        const bf16_bits* qb = q + ((size_t)rs * H + m0) * MLA_QK_DIM;
        for (int i = tid; i < C::BM * MLA_CHUNKS; i += C::THREADS) {
            int r = i / MLA_CHUNKS, c = i - r * MLA_CHUNKS;
            bool ok = r < valid_m;
            cp_async16(Qs + r * MLA_SROW + c * 8, ok ? qb + (size_t)r * MLA_QK_DIM + c * 8 : q, ok);
        }
    }
    // Group 0 = Q + first tile; then one group per tile (possibly empty, so the wait count stays fixed).
    for (int st = 0; st < STAGES - 1; ++st) {
        if (tile_begin + st < tile_end) load_tile(tile_begin + st, st);
        cp_async_commit();
    }

    // ---- per-thread row state: rows g and g+8 of the warp's 16 ---------------------------------------
    int qrow[2];
    const unsigned* mrow[2];
    for (int i = 0; i < 2; ++i) {
        int m = m0 + mg * 16 + g + 8 * i;
        int r = min(m / H, n - 1);  // padded rows borrow the last row's mask; their output is dropped
        qrow[i] = r;
        mrow[i] = mask ? mask + ((size_t)b * mask_rows + r) * DDT_MASK_WORDS : nullptr;
    }
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.f, 0.f};
    float o[C::NT_O][4];
#pragma unroll
    for (int j = 0; j < C::NT_O; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

    for (int tile = tile_begin; tile < tile_end; ++tile) {
        const int it = tile - tile_begin;
        const int buf = it % STAGES;
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {   // refill the stage that was consumed in the previous iteration
            int nt = tile + STAGES - 1;
#ifndef MLA_PROBE_SKIP_LOAD
            if (nt < tile_end) load_tile(nt, (it + STAGES - 1) % STAGES);
#endif
            cp_async_commit();
        }
        const bf16_bits* Kb = Ks + buf * C::K_ELEMS;

        // ---- S = Q K^T for 16 rows x TOK_W tokens --------------------------------------------------
        // Two accumulator sets (even / odd k-steps) halve the dependent mma chain: with one block of
        // 4-8 warps per SM the S phase is bound by mma latency, not by tensor throughput.
        float sacc[C::NT_S][4], sodd[C::NT_S][4];
#pragma unroll
        for (int j = 0; j < C::NT_S; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) sacc[j][e] = sodd[j][e] = 0.f;
        const bf16_bits* qa = Qs + (mg * 16 + (lane & 15)) * MLA_SROW + (lane >> 4) * 8;
        const int tokw0 = vg * C::TOK_W;
#ifndef MLA_PROBE_SKIP_S
#pragma unroll 2
        for (int ks2 = 0; ks2 < MLA_QK_DIM / 16; ks2 += 2) {
#pragma unroll
            for (int par = 0; par < 2; ++par) {
                const int ks = ks2 + par;
                float (*acc)[4] = par ? sodd : sacc;
                unsigned a0, a1, a2, a3;
                ldsm_x4(a0, a1, a2, a3, qa + ks * 16);
#pragma unroll
                for (int j = 0; j + 1 < C::NT_S; j += 2) {
                    const bf16_bits* kp = Kb + (tokw0 + j * 8 + (lane & 7) + (lane >> 4) * 8) * MLA_SROW +
                                          ks * 16 + ((lane >> 3) & 1) * 8;
                    unsigned b0, b1, b2, b3;
                    ldsm_x4(b0, b1, b2, b3, kp);
                    mma_bf16(acc[j], a0, a1, a2, a3, b0, b1);
                    mma_bf16(acc[j + 1], a0, a1, a2, a3, b2, b3);
                }
                if (C::NT_S & 1) {
                    const int j = C::NT_S - 1;
                    const bf16_bits* kp = Kb + (tokw0 + j * 8 + (lane & 7)) * MLA_SROW + ks * 16 +
                                          ((lane >> 3) & 1) * 8;
                    unsigned b0, b1;
                    ldsm_x2(b0, b1, kp);
                    mma_bf16(acc[j], a0, a1, a2, a3, b0, b1);
                }
            }
        }
#endif
#pragma unroll
        for (int j = 0; j < C::NT_S; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) sacc[j][e] += sodd[j][e];

        // ---- mask, scale, tile row max ------------------------------------------------------------
        const int t0 = tile * BN + tokw0;
        float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < C::NT_S; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e >> 1;
                const int t = t0 + j * 8 + 2 * q4 + (e & 1);
                bool vis = t < kv_len;
                if (vis && t >= s) {
                    int jj = t - s;
                    vis = mrow[i] ? ((__ldg(mrow[i] + (jj >> 5)) >> (jj & 31)) & 1u) != 0 : jj <= qrow[i];
                }
                float x = vis ? sacc[j][e] * scale_log2 : -INFINITY;
                sacc[j][e] = x;
                tmax[i] = fmaxf(tmax[i], x);
            }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(0xffffffffu, tmax[i], 1));
            tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(0xffffffffu, tmax[i], 2));
        }
        if (VG > 1) {
            if (q4 == 0) {
                red_max[vg * C::BM + mg * 16 + g] = tmax[0];
                red_max[vg * C::BM + mg * 16 + g + 8] = tmax[1];
            }
            __syncthreads();
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float mx = -INFINITY;
#pragma unroll
                for (int v = 0; v < VG; ++v) mx = fmaxf(mx, red_max[v * C::BM + mg * 16 + g + 8 * i]);
                tmax[i] = mx;
            }
        }

        // ---- probabilities, written to shared memory as the A operand of P V -------------------------
        float alpha[2], m_use[2], psum[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float m_new = fmaxf(m_run[i], tmax[i]);
            m_use[i] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet: keep p = 0
            alpha[i] = exp2f(m_run[i] - m_use[i]);
            m_run[i] = m_new;
        }
#pragma unroll
        for (int j = 0; j < C::NT_S; ++j) {
            float p0 = exp2f(sacc[j][0] - m_use[0]), p1 = exp2f(sacc[j][1] - m_use[0]);
            float p2 = exp2f(sacc[j][2] - m_use[1]), p3 = exp2f(sacc[j][3] - m_use[1]);
            psum[0] += p0 + p1;
            psum[1] += p2 + p3;
            const int col = tokw0 + j * 8 + 2 * q4;
            *reinterpret_cast<unsigned*>(Ps + (mg * 16 + g) * C::PSTR + col) = pack_bf16x2(p0, p1);
            *reinterpret_cast<unsigned*>(Ps + (mg * 16 + g + 8) * C::PSTR + col) = pack_bf16x2(p2, p3);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            psum[i] += __shfl_xor_sync(0xffffffffu, psum[i], 1);
            psum[i] += __shfl_xor_sync(0xffffffffu, psum[i], 2);
        }
        if (VG > 1 && q4 == 0) {
            red_sum[vg * C::BM + mg * 16 + g] = psum[0];
            red_sum[vg * C::BM + mg * 16 + g + 8] = psum[1];
        }
        __syncthreads();
        if (VG > 1) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float sm = 0.f;
#pragma unroll
                for (int v = 0; v < VG; ++v) sm += red_sum[v * C::BM + mg * 16 + g + 8 * i];
                psum[i] = sm;
            }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) l_run[i] = l_run[i] * alpha[i] + psum[i];
#pragma unroll
        for (int j = 0; j < C::NT_O; ++j) {
            o[j][0] *= alpha[0]; o[j][1] *= alpha[0];
            o[j][2] *= alpha[1]; o[j][3] *= alpha[1];
        }

        // ---- O += P V (V = the first 512 columns of the same latent rows) ---------------------------
        const int col0 = vg * C::COL_W;
#ifndef MLA_PROBE_SKIP_PV
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned a0, a1, a2, a3;
            ldsm_x4(a0, a1, a2, a3, Ps + (mg * 16 + (lane & 15)) * C::PSTR + kk * 16 + (lane >> 4) * 8);
            const bf16_bits* vrow = Kb + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * MLA_SROW + col0 +
                                    (lane >> 4) * 8;
#pragma unroll
            for (int j = 0; j < C::NT_O; j += 2) {
                unsigned b0, b1, b2, b3;
                ldsm_x4_t(b0, b1, b2, b3, vrow + j * 8);
                mma_bf16(o[j], a0, a1, a2, a3, b0, b1);
                mma_bf16(o[j + 1], a0, a1, a2, a3, b2, b3);
            }
        }
#endif
    }
    cp_async_wait<0>();

    // ---- epilogue -----------------------------------------------------------------------------------
    const int valid_m = n * H - m0;
    const int col0 = vg * C::COL_W;
#if MLA_PART_BF16
    if (num_splits > 1) {   // every lane takes part (shuffles); rows past the stream only skip the stores
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int ml = mg * 16 + g + 8 * i;
            const bool ok = ml < valid_m;
            const size_t prow = (size_t)split * total_packed + (size_t)rs * H + m0 + ml;
            const float inv = l_run[i] > 0.f ? 1.f / l_run[i] : 0.f;
            mla_store_part_bf16_row<C::NT_O>(part_o + prow * MLA_V_DIM + col0, o, i, inv, q4, ok);
            if (ok && vg == 0 && q4 == 0) part_lse[prow] = l_run[i] > 0.f ? m_run[i] + log2f(l_run[i]) : -INFINITY;
        }
        return;
    }
#endif
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int ml = mg * 16 + g + 8 * i;
        if (ml >= valid_m) continue;
        const size_t gm = (size_t)rs * H + m0 + ml;  // packed row in [total_rows * H]
        const float inv = l_run[i] > 0.f ? 1.f / l_run[i] : 0.f;
        if (num_splits == 1) {
            bf16_bits* orow = out + gm * MLA_V_DIM + col0 + 2 * q4;
#pragma unroll
            for (int j = 0; j < C::NT_O; ++j)
                *reinterpret_cast<unsigned*>(orow + j * 8) = pack_bf16x2(o[j][2 * i] * inv, o[j][2 * i + 1] * inv);
        } else {
            const size_t prow = (size_t)split * total_packed + gm;
            mla_part_t* orow = part_o + prow * MLA_V_DIM + col0 + 2 * q4;
#pragma unroll
            for (int j = 0; j < C::NT_O; ++j) mla_store_part2(orow + j * 8, o[j][2 * i] * inv, o[j][2 * i + 1] * inv);
            if (vg == 0 && q4 == 0)
                part_lse[prow] = l_run[i] > 0.f ? m_run[i] + log2f(l_run[i]) : -INFINITY;
        }
    }
}

// ---- mla_attn_ksplit<MT, BN, STAGES>: Q in registers, S split over the reduction, 2 barriers per tile ----
//
// The mla_attn_fwd layout above re-reads Q from shared memory for every KV tile and every token group
// (~420 KB of ldmatrix traffic per 64-row x 32-token tile) and needs 3 barriers per tile. Here a block of 8
// warps takes BM = 16 * MT packed rows and:
//   S phase:  warp w = (kq = w % 4, th = w / 4) computes the partial S over the reduction columns
//             kq * 144 .. +144 for all BM rows and the tokens th * BN/2 .. +BN/2 of the tile. Its Q
//             fragments (MT x 9 k-steps) stay in registers for the whole KV range, so each K tile is read
//             from shared memory exactly once (one ldmatrix per 16 tokens x 16 columns feeds 2 * MT mma).
//             The 4 partial S tiles go to shared memory in fp32.
//   softmax:  thread t owns row t / TPR and BN / TPR of its tokens: sums the 4 partials, masks, keeps the
//             row's running (m, l) in registers (the TPR threads of a row hold identical copies, reduced
//             with shuffles) and writes P (bf16) and the row's rescale factor to shared memory.
//   PV phase: warp w owns the output columns w * 64 .. +64 of all BM rows (O: MT x 8 n-tiles, registers);
//             V is the first 512 columns of the same K tile.
// Barriers per tile: B (partial S -> softmax) and C (P -> PV; the next K tile has landed). The refill of the
// stage that PV(i-1) read is issued right after B(i), when every warp is past PV(i-1).
template <int MT, int BN, int STAGES>
struct MlaKsCfg {
    static constexpr int THREADS = 256;
    static constexpr int BM = 16 * MT;
    static constexpr int KQ = 4;                          // reduction quarters (warps per token half)
    static constexpr int KSTEPS = MLA_QK_DIM / 16 / KQ;   // 9 k-steps of 16 columns per warp
    static constexpr int TOKW = BN / 2;                   // tokens per warp in S
    static constexpr int NTS = TOKW / 8;                  // S n-tiles per warp
    static constexpr int NTO = MLA_V_DIM / 8 / 8;         // 8 output n-tiles (64 columns) per warp
    static constexpr int SPSTR = BN + 8;                  // fp32 partial-S row stride: a half warp's float2
                                                          // stores (rows g, cols 2*q4) hit distinct banks
    static constexpr int PSTR = BN + 8;                   // P row stride (bf16): odd number of 16 B chunks
    static constexpr int TPR = THREADS / BM;              // softmax threads per row
    static constexpr int TPT = BN / TPR;                  // tokens per softmax thread
    static constexpr int K_ELEMS = BN * MLA_SROW;
    static constexpr int SMEM = STAGES * K_ELEMS * 2 + KQ * BM * SPSTR * 4 + BM * PSTR * 2 + 2 * BM * 4;
    static_assert(MLA_QK_DIM % (16 * KQ) == 0, "the reduction splits into whole k-steps");
    static_assert(NTS % 2 == 0, "K fragments are loaded for pairs of n-tiles");
    static_assert(TPT % 2 == 0, "softmax threads take token pairs");
    static_assert(TPR <= 32 && 32 % TPR == 0, "the softmax threads of a row sit in one warp");
    static_assert(STAGES >= 2, "cp.async pipeline needs at least two stages");
};

template <int MT, int BN, int STAGES>
__global__ void __launch_bounds__(256, 1) mla_attn_ksplit(
    const bf16_bits* __restrict__ q, const bf16_bits* __restrict__ pool, const int* __restrict__ block_table,
    const int* __restrict__ prefix_len, const int* __restrict__ n_rows_arr, const int* __restrict__ row_start,
    const unsigned* __restrict__ mask, bf16_bits* __restrict__ out, mla_part_t* __restrict__ part_o,
    float* __restrict__ part_lse, int max_pages, int mask_rows, int H, int total_packed, int num_splits,
    float scale_log2) {   // same arguments as mla_attn_fwd
    using C = MlaKsCfg<MT, BN, STAGES>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_bits* Ks = reinterpret_cast<bf16_bits*>(smem_raw);                        // [STAGES][BN][SROW]
    float* Sp = reinterpret_cast<float*>(Ks + STAGES * C::K_ELEMS);                // [KQ][BM][SPSTR]
    bf16_bits* Ps = reinterpret_cast<bf16_bits*>(Sp + C::KQ * C::BM * C::SPSTR);   // [BM][PSTR]
    float* alpha_s = reinterpret_cast<float*>(Ps + C::BM * C::PSTR);               // [BM]
    float* linv_s = alpha_s + C::BM;                                               // [BM]

    MlaTile tl;   // after the wait for the inputs
    if (!mla_tile<C::BM, BN>(block_table, prefix_len, n_rows_arr, row_start, mask, max_pages, H, num_splits, tl))
        return;
    const int b = tl.b, split = tl.split, n = tl.n, s = tl.s, rs = tl.rs, m0 = tl.m0, kv_len = tl.kv_len,
              n_tiles = tl.n_tiles, tile_begin = tl.tile_begin, tile_end = tl.tile_end;
    const int* table = tl.table;
    const int valid_m = n * H - m0;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, q4 = lane & 3;
    const int kq = warp & 3, th = warp >> 2;

    static_assert(KV_PAGE_SIZE % BN == 0, "tiles must not straddle pages");
    auto load_tile = [&](int tile, int buf) {
        bf16_bits* dst0 = Ks + buf * C::K_ELEMS;
        const int t0 = tile * BN;
        const int page = __ldg(table + t0 / KV_PAGE_SIZE);
        const bf16_bits* base = pool + ((size_t)page * KV_PAGE_SIZE + (t0 % KV_PAGE_SIZE)) * MLA_QK_DIM;
        for (int i = tid; i < BN * MLA_CHUNKS; i += C::THREADS) {
            const int tok = i / MLA_CHUNKS, c = i - tok * MLA_CHUNKS;
            const bool ok = t0 + tok < kv_len;
            cp_async16(dst0 + tok * MLA_SROW + c * 8, ok ? base + tok * MLA_QK_DIM + c * 8 : pool, ok);
        }
    };
    // One cp.async group per stage (possibly empty, so the wait counts stay fixed).
    for (int st = 0; st < STAGES - 1; ++st) {
        if (tile_begin + st < tile_end) load_tile(tile_begin + st, st);
        cp_async_commit();
    }

    // Q A-fragments of this warp's reduction quarter, straight from global memory (padded rows are zero):
    // a0 / a1 = rows g / g+8 at columns 2*q4, a2 / a3 the same rows 8 columns on.
    unsigned qf[MT][C::KSTEPS][4];
    {
        const bf16_bits* qb = q + ((size_t)rs * H + m0) * MLA_QK_DIM + kq * (MLA_QK_DIM / C::KQ) + 2 * q4;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hi = 0; hi < 2; ++hi) {
                const int r = mt * 16 + g + 8 * hi;
                const bool ok = r < valid_m;
                const unsigned* src = reinterpret_cast<const unsigned*>(qb + (size_t)(ok ? r : 0) * MLA_QK_DIM);
#pragma unroll
                for (int kk = 0; kk < C::KSTEPS; ++kk) {
                    qf[mt][kk][hi] = ok ? src[kk * 8] : 0u;
                    qf[mt][kk][2 + hi] = ok ? src[kk * 8 + 4] : 0u;
                }
            }
    }

    // Softmax ownership: row srow of the tile, tokens spart * TPT .. +TPT.
    const int srow = tid / C::TPR, spart = tid % C::TPR;
    const int sq = min((m0 + srow) / H, n - 1);  // padded rows borrow the last row's mask; output dropped
    const unsigned* smask = mask ? mask + ((size_t)b * mask_rows + sq) * DDT_MASK_WORDS : nullptr;
    float m_run = -INFINITY, l_run = 0.f;
    float o[MT][C::NTO][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < C::NTO; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;

    cp_async_wait<STAGES - 2>();
    __syncthreads();
    for (int tile = tile_begin; tile < tile_end; ++tile) {
        const int it = tile - tile_begin;
        const bf16_bits* Kb = Ks + (it % STAGES) * C::K_ELEMS;

        // ---- partial S = Q[:, kq quarter] K[th half, kq quarter]^T ---------------------------------
        float sacc[MT][C::NTS][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < C::NTS; ++j) sacc[mt][j][0] = sacc[mt][j][1] = sacc[mt][j][2] = sacc[mt][j][3] = 0.f;
#ifndef MLA_PROBE_SKIP_S
        const bf16_bits* kp = Kb + (th * C::TOKW + (lane & 7) + (lane >> 4) * 8) * MLA_SROW +
                              kq * (MLA_QK_DIM / C::KQ) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int kk = 0; kk < C::KSTEPS; ++kk) {
#pragma unroll
            for (int j = 0; j < C::NTS; j += 2) {
                unsigned b0, b1, b2, b3;
                ldsm_x4(b0, b1, b2, b3, kp + j * 8 * MLA_SROW + kk * 16);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(sacc[mt][j], qf[mt][kk][0], qf[mt][kk][1], qf[mt][kk][2], qf[mt][kk][3], b0, b1);
                    mma_bf16(sacc[mt][j + 1], qf[mt][kk][0], qf[mt][kk][1], qf[mt][kk][2], qf[mt][kk][3], b2, b3);
                }
            }
        }
#endif
        {
            float* spw = Sp + kq * C::BM * C::SPSTR;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < C::NTS; ++j) {
                    const int r = mt * 16 + g, col = th * C::TOKW + j * 8 + 2 * q4;
                    *reinterpret_cast<float2*>(spw + r * C::SPSTR + col) = make_float2(sacc[mt][j][0], sacc[mt][j][1]);
                    *reinterpret_cast<float2*>(spw + (r + 8) * C::SPSTR + col) = make_float2(sacc[mt][j][2], sacc[mt][j][3]);
                }
        }
        __syncthreads();  // B: partial S complete; every warp is past PV of the previous tile
        {   // refill the stage the previous tile used
            const int nt = tile + STAGES - 1;
#ifndef MLA_PROBE_SKIP_LOAD
            if (nt < tile_end) load_tile(nt, (it + STAGES - 1) % STAGES);
#endif
            cp_async_commit();
        }

        // ---- softmax over the tile: row srow, tokens tokc .. tokc + TPT ---------------------------------
        {
            const int tokc = spart * C::TPT;
            float x[C::TPT];
#pragma unroll
            for (int e = 0; e < C::TPT; e += 2) {
                float2 a = make_float2(0.f, 0.f);
#pragma unroll
                for (int k = 0; k < C::KQ; ++k) {
                    const float2 v = *reinterpret_cast<const float2*>(Sp + (k * C::BM + srow) * C::SPSTR + tokc + e);
                    a.x += v.x; a.y += v.y;
                }
                x[e] = a.x; x[e + 1] = a.y;
            }
            const int tb = tile * BN + tokc;
            float tmax = -INFINITY;
#pragma unroll
            for (int e = 0; e < C::TPT; ++e) {
                const int t = tb + e;
                bool vis = t < kv_len;
                if (vis && t >= s) {
                    const int jj = t - s;
                    vis = smask ? ((__ldg(smask + (jj >> 5)) >> (jj & 31)) & 1u) != 0 : jj <= sq;
                }
                x[e] = vis ? x[e] * scale_log2 : -INFINITY;
                tmax = fmaxf(tmax, x[e]);
            }
#pragma unroll
            for (int off = C::TPR / 2; off > 0; off >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
            const float m_new = fmaxf(m_run, tmax);
            const float m_use = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet: keep p = 0
            const float alpha = exp2f(m_run - m_use);
            m_run = m_new;
            float psum = 0.f;
#pragma unroll
            for (int e = 0; e < C::TPT; e += 2) {
                const float p0 = exp2f(x[e] - m_use), p1 = exp2f(x[e + 1] - m_use);
                psum += p0 + p1;
                *reinterpret_cast<unsigned*>(Ps + srow * C::PSTR + tokc + e) = pack_bf16x2(p0, p1);
            }
#pragma unroll
            for (int off = C::TPR / 2; off > 0; off >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, off);
            l_run = l_run * alpha + psum;
            if (spart == 0) alpha_s[srow] = alpha;
        }
        cp_async_wait<STAGES - 2>();   // the next tile's group
        __syncthreads();  // C: P and alpha written; the next K tile is visible to every thread

        // ---- O = alpha * O + P V for columns warp * 64 .. +64 ------------------------------------------
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const float a_lo = alpha_s[mt * 16 + g], a_hi = alpha_s[mt * 16 + g + 8];
#pragma unroll
            for (int j = 0; j < C::NTO; ++j) {
                o[mt][j][0] *= a_lo; o[mt][j][1] *= a_lo;
                o[mt][j][2] *= a_hi; o[mt][j][3] *= a_hi;
            }
        }
#ifndef MLA_PROBE_SKIP_PV
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldsm_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3],
                        Ps + (mt * 16 + (lane & 15)) * C::PSTR + kk * 16 + (lane >> 4) * 8);
            const bf16_bits* vrow = Kb + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * MLA_SROW + warp * 64 +
                                    (lane >> 4) * 8;
#pragma unroll
            for (int j = 0; j < C::NTO; j += 2) {
                unsigned b0, b1, b2, b3;
                ldsm_x4_t(b0, b1, b2, b3, vrow + j * 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(o[mt][j], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
                    mma_bf16(o[mt][j + 1], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b2, b3);
                }
            }
        }
#endif
    }
    cp_async_wait<0>();
    DDT_PDL_LAUNCH_DEPENDENTS();  // dependents still wait for this grid's writes below

    // ---- epilogue: the softmax threads publish 1/l (and the split's log2-sum-exp) ---------------------
    if (spart == 0) {
        linv_s[srow] = l_run > 0.f ? 1.f / l_run : 0.f;
        if (num_splits > 1 && srow < valid_m)
            part_lse[(size_t)split * total_packed + (size_t)rs * H + m0 + srow] =
                l_run > 0.f ? m_run + log2f(l_run) : -INFINITY;
    }
    __syncthreads();
#if MLA_PART_BF16
    if (num_splits > 1) {   // every lane takes part (shuffles); rows past the stream only skip the stores
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hi = 0; hi < 2; ++hi) {
                const int ml = mt * 16 + g + 8 * hi;
                const size_t gm = (size_t)rs * H + m0 + ml;
                mla_store_part_bf16_row<C::NTO>(part_o + ((size_t)split * total_packed + gm) * MLA_V_DIM + warp * 64,
                                                o[mt], hi, linv_s[ml], q4, ml < valid_m);
            }
        return;
    }
#endif
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            const int ml = mt * 16 + g + 8 * hi;
            if (ml >= valid_m) continue;
            const float inv = linv_s[ml];
            const size_t gm = (size_t)rs * H + m0 + ml;
            if (num_splits == 1) {
                bf16_bits* orow = out + gm * MLA_V_DIM + warp * 64 + 2 * q4;
#pragma unroll
                for (int j = 0; j < C::NTO; ++j)
                    *reinterpret_cast<unsigned*>(orow + j * 8) =
                        pack_bf16x2(o[mt][j][2 * hi] * inv, o[mt][j][2 * hi + 1] * inv);
            } else {
                mla_part_t* orow = part_o + ((size_t)split * total_packed + gm) * MLA_V_DIM + warp * 64 + 2 * q4;
#pragma unroll
                for (int j = 0; j < C::NTO; ++j)
                    mla_store_part2(orow + j * 8, o[mt][j][2 * hi] * inv, o[mt][j][2 * hi + 1] * inv);
            }
        }
}

// Merge the splits (attn_combine.cuh): one block of 8 warps per packed row. grid (max_rows * H, S).
// U = splits per warp in flight (4 or 1: kernels/attention.py combine_unroll picks by the grid size).
#define MLA_COMBINE_THREADS 256
// bf16 partials: without a minimum-blocks hint ptxas (NVRTC 12.9, sm_90 and sm_120) schedules the bf16
// combine's loads one at a time, each followed by its widening and fmas (U = 4: 1 of a warp's 8 loads issued
// before the first use), i.e. one L2 round trip per split, the serial pattern attn_combine.cuh exists to
// avoid. With (256, 2) all 8 are issued first (SASS checked on both, 72 registers on sm_90). The fp32 build on
// sm_90 keeps its bounds (its code issues all 16 loads first; unchanged PTX); on sm_120 the fp32 U = 4 issued 2 of
// its 16 loads before the first fma and with (256, 2) all 16 (SASS only: no sm_120 device to time it).
#if MLA_PART_BF16 || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000)
#define MLA_COMBINE_BOUNDS __launch_bounds__(MLA_COMBINE_THREADS, 2)
#else
#define MLA_COMBINE_BOUNDS __launch_bounds__(MLA_COMBINE_THREADS)
#endif
template <int U>
__global__ void MLA_COMBINE_BOUNDS mla_attn_combine(
    const mla_part_t* __restrict__ part_o, const float* __restrict__ part_lse, const int* __restrict__ n_rows,
    const int* __restrict__ row_start, int H, int total_packed, int num_splits, bf16_bits* __restrict__ out) {
    __shared__ __align__(16) AttnCombineSmem<MLA_V_DIM, MLA_COMBINE_THREADS / 32> sm;
    DDT_PDL_WAIT();
    const int b = blockIdx.y;
    const int m = blockIdx.x;
    if (m >= n_rows[b] * H) return;
    const size_t gm = (size_t)row_start[b] * H + m;
    attn_combine_row<MLA_V_DIM, MLA_COMBINE_THREADS / 32, U, mla_part_t>(part_o, part_lse, (size_t)total_packed, gm,
                                                                         num_splits, out + gm * MLA_V_DIM, sm);
}

// Instantiations are the compile.py name expressions (ddtree_cupy/kernels/attention.py MLA_CONFIGS):
// tiles of 64 / 32 / 16 packed rows, for > 160 KB (H200) and <= 99 KB (sm_120) of shared memory.
// MLA_PROBE_SKIP_{S,PV,LOAD} drop one phase; bench/attention.py --probe times them to show where the
// time goes (the results are wrong by construction; never set them elsewhere).
