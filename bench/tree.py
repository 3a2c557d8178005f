"""DDTree stage timings on the GPU (CUDA-graph replay) next to the numpy reference's CPU heap builder.

    PYTHONPATH=$PWD python3 bench/tree.py [--streams 1 4 10] [--budgets 8 16 32 64] [--pdl] [--json out.json]

Shape: depth 7, V = 163840 drafter logits (bf16, and fp32 for the largest case), top-K = budget.
Stages: top-K (per-chunk candidate lists + merge, 2 launches; "stage 1" is the first launch alone; the
last lines also give the merge launch alone, "merge alone"),
build (1 launch), walk + commit (1 launch), and all of them in one graph ("total"; "total PDL": the
same graph launched with programmatic dependent launch, when the launch path is available; "top-K PDL":
the top-K's two launches alone with PDL, in the comparison lines). The top-K kinds given by --topk run on the
same inputs (CONFIGS: auto = the workspace's rule, the engine's, named "engine" in the rows; scan / list =
that kind for every shape; default: all three, so the GPU run shows each kind's top-K time at every shape);
"same" says a configuration's outputs equal the reference configuration's bit for bit (all but the
stage-1 buffers; the reference is the first given).
The top-K stage reads S*D*V logits: its time is also shown as a fraction of the read ceiling measured in
the same run. "was": the build and total of the same case and variant in the previous results file
(--was); for a configuration that file lacks, the figures of the one it replaces (--was-variant, default
scan-rank-cache-regs, the engine's name in older files). The last lines compare every configuration with
the reference configuration in this run.
Target (docs/PERFORMANCE.md): <= 30 us for all stages at 10 streams, budget 64.
Prints a table; asserts nothing about speed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.ceilings import measure_read_bandwidth, time_graph  # noqa: E402
from ddtree_cupy.kernels.ddtree import MAX_TREE_ROWS, DDTreeWorkspace, topk_merge, topk_partial  # noqa: E402
from ddtree_cupy.reference import ddtree as dd  # noqa: E402

D, V = 7, 163840
# --topk value -> (the workspace's ``topk`` argument, the name in the result rows' "variant" field)
CONFIGS = {"auto": (None, "engine"), "scan": ("scan", "scan"), "list": ("list", "list")}


def _bf16_bits(x):
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _deep_post(tokens, parents, n1, rng):
    """Target tokens that follow the tree's deepest path (the walk's worst case), junk elsewhere."""
    post = rng.integers(0, V, size=MAX_TREE_ROWS).astype(np.int32)
    depth = np.zeros(n1, int)
    for i in range(1, n1):
        depth[i] = depth[parents[i]] + 1
    r = int(depth.argmax())
    while r > 0:
        post[parents[r]] = tokens[r]
        r = int(parents[r])
    return post


def bench_case(S, B, dtype, seed, bw_gbs, config, pdl=False):
    """Times one case with top-K configuration ``config`` (a key of CONFIGS); returns its outputs, its result
    row, and the top-K arrays (for the CPU builder)."""
    import cupy as cp
    rng = np.random.default_rng(seed)   # same inputs for every configuration
    x = (rng.standard_normal((S, D, V)) * 2.0).astype(np.float32)
    x[:, :, rng.integers(0, V, size=8)] += 10.0
    logits = cp.asarray(_bf16_bits(x) if dtype == "bf16" else x)
    ws = DDTreeWorkspace(S, D, V, B, topk=CONFIGS[config][0])
    budgets = cp.full(S, B, cp.int32)
    prefix = cp.asarray(rng.integers(100, 4000, size=S).astype(np.int32))
    bonus = cp.asarray(rng.integers(0, V, size=S).astype(np.int32))
    row_off = cp.asarray((np.arange(S) * MAX_TREE_ROWS).astype(np.int32))
    ws.topk(logits)
    ws.build(budgets, prefix, bonus)
    cp.cuda.get_current_stream().synchronize()
    tk, pa, nr = ws.tokens.get(), ws.parents.get(), ws.n_rows.get()
    post = cp.asarray(np.stack([_deep_post(tk[s], pa[s], int(nr[s]), rng) for s in range(S)]))

    t_topk = time_graph(lambda: ws.topk(logits))
    t_part = time_graph(lambda: topk_partial(logits.reshape(S * D, V), B, ws.part_keys, ws.part_ms,
                                             kind=ws.topk_kind))
    # the merge launch alone (it only reads stage 1's buffers and the logits, which stay as they are)
    t_merge = time_graph(lambda: topk_merge(ws.part_keys, ws.part_ms, B, ws.keys, ws.ms,
                                            ws.top_lp.reshape(S * D, B), ws.top_id.reshape(S * D, B),
                                            kind=ws.topk_kind))
    t_build = time_graph(lambda: ws.build(budgets, prefix, bonus))
    t_walk = time_graph(lambda: ws.walk_commit(post, prefix, row_off))

    def step():
        ws.topk(logits)
        ws.build(budgets, prefix, bonus)
        ws.walk_commit(post, prefix, row_off)
    t_all = time_graph(step)
    t_pdl = t_topk_pdl = float("nan")
    if pdl:
        from ddtree_cupy.kernels import launch
        launch.set_pdl(True)
        try:
            t_pdl = time_graph(step)
            t_topk_pdl = time_graph(lambda: ws.topk(logits))
        finally:
            launch.set_pdl(False)
    ws.walk_commit(post, prefix, row_off)
    n_acc = ws.n_acc.get()
    snap = {k: v.get() for k, v in ws.outputs().items() if k not in ("part_keys", "part_ms")}
    nbytes = logits.nbytes
    row = dict(streams=S, budget=B, dtype=dtype, variant=CONFIGS[config][1], topk_kind=ws.topk_kind,
               topk_us=t_topk, topk_pdl_us=t_topk_pdl, topk_stage1_us=t_part, topk_merge_us=t_merge, build_us=t_build, total_pdl_us=t_pdl,
               walk_commit_us=t_walk, total_us=t_all, mean_accepted=float(n_acc.mean()),
               topk_read_frac=(nbytes / (t_topk * 1e-6) / 1e9) / bw_gbs)
    return snap, row, (ws.top_lp.get(), ws.top_id.get())


def cpu_heap_builder_us(top_lp, top_id, B, reps=3):
    """The numpy reference's heap builder on the GPU's top-K arrays, all streams (what a CPU-side DDTree
    would run)."""
    t0 = time.perf_counter()
    for _ in range(reps):
        for s in range(top_lp.shape[0]):
            dd.build_tree(top_lp[s], top_id[s], B)
    return (time.perf_counter() - t0) / reps * 1e6


def profile_case(S, B, config="auto"):
    """Eager launches of every stage (bf16 logits, top-K configuration ``config``) for a profiler to pick up."""
    import cupy as cp
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((S, D, V)) * 2.0).astype(np.float32)
    x[:, :, rng.integers(0, V, size=8)] += 10.0
    logits = cp.asarray(_bf16_bits(x))
    ws = DDTreeWorkspace(S, D, V, B, topk=CONFIGS[config][0])
    budgets = cp.full(S, B, cp.int32)
    prefix = cp.full(S, 1000, cp.int32)
    bonus = cp.zeros(S, cp.int32)
    post = cp.zeros((S, MAX_TREE_ROWS), cp.int32)
    row_off = cp.asarray((np.arange(S) * MAX_TREE_ROWS).astype(np.int32))
    for _ in range(3):
        ws.topk(logits)
        ws.build(budgets, prefix, bonus)
        ws.walk_commit(post, prefix, row_off)
    cp.cuda.get_current_stream().synchronize()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 10])
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--json", default=None)
    ap.add_argument("--was", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "tree_h200.json"), help="previous results (was -> now)")
    ap.add_argument("--pdl", action="store_true", help="also time the whole step launched with PDL")
    ap.add_argument("--chunk-sweep", type=int, nargs="*", default=[],
                    help="also time the top-K stage at the largest case for these stage-1 chunk sizes")
    ap.add_argument("--profile", action="store_true",
                    help="no table: launch the stages of the first case a few times (for Nsight Compute)")
    ap.add_argument("--topk", nargs="+", default=["auto", "scan", "list"], choices=list(CONFIGS),
                    help="top-K configurations to time (auto = the engine's rule, scan / list = that kind for "
                         "every shape); the reference of the 'same' column is the first")
    ap.add_argument("--was-variant", default="scan-rank-cache-regs",
                    help="the --was file's variant whose figures stand for a configuration that file lacks")
    args = ap.parse_args(argv)
    if args.profile:
        return profile_case(args.streams[0], args.budgets[0], args.topk[0])
    configs = list(dict.fromkeys(args.topk))
    ref_name = CONFIGS[configs[0]][1]
    was = {}
    if args.was and os.path.exists(args.was):
        with open(args.was) as f:
            for r in json.load(f)["rows"]:
                was[(r["streams"], r["budget"], r["dtype"], r["variant"])] = (r["build_us"], r["total_us"])
    import cupy as cp
    bw = measure_read_bandwidth(1 << 30)
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    cases = [(S, B, "bf16") for S in args.streams for B in args.budgets]
    cases.append((max(args.streams), max(args.budgets), "f32"))
    rows = []
    hdr = (f"{'streams':>7} {'budget':>6} {'logits':>6} {'variant':>20} {'top-K':>7} {'(%ceil)':>7} "
           f"{'stage1':>7} {'build':>15} {'walk+cm':>7} {'total':>15} {'PDL':>7} {'CPU heap':>9} "
           f"{'acc':>4} {'same':>5}")

    def line(r):
        return (f"{r['streams']:7d} {r['budget']:6d} {r['dtype']:>6} {r['variant']:>20} {r['topk_us']:7.1f} "
                f"{100 * r['topk_read_frac']:6.0f}% {r['topk_stage1_us']:7.1f} "
                f"{r['was_build_us']:6.1f} ->{r['build_us']:6.1f} {r['walk_commit_us']:7.1f} "
                f"{r['was_total_us']:6.1f} ->{r['total_us']:6.1f} {r['total_pdl_us']:7.1f} "
                f"{r['cpu_heap_builder_us']:9.0f} {r['mean_accepted']:4.1f} {'yes' if r['matches_verified'] else 'NO':>5}")
    print("build and total: was -> now", flush=True)
    print(hdr, flush=True)   # rows as they come: a time limit still leaves the finished ones
    for i, (S, B, dt) in enumerate(cases):
        ref_snap = None
        for v in configs:
            snap, r, top = bench_case(S, B, dt, i, bw, v, pdl=args.pdl)
            if ref_snap is None:
                ref_snap, t_cpu = snap, cpu_heap_builder_us(*top, B)
            # every configuration must give the reference's outputs (trees, top-K, walk) bit for bit
            r["matches_verified"] = all(np.array_equal(snap[k], ref_snap[k]) for k in snap)
            r["reference_variant"] = ref_name
            r["cpu_heap_builder_us"] = t_cpu
            w = was.get((S, B, dt, r["variant"]), was.get((S, B, dt, args.was_variant)))
            r["was_build_us"], r["was_total_us"] = w if w else (float("nan"), float("nan"))
            rows.append(r)
            print(line(r), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=dev, read_ceiling_gbs=bw, rows=rows), f, indent=1)
    print(f"\nDDTree stages on {dev}, depth {D}, V {V}; read ceiling {bw:.0f} GB/s (same run); "
          f"CUDA-graph replay, us per step; build and total: was -> now")
    print(hdr)
    for r in rows:
        print(line(r))
    for chunk in args.chunk_sweep:
        S, B = max(args.streams), max(args.budgets)
        rng = np.random.default_rng(0)
        x = (rng.standard_normal((S, D, V)) * 2.0).astype(np.float32)
        x[:, :, rng.integers(0, V, size=8)] += 10.0
        logits = cp.asarray(_bf16_bits(x))
        ws = DDTreeWorkspace(S, D, V, B, chunk=chunk)
        t1 = time_graph(lambda: topk_partial(logits.reshape(S * D, V), B, ws.part_keys, ws.part_ms, chunk=chunk,
                                             kind=ws.topk_kind))
        t = time_graph(lambda: ws.topk(logits))
        print(f"chunk {chunk}: {S} streams, budget {B}, bf16: top-K {t:.1f} us (stage 1 {t1:.1f} us, P = {ws.P})")
    by = {(r["streams"], r["budget"], r["dtype"], r["variant"]): r for r in rows}
    for r in rows:
        if r["streams"] == 10 and r["budget"] == 64 and r["dtype"] == "bf16":
            print(f"target: 10 streams, budget 64, {r['variant']}: {r['was_total_us']:.1f} -> {r['total_us']:.1f} us "
                  f"(PDL {r['total_pdl_us']:.1f}; target <= 30 us)")
    # the builder's cost per pop: the slope of its time between the smallest and the largest budget (the
    # fixed part -- launch, loads, the rows and masks -- cancels)
    lo_b, hi_b = min(args.budgets), max(args.budgets)
    for S in args.streams:
        for v in configs:
            name = CONFIGS[v][1]
            a, b = by.get((S, lo_b, "bf16", name)), by.get((S, hi_b, "bf16", name))
            if a is not None and b is not None and hi_b > lo_b:
                print(f"build per pop, {name}, {S} streams: ({b['build_us']:.2f} - {a['build_us']:.2f}) / "
                      f"{hi_b - lo_b} = {(b['build_us'] - a['build_us']) / (hi_b - lo_b) * 1e3:.0f} ns")
    for (S, B, dt, v), r in by.items():   # every configuration against the reference, same run and inputs
        d = by.get((S, B, dt, ref_name))
        if v != ref_name and d is not None:
            print(f"{ref_name} -> {v} (same run): {S:2d} x {B:3d} {dt}: top-K {d['topk_us']:5.1f} -> {r['topk_us']:5.1f} "
                  f"(PDL {d.get('topk_pdl_us', float('nan')):5.1f} -> {r.get('topk_pdl_us', float('nan')):5.1f}) "
                  f"(stage 1 {d['topk_stage1_us']:5.1f} -> {r['topk_stage1_us']:5.1f}, merge alone "
                  f"{d['topk_merge_us']:5.1f} -> {r['topk_merge_us']:5.1f}), walk {d['walk_commit_us']:4.1f} -> "
                  f"{r['walk_commit_us']:4.1f}, build {d['build_us']:5.1f} -> "
                  f"{r['build_us']:5.1f}, total {d['total_us']:5.1f} -> {r['total_us']:5.1f} us "
                  f"({d['total_us'] / r['total_us']:.2f}x), total PDL {d['total_pdl_us']:5.1f} -> "
                  f"{r['total_pdl_us']:5.1f} us; same outputs: {'yes' if r['matches_verified'] else 'NO'}")


if __name__ == "__main__":
    main()
