// L2 prefetch of bytes a later kernel of the step will read: the next layer's projection weights and its
// latent-cache pages (docs/KERNELS.md "L2 prefetch"). Why: a GEMM's first weight bytes arrive ~1-2 us after
// its blocks start, and inside the step the blocks of a 96 KB-per-block GEMM cannot even become resident
// (and issue their pre-PDL-wait weight loads) until the MoE kernel before them has left the SMs, so the
// projections after the MoE start on an empty pipeline. Prefetching their bytes into L2 during the MoE,
// which leaves ~40% of the DRAM bandwidth unused, turns those DRAM reads into L2 reads.
//
// A pure hint: the kernel writes nothing and reads only the block table and lengths (clamped, so stale or
// garbage values can only prefetch the wrong lines of valid buffers). cp.async.bulk.prefetch.L2 (sm_90+,
// also sm_120) asks the copy engine for a whole chunk with one instruction and costs no registers.
// Optional eviction priority evict_last (createpolicy), so the MoE's streamed expert bytes, which are never
// re-read, are evicted before the prefetched lines.
#include "common.cuh"

#define PF_CHUNK 16384       // bytes per prefetch instruction (a multiple of 16)
#define PF_RANGES 4
#define PF_PAGE_PARTS 4     // a 73,728-byte latent page in 4 prefetches of 18,432 bytes

__device__ __forceinline__ void prefetch_l2_bulk(const void* p, unsigned bytes, int last, uint64_t pol) {
    if (last)
        asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" :: "l"(p), "r"(bytes), "l"(pol) : "memory");
    else
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}

// Items: PF_CHUNK-byte chunks of ranges 0..3 (16-byte aligned, sizes multiples of 16), then PF_PAGE_PARTS items
// per (stream, page) of the latent pool (page block_table[b][j] for j < min(ceil((len[b] + 1) / 64), max_pages)),
// each a quarter page. Every thread of the grid takes items gid, gid + nthreads, ... The copy engine serves one
// SM's prefetches one after the other (measured: a 4.7 MB pool prefetch from one block held the launch ~15 us),
// so the wrapper spreads the items over many small blocks.
extern "C" __global__ void __launch_bounds__(32) l2_prefetch_kernel(
        const unsigned char* __restrict__ p0, long long n0, const unsigned char* __restrict__ p1, long long n1,
        const unsigned char* __restrict__ p2, long long n2, const unsigned char* __restrict__ p3, long long n3,
        const unsigned char* __restrict__ pool, long long page_bytes, int num_pages,
        const int* __restrict__ block_table, const int* __restrict__ lens, int S, int max_pages, int last) {
    // Let the next kernel launch at once: this one only waits (below) so that the stream's order holds
    // transitively -- a dependent's DDT_PDL_WAIT covers this grid, and this grid covers its predecessor.
    DDT_PDL_LAUNCH_DEPENDENTS();
    uint64_t pol = 0;
    if (last) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    const unsigned char* const ps[PF_RANGES] = {p0, p1, p2, p3};
    const long long ns[PF_RANGES] = {n0, n1, n2, n3};
    long long first[PF_RANGES + 1];
    first[0] = 0;
#pragma unroll
    for (int r = 0; r < PF_RANGES; ++r) first[r + 1] = first[r] + (ns[r] + PF_CHUNK - 1) / PF_CHUNK;
    const long long n_items = first[PF_RANGES] + (pool ? (long long)S * max_pages * PF_PAGE_PARTS : 0);
    const long long nth = (long long)gridDim.x * blockDim.x;
    for (long long it = (long long)blockIdx.x * blockDim.x + threadIdx.x; it < n_items; it += nth) {
        if (it < first[PF_RANGES]) {
            int r = 0;
#pragma unroll
            for (int q = 1; q < PF_RANGES; ++q) r += it >= first[q];
            const long long off = (it - first[r]) * PF_CHUNK;
            const long long rem = ns[r] - off;
            prefetch_l2_bulk(ps[r] + off, (unsigned)(rem < PF_CHUNK ? rem : PF_CHUNK), last, pol);
        } else {
            // Block table and lengths are read before the wait: a value being rewritten by an earlier kernel
            // can only misdirect the hint; the clamps keep every address inside the pool.
            const long long q = (it - first[PF_RANGES]) / PF_PAGE_PARTS;
            const int part = (int)((it - first[PF_RANGES]) % PF_PAGE_PARTS);
            const int b = (int)(q / max_pages), j = (int)(q % max_pages);
            const int n_pages = min((lens[b] + KV_PAGE_SIZE) / KV_PAGE_SIZE, max_pages);
            if (j >= n_pages) continue;
            const int page = block_table[(size_t)b * max_pages + j];
            if (page < 0 || page >= num_pages) continue;
            const long long pb = page_bytes / PF_PAGE_PARTS;
            prefetch_l2_bulk(pool + (size_t)page * page_bytes + part * pb, (unsigned)pb, last, pol);
        }
    }
    DDT_PDL_WAIT();
}
