// Thread-block cluster helpers (sm_90+: Hopper and Blackwell, sm_120 included): the cluster rank, a
// cluster-wide barrier, and loads from another block's shared memory (distributed shared memory). Used by the
// GEMM's K-split reductions (cuda_src/gemm_bf16.cu: decode and wide families). Below sm_90 the rank is 0, the
// barrier a no-op and the loads local, so a kernel without __cluster_dims__ still builds.
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define DDT_HAS_CLUSTERS 1
#endif

__device__ __forceinline__ uint32_t ddt_smem_u32(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ uint32_t cluster_rank() {
#ifdef DDT_HAS_CLUSTERS
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
#else
    return 0;
#endif
}
// Every thread of every block of the cluster arrives; release/acquire make the shared-memory writes before
// the barrier visible to the other blocks' loads after it.
__device__ __forceinline__ void cluster_sync_all() {
#ifdef DDT_HAS_CLUSTERS
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// The address of the same shared-memory offset as p in cluster block `rank` (distributed shared memory).
__device__ __forceinline__ uint32_t cluster_smem_addr(const void* p, uint32_t rank) {
    uint32_t remote = ddt_smem_u32(p);
#ifdef DDT_HAS_CLUSTERS
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(remote), "r"(rank));
#endif
    return remote;
}
// Load a float (a float4: 16-byte aligned) from the same shared-memory offset in cluster block `rank`.
__device__ __forceinline__ float ld_cluster_f32(const float* p, uint32_t rank) {
#ifdef DDT_HAS_CLUSTERS
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(cluster_smem_addr(p, rank)) : "memory");
    return v;
#else
    return *p;
#endif
}
__device__ __forceinline__ float4 ld_cluster_f32x4(const float* p, uint32_t rank) {
#ifdef DDT_HAS_CLUSTERS
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(cluster_smem_addr(p, rank)) : "memory");
    return v;
#else
    return *reinterpret_cast<const float4*>(p);
#endif
}
