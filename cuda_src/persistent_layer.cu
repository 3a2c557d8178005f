// Persistent layer executor (docs/PERSISTENT.md): one block per resident slot walks its precomputed list of
// work items (ddtree_cupy/engine/schedule.py, Schedule.encode). Per item: wait until every counter it
// depends on has reached its target, run the item's body, signal its own counter.
//
//  * Waits: thread q polls wait q (q + 256, ...) with acquire loads (ld.acquire.gpu) until its counter reaches
//    the target, then the block barrier publishes the observation. The spin is bounded (spin_limit polls,
//    with nanosleep back-off): past it, the block records (device row + 1) in err[0] and the reason in
//    err[1], and every block leaves at its next wait (no launch hangs forever; the host checks err). Norm
//    items and GEMM runs wait after their weight loads (the norm weight, the run's first STAGES - 1 ring
//    stages), which are in flight while the producers finish.
//  * Signals: the block barrier (every thread's stores issued), then thread 0 adds 1 with a release
//    reduction (red.release.gpu: the block's stores, ordered before it by the barrier, are visible
//    device-wide before the count is). No separate fence: a full fence per item cost ~1 us of each item.
//    GEMM parts signal with their arrival (acq_rel) and, for a group's last, the fixup's release.
//  * Records: the block's header, its first step's records and the whole op table are read once at the
//    start (shared memory); each next step's records are prefetched with cp.async while the current step
//    runs, so no step waits on a chain of dependent global loads before its first weight request.
//  * Two counter sets: each block counts its launches in its own word; launch g uses set g & 1 and zeroes the other
//    (the previous launch's, the next one's), so a CUDA graph replays the launch with no memset and no block
//    resets anything at its end. After an error the host resets both sets and the counts.
//  * Activations produced by other blocks in the same launch are read with L1-bypassing loads (ld.cg, or
//    cp.async.cg in the GEMM run), never through a line this SM may have cached before it was written. The
//    GEMM run loads its tokens with cp.async.cg only, after the wait for every producer of them.
//  * trace (optional), from the global ns timer: per item (block, start, end); start = when the block
//    reached the item (its weight prologue and wait included); the parts of a GEMM run share the run's start
//    and each ends when its part end is done (the block sum, its store and arrival, the fixup if it was last).
//    A block's header row gets (block start, set-up done, block end, the SM it ran on). Rows of 4 int64.
//  * Shared pieces: rmsnorm_row (norm_row.cuh), the decode GEMM's ring layout and swizzle (swz, GEMM_BK,
//    DEC_WARPS, gemm_bf16.cu: the GEMM run's copies and mma stage are decode_load_w / decode_load_x /
//    decode_mma_stage on shared addresses computed once per run), silu_mul1 (layer_math.cuh).
//
// Item record (int32 x 16): kind, op, arg0..arg6, wait_begin, n_waits, signal, run, run waits (2), 0. `op` indexes the op
// table (PersistOp, one per stage of the layer: pointers, strides, sizes). Kinds (schedule.KIND):
//   1 norm_row    arg0 = row                                     rmsnorm_row (residual add when op.x2 is set)
//   3 boundary    TP = 1 all-reduce stand-in: out = x (a fused all-reduce replaces this body)
//   4 row_post    arg0 = row                                     qkv_a_post_row (mla_small.cuh): c_q norm, latent
//                 norm + RoPE into the paged cache; op.x = qkv_a rows, op.w = q_a norm, op.K = q_lora, aux
//   5 head_gemm   arg0 = head, arg1 = piece, arg2 = its columns   head_gemm_* (mla_small.cuh) as two groups of 4
//                 (64 with K = 128, 32 with K = 512)              warps; piece 0 also rotates the head's q_pe
//                                                                when aux.pe is set
//  15 gemm_part   arg0 = first weight row of the 16-row unit, arg1 / arg2 = first k tile / k tiles,
//                 arg3 = workspace slot, arg4 / arg5 / arg6 = the group's first slot / gate parts / parts;
//                 [12] = the run length from here, [13] / [14] = the run's waits (first, count). A block's
//                 consecutive parts of one GEMM run as one step (gemm_run below).
// Any other kind sets err and stops (the host refuses schedules with kinds this build does not run).
#include "norm_row.cuh"
#include "mla_small.cuh"
#include "gpu_sync.cuh"
#include "gemm_bf16.cu"

#define PERSIST_THREADS DEC_THREADS           // 256: the decode GEMM body's and the norm body's block
static_assert(PERSIST_THREADS == NORM_THREADS, "the norm row body needs the GEMM body's block size");

