// INT4 (W4A16) routed-expert GEMMs streamed by the bulk copy engine (any T: the routing from the block's own sort
// at T*k <= FUSED_MAX_PAIRS, or from moe_route's global arrays):
// gate/up with SiLU(gate)*up in the epilogue (MODE 0) and down with the routing weight (MODE 1). Same weight
// layout, routing contract and outputs as moe_gemm in moe_int4.cu (h[slot][row] bf16, y[pair][row] fp32, then
// moe_combine), same arithmetic per k64 step; docs/MOE.md "Bulk-copy GEMMs".
//
// Why a second family: the register-ring GEMM keeps ~1.7 KB per warp in flight and leans on an L2 prefetch that
// touches every weight line twice (Nsight: the L2, not DRAM, was the busiest unit), and its short units (4 k64
// steps per warp in the I = 256 down GEMM) start on an empty pipeline. Here one producer warp per block issues
// `cp.async.bulk` copies global -> shared (each copy a contiguous run: a 16-row tile's k-range of weights, its
// scales, one token's activation slice), completing on a per-stage mbarrier; the ring of NST stages runs on
// across unit boundaries, so tens of KB per SM stay in flight with no register cost and one L2 pass per line.
// Consumer warps only wait on the stage's barrier, dequantise from shared memory and issue mma.sync.
// Measured (docs/history/2026-11-29-moe.md "Bulk-copy GEMMs: measured"): what bounds it is the consumers' chain per stage, not the bytes in flight,
// hence stages of 16 k64 steps (gate/up) or a whole K (down at I <= 256).
//
// Block = WM x WK consumer warps + 1 producer warp. A unit is (chunk, m-group) as in moe_gemm: the chunk's
// <= XR (8; the compact gate/up blocks 4 or 2) tokens times WM pairs of m16 tiles (gate/up: tiles 2r = gate rows 16r.., 2r+1 = up rows 16r..). A stage
// holds SS = WK * SPW k64 steps of the unit's 2*WM tiles; consumer warp (wm, kw) computes tile pair wm over
// steps kw*SPW .. kw*SPW + SPW - 1 of every stage, and the WK partial sums meet in shared memory at the unit's
// end in a fixed order (deterministic).
//
// Routing (template parameter G). G = 0 (T*k <= FUSED_MAX_PAIRS): both kernels sort the routing themselves
// with the deterministic shared-memory sort (sort_pairs_block), so every block of both kernels derives the same
// slots; block 0 of the gate/up kernel publishes chunks / slot_pair / meta like moe_gemm does (for
// ws.bad_ids() and debugging). G = 1 (any T; docs/MOE.md "Bulk-copy GEMMs at large T"):
// moe_route ran first (chunks of <= 8 tokens); both kernels read its global chunk list, slot_pair and meta[0],
// so they agree on the slots by construction (whatever order its atomic ranks gave).
//
// PDL: the gate/up kernel waits first (ids, weights and x come from the router and the norm; G = 1: the
// routing arrays from moe_route). The down kernel sorts (G = 0) or reads the routing arrays (G = 1) and issues
// its first NST stages of WEIGHT copies before its wait: ids / weights were written by the router and the
// routing arrays by moe_route, both of which had finished before the gate/up kernel passed its own wait and let
// this kernel launch (the gate/up triggers its dependents only after that wait, and its G = 1 variant writes no
// routing array), and expert weights are constants; only h (the gate/up output) needs the wait, and its copies
// are issued after it. The down's consumers never wait: what they read of earlier kernels is the routing (the
// same argument) and h through the producer's copies.
#ifdef DDT_MOE_TIMELINE
// The shared-memory sort's phase ends (thread 0's clock), copied into the block header at the block's end.
__shared__ long long mtl_sort_marks[6];
#define MOE_SORT_MARK(k)                                                                                    \
    do {                                                                                                    \
        if (threadIdx.x == 0) {                                                                             \
            long long c_;                                                                                   \
            asm volatile("mov.u64 %0, %%clock64;" : "=l"(c_) :: "memory");                                 \
            mtl_sort_marks[k] = c_;                                                                         \
        }                                                                                                   \
    } while (0)
#endif
#include "moe_common.cuh"

