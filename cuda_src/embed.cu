// Vocabulary-parallel embedding gather: out[t] = table[ids[t] - vocab_start] when the id falls in this
// shard's [vocab_start, vocab_start + rows), else zeros (the all-reduce over shards fills it in).
#include "common.cuh"

extern "C" __global__ void embed_gather_kernel(const int* __restrict__ ids, const bf16_bits* __restrict__ table,
                                               int rows, int vocab_start, int H,
                                               bf16_bits* __restrict__ out, long long out_stride) {
    // PDL (common.cuh): let the next kernel launch now (it waits for this whole grid before reading),
    // then wait for the previous kernel's outputs before the first read of an input.
    DDT_PDL_LAUNCH_DEPENDENTS();
    DDT_PDL_WAIT();
    const int t = blockIdx.x;
    const int local = ids[t] - vocab_start;
    const bool mine = local >= 0 && local < rows;
    const uint4* src = (const uint4*)(table + (long long)(mine ? local : 0) * H);
    uint4* dst = (uint4*)(out + t * out_stride);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int i = threadIdx.x; i < H / 8; i += blockDim.x) dst[i] = mine ? src[i] : zero;
}