#define PERSIST_ERR_TIMEOUT 1
#define PERSIST_ERR_KIND 2
#define PERSIST_ERR_SHAPE 3

struct PersistOp {
    const bf16_bits* x;       // input rows (GEMM x, norm x, boundary source)
    const bf16_bits* x2;      // norm: residual in (nullptr: no residual add)
    const bf16_bits* w;       // GEMM weight [N, K] / norm weight [H]
    void* out;                // GEMM (bf16 [T, N], or act [T, N / 2] with SwiGLU) / norm / boundary output
    bf16_bits* out2;          // norm: residual out; GEMM: the parts' fp32 block sums [part slot][T][16]
    long long x_stride, x2_stride, out_stride, out2_stride;   // row strides in elements
    int T, N, K, flags;       // flags bit 1: GEMM fixup is SwiGLU of a gate|up pair
    long long aux;            // byte offset of the stage's PersistAux in the op table (0: none)
    float eps;
    int pad;
};

// The extra arguments of the row_post and head_gemm stages, after the op records in the same table (so the
// block's shared-memory copy of the table holds them too: no dependent global load in the item).
struct PersistAux {
    const bf16_bits* w2;          // row_post: the kv_a norm weight [512]
    const int* positions;         // RoPE positions [T] (row_post: k_pe; head_gemm: q_pe)
    const float* inv_freq;        // the RoPE table [rotary pairs]
    const int* stream_ids;        // row_post: each row's stream [T]
    const int* kv_pos;            // row_post: each row's cache position [T] (< 0: no cache write)
    bf16_bits* pool;              // row_post: the paged latent cache [pages, 64, 576]
    const int* block_table;       // row_post: [streams, max_pages]
    const bf16_bits* pe;          // head_gemm: q_pe to rotate (nullptr: none), [T, nh, 2 half] strided
    bf16_bits* pe_out;            // head_gemm: its destination
    long long x_head, out_head, pe_row, pe_head, pe_out_row, pe_out_head;   // head_gemm strides (elements)
    int max_pages;                // row_post: the block table's row length
    int half;                     // head_gemm: rotary pairs
    float amplitude;              // RoPE amplitude
    int pad;
};

// kernels/persistent.py OP_DTYPE / AUX_DTYPE mirror these layouts: naturally aligned fields in this order
// (PersistOp's aux at offset 88, after its four 4-byte fields), no implicit padding, so the sizes pin the
// offsets (NVRTC has no offsetof in constant expressions).
static_assert(sizeof(PersistOp) == 104 && alignof(PersistOp) == 8, "PersistOp layout (OP_DTYPE)");
static_assert(sizeof(PersistAux) == 136 && alignof(PersistAux) == 8, "PersistAux layout (AUX_DTYPE)");