// ---------------------------------------------------------------------------------------------------------
// Timeline build (docs/history/2026-11-29-moe.md "A timeline build"). Only with
// -DDDT_MOE_TIMELINE (kernels/moe/timeline.py's SPEC_BULK_TIMELINE): the kernel takes one more argument, `tl`, and lane 0 of every
// warp of the blocks blockIdx.x < DDT_MOE_TL_BLOCKS stores SM cycle stamps (%clock64) at fixed events into it.
// Without the macro every MB_TL(...) is empty and the parameter list is the production one: the production
// PTX does not change (checked by diffing it before / after, line info stripped).
// Why %clock64 per event and %globaltimer only at a warp's start and end: %globaltimer's update interval is
// implementation-defined (microsecond-scale on some parts, i.e. coarser than the ~1-2 us stage this is meant
// to resolve); %clock64 counts SM cycles, and every warp of a block sits on one SM, so the stamps of a block
// compare exactly. The start / end pairs (globaltimer, clock64) give each block's cycles-per-ns and place the
// blocks on one time axis (bench/moe_timeline.py).
// Layout of one block's record (int64 words; the buffer is poisoned with -1 by the caller, so -1 = "not
// recorded"), NW = consumer warps + 1 (the producer is warp NW - 1), S = DDT_MOE_TL_STAGES, U = DDT_MOE_TL_UNITS:
//   [0, 16)                    block header: magic, smid, units of this block, stages per unit, NCW, NST, SS, chunks,
//                              then (G = 0) thread 0's clock at the shared-memory sort's phase ends (MOE_SORT_MARK:
//                              entry, ids loaded, counted, scanned, chunks cut, ranked), 2 words unused
//   [16, 16 + 8 NW)            per warp: gt_start, clk_start, clk_pdl (after its PDL wait, if it has one),
//                              clk_sort (routing ready), gt_end, clk_end, stages done, units done
//   then [NW][S][3]            per warp and ring stage it (its running stage count, across units):
//                              consumer: before the full wait, after it, before its empty arrive (stage released)
//                              producer: before the empty wait, after it, after its lanes issued the copies
//   then [NW][U][2]            per consumer warp and local unit: epilogue start (after the last stage), end
// Stage / unit indices past S / U are not recorded (the counts in the warp header still are). The headers are
// stored at each warp's end from registers (nothing global is written before the PDL wait); the block header
// last of all by warp 0.
// ---------------------------------------------------------------------------------------------------------
#ifdef DDT_MOE_TIMELINE
#ifndef DDT_MOE_TL_STAGES
#define DDT_MOE_TL_STAGES 128
#endif
#ifndef DDT_MOE_TL_UNITS
#define DDT_MOE_TL_UNITS 32
#endif
#ifndef DDT_MOE_TL_BLOCKS
#define DDT_MOE_TL_BLOCKS 1024
#endif
#define MB_TL(...) __VA_ARGS__
namespace mtl {
constexpr int S = DDT_MOE_TL_STAGES, U = DDT_MOE_TL_UNITS, B = DDT_MOE_TL_BLOCKS, BH = 16, WH = 8;
constexpr long long MAGIC = 0x544C424Bll;    // "TLBK": this block's record was written
enum { B_MAGIC = 0, B_SMID, B_UNITS, B_NST_UNIT, B_NCW, B_NST, B_SS, B_CHUNKS, B_SORT0 };   // B_SORT0 .. + 5: sort phases
enum { W_GT0 = 0, W_CLK0, W_PDL, W_SORT, W_GT1, W_CLK1, W_STAGES, W_UNITS };
__host__ __device__ constexpr int block_words(int nw) { return BH + nw * WH + nw * S * 3 + nw * U * 2; }
// The timer reads are volatile asm with a memory clobber so that the compiler keeps them where they are written
// relative to the barrier asms (also volatile, also clobbering memory); they add no data dependence.
__device__ __forceinline__ long long clk() {
    long long c;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(c) :: "memory");
    return c;
}
__device__ __forceinline__ long long gtime() {
    long long c;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(c) :: "memory");
    return c;
}
__device__ __forceinline__ int smid() {
    int v;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(v));
    return v;
}
// One warp's writer: only lane 0 of a recorded block stores (every lane reads the clock: no divergence there).
struct Rec {
    long long* base;
    int warp, nw;
    bool on;
    __device__ void blk(int f, long long v) const { if (on) base[f] = v; }
    __device__ void hdr(int f, long long v) const { if (on) base[BH + warp * WH + f] = v; }
    __device__ void stage(int it, int e, long long v) const {
        if (on && it < S) base[BH + nw * WH + (warp * S + it) * 3 + e] = v;
    }
    __device__ void unit(int lu, int e, long long v) const {
        if (on && lu < U) base[BH + nw * WH + nw * S * 3 + (warp * U + lu) * 2 + e] = v;
    }
    // The warp header, written at the warp's end from registers: nothing is stored before the kernel's PDL wait
    // (docs/KERNELS.md "PDL": a kernel writes nothing global before it; the down kernel's consumers never wait,
    // but their stage stamps follow the producer's wait through the full barriers).
    __device__ void end(long long gt0, long long clk0, long long pdl, long long sort, int stages, int units) const {
        const long long gt1 = gtime(), clk1 = clk();
        hdr(W_GT0, gt0);
        hdr(W_CLK0, clk0);
        hdr(W_PDL, pdl);
        hdr(W_SORT, sort);
        hdr(W_GT1, gt1);
        hdr(W_CLK1, clk1);
        hdr(W_STAGES, stages);
        hdr(W_UNITS, units);
    }
};
}  // namespace mtl
#else
#define MB_TL(...)
#endif

