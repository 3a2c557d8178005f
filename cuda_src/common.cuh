// Shared definitions for every kernel family. Keep this small: types, limits and tiny helpers only.
#pragma once
#include <cuda_bf16.h>
// NVRTC has no C library headers (no <stdint.h> on a pip-only install): define the fixed-width types
// it would give (LP64: 64-bit is long) and only include the real header under a host compiler.
#if defined(__CUDACC_RTC__)
typedef signed char int8_t; typedef unsigned char uint8_t;
typedef short int16_t; typedef unsigned short uint16_t;
typedef int int32_t; typedef unsigned int uint32_t;
typedef long int64_t; typedef unsigned long uint64_t;
#else
#include <stdint.h>
#endif

// Tree limits (docs/CONTRACTS.md): root + up to 128 nodes per stream, ancestor mask of 5 x 32 bits per row.
#define DDT_MAX_TREE_ROWS 129
#define DDT_MASK_WORDS 5

// Paged latent KV cache: tokens per page and values per token (c_kv 512 | k_pe 64).
#define KV_PAGE_SIZE 64
#define KV_LATENT_DIM 512
#define KV_ROPE_DIM 64
#define KV_ROW_DIM (KV_LATENT_DIM + KV_ROPE_DIM)

// Programmatic dependent launch (sm_90 and sm_120; docs/KERNELS.md "PDL"). A kernel launched with the
// programmatic-serialization attribute may start while its predecessor in the stream is still running, so
// everything it does before DDT_PDL_WAIT() must not read what earlier kernels write (weights, tables and
// constants are fine: prefetch them there). DDT_PDL_WAIT() returns once every earlier kernel has finished
// and its writes are visible; it is a no-op when the kernel was launched normally or on older GPUs.
// DDT_PDL_LAUNCH_DEPENDENTS() lets the next kernel start launching before this one ends (it never makes
// this kernel's later writes visible early: the dependent's DDT_PDL_WAIT() still waits for the whole grid).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define DDT_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define DDT_PDL_LAUNCH_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define DDT_PDL_WAIT() do { } while (0)
#define DDT_PDL_LAUNCH_DEPENDENTS() do { } while (0)
#endif

// The wait-for-inputs point of a shared device body (gemm_decode_body, rmsnorm_row), passed as a functor:
// the kernels wait for their PDL predecessor there; the persistent executor waits on its item's dependency
// counters instead (cuda_src/persistent_layer.cu), so the weight loads issued before it overlap the wait.
struct PdlWaitHook {
    __device__ __forceinline__ void operator()() const { DDT_PDL_WAIT(); }
};

typedef unsigned short bf16_bits;  // bf16 as stored by the host (numpy/CuPy uint16)

// An L2 prefetch (fire and forget): no register result and no architectural effect, so a warp can have
// many more bytes requested than its ring holds, and the address may come from values another kernel is
// still writing (before DDT_PDL_WAIT()): a stale address only wastes a line.
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}

__device__ __forceinline__ float bf16_to_f32(bf16_bits b) {
    return __uint_as_float(((unsigned int)b) << 16);
}
__device__ __forceinline__ bf16_bits f32_to_bf16(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
