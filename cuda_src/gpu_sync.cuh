// GPU-scope memory-order helpers for blocks that wait on each other inside one launch (the persistent layer
// executor's counters; the all-reduce's peer flags are system-scope, allreduce.cuh). Acquire loads and
// release reductions order a block's own accesses; a block barrier before a release (or after an acquire)
// extends that to the whole block.
#pragma once

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