namespace mbulk {

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(bar)), "r"(count) : "memory");
}
// One arrival (the producer's) plus the bytes the stage's copies will deliver.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(bar)) : "memory");
}
// Every lane waits (try_wait: the hardware may suspend the thread until the phase completes). Measured against
// test_wait polling and a lane-0-only wait + __syncwarp: both slower (docs/history/2026-11-29-moe.md "Bulk-copy GEMMs: measured").
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done = 0;
    do {
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    } while (!done);
}
// Contiguous global -> shared copy by the bulk copy engine (16-byte aligned, size a multiple of 16).
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
// Barrier 1 among the consumer warps only (the producer warp never joins it).
__device__ __forceinline__ void consumers_sync(int nthreads) {
    asm volatile("bar.sync 1, %0;" :: "r"(nthreads) : "memory");
}

// One stage of the ring: [2*WM tiles][SS steps][512 B] weights, [2*WM][SS][64 B] scales, [XR tokens][X_PITCH]
// activations (SS*128 B of k per token; the pitch is 64 B past a multiple of 128 so that the two token rows an
// 8-lane phase of a 16-byte load touches fall in different bank halves). XR = the chunk size (token rows per
// unit): 8 everywhere but the compact gate/up blocks (docs/MOE.md "Compact token rows"),
// whose 4 or 2 rows leave room for a third stage.
template <int WM, int SS, int XR = 8>
struct Stage {
    static constexpr int W_BYTES = 2 * WM * SS * 512;
    static constexpr int S_BYTES = 2 * WM * SS * 64;
    static constexpr int X_PITCH = SS * 128 + 64;
    static constexpr int BYTES = W_BYTES + S_BYTES + XR * X_PITCH;   // a multiple of 128 for XR in {2, 4, 8}
};

struct BulkMeta {
    SortSmem sort;
    float wslot[FUSED_MAX_PAIRS];     // routing weight of each sorted slot (down kernel)
};

}  // namespace mbulk

using namespace mbulk;

