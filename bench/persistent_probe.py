"""What does each thing a persistent executor does cost a GEMM? A bisection: the decode GEMM body
(gemm_bf16.cu, 16-row tile over all of K, the full ring) run by kernels that each add one thing, all on the
same inputs, timed as CUDA graphs against the byte floor of the same run (docs/history/
2026-12-03-persistent.md: it found the misaligned-ring cost).

    PYTHONPATH=$PWD python3 -m bench.persistent_probe [--rows 8 16] [--only NAME]

  plain        gemm_bf16_kernel_decode, one tile per block (the product's launch, forced to the tile config)
  loop         a grid of (SMs x 2) blocks striding over the tiles, arguments as kernel parameters
  loop1        the same kernel with one block per tile (the plain grid)
  table        per-block item lists and an op table read from global memory per item, no signals
  table_sig    + per item: block barrier, threadfence, release add; the done counter at the end
  table_sig_s  + 48 bytes of static shared memory (the dynamic ring then starts 48 bytes in)
  executor     persistent_layer itself on its stream-K schedule (engine/schedule.build_gemm): not the same
               tiles, so its row shows the relative error against the plain launch instead of same bits
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from bench.ceilings import measure_read_bandwidth, time_graph
from ddtree_cupy.engine import schedule as S

_SRC = r"""
#include "persistent_layer.cu"

struct ProbeNoWait { __device__ __forceinline__ void operator()() const {} };

template <int NT>
__device__ __forceinline__ void probe_tile(const bf16_bits* x, int xs, const bf16_bits* w, void* out, int os, int T,
                                           int N, int K, int tile) {
    gemm_decode_body<NT, NT == 1 ? 4 : 3, false, 1, 1, ProbeNoWait>(x, 0, xs, w, 0, out, 0, os, T, N, K, tile, 0);
}

template <int NT>
__global__ void __launch_bounds__(256, 2)
probe_loop(const bf16_bits* __restrict__ x, int xs, const bf16_bits* __restrict__ w, bf16_bits* __restrict__ out,
           int os, int T, int N, int K, int ntiles) {
    for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
        probe_tile<NT>(x, xs, w, out, os, T, N, K, t);
        __syncthreads();
    }
}

