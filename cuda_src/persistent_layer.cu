// Persistent layer executor (docs/PERSISTENT.md): one block per resident slot walks its precomputed list of
// work items (ddtree_cupy/engine/schedule.py, Schedule.encode). Per item: wait until every counter it
// depends on has reached its target, run the item's body, signal its own counter.
//
//  * Waits: thread 0 polls with acquire loads (ld.acquire.gpu) until the counter reaches the target, then
//    the block barrier publishes the observation to the other threads. The spin is bounded (spin_limit
//    polls, with nanosleep back-off): past it, the block records (item index + 1) in err[0] and the reason
//    in err[1], and every block leaves at its next wait (no launch hangs forever; the host checks err).
//    Norm and GEMM items wait inside their bodies, at the bodies' wait-for-inputs point (CounterWait as
//    the WaitHook of common.cuh): the weight loads they issue first (the GEMM's first STAGES - 1 ring
//    stages, the norm weight) are in flight while the producers finish.
//  * Signals: the block barrier (every thread's stores issued), then thread 0 adds 1 with a release
//    reduction (red.release.gpu: the block's stores, ordered before it by the barrier, are visible
//    device-wide before the count is). No separate fence: a full fence per item cost ~1 us of each item.
//  * Item records: the block's header and first record, and the whole op table, are read once at the start
//    (shared memory); each next record is prefetched with cp.async while the current item runs, so no item
//    waits on a chain of dependent global loads before its first weight request.
//  * Counters reset themselves: the last block to finish (done counter) zeroes every counter and the done
//    counter, so a CUDA graph replays the launch with no memset. After an error the host resets them.
//  * Activations produced by other blocks in the same launch are read with L1-bypassing loads (ld.cg, or
//    cp.async.cg in the GEMM body), never through a line this SM may have cached before it was written;
//    the GEMM body's plain token loads are safe because a GEMM item waits for its whole input buffer (the
//    schedule builder guarantees it: GEMM items read the full input).
//  * trace (optional): per item (block, start, end) from the global ns timer; start = when the block
//    reached the item (its weight prologue and wait included).
//  * The item bodies are the existing kernels' device bodies (no copy): rmsnorm_row (norm_row.cuh),
//    gemm_decode_body (gemm_bf16.cu), silu_mul1 (layer_math.cuh).
//
// Item record (int32 x 16): kind, op, arg0..arg6, wait_begin, n_waits, signal, 4 zero. `op` indexes the op
// table (PersistOp, one per stage of the layer: pointers, strides, sizes). Kinds (schedule.KIND):
//   1 norm_row    arg0 = row                                     rmsnorm_row (residual add when op.x2 is set)
//   3 boundary    TP = 1 all-reduce stand-in: out = x (a fused all-reduce replaces this body)
//  15 gemm_part   arg0 = first weight row of the 16-row unit, arg1 / arg2 = first k tile / k tiles,
//                 arg3 = workspace slot, arg4 / arg5 / arg6 = the group's first slot / gate parts / parts.
//                 The decode GEMM body over the K range into the fp32 slot [T][16] of op.out2; then the
//                 arrival on the group's counter (acq_rel add): the part that arrives last sums the group's
//                 slots in slot order, writes the group's 16 output columns (bf16; flags bit 1: SwiGLU of the
//                 gate sum and the up sum, the group being a gate|up unit pair) and adds 1 more (release).
//                 The group's consumers wait for parts + 1.
// Any other kind sets err and stops (the host refuses schedules with kinds this build does not run).
#include "norm_row.cuh"
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
    bf16_bits* out2;          // norm: residual out; GEMM: the fp32 partial slots (slot s at s * T * 16)
    long long x_stride, x2_stride, out_stride, out2_stride;   // row strides in elements
    int T, N, K, flags;       // flags bit 1: GEMM fixup is SwiGLU of a gate|up pair
    float eps;
    int pad[3];
};

// kernels/persistent.py OP_DTYPE mirrors this layout: naturally aligned fields in this order (8-byte
// pointers and strides, then 4-byte fields), no implicit padding, so the size pins the offsets (NVRTC has
// no offsetof in constant expressions).
static_assert(sizeof(PersistOp) == 104 && alignof(PersistOp) == 8, "PersistOp layout (OP_DTYPE)");

__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int atom_acq_rel_add(int* p, int v) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

