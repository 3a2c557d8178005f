"""Per-kernel timings at Kimi K2.6 TP=8 rank shapes, as a fraction of the read ceiling measured in the
same run.

    PYTHONPATH=. python -m bench.kernels [--quick] [--json out.json]

Each case is timed by CUDA-graph replay (bench.ceilings.time_graph: median per call). GEMMs rotate over
enough weight copies (> 2x L2) that every call streams its weight from DRAM, as in a real decode step
where 61 layers' weights pass through L2 once. bytes = weights + activations read + outputs written;
GB/s = bytes / time; 'frac' = GB/s / measured read ceiling. Benchmarks print; they never assert.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from bench.ceilings import measure_mma_bf16_tflops, measure_read_bandwidth, time_graph

H, V, V_SHARD = 7168, 163840, 20480
# (name, N, K, batch): every skinny GEMM one TP=8 rank runs per layer (weights [N, K] bf16)
GEMMS = [
    ("q_a+kv_a (fused)", 1536 + 576, 7168, 1),
    ("q_b (8 heads x 192)", 1536, 1536, 1),
    ("kv_b W_UK^T (8 heads)", 512, 128, 8),
    ("kv_b W_UV (8 heads)", 128, 512, 8),
    ("o_proj", 7168, 1024, 1),
    ("dense MLP gate+up", 2 * 2304, 7168, 1),
    ("dense MLP down", 7168, 2304, 1),
    ("shared expert gate+up", 2 * 256, 7168, 1),
    ("shared expert down", 7168, 256, 1),
    ("router gate (fp32 out)", 384, 7168, 1),
    ("lm_head shard", V_SHARD, 7168, 1),
    ("drafter qkv (8q+1k+1v heads)", 1024 + 256, 7168, 1),
    ("drafter o_proj", 7168, 1024, 1),
    ("drafter MLP gate+up", 2 * 2304, 7168, 1),
    ("drafter MLP down", 7168, 2304, 1),
]
L2_BYTES = 64 << 20


def _rand_bf16(cp, shape, scale=1.0):
    from ddtree_cupy.bf16 import to_bf16_bits
    return cp.asarray(to_bf16_bits(np.random.default_rng(0).standard_normal(shape, dtype=np.float32) * scale))


def gemm_cases(cp, rows):
    from ddtree_cupy.kernels.gemm import gemm_bf16
    out = []
    for name, N, K, B in GEMMS:
        wbytes = N * K * 2 * B
        copies = max(1, min(64, math.ceil(2 * L2_BYTES / wbytes)))
        shape = (B, N, K) if B > 1 else (N, K)
        w0 = _rand_bf16(cp, shape, 0.02)
        ws = [w0] + [w0.copy() for _ in range(copies - 1)]
        f32 = "fp32" in name
        for T in rows:
            x = _rand_bf16(cp, (B, T, K) if B > 1 else (T, K))
            y = cp.empty((B, T, N) if B > 1 else (T, N), np.float32 if f32 else np.uint16)
            it = [0]

            def fn(x=x, y=y, ws=ws, it=it, f32=f32):
                gemm_bf16(x, ws[it[0] % len(ws)], y, out_dtype=np.float32 if f32 else np.uint16)
                it[0] += 1
            nbytes = wbytes + x.nbytes + y.nbytes
            out.append((f"gemm {name}", f"T={T} N={N} K={K}" + (f" x{B}" if B > 1 else ""), nbytes, fn))
    return out


def layer_cases(cp, rows):
    from ddtree_cupy.kernels import layers, router, sample, topk
    from ddtree_cupy.config import RopeConfig
    from ddtree_cupy.reference import yarn_inv_freq
    rope_cfg = RopeConfig(theta=50000.0, kind="yarn", factor=64.0, original_max_position_embeddings=4096,
                          beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    inv = cp.asarray(yarn_inv_freq(rope_cfg, 64).astype(np.float32))
    c, s = layers.rope_tables(yarn_inv_freq(rope_cfg, 64), 65536)
    cos, sin = cp.asarray(c), cp.asarray(s)
    w = _rand_bf16(cp, (H,))
    table = _rand_bf16(cp, (V_SHARD, H))
    out = []
    for T in rows:
        x, res, y = _rand_bf16(cp, (T, H)), _rand_bf16(cp, (T, H)), cp.empty((T, H), np.uint16)
        out.append(("rms_norm", f"T={T} H={H}", 2 * T * H * 2 + H * 2,
                    lambda x=x, y=y: layers.rms_norm(x, w, 1e-6, y)))
        out.append(("rms_norm + residual", f"T={T} H={H}", 4 * T * H * 2 + H * 2,
                    lambda x=x, y=y, r=res: layers.rms_norm(x, w, 1e-6, y, residual=r)))
        q = _rand_bf16(cp, (T, 8, 192))
        pos = cp.asarray(np.arange(T, dtype=np.int32) + 4000)
        out.append(("rope q_pe (inv_freq)", f"T={T} 8 heads x 64", 2 * T * 8 * 64 * 2,
                    lambda q=q, pos=pos: layers.rope(q[:, :, 128:], pos, inv_freq=inv)))
        out.append(("rope q_pe (table)", f"T={T} 8 heads x 64", 2 * T * 8 * 64 * 2 + T * 64 * 4,
                    lambda q=q, pos=pos: layers.rope(q[:, :, 128:], pos, cos=cos, sin=sin)))
        gu, a = _rand_bf16(cp, (T, 2 * 2304)), cp.empty((T, 2304), np.uint16)
        out.append(("silu_mul", f"T={T} I=2304", 3 * T * 2304 * 2, lambda gu=gu, a=a: layers.silu_mul(gu, a)))
        ids = cp.asarray(np.random.default_rng(T).integers(0, V, T).astype(np.int32))
        e = cp.empty((T, H), np.uint16)
        out.append(("embed (vocab shard)", f"T={T} H={H}", 2 * T * H * 2,
                    lambda ids=ids, e=e: layers.embed(ids, table, 0, e)))
        lg = cp.asarray(np.random.default_rng(T).standard_normal((T, 384)).astype(np.float32))
        bias = cp.zeros(384, np.float32)
        ri, rw = cp.empty((T, 8), np.int32), cp.empty((T, 8), np.float32)
        out.append(("router top-k (from logits)", f"T={T} E=384 k=8", T * 384 * 4,
                    lambda lg=lg, ri=ri, rw=rw: router.route_logits(lg, bias, 8, 1, 1, 2.827, True, ri, rw)))
        logits = cp.asarray(np.random.default_rng(T).standard_normal((T, V)).astype(np.float32))
        am = cp.empty((T,), np.int32)
        ws1 = topk.topk_workspace(T, V, 1)
        amv = cp.empty((T, 1), np.float32)
        out.append(("argmax fp32", f"T={T} V={V}", T * V * 4,
                    lambda lo=logits, am=am, ws1=ws1, amv=amv: topk.argmax(lo, am, workspace=ws1, out_vals=amv)))
        for K in (8, 64):
            tv, ti = cp.empty((T, K), np.float32), cp.empty((T, K), np.int32)
            wsk = topk.topk_workspace(T, V, K)
            out.append((f"top-{K} fp32", f"T={T} V={V}", T * V * 4,
                        lambda lo=logits, tv=tv, ti=ti, wsk=wsk, K=K: topk.topk(lo, K, tv, ti, workspace=wsk)))
        sb = sample.SampleBuffers(T, V, 64)
        sargs = (cp.full(T, 0.7, np.float32), cp.full(T, 50, np.int32), cp.full(T, 0.9, np.float32),
                 cp.arange(T, dtype=np.uint64), cp.zeros(T, np.int64))
        so = cp.empty((T,), np.int32)
        out.append(("sample (top-k 50, top-p 0.9)", f"T={T} V={V}", 2 * T * V * 4,
                    lambda lo=logits, so=so, sb=sb, sargs=sargs: sample.sample(lo, *sargs, so, buffers=sb)))
    return out


def main(argv=None):
    import cupy as cp
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer row counts")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    bw = measure_read_bandwidth(4 << 30)
    tf = measure_mma_bf16_tflops()
    print(f"device: {name} (sm_{dev.compute_capability}); read ceiling {bw:.0f} GB/s; mma.sync bf16 {tf:.0f} TFLOP/s")
    g_rows = [1, 8, 16, 64, 160] if not args.quick else [1, 16, 160]
    l_rows = [1, 16, 160] if not args.quick else [1, 160]
    results = []
    print(f"{'kernel':34} {'shape':28} {'us':>8} {'MB':>8} {'GB/s':>7} {'frac':>6}")
    for cases in (gemm_cases, layer_cases):
        for kname, shape, nbytes, fn in cases(cp, g_rows if cases is gemm_cases else l_rows):
            try:
                us = time_graph(fn, iters=64 if kname.startswith("gemm") else 20)
            except Exception as e:      # keep the table going; the error is printed in its row
                print(f"{kname:34} {shape:28} ERROR {type(e).__name__}: {str(e)[:80]}")
                continue
            gbs = nbytes / (us * 1e-6) / 1e9
            results.append(dict(kernel=kname, shape=shape, us=us, bytes=nbytes, gbps=gbs, frac=gbs / bw))
            print(f"{kname:34} {shape:28} {us:8.2f} {nbytes / 1e6:8.2f} {gbs:7.0f} {gbs / bw:6.2f}")
            sys.stdout.flush()
        cp.get_default_memory_pool().free_all_blocks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, read_ceiling_gbps=bw, mma_bf16_tflops=tf, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
