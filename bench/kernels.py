"""Per-kernel timings at Kimi K2.6 TP=8 rank shapes, as a fraction of the read ceiling measured in the
same run.

    PYTHONPATH=. python -m bench.kernels [--quick] [--parts gemm,layers,chain,sweep] [--pdl 0|1|both]
                                         [--variant auto|splitk|decode|both] [--rows 1,8,16] [--json out.json]

Each case is timed by CUDA-graph replay (bench.ceilings.time_graph: median per call). GEMMs rotate over
enough weight copies (> 2x L2) that every call streams its weight from DRAM, as in a real decode step
where 61 layers' weights pass through L2 once. bytes = weights + activations read + outputs written;
GB/s = bytes / time; 'frac' = GB/s / measured read ceiling. Benchmarks print; they never assert.

Parts: 'gemm' every skinny GEMM at TP=8 rank shapes; 'layers' the small layer kernels, top-K, sampling;
'chain' a model-like graph: one TP=8 rank's attention + shared-expert + router sequence (10 kernels, 6 of
them GEMMs) over 8 distinct layers' weights back to back, so each GEMM's fixed cost shows in context;
'sweep' the split-K factor of a few GEMMs, against gemm.choose_split's pick. --pdl: run with programmatic
dependent launch off (0), on (1) or both (default; '[pdl]' marks the rows with it). --variant: the GEMM
kernel (gemm.set_variant): the rule ('auto'), one forced, or 'both' (default: every GEMM and chain at
T <= 16 with the split-K kernel and with the decode kernel, '[dec]' marks the latter), followed by a
side-by-side table.
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


def _variants(T, variants):
    return [v for v in variants if v != "decode" or T <= 16]


def _tag(v):
    return " [dec]" if v == "decode" else ""


def _with_variant(v, fn):
    from ddtree_cupy.kernels import gemm

    def run():
        old = gemm.set_variant(v)
        try:
            fn()
        finally:
            gemm.set_variant(old)
    return run


def gemm_cases(cp, rows, variants=("auto",)):
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
            for v in _variants(T, variants):
                out.append((f"gemm {name}{_tag(v)}", f"T={T} N={N} K={K}" + (f" x{B}" if B > 1 else ""), nbytes,
                            _with_variant(v, fn)))
    return out


def layer_cases(cp, rows, variants=None):
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


# one TP=8 rank's per-layer dense GEMMs in the order the target runs them (the MoE experts are moe_int4's)
CHAIN_LAYERS = 8


def chain_case(cp, T):
    """(bytes of weights, fn): CHAIN_LAYERS x [norm, q_a+kv_a, q_a norm, q_b, o_proj, norm(+residual),
    router gate, shared gate+up, silu, shared down], each step reading the previous step's output."""
    from ddtree_cupy.kernels import layers
    from ddtree_cupy.kernels.gemm import gemm_bf16
    shapes = dict(qa=(1536 + 576, H), qb=(1536, 1536), o=(H, 1024), gu=(512, H), down=(H, 256), router=(384, H))
    base = {k: _rand_bf16(cp, v, 0.02) for k, v in shapes.items()}
    layers_w = [{k: (v if i == 0 else v.copy()) for k, v in base.items()} for i in range(CHAIN_LAYERS)]
    wbytes = sum(v.nbytes for lw in layers_w for v in lw.values())
    nw = _rand_bf16(cp, (H,))
    qnw = _rand_bf16(cp, (1536,))
    h0 = _rand_bf16(cp, (T, H))
    b = dict(h=cp.empty((T, H), np.uint16), xn=cp.empty((T, H), np.uint16), qkv=cp.empty((T, 2112), np.uint16),
             qn=cp.empty((T, 1536), np.uint16), q=cp.empty((T, 1536), np.uint16), o=cp.empty((T, H), np.uint16),
             lg=cp.empty((T, 384), np.float32), gu=cp.empty((T, 512), np.uint16), a=cp.empty((T, 256), np.uint16),
             ws=cp.empty(1 << 22, np.float32))

    def fn():
        b["h"][...] = h0          # one copy kernel: every graph replay starts from the same residual
        for lw in layers_w:
            layers.rms_norm(b["h"], nw, 1e-6, b["xn"])
            gemm_bf16(b["xn"], lw["qa"], b["qkv"], workspace=b["ws"])
            layers.rms_norm(b["qkv"][:, :1536], qnw, 1e-6, b["qn"])
            gemm_bf16(b["qn"], lw["qb"], b["q"], workspace=b["ws"])
            gemm_bf16(b["q"][:, :1024], lw["o"], b["o"], workspace=b["ws"])
            layers.rms_norm(b["o"], nw, 1e-6, b["xn"], residual=b["h"])
            gemm_bf16(b["xn"], lw["router"], b["lg"], out_dtype=np.float32, workspace=b["ws"])
            gemm_bf16(b["xn"], lw["gu"], b["gu"], workspace=b["ws"])
            layers.silu_mul(b["gu"], b["a"])
            gemm_bf16(b["a"], lw["down"], b["o"], workspace=b["ws"])
            layers.rms_norm(b["o"], nw, 1e-6, b["xn"], residual=b["h"])
    return wbytes, fn