template <int NT, bool SIG, bool STATIC>
__global__ void __launch_bounds__(256, 2)
probe_table(const int* __restrict__ items, const int* __restrict__ block_start, const PersistOp* __restrict__ ops,
            int* counters, int* done) {
    __shared__ float pad_f[STATIC ? NORM_THREADS / 32 : 1];
    __shared__ int pad_i;
    // opaque to the compiler, so the arrays stay (the executor's `red` and `abort_s`)
    if (STATIC && threadIdx.x < NORM_THREADS / 32) pad_f[threadIdx.x] = (float)items[0];
    if (STATIC && threadIdx.x == 0) pad_i = block_start[gridDim.x] < 0;
    const int i0 = block_start[blockIdx.x], i1 = block_start[blockIdx.x + 1];
    for (int ii = i0; ii < i1; ++ii) {
        const int* it = items + 16 * ii;
        const PersistOp& op = ops[it[1]];
        probe_tile<NT>(op.x, (int)op.x_stride, op.w, op.out, (int)op.out_stride, op.T, op.N, op.K, it[2] / 16);
        if (STATIC && (pad_i || pad_f[(threadIdx.x >> 5) & 7] < -1e30f)) return;
        __syncthreads();
        if (SIG && threadIdx.x == 0) {
            __threadfence();
            red_release_add(counters + it[11], 1);
        }
    }
    if (SIG && threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(done, 1) == (int)gridDim.x - 1) {
            counters[0] = 0;
            *done = 0;
        }
    }
}
"""

_NAMES = ["probe_loop<1>", "probe_loop<2>"] + [f"probe_table<{nt}, {s}, {st}>" for nt in (1, 2)
                                              for s, st in (("false", "false"), ("true", "false"), ("true", "true"))]


def _module(cp):
    from ddtree_cupy.kernels.compile import CUDA_SRC_DIR, KernelSpec, cuda_include_dirs
    opts = KernelSpec("persistent_layer.cu", ()).options(None) + tuple(f"--include-path={d}"
                                                                        for d in cuda_include_dirs())
    mod = cp.RawModule(code=_SRC, options=opts, name_expressions=_NAMES)
    mod.compile()
    return mod


def run(cp, T, read_gbs, only=None):
    from ddtree_cupy.kernels import gemm
    from ddtree_cupy.kernels.persistent import RING_BYTES, PersistOpArgs, PersistentSegment, default_grid
    mod = _module(cp)
    nt = 1 if T <= 8 else 2
    rng = np.random.default_rng(T)
    bf = lambda *s: cp.asarray(((rng.standard_normal(s) * 0.05).astype(np.float32).view(np.uint32) >> 16)   # noqa: E731
                               .astype(np.uint16))
    rows = []
    for name, N, K in (("gate_up", 4608, 7168), ("down", 7168, 2304)):
        x, w, o = bf(T, K), bf(N, K), cp.zeros((T, N), np.uint16)
        grid = default_grid()
        sc = S.build_gemm(T, N, K, grid, bytes_per_us_per_block=4.0e6 / grid)
        seg = PersistentSegment(sc, 0, {"gemm": PersistOpArgs(x=x, w=w, out=o, N=N, K=K)})
        ntiles = N // 16
        # the table variants' lists: whole-K tiles dealt round robin (tile t on block t % grid), 16-int records
        # (kind, op 0, first row, ..., signal 0 at [11])
        lists = [list(range(b, ntiles, grid)) for b in range(grid)]
        rec = np.zeros((ntiles, S.REC_INTS), np.int32)
        rec[:, 2] = 16 * np.concatenate([np.array(li, np.int64) for li in lists])
        items = cp.asarray(rec)
        block_start = cp.asarray(np.cumsum([0] + [len(li) for li in lists]).astype(np.int32))
        i32 = np.int32

        def fn_of(kname):
            f = mod.get_function(kname)
            f.max_dynamic_shared_size_bytes = RING_BYTES
            return f
        loop = fn_of(f"probe_loop<{nt}>")
        tabs = {k: fn_of(f"probe_table<{nt}, {s}, {st}>") for k, s, st in
                (("table", "false", "false"), ("table_sig", "true", "false"), ("table_sig_s", "true", "true"))}
        cfg = gemm.DecodeConfig(nt, gemm.dec_stages(nt), 1, 1)

        def plain():
            old, prev = gemm.set_decode_config(cfg), gemm.set_variant("decode")
            try:
                gemm.gemm_bf16(x, w, o)
            finally:
                gemm.set_decode_config(old)
                gemm.set_variant(prev)
        variants = {
            "plain": plain,
            "loop": lambda: loop((grid,), (256,), (x, i32(K), w, o, i32(N), i32(T), i32(N), i32(K), i32(ntiles)),
                                 shared_mem=RING_BYTES),
            "loop1": lambda: loop((ntiles,), (256,), (x, i32(K), w, o, i32(N), i32(T), i32(N), i32(K), i32(ntiles)),
                                  shared_mem=RING_BYTES),
        }
        for k, f in tabs.items():
            variants[k] = (lambda f=f: f((grid,), (256,), (items, block_start, seg.op_table, seg.counters,
                                                             seg.done), shared_mem=RING_BYTES))
        variants["executor"] = seg.launch
        floor = (w.nbytes + x.nbytes + o.nbytes) / (read_gbs * 1e3)
        plain()
        ref = o.copy()
        for vname, fn in variants.items():
            if only and vname not in only:
                continue
            o[...] = 0xFFFF
            fn()
            cp.cuda.Stream.null.synchronize()
            seg.check()
            if vname == "executor":
                f = lambda a: (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)   # noqa: E731
                check = f"rel err {float(cp.linalg.norm(f(o) - f(ref)) / cp.linalg.norm(f(ref))):.1e}"
            else:
                check = f"same bits {bool(cp.array_equal(o, ref))}"
            us = time_graph(fn)
            rows.append((name, T, vname, us, floor, check))
            print(f"{name:8} T={T:2d} {vname:12} {us:8.2f} us  floor {floor:6.2f}  x{us / floor:5.2f}  {check}",
                  flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.persistent_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[8, 16])
    ap.add_argument("--only", nargs="+")
    ap.add_argument("--ceiling", type=float, help="read ceiling GB/s to use instead of measuring (profiler runs)")
    args = ap.parse_args(argv)
    import cupy as cp
    read = args.ceiling or measure_read_bandwidth()
    print(f"read ceiling {read:.0f} GB/s (this run)")
    for T in args.rows:
        run(cp, T, read, args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
