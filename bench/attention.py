"""Benchmark: absorbed MLA tree-verify attention (8 local heads) vs the measured ceilings of the same run.

    PYTHONPATH=$PWD python3 bench/attention.py [--out bench/results/attention_h200.json] [--quick] [--probe]
                                               [--compare] [--was OLD.json] [--policy auto|measured|model|both]
                                               [--partial fp32|bf16|both]
    python3 bench/attention.py --svg-from bench/results/attention_h200.json   # redraw the plot only
    python3 bench/attention.py --refit bench/results/attention_h200.json [more.json]   # CPU: refit the model

For streams x tree rows x context: time per call (CUDA-graph replay), bytes (latent KV read once + q +
o_lat), FLOPs (2 x (576 + 512) per visible (row, head, key)), the floor max(bytes / read ceiling,
FLOPs / mma.sync bf16 rate) with both ceilings measured here, the ratio to the floor, and the same rows
as a chain (causal) at the same prefix, the earlier results' time ("was", default: the committed JSON) and
the launch floor (empty kernels replayed from a graph: 1 kernel per call without a split, 2 with one); the
column "r_lf" is the time over max(floor, launch floor), which separates what the hardware forbids (launch
and bytes / FLOPs) from what the kernel loses. --compare also times, at the same split count, the deeper
pipeline twin of a planned 16-row mla_attn_ksplit tile (DEEP_TWIN: 3 <-> 5 stages), the ks32 tile where
plan_mla picks an mla_attn_fwd tile, and the combine with one split per warp in flight (the combine rule);
--probe times every tile config, split counts around the plan and builds without one phase. --set decode keeps the engine's decode-step shapes
(1/4/10 streams x 1-32 rows at 4K, 1 stream x 1-8 rows at 32K-256K). Also the DFlash drafter attention
(8 q heads / 1 kv head).
--policy picks the planner policy (plan_mla(policy=...); default auto, as the engine); "both" times the "measured" (was) and the "model"
(now) plan of every shape in the same run (once where both policies plan the same), plus a few 64-head
(TP1) shapes, prints was -> now, the modelled times and the ratio to the floor, and a summary (median
speed-up, worst case, per row bucket); it skips the chain timings and the drafter to stay near a minute.
--partial both times fp32 against bf16 split partials (each with its own plan) at the engine's decode shapes in
the same run, without and with PDL, and prints the decision of docs/history/2026-11-29-attention.md
"bf16 split partials" (~15 s);
--partial fp32 / bf16 runs every other mode with that dtype (default: the rule, DDT_MLA_PARTIAL_BF16).
Prints tables; never asserts a speed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.ceilings import measure_mma_bf16_tflops, measure_read_bandwidth, time_graph  # noqa: E402

H = 8
SCALE = 0.14467963
# planned tile -> the same rows with another pipeline depth (timed at the same split count by --compare)
DEEP_TWIN = {"ks16_5stage": ("ks16",), "ks16": ("ks16_5stage",)}


def random_bf16(cp, shape, scale=1.0):
    x = cp.random.standard_normal(shape, dtype=cp.float32) * scale
    return (x.view(cp.uint32) >> 16).astype(cp.uint16)


def tree_mask(rng, n):
    from ddtree_cupy.reference.attention import ancestor_mask_bits
    par = np.array([-1] + [int(rng.integers(max(0, i - 8), i)) for i in range(1, n)])  # bushy but deep-ish
    bits = ancestor_mask_bits(par, 129)
    vis = int(sum(bin(int(w)).count("1") for w in bits[:n].ravel()))
    return bits, vis


def launch_floor(cp):
    """Per-call time of a graph of empty kernels (1 and 2 launches per call): the fixed cost any
    attention call pays before it reads a byte."""
    k = cp.RawKernel(r'extern "C" __global__ void ddt_nop(int x) { if (x == 12345) __trap(); }', "ddt_nop")

    def one_k():
        k((132,), (256,), (np.int32(0),))

    def two_k():
        k((132,), (256,), (np.int32(0),))
        k((132,), (256,), (np.int32(0),))
    return time_graph(one_k, iters=50, reps=5), time_graph(two_k, iters=50, reps=5)


def write_svg(summary: dict, path: str) -> None:
    """Measured time per call (solid) and the floor (dashed) against context, log-log, as a plain SVG
    (no plotting library needed)."""
    import math
    series = [(1, 1), (1, 16), (4, 16), (10, 16), (10, 64)]
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    mla = [r for r in summary["mla"] if r.get("heads", 8) == 8]
    ctxs = sorted({r["ctx"] for r in mla if r["ctx"] <= 65536})
    pts = {k: sorted((r["ctx"], r["us"], r["floor_us"]) for r in mla
                     if (r["streams"], r["rows"]) == k and r["ctx"] <= 65536) for k in series}
    ys = [v for p in pts.values() for _, a, b in p for v in (a, b)]
    y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    W, Hh, L, B, R, T = 640, 420, 70, 50, 150, 30
    X = lambda c: L + (math.log2(c) - math.log2(ctxs[0])) / (math.log2(ctxs[-1]) - math.log2(ctxs[0])) * (W - L - R)
    Y = lambda v: Hh - B - (math.log10(v) - y0) / (y1 - y0) * (Hh - B - T)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{Hh}" font-family="sans-serif" '
           f'font-size="12"><rect width="{W}" height="{Hh}" fill="white"/>',
           f'<text x="{L}" y="18">MLA tree verify, 8 heads, {summary["device"]}: time per call (solid) vs floor '
           f'(dashed)</text>']
    for e in range(y0, y1 + 1):
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{Y(10 ** e):.1f}" y2="{Y(10 ** e):.1f}" stroke="#ddd"/>'
                   f'<text x="{L - 8}" y="{Y(10 ** e) + 4:.1f}" text-anchor="end">{10 ** e:g} us</text>')
    for c in ctxs:
        out.append(f'<text x="{X(c):.1f}" y="{Hh - B + 18}" text-anchor="middle">{c // 1024}K</text>')
    out.append(f'<text x="{(L + W - R) / 2}" y="{Hh - 10}" text-anchor="middle">context (tokens)</text>')
    for (k, p), col in zip(pts.items(), colors):
        meas = " ".join(f"{X(c):.1f},{Y(u):.1f}" for c, u, _ in p)
        flo = " ".join(f"{X(c):.1f},{Y(f):.1f}" for c, _, f in p)
        out.append(f'<polyline points="{meas}" fill="none" stroke="{col}" stroke-width="2"/>')
        out.append(f'<polyline points="{flo}" fill="none" stroke="{col}" stroke-width="1.5" stroke-dasharray="5,4"/>')
        i = series.index(k)
        out.append(f'<line x1="{W - R + 10}" x2="{W - R + 35}" y1="{T + 20 + 18 * i}" y2="{T + 20 + 18 * i}" '
                   f'stroke="{col}" stroke-width="2"/><text x="{W - R + 40}" y="{T + 24 + 18 * i}">'
                   f'{k[0]} x {k[1]} rows</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


TP1_CASES = ((1, 1, 4096), (1, 8, 4096), (1, 65, 4096), (1, 1, 32768), (1, 8, 32768), (4, 8, 4096))


def policy_both(one, cases, results, args, was):
    """Time the "measured" (was) and "model" (now) plans of every case in the same run; a shape both
    policies plan alike is timed once (ratio 1 by construction). Adds the 64-head (TP1) shapes."""
    from ddtree_cupy.kernels import attention as A
    print(f"{'S':>3} {'rows':>4} {'H':>3} {'ctx':>7} | {'measured (was)':>24} | {'model (now)':>24} | "
          f"{'now/was':>7} {'floor':>7} {'was/fl':>6} {'now/fl':>6} | {'pred was':>8} {'pred now':>8}")
    all_cases = [(S, n, c, 8) for S, n, c in cases] + [(S, n, c, 64) for S, n, c in (TP1_CASES if not args.quick
                                                                                       else TP1_CASES[:2])]
    for S, n, c, heads in all_cases:
        plans = {p: A.plan_mla(S, n, heads, c + n, policy=p) for p in A.MLA_POLICIES}
        r = one(S, n, c, "tree", policy="measured", heads=heads)
        m = r if plans["model"] == plans["measured"] else one(S, n, c, "tree", policy="model", heads=heads)
        r.update(chain_us=r["us"], tree_over_chain=1.0, was_us=was.get((S, n, c)) if heads == 8 else None,
                 model_us=m["us"], model_config=m["config"], model_splits=m["splits"], model_pred_us=m["pred_us"],
                 same_plan=m is r, speedup=r["us"] / m["us"])
        r["meets_target"] = bool(min(r["us"], m["us"]) <= max(1.3 * r["floor_us"], 8.0))
        results.append(r)
        cfg_s = lambda x: f"{x['config'][4:].replace('attn_', ''):>15} {x['splits']:>3} {x['us']:>5.0f}" \
            if x["us"] >= 1000 else f"{x['config'][4:].replace('attn_', ''):>15} {x['splits']:>3} {x['us']:>5.1f}"
        pw = f"{r['pred_us']:>8.1f}" if r["pred_us"] is not None else f"{'-':>8}"
        pn = f"{m['pred_us']:>8.1f}" if m["pred_us"] is not None else f"{'-':>8}"
        print(f"{S:>3} {n:>4} {heads:>3} {c:>7} | {cfg_s(r)} | {cfg_s(m) if m is not r else 'same plan':>24} | "
              f"{m['us'] / r['us']:>7.2f} {r['floor_us']:>7.1f} {r['ratio']:>6.2f} {m['ratio']:>6.2f} | "
              f"{pw} {pn}", flush=True)


# --partial both: the engine's decode shapes (streams x tree rows @ context), 8 heads
PARTIAL_SHAPES = ((1, 8, 4096), (1, 16, 4096), (1, 32, 4096), (4, 8, 4096), (4, 16, 4096), (4, 32, 4096),
                  (10, 8, 4096), (10, 16, 4096), (10, 32, 4096), (1, 8, 32768))
PARTIAL_KEY_SHAPES = ((1, 8, 4096), (4, 8, 4096))   # the decision rule's "must win by >= 2%" shapes


def partial_both(one, results, args, bw, num_sms):
    """fp32 vs bf16 split partials, each with its own plan (what flipping the default does), in the same run:
    per shape fp32, bf16, fp32, bf16 (the minimum of the two timings each, so drift hits both), without and
    with PDL (the engine's launch mode at these sizes); where the bf16 pricing re-plans, also bf16 at the fp32
    plan (the dtype alone); where the combine rule picks one split per warp in flight (U = 1, > 2 blocks per SM),
    also bf16 with U = 4 (its bf16 build needs 72 registers, not fp32's 124: the rule may move for bf16; not part of
    the decision)."""
    from ddtree_cupy.kernels import attention as A
    print(f"# split partials fp32 vs bf16 (each its own plan), min of 2 alternating timings, us per call; "
          f"read ceiling {bw:.0f} GB/s (this run)")
    print(f"{'S':>3} {'rows':>4} {'ctx':>6} | {'plan fp32':>21} {'plan bf16':>21} | {'MB fp32':>7} {'bf16':>5} | "
          f"{'fp32':>7} {'bf16':>7} {'ratio':>6} | {'pdl fp32':>8} {'bf16':>7} {'ratio':>6} | {'floor':>6} | "
          f"{'model fp32':>10} {'bf16':>6} | note")
    short = lambda r: f"{r['config'][4:].replace('attn_', '')} x{r['splits']}"
    for S, n, c in PARTIAL_SHAPES:
        row = {}
        for pdl in (False, True):
            for rep in range(2):
                for pb in (False, True):
                    r = one(S, n, c, "tree", part=pb, pdl=pdl)
                    k = (pb, pdl)
                    if k not in row or r["us"] < row[k]["us"]:
                        row[k] = dict(r, us_reps=row.get(k, {}).get("us_reps", []) + [r["us"]])
                    else:
                        row[k]["us_reps"].append(r["us"])
        f32, b16, pf32, pb16 = row[(False, False)], row[(True, False)], row[(False, True)], row[(True, True)]
        note = ""
        rec = dict(streams=S, rows=n, ctx=c, heads=H, fp32=f32, bf16=b16, pdl_fp32=pf32, pdl_bf16=pb16,
                   ratio=b16["us"] / f32["us"], pdl_ratio=pb16["us"] / pf32["us"], floor_us=f32["floor_us"],
                   same_plan=(f32["config"], f32["splits"]) == (b16["config"], b16["splits"]))
        if not rec["same_plan"]:   # the dtype alone, at the fp32 plan
            cfg32 = A.MLA_CONFIGS[f32["config_key"]]
            alone = min(one(S, n, c, "tree", part=True, pdl=True, config=cfg32, splits_override=f32["splits"])["us"]
                        for _ in range(2))
            rec["pdl_bf16_at_fp32_plan_us"] = alone
            note = f"re-planned; bf16 at the fp32 plan (pdl) {alone:.1f} ({alone / pf32['us']:.3f})"
        if b16["splits"] > 1 and A.combine_unroll(S * n * H, num_sms) == 1:
            cfg16 = A.MLA_CONFIGS[b16["config_key"]]
            u4 = min(one(S, n, c, "tree", part=True, pdl=True, config=cfg16, splits_override=b16["splits"],
                         unroll=4)["us"] for _ in range(2))
            rec["pdl_bf16_u4_us"] = u4
            note += f"{'; ' if note else ''}bf16 U=4 (pdl) {u4:.1f} ({u4 / pb16['us']:.3f} of U=1)"
        results.append(rec)
        print(f"{S:>3} {n:>4} {c:>6} | {short(f32):>21} {short(b16):>21} | {f32['partial_mb']:>7.1f} "
              f"{b16['partial_mb']:>5.1f} | {f32['us']:>7.2f} {b16['us']:>7.2f} {rec['ratio']:>6.3f} | "
              f"{pf32['us']:>8.2f} {pb16['us']:>7.2f} {rec['pdl_ratio']:>6.3f} | {f32['floor_us']:>6.2f} | "
              f"{f32['pred_us'] or float('nan'):>10.1f} {b16['pred_us'] or float('nan'):>6.1f} | {note}", flush=True)


def partial_decision(results):
    """docs/history/2026-11-29-attention.md "bf16 split partials" decision rule: flip PARTIAL_BF16 to True iff
    bf16 is >= 2% faster (ratio <= 0.98) at 1 x 8 and 4 x 8 @ 4K and no decode shape is > 1% slower (ratio >
    1.01), in both columns (without and with PDL)."""
    rs = [r for r in results if "pdl_ratio" in r]
    key = [r for r in rs if (r["streams"], r["rows"], r["ctx"]) in PARTIAL_KEY_SHAPES]
    wins = all(r["ratio"] <= 0.98 and r["pdl_ratio"] <= 0.98 for r in key) and len(key) == len(PARTIAL_KEY_SHAPES)
    worst = max(rs, key=lambda r: max(r["ratio"], r["pdl_ratio"]))
    no_loss = max(worst["ratio"], worst["pdl_ratio"]) <= 1.01
    out = dict(flip=bool(wins and no_loss), key_shapes_win=bool(wins), no_shape_slower=bool(no_loss),
               worst_ratio=max(worst["ratio"], worst["pdl_ratio"]),
               worst_shape=[worst["streams"], worst["rows"], worst["ctx"]],
               median_ratio=float(np.median([r["ratio"] for r in rs])),
               median_pdl_ratio=float(np.median([r["pdl_ratio"] for r in rs])))
    print(f"\n# PARTIAL DECISION: {'FLIP PARTIAL_BF16 = True' if out['flip'] else 'keep fp32 (PARTIAL_BF16 = False)'}"
          f" -- 1 x 8 and 4 x 8 >= 2% faster: {out['key_shapes_win']}; no shape > 1% slower: {out['no_shape_slower']}"
          f" (worst {out['worst_ratio']:.3f} at {' x '.join(map(str, out['worst_shape']))}); median bf16/fp32 "
          f"{out['median_ratio']:.3f} (pdl {out['median_pdl_ratio']:.3f})")
    return out


def policy_summary(results):
    """Median / worst now/was over all shapes and per row bucket (decode, 2-16 rows, 17-65 rows), for the
    model policy as run and as it would plan with a stricter margin: the model's best plan does not depend
    on MLA_MODEL_MARGIN (only whether it replaces the measured plan: modelled now <= margin x modelled was),
    so both timings of this run answer that without another run."""
    def pick(r, margin):
        if margin is None or r["same_plan"] or r["pred_us"] is None or r["model_pred_us"] is None:
            return r["model_us"]
        return r["model_us"] if r["model_pred_us"] <= margin * r["pred_us"] else r["us"]

    def stats(rs, margin=None):
        if not rs:
            return None
        q = np.array([pick(r, margin) / r["us"] for r in rs])
        w = int(q.argmax())
        return dict(n=len(rs), median_now_over_was=float(np.median(q)), best=float(q.min()), worst=float(q.max()),
                    worst_shape=[rs[w]["streams"], rs[w]["rows"], rs[w]["heads"], rs[w]["ctx"]],
                    slower_5pct=int((q > 1.05).sum()), faster_5pct=int((q < 0.95).sum()),
                    changed=int(sum(pick(r, margin) is not r["us"] for r in rs)))
    buckets = {"all": results, "rows=1": [r for r in results if r["rows"] == 1],
               "rows 2-16": [r for r in results if 2 <= r["rows"] <= 16],
               "rows 17-65": [r for r in results if r["rows"] > 16]}
    out = {k: stats(v) for k, v in buckets.items()}
    for m in (0.8, 0.7):
        out[f"all, margin {m}"] = stats(results, m)
    return out


def print_policy_summary(ps):
    print("\n# planner policies, now = model / was = measured (time ratio < 1: model faster); 'margin m': the model "
          "plan only where it models <= m x the measured plan's time (as run: MLA_MODEL_MARGIN)")
    for k, s in ps.items():
        if s:
            print(f"  {k:>15}: {s['n']:>3} shapes, {s['changed']:>3} re-planned, median now/was "
                  f"{s['median_now_over_was']:.3f}, best {s['best']:.2f}, worst {s['worst']:.2f} at S x rows x H x ctx "
                  f"= {' x '.join(map(str, s['worst_shape']))}; {s['faster_5pct']} faster / {s['slower_5pct']} "
                  f"slower by > 5%")
    a = ps["all"]
    print(f"# POLICY SUMMARY: median speed-up {1 / a['median_now_over_was']:.3f}x, worst case {a['worst']:.2f}x the "
          f"measured time ({' x '.join(map(str, a['worst_shape']))}), {a['slower_5pct']} of {a['n']} shapes > 5% "
          f"slower")


def fit_points(summary: dict):
    """(config key, streams, rows, heads, kv_len, splits, us) of every timed plan in a results JSON: the
    planned configs, --compare's ks32, --policy both's model plans, the probe's split sweeps."""
    from ddtree_cupy.kernels import attention as A
    key_of = {c.name: k for k, c in A.MLA_CONFIGS.items()}
    pts = []
    for r in summary["mla"]:
        S, n, h, L = r["streams"], r["rows"], r.get("heads", H), r["ctx"] + r["rows"]
        pts.append((key_of[r["config"]], S, n, h, L, r["splits"], r["us"]))
        if r.get("ks32_us"):
            pts.append(("ks32", S, n, h, L, r["ks32_splits"], r["ks32_us"]))
        if r.get("model_us") and not r.get("same_plan"):
            pts.append((key_of[r["model_config"]], S, n, h, L, r["model_splits"], r["model_us"]))
    for p in summary.get("probe", []):
        key = p.get("auto", "ks16" if p["rows"] == 1 else "ks32")
        for k, v in p.items():
            if k.startswith("splits"):
                pts.append((key, p["streams"], p["rows"], H, p["ctx"] + p["rows"], int(k[6:]), v))
    return [p for p in pts if p[0] in A.MLA_TILE_US]


def refit(paths):
    """Least squares on log time of the cost model's constants (per-config tile times of the configs with
    points, block, combine and DRAM terms) to the timed plans of the given results; prints the constants
    and the fit error. Host only (needs scipy)."""
    from scipy.optimize import minimize
    from ddtree_cupy.kernels import attention as A
    pts = []
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        sms = d.get("num_sms", 132)
        pts += [p + (sms,) for p in fit_points(d)]
    keys = sorted({p[0] for p in pts})
    names = [f"MLA_TILE_US[{k}]" for k in keys] + ["MLA_BLOCK_US", "MLA_COMBINE_US", "MLA_COMBINE_US_PER_ROW_SPLIT",
                                                   "MLA_DRAM_GBPS"]
    saved = (dict(A.MLA_TILE_US), A.MLA_BLOCK_US, A.MLA_COMBINE_US, A.MLA_COMBINE_US_PER_ROW_SPLIT, A.MLA_DRAM_GBPS)
    scale = np.array([1.0] * len(keys) + [1.0, 1.0, 1e-3, 1e3])

    def apply(x):
        v = x * scale
        for k, t in zip(keys, v):
            A.MLA_TILE_US[k] = float(t)
        A.MLA_BLOCK_US, A.MLA_COMBINE_US, A.MLA_COMBINE_US_PER_ROW_SPLIT, A.MLA_DRAM_GBPS = map(float, v[len(keys):])

    def logerr(x):
        apply(x)
        # resident blocks as on the H200 (233472 B per SM): the results JSONs do not record the device smem
        return np.array([np.log(A.mla_cost_us(k, sp, S, n, h, L, sms, A._blocks_per_sm(A.MLA_CONFIGS[k], 233472))
                                / us) for k, S, n, h, L, sp, us, sms in pts])

    x0 = np.array([saved[0][k] for k in keys] + [saved[1], saved[2], saved[3] * 1e3, saved[4] * 1e-3])
    try:
        loss = lambda x: float((logerr(x) ** 2).sum()) if (x > 0).all() else 1e9
        e0 = logerr(x0)
        res = x0
        for _ in range(3):
            res = minimize(loss, res, method="Nelder-Mead", options=dict(maxiter=20000, xatol=1e-5, fatol=1e-8)).x
        e1 = logerr(res)
    finally:
        A.MLA_TILE_US.clear()
        A.MLA_TILE_US.update(saved[0])
        A.MLA_BLOCK_US, A.MLA_COMBINE_US, A.MLA_COMBINE_US_PER_ROW_SPLIT, A.MLA_DRAM_GBPS = saved[1:]
    print(f"# {len(pts)} timed plans; rms log error {np.sqrt((e0 ** 2).mean()):.3f} with the committed constants, "
          f"{np.sqrt((e1 ** 2).mean()):.3f} refitted (worst {np.exp(e1).min():.2f}x / {np.exp(e1).max():.2f}x)")
    for nm, a, b in zip(names, x0 * scale, res * scale):
        print(f"  {nm:>32}: {a:10.4g} -> {b:10.4g}")


def refit_combine(paths):
    """Least squares on log time of the combine terms only (MLA_COMBINE_US, MLA_COMBINE_US_PER_ROW_SPLIT), the
    tile / block / DRAM constants kept: for results whose plans all split (the H200 runs of the fixed-cost work), where a full
    refit trades the block and combine fixed costs against each other. Prints the constants, the fit error and
    the shapes of the benchmark grid whose "model" plan (H200) would change. Host only (needs scipy)."""
    from scipy.optimize import minimize
    from ddtree_cupy.kernels import attention as A
    pts = []
    for path in paths:
        with open(path) as f:
            pts += fit_points(json.load(f))
    h200 = (132, 232448, 233472)
    saved = (A.MLA_COMBINE_US, A.MLA_COMBINE_US_PER_ROW_SPLIT)

    def logerr(c0, c1):
        A.MLA_COMBINE_US, A.MLA_COMBINE_US_PER_ROW_SPLIT = c0, c1
        return np.array([np.log(A.mla_cost_us(k, sp, S, n, h, L, h200[0], A._blocks_per_sm(A.MLA_CONFIGS[k], h200[2]))
                                / us) for k, S, n, h, L, sp, us in pts])

    def plans():
        A.plan_mla_for.cache_clear()
        grid = [(S, n, c) for c in (1024, 4096, 32768, 65536) for S in (1, 4, 10) for n in (1, 8, 16, 32, 64)]
        return {(S, n, c): A.plan_mla_for(S, n, H, c + n, "model", *h200) for S, n, c in grid}
    try:
        before = plans()
        e0 = logerr(*saved)
        x = minimize(lambda v: float((logerr(v[0], v[1] * 1e-3) ** 2).sum()) if (v >= 0).all() else 1e9,
                     [saved[0], saved[1] * 1e3], method="Nelder-Mead").x
        e1 = logerr(x[0], x[1] * 1e-3)
        after = plans()
    finally:
        A.MLA_COMBINE_US, A.MLA_COMBINE_US_PER_ROW_SPLIT = saved
        A.plan_mla_for.cache_clear()
    print(f"# {len(pts)} timed plans; rms log error {np.sqrt((e0 ** 2).mean()):.3f} -> {np.sqrt((e1 ** 2).mean()):.3f} "
          f"(worst {np.exp(e1).min():.2f}x / {np.exp(e1).max():.2f}x)")
    print(f"  MLA_COMBINE_US {saved[0]:.3g} -> {x[0]:.3g}, MLA_COMBINE_US_PER_ROW_SPLIT {saved[1]:.3g} -> {x[1] * 1e-3:.3g}")
    for k in before:
        if before[k] != after[k]:
            print(f"  re-planned {k}: {before[k][0].name} x{before[k][1]} -> {after[k][0].name} x{after[k][1]}")


def _save(path: str, summary: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--svg-from", default=None, help="only draw the SVG plot of an existing results JSON")
    ap.add_argument("--svg", default=None, help="where to write the SVG plot")
    ap.add_argument("--refit", nargs="+", default=None, help="refit the planner's cost model to results JSONs")
    ap.add_argument("--refit-combine", nargs="+", default=None,
                    help="refit only the cost model's combine terms to results JSONs (CPU) and list re-planned shapes")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--set", choices=("grid", "decode"), default="grid",
                    help="grid: the original shapes; decode: the engine's decode-step shapes only")
    ap.add_argument("--probe", action="store_true", help="also time every tile config and phase-less builds")
    ap.add_argument("--sweep", action="store_true",
                    help="also time the planned tile of the engine's decode shapes at several split counts, and "
                         "1 x 1 / 1 x 8 at 4K without one phase (fixed-cost breakdown; planner refit points)")
    ap.add_argument("--compare", action="store_true",
                    help="also time the cases planned with mla_attn_fwd tiles with the opt-in ks32 tile")
    ap.add_argument("--policy", choices=("auto", "measured", "model", "both"), default="auto",
                    help="planner policy (auto: the engine's default, kernels/attention.py resolve_policy); "
                         "both: time the measured and the model plan of every shape")
    ap.add_argument("--partial", choices=("fp32", "bf16", "both"), default=None,
                    help="split-partial dtype (default: the rule, kernels/attention.py mla_partial_bf16); both: time "
                         "fp32 vs bf16 partials at the engine's decode shapes in the same run, with and without "
                         "PDL, and apply the decision rule of docs/history/2026-11-29-attention.md "
                         "'bf16 split partials'")
    ap.add_argument("--was", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "attention_h200.json"),
                    help="earlier results JSON for the was -> now column")
    args = ap.parse_args()
    if args.refit:
        refit(args.refit)
        return
    if args.refit_combine:
        refit_combine(args.refit_combine)
        return
    if args.svg_from:
        with open(args.svg_from) as f:
            write_svg(json.load(f), args.svg or os.path.splitext(args.svg_from)[0] + ".svg")
        return
    import cupy as cp
    from ddtree_cupy.kernels import attention as A

    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    num_sms = dev.attributes["MultiProcessorCount"]
    t_start = time.time()
    bw = measure_read_bandwidth(2 << 30, reps=9)          # GB/s
    tflops = measure_mma_bf16_tflops()
    print(f"# {name}: read ceiling {bw:.0f} GB/s, mma.sync bf16 {tflops:.0f} TFLOP/s, {num_sms} SMs")
    print("# tile configs (plan_mla picks per shape): " +
          ", ".join(f"{k} {c.name} {c.smem} B" for k, c in A.MLA_CONFIGS.items()))
    launch = launch_floor(cp)
    print(f"# launch floor (graph replay of empty kernels): 1 kernel {launch[0]:.2f} us, 2 kernels "
          f"{launch[1]:.2f} us per call")
    was, was_d = {}, {}
    if args.was and os.path.exists(args.was):
        with open(args.was) as f:
            wj = json.load(f)
        for r in wj["mla"]:
            was[(r["streams"], r["rows"], r["ctx"])] = r["us"]
        for r in wj.get("drafter", []):
            was_d[(r["streams"], r["ctx"])] = r["us"]

    ctxs = [1024, 4096, 32768, 65536]
    streams = [1, 4, 10]
    rows_list = [1, 8, 16, 32, 64]
    long_ctx = 262144
    if args.quick:
        ctxs, streams, rows_list = [4096, 32768], [1, 10], [1, 16]
        if args.policy == "both":
            ctxs, streams, rows_list = [4096, 65536], [1, 10], [1, 8, 64]
    max_ctx = max(ctxs) + 128
    pages_per_stream = -(-max_ctx // 64)
    pages_long = -(-(long_ctx + 128) // 64)
    num_pages = max(max(streams) * pages_per_stream, pages_long)
    pool = random_bf16(cp, (num_pages, 64, 576))
    perm = cp.asarray(np.random.default_rng(0).permutation(num_pages).astype(np.int32))
    rng = np.random.default_rng(1)

    results = []
    # split-partial dtype of every timing except --partial both's pairs: --partial fp32 / bf16, else the rule
    part_default = {"fp32": False, "bf16": True}.get(args.partial, A.mla_partial_bf16())
    part_defines = (("MLA_PART_BF16", "1"),) if part_default else ()

    def one(S, n, ctx, mode, config=None, spec=None, splits_override=None, policy=None, heads=H, unroll=None,
            part=None, pdl=False):
        pb = part_default if part is None else part   # split partials: bf16 (True) or fp32
        max_p = pages_long if ctx > max_ctx else pages_per_stream
        table = perm[:S * max_p].reshape(S, max_p) if S * max_p <= num_pages else None
        T = S * n
        q = random_bf16(cp, (T, heads, 576), 0.5)
        out = cp.empty((T, heads, 512), cp.uint16)
        prefix = cp.full((S,), ctx, cp.int32)
        n_rows = cp.full((S,), n, cp.int32)
        row_start = cp.arange(S, dtype=cp.int32) * n
        vis_rows = n * (n + 1) // 2
        mask = None
        if mode == "tree":
            bits, vis_rows = tree_mask(rng, n)
            mask = cp.asarray(np.broadcast_to(bits, (S, 129, 5)).copy())
        cfg, splits = A.plan_mla(S, n, heads, ctx + n, policy=policy or args.policy.replace("both", "measured"),
                                 part_bf16=pb)
        if config is not None and config != cfg:
            cfg, splits = config, A.mla_num_splits(S, n, heads, ctx + n, num_sms, config, A._blocks_per_sm(config))
        if splits_override is not None:
            splits = splits_override
        ws = A.MlaWorkspace(splits, T, heads, part_bf16=pb) if splits > 1 else None

        def call():
            A.mla_attention(q, pool, table, prefix, n_rows, row_start, mask=mask, softmax_scale=SCALE,
                            max_rows=n, max_kv_len=ctx + n, out=out, workspace=ws, config=cfg, spec=spec,
                            num_splits=splits, combine_unroll_override=unroll, part_bf16=pb)
        work = (ctx + n) * n * heads
        iters = 20 if work * S > 64 * 65536 * H else 50
        from ddtree_cupy.kernels import launch as kl
        kl.set_pdl(pdl)   # as the engine (steps <= 320 rows): the combine launches early and waits
        try:
            us = time_graph(call, iters=iters, reps=5)
        finally:
            kl.set_pdl(False)
        nbytes = S * ((ctx + n) * 1152 + n * heads * (576 + 512) * 2)
        flops = S * 2 * 1088 * heads * (n * ctx + vis_rows)
        floor = max(nbytes / (bw * 1e3), flops / (tflops * 1e6))   # us
        lfloor = launch[1] if splits > 1 else launch[0]            # forward (+ combine) launches, us
        key = [k for k, v in A.MLA_CONFIGS.items() if v == cfg][0]
        pred = A.mla_cost_us(key, splits, S, n, heads, ctx + n, num_sms, A._blocks_per_sm(cfg), pb) \
            if key in A.MLA_TILE_US else None
        return dict(mode=mode, streams=S, rows=n, ctx=ctx, heads=heads, us=us, pred_us=pred, bytes=nbytes,
                    flops=flops, floor_us=floor, launch_floor_us=lfloor, ratio_launch=us / max(floor, lfloor),
                    config_key=[k for k, v in A.MLA_CONFIGS.items() if v == cfg][0], ratio=us / floor, splits=splits, config=cfg.name, gbps=nbytes / us / 1e3, tflops=flops / us / 1e6,
                    part_bf16=pb, pdl=pdl, partial_mb=(splits * T * heads * A.mla_partial_row_bytes(pb) / 1e6
                                                       if splits > 1 else 0.0))

    cases = [(S, n, c) for c in ctxs for S in streams for n in rows_list]
    if not args.quick:
        cases += [(1, n, long_ctx) for n in rows_list]
    if args.set == "decode":
        cases = ([(S, n, 4096) for S in (1, 4, 10) for n in (1, 8, 16, 32)] +
                 [(1, n, c) for c in (32768, 65536, long_ctx) for n in (1, 4, 8)])
    if args.partial == "both":
        partial_both(one, results, args, bw, num_sms)
        cases = []
    elif args.policy == "both":
        policy_both(one, cases, results, args, was)
        cases = []
    else:
        print(f"{'S':>3} {'rows':>4} {'ctx':>7} | {'tree us':>8} {'was':>7} {'floor':>7} {'ratio':>6} {'r_lf':>5} "
              f"{'TB/s':>5} {'TF/s':>5} {'spl':>3} {'cfg':>20} | {'chain us':>8} {'tree/chain':>10} | target")
    for S, n, c in cases:
        r = one(S, n, c, "tree")
        ch = one(S, n, c, "chain") if n > 1 else None
        r["chain_us"] = ch["us"] if ch else r["us"]
        r["tree_over_chain"] = r["us"] / r["chain_us"]
        r["meets_target"] = bool(r["us"] <= max(1.3 * r["floor_us"], 8.0)) and r["tree_over_chain"] <= 1.5
        r["was_us"] = was.get((S, n, c))
        extra = ""
        if args.compare and r["config_key"] in DEEP_TWIN:   # deeper pipelines, same rows and split count
            r["twins"] = {}
            for tw in DEEP_TWIN[r["config_key"]]:
                # the same split count, or the largest below it with no empty split (64-token tiles)
                k = max(x for x in A.mla_split_candidates(A.MLA_CONFIGS[tw], S, n, H, c + n) if x <= r["splits"])
                o = one(S, n, c, "tree", config=A.MLA_CONFIGS[tw], splits_override=k)
                r["twins"][tw] = o["us"]
                extra += f" {tw}={o['us']:.1f} ({o['us'] / r['us']:.2f})"
        elif args.compare and not A.MLA_CONFIGS[r["config_key"]].ksplit and S * n * c <= 10 * 16 * 32768:
            o = one(S, n, c, "tree", config=A.MLA_CONFIGS["ks32"])
            r["ks32_us"], r["ks32_splits"] = o["us"], o["splits"]
            extra = f" ks32={o['us']:.1f} ({o['splits']})"
        if args.compare and r["splits"] > 1 and (args.set == "decode" or c <= 4096):   # the other combine
            u = A.combine_unroll(S * n * H, num_sms)
            other = 1 if u == A.COMBINE_UNROLL else A.COMBINE_UNROLL
            r["combine_unroll"], r["combine_other_us"] = u, one(S, n, c, "tree", config=A.MLA_CONFIGS[r["config_key"]],
                                                                 splits_override=r["splits"], unroll=other)["us"]
            extra += f" combine_U{other}={r['combine_other_us']:.1f} (U{u} planned)"
        results.append(r)
        if args.out:   # as we go: a run cut short by a time limit keeps what it measured
            _save(args.out, dict(device=name, read_gbps=bw, mma_tflops=tflops, num_sms=num_sms, heads=H,
                                 launch_floor_us=dict(one_kernel=launch[0], two_kernels=launch[1]), mla=results,
                                 partial=True))
        wa = f"{r['was_us']:>7.1f}" if r["was_us"] else f"{'-':>7}"
        print(f"{S:>3} {n:>4} {c:>7} | {r['us']:>8.1f} {wa} {r['floor_us']:>7.1f} {r['ratio']:>6.2f} "
              f"{r['ratio_launch']:>5.2f} "
              f"{r['gbps'] / 1e3:>5.2f} {r['tflops']:>5.0f} {r['splits']:>3} {r['config'][9:]:>20} | "
              f"{r['chain_us']:>8.1f} {r['tree_over_chain']:>10.2f} | {'ok' if r['meets_target'] else 'MISS'}" +
              extra, flush=True)

    sweep = []
    if args.sweep:
        from ddtree_cupy.kernels.compile import KernelSpec
        print("\n# split sweep (planned tile; us per call) and phase-less builds (wrong results by design)")
        for S, n, c in ((1, 1, 4096), (1, 8, 4096), (4, 8, 4096), (10, 8, 4096), (1, 1, 65536), (1, 8, 65536)):
            cfg, planned = A.plan_mla(S, n, H, c + n)
            key = [k for k, v in A.MLA_CONFIGS.items() if v == cfg][0]
            ks = sorted({k for k in (1, 2, 4, 8, 16, 33, 66, 132) if k <= -(-(c + n) // cfg.bn)} | {planned})
            row = dict(streams=S, rows=n, ctx=c, config_key=key, planned=planned,
                       us={k: one(S, n, c, "tree", config=cfg, splits_override=k)["us"] for k in ks})
            if (S, c) == (1, 4096):
                for ph in ("S", "PV", "LOAD"):
                    spec = KernelSpec(src="mla_attention.cu", names=(cfg.name, "mla_attn_combine<4>",
                                                                     "mla_attn_combine<1>"),
                                      defines=((f"MLA_PROBE_SKIP_{ph}", "1"),) + part_defines)
                    row["skip_" + ph] = one(S, n, c, "tree", config=cfg, splits_override=planned, spec=spec)["us"]
            sweep.append(row)
            print(f"  {S} x {n} @ {c} {key} (plan {planned}): " +
                  " ".join(f"{k}:{v:.1f}" for k, v in row["us"].items()) +
                  "".join(f" skip_{ph}={row['skip_' + ph]:.1f}" for ph in ("S", "PV", "LOAD") if "skip_" + ph in row),
                  flush=True)

    probe = []
    if args.probe:
        from ddtree_cupy.kernels.compile import KernelSpec
        print("\n# probe: time per call by tile config, and with one phase removed (wrong results by design)")
        shapes = ((1, 1, 32), (1, 1, 4096), (1, 1, 65536), (1, 16, 32), (1, 16, 4096), (1, 16, 32768),
                  (10, 64, 4096), (10, 16, 32768))
        used = tuple(sorted({A.plan_mla(S, n, H, c + n)[0].name for S, n, c in shapes}))  # compile only these
        variants = {k: KernelSpec(src="mla_attention.cu", names=used + ("mla_attn_combine<4>", "mla_attn_combine<1>"),
                                  defines=((f"MLA_PROBE_SKIP_{k}", "1"),) + part_defines) for k in ("S", "PV", "LOAD")}
        for S, n, c in shapes:
            row = dict(streams=S, rows=n, ctx=c)
            for key, pc in A.MLA_CONFIGS.items():
                if pc.smem > dev.attributes["MaxSharedMemoryPerBlockOptin"]:
                    continue
                row[key] = one(S, n, c, "tree", config=pc)["us"]
            auto, auto_splits = A.plan_mla(S, n, H, c + n)
            for k, spec in variants.items():
                row["skip_" + k] = one(S, n, c, "tree", config=auto, spec=spec)["us"]
            row["auto"] = [k for k, v in A.MLA_CONFIGS.items() if v == auto][0]
            row["auto_splits"] = auto_splits
            # split count: fixed cost (combine, fill) vs parallelism; the planner's cost model vs measured
            for k in sorted({1, 4, 16, 64, max(1, auto_splits // 2), 2 * auto_splits}):
                if k != auto_splits and k <= min(A.MAX_SPLITS, -(-(c + n) // auto.bn)):
                    row[f"splits{k}"] = one(S, n, c, "tree", config=auto, splits_override=k)["us"]
            probe.append(row)
            print("  " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)

    # DFlash drafter attention, TP8 rank shape: 8 q heads / 1 kv head, block 8.
    drafter = []
    if args.policy != "both" and args.partial != "both":
        print(f"\n# drafter attention (8 q heads / 1 kv head, block 8, head_dim 128)")
        print(f"{'S':>3} {'ctx':>7} | {'us':>7} {'was':>7} {'floor':>7} {'ratio':>6} {'r_lf':>5} {'spl':>3}")
    for S in ((1, 10) if args.policy != "both" and args.partial != "both" else ()):
        for c in (4096, 32768):
            q = random_bf16(cp, (S, 8, 8, 128))
            kb = random_bf16(cp, (S, 8, 1, 128))
            vb = random_bf16(cp, (S, 8, 1, 128))
            kc = random_bf16(cp, (S, c, 1, 128))
            vc = random_bf16(cp, (S, c, 1, 128))
            ctx = cp.full((S,), c, cp.int32)
            out = cp.empty((S, 8, 8, 128), cp.uint16)
            sp = A.drafter_num_splits(S, 1, c, 8, num_sms)
            ws = A.DrafterWorkspace(sp, S, 8, 8) if sp > 1 else None

            def dcall():
                A.drafter_attention(q, kb, vb, kc, vc, ctx, softmax_scale=128 ** -0.5, max_ctx_len=c, out=out,
                                    workspace=ws)
            us = time_graph(dcall, iters=20, reps=5)
            nbytes = S * (c + 8) * 2 * 128 * 2
            flops = S * 64 * (c + 8) * 4 * 128
            floor = max(nbytes / (bw * 1e3), flops / (tflops * 1e6))
            lfloor = launch[1] if sp > 1 else launch[0]
            wd = was_d.get((S, c))
            drafter.append(dict(streams=S, ctx=c, us=us, was_us=wd, bytes=nbytes, flops=flops, floor_us=floor,
                                splits=sp, launch_floor_us=lfloor, ratio_launch=us / max(floor, lfloor)))
            print(f"{S:>3} {c:>7} | {us:>7.1f} {wd if wd else float('nan'):>7.1f} {floor:>7.1f} {us / floor:>6.2f} "
                  f"{us / max(floor, lfloor):>5.2f} {sp:>3}", flush=True)

    summary = dict(device=name, read_gbps=bw, mma_tflops=tflops, num_sms=num_sms, heads=H, softmax_scale=SCALE,
                   launch_floor_us=dict(one_kernel=launch[0], two_kernels=launch[1]), mla=results, probe=probe,
                   sweep=sweep,
                   drafter=drafter, seconds=time.time() - t_start)
    if args.policy == "both":
        summary["policy_summary"] = policy_summary(results)
    if args.partial == "both":   # its own table and decision; the grid summary and plot do not apply
        summary["partial_decision"] = partial_decision(results)
        print(f"# bench took {summary['seconds']:.0f} s")
        if args.out:
            _save(args.out, summary)
            print(f"# wrote {args.out}")
        return
    print("\n# summary (tree verify, 8 heads): streams x rows @ context -> us (was; floor us, ratio, ratio to "
          "max(floor, launch floor), tree/chain; deeper twin)")
    for S, n, c in ((1, 1, 4096), (1, 8, 4096), (4, 8, 4096), (10, 8, 4096), (10, 32, 4096), (1, 16, 4096),
                    (10, 16, 4096), (1, 1, 32768), (1, 8, 32768), (1, 16, 32768), (10, 16, 32768), (1, 1, 65536),
                    (1, 8, 65536), (10, 64, 65536), (1, 1, 262144), (1, 8, 262144)):
        for r in results:
            if (r["streams"], r["rows"], r["ctx"], r.get("heads", H)) == (S, n, c, H):
                was_s = f"{r['was_us']:7.1f}" if r.get("was_us") else "      -"
                tw = "".join(f"  {k} {v:.1f}" for k, v in r.get("twins", {}).items())
                print(f"  {S:>2} x {n:>2} @ {c:>6}: {r['us']:8.1f} us (was {was_s}; {r['floor_us']:7.1f}, "
                      f"{r['ratio']:5.2f}x, {r['ratio_launch']:5.2f}x, {r['tree_over_chain']:.2f}){tw}")
    if args.policy == "both":
        print_policy_summary(summary["policy_summary"])
    met = sum(r["meets_target"] for r in results)
    print(f"\n# {met}/{len(results)} MLA cases meet (<= max(1.3 x floor, 8 us) and tree <= 1.5 x chain); "
          f"bench took {summary['seconds']:.0f} s")
    if args.out:
        _save(args.out, summary)
        print(f"# wrote {args.out}")
        write_svg(summary, args.svg or os.path.splitext(args.out)[0] + ".svg")


if __name__ == "__main__":
    main()