__device__ __forceinline__ long long global_ns() {
    long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// 8 bf16 through L2 only (a line another block wrote during this launch)
__device__ __forceinline__ uint4 ldcg16(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

// Poll the (counter, target) pairs[0 .. n) until every counter has reached its target: thread q polls pairs
// q, q + 256, ... with acquire loads (n waits cost one round trip, not n), bounded: past spin_limit polls the
// block records the item (err[0] = device row + 1, err[1] = the reason); a block that sees another's error
// gives up too. Then the block barrier publishes what the pollers saw; returns whether the block gave up
// (the same answer in every thread).
__device__ __forceinline__ bool wait_counters(const int* pairs, int n, const int* counters, int* err, int item,
                                              int spin_limit) {
    int bad = 0;
    for (int q = threadIdx.x; q < n && !bad; q += PERSIST_THREADS) {
        const int* c = counters + pairs[2 * q];
        const int target = pairs[2 * q + 1];
        int polls = 0;
        while (ld_acquire(c) < target) {
            if (*(volatile int*)err) { bad = 1; break; }            // another block gave up
            if (++polls > spin_limit) {
                if (atomicCAS(err, 0, item + 1) == 0) err[1] = PERSIST_ERR_TIMEOUT;
                bad = 1;
                break;
            }
            if (polls > 64) __nanosleep(polls > 4096 ? 1000 : 100);
        }
    }
    return __syncthreads_or(bad);
}

// The wait of one item as the WaitHook (common.cuh) of the norm body: at the body's wait-for-inputs point,
// after its weight loads. No waits: no barrier either (n is the item's: uniform over the block).
struct CounterWait {
    const int* rec;            // the item's record in shared memory: wait_begin, n_waits at [9], [10]
    const int* wait_pairs;     // every item's (counter, target) pairs
    const int* counters;
    int* err;
    int item;                  // the device row of the item (reported + 1 in err[0])
    int spin_limit;
    int* abort_flag;           // shared: set when this block gives up (timeout, or another block's error)

    __device__ __forceinline__ void operator()() const {
        const int n = rec[10];
        if (n == 0) return;
        if (wait_counters(wait_pairs + 2 * rec[9], n, counters, err, item, spin_limit))
            *abort_flag = 1;                                 // every thread writes the same value
    }
};

// ---- GEMM runs ---------------------------------------------------------------------------------------------
// A run: the m (<= PERSIST_RUN_MAX) consecutive gemm_part records of one block and one GEMM (its stream-K
// range; Schedule.encode puts m in the first record's [12] and the run's waits, contiguous in `waits`, in
// [13] / [14]). Every warp streams its 1/8 K slice of each part in turn through one continuous cp.async
// ring, so the next part's first stages are in flight while a part finishes. At the end of its slice of a
// part (every warp reaches the m part ends in the same order) a warp parks its fp32 partial in the ring
// slot it has just consumed, which no load reuses before the block's next barrier, and the block sums the
// 8 warps' partials in warp order in shared memory. A group of one part (a whole unit) writes its 16 output
// columns from that sum and adds 2 (release). Otherwise the block stores its sum [T][16] in the part's
// workspace slot and arrives once on the group's counter (acq_rel add); if that completed the group, it
// sums the group's slots in slot order (its own sum from registers: the same bits whoever is last), writes
// the 16 output columns (SwiGLU of the gate and up sums for a gate|up pair, flags bit 1) and adds 1 more
// (release). Consumers wait for parts + 1. Measured: the 8 per-warp partials read back through L2 cost
// 1.2-2.2 us per GEMM (docs/history/2026-12-03-persistent.md).
#define PERSIST_RUN_MAX 4

// Element i = t * 16 + c (i < T * 16) of a part's block sum: the 8 warps' partials parked in shared memory
// (warp w's at uint4 offset slot_off[w], [16 rows][rs] floats), in warp order.
__device__ __forceinline__ float gemm_block_sum(const int* slot_off, int rs, int i) {
    extern __shared__ uint4 smem[];
    const int t = i >> 4, c = i & 15;
    float v[DEC_WARPS];
#pragma unroll
    for (int w = 0; w < DEC_WARPS; ++w) v[w] = reinterpret_cast<const float*>(smem + slot_off[w])[c * rs + t];
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < DEC_WARPS; ++w) s += v[w];
    return s;
}

// The group's output element i from its n parts' sums (slots slot0.., the first n_gate of them the gate
// unit's for a gate|up pair): own = this block's part's sum (slot own_slot), the others from the workspace.
__device__ __forceinline__ void gemm_group_out(const PersistOp& op, int col0, int slot0, int n_gate, int n,
                                               int own_slot, float own, int i) {
    const int per = op.T * 16;
    const float* ws = reinterpret_cast<const float*>(op.out2);
    const bool swiglu = op.flags & 2;
    float g = 0.f, u = 0.f;
    for (int p0 = 0; p0 < n; p0 += 4) {
        float v[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {                  // the loads of four parts in flight at once
            const int p = p0 + q;
            v[q] = p >= n ? 0.f : slot0 + p == own_slot ? own : __ldcg(ws + (long long)(slot0 + p) * per + i);
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int p = p0 + q;
            if (p < n) {
                if (p < n_gate || !swiglu) g += v[q];
                else u += v[q];
            }
        }
    }
    const int t = i >> 4, c = i & 15;
    bf16_bits* out = reinterpret_cast<bf16_bits*>(op.out) + (long long)t * op.out_stride + col0 + c;
    *out = swiglu ? silu_mul1(f32_to_bf16(g), f32_to_bf16(u)) : f32_to_bf16(g);
}

// This warp's slice of part `r` (a record in shared memory): first k tile and count.
__device__ __forceinline__ void warp_slice(const int* r, int ks, int& kt, int& cnt) {
    const int kt0 = r[3], nkt = r[4];
    kt = kt0 + ks * nkt / DEC_WARPS;
    cnt = kt0 + (ks + 1) * nkt / DEC_WARPS - kt;
}

// Returns whether the block gave up in the wait. `recs`: the run's m records (shared memory).
template <int NT>
__device__ __forceinline__ bool gemm_run(const PersistOp& op, const int* recs, int m, const int* wait_pairs,
                                         int* counters, int* err, int item, int spin_limit, int* last_s,
                                         int* slot_off, long long* trace, long long t0) {
    constexpr int STAGES = NT == 1 ? 4 : 3;   // kernels/gemm.py dec_stages: 96 KB rings
    constexpr int WST = 16 * 8, XST = NT * 64;
    extern __shared__ uint4 smem[];
    const int lane = threadIdx.x & 31, ks = threadIdx.x >> 5;
    uint4* w_s = smem + ks * STAGES * (WST + XST);
    uint4* x_s = w_s + STAGES * WST;
    const int T = op.T, K = op.K;

    // The stage copies with everything per lane computed once (the decode kernel's copies and mma stage
    // recomputed the swizzled shared addresses, the generic-to-shared conversion and the global offsets at
    // every stage here: ~195 instructions per stage against 114 in the plain kernel's unrolled loop, SASS).
    // Chunk j of a stage is row (lane >> 3) + 4 j, 16-byte chunk lane & 7 (decode_load_w / decode_load_x).
    const bf16_bits* const wg = op.w;
    const bf16_bits* const xg = op.x;
    const int lr = lane >> 3, lc = lane & 7;
    const uint32_t wring = smem_addr(w_s), xring = smem_addr(x_s);
    const long long w_lane = (long long)lr * K + lc * 8;            // + 4 j K for chunk j
    const int x_lane = lr * (int)op.x_stride + lc * 8;              // + 4 j x_stride
    const int x_step = 4 * (int)op.x_stride;
    const long long w_step = 4LL * K;
    // chunk j's swizzled offset in a stage: row r = lr + 4 j: (r * 8 + (lc ^ (r & 7))) * 16; r & 7 = lr + 4 (j & 1)
    const uint32_t sw_even = (uint32_t)(lr * 8 + (lc ^ lr)) * 16, sw_odd = (uint32_t)(lr * 8 + (lc ^ (lr + 4))) * 16;
    const bf16_bits* lw = wg + (long long)recs[2] * K + w_lane;     // the load cursor's part, this lane's chunk 0
    // decode_mma_stage on shared addresses: A rows lane & 15 at chunk 2 kk + (lane >> 4); B rows lane & 7
    // (+ 8 for lanes 16-31 at NT = 2) at chunk 2 kk + ((lane >> 3) & 1); chunk c of row r at
    // (r * 8 + (c ^ (r & 7))) * 16, and (2 kk + h) ^ q = 2 kk ^ (h ^ q) for h in {0, 1}
    const int ar = lane & 15, br = NT == 2 ? (lane & 7) + ((lane >> 4) << 3) : lane & 7;
    const int aq = (lane >> 4) ^ (ar & 7), bq = ((lane >> 3) & 1) ^ (br & 7);
    auto mma_stage = [&](int slot, float (&acc)[NT][4]) {
        const uint32_t wa = wring + slot * (WST * 16) + ar * 128, xb = xring + slot * (XST * 16) + br * 128;
#pragma unroll
        for (int kk = 0; kk < GEMM_BK / 16; ++kk) {
            uint32_t a0, a1, a2, a3, b0, b1, b2 = 0, b3 = 0;
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                         : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(wa + (((2 * kk) ^ aq) << 4)));
            if (NT == 2) {
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(xb + (((2 * kk) ^ bq) << 4)));
            } else {
                asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                             : "=r"(b0), "=r"(b1) : "r"(xb + (((2 * kk) ^ bq) << 4)));
            }
            mma_16816_bf16(acc[0], a0, a1, a2, a3, b0, b1);
            if (NT == 2) mma_16816_bf16(acc[NT - 1], a0, a1, a2, a3, b2, b3);
        }
    };
    auto load_w = [&](int slot, int kt) {
        const bf16_bits* src = lw + kt * GEMM_BK;
        const uint32_t d = wring + slot * (WST * 16);
#pragma unroll
        for (int j = 0; j < 4; ++j) cp_async16(d + (j & 1 ? sw_odd : sw_even) + j * 512, src + j * w_step, 16);
    };
    auto load_x = [&](int slot, int kt) {
        const uint32_t d = xring + slot * (XST * 16);
#pragma unroll
        for (int j = 0; j < 2 * NT; ++j) {
            const bool ok = lr + 4 * j < T;
            cp_async16(d + (j & 1 ? sw_odd : sw_even) + j * 512, ok ? xg + x_lane + j * x_step + kt * GEMM_BK : xg,
                       ok ? 16 : 0);
        }
    };
    // the load cursor: part li, the next k tile, the k tiles left in this warp's slice of it
    int li = 0, lk, lleft;
    warp_slice(recs, ks, lk, lleft);
    auto next_load = [&](int& kt) {                    // the next stage's k tile (of the cursor's part: lw)
        while (lleft == 0) {
            warp_slice(recs + 16 * ++li, ks, lk, lleft);
            lw = wg + (long long)recs[16 * li + 2] * K + w_lane;
        }
        kt = lk++;
        --lleft;
    };
    int total = 0;                                     // this warp's stages over the run
    for (int i = 0; i < m; ++i) {
        int a, c;
        warp_slice(recs + 16 * i, ks, a, c);
        total += c;
    }
    // prologue: weights only (allowed before the wait)
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < total) {
            int kt;
            next_load(kt);
            load_w(s, kt);
        }
        cp_async_commit();
    }
    if (recs[14] > 0 && wait_counters(wait_pairs + 2 * recs[13], recs[14], counters, err, item, spin_limit)) {
        cp_async_wait<0>();
        return true;
    }
    {   // the prologue stages' token rows (their k tiles walked again), as cp.async: all in flight at once (plain
        // loads in this data-dependent loop went one round trip per stage), then one wait for the whole prologue
        int pi = 0, pk, pleft;
        warp_slice(recs, ks, pk, pleft);
        for (int s = 0; s < STAGES - 1 && s < total; ++s) {
            while (pleft == 0) warp_slice(recs + 16 * ++pi, ks, pk, pleft);
            load_x(s, pk++);
            --pleft;
        }
        cp_async_commit();
        cp_async_wait<0>();                            // the prologue's weights were requested before the wait
    }

    int ci = 0, cleft;                                 // the compute cursor
    {
        int a;
        warp_slice(recs, ks, a, cleft);
    }
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    int done_st = 0;                                   // this warp's stages consumed so far
    // The end of part ci. The ring slot free for the warp's partial: the one it consumed last (its next load
    // goes there, after the block's barriers below); before its first stage, the one the prologue left empty.
    auto flush = [&]() {
        const int* r = recs + 16 * ci;
        constexpr int RS = NT * 8 + 1;                 // [16 rows][RS] floats (+1: fewer bank conflicts)
        const int off = ks * STAGES * (WST + XST) + ((done_st + STAGES - 1) % STAGES) * WST;
        __syncwarp();                                  // the warp's last ldmatrix of that slot is behind it
        float* red = reinterpret_cast<float*>(smem + off);
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                red[((lane >> 2) + (e >> 1) * 8) * RS + 8 * j + 2 * (lane & 3) + (e & 1)] = acc[j][e];
                acc[j][e] = 0.f;
            }
        if (lane == 0) slot_off[ks] = off;
        __syncthreads();                               // every warp's partial of part ci parked
        const int per = T * 16, i = threadIdx.x;       // per <= 256: one element per thread
        const bool mine = i < per;
        const float sum = mine ? gemm_block_sum(slot_off, RS, i) : 0.f;
        const bool single = r[8] == 1;                 // a whole unit: the group is this part alone
        const int col0 = (op.flags & 2) ? r[2] % (op.N / 2) : r[2];
        if (!single) {
            if (mine) reinterpret_cast<float*>(op.out2)[(long long)r[5] * per + i] = sum;
            __syncthreads();                           // the block's sum stored (ordered before the arrival)
            if (threadIdx.x == 0) *last_s = atom_acq_rel_add(counters + r[11], 1) == r[8] - 1;
            __syncthreads();                           // the arrival's answer; every warp done with its slot
        }
        if (single || *last_s) {                       // uniform: the block completes the group
            if (mine) gemm_group_out(op, col0, r[6], r[7], r[8], r[5], sum, i);
            __syncthreads();                           // every thread's outputs before the release (a group
                                                       // of one part: also every warp done with its slot)
            // a group of one part skipped its arrival: it adds the arrival's 1 with the fixup's
            if (threadIdx.x == 0) red_release_add(counters + r[11], single ? 2 : 1);
        }
        if (trace && threadIdx.x == 0) {               // (block, run start, this part's end)
            long long* t = trace + 4 * (long long)(item + ci);
            t[0] = blockIdx.x;
            t[1] = t0;
            t[2] = global_ns();
        }
    };
    auto retire = [&]() {                              // every finished part, in order (empty slices too)
        while (ci < m && cleft == 0) {
            flush();
            if (++ci < m) {
                int a;
                warp_slice(recs + 16 * ci, ks, a, cleft);
            }
        }
    };
    retire();
    for (int s = 0; s < total; ++s) {
        cp_async_wait<STAGES - 2>();
        __syncwarp();                                  // stage s visible to the warp; slot (s - 1) free
        if (s + STAGES - 1 < total) {
            int kt;
            next_load(kt);
            const int slot = (s + STAGES - 1) % STAGES;
            load_w(slot, kt);
            load_x(slot, kt);
        }
        cp_async_commit();
        mma_stage(s % STAGES, acc);
        ++done_st;
        --cleft;
        retire();
    }
    cp_async_wait<0>();
    return false;
}

