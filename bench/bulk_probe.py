"""How fast the bulk copy engine streams from DRAM, by copy size, copies in flight and blocks per SM.

    PYTHONPATH=$PWD python -m bench.bulk_probe [--gb 1] [--json F]

Why: the bulk-copy MoE GEMMs (cuda_src/moe_bulk.cu) and a bulk-copy skinny GEMM (removed) streamed
far below the read ceiling, and the two readings -- the consumers' per-stage chain vs a fixed cost per copy
request -- could not be told apart inside those kernels. This kernel has no arithmetic: a producer warp streams
each block's contiguous region through an nst-deep ring of stages of ``copies`` copies of ``copy_bytes`` each
(``cp.async.bulk`` + mbarriers, the same protocol as moe_bulk.cu), and four consumer warps only XOR every 16-byte
word of each stage (so the copies must land) before releasing it. The XOR of the whole region is checked
against numpy. Prints GB/s and the fraction of the plain-load read ceiling measured in the same run
(bench/ceilings.py).
"""
from __future__ import annotations

import argparse
import json

import numpy as np

_SRC = r"""
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    unsigned done = 0;
    do {
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    } while (!done);
}

// Block b streams bytes [b * per_block, (b + 1) * per_block) of src in stages of copies x copy_bytes.
extern "C" __global__ void __launch_bounds__(160, 1) bulk_probe(const unsigned char* __restrict__ src,
        long long per_block, int copy_bytes, int copies, int nst, unsigned* __restrict__ out) {
    extern __shared__ __align__(128) unsigned char dyn[];
    unsigned long long* full = reinterpret_cast<unsigned long long*>(dyn);
    unsigned long long* empty = full + 8;
    unsigned char* ring = dyn + 128;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long stage_bytes = (long long)copies * copy_bytes;
    const int n = (int)(per_block / stage_bytes);
    const unsigned char* base = src + (long long)blockIdx.x * per_block;
    if (threadIdx.x == 0) {
        for (int s = 0; s < nst; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_u32(full + s)) : "memory");
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 4;" :: "r"(smem_u32(empty + s)) : "memory");
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == 4) {
        for (int it = 0; it < n; ++it) {
            const int slot = it % nst;
            if (it >= nst) mbar_wait(empty + slot, ((it / nst) - 1) & 1);
            if (lane == 0)
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                             :: "r"(smem_u32(full + slot)), "r"((unsigned)stage_bytes) : "memory");
            __syncwarp();
            for (int c = lane; c < copies; c += 32)
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                             :: "r"(smem_u32(ring + slot * stage_bytes + (long long)c * copy_bytes)),
                                "l"(base + it * stage_bytes + (long long)c * copy_bytes), "r"(copy_bytes),
                                "r"(smem_u32(full + slot)) : "memory");
        }
        return;
    }
    unsigned acc = 0;
    for (int it = 0; it < n; ++it) {
        const int slot = it % nst;
        mbar_wait(full + slot, (it / nst) & 1);
        const uint4* st = reinterpret_cast<const uint4*>(ring + slot * stage_bytes);
        for (int i = threadIdx.x; i < stage_bytes / 16; i += 128) {
            const uint4 v = st[i];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        __syncwarp();
        if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(empty + slot)) : "memory");
    }
    atomicXor(out, acc);
}
"""


def main():
    import cupy as cp
    from bench.ceilings import _median_event_ms, measure_read_bandwidth
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0, help="bytes streamed per configuration")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    smem_sm = dev.attributes["MaxSharedMemoryPerMultiprocessor"]
    read_gbs = measure_read_bandwidth()
    total = int(args.gb * 1e9)
    src = cp.random.randint(0, 2 ** 31, size=total // 4, dtype=cp.int64).astype(cp.uint32)
    src_u8 = src.view(cp.uint8)
    kern = cp.RawKernel(_SRC, "bulk_probe", options=("--std=c++17",))
    xor_all = cp.ReductionKernel("uint32 x", "uint32 y", "x", "a ^ b", "y = a", "0", "xor_all")
    out = cp.zeros(1, dtype=cp.uint32)
    rows = []
    print(f"{dev.attributes.get('ComputeCapabilityMajor', '')} SMs {sms}, read ceiling {read_gbs:.0f} GB/s")
    print(f"{'copy B':>7} {'copies':>6} {'nst':>3} {'blk/SM':>6} {'in flight/SM':>12} {'GB/s':>7} {'% ceil':>6} "
          f"{'Gcopy/s':>7}  check")
    for copy_bytes in (256, 1024, 4096, 16384):
        for copies in (1, 4, 16):
            for nst in (2, 4, 8):
                stage = copy_bytes * copies
                smem = 128 + nst * stage
                if smem > 99 * 1024 or copies > 32:
                    continue
                for bps in (1, 2, 3):
                    if bps * (smem + 1024) > smem_sm:
                        continue
                    grid = sms * bps
                    per_block = (total // grid) // stage * stage
                    if per_block < 4 * stage:
                        continue
                    kern.max_dynamic_shared_size_bytes = smem
                    args_k = (src_u8, np.int64(per_block), np.int32(copy_bytes), np.int32(copies), np.int32(nst), out)

                    def launch():
                        kern((grid,), (160,), args_k, shared_mem=smem)
                    out.fill(0)
                    launch()
                    cp.cuda.Device().synchronize()
                    want = int(xor_all(src[: grid * per_block // 4]).get())
                    ok = int(out.get()[0]) == want
                    ms = _median_event_ms(launch, reps=5)
                    gbs = grid * per_block / (ms * 1e-3) / 1e9
                    r = dict(copy_bytes=copy_bytes, copies=copies, nst=nst, blocks_per_sm=bps,
                             in_flight_per_sm=bps * nst * stage, gbs=gbs, frac=gbs / read_gbs,
                             gcopies_per_s=gbs / copy_bytes, check=ok)
                    rows.append(r)
                    print(f"{copy_bytes:7d} {copies:6d} {nst:3d} {bps:6d} {bps * nst * stage:12d} {gbs:7.0f} "
                          f"{100 * gbs / read_gbs:6.1f} {gbs / copy_bytes:7.2f}  {'ok' if ok else 'WRONG'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode(), sms=sms,
                           read_ceiling_gbs=read_gbs, rows=rows), f, indent=1)
    bad = [r for r in rows if not r["check"]]
    if bad:
        raise SystemExit(f"{len(bad)} configurations read wrong data")


if __name__ == "__main__":
    main()