// Dynamic shared memory: [NST full | NST empty mbarriers, padded to 128 B][NST stages][BulkMeta (G = 0 only)].
// XR: token rows per chunk (the sort's chunk size; 8 = the previous kernels, unchanged). XR = 4 / 2 (gate/up with
// the shared-memory sort only): an expert with more tokens gets several chunks, so its weights are streamed once
// per chunk; each token column's arithmetic (k order, K-split partial order) is the same as at XR = 8, so h is
// bit-identical, and the slots (hence what the down kernel reads) do not depend on the chunk size at all
// (sort_pairs_block: a slot is the expert's run offset + the pair's rank).
// G: where the routing comes from. 0 = the block sorts it in shared memory (T*k <= FUSED_MAX_PAIRS);
// 1 = moe_route's global arrays (chunks, slot_pair, meta[0] = chunks; any T), read through L2 one and two
// units ahead of their use so that a unit never waits on a routing round trip (see "Lookahead" below).
template <int MODE, int WM, int WK, int SPW, int NST, int G, int XR = 8>
// Timeline build: at least 2 blocks per SM for the gate/up (its production occupancy on the H200; measured in
// With 99 registers the compact gate/up's timeline build fit 1 block per SM, the register file being
// allocated per SM quadrant, so it ran in two waves and the record described another kernel).
// (sm_90 only: sm_120's 99 KB fit one gate/up block per SM anyway, and a register cap there would spill.)
#if defined(DDT_MOE_TIMELINE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 1000
#define MB_MIN_BLOCKS (MODE == 0 ? 2 : 1)
#else
#define MB_MIN_BLOCKS 1
#endif
__global__ void __launch_bounds__((WM * WK + 1) * 32, MB_MIN_BLOCKS) moe_gemm_bulk(
        const uint4* __restrict__ wp, const uint2* __restrict__ sp, int N, int KS,
        const bf16_bits* __restrict__ act, int act_stride,
        const int* __restrict__ ids, const float* __restrict__ wts, int T, int k, int E,
        int* __restrict__ slot_pair, int4* __restrict__ chunks, int* __restrict__ meta,
        bf16_bits* __restrict__ h_out, int h_stride, float* __restrict__ y, int whole_ok
#ifdef DDT_MOE_TIMELINE
        , long long* __restrict__ tl
#endif
        ) {
    constexpr int NCW = WM * WK;          // consumer warps
    constexpr int SS = WK * SPW;          // k64 steps per stage
    using St = Stage<WM, SS, XR>;
    static_assert(4 * WM + XR <= 32, "one producer lane per copy: 2*WM weight tiles, their scales, XR token rows");
    static_assert(G == 0 || G == 1, "G: 0 = shared-memory sort, 1 = moe_route's global arrays");
    static_assert(XR == 8 || XR == 4 || XR == 2, "XR: token rows per chunk, 8, 4 or 2");
    // moe_route cuts chunks of 8 (G = 1), and the down kernel's whole-K stage copies up to 8 h rows
    static_assert(XR == 8 || (MODE == 0 && G == 0), "XR < 8: gate/up with the shared-memory sort only");
    // K-split partials, double-buffered by unit parity: one barrier per unit (a warp can only reach the next
    // unit's barrier, and so the buffer after it, once every warp has finished this unit's epilogue reads).
    // Only lanes whose columns can hold a token store them: tokens j = 2t, 2t + 1 < XR, i.e. t < XR / 2, so
    // RL = 4 * XR lanes per warp (XR = 8: all 32, the previous layout; XR = 4: half the buffer, which is what
    // lets a third stage fit sm_120's 99 KB).
    constexpr int RL = 4 * XR;
    constexpr int RED_UNIT = NCW * 2 * 4 * RL;
    constexpr int RED = WK > 1 ? 2 * RED_UNIT : 1;
    __shared__ float red[RED];
    extern __shared__ __align__(128) unsigned char bulk_dyn[];
    uint64_t* full = reinterpret_cast<uint64_t*>(bulk_dyn);
    uint64_t* empty = full + NST;
    unsigned char* ring = bulk_dyn + 128;
    // (G = 1 allocates no BulkMeta: the reference is formed, never used)
    BulkMeta& bm = *reinterpret_cast<BulkMeta*>(ring + (size_t)NST * St::BYTES);
    SortSmem& so = bm.sort;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ntiles = N / 16;                       // even: pack_moe_weights checks H % 64 and I % 32
    const int n_mg = (ntiles / 2 + WM - 1) / WM;
    const int npairs = T * k;
    MB_TL(const mtl::Rec rec{tl + (size_t)min((int)blockIdx.x, mtl::B - 1) * mtl::block_words(NCW + 1), warp, NCW + 1,
                             lane == 0 && (int)blockIdx.x < mtl::B};
          const long long tl_gt0 = mtl::gtime();
          const long long tl_clk0 = mtl::clk();
          long long tl_pdl = -1;)                   // -1: no PDL wait in this warp (the down's consumers)

    if (threadIdx.x == 0) {
        for (int s = 0; s < NST; ++s) { mbar_init(full + s, 1); mbar_init(empty + s, NCW); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if (MODE == 0) DDT_PDL_WAIT();                   // ids and x come from the router / the norm (G = 1: and
                                                     // the routing arrays from moe_route)
    MB_TL(if (MODE == 0) tl_pdl = mtl::clk();)
    int n_chunks;
    if constexpr (G == 0) {
        sort_pairs_block(ids, npairs, E, XR, so);    // ends with __syncthreads (the barrier inits are visible)
        n_chunks = so.total.y;
        if constexpr (MODE == 0) {
            if (blockIdx.x == 0) {
                for (int c = threadIdx.x; c < n_chunks; c += blockDim.x) chunks[c] = so.chunks[c];
                for (int s = threadIdx.x; s < so.total.x; s += blockDim.x) slot_pair[s] = so.slot_pair[s];
                if (threadIdx.x == 0) { meta[0] = n_chunks; meta[1] = so.bad; }
            }
        } else {
            for (int s = threadIdx.x; s < so.total.x; s += blockDim.x) bm.wslot[s] = wts[so.slot_pair[s]];
            __syncthreads();
        }
    } else {
        // MODE 1 reads moe_route's arrays before its PDL wait: moe_route finished before the gate/up kernel
        // passed its wait, and the gate/up lets this kernel launch only after that wait (header, "PDL").
        n_chunks = __ldcg(meta);
        __syncthreads();                             // the barrier inits are visible to every warp
    }
    (void)npairs;
    const int n_units = n_chunks * n_mg;
    const int nst_unit = (KS + SS - 1) / SS;
    MB_TL(const long long tl_sort = mtl::clk();)
    // The chunk of unit u (units run m-group major: u = mg * n_chunks + chunk).
    auto chunk_of = [&](int u) -> int4 {
        const int c = u - (u / n_chunks) * n_chunks;
        if constexpr (G == 0) return so.chunks[c];
        else return __ldcg(chunks + c);
    };
    // Down GEMM whose stage holds the whole K (I <= 64 * SS): tiles and h rows are contiguous runs (one copy each)
    // and the h rows land unpadded (x_pitch = the h row: a 2-way bank conflict on the B loads, against ~5x fewer
    // copies per stage).
    const bool whole = whole_ok && MODE == 1 && KS == SS && act_stride == KS * 64;
    const int x_pitch = whole ? KS * 128 : St::X_PITCH;

    if (warp == NCW) {
        // ---------------- producer warp ----------------
        // Lanes [0, 2WM): weight tile, [2WM, 4WM): its scales, [4WM, 4WM + XR): token row (gate/up: x of the
        // pair's token; down: h of the slot). One copy per lane and stage.
        const int j = lane - 4 * WM;                 // this lane's token of the chunk (when 0 <= j < ch.z <= XR)
        // This lane's routing datum for a unit: gate/up the pair of slot ch.y + j (its token = pair / k, divided
        // only where the copy is issued, so that a lookahead load is not waited for early); down: unused.
        auto pair_of = [&](int4 ch) -> int {
            if (MODE == 1 || j < 0 || j >= ch.z) return 0;
            if constexpr (G == 0) return so.slot_pair[ch.y + j];
            else return __ldcg(slot_pair + ch.y + j);
        };
        // This lane's copy for a unit, worked out once per unit: the per-stage issue is then an add,
        // a min and the copy. Measured with the timeline build (docs/history/2026-11-29-moe.md "The timeline run"): the producer spent
        // ~1.1 us per gate/up stage between its empty wait and its last copy, 70% of its life, with three integer
        // divisions by runtime values and the 64-bit index products redone every stage while it shares its
        // scheduler with busy consumer warps; the consumers' full waits were mostly "producer busy elsewhere".
        // kind: 0 = no copy, 1 = weights or scales (tile r), 2 = a token row (gate/up: x of the pair's token;
        // down: h of the slot). A stage at k0 copies src + k0 * step, ns * step bytes, to dst of the slot.
        struct Copy {
            const unsigned char* src;
            uint32_t dst, step, stage_step;          // stage_step: the whole stage's bytes per k64 step
            int kind;
        };
        auto plan = [&](int u, int4 ch, int pr) -> Copy {
            const int mg = u / n_chunks;
            const int tile0 = mg * WM * 2;
            const int ntl = min(2 * WM, ntiles - tile0);
            Copy c{nullptr, 0u, 0u, (uint32_t)(ntl * 576 + ch.z * 128), 0};
            if (whole) {
                // The stage is the unit's whole K: its tiles' weights, their scales and the chunk's h rows are
                // three contiguous runs, so three copies instead of one per tile and token row (the copy unit's
                // cost is per request: docs/MOE.md). k0 is always 0 here.
                const size_t blk = ((size_t)ch.x * ntiles + tile0) * KS;
                if (lane == 0) c = Copy{(const unsigned char*)(wp + blk * 32), 0u, (uint32_t)(ntl * 512), c.stage_step, 1};
                if (lane == 1) c = Copy{(const unsigned char*)(sp + blk * 8), (uint32_t)St::W_BYTES, (uint32_t)(ntl * 64), c.stage_step, 1};
                if (lane == 2)
                    c = Copy{(const unsigned char*)(act + (size_t)ch.y * act_stride), (uint32_t)(St::W_BYTES + St::S_BYTES),
                             (uint32_t)(ch.z * 128), c.stage_step, 2};
                return c;
            }
            if (lane < 4 * WM) {
                const int r = lane < 2 * WM ? lane : lane - 2 * WM;
                if (tile0 + r < ntiles) {
                    const size_t blk = ((size_t)ch.x * ntiles + tile0 + r) * KS;
                    if (lane < 2 * WM) c = Copy{(const unsigned char*)(wp + blk * 32), (uint32_t)(r * SS * 512), 512u, c.stage_step, 1};
                    else c = Copy{(const unsigned char*)(sp + blk * 8), (uint32_t)(St::W_BYTES + r * SS * 64), 64u, c.stage_step, 1};
                }
            } else if (j < ch.z) {
                const size_t row = MODE == 0 ? (size_t)(pr / k) : (size_t)(ch.y + j);
                c = Copy{(const unsigned char*)(act + row * act_stride), (uint32_t)(St::W_BYTES + St::S_BYTES + j * St::X_PITCH),
                         128u, c.stage_step, 2};
            }
            return c;
        };
        // Lane 0 arms the stage's barrier with all its bytes, then every lane issues its copy (kinds in `kinds`).
        auto arm = [&](const Copy& c, int k0, int slot) {
            if (lane == 0) mbar_arrive_expect_tx(full + slot, (uint32_t)min(SS, KS - k0) * c.stage_step);
            __syncwarp();
        };
        auto issue = [&](const Copy& c, int k0, int slot, int kinds) {
            if ((c.kind & kinds) == 0) return;
            const uint32_t ns = (uint32_t)min(SS, KS - k0);
            bulk_g2s(ring + (size_t)slot * St::BYTES + c.dst, c.src + (size_t)k0 * c.step, ns * c.step, full + slot);
        };
        int pre = 0;                                 // stages whose weights went out before the PDL wait
        if constexpr (MODE == 1) {
            int u = blockIdx.x, k0 = 0;
            Copy c = plan(u, u < n_units ? chunk_of(u) : make_int4(0, 0, 0, 0), 0);
            for (; pre < NST && u < n_units; ++pre) {
                arm(c, k0, pre);
                issue(c, k0, pre, 1);
                k0 += SS;
                if (k0 >= KS) {
                    k0 = 0;
                    u += gridDim.x;
                    if (u < n_units) c = plan(u, chunk_of(u), 0);
                }
            }
            DDT_PDL_WAIT();                          // h is the gate/up kernel's output
            MB_TL(tl_pdl = mtl::clk();)
        }
        // Lookahead: at the start of unit u the chunk of u + grid is already here (loaded one unit ago) and
        // this lane's pair of it is requested now; the chunk of u + 2 grid is requested now. A unit's copies
        // then wait on no routing load (G = 1: L2 round trips; G = 0: shared memory, the same order).
        const int gs = gridDim.x;
        int u = blockIdx.x;
        int4 ch = u < n_units ? chunk_of(u) : make_int4(0, 0, 0, 0);
        int pr = pair_of(ch);
        int4 ch1 = u + gs < n_units ? chunk_of(u + gs) : ch;
        int it = 0;
        for (; u < n_units; u += gs) {
            const int pr1 = u + gs < n_units ? pair_of(ch1) : 0;
            const int4 ch2 = u + 2 * gs < n_units ? chunk_of(u + 2 * gs) : ch1;
            const Copy c = plan(u, ch, pr);
            for (int k0 = 0; k0 < KS; k0 += SS, ++it) {
                const int slot = it % NST;
                MB_TL(rec.stage(it, 0, mtl::clk());)
                if (it < pre) {
                    MB_TL(rec.stage(it, 1, mtl::clk());)
                    issue(c, k0, slot, 2);
                    MB_TL(__syncwarp(); rec.stage(it, 2, mtl::clk());)
                    continue;
                }
                if (it >= NST) mbar_wait(empty + slot, ((it / NST) - 1) & 1);
                MB_TL(rec.stage(it, 1, mtl::clk());)
                arm(c, k0, slot);
                issue(c, k0, slot, 3);
                MB_TL(__syncwarp(); rec.stage(it, 2, mtl::clk());)   // every lane's copy is issued
            }
            ch = ch1;
            ch1 = ch2;
            pr = pr1;
        }
        DDT_PDL_LAUNCH_DEPENDENTS();                 // everything is requested; the next kernel may launch
        MB_TL(rec.end(tl_gt0, tl_clk0, tl_pdl, tl_sort, it, -1);)
        return;
    }

    // ---------------- consumer warps ----------------
    const int wm = warp % WM, kw = warp / WM;
    const int g = lane >> 2, t = lane & 3;
    int it = 0;
    int unit_parity = 0;
    MB_TL(int lu = 0;)                               // units this warp has done (timeline index)
    // G = 1 lookahead (as the producer's): the chunk one unit ahead is here, the one two ahead in flight; the
    // down epilogue's pairs (columns 2t, 2t + 1) of the next unit are requested at this unit's start and their
    // routing weights at the next unit's start, so the epilogue never waits on L2.
    const int gs = gridDim.x;
    int4 gch = make_int4(0, 0, 0, 0), gch1 = gch;
    int gp0 = -1, gp1 = -1;
    if constexpr (G == 1) {
        const int u0 = blockIdx.x;
        if (u0 < n_units) gch = chunk_of(u0);
        gch1 = u0 + gs < n_units ? chunk_of(u0 + gs) : gch;
        if (MODE == 1) {
            gp0 = 2 * t < gch.z ? __ldcg(slot_pair + gch.y + 2 * t) : -1;
            gp1 = 2 * t + 1 < gch.z ? __ldcg(slot_pair + gch.y + 2 * t + 1) : -1;
        }
    }
    for (int u = blockIdx.x; u < n_units; u += gridDim.x) {
        const int mg = u / n_chunks;
        int4 ch;
        float gw0 = 0.f, gw1 = 0.f;
        int gp0n = -1, gp1n = -1;
        if constexpr (G == 0) {
            ch = so.chunks[u - mg * n_chunks];
        } else {
            ch = gch;
            const int4 ch2 = u + 2 * gs < n_units ? chunk_of(u + 2 * gs) : gch1;
            if (MODE == 1) {
                gw0 = gp0 >= 0 ? __ldg(wts + gp0) : 0.f;
                gw1 = gp1 >= 0 ? __ldg(wts + gp1) : 0.f;
                if (u + gs < n_units) {
                    gp0n = 2 * t < gch1.z ? __ldcg(slot_pair + gch1.y + 2 * t) : -1;
                    gp1n = 2 * t + 1 < gch1.z ? __ldcg(slot_pair + gch1.y + 2 * t + 1) : -1;
                }
            }
            gch = gch1;
            gch1 = ch2;
        }
        const int slot0 = ch.y, ntok = ch.z;
        const int tp = mg * WM + wm;                 // this warp's tile pair (tiles 2tp, 2tp + 1)
        const bool wactive = 2 * tp < ntiles;
        float acc[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[mt][q] = 0.f;
        for (int s = 0; s < nst_unit; ++s, ++it) {
            const int slot = it % NST;
            MB_TL(rec.stage(it, 0, mtl::clk());)
            mbar_wait(full + slot, (it / NST) & 1);
            MB_TL(rec.stage(it, 1, mtl::clk());)
            const unsigned char* st = ring + (size_t)slot * St::BYTES;
            const int ns = min(SS, KS - s * SS);
            if (wactive) {
#pragma unroll
                for (int i = 0; i < SPW; ++i) {
                    const int ks = kw * SPW + i;
                    if (ks < ns) {
                        // Absent token columns (g >= ntok) read a stale row: MMA columns are independent, so
                        // whatever it holds never reaches a stored column. Columns g >= XR have no row in the
                        // stage: they read row g % XR (inside the stage; a same-address broadcast, no conflict).
                        const int xrow = XR == 8 ? g : g % XR;
                        const unsigned char* xr = st + St::W_BYTES + St::S_BYTES + xrow * x_pitch + ks * 128 + 16 * t;
                        const uint4 b0 = *reinterpret_cast<const uint4*>(xr);
                        const uint4 b1 = *reinterpret_cast<const uint4*>(xr + 64);
#pragma unroll
                        for (int mt = 0; mt < 2; ++mt) {
                            const int r = 2 * wm + mt;
                            const uint4 a = reinterpret_cast<const uint4*>(st + (r * SS + ks) * 512)[lane];
                            const uint2 sc = reinterpret_cast<const uint2*>(st + St::W_BYTES + (r * SS + ks) * 64)[g];
                            uint32_t A[4][4];
                            dequant_word(a.x, A[0]);
                            dequant_word(a.y, A[1]);
                            dequant_word(a.z, A[2]);
                            dequant_word(a.w, A[3]);
                            const float s00 = bf_lo(sc.x), s08 = bf_hi(sc.x);
                            const float s10 = bf_lo(sc.y), s18 = bf_hi(sc.y);
                            float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
                            mma_bf16(d0, A[0], b0.x, b0.y);
                            mma_bf16(d0, A[1], b0.z, b0.w);
                            mma_bf16(d1, A[2], b1.x, b1.y);
                            mma_bf16(d1, A[3], b1.z, b1.w);
                            acc[mt][0] += s00 * d0[0] + s10 * d1[0];
                            acc[mt][1] += s00 * d0[1] + s10 * d1[1];
                            acc[mt][2] += s08 * d0[2] + s18 * d1[2];
                            acc[mt][3] += s08 * d0[3] + s18 * d1[3];
                        }
                    }
                }
            }
            __syncwarp();                            // every lane has read the stage
            MB_TL(rec.stage(it, 2, mtl::clk());)     // released: what the producer's empty wait sees
            if (lane == 0) mbar_arrive(empty + slot);
        }
        MB_TL(rec.unit(lu, 0, mtl::clk());)

        // Epilogue of column q (token j = 2t + q%2, row g + 8*(q/2) of each tile) from its two tile values.
        auto store = [&](int q, float v0, float v1) {
            const int j = 2 * t + (q & 1);
            const int slot = slot0 + j;
            if constexpr (MODE == 0) {
                h_out[(size_t)slot * h_stride + tp * 16 + g + 8 * (q >> 1)] = f32_to_bf16(v0 / (1.f + expf(-v0)) * v1);
            } else {
                int pair;
                float wgt;
                if constexpr (G == 0) {
                    pair = so.slot_pair[slot];
                    wgt = bm.wslot[slot];
                } else {
                    pair = (q & 1) ? gp1 : gp0;
                    wgt = (q & 1) ? gw1 : gw0;
                }
                const size_t row = (size_t)pair * N + 2 * tp * 16 + g + 8 * (q >> 1);
                y[row] = wgt * v0;
                y[row + 16] = wgt * v1;
            }
        };
        if (WK > 1) {
            float* buf = red + (size_t)(unit_parity * RED_UNIT);
            const int rl = g * (XR / 2) + t;         // this lane's place among the RL storing lanes (XR = 8: lane)
            float* mine = buf + (size_t)warp * 2 * 4 * RL + rl;
            if (XR == 8 || 2 * t < XR) {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int q = 0; q < 4; ++q) mine[(mt * 4 + q) * RL] = acc[mt][q];
            }
            consumers_sync(NCW * 32);
            // The WK warps of a tile pair share its four columns: warp kw sums column q = kw, kw + WK, ... over
            // the K slices in a fixed order (deterministic) and stores it.
            if (wactive) {
                for (int q = kw; q < 4; q += WK) {
                    if (2 * t + (q & 1) >= ntok) continue;       // (ntok <= XR: so t < XR / 2 below)
                    float v0 = 0.f, v1 = 0.f;
                    for (int k2 = 0; k2 < WK; ++k2) {
                        const float* p = buf + ((size_t)(k2 * WM + wm) * 2 * 4 + q) * RL + rl;
                        v0 += p[0];
                        v1 += p[4 * RL];
                    }
                    store(q, v0, v1);
                }
            }
            unit_parity ^= 1;
        } else if (wactive) {
#pragma unroll
            for (int q = 0; q < 4; ++q)
                if (2 * t + (q & 1) < ntok) store(q, acc[0][q], acc[1][q]);
        }
        if constexpr (G == 1) {
            gp0 = gp0n;
            gp1 = gp1n;
        }
        MB_TL(rec.unit(lu, 1, mtl::clk()); ++lu;)
    }
    MB_TL(rec.end(tl_gt0, tl_clk0, tl_pdl, tl_sort, it, lu);
          if (warp == 0) {                           // the block header (last: "magic" marks a written record)
              rec.blk(mtl::B_SMID, mtl::smid());
              rec.blk(mtl::B_UNITS, (int)blockIdx.x < n_units ? (n_units - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x : 0);
              rec.blk(mtl::B_NST_UNIT, nst_unit);
              rec.blk(mtl::B_NCW, NCW);
              rec.blk(mtl::B_NST, NST);
              rec.blk(mtl::B_SS, SS);
              rec.blk(mtl::B_CHUNKS, n_chunks);
              if constexpr (G == 0)
                  for (int m = 0; m < 6; ++m) rec.blk(mtl::B_SORT0 + m, mtl_sort_marks[m]);
              rec.blk(mtl::B_MAGIC, mtl::MAGIC);
          })
}
