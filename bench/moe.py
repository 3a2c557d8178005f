"""Benchmark of the fused INT4 MoE layer (ddtree_cupy/kernels/moe/) against the read ceiling measured in
the same run, with cuBLAS (fp16, outside graphs) on the same touched experts for comparison.

    PYTHONPATH=$PWD python -m bench.moe [--out bench/results/moe_h200.json] [--quick]
    PYTHONPATH=$PWD python -m bench.moe --focus [--prev OLD_moe_int4.cu] --out F.json   # decode sizes, variants,
                                                                  # and was -> now against another kernel file
        [--ts '256:1,8,64;2048:8'] [--variants lean1,lean2]   # a subset (sizes; variants besides "now")
    PYTHONPATH=$PWD python -m bench.moe --focus --ts '256:64,160,320;2048:64' --variants 'bulkL*'
        # the bulk-copy GEMMs fed by moe_route ("bulkL*") at T*k > 256 and their candidate blocks; --ts may name
        # T values outside the default list (uniform routing; skewed where the list has them)
    PYTHONPATH=$PWD python -m bench.moe --timeline 256 8 [--routing skewed] [--tl-out F.npz]
        # the table's bulk GEMMs at I, T through their timeline build (cycle stamps per warp and
        # stage, docs/MOE.md "Profiling build"): production vs timeline layer time and outputs in the
        # same process, then bench/moe_timeline.py's analysis of the gate/up and the down; raw buffers to F.npz

E = 384, top-8, H = 7168, I in {256 (TP8 shard), 2048 (TP1)}, T in {1..256}, routing uniform or skewed
(16 hot experts carry half the routing mass). Bytes = unique experts touched x (packed weights + scales of
one expert) + x and out (bf16). Time = CUDA-graph replay of the whole layer (the launches of the table:
gate/up (+ routing sort) and down (+ combine) at small T; route, gate/up, down, combine above). A stage
breakdown (graph time of launch prefixes) and variants (fusions off/on, prefetch settings)
are recorded at T in {1, 8, 64, 256}.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from bench.ceilings import measure_mma_bf16_tflops, measure_read_bandwidth, time_graph
from ddtree_cupy.kernels import moe

E, K_TOP, H = 384, 8, 7168
TS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

_HASH = r"""
unsigned int h = (unsigned int)i * 0x9E3779B1u ^ seed;
h ^= h >> 16; h *= 0x7feb352du; h ^= h >> 15; h *= 0x846ca68bu; h ^= h >> 16;
"""


def _hashed(shape, seed, ctype, expr, name):
    """A cupy array of ``shape`` whose element i is ``expr`` of the 32-bit hash h of (i, seed) (``ctype`` out)."""
    import cupy as cp
    k = cp.ElementwiseKernel("uint32 seed", f"{ctype} out", _HASH + f"out = {expr};", name)
    out = cp.empty(shape, dtype={"int32": cp.int32, "uint16": cp.uint16}[ctype])
    k(np.uint32(seed), out)
    return out


def _random_words(shape, seed):
    return _hashed(shape, seed, "int32", "(int)h", "moe_bench_words")


def _random_scales(shape, seed):
    # bf16 in [2^-8, 2^-6): exponent fixed range, random mantissa
    return _hashed(shape, seed, "uint16", "(unsigned short)(0x3B80u + (h & 0xFFu))", "moe_bench_scales")


def _random_half(shape, seed):
    import cupy as cp
    return _hashed(shape, seed, "uint16", "(unsigned short)(0x2000u | (h & 0x83FFu))", "moe_bench_half").view(cp.float16)


def _random_sources(I):
    """One layer's compressed-tensors experts with random contents: [(gate packed, scales), (up ...), (down ...)]."""
    return [(_random_words((E, I, H // 8), 1 + I), _random_scales((E, I, H // 32), 2 + I)),
            (_random_words((E, I, H // 8), 3 + I), _random_scales((E, I, H // 32), 4 + I)),
            (_random_words((E, H, I // 8), 5 + I), _random_scales((E, H, I // 32), 6 + I))]


def routing(rng, T, mode):
    if mode == "uniform":
        logp = np.zeros(E)
    else:
        p = np.full(E, 0.5 / (E - 16))
        p[:16] = 0.5 / 16
        logp = np.log(p)
    gumbel = -np.log(-np.log(rng.random((T, E))))
    ids = np.argsort(-(logp[None, :] + gumbel), axis=1)[:, :K_TOP].astype(np.int32)
    wts = rng.uniform(0.05, 0.5, size=(T, K_TOP)).astype(np.float32)
    return ids, wts


def _event_us(fn, reps=5):
    import cupy as cp
    fn()
    cp.cuda.Device().synchronize()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(cp.cuda.get_elapsed_time(s, e) * 1e3)
    return float(np.median(times))


def bench_width(I, read_gbs, rows, quick):
    import cupy as cp
    t0 = time.perf_counter()
    src = _random_sources(I)
    cp.cuda.Device().synchronize()
    t1 = time.perf_counter()
    w = moe.pack_moe_weights(*src[0], *src[1], *src[2])
    cp.cuda.Device().synchronize()
    repack_s = time.perf_counter() - t1
    del src
    cp.get_default_memory_pool().free_all_blocks()
    per_expert = w.expert_bytes()
    print(f"I={I}: weights generated in {t1 - t0:.2f} s, GPU repack of the layer {repack_s * 1e3:.1f} ms, "
          f"{per_expert / 1e6:.3f} MB per expert", flush=True)
    ws = moe.MoEWorkspace(max(TS), K_TOP, w)
    # cuBLAS comparison: dense fp16 weights for the touched experts (the first n experts of a pool: contents
    # do not change the time), stored [n, K, N] so cupy.matmul maps to one strided-batched GEMM.
    w13t = _random_half((E, H, 2 * I), 7)
    w2t = _random_half((E, I, H), 8)
    silu_mul = cp.ElementwiseKernel("float16 g, float16 u", "float16 h",
                                    "float gf = (float)g; h = (half)(gf / (1.f + expf(-gf)) * (float)u);",
                                    "moe_bench_silu_mul")
    rng = np.random.default_rng(I)
    for mode in ("uniform", "skewed"):
        for T in (TS if not quick else (1, 8, 64)):
            ids, wts = routing(rng, T, mode)
            x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32)).view(cp.uint32)
            x = (x >> 16).astype(cp.uint16)
            d_ids, d_wts = cp.asarray(ids), cp.asarray(wts)
            out = cp.empty((T, H), cp.uint16)
            plan = moe.moe_launch_plan(x, d_ids, d_wts, w, ws, out)

            def full():
                for _, f in plan:
                    f()
            us = time_graph(full, iters=20, reps=5)
            touched = np.unique(ids)
            nbytes = len(touched) * per_expert + 2 * T * H * 2
            gbs = nbytes / (us * 1e-6) / 1e9
            stages = {}
            if T in (1, 8, 64, 256):
                # graph time of launch prefixes (route / gate_up / down / combine, whichever the table uses)
                for n in range(1, len(plan)):
                    sub = plan[:n]
                    stages[plan[n - 1][0]] = time_graph(lambda sub=sub: [f() for _, f in sub], iters=20, reps=5)
                stages[plan[-1][0]] = us
                # variants, to attribute time to the fusions, the prefetch paths and the token-tile choice
                variants = {"pf_next_off": dict(pf_next=False), "pf_steps_0": dict(pf_steps=0)}
                if moe.fuse_route_default(T, K_TOP):     # the routing kernel and the bulk-copy GEMMs it feeds
                    variants["separate_route"] = dict(fuse_route=False, l2_prefetch=False)
                else:
                    variants["route_l2_prefetch_off"] = dict(l2_prefetch=False)
                for name, kw in variants.items():
                    vplan = moe.moe_launch_plan(x, d_ids, d_wts, w, ws, out, **kw)
                    stages["variant_" + name] = time_graph(lambda vp=vplan: [f() for _, f in vp], iters=20, reps=5)
            # cuBLAS: batched over the touched experts, each padded to the largest token count
            n = len(touched)
            m = int(max(np.sum(ids == e) for e in touched))
            xp = _random_half((n, m, H), 9)

            def cublas():
                gu = cp.matmul(xp, w13t[:n])
                h = silu_mul(gu[:, :, :I], gu[:, :, I:])
                cp.matmul(h, w2t[:n])
            cub_us = _event_us(cublas)
            cub_bytes = n * (3 * H * I * 2)
            row = dict(I=I, routing=mode, T=T, experts=int(n), max_tokens_per_expert=m, us=us, bytes=nbytes,
                       gbs=gbs, frac_read_ceiling=gbs / read_gbs, cublas_fp16_us=cub_us,
                       cublas_fp16_bytes=cub_bytes, cublas_fp16_frac=cub_bytes / (cub_us * 1e-6) / 1e9 / read_gbs,
                       speedup_vs_cublas=cub_us / us, stages_us_cumulative=stages, tiles=str(moe.select_tiles(
                           f"sm_{cp.cuda.Device().compute_capability}", T, I)))
            rows.append(row)
            print(f"I={I:5d} {mode:8s} T={T:4d} experts={n:3d} {us:9.1f} us {gbs:7.0f} GB/s "
                  f"{100 * gbs / read_gbs:5.1f}% | cuBLAS fp16 {cub_us:9.1f} us ({cub_us / us:4.1f}x)", flush=True)
    del w13t, w2t, w, ws
    cp.get_default_memory_pool().free_all_blocks()
    return repack_s


FOCUS = {256: (("uniform", (1, 2, 4, 8, 16, 32, 64, 128, 256)), ("skewed", (8, 64, 256))),
         2048: (("uniform", (1, 2, 8, 64, 256)), ("skewed", (8,)))}


def _make_layer(I):
    import cupy as cp
    src = _random_sources(I)
    w = moe.pack_moe_weights(*src[0], *src[1], *src[2])
    del src
    cp.get_default_memory_pool().free_all_blocks()
    return w


def _prev_plan(prev_src, *args, **kw):
    """moe_launch_plan with the two GEMMs taken from another kernel file (``prev_src``, e.g. the previous
    commit's cuda_src/moe_int4.cu saved with ``git show``): the same argument list, layout and workspace are
    required. Used to measure was -> now in ONE process: figures of two device runs
    differ by up to 15% at the same code (moe_h200_s3_run*.json (in git history))."""
    from ddtree_cupy.kernels import compile as kc
    rel = os.path.relpath(os.path.abspath(prev_src), str(kc.CUDA_SRC_DIR))
    with open(prev_src) as f:
        six = "int U, int S>" in f.read()      # a kernel file from before the LEAN template parameter

    def prev_name(name):   # that file runs its only k loop: drop ", lean>" from the name
        return name.rsplit(",", 1)[0] + ">" if six else name
    spec = kc.KernelSpec(src=rel, names=tuple(dict.fromkeys(prev_name(n) for n in moe._all_gemm_names())))
    orig = moe.forward.get_kernel

    def patched(sp, name, max_dynamic_smem=0):
        if name.startswith("moe_gemm"):
            return orig(spec, prev_name(name), max_dynamic_smem)
        return orig(sp, name, max_dynamic_smem)
    moe.forward.get_kernel = patched
    try:
        return moe.moe_launch_plan(*args, **kw)
    finally:
        moe.forward.get_kernel = orig


def focus_width(I, read_gbs, rows, prev_src=None, only_ts=None, only_variants=None):
    """The table ("now") against prefetch variants, the register ring's two k loops ("lean1"/"lean2": the table's
    tiles with lean = 1/2) and, with ``prev_src``, the same launches through another kernel
    file ("prev"), all in one process; stage prefixes of "now"/"lean2". ``only_ts``: the T values to
    run (None: FOCUS); ``only_variants``: the variant names to time besides "now" (None: all)."""
    import cupy as cp
    w = _make_layer(I)
    per_expert = w.expert_bytes()
    # ``only_ts`` may name T values outside FOCUS (the large-T bulk sizes 48, 80, 160, 320, ...): uniform
    # routing runs every one of them, skewed those in FOCUS's skewed list
    focus = FOCUS[I]
    if only_ts is not None:
        focus = tuple((mode, tuple(sorted(set(ts) | set(only_ts))) if mode == "uniform" else ts)
                      for mode, ts in focus)
    ws = moe.MoEWorkspace(max(t for _, ts in focus for t in ts), K_TOP, w)
    rng = np.random.default_rng(I)
    arch = f"sm_{cp.cuda.Device().compute_capability}"
    for mode, ts in focus:
        for T in ts:
            if only_ts is not None and T not in only_ts:
                continue
            ids, wts = routing(rng, T, mode)
            x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32)).view(cp.uint32)
            x = (x >> 16).astype(cp.uint16)
            d_ids, d_wts = cp.asarray(ids), cp.asarray(wts)
            out = cp.empty((T, H), cp.uint16)
            tab = moe.select_tiles(arch, T, I)
            variants = {"now": {}}
            if T * K_TOP <= moe.FUSED_MAX_PAIRS:       # the register ring and the bulk-copy GEMMs (moe_bulk.cu)
                variants.update({"lean1": dict(tiles=moe.with_lean(tab, 1)), "lean2": dict(tiles=moe.with_lean(tab, 2)),
                                 "pf_steps_0": dict(pf_steps=0), "pf_steps_4": dict(pf_steps=4),
                                 "pf_steps_16": dict(pf_steps=16), "pf_next_off": dict(pf_next=False)})
                variants["bulk"] = dict(bulk=True)
                variants["ring"] = dict(bulk=False)
                for i, t in enumerate(moe.BULK_GATEUP_CANDIDATES):
                    # the compact token-row blocks by their rows ("bulk_xr4", "bulk_xr2")
                    key = f"bulk_xr{t.xr}" if t.xr != 8 else f"bulk_gu{i}"
                    variants[key] = dict(bulk=True, bulk_tiles=(t, moe.BULK_DOWN))
                # the 8-row block named explicitly, whatever moe.tables.BULK_TILES says ("bulk" follows it)
                variants["bulk_xr8"] = dict(bulk=True, bulk_tiles=(moe.BULK_GATEUP, moe.BULK_DOWN))
                for i, t in enumerate(moe.BULK_DOWN_CANDIDATES):
                    variants[f"bulk_dn{i}"] = dict(bulk=True, bulk_tiles=(moe.BULK_GATEUP, t))
                variants["bulkG"] = dict(bulk=True, fuse_route=False)      # fed by moe_route (G = 1): its cost
            else:
                # the bulk-copy GEMMs fed by moe_route's chunk list (G = 1, the only ones there: "now"); the route's
                # L2 prefetch flipped from its rule (on from T = 64), and the large-T candidate blocks
                variants["bulkL"] = dict(bulk=True)
                variants["bulkL_pf" if T < 64 else "bulkL_nopf"] = dict(bulk=True, l2_prefetch=T < 64)
                for i, t in enumerate(moe.BULK_GATEUP_LARGE_CANDIDATES):
                    variants[f"bulkL_gu{i}"] = dict(bulk=True, bulk_tiles=(t, moe.BULK_DOWN_LARGE))
                for i, t in enumerate(moe.BULK_DOWN_LARGE_CANDIDATES):
                    variants[f"bulkL_dn{i}"] = dict(bulk=True, bulk_tiles=(moe.BULK_GATEUP_LARGE, t))
            if only_variants is not None:       # a trailing '*' selects by prefix ("bulk*")
                variants = {k: v for k, v in variants.items() if k == "now" or k in only_variants
                            or any(o.endswith("*") and k.startswith(o[:-1]) for o in only_variants)}
            plans = {name: moe.moe_launch_plan(x, d_ids, d_wts, w, ws, out, **kw) for name, kw in variants.items()}
            if prev_src:
                plans["prev"] = _prev_plan(prev_src, x, d_ids, d_wts, w, ws, out)
            res = {name: time_graph(lambda p=plan: [f() for _, f in p], iters=20, reps=5)
                   for name, plan in plans.items()}
            stage_sets = {}
            for key in [k for k in ("now", "lean2", "bulk", "bulkL") if k in plans] + \
                    [k for k in plans if k.startswith("bulk_xr")]:
                plan, st = plans[key], {}
                for n in range(1, len(plan) + 1):
                    sub = plan[:n]
                    st[plan[n - 1][0]] = time_graph(lambda sub=sub: [f() for _, f in sub], iters=20, reps=5)
                stage_sets[key] = st
            touched = np.unique(ids)
            nbytes = len(touched) * per_expert + 2 * T * H * 2
            frac = {k: nbytes / (v * 1e-6) / 1e9 / read_gbs for k, v in res.items()}
            rows.append(dict(I=I, routing=mode, T=T, experts=int(len(touched)), bytes=nbytes, us=res["now"],
                             frac_read_ceiling=frac["now"], variants_us=res, variants_frac=frac,
                             stages_us_cumulative=stage_sets["now"],
                             stages_prev_us_cumulative=stage_sets.get("prev"),
                             stages_lean2_us_cumulative=stage_sets.get("lean2"),
                             stages_bulk_us_cumulative=stage_sets.get("bulk"),
                             stages_bulkL_us_cumulative=stage_sets.get("bulkL"),
                             stages_xr_us_cumulative={k: v for k, v in stage_sets.items() if k.startswith("bulk_xr")},
                             tiles=str(tab)))
            best = min(res, key=res.get)
            print(f"I={I:5d} {mode:8s} T={T:3d} exp={len(touched):3d} now {res['now']:8.1f} us "
                  f"({100 * frac['now']:4.1f}%) best={best} {res[best]:.1f} | "
                  + " ".join(f"{k}={v:.1f}" for k, v in res.items()), flush=True)
            for key, st in stage_sets.items():
                v = list(st.values())
                print(f"    stages {key:6s} " + " ".join(
                    f"{n}={b - a:.1f}" for n, a, b in zip(st, [0.0] + v[:-1], v)), flush=True)
            if "bulk_xr8" in stage_sets:
                # the decision line (docs/MOE.md "Compact token rows"): layer and gate/up time of the
                # compact blocks against the table's block (xr8), same process, same inputs
                def gu_us(key):
                    st = stage_sets[key]
                    return st["gate_up"] - st.get("route", 0.0)
                base_l, base_g = res["bulk_xr8"], gu_us("bulk_xr8")
                touched_gu = np.unique(ids)          # the gate/up's bytes: its weights + scales of touched experts
                gu_bytes = len(touched_gu) * (w.w13.nbytes + w.s13.nbytes) // E
                print(f"    compact I={I} {mode} T={T}: " + " | ".join(
                    f"{k[5:]} layer {res[k]:.1f} us ({100 * (res[k] / base_l - 1):+.1f}%) gate/up {gu_us(k):.1f} us "
                    f"({100 * (gu_us(k) / base_g - 1):+.1f}%, {gu_bytes / (gu_us(k) * 1e-6) / 1e9 / read_gbs * 100:.0f}% "
                    f"of ceiling)" for k in sorted((k for k in stage_sets if k.startswith("bulk_xr")), reverse=True))
                      + f" [{len(touched_gu)} experts]", flush=True)
    del w, ws
    cp.get_default_memory_pool().free_all_blocks()


def focus_table(res):
    lines = ["| I | routing | T | experts | prev us | lean1 us | lean2 us | now us | % ceiling prev -> now "
             "| stages now (route/gu/dn/cb) | stages lean2 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def st(d):
        if not d:
            return "-"
        v = list(d.values())
        return "/".join(f"{b - a:.1f}" for a, b in zip([0.0] + v[:-1], v))
    for r in res["rows"]:
        vu, vf = r["variants_us"], r["variants_frac"]
        prev = f"{vu['prev']:.1f}" if "prev" in vu else "-"
        pf = f"{100 * vf['prev']:.1f} -> " if "prev" in vf else ""
        var = " | ".join(f"{vu[k]:.1f}" if k in vu else "-" for k in ("lean1", "lean2"))
        lines.append(f"| {r['I']} | {r['routing']} | {r['T']} | {r['experts']} | {prev} | {var} | {r['us']:.1f} | "
                     f"{pf}{100 * r['frac_read_ceiling']:.1f} | {st(r['stages_us_cumulative'])} | "
                     f"{st(r.get('stages_lean2_us_cumulative'))} |")
    return "\n".join(lines)


def profile(I, T, mode="uniform", calls=1):
    """A few eager calls of one configuration, for Nsight Compute (``ncu -k regex:moe_gemm ...``)."""
    import cupy as cp
    w = _make_layer(I)
    ws = moe.MoEWorkspace(T, K_TOP, w)
    rng = np.random.default_rng(I)
    ids, wts = routing(rng, T, mode)
    x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32)).view(cp.uint32)
    x = (x >> 16).astype(cp.uint16)
    for _ in range(calls):
        moe.moe_forward(x, cp.asarray(ids), cp.asarray(wts), w, ws)
    cp.cuda.Device().synchronize()
    print(f"profiled I={I} T={T} {mode}: {len(np.unique(ids))} experts, tiles {moe.select_tiles('sm_90', T, I)}")


def timeline_run(I, T, mode="uniform", out_path="bench/results/moe_timeline.npz", read_gbs=None):
    """The table's bulk-copy layer at (I, T) twice in one process: production and timeline build (graph time of
    the layer and of its gate/up prefix, outputs compared bit for bit), then one eager timeline call with poisoned
    buffers, analysed (bench/moe_timeline.py) and saved raw to ``out_path``."""
    import cupy as cp
    from bench import moe_timeline as mt
    if moe.bulk_for(T, K_TOP) is not True:
        print(f"note: the table does not run both bulk GEMMs at T = {T}; timing them anyway")
    w = _make_layer(I)
    rng = np.random.default_rng(I + 17 * T)
    ids, wts = routing(rng, T, mode)
    x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32)).view(cp.uint32)
    x = (x >> 16).astype(cp.uint16)
    d_ids, d_wts = cp.asarray(ids), cp.asarray(wts)
    glob = T * K_TOP > moe.FUSED_MAX_PAIRS
    gu, dn = moe._bulk_tiles_for(glob, None if glob else I)
    bufs = tuple(cp.full(moe.TL_BLOCKS * moe.timeline_words(bt), -1, dtype=cp.int64) for bt in (gu, dn))
    ws = moe.MoEWorkspace(T, K_TOP, w)
    outs = {k: cp.empty((T, H), cp.uint16) for k in ("prod", "timeline")}
    plans = {"prod": moe.moe_launch_plan(x, d_ids, d_wts, w, ws, outs["prod"], bulk=True, bulk_tiles=(gu, dn)),
             "timeline": moe.moe_launch_plan(x, d_ids, d_wts, w, ws, outs["timeline"], bulk=True,
                                             bulk_tiles=(gu, dn), timeline=bufs)}
    layer_us, gu_us = {}, {}
    for key, plan in plans.items():       # gate/up = the prefix up to it (a route launch first at large T)
        n_gu = [n for n, _ in plan].index("gate_up") + 1
        pre = time_graph(lambda p=plan[:n_gu - 1]: [f() for _, f in p], iters=20, reps=5) if n_gu > 1 else 0.0
        gu_us[key] = time_graph(lambda p=plan[:n_gu]: [f() for _, f in p], iters=20, reps=5) - pre
        layer_us[key] = time_graph(lambda p=plan: [f() for _, f in p], iters=20, reps=5)
    for key in ("prod", "timeline"):
        outs[key].fill(0xFFFF)
        ws.h[:, :I] = 0xFFFF
        for _, f in plans[key]:
            f()
    same = bool(cp.array_equal(outs["prod"], outs["timeline"])) and not bool((outs["prod"] == 0xFFFF).any())
    for b in bufs:                        # the recorded call: warm (the graphs above ran it), buffers poisoned
        b.fill(-1)
    for _, f in plans["timeline"]:
        f()
    cp.cuda.Device().synchronize()
    touched = np.unique(ids)
    gu_bytes = len(touched) * (w.w13.nbytes + w.s13.nbytes) // E
    ceil = f" of the {read_gbs:.0f} GB/s read ceiling" if read_gbs else ""
    frac = (lambda us: f" ({gu_bytes / (us * 1e-6) / 1e9 / read_gbs * 100:.0f}%)") if read_gbs else (lambda us: "")
    print(f"I={I} T={T} {mode}: {len(touched)} experts, gate/up {gu}, down {dn}, routing G = {int(glob)}")
    print(f"  layer: production {layer_us['prod']:.1f} us, timeline build {layer_us['timeline']:.1f} us "
          f"({100 * (layer_us['timeline'] / layer_us['prod'] - 1):+.1f}%); gate/up {gu_us['prod']:.1f}"
          f"{frac(gu_us['prod'])} -> {gu_us['timeline']:.1f} us{frac(gu_us['timeline'])}{ceil}; "
          f"outputs bit-identical: {same}")
    save = dict(I=I, T=T, ids=ids, layer_us=np.array([layer_us["prod"], layer_us["timeline"]]),
                gate_up_us=np.array([gu_us["prod"], gu_us["timeline"]]))
    for name, bt, buf in (("gate_up", gu, bufs[0]), ("down", dn, bufs[1])):
        lay = mt.Layout(bt.wm * bt.wk + 1, moe.TL_STAGES, moe.TL_UNITS, moe.TL_BLOCKS)
        raw = buf.get()
        save[f"buf_{name}"] = raw
        save[f"layout_{name}"] = np.array([lay.nw, lay.stages, lay.units, lay.blocks])
        rec = mt.parse(raw, lay)
        bad = mt.check_invariants(rec)
        print(f"== {name} {bt}: invariants {'all hold' if not bad else 'FAIL: ' + '; '.join(bad[:5])}")
        print(mt.report(mt.analyse(rec)))
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    np.savez_compressed(out_path, **save)
    print(f"raw buffers: {out_path} (python -m bench.moe_timeline {out_path})")
    return same


def markdown(res):
    lines = [f"Device: {res['device']}; read ceiling {res['read_ceiling_gbs']:.0f} GB/s, mma.sync bf16 "
             f"{res['mma_bf16_tflops']:.0f} TFLOP/s (same run).", "",
             "| I | routing | T | experts | time us | GB/s | % of read ceiling | cuBLAS fp16 us | MoE speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['I']} | {r['routing']} | {r['T']} | {r['experts']} | {r['us']:.1f} | {r['gbs']:.0f} | "
                     f"{100 * r['frac_read_ceiling']:.1f} | {r['cublas_fp16_us']:.1f} | {r['speedup_vs_cublas']:.1f}x |")
    return "\n".join(lines)


def plot_svg(res, path):
    """% of the read ceiling vs T, one line per (I, routing), as a dependency-free SVG (matplotlib is not
    installed everywhere this runs)."""
    import math
    W, Hh, L, B, R, Tp = 640, 360, 60, 40, 150, 20
    xs = lambda T: L + (W - L - R) * math.log2(T) / math.log2(max(TS))
    ys = lambda f: Tp + (Hh - Tp - B) * (1 - f)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{Hh}" font-family="sans-serif" '
           f'font-size="11"><rect width="{W}" height="{Hh}" fill="white"/>']
    for f in (0, 0.2, 0.4, 0.6, 0.8, 1.0):
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{ys(f):.1f}" y2="{ys(f):.1f}" stroke="#ddd"/>'
                   f'<text x="{L - 6}" y="{ys(f) + 4:.1f}" text-anchor="end">{int(f * 100)}%</text>')
    for T in TS:
        out.append(f'<text x="{xs(T):.1f}" y="{Hh - B + 16}" text-anchor="middle">{T}</text>')
    out.append(f'<text x="{(L + W - R) / 2}" y="{Hh - 6}" text-anchor="middle">tokens T (E=384, top-8, H=7168)</text>')
    out.append(f'<text x="{L}" y="14">fused INT4 MoE: fraction of the read ceiling ({res["read_ceiling_gbs"]:.0f} GB/s, '
               f'{res["device"]})</text>')
    colors = {(256, "uniform"): "#1f77b4", (256, "skewed"): "#9ecae1", (2048, "uniform"): "#d62728",
              (2048, "skewed"): "#fc9272"}
    for i, (key, col) in enumerate(colors.items()):
        pts = [(r["T"], r["frac_read_ceiling"]) for r in res["rows"] if (r["I"], r["routing"]) == key]
        if not pts:
            continue
        d = " ".join(f"{xs(T):.1f},{ys(f):.1f}" for T, f in pts)
        out.append(f'<polyline points="{d}" fill="none" stroke="{col}" stroke-width="2"/>')
        y = Tp + 20 + 18 * i
        out.append(f'<line x1="{W - R + 10}" x2="{W - R + 30}" y1="{y}" y2="{y}" stroke="{col}" stroke-width="2"/>'
                   f'<text x="{W - R + 35}" y="{y + 4}">I={key[0]} {key[1]}</text>')
    for f, lab in ((0.8, "target T>=8"), (0.6, "target T=1")):
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{ys(f):.1f}" y2="{ys(f):.1f}" stroke="#888" '
                   f'stroke-dasharray="4,3"/><text x="{W - R - 4}" y="{ys(f) - 3:.1f}" text-anchor="end" '
                   f'fill="#666">{lab}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/moe_bench.json")
    ap.add_argument("--md", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--widths", default="256,2048", metavar="I,..",
                    help="expert widths of the table (256: the TP8 shard, ~6 GB of GPU memory; 2048: TP1, ~45 GB "
                         "with the cuBLAS fp16 comparison weights)")
    ap.add_argument("--focus", action="store_true", help="the table against its variants at the decode sizes")
    ap.add_argument("--prev", default=None, metavar="FILE.cu",
                    help="with --focus: also time the GEMMs of this kernel file (same arguments) in the same process")
    ap.add_argument("--ts", default=None, metavar="I:T,T[;I:T,..]",
                    help="with --focus: only these widths and T values, e.g. '256:1,8,64;2048:8'")
    ap.add_argument("--variants", default=None, metavar="NAME,..",
                    help="with --focus: only these variants besides 'now' (e.g. 'lean1'; '' for none)")
    ap.add_argument("--plot", nargs=2, metavar=("JSON", "SVG"), help="only draw the SVG from a result file")
    ap.add_argument("--profile", nargs="+", metavar="I T", help="only run I T [I T ...] a few times (for ncu)")
    ap.add_argument("--timeline", nargs=2, type=int, metavar=("I", "T"),
                    help="only the timeline build of the table's bulk GEMMs at I, T, analysed (bench/moe_timeline.py)")
    ap.add_argument("--routing", default="uniform", choices=("uniform", "skewed"), help="with --timeline")
    ap.add_argument("--tl-out", default="bench/results/moe_timeline.npz", help="with --timeline: the raw buffers")
    args = ap.parse_args()
    if args.timeline:
        read_gbs = measure_read_bandwidth()
        ok = timeline_run(*args.timeline, mode=args.routing, out_path=args.tl_out, read_gbs=read_gbs)
        print(f"read ceiling {read_gbs:.0f} GB/s (same run)")
        if not ok:
            raise SystemExit("timeline build: outputs differ from the production build")
        return
    if args.profile:
        vals = [int(v) for v in args.profile]
        for I, T in zip(vals[0::2], vals[1::2]):
            profile(I, T)
        return
    if args.plot:
        with open(args.plot[0]) as f:
            plot_svg(json.load(f), args.plot[1])
        return
    import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    device = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    read_gbs = measure_read_bandwidth()
    mma = measure_mma_bf16_tflops()
    print(f"{device}: read ceiling {read_gbs:.0f} GB/s, mma.sync bf16 {mma:.0f} TFLOP/s", flush=True)
    if args.focus:
        rows = []
        res = dict(device=device, read_ceiling_gbs=read_gbs, mma_bf16_tflops=mma, rows=rows)
        widths = {256: None, 2048: None}
        if args.ts:
            widths = {}
            for part in args.ts.split(";"):
                i, ts = part.split(":")
                widths[int(i)] = {int(t) for t in ts.split(",")}
        only_v = None if args.variants is None else {v for v in args.variants.split(",") if v}
        for I, only_ts in widths.items():
            focus_width(I, read_gbs, rows, args.prev, only_ts, only_v)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        res["read_ceiling_after_gbs"] = measure_read_bandwidth()
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"read ceiling {read_gbs:.0f} GB/s (after: {res['read_ceiling_after_gbs']:.0f})")
        print(focus_table(res))
        return
    rows = []
    repack = {}
    res = dict(device=device, arch=f"sm_{cp.cuda.Device().compute_capability}", read_ceiling_gbs=read_gbs,
               read_ceiling_after_gbs=None, mma_bf16_tflops=mma, E=E, top_k=K_TOP, H=H,
               repack_layer_s=repack, rows=rows)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    widths = [int(v) for v in args.widths.split(",") if v]
    if not widths or any(i not in (256, 2048) for i in widths):
        raise SystemExit(f"--widths: choose from 256, 2048 (got {args.widths!r})")
    for I in widths:
        repack[I] = bench_width(I, read_gbs, rows, args.quick)
        with open(args.out, "w") as f:          # after each width: a time limit still leaves the first
            json.dump(res, f, indent=1)
    res["read_ceiling_after_gbs"] = measure_read_bandwidth()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