SWEEP = [("dense MLP gate+up", 2 * 2304, 7168), ("q_a+kv_a (fused)", 2112, 7168), ("o_proj", 7168, 1024),
         ("dense MLP down", 7168, 2304), ("shared expert gate+up", 512, 7168), ("drafter qkv", 1280, 7168),
         ("q_b", 1536, 1536)]


def sweep_cases(cp, rows, variants=None):
    """Split-K factors around gemm.choose_split's pick (each distinct effective split once)."""
    from ddtree_cupy.kernels import gemm
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = []
    for name, N, K in SWEEP:
        wbytes = N * K * 2
        copies = max(1, min(64, math.ceil(2 * L2_BYTES / wbytes)))
        w0 = _rand_bf16(cp, (N, K), 0.02)
        ws_ = [w0] + [w0.copy() for _ in range(copies - 1)]
        kt = K // gemm.BK
        for T in rows:
            x, y = _rand_bf16(cp, (T, K)), cp.empty((T, N), np.uint16)
            cap = max(1, min(kt, K // (8 * T)))
            eff = sorted({math.ceil(kt / math.ceil(kt / s)) for s in range(1, cap + 1)})
            pick = gemm.choose_split(T, N, K, 1, sms)
            step = max(1, len(eff) // 10)
            cand = sorted(set(eff[::step]) | {pick, eff[-1]})
            for s in cand:
                it = [0]

                def fn(x=x, y=y, ws_=ws_, it=it, s=s):
                    gemm.gemm_bf16(x, ws_[it[0] % len(ws_)], y, split_k=s)
                    it[0] += 1
                tag = " *pick*" if s == pick else ""
                out.append((f"split {name}", f"T={T} split={s}{tag}", wbytes + x.nbytes + y.nbytes, fn))
    return out


def _row(results, bw, kname, shape, nbytes, us, pdl):
    gbs = nbytes / (us * 1e-6) / 1e9
    results.append(dict(kernel=kname, shape=shape, us=us, bytes=nbytes, gbps=gbs, frac=gbs / bw, pdl=pdl))
    print(f"{kname:34} {shape:28} {us:8.2f} {nbytes / 1e6:8.2f} {gbs:7.0f} {gbs / bw:6.2f}")
    sys.stdout.flush()


def _side_by_side(results):
    """One line per (GEMM or chain, shape): split-K vs decode, PDL off and on (us, frac of the ceiling)."""
    rows = {}
    for r in results:
        k = r["kernel"]
        dec, pdl = " [dec]" in k, " [pdl]" in k
        base = k.replace(" [dec]", "").replace(" [pdl]", "")
        rows.setdefault((base, r["shape"]), {})[(dec, pdl)] = r
    print(f"\n{'split-K vs decode (us / frac)':44} {'shape':22} {'splitk':>12} {'decode':>12} "
          f"{'splitk[pdl]':>12} {'decode[pdl]':>12}")
    for (base, shape), d in rows.items():
        if (True, False) not in d and (True, True) not in d:
            continue
        cells = [f"{d[c]['us']:6.2f}/{d[c]['frac']:.2f}" if c in d else "-"
                 for c in ((False, False), (True, False), (False, True), (True, True))]
        print(f"{base:44} {shape[:22]:22} " + " ".join(f"{c:>12}" for c in cells))


def main(argv=None):
    import cupy as cp
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer row counts")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--parts", default="gemm,layers,chain", help="comma list of gemm, layers, chain, sweep")
    ap.add_argument("--pdl", default="both", choices=("0", "1", "both"),
                    help="programmatic dependent launch off, on, or both (rows marked [pdl]; sm_90+ only)")
    ap.add_argument("--variant", default="both", choices=("auto", "splitk", "decode", "both"),
                    help="GEMM kernel: the rule, one forced, or split-K and decode side by side ([dec])")
    ap.add_argument("--rows", help="comma list of token counts for gemm and chain (overrides --quick)")
    args = ap.parse_args(argv)
    variants = ("splitk", "decode") if args.variant == "both" else (args.variant,)
    from ddtree_cupy.kernels import launch
    parts = set(args.parts.split(","))
    modes = {"0": [False], "1": [True], "both": [False, True]}[args.pdl]
    if int(cp.cuda.Device().compute_capability) < 90:
        modes = [False]
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    bw = measure_read_bandwidth(4 << 30)
    tf = measure_mma_bf16_tflops()
    print(f"device: {name} (sm_{dev.compute_capability}); read ceiling {bw:.0f} GB/s; mma.sync bf16 {tf:.0f} TFLOP/s")
    g_rows = [1, 8, 16, 64, 160] if not args.quick else [1, 16, 160]
    if args.rows:
        g_rows = [int(r) for r in args.rows.split(",")]
    l_rows = [1, 16, 160] if not args.quick else [1, 160]
    results = []
    print(f"{'kernel':34} {'shape':28} {'us':>8} {'MB':>8} {'GB/s':>7} {'frac':>6}")
    groups = [(gemm_cases, g_rows, "gemm"), (layer_cases, l_rows, "layers"),
              (sweep_cases, [1, 16], "sweep")]
    for cases, rows, part in groups:
        if part not in parts:
            continue
        built = cases(cp, rows, variants)
        for pdl in (modes if part != "sweep" else modes[-1:]):
            launch.set_pdl(pdl)
            tag = " [pdl]" if pdl else ""
            for kname, shape, nbytes, fn in built:
                try:
                    us = time_graph(fn, iters=64 if part != "layers" else 20)
                except Exception as e:      # keep the table going; the error is printed in its row
                    print(f"{kname + tag:34} {shape:28} ERROR {type(e).__name__}: {str(e)[:80]}")
                    continue
                _row(results, bw, kname + tag, shape, nbytes, us, pdl)
        del built
        cp.get_default_memory_pool().free_all_blocks()
    if "chain" in parts:
        for T in g_rows:
            wbytes, fn = chain_case(cp, T)
            for v in _variants(T, variants):
                for pdl in modes:
                    launch.set_pdl(pdl)
                    try:
                        us = time_graph(_with_variant(v, fn), iters=4, reps=9)
                    except Exception as e:
                        print(f"chain [pdl={int(pdl)}]{_tag(v)} T={T} ERROR {type(e).__name__}: {str(e)[:80]}")
                        continue
                    _row(results, bw, f"chain {CHAIN_LAYERS} layers{_tag(v)}" + (" [pdl]" if pdl else ""),
                         f"T={T} 80 kernels, 48 GEMMs", wbytes, us, pdl)
                    print(f"{'':34} {'  per layer':28} {us / CHAIN_LAYERS:8.2f} us; weight stream alone "
                          f"{wbytes / CHAIN_LAYERS / bw / 1e3:.2f} us")
            del fn
            cp.get_default_memory_pool().free_all_blocks()
    launch.set_pdl(False)
    if len(variants) == 2:
        _side_by_side(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, read_ceiling_gbps=bw, mma_bf16_tflops=tf, pdl=args.pdl, results=results),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
