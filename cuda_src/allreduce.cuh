// Peer-to-peer all-reduce over CUDA IPC buffers: the device functions (allreduce.cu holds the kernels).
//
// Every rank owns one IPC-exported allocation (ddtree_cupy/comm/layout.py mirrors this layout):
//   header  flags1[AR_MAX_BLOCKS][AR_MAX_RANKS]  u32  phase-1 arrival of rank s for block b (written by s)
//           flags2[AR_MAX_BLOCKS][AR_MAX_RANKS]  u32  phase-2 arrival (two-shot: reduced shard published)
//           epoch1[AR_MAX_BLOCKS], epoch2[...]   u32  this rank's own per-block epoch counters
//   data    [2][cap] bf16   this rank's input, one slot per epoch parity (peers read it)
//   result  [2][cap] bf16   two-shot: the shards this rank reduced (peers read them)
//   isum    [2][cap] fp32   two-level: this rank's island sum (its partners in the other islands read it)
// Synchronisation is by epochs, never by a host reset: block b of every rank increments its own counter at
// each call, publishes "I reached epoch e" into every peer's flag word for (b, me), and waits until every
// peer's word for (b, peer) is at least e (a wrap-safe signed difference: a peer can be at most one epoch
// ahead, because it cannot pass epoch e + 1 before this rank publishes e + 1). Two parity slots make a
// buffer written at epoch e + 1 distinct from the one peers may still read at epoch e; slot e is rewritten
// at e + 2, and nobody reaches e + 2 before everybody left e. So a captured CUDA graph replays forever.
//
// Every rank runs the same grid for the same call (the host's plan depends on the payload and a table that
// is identical on all ranks), so counters agree across ranks. Sums run in rank order 0..n-1 in fp32 from
// identical bf16 inputs: every rank holds identical bits.
//
// The wait is bounded (nanoseconds, %globaltimer): a peer that never arrives makes the waiting block record
// {code, rank, block, peer, epoch} in host-mapped memory and trap, so the job ends with a clear error
// instead of spinning forever.
#pragma once
#include "layer_math.cuh"

#define AR_MAX_RANKS 8
#define AR_MAX_BLOCKS 128
#define AR_THREADS 256
#define AR_MAXV 4                  // 16-byte vectors per thread in a fused row: H <= 8 * 4 * 256 = 8192
#define AR_HEADER_BYTES 16384      // flags1 4 KB | flags2 4 KB | epoch1 512 B | epoch2 512 B, padded

struct ArBuffers {
    unsigned int* flags1;
    unsigned int* flags2;
    unsigned int* epoch1;
    unsigned int* epoch2;
    bf16_bits* data;               // [2][cap]
    bf16_bits* result;             // [2][cap]
    float* isum;                   // [2][cap]
};

__device__ __forceinline__ ArBuffers ar_buffers(unsigned long long base, long long cap) {
    ArBuffers b;
    char* p = (char*)base;
    b.flags1 = (unsigned int*)p;
    b.flags2 = b.flags1 + AR_MAX_BLOCKS * AR_MAX_RANKS;
    b.epoch1 = b.flags2 + AR_MAX_BLOCKS * AR_MAX_RANKS;
    b.epoch2 = b.epoch1 + AR_MAX_BLOCKS;
    b.data = (bf16_bits*)(p + AR_HEADER_BYTES);
    b.result = b.data + 2 * cap;
    b.isum = (float*)(b.result + 2 * cap);
    return b;
}

