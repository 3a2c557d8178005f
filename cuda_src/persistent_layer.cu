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
//  * Signals: the block barrier (every thread's stores issued), then thread 0 fences (threadfence: the
//    stores are visible device-wide) and adds 1 with a release atomic.
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
// Item record (int32 x 8): kind, op, arg0, arg1, arg2, wait_begin, n_waits, signal. `op` indexes the op
// table (PersistOp, one per stage of the layer: pointers, strides, sizes). Kinds (schedule.KIND):
//   1 norm_row    arg0 = row                        rmsnorm_row (residual add when op.x2 is set)
//   2 gemm_tile   arg0 = first weight row, arg1 = rows (16)    decode GEMM body, NT from op.T
//   3 boundary    TP = 1 all-reduce stand-in: out = x (a fused all-reduce replaces this body)
//  13 silu_chunk  arg0 = first column, arg1 = columns   act = silu(gate) * up
// Any other kind sets err and stops (the host refuses schedules with kinds this build does not run).
#include "norm_row.cuh"
#include "gemm_bf16.cu"

#define PERSIST_THREADS DEC_THREADS           // 256: the decode GEMM body's and the norm body's block
static_assert(PERSIST_THREADS == NORM_THREADS, "the norm row body needs the GEMM body's block size");

#define PERSIST_ERR_TIMEOUT 1
#define PERSIST_ERR_KIND 2
#define PERSIST_ERR_SHAPE 3