// ---- row_post and head products ----------------------------------------------------------------------------
// Row t: qkv_a_post_row (mla_small.cuh, mla_qkv_a_post's body), its reductions in the idle ring memory.
__device__ __forceinline__ void row_post_item(const PersistOp& op, const PersistAux& a, int t, const CounterWait& wait) {
    extern __shared__ uint4 smem[];
    float* red = reinterpret_cast<float*>(smem);
    qkv_a_post_row<true>(t, op.x, op.x_stride, op.K, op.w, a.w2, op.eps, (bf16_bits*)op.out, op.out_stride, a.positions,
                         a.inv_freq, a.amplitude, a.stream_ids, a.kv_pos, a.pool, a.block_table, a.max_pages, red,
                         red + FL_THREADS / 32, wait);
}

// Item (head h, piece c of 16 NJ columns, arg2 = that width): two groups of 4 warps, group g the 8 NJ columns
// c * 16 NJ + 8 NJ g, each as one mla_head_gemm block would run them (the same body, mla_small.cuh: identical
// bits), its weight fragments loaded before the wait; the partial sums meet in the idle ring memory. Piece 0's
// first group also rotates the head's q_pe. One 16-row tile (T <= 16): the body's tile loop, inlined here,
// spilled under sm_90's 128-register budget at W_UV's K = 512. W_UK: NJ = 4 (64-column pieces, 64 items of 16 KB
// at Kimi's TP = 8 widths); W_UV: NJ = 1 (16-column pieces: also 64 items of 16 KB; at NJ = 4 its 64 fragment
// registers per lane spilled).
template <int KS, int NJ>
__device__ __forceinline__ void head_gemm_item(const PersistOp& op, const PersistAux& a, const int* it,
                                               const CounterWait& wait, const int* abort_flag) {
    extern __shared__ uint4 smem[];
    const int h = it[2], piece = it[3];
    const int grp = threadIdx.x >> 7, gtid = threadIdx.x & 127, warp = gtid >> 5;
    const int n0 = piece * 16 * NJ + grp * 8 * NJ;
    uint32_t b[KS][NJ][2];
    head_gemm_weights<KS, NJ>(op.w, h, op.N, n0, warp, threadIdx.x & 31, b);
    wait();
    if (*abort_flag) return;                           // uniform: written before the wait's barrier
    float (*red)[16][33] = reinterpret_cast<float (*)[16][33]>(smem) + grp * HG_WARPS;
    head_gemm_tiles<KS, NJ, true, true>(op.x, op.x_stride, a.x_head, (bf16_bits*)op.out, op.out_stride, a.out_head, op.T, h,
                                  n0, 0, 1, warp, gtid, b, red);
    if (a.pe != nullptr && piece == 0 && grp == 0)
        head_gemm_rope<true>(a.pe, a.pe_row, a.pe_head, a.pe_out, a.pe_out_row, a.pe_out_head, a.positions, a.inv_freq,
                             a.amplitude, a.half, op.T, h, 0, 1, gtid);
}