__device__ __forceinline__ void ar_store_release(unsigned int* p, unsigned int v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned int ar_load_acquire(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long ar_now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Error record in host-mapped memory: [0] code (1 = a peer never arrived), [1] rank, [2] block, [3] peer,
// [4] epoch, [5] phase. Plain stores, the code last (no atomics on host memory: not every PCIe root complex
// has them); blocks failing together may mix their fields, the code and the message stay right. The trap
// then ends the CUDA context; the host's watchdog reads the record.
__device__ __forceinline__ void ar_fail(int* err, int rank, int block, int peer, unsigned int epoch, int phase) {
    if (err != nullptr) {
        volatile int* ev = err;
        ev[1] = rank; ev[2] = block; ev[3] = peer; ev[4] = (int)epoch; ev[5] = phase;
        __threadfence_system();
        ev[0] = 1;
        __threadfence_system();
    }
    __trap();
}

// A 16-byte load that bypasses L1 (peers' slots are rewritten every other call; L1 is not coherent with
// them, which matters once a persistent kernel runs several all-reduce items in one launch).
__device__ __forceinline__ uint4 ar_ld_cg(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}

// One barrier of block `blk` at epoch e: thread s < n publishes e into peer s's flag word for (blk, me) --
// into every peer's, so that no flag word ever lags by more than one epoch -- then, if bit s of `wait_mask`
// is set, waits until this rank's word for (blk, s) has reached e. Every thread of the block must call it
// (it ends with __syncthreads, after which the awaited peers' writes before their publish are visible).
__device__ __forceinline__ void ar_barrier(const unsigned long long* peers, long long cap, unsigned int* my_flags,
                                           int which, int rank, int n, int blk, unsigned int e,
                                           long long timeout_ns, int* err, unsigned int wait_mask) {
    __syncthreads();                        // this block's writes of the phase precede the publish
    const int s = threadIdx.x;
    if (s < n) {
        ArBuffers pb = ar_buffers(peers[s], cap);
        unsigned int* f = (which == 1 ? pb.flags1 : pb.flags2) + blk * AR_MAX_RANKS + rank;
        __threadfence_system();
        ar_store_release(f, e);
        if ((wait_mask >> s) & 1u) {
            const unsigned int* mine = my_flags + blk * AR_MAX_RANKS + s;
            const unsigned long long t0 = ar_now_ns();
            unsigned int spins = 0;
            while ((int)(ar_load_acquire(mine) - e) < 0) {
                if ((++spins & 255u) == 0u && (long long)(ar_now_ns() - t0) > timeout_ns)
                    ar_fail(err, rank, blk, s, e, which);
            }
        }
    }
    __syncthreads();
}

// fp32 sum of 8 bf16 values from the slots of ranks s0 .. s0 + cnt - 1, in rank order (identical on every
// rank that sums the same ranks).
__device__ __forceinline__ void ar_sum8(const unsigned long long* peers, long long cap, int s0, int cnt,
                                        long long slot_off, int vec, float (&acc)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    for (int s = s0; s < s0 + cnt; ++s) {
        const uint4 v = ar_ld_cg((const uint4*)(ar_buffers(peers[s], cap).data + slot_off) + vec);
        const bf16_bits* vh = (const bf16_bits*)&v;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += bf16_to_f32(vh[e]);
    }
}

// Two-level: the fp32 sum over islands 0 .. k-1, in island order, of the island sums that rank
// j * m + (rank % m) published (this rank's own for its island).
__device__ __forceinline__ void ar_sum8_islands(const unsigned long long* peers, long long cap, int rank, int m,
                                                int k, long long slot_off, int vec, float (&acc)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    for (int j = 0; j < k; ++j) {
        const float* src = ar_buffers(peers[j * m + rank % m], cap).isum + slot_off + 8LL * vec;
        const uint4 lo = ar_ld_cg((const uint4*)src), hi = ar_ld_cg((const uint4*)src + 1);
        acc[0] += __uint_as_float(lo.x); acc[1] += __uint_as_float(lo.y);
        acc[2] += __uint_as_float(lo.z); acc[3] += __uint_as_float(lo.w);
        acc[4] += __uint_as_float(hi.x); acc[5] += __uint_as_float(hi.y);
        acc[6] += __uint_as_float(hi.z); acc[7] += __uint_as_float(hi.w);
    }
}

__device__ __forceinline__ uint4 ar_round8(const float (&acc)[8]) {
    uint4 o;
    bf16_bits* oh = (bf16_bits*)&o;
#pragma unroll
    for (int e = 0; e < 8; ++e) oh[e] = f32_to_bf16(acc[e]);
    return o;
}

// The fused tail of one row: h = bf16(sum + residual) (the residual stream is bf16), residual_out = h,
// normed = bf16(w * h * rsqrt(mean(h^2) + eps)): the same arithmetic and reduction order as rmsnorm_kernel
// with a residual (the same add_residual8 / rms_rstd / rms_scale_store of layer_math.cuh, the squares summed
// in the same order), so the fused path and "all-reduce, then rms_norm(residual=...)" agree bit for bit.
// `sums` holds the row's reduced bf16 vectors (thread-owned: vector i = threadIdx.x + j * AR_THREADS).
__device__ __forceinline__ void ar_add_norm_row(const uint4 (&sums)[AR_MAXV], const uint4 (&wv)[AR_MAXV], int nv,
                                                const bf16_bits* res_in, bf16_bits* res_out, bf16_bits* normed,
                                                int H, float eps, float* red) {
    float v[AR_MAXV][8];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < AR_MAXV; ++j) {
        const int i = threadIdx.x + j * AR_THREADS;
        if (i < nv) {
            const uint4 r = ((const uint4*)res_in)[i];
            ((uint4*)res_out)[i] = add_residual8(sums[j], r, v[j]);
#pragma unroll
            for (int e = 0; e < 8; ++e) ss += v[j][e] * v[j][e];
        }
    }
    rms_scale_store<AR_THREADS, AR_MAXV>(v, rms_rstd<AR_THREADS>(ss, red, H, eps), wv, nv, (uint4*)normed);
    __syncthreads();                        // `red` is reused by the next row
}

// Arguments of one all-reduce work item (a persistent kernel fills one and calls ar_allreduce_item).
struct ArItem {
    const unsigned long long* peers;   // [n] base addresses of every rank's buffer, this rank's included
    long long cap;                     // elements per data / result slot
    int rank, n;
    int island;                        // two-level: ranks per island (islands are rank ranges of this size)
    const bf16_bits* x;                // [N] this rank's partial sum
    bf16_bits* out;                    // [N] the sum (unfused; may alias x)
    long long N;                       // elements
    int unit;                          // elements per unit (fused: H, one row per unit)
    // fused add + norm (residual != nullptr): rows of H = unit
    const bf16_bits* residual; bf16_bits* residual_out; const bf16_bits* weight; bf16_bits* normed;
    float eps;
    long long timeout_ns;
    int* err;
};

#define AR_ONESHOT 0
#define AR_TWOSHOT 1
#define AR_TWOLEVEL 2

// The whole all-reduce for block `blk` of `nblk` (units blk, blk + nblk, ...).
//   AR_ONESHOT:  every rank sums every rank's unit (rank order); n - 1 payloads cross into each GPU.
//   AR_TWOSHOT:  unit u is reduced by its owner rank u % n only (reduce-scatter into `result`), then every
//                rank reads the reduced unit from its owner (all-gather): 2 (n - 1) / n payloads per GPU.
//   AR_TWOLEVEL: k islands of m ranks (rank ranges [j m, j m + m)); every rank sums its island's units in
//                fp32 (island rank order) into `isum`, then adds the island sums of its partners j m + rank % m
//                in island order: m - 1 payloads inside the island and 2 (k - 1) fp32 payloads across, each
//                from one partner (on a 4 + 4 PCIe box: one peer over the socket link instead of four).
//                Its bits differ from the flat order's, and are the same on every rank.
// The fused tail runs where the reduced row is final, on every rank.
template <int ALGO, bool FUSED>
__device__ __forceinline__ void ar_allreduce_item(const ArItem& a, int blk, int nblk, float* red,
                                                  unsigned int* e_sh) {
    constexpr bool PHASE2 = ALGO != AR_ONESHOT;
    const ArBuffers me = ar_buffers(a.peers[a.rank], a.cap);
    const int nunits = (int)((a.N + a.unit - 1) / a.unit);   // the wrapper keeps N < 2^31
    const int nvec = (int)(a.N / 8);
    const int uv = a.unit / 8;                    // vectors per unit
    const int m = ALGO == AR_TWOLEVEL ? a.island : a.n;
    const int k = a.n / m;                        // islands
    const int i0 = (a.rank / m) * m;              // this rank's island's first rank
    const unsigned int all = (a.n >= 32) ? 0xffffffffu : ((1u << a.n) - 1u);
    unsigned int partners = 0u;
    for (int j = 0; j < k; ++j) partners |= 1u << (j * m + a.rank % m);
    const unsigned int mask1 = ALGO == AR_TWOLEVEL ? (((1u << m) - 1u) << i0) : all;
    const unsigned int mask2 = ALGO == AR_TWOLEVEL ? partners : all;
    uint4 wv[AR_MAXV];
    if (FUSED) {                                  // weights are never written by a kernel: load before the wait
#pragma unroll
        for (int j = 0; j < AR_MAXV; ++j) {
            const int i = threadIdx.x + j * AR_THREADS;
            if (i < uv) wv[j] = ((const uint4*)a.weight)[i];
        }
    }
    DDT_PDL_WAIT();
    if (threadIdx.x == 0) {
        e_sh[0] = me.epoch1[blk] + 1u;
        if (PHASE2) e_sh[1] = me.epoch2[blk] + 1u;
    }
    __syncthreads();
    const unsigned int e1 = e_sh[0];
    const unsigned int e2 = PHASE2 ? e_sh[1] : 0u;
    const long long slot = (long long)(e1 & 1u) * a.cap;
    // phase 1: publish this rank's input in its own parity slot
    for (int u = blk; u < nunits; u += nblk) {
        const int v0 = u * uv;
        const int vend = min(v0 + uv, nvec);
        for (int v = v0 + threadIdx.x; v < vend; v += AR_THREADS)
            ((uint4*)(me.data + slot))[v] = ((const uint4*)a.x)[v];
    }
    ar_barrier(a.peers, a.cap, me.flags1, 1, a.rank, a.n, blk, e1, a.timeout_ns, a.err, mask1);
    // peers are reading the slot now: dependents may start launching (their wait covers our writes)
    DDT_PDL_LAUNCH_DEPENDENTS();
    const long long rslot = (long long)(e2 & 1u) * a.cap;
    if (PHASE2) {
        for (int u = blk; u < nunits; u += nblk) {
            if (ALGO == AR_TWOSHOT && u % a.n != a.rank) continue;
            const int v0 = u * uv;
            const int vend = min(v0 + uv, nvec);
            for (int v = v0 + threadIdx.x; v < vend; v += AR_THREADS) {
                float acc[8];
                ar_sum8(a.peers, a.cap, ALGO == AR_TWOLEVEL ? i0 : 0, m, slot, v, acc);
                if (ALGO == AR_TWOSHOT) {
                    ((uint4*)(me.result + rslot))[v] = ar_round8(acc);
                } else {
                    float4* d = (float4*)(me.isum + rslot + 8LL * v);
                    d[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
                    d[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
                }
            }
        }
        ar_barrier(a.peers, a.cap, me.flags2, 2, a.rank, a.n, blk, e2, a.timeout_ns, a.err, mask2);
    }
    for (int u = blk; u < nunits; u += nblk) {
        const int v0 = u * uv;
        const ArBuffers own = ar_buffers(a.peers[ALGO == AR_TWOSHOT ? u % a.n : a.rank], a.cap);
        if (FUSED) {
            uint4 sums[AR_MAXV];
#pragma unroll
            for (int j = 0; j < AR_MAXV; ++j) {
                const int i = threadIdx.x + j * AR_THREADS;
                if (i < uv) {
                    if (ALGO == AR_TWOSHOT) {
                        sums[j] = ar_ld_cg((const uint4*)(own.result + rslot) + v0 + i);
                    } else {
                        float acc[8];
                        if (ALGO == AR_TWOLEVEL) ar_sum8_islands(a.peers, a.cap, a.rank, m, k, rslot, v0 + i, acc);
                        else ar_sum8(a.peers, a.cap, 0, a.n, slot, v0 + i, acc);
                        sums[j] = ar_round8(acc);
                    }
                }
            }
            ar_add_norm_row(sums, wv, uv, a.residual + (long long)u * a.unit, a.residual_out + (long long)u * a.unit,
                            a.normed + (long long)u * a.unit, a.unit, a.eps, red);
        } else {
            const int vend = min(v0 + uv, nvec);
            for (int v = v0 + threadIdx.x; v < vend; v += AR_THREADS) {
                if (ALGO == AR_TWOSHOT) {
                    ((uint4*)a.out)[v] = ar_ld_cg((const uint4*)(own.result + rslot) + v);
                } else {
                    float acc[8];
                    if (ALGO == AR_TWOLEVEL) ar_sum8_islands(a.peers, a.cap, a.rank, m, k, rslot, v, acc);
                    else ar_sum8(a.peers, a.cap, 0, a.n, slot, v, acc);
                    ((uint4*)a.out)[v] = ar_round8(acc);
                }
            }
        }
    }
    if (threadIdx.x == 0) {                       // the next call of this block starts from here
        me.epoch1[blk] = e1;
        if (PHASE2) me.epoch2[blk] = e2;
    }
}