struct PersistOp {
    const bf16_bits* x;       // input rows (GEMM x, norm x, silu gate|up, boundary source)
    const bf16_bits* x2;      // norm: residual in (nullptr: no residual add)
    const bf16_bits* w;       // GEMM weight [N, K] / norm weight [H]
    void* out;                // GEMM / norm / silu / boundary output
    bf16_bits* out2;          // norm: residual out
    long long x_stride, x2_stride, out_stride, out2_stride;   // row strides in elements
    int T, N, K, flags;       // flags bit 0: GEMM output fp32
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

__device__ __forceinline__ long long global_ns() {
    long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// 8 bf16 through L2 only (a line another block wrote during this launch)
__device__ __forceinline__ uint4 ldcg16(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

// The wait on an item's dependency counters, as a WaitHook (common.cuh) of the shared bodies: called by every
// thread at the body's wait-for-inputs point, after the weight loads it issued before (so the weight bytes
// stream while the producers finish). Thread 0 spins with acquire loads, bounded; the barrier publishes.
struct CounterWait {
    const int* waits;          // this item's (counter, target) pairs
    int n;
    const int* counters;
    int* err;
    int item;                  // the encoded item row (reported + 1 in err[0])
    long long spin_limit;
    int* abort_flag;           // shared: set when this block gives up (timeout, or another block's error)

    __device__ __forceinline__ void operator()() const {
        if (threadIdx.x == 0) {
            int bad = 0;
            for (int q = 0; q < n && !bad; ++q) {
                const int* c = counters + waits[2 * q];
                const int target = waits[2 * q + 1];
                long long polls = 0;
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
            *abort_flag = bad;
        }
        __syncthreads();
    }
};

template <int RT, int NT>
__device__ __forceinline__ void gemm_item(const PersistOp& op, int n0, const CounterWait& wait) {
    constexpr int STAGES = NT == 1 ? 4 : 3;   // kernels/gemm.py dec_stages: 96 KB rings
    if (op.flags & 1)
        gemm_decode_body<NT, STAGES, true, RT, 1, CounterWait>(op.x, 0, (int)op.x_stride, op.w, 0, op.out, 0,
                                                               (int)op.out_stride, op.T, op.N, op.K,
                                                               n0 / (16 * RT), 0, wait);
    else
        gemm_decode_body<NT, STAGES, false, RT, 1, CounterWait>(op.x, 0, (int)op.x_stride, op.w, 0, op.out, 0,
                                                                (int)op.out_stride, op.T, op.N, op.K,
                                                                n0 / (16 * RT), 0, wait);
}

// Two resident blocks per SM where the device holds them (the H200's 228 KB of shared memory holds two 96 KB
// rings; sm_120's 100 KB per SM holds one either way): the register budget is then 128, under which only the
// 16-row GEMM tile fits beside the norm body (the 32 / 64-row bodies spill), so the schedule is built with
// 16-row tiles (kernels/persistent.py TILE_ROWS). Measured against one block per SM with 16 / 32 / 64-row
// tiles: 3-8% faster at every shape (docs/PERSISTENT.md).
template <int NT>
__device__ __forceinline__ bool gemm_rows(const PersistOp& op, int n0, int rows, const CounterWait& wait) {
    if (rows != 16) return false;
    gemm_item<1, NT>(op, n0, wait);
    return true;
}

extern "C" __global__ void __launch_bounds__(PERSIST_THREADS, 2)
persistent_layer(const int* __restrict__ items, const int* __restrict__ waits, const int* __restrict__ block_start,
                 const PersistOp* __restrict__ ops, int* counters, int n_counters, int* done, int* err,
                 long long spin_limit, long long* __restrict__ trace) {
    __shared__ float red[NORM_THREADS / 32];
    __shared__ int abort_s;
    const int i0 = block_start[blockIdx.x], i1 = block_start[blockIdx.x + 1];
    for (int ii = i0; ii < i1; ++ii) {
        const int* it = items + 8 * ii;
        const int kind = it[0], opi = it[1], a0 = it[2], a1 = it[3];
        const int wb = it[5], nw = it[6], sig = it[7];
        const CounterWait wait{waits + 2 * wb, nw, counters, err, ii, spin_limit, &abort_s};
        const PersistOp& op = ops[opi];
        long long t0 = 0;
        if (trace && threadIdx.x == 0) t0 = global_ns();
        bool ok = true;
        // norm and GEMM items wait inside their bodies (after their weight loads); the others wait first
        if (kind == 1) {
            rmsnorm_row<CounterWait>(a0, op.x, op.x_stride, op.x2, op.x2_stride, op.out2, op.out2_stride, op.w,
                                     (bf16_bits*)op.out, op.out_stride, nullptr, op.N, op.eps, red, wait);
        } else if (kind == 2) {
            ok = op.T <= 8 ? gemm_rows<1>(op, a0, a1, wait)
                           : (op.T <= 16 ? gemm_rows<2>(op, a0, a1, wait) : false);
            if (!ok) wait();                                 // still wait: the error path below must not race
        } else {
            wait();
            if (!abort_s) {
                if (kind == 3) {
                    const int nv = op.N / 8;
                    for (int v = threadIdx.x; v < op.T * nv; v += PERSIST_THREADS) {
                        const int t = v / nv, c = v - t * nv;
                        *reinterpret_cast<uint4*>((bf16_bits*)op.out + t * op.out_stride + 8 * c) =
                            ldcg16(op.x + t * op.x_stride + 8 * c);
                    }
                } else if (kind == 13) {
                    const int F = op.N;                      // act width; x = [T, 2F] gate | up
                    for (int v = threadIdx.x; v < op.T * a1; v += PERSIST_THREADS) {
                        const int t = v / a1, f = a0 + (v - t * a1);
                        const bf16_bits g = __ldcg(op.x + t * op.x_stride + f);
                        const bf16_bits u = __ldcg(op.x + t * op.x_stride + F + f);
                        ((bf16_bits*)op.out)[t * op.out_stride + f] = silu_mul1(g, u);
                    }
                } else {
                    ok = false;
                }
            }
        }
        if (abort_s) return;                                 // uniform: set before a barrier in wait()
        __syncthreads();                                     // every thread's stores issued; smem free again
        if (threadIdx.x == 0) {
            if (!ok) {
                if (atomicCAS(err, 0, ii + 1) == 0) err[1] = kind == 2 ? PERSIST_ERR_SHAPE : PERSIST_ERR_KIND;
            }
            __threadfence();
            red_release_add(counters + sig, 1);
            if (trace) {                                     // (block, start, end) per item: the device-wide ns timer
                trace[3 * ii] = blockIdx.x;
                trace[3 * ii + 1] = t0;
                trace[3 * ii + 2] = global_ns();
            }
        }
        if (!ok) return;
    }
    // the last block out resets the counters for the next launch (graph replay)
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(done, 1) == (int)gridDim.x - 1) {
            for (int c = 0; c < n_counters; ++c) counters[c] = 0;
            *done = 0;
            __threadfence();
        }
    }
}
