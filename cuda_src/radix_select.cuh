// Radix select over unique 64-bit keys, 8-bit digits from the most significant: the one implementation used
// by the DDTree top-K (ddtree.cu: the list kind's exact stage-1 fallback, both merges' narrowing, the scan
// merge's group-key narrowing) and the general top-K (topk.cu's block_topk). A larger key ranks first.
#pragma once
#include "common.cuh"

// One radix-select step, run by one warp: hist[256] counts the keys of the current prefix region by their
// next 8-bit digit. Finds the digit d whose bin holds the `remaining`-th largest key of the region
// (remaining >= 1 and <= the region's size) and writes d, the count in bins above d and the count in d.
__device__ __forceinline__ void radix_pick(const unsigned* hist, unsigned remaining, int lane,
                                           int* digit, unsigned* above, unsigned* bin) {
    unsigned c[8], local = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) { c[j] = hist[255 - (lane * 8 + j)]; local += c[j]; }
    unsigned incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    unsigned cum = incl - local;             // keys in the bins above this lane's first bin
    if (cum < remaining && incl >= remaining) {
#pragma unroll 1
        for (int j = 0; j < 8; ++j) {
            if (cum + c[j] >= remaining) { *digit = 255 - (lane * 8 + j); *above = cum; *bin = c[j]; break; }
            cum += c[j];
        }
    }
}

// A radix select run by a whole block of 256 threads (one histogram bin each) over unique keys: each pass
// counts, by their next 8-bit digit, the keys whose bits above it equal the prefix (count(hmask, prefix, shift): shared
// atomics into hist, which every thread clears before and sees complete after), radix_pick (warp 0) finds
// the digit of the bin holding the k-th largest of them, and the prefix takes that digit. STOP: ends after
// the first pass whose keys >= the prefix (the bins above plus this bin) number at most cap (uniform; with
// k <= cap at the latest at shift 0, where the bin is one key). Else all 8 passes: the prefix is the k-th
// largest key. s_digit / s_above / s_bin: radix_pick's shared outputs. Starts after a barrier that made
// the keys visible; every shared value it wrote has been read by all when it returns.
template <bool STOP, typename Count>
__device__ __forceinline__ unsigned long long radix_select(unsigned k, unsigned cap, unsigned* hist, int* s_digit,
                                                           unsigned* s_above, unsigned* s_bin, int tid, int lane,
                                                           int warp, Count count) {
    unsigned long long prefix = 0ull;
    unsigned remaining = k, above = 0;
#pragma unroll 1
    for (int shift = 56; shift >= 0; shift -= 8) {
        const unsigned long long hmask = shift == 56 ? 0ull : (~0ull << (shift + 8));
        hist[tid] = 0u;
        __syncthreads();
        count(hmask, prefix, shift);
        __syncthreads();
        if (warp == 0) radix_pick(hist, remaining, lane, s_digit, s_above, s_bin);
        __syncthreads();
        prefix |= (unsigned long long)*s_digit << shift;
        remaining -= *s_above;
        if constexpr (STOP) {
            above += *s_above;
            const unsigned in_bin = *s_bin;
            __syncthreads();   // digit/above/bin read by all before the next pass
            if (above + in_bin <= cap) break;   // uniform
        } else {
            __syncthreads();   // digit/above read by all before the next pass
        }
    }
    return prefix;
}