// Shared memory: the GEMM rings first, at the dynamic base (cp.async into a ring whose base is not 128-byte
// aligned moves each 16-byte chunk as two sectors: measured 2x slower, docs/history/2026-12-03-persistent.md;
// so the executor declares no static shared memory), then its own words, then the block's copy of the op
// table. kernels/persistent.py sizes the launch with the same layout (smem_bytes).
#define PERSIST_RING_BYTES (96 * 1024)
#define PERSIST_REC 16
struct PersistMeta {
    int abort_flag;                   // set by a wait that gives up (CounterWait)
    int count;                        // this block's items
    int last;                         // a GEMM run: the block's arrival completed its part's group
    int set;                          // the launch's counter set (0 / 1: the parity of the block's launch count)
    union {
        float red[NORM_THREADS / 32]; // the norm body's reduction
        int slot_off[DEC_WARPS];      // a GEMM run's part end: where each warp parked its partial
    };
    long long t0;                     // trace: the current step's start (kept here, not in a register)
    long long t_block;                // trace: the block's start
    // records: the current step's (one item, or a GEMM run's parts) and the next step's, prefetched
    int rec[2][PERSIST_RUN_MAX][PERSIST_REC];
};
static_assert(sizeof(PersistMeta) == 576, "kernels/persistent.py META_BYTES; the op table after it 16-byte aligned");