__device__ __forceinline__ long long global_ns() {
    long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// 8 bf16 through L2 only (a line another block wrote during this launch)
__device__ __forceinline__ uint4 ldcg16(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

// The wait on an item's dependency counters, as a WaitHook (common.cuh) of the shared bodies: called by every
// thread at the body's wait-for-inputs point, after the weight loads it issued before (so the weight bytes
// stream while the producers finish). Thread q polls waits q, q + 256, ... with acquire loads, bounded (so n
// waits cost one round trip, not n); the barrier publishes what they saw. No waits: no barrier either.
struct CounterWait {
    const int* rec;            // the item's record in shared memory: wait_begin, n_waits read at the wait
    const int* wait_pairs;     // every item's (counter, target) pairs
    const int* counters;
    int* err;
    int item;                  // the device row of the item (reported + 1 in err[0])
    int spin_limit;
    int* abort_flag;           // shared: set when this block gives up (timeout, or another block's error)

    __device__ __forceinline__ void operator()() const {
        const int n = rec[10];
        const int* waits = wait_pairs + 2 * rec[9];
        if (n == 0) return;                                  // uniform over the block: n is the item's
        int bad = 0;
        for (int q = threadIdx.x; q < n && !bad; q += PERSIST_THREADS) {
            const int* c = counters + waits[2 * q];
            const int target = waits[2 * q + 1];
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
        if (__syncthreads_or(bad)) *abort_flag = 1;          // every thread writes the same value
    }
};

// The fixup of a gemm_part group by the part that arrived last: the group's fp32 slots [T][16] summed in slot
// order (L2 loads: other blocks wrote them during this launch), bf16 out; SwiGLU for a gate|up pair (the
// first n_gate slots are the gate unit's), rounding the sums to bf16 first as the unfused chain stores them.
__device__ __forceinline__ void gemm_part_fixup(const PersistOp& op, int col0, int slot0, int n_gate, int n) {
    const float* ws = reinterpret_cast<const float*>(op.out2);
    const int per = op.T * 16;
    for (int i = threadIdx.x; i < per; i += PERSIST_THREADS) {
        const int t = i >> 4, c = i & 15;
        float g = 0.f, u = 0.f;
        for (int p = 0; p < n; ++p) {
            const float v = __ldcg(ws + (long long)(slot0 + p) * per + i);
            if (p < n_gate || !(op.flags & 2)) g += v;
            else u += v;
        }
        bf16_bits* out = reinterpret_cast<bf16_bits*>(op.out) + (long long)t * op.out_stride + col0 + c;
        *out = (op.flags & 2) ? silu_mul1(f32_to_bf16(g), f32_to_bf16(u)) : f32_to_bf16(g);
    }
}

template <int NT>
__device__ __forceinline__ void gemm_part_body(const PersistOp& op, const int* a, const CounterWait& wait) {
    constexpr int STAGES = NT == 1 ? 4 : 3;   // kernels/gemm.py dec_stages: 96 KB rings
    float* slot = reinterpret_cast<float*>(op.out2) + (long long)a[3] * op.T * 16;
    gemm_decode_body<NT, STAGES, true, 1, 1, CounterWait>(op.x, 0, (int)op.x_stride, op.w, 0, slot, 0, 16, op.T,
                                                          op.N, op.K, a[0] / 16, 0, wait, a[1], a[2], 0);
}

// Shared memory: the GEMM rings first, at the dynamic base (cp.async into a ring whose base is not 128-byte
// aligned moves each 16-byte chunk as two sectors: measured 2x slower, docs/history/2026-12-03-persistent.md;
// so the executor declares no static shared memory), then its own words, then the block's copy of the op
// table. kernels/persistent.py sizes the launch with the same layout (smem_bytes).
#define PERSIST_RING_BYTES (96 * 1024)
struct PersistMeta {
    int abort_flag;                   // set by a wait that gives up (CounterWait)
    int count;                        // this block's items
    int last;                         // gemm_part: this part arrived last in its group (runs the fixup)
    int pad;
    float red[NORM_THREADS / 32];     // the norm body's reduction
    int rec[2][16];                   // item records: the current one and the next, prefetched (cp.async)
    long long t0;                     // trace: the current item's start (kept here, not in a register)
    long long pad2;
};
static_assert(sizeof(PersistMeta) == 192, "kernels/persistent.py META_BYTES; the op table after it 16-byte aligned");

// Items of block b (Schedule.encode re-laid by kernels/persistent.py): rows b * stride .. b * stride + count
// of `items` (PERSIST_REC ints each), where row b * stride holds (count, 0, ...) and the block's records
// follow it.
#define PERSIST_REC 16
extern "C" __global__ void __launch_bounds__(PERSIST_THREADS, 2)
persistent_layer(const int* __restrict__ items, int stride, const int* __restrict__ waits,
                 const PersistOp* __restrict__ ops, int n_ops, int* counters, int n_counters, int* done, int* err,
                 int spin_limit, long long* __restrict__ trace) {
    extern __shared__ uint4 smem[];
    PersistMeta* meta = reinterpret_cast<PersistMeta*>(reinterpret_cast<char*>(smem) + PERSIST_RING_BYTES);
    PersistOp* ops_s = reinterpret_cast<PersistOp*>(meta + 1);
    const int* rows = items + PERSIST_REC * (long long)blockIdx.x * stride;
    // the header, the first record and the op table in one round trip
    if (threadIdx.x < 2 * PERSIST_REC) {
        const int q = threadIdx.x;                    // the header row, then record 0
        const int v = rows[q];
        if (q == 0) meta->count = v;
        else if (q >= PERSIST_REC) meta->rec[0][q - PERSIST_REC] = v;
    }
    if (threadIdx.x == 0) meta->abort_flag = 0;
    {
        const uint2* src = reinterpret_cast<const uint2*>(ops);
        uint2* dst = reinterpret_cast<uint2*>(ops_s);
        for (int v = threadIdx.x; v < n_ops * (int)(sizeof(PersistOp) / 8); v += PERSIST_THREADS) dst[v] = src[v];
    }
    __syncthreads();
    const int count = meta->count;
    const int first = (int)blockIdx.x * stride + 1;   // device row of the block's first record (err, trace)
    for (int j = 0; j < count; ++j) {
        const int* it = meta->rec[j & 1];
        const int* a = it + 2;                        // the args, read from shared memory where used
        const int kind = it[0];
        const int ii = first + j;
        // the next record streams in while this item runs (its slot was last read one item ago)
        if (threadIdx.x < PERSIST_REC / 4 && j + 1 < count)
            cp_async16(smem_addr(&meta->rec[(j + 1) & 1][4 * threadIdx.x]),
                       rows + PERSIST_REC * (j + 2) + 4 * threadIdx.x, 16);
        cp_async_commit();
        const CounterWait wait{it, waits, counters, err, ii, spin_limit, &meta->abort_flag};
        const PersistOp& op = ops_s[it[1]];
        if (trace && threadIdx.x == 0) meta->t0 = global_ns();
        bool ok = true, signal = true;
        // norm and GEMM items wait inside their bodies (after their weight loads); the others wait first
        if (kind == 1) {
            rmsnorm_row<CounterWait>(a[0], op.x, op.x_stride, op.x2, op.x2_stride, op.out2, op.out2_stride, op.w,
                                     (bf16_bits*)op.out, op.out_stride, nullptr, op.N, op.eps, meta->red, wait);
        } else if (kind == 15) {
            if (op.T <= 8) gemm_part_body<1>(op, a, wait);
            else if (op.T <= 16) gemm_part_body<2>(op, a, wait);
            else { ok = false; wait(); }                     // still wait: the error path below must not race
            if (ok && !meta->abort_flag) {
                __syncthreads();                             // the partial's stores issued
                if (threadIdx.x == 0) meta->last = atom_acq_rel_add(counters + it[11], 1) == a[6] - 1;
                __syncthreads();
                signal = meta->last;                         // a part that is not last: its arrival signalled
                if (signal) gemm_part_fixup(op, (op.flags & 2) ? a[0] % (op.N / 2) : a[0], a[4], a[5], a[6]);
            }
        } else {
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
        cp_async_wait<0>();                                  // the next record has landed (for this thread)
        if (meta->abort_flag) return;                        // uniform: every thread wrote it in wait()
        __syncthreads();                                     // every thread's stores issued; smem free again
        if (threadIdx.x == 0) {
            if (!ok) {
                if (atomicCAS(err, 0, ii + 1) == 0) err[1] = kind == 15 ? PERSIST_ERR_SHAPE : PERSIST_ERR_KIND;
            }
            // release: the block's stores (ordered before this thread's by the barrier) are visible device-wide
            // before the count is; a consumer's acquire load pairs with it
            if (signal) red_release_add(counters + it[11], 1);
            if (trace) {                                     // (block, start, end) per item: the device-wide ns timer
                trace[3 * ii] = blockIdx.x;
                trace[3 * ii + 1] = meta->t0;
                trace[3 * ii + 2] = global_ns();
            }
        }
        if (!ok) return;
    }
    // the last block out resets the counters for the next launch (graph replay)
    if (threadIdx.x == 0) {
        if (atom_acq_rel_add(done, 1) == (int)gridDim.x - 1) {
            for (int c = 0; c < n_counters; ++c) counters[c] = 0;
            *done = 0;
        }
    }
}
