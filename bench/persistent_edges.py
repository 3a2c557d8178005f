"""What one dependency edge costs: a chain of dependent stages run as one persistent launch (the executor's
counter waits) against the same stages as one kernel launch each (kernel boundaries), with and without
programmatic dependent launch, at 1, 2, 4 and 8 stages.

    PYTHONPATH=$PWD python3 -m bench.persistent_edges [--rows 1 8] [--kinds norm gemm] [--width 1536] [--json F]

Stages (``schedule.build_chain``): "norm", an RMSNorm of each row of the stage before (a few KB: all latency);
"gemm", x @ w^T with a width x width weight (q_b's shape at the default 1536: 4.7 MB per stage, as the
attention half's small GEMMs). The chain's weights are cold (every timed call uses the next of enough weight
copies, together >= 3x the L2, as bench/persistent.py does). Per method the time per call at each stage
count, and a least-squares line through them: its slope is the cost of one more stage (its work and its
edge); the work is the same in each method, so the slopes' difference is what the executor's edge saves or
costs against a boundary. The floor per stage is its bytes at the read ceiling measured in the same run.
This decides whether the segments with many small dependent stages (the attention half: qkv_a, its norms,
q_b, the per-head products, o_proj) are worth moving into the executor before their edges get cheaper.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from bench.ceilings import measure_read_bandwidth, time_graph
from bench.persistent import _Cycle, _copies, _rel
from ddtree_cupy.engine import schedule as S

STAGES = (1, 2, 4, 8)


def slope(stages, us) -> float:
    """The least-squares slope of us against stages: us per added stage."""
    x, y = np.asarray(stages, np.float64), np.asarray(us, np.float64)
    x = x - x.mean()
    return float((x * (y - y.mean())).sum() / (x * x).sum())


def run_chain(cp, kind, T, width, read_gbs):
    from ddtree_cupy.kernels import gemm, launch, layers
    from ddtree_cupy.kernels.persistent import PersistentSegment, bind_chain, default_grid
    rng = np.random.default_rng(7 + T)
    scale = 1.0 if kind == "norm" else width ** -0.5       # GEMM stages keep the rows' scale
    bf = lambda *s: cp.asarray(((rng.standard_normal(s) * scale).astype(np.float32)   # noqa: E731
                                .view(np.uint32) >> 16).astype(np.uint16))
    n_max = max(STAGES)
    w_shape = (width,) if kind == "norm" else (width, width)
    w0 = [bf(*w_shape) for _ in range(n_max)]
    n_copies = _copies(cp, sum(w.nbytes for w in w0))
    wsets = [w0] + [[cp.roll(w, k, axis=0) for w in w0] for k in range(1, n_copies)]   # distinct bytes per copy
    x0 = (cp.asarray(rng.standard_normal((T, width)).astype(np.float32)).view(np.uint32) >> 16).astype(np.uint16)
    xs = [x0] + [cp.zeros((T, width), np.uint16) for _ in range(n_max)]
    xt = [x0] + [cp.zeros((T, width), np.uint16) for _ in range(n_max)]
    grid = default_grid()
    rows = []
    for n in STAGES:
        sc = S.build_chain(kind, T, width, n, grid, bytes_per_us_per_block=4.0e6 / grid)
        segs = [PersistentSegment(sc, 0, bind_chain(sc, xs[:n + 1], ws[:n])) for ws in wsets]
        t_whole = None
        if kind == "gemm":     # the part ends' share of an edge: whole units only (no workspace, arrival, fixup)
            sw = S.build_chain(kind, T, width, n, grid, bytes_per_us_per_block=4.0e6 / grid, whole_units=True)
            segs_w = [PersistentSegment(sw, 0, bind_chain(sw, xs[:n + 1], ws[:n])) for ws in wsets]
            segs_w[0].launch()
            segs_w[0].check()
            xw = xs[n].copy()

        def today(ws, n=n):
            def run():
                for j in range(n):
                    if kind == "norm":
                        layers.rms_norm(xt[j], ws[j], 1e-6, out=xt[j + 1])
                    else:
                        gemm.gemm_bf16(xt[j], ws[j], xt[j + 1])
            return run
        segs[0].launch()
        segs[0].check()
        today(wsets[0])()
        err = _rel(cp, xs[n], xt[n])
        err_whole = None
        if kind == "gemm":
            err_whole = _rel(cp, xw, xt[n])
            t_whole = time_graph(_Cycle(sg.launch for sg in segs_w))
            for sg in segs_w:
                sg.check()
        t_pers = time_graph(_Cycle(sg.launch for sg in segs))
        for sg in segs:
            sg.check()
        old = launch.pdl_enabled()
        try:
            launch.set_pdl(False)
            t_plain = time_graph(_Cycle(today(ws) for ws in wsets))
            launch.set_pdl(True)
            t_pdl = time_graph(_Cycle(today(ws) for ws in wsets))
        finally:
            launch.set_pdl(old)
        stage_bytes = sum(w.nbytes for w in w0[:n]) + 2 * n * x0.nbytes
        rows.append({"kind": kind, "T": T, "width": width, "stages": n, "blocks": grid, "items": len(sc.items),
                     "persistent_us": t_pers, "persistent_whole_units_us": t_whole, "rel_err_whole_units": err_whole,
                     "kernels_us": t_plain, "kernels_pdl_us": t_pdl,
                     "floor_us": stage_bytes / (read_gbs * 1e3), "rel_err": err})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.persistent_edges", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--kinds", nargs="+", default=["norm", "gemm"], choices=["norm", "gemm"])
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    import cupy as cp
    read = measure_read_bandwidth()
    print(f"read ceiling {read:.0f} GB/s (this run)")
    print(f"{'kind':5} {'T':>3} {'stages':>6} {'items':>6} {'persist us':>10} {'kernels us':>10} {'PDL us':>8} "
          f"{'floor us':>8} {'rel err':>9}")
    rows, lines = [], []
    for kind in args.kinds:
        for T in args.rows:
            rs = run_chain(cp, kind, T, args.width, read)
            rows += rs
            for r in rs:
                print(f"{kind:5} {T:3d} {r['stages']:6d} {r['items']:6d} {r['persistent_us']:10.2f} "
                      f"{r['kernels_us']:10.2f} {r['kernels_pdl_us']:8.2f} {r['floor_us']:8.2f} {r['rel_err']:9.2e}")
            n = [r["stages"] for r in rs]
            per = {m: slope(n, [r[f"{m}_us"] for r in rs]) for m in ("persistent", "kernels", "kernels_pdl")}
            whole = ""
            if kind == "gemm":
                whole = f", persistent whole units {slope(n, [r['persistent_whole_units_us'] for r in rs]):.2f}"
                for r in rs:
                    print(f"      whole units: {r['persistent_whole_units_us']:.2f} us (rel err "
                          f"{r['rel_err_whole_units']:.1e})")
            fl = rs[-1]["floor_us"] / rs[-1]["stages"]
            lines.append(f"edge {kind:5} T {T:2d}: us per added stage: persistent {per['persistent']:.2f}{whole}, "
                         f"kernels {per['kernels']:.2f}, kernels with PDL {per['kernels_pdl']:.2f} (floor {fl:.2f} "
                         f"per stage)")
    print()
    for line in lines:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"read_gbs": read, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
