// KV cache writes and compaction (docs/ATTENTION.md, docs/CONTRACTS.md "Paged latent KV cache").
//
// Latent pool per layer: bf16 [num_pages, 64, 576]; stream b's position p lives in page
// block_table[b][p / 64], row p % 64. Drafter cache per layer: bf16 [S, C, Hkv, 128] for K and for V,
// position p of stream b in slot p % C (a ring: with C >= the context every position has its own slot;
// with a sliding window W <= C only the last W positions are read, so older slots may be reused).
#include "common.cuh"

#define LAT_CHUNKS (KV_ROW_DIM / 8)     // 72 chunks of 16 bytes per latent row
#define LAT_CKV_CHUNKS (KV_LATENT_DIM / 8)

// Write T new latent rows. Row i: c_kv from lat + i*lat_stride (512 values), k_pe from rope + i*rope_stride
// (64 values); for a packed [T, 576] input the caller passes rope = lat + 512 and both strides 576.
// Rows with pos[i] < 0 are padding and are skipped. One block per row, 96 threads (72 busy).
extern "C" __global__ void __launch_bounds__(96) kv_write_latent(
    const bf16_bits* __restrict__ lat, long long lat_stride, const bf16_bits* __restrict__ rope,
    long long rope_stride, const int* __restrict__ stream, const int* __restrict__ pos,
    bf16_bits* __restrict__ pool, const int* __restrict__ block_table, int max_pages) {
    DDT_PDL_LAUNCH_DEPENDENTS();  // dependents still wait (DDT_PDL_WAIT) for this whole grid's writes
    DDT_PDL_WAIT();  // inputs and the cache are written by earlier kernels
    const int i = blockIdx.x;
    const int c = threadIdx.x;
    if (c >= LAT_CHUNKS) return;
    const int p = pos[i];
    if (p < 0) return;
    const int b = stream[i];
    const int page = block_table[(size_t)b * max_pages + p / KV_PAGE_SIZE];
    const uint4* src = c < LAT_CKV_CHUNKS
        ? reinterpret_cast<const uint4*>(lat + (size_t)i * lat_stride) + c
        : reinterpret_cast<const uint4*>(rope + (size_t)i * rope_stride) + (c - LAT_CKV_CHUNKS);
    uint4* dst = reinterpret_cast<uint4*>(pool + ((size_t)page * KV_PAGE_SIZE + p % KV_PAGE_SIZE) * KV_ROW_DIM) + c;
    *dst = *src;
}

// Commit accepted tree rows for every layer at once: grid (S, n_layers), 128 threads.
// Stream b (committed length s = prefix_len[b], n_accept[b] accepted rows including the root) moves slot
// s + acc_rows[b][j] to s + j for j = 1 .. n_accept-1 in ascending order. acc_rows is strictly increasing
// (a parent precedes its child), so acc_rows[j] >= j: the copy for j reads a slot no earlier copy wrote,
// but it may write a slot a LATER copy reads (e.g. rows 0,2,3: copy 1 reads s+2, copy 2 writes s+2), hence
// one row at a time with a barrier in between (at most a handful of rows per stream).
extern "C" __global__ void __launch_bounds__(128) kv_compact_latent(
    const unsigned long long* __restrict__ pools, const int* __restrict__ block_table, int max_pages,
    const int* __restrict__ prefix_len, const int* __restrict__ n_accept, const int* __restrict__ acc_rows,
    int acc_stride) {
    DDT_PDL_LAUNCH_DEPENDENTS();  // dependents still wait (DDT_PDL_WAIT) for this whole grid's writes
    DDT_PDL_WAIT();  // inputs and the cache are written by earlier kernels
    const int b = blockIdx.x;
    bf16_bits* pool = reinterpret_cast<bf16_bits*>(pools[blockIdx.y]);
    const int* table = block_table + (size_t)b * max_pages;
    const int s = prefix_len[b];
    const int na = n_accept[b];
    for (int j = 1; j < na; ++j) {
        const int src_p = s + acc_rows[(size_t)b * acc_stride + j];
        const int dst_p = s + j;
        if (src_p != dst_p && threadIdx.x < LAT_CHUNKS) {
            const uint4* src = reinterpret_cast<const uint4*>(
                pool + ((size_t)table[src_p / KV_PAGE_SIZE] * KV_PAGE_SIZE + src_p % KV_PAGE_SIZE) * KV_ROW_DIM);
            uint4* dst = reinterpret_cast<uint4*>(
                pool + ((size_t)table[dst_p / KV_PAGE_SIZE] * KV_PAGE_SIZE + dst_p % KV_PAGE_SIZE) * KV_ROW_DIM);
            dst[threadIdx.x] = src[threadIdx.x];
        }
        __syncthreads();  // the next copy may read what this one wrote over (block-wide visibility)
    }
}

// Append T rows of drafter context K/V ([T, Hkv, 128] each) at per-row (stream, position); pos < 0 skips.
// grid (T), 128 threads; each thread moves 16-byte chunks of K and V.
extern "C" __global__ void __launch_bounds__(128) drafter_kv_append(
    const bf16_bits* __restrict__ k, const bf16_bits* __restrict__ v, const int* __restrict__ stream,
    const int* __restrict__ pos, bf16_bits* __restrict__ k_cache, bf16_bits* __restrict__ v_cache,
    int capacity, int kv_heads) {
    DDT_PDL_LAUNCH_DEPENDENTS();  // dependents still wait (DDT_PDL_WAIT) for this whole grid's writes
    DDT_PDL_WAIT();  // inputs and the cache are written by earlier kernels
    const int i = blockIdx.x;
    const int p = pos[i];
    if (p < 0) return;
    const int b = stream[i];
    const int chunks = kv_heads * 128 / 8;
    const size_t dst_row = ((size_t)b * capacity + p % capacity) * chunks;
    const uint4* ks = reinterpret_cast<const uint4*>(k) + (size_t)i * chunks;
    const uint4* vs = reinterpret_cast<const uint4*>(v) + (size_t)i * chunks;
    uint4* kd = reinterpret_cast<uint4*>(k_cache) + dst_row;
    uint4* vd = reinterpret_cast<uint4*>(v_cache) + dst_row;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        kd[c] = ks[c];
        vd[c] = vs[c];
    }
}