// Items of block b (Schedule.encode re-laid by kernels/persistent.py): rows b * stride .. b * stride + count
// of `items` (PERSIST_REC ints each), where row b * stride holds (count, 0, ...) and the block's records
// follow it (and PERSIST_RUN_MAX padding rows after the last block: a step prefetches that many records).
// Two resident blocks per SM where shared memory holds two 96 KB rings (the H200's 228 KB per SM): a
// 128-register budget. sm_120 / sm_121 hold one either way (100 KB per SM), so there the budget is not
// halved for nothing.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 1200 || __CUDA_ARCH__ == 1210)
#define PERSIST_MIN_BLOCKS 1
#else
#define PERSIST_MIN_BLOCKS 2
#endif
extern "C" __global__ void __launch_bounds__(PERSIST_THREADS, PERSIST_MIN_BLOCKS)
persistent_layer(const int* __restrict__ items, int stride, const int* __restrict__ waits,
                 const PersistOp* __restrict__ ops, int table_words, int* counters, int n_counters,
                 int* launches, int* err, int spin_limit, long long* __restrict__ trace) {
    extern __shared__ uint4 smem[];
    PersistMeta* meta = reinterpret_cast<PersistMeta*>(reinterpret_cast<char*>(smem) + PERSIST_RING_BYTES);
    PersistOp* ops_s = reinterpret_cast<PersistOp*>(meta + 1);
    const int* rows = items + PERSIST_REC * (long long)blockIdx.x * stride;
    long long* trace_hdr = trace ? trace + 4 * (long long)blockIdx.x * stride : nullptr;   // the header row's
    if (trace && threadIdx.x == 0) meta->t_block = global_ns();
    // Launched with PDL (programmatic serialization; otherwise both are no-ops), the set-up overlaps the
    // kernel before: every block lets the next kernel launch at its start (that kernel's blocks get only
    // what this grid leaves over: every block of this grid has started by then, so co-residency holds), and
    // reads only what the host wrote (its list, records and the op table) before the wait. The launch
    // count, the counters and every activation come after it: the kernel before may be this segment's
    // previous launch, still counting, and a read before the wait sees no order.
    DDT_PDL_LAUNCH_DEPENDENTS();
    // the header and the first step's records (PERSIST_RUN_MAX of them) and the op table in one round trip
    if (threadIdx.x < PERSIST_REC * (1 + PERSIST_RUN_MAX)) {
        const int q = threadIdx.x, v = rows[q];
        if (q == 0) meta->count = v;
        else if (q >= PERSIST_REC) (&meta->rec[0][0][0])[q - PERSIST_REC] = v;
    }
    {
        const uint2* src = reinterpret_cast<const uint2*>(ops);
        uint2* dst = reinterpret_cast<uint2*>(ops_s);
        for (int v = threadIdx.x; v < table_words; v += PERSIST_THREADS) dst[v] = src[v];   // ops, then aux
    }
    DDT_PDL_WAIT();
    if (threadIdx.x == 0) {
        meta->abort_flag = 0;
        // The launch's counter set: launches of this segment are stream-ordered and every block counts its
        // own launches in its own word (no shared atomic: one ticket word for all blocks delayed every
        // block's set-up), so in launch g every block reads g and uses set g & 1; they zero the other set,
        // which launch g - 1 used (it has ended) and launch g + 1 will use (it starts after this one ends).
        // No block resets anything at the end: the last-block-out count there was a round trip in every
        // block's tail (0.8-0.9 us per launch, measured).
        const int g = launches[blockIdx.x];
        launches[blockIdx.x] = g + 1;
        meta->set = g & 1;
    }
    __syncthreads();
    if (trace && threadIdx.x == 0) {
        trace_hdr[0] = meta->t_block;
        trace_hdr[1] = global_ns();
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        trace_hdr[3] = sm;
    }
    const int count = meta->count;
    {
        int* other = counters + (1 - meta->set) * n_counters;
        for (int c = blockIdx.x * PERSIST_THREADS + threadIdx.x; c < n_counters; c += gridDim.x * PERSIST_THREADS)
            other[c] = 0;
        counters += meta->set * n_counters;
    }
    const int first = (int)blockIdx.x * stride + 1;   // device row of the block's first record (err, trace)
    int b = 0;                                         // the step's record buffer
    for (int j = 0; j < count; b ^= 1) {
        const int* it = meta->rec[b][0];
        const int kind = it[0];
        // items this step covers (a GEMM run: its parts; bounded, so a bad record can neither stall the loop
        // nor run past the record buffer or the block's list)
        const int m = kind == 15 ? min(max(it[12], 1), min(PERSIST_RUN_MAX, count - j)) : 1;
        const int ii = first + j;
        // the next step's records stream in while this one runs (the buffer was last read a step ago)
        if (threadIdx.x < PERSIST_RUN_MAX * PERSIST_REC / 4 && j + m < count)
            cp_async16(smem_addr(&meta->rec[b ^ 1][0][0] + 4 * threadIdx.x),
                       rows + PERSIST_REC * (j + m + 1) + 4 * threadIdx.x, 16);
        cp_async_commit();
        const PersistOp& op = ops_s[it[1]];
        if (trace && threadIdx.x == 0) meta->t0 = global_ns();
        bool ok = true;
        if (kind == 1) {
            const CounterWait wait{it, waits, counters, err, ii, spin_limit, &meta->abort_flag};
            rmsnorm_row<CounterWait>(it[2], op.x, op.x_stride, op.x2, op.x2_stride, op.out2, op.out2_stride, op.w,
                                     (bf16_bits*)op.out, op.out_stride, nullptr, op.N, op.eps, meta->red, wait);
        } else if (kind == 15) {
            bool bad = false;
            if (op.T <= 8)
                bad = gemm_run<1>(op, it, m, waits, counters, err, ii, spin_limit, &meta->last, meta->slot_off,
                                     trace, meta->t0);
            else if (op.T <= 16)
                bad = gemm_run<2>(op, it, m, waits, counters, err, ii, spin_limit, &meta->last, meta->slot_off,
                                     trace, meta->t0);
            else ok = false;
            if (bad) meta->abort_flag = 1;                   // every thread writes the same value
        } else if (kind == 4 || kind == 5) {
            const CounterWait wait{it, waits, counters, err, ii, spin_limit, &meta->abort_flag};
            const PersistAux& a = *reinterpret_cast<const PersistAux*>(reinterpret_cast<const char*>(ops_s) + op.aux);
            if (op.aux <= 0) {
                ok = false;
            } else if (kind == 4) {
                if (op.K % 8 || op.K > 8 * FL_QMAXV * FL_THREADS) {
                    ok = false;
                } else {
                    row_post_item(op, a, it[2], wait);
                }
            } else if (op.N % it[4] || it[4] * (it[3] + 1) > op.N || op.T > 16) {   // one 16-row tile (MAX_T)
                ok = false;
            } else if (op.K == 128 && it[4] == 64) {
                head_gemm_item<2, 4>(op, a, it, wait, &meta->abort_flag);
            } else if (op.K == 512 && it[4] == 16) {
                head_gemm_item<8, 1>(op, a, it, wait, &meta->abort_flag);
            } else {
                ok = false;
            }
        } else {
            const CounterWait wait{it, waits, counters, err, ii, spin_limit, &meta->abort_flag};
            wait();
            if (!meta->abort_flag) {
                if (kind == 3) {
                    const int nv = op.N / 8;
                    for (int v = threadIdx.x; v < op.T * nv; v += PERSIST_THREADS) {
                        const int t = v / nv, c = v - t * nv;
                        *reinterpret_cast<uint4*>((bf16_bits*)op.out + t * op.out_stride + 8 * c) =
                            ldcg16(op.x + t * op.x_stride + 8 * c);
                    }
                } else {
                    ok = false;
                }
            }
        }
        cp_async_wait<0>();                                  // the next step's records have landed (this thread's)
        if (meta->abort_flag) return;                        // uniform: every thread wrote it after a barrier
        __syncthreads();                                     // every thread's stores issued; smem free again
        if (threadIdx.x == 0) {
            if (!ok) {
                if (atomicCAS(err, 0, ii + 1) == 0) err[1] = kind == 15 ? PERSIST_ERR_SHAPE : PERSIST_ERR_KIND;
            }
            // release: the block's stores (ordered before this thread's by the barrier) are visible device-wide
            // before the count is; a consumer's acquire load pairs with it. A GEMM run's parts signalled
            // with their arrivals and fixups.
            if (ok && kind != 15) red_release_add(counters + it[11], 1);
            if (trace && kind != 15) {                       // (block, start, end): the device-wide ns timer
                trace[4 * ii] = blockIdx.x;                  // (a GEMM run traced its parts' ends itself)
                trace[4 * ii + 1] = meta->t0;
                trace[4 * ii + 2] = global_ns();
            }
        }
        if (!ok) return;
        j += m;
    }
    if (trace && threadIdx.x == 0) trace_hdr[2] = global_ns();
}
