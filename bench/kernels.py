"""Per-kernel timings at Kimi K2.6 TP=8 rank shapes, as fractions of the read ceiling and of the floor
(max(bytes / read ceiling, FLOPs / mma.sync rate)), both measured in the same run.

    PYTHONPATH=. python -m bench.kernels [--quick] [--parts gemm,layers,chain,sweep,configs,wideconfigs]
                                         [--pdl 0|1|both] [--variant oldnew|auto|old,splitk,decode,wide,nocl]
                                         [--rows 1,8,16]
                                         [--shapes q_a,o_proj] [--json out.json]

Each case is timed by CUDA-graph replay (bench.ceilings.time_graph: median per call). GEMMs rotate over
enough weight copies (> 2x L2) that every call streams its weight from DRAM, as in a real decode step
where 61 layers' weights pass through L2 once. bytes = weights + activations read + outputs written;
GB/s = bytes / time; 'frac' = GB/s / measured read ceiling; 'floor' (us) and 'f/fl' = floor / time.
Benchmarks print; they never assert.

Parts: 'gemm' every skinny GEMM at TP=8 rank shapes (T = 1, 8, 16, 32, 64, 160); 'layers' the small layer
kernels, top-K, sampling; 'chain' a model-like graph: one TP=8 rank's attention + shared-expert + router
sequence (10 kernels, 6 of them GEMMs) over 8 distinct layers' weights back to back, so each GEMM's fixed
cost shows in context; 'sweep' the split-K factor of a few GEMMs; 'configs' every compiled decode
config (and split-K) forced at each shape and T, then the fastest per shape; 'wideconfigs' the rule's wide
block shape, the 64-row block and (above 80 rows) the 4-warp 80-token block (T > 16), each with workspace splits
around its model pick and with cluster splits of 2, 4, 8, plus split-K and the rule's own pick, then the
fastest per shape (docs/KERNELS.md "Wide kernel: K split over a thread-block cluster"). --pdl: programmatic
dependent launch off (0), on (1) or both (default; '[pdl]' marks the rows with it). --variant: 'oldnew'
(default) times every GEMM and chain with the decode rule before ``choose_decode`` ('[old]':
bench.kernels.old_choice) and with the current rule, same run, then a side-by-side table; or a comma list of
families forced through gemm.set_variant ('[splitk]', '[dec]', '[wide]': the wide family above 16 rows; 'auto'
is the rule), or 'nocl' (the rule with gemm.WIDE_CLUSTER off: the rule before the cluster split). The wide-token
kernel's comparison against split-K: --parts gemm --pdl 1 --variant splitk,wide --rows 32,64,160; the cluster
split's: --parts gemm,chain --pdl 1 --variant nocl,auto.
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
    ("router+shared gate/up (fp32 out)", 384 + 2 * 256, 7168, 1),   # the engine's fused MoE-layer GEMM
]
L2_BYTES = 64 << 20


_SEED = [0]


def _rand_bf16(cp, shape, scale=1.0):
    """Normal(0, scale) as bf16 bits, drawn on the device (host RNG for the 294 MB lm_head shard alone took
    seconds); round to nearest even as ddtree_cupy.bf16 does (no NaN can occur)."""
    _SEED[0] += 1           # a new stream per array: x must not repeat the weight's first rows
    f = cp.random.RandomState(_SEED[0]).standard_normal(shape, dtype=cp.float32) * np.float32(scale)
    u = f.view(cp.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(cp.uint16)


def _variants(T, variants):
    return [v for v in variants if (v != "decode" or T <= 16) and (v != "wide" or T > 16)]


_TAGS = {"auto": "", "splitk": " [splitk]", "decode": " [dec]", "old": " [old]", "wide": " [wide]",
         "nocl": " [nocl]"}


def _tag(v):
    return _TAGS[v] if isinstance(v, str) else f" [{_cfg_str(v)}]"


def _cfg_str(c):
    if isinstance(c, tuple) and len(c) == 3:        # ("wide", WideConfig, split)
        w = c[1]
        split = f"cl{w.cs}" if w.cs > 1 else f"k{c[2]}"
        bm = f"bm{w.bm()} " if w.bm() != 128 else ""
        return f"wide {bm}bt{w.bt()} w{w.warps_m * w.warps_n} s{w.stages} {split}{' *rule*' if c[0] == 'wide-rule' else ''}"
    return f"dec nt{c.nt} s{c.stages} rt{c.rt} cs{c.cs}"


# The decode rule before ``choose_decode`` (commit bbf9da7), kept here only to time "was" against "now" in one run: the
# decode kernel (RT = CS = 1, full ring) for T <= 8, for T = 9..16 unless its grid is below 0.2 x SMs or in
# (1, 1.25] waves of 2 resident blocks per SM; the split-K kernel otherwise.
def old_choice(T, N, K, B, sms, slots_per_sm):
    from ddtree_cupy.kernels import gemm
    if T > 16:
        return "splitk", None
    base = gemm.DecodeConfig(1 if T <= 8 else 2, gemm.dec_stages(1 if T <= 8 else 2), 1, 1)
    if T <= 8:
        return "decode", base
    blocks = N // 16 * B
    waves = blocks / (slots_per_sm * sms)
    if blocks >= 0.2 * sms and not 1.0 < waves <= 1.25:
        return "decode", base
    return "splitk", None


def _old_gemm(real):
    """gemm_bf16 with the kernel of ``old_choice`` forced per call (the chain mixes shapes)."""
    import cupy
    from ddtree_cupy.kernels import gemm
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]

    def call(x, w, out=None, **kw):
        T, N, K = x.shape[-2], w.shape[-2], w.shape[-1]
        B = w.shape[0] if w.ndim == 3 else 1
        fam, cfg = old_choice(T, N, K, B, sms, 2)
        ov, od = gemm.set_variant(fam), gemm.set_decode_config(cfg)
        try:
            return real(x, w, out, **kw)
        finally:
            gemm.set_variant(ov)
            gemm.set_decode_config(od)
    return call


def _with_variant(v, fn, shape=None):
    """fn run with variant v: a family name ("auto", "splitk", "decode"), "old" (old_choice per call), or
    a DecodeConfig forced."""
    from ddtree_cupy.kernels import gemm

    if v == "old":
        def run_old():
            real = gemm.gemm_bf16
            gemm.gemm_bf16 = _old_gemm(real)
            try:
                fn()
            finally:
                gemm.gemm_bf16 = real
        return run_old

    if v == "nocl":         # the rule without cluster splits (the rule before the cluster split; gemm.WIDE_CLUSTER = False)
        def run_nocl():
            old = gemm.WIDE_CLUSTER
            gemm.WIDE_CLUSTER = False
            try:
                fn()
            finally:
                gemm.WIDE_CLUSTER = old
        return run_nocl

    def run():
        wide = (v[1], v[2]) if isinstance(v, tuple) and isinstance(v[1], gemm.WideConfig) else None  # forced
        fam, cfg = ("decode", v) if isinstance(v, gemm.DecodeConfig) else ("wide", None) if wide else (v, None)
        old, od, ow = gemm.set_variant(fam), gemm.set_decode_config(cfg), gemm.set_wide_config(wide)
        try:
            fn()
        finally:
            gemm.set_variant(old)
            gemm.set_decode_config(od)
            gemm.set_wide_config(ow)
    return run


def wide_candidates(T, N, K, B, sms, smem_per_sm):
    """The wideconfigs sweep at one shape (the cluster-split measurements): the rule's own (config, split) tagged; the rule's block
    shape, the 64-row block (``gemm.WIDE_BM64``) and, above 80 rows, the 4-warp 80-token block, each with
    workspace splits {s / 2, s, 2 s} (s: ``wide_split``'s pick for that shape) and with the K split over a
    cluster of 2, 4, 8 blocks (where K / 64 >= 2 cs); and split-K. (The wide-token kernel's first sweep of every shape x split
    is in gemm_s5_wideconfigs_h200.json (in git history).)"""
    from ddtree_cupy.kernels import gemm
    rule = gemm.choose_wide(T, N, K, B, sms, smem_per_sm)
    out = [("wide-rule",) + tuple(rule)]
    shapes = (rule[0]._replace(cs=1), gemm.WIDE_BM64) + ((gemm.WIDE_BT80_W4,) if T > 80 else ())
    for c in dict.fromkeys(shapes):
        s0 = gemm.wide_split(c, T, N, K, B, sms, smem_per_sm)
        cands = [(c, s) for s in sorted({max(1, s0 // 2), s0, 2 * s0}) if s <= K // gemm.BK]
        cands += [(c._replace(cs=cs), cs) for cs in gemm.WIDE_CL_CS if K // gemm.BK >= 2 * cs]
        out += [("wide", cc, s) for cc, s in cands if (cc, s) != tuple(rule)]
    return out + ["splitk"]


def _flops(T, N, K, B):
    return 2.0 * T * N * K * B


def gemm_cases(cp, rows, variants=("auto",), shapes=None, configs=False, wide=False):
    """(name, shape, bytes, flops, fn) per GEMM x T x variant; ``configs``: instead of the variants, every
    compiled decode config that can serve the call (T <= 16) forced, plus the split-K kernel; ``wide``:
    instead, ``wide_candidates`` at every T > 16."""
    from ddtree_cupy.kernels import gemm
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    smem_sm = cp.cuda.Device().attributes.get("MaxSharedMemoryPerMultiprocessor", 0) or 228 * 1024
    out = []
    for name, N, K, B in GEMMS:
        if shapes and not any(k in name for k in shapes):
            continue
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
                gemm.gemm_bf16(x, ws[it[0] % len(ws)], y, out_dtype=np.float32 if f32 else np.uint16)
                it[0] += 1
            nbytes = wbytes + x.nbytes + y.nbytes
            if wide:
                vs = wide_candidates(T, N, K, B, sms, smem_sm) if T > 16 else []
            elif configs:
                vs = [c for c in gemm.DEC_CONFIGS if T <= 16 and c.nt == (1 if T <= 8 else 2) and N % c.rows() == 0]
                vs += ["splitk"]
            else:
                vs = _variants(T, variants)
            for v in vs:
                out.append((f"gemm {name}{_tag(v)}", f"T={T} N={N} K={K}" + (f" x{B}" if B > 1 else ""), nbytes,
                            _flops(T, N, K, B), _with_variant(v, fn, (T, N, K, B))))
    return out


def layer_cases(cp, rows, variants=None, shapes=None, configs=False):
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
        sargs = (cp.full(T, 0.7, np.float32), cp.full(T, 50, np.int32), cp.full(T, 0.9, np.float32),
                 cp.arange(T, dtype=np.uint64), cp.zeros(T, np.int64))
        so = cp.empty((T,), np.int32)
        # bytes: the exact sampler reads each row up to 15 times (max, mass, 3 radix searches x 4, id lookup)
        out.append(("sample (top-k 50, top-p 0.9)", f"T={T} V={V}", 15 * T * V * 4,
                    lambda lo=logits, so=so, sargs=sargs: sample.sample(lo, *sargs, so)))
    return out


# one TP=8 rank's per-layer dense GEMMs in the order the target runs them (the MoE experts are moe_int4's)
CHAIN_LAYERS = 8


def chain_case(cp, T):
    """(bytes of weights, fn): CHAIN_LAYERS x [norm, q_a+kv_a, q_a norm, q_b, o_proj, norm(+residual),
    router gate, shared gate+up, silu, shared down], each step reading the previous step's output."""
    from ddtree_cupy.kernels import gemm, layers
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
            gemm.gemm_bf16(b["xn"], lw["qa"], b["qkv"], workspace=b["ws"])
            layers.rms_norm(b["qkv"][:, :1536], qnw, 1e-6, b["qn"])
            gemm.gemm_bf16(b["qn"], lw["qb"], b["q"], workspace=b["ws"])
            gemm.gemm_bf16(b["q"][:, :1024], lw["o"], b["o"], workspace=b["ws"])
            layers.rms_norm(b["o"], nw, 1e-6, b["xn"], residual=b["h"])
            gemm.gemm_bf16(b["xn"], lw["router"], b["lg"], out_dtype=np.float32, workspace=b["ws"])
            gemm.gemm_bf16(b["xn"], lw["gu"], b["gu"], workspace=b["ws"])
            layers.silu_mul(b["gu"], b["a"])
            gemm.gemm_bf16(b["a"], lw["down"], b["o"], workspace=b["ws"])
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


def _row(results, bw, tf, kname, shape, nbytes, flops, us, pdl):
    gbs = nbytes / (us * 1e-6) / 1e9
    floor = max(nbytes / bw / 1e3, flops / tf / 1e6)      # us: read ceiling or mma rate, whichever binds
    results.append(dict(kernel=kname, shape=shape, us=us, bytes=nbytes, flops=flops, gbps=gbs, frac=gbs / bw,
                        floor_us=floor, frac_floor=floor / us, pdl=pdl))
    print(f"{kname:44} {shape:26} {us:8.2f} {nbytes / 1e6:8.2f} {gbs:7.0f} {gbs / bw:6.2f} {floor:7.2f} "
          f"{floor / us:6.2f}")
    sys.stdout.flush()


def _side_by_side(results, tags):
    """One line per (GEMM or chain, shape): us / fraction of the floor per tag (PDL rows only if any)."""
    pdl_any = any(r["pdl"] for r in results)
    rows = {}
    for r in results:
        if r["pdl"] != pdl_any:
            continue
        k = r["kernel"].replace(" [pdl]", "")
        tag = next((t for t in tags if t and k.endswith(t)), "")
        base = k[: len(k) - len(tag)] if tag else k
        rows.setdefault((base, r["shape"]), {})[tag] = r
    names = [t.strip(" []") or "new" for t in tags]
    print(f"\n{'us / frac of floor' + (' (PDL)' if pdl_any else ''):40} {'shape':20} "
          + " ".join(f"{n:>14}" for n in names))
    for (base, shape), d in rows.items():
        if len(d) < 2:
            continue
        cells = [f"{d[t]['us']:6.2f}/{d[t]['frac_floor']:.2f}" if t in d else "-" for t in tags]
        print(f"{base[:40]:40} {shape[:20]:20} " + " ".join(f"{c:>14}" for c in cells))


def _best_configs(results):
    """Per (GEMM, shape) of the configs part: the fastest forced config and the rule's pick."""
    best = {}
    for r in results:
        if "[dec " not in r["kernel"] and "[splitk]" not in r["kernel"] and "[wide " not in r["kernel"]:
            continue
        base = r["kernel"].replace(" [pdl]", "")
        base, cfg = base[: base.index(" [")], base[base.index(" [") + 2:-1]
        cur = best.get((base, r["shape"]))
        if cur is None or r["us"] < cur[1]:
            best[(base, r["shape"])] = (cfg, r["us"], r["frac_floor"])
    rule = {}
    for r in results:
        if "*rule*" in r["kernel"]:
            rule[(r["kernel"].replace(" [pdl]", "").split(" [")[0], r["shape"])] = r["us"]
    print(f"\n{'fastest forced config':40} {'shape':26} {'config':28} {'us':>8} {'f/floor':>7} {'rule us':>8}")
    for (base, shape), (cfg, us, ff) in best.items():
        ru = rule.get((base, shape))
        print(f"{base[:40]:40} {shape[:26]:26} {cfg:28} {us:8.2f} {ff:7.2f} "
              + (f"{ru:8.2f}" if ru is not None else f"{'-':>8}"))


def main(argv=None):
    import cupy as cp
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer row counts")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--parts", default="gemm,layers,chain",
                    help="comma list of gemm, layers, chain, sweep, configs, wideconfigs")
    ap.add_argument("--pdl", default="both", choices=("0", "1", "both"),
                    help="programmatic dependent launch off, on, or both (rows marked [pdl]; sm_90+ only)")
    ap.add_argument("--variant", default="oldnew",
                    help="GEMM kernel: 'oldnew' (the decode rule before choose_decode [old] vs the current one, same run), "
                         "'auto', or a comma list of auto, old, splitk, decode, wide, nocl (the rule without "
                         "cluster splits of the wide family)")
    ap.add_argument("--rows", help="comma list of token counts for gemm and chain (overrides --quick)")
    ap.add_argument("--shapes", help="comma list of substrings of GEMM names to keep (default: all)")
    args = ap.parse_args(argv)
    variants = ("old", "auto") if args.variant == "oldnew" else tuple(args.variant.split(","))
    from ddtree_cupy.kernels import launch
    parts = set(args.parts.split(","))
    shapes = args.shapes.split(",") if args.shapes else None
    modes = {"0": [False], "1": [True], "both": [False, True]}[args.pdl]
    if int(cp.cuda.Device().compute_capability) < 90:
        modes = [False]
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    bw = measure_read_bandwidth(4 << 30)
    tf = measure_mma_bf16_tflops()
    print(f"device: {name} (sm_{dev.compute_capability}); read ceiling {bw:.0f} GB/s; mma.sync bf16 {tf:.0f} TFLOP/s")
    g_rows = [1, 8, 16, 32, 64, 160] if not args.quick else [1, 16, 160]
    if args.rows:
        g_rows = [int(r) for r in args.rows.split(",")]
    l_rows = [1, 16, 160] if not args.quick else [1, 160]
    results = []
    print(f"{'kernel':44} {'shape':26} {'us':>8} {'MB':>8} {'GB/s':>7} {'frac':>6} {'floor':>7} {'f/fl':>6}")
    groups = [(gemm_cases, g_rows, "gemm"), (layer_cases, l_rows, "layers"), (sweep_cases, [1, 16], "sweep")]
    for cases, rows, part in groups:
        if part not in parts:
            continue
        built = cases(cp, rows, variants, shapes) if part == "gemm" else cases(cp, rows, variants)
        for pdl in (modes if part != "sweep" else modes[-1:]):
            launch.set_pdl(pdl)
            tag = " [pdl]" if pdl else ""
            for case in built:
                kname, shape, nbytes, fn = case[0], case[1], case[2], case[-1]
                flops = case[3] if len(case) == 5 else 0.0
                try:
                    us = time_graph(fn, iters=64 if part != "layers" else 20)
                except Exception as e:      # keep the table going; the error is printed in its row
                    print(f"{kname + tag:44} {shape:26} ERROR {type(e).__name__}: {str(e)[:80]}")
                    continue
                _row(results, bw, tf, kname + tag, shape, nbytes, flops, us, pdl)
        del built
        cp.get_default_memory_pool().free_all_blocks()
    for cpart in ("configs", "wideconfigs"):     # every config forced, PDL as the engine runs (where available)
        if cpart not in parts:
            continue
        launch.set_pdl(modes[-1])
        built = gemm_cases(cp, g_rows, shapes=shapes, configs=cpart == "configs", wide=cpart == "wideconfigs")
        for kname, shape, nbytes, flops, fn in built:
            try:
                us = time_graph(fn, iters=64)
            except Exception as e:
                print(f"{kname:44} {shape:26} ERROR {type(e).__name__}: {str(e)[:80]}")
                continue
            _row(results, bw, tf, kname + (" [pdl]" if modes[-1] else ""), shape, nbytes, flops, us, modes[-1])
        del built
        cp.get_default_memory_pool().free_all_blocks()
    if "chain" in parts:
        for T in g_rows:
            wbytes, fn = chain_case(cp, T)
            for v in variants:
                for pdl in modes:
                    launch.set_pdl(pdl)
                    try:
                        us = time_graph(_with_variant(v, fn), iters=4, reps=9)
                    except Exception as e:
                        print(f"chain [pdl={int(pdl)}]{_tag(v)} T={T} ERROR {type(e).__name__}: {str(e)[:80]}")
                        continue
                    _row(results, bw, tf, f"chain {CHAIN_LAYERS} layers{_tag(v)}" + (" [pdl]" if pdl else ""),
                         f"T={T} 80 kernels, 48 GEMMs", wbytes, 0.0, us, pdl)
                    print(f"{'':44} {'  per layer':26} {us / CHAIN_LAYERS:8.2f} us; weight stream alone "
                          f"{wbytes / CHAIN_LAYERS / bw / 1e3:.2f} us")
            del fn
            cp.get_default_memory_pool().free_all_blocks()
    launch.set_pdl(False)
    if parts & {"configs", "wideconfigs"}:
        _best_configs(results)
    if len(variants) >= 2:
        _side_by_side(results, [_tag(v) for v in variants])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, read_ceiling_gbps=bw, mma_bf16_tflops=tf, pdl=args.pdl, results=results),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
