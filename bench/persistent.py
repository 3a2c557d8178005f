"""The persistent executor against today's kernel chain on the part of a layer it runs: the dense MLP half
(post-attention norm with the residual add, gate|up GEMM with SwiGLU, down GEMM) at one TP = 8 rank's widths
of Kimi K2.6 dense layer 0 and of the DFlash drafter, same weights and inputs in one run.

    PYTHONPATH=$PWD python3 -m bench.persistent [--rows 1 8 16] [--json out.json] [--timeline] [--gemm] [--pdl]

Per shape: today's chain and the persistent launch as CUDA graphs (us per call), both against the byte
floor (weights + activations read once, at the read ceiling measured in the same run), and the cost
model's prediction (engine/schedule.py). The weights are cold, as in a step of 61 layers: every timed call
uses the next of enough weight copies that the ones a call reads are not in L2 from the call before
(``_copies``: together at least 3x the L2), so a GEMM whose weights fit in L2 is not flattered. --timeline prints the per-stage span of the persistent launch
(globaltimer per item) and the busiest blocks' item sequence; --repeat N traces N launches and says whether a
block's lateness at each GEMM's end repeats, by block id or by the SM it lands on (``lateness_stability``).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from bench.ceilings import measure_read_bandwidth, time_graph
from ddtree_cupy.engine import schedule as S

H, F_DENSE, F_DRAFT = 7168, 18432 // 8, 18432 // 8


def _shape(kind, T, F):
    if kind == "dense":
        return S.LayerShape("dense", 1, T, H=H, nh=8, ql=1536, dn=128, dv=128, F=F)
    return S.LayerShape("drafter", 1, T, H=H, nh=8, dn=128, dv=128, F=F, nkv=1)


def _copies(cp, nbytes: int) -> int:
    """Weight copies to cycle through so that a call's weights were evicted since their last use: together
    at least 3x the device's L2 (at most 16)."""
    l2 = int(cp.cuda.Device().attributes["L2CacheSize"])
    return max(2, min(16, -(-3 * l2 // max(1, nbytes))))


class _Cycle:
    """fn(k) for k = 0, 1, ... mod n on successive calls (a graph captures n different launches in turn)."""

    def __init__(self, fns):
        self.fns, self.i = list(fns), 0

    def __call__(self):
        f = self.fns[self.i % len(self.fns)]
        self.i += 1
        f()


def _breakdown(seg):
    """Where a traced launch's time goes, per block, in us from the earliest block start: the block's start,
    its set-up done, its first and last part end of each GEMM (or item end), its end. Percentiles over blocks."""
    bt = seg.block_times().astype(np.float64)
    t0 = bt[:, 0].min()
    per = {"start": bt[:, 0] - t0, "setup_done": bt[:, 1] - t0, "end": bt[:, 2] - t0}
    ends = {}
    for b, _, op, _, e in seg.timeline():
        ends.setdefault(op, {}).setdefault(b, []).append(e - t0)
    for op, by_block in ends.items():
        per[f"{op}_first_end"] = np.array([min(v) for v in by_block.values()])
        per[f"{op}_last_end"] = np.array([max(v) for v in by_block.values()])
    return {k: [float(np.percentile(v, q)) / 1e3 for q in (0, 50, 100)] for k, v in per.items()}


def stage_spans(seg):
    """{stage: (first item's start, last item's end)} of a traced launch, us from its first item's start."""
    tl = seg.timeline()
    t0 = min(t for _, _, _, t, _ in tl)
    spans = {}
    for _, _, op, a, e in tl:
        lo, hi = spans.get(op, (1 << 62, 0))
        spans[op] = (min(lo, a - t0), max(hi, e - t0))
    return {op: (lo / 1e3, hi / 1e3) for op, (lo, hi) in spans.items()}


def _print_breakdown(bd, indent="    "):
    print(f"{indent}per block, us from the first block's start (min / median / max over blocks):")
    for k, (lo, md, hi) in bd.items():
        print(f"{indent}  {k:22} {lo:7.2f} {md:7.2f} {hi:7.2f}")


def _corr(a, b) -> float:
    a, b = a - a.mean(), b - b.mean()
    d = float(np.sqrt((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / d) if d else 0.0


def lateness_stability(ends: np.ndarray, sms: np.ndarray) -> dict:
    """Whether a block's lateness at the end of a GEMM repeats from launch to launch, and whether it follows
    the block or the SM it lands on. ``ends`` [launches, blocks]: each block's last part end of the GEMM
    (us from the launch's first block start), ``sms`` [launches, blocks]: the SM each block ran on. Lateness
    = end - the launch's median. Returns the mean spread (max - min) per launch, the mean correlation of
    lateness between two launches by block id and by SM (the SM's blocks averaged), the correlation within a
    launch between the two blocks of one SM, the share of blocks on the same SM as in the first launch, and
    the spread of the per-SM lateness averaged over launches (what a static per-SM plan could remove)."""
    n, nb = ends.shape
    late = ends - np.median(ends, axis=1, keepdims=True)
    n_sm = int(sms.max()) + 1
    per_sm = np.full((n, n_sm), np.nan)
    pair = []
    for i in range(n):
        tot, cnt = np.zeros(n_sm), np.zeros(n_sm)
        np.add.at(tot, sms[i], late[i])
        np.add.at(cnt, sms[i], 1)
        per_sm[i, cnt > 0] = tot[cnt > 0] / cnt[cnt > 0]
        first, second = {}, {}
        for b in range(nb):
            (second if sms[i, b] in first else first)[sms[i, b]] = late[i, b]
        both = [s for s in second if s in first]
        if len(both) > 2:
            pair.append(_corr(np.array([first[s] for s in both]), np.array([second[s] for s in both])))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    ok = ~np.isnan(per_sm).any(axis=0)
    sm_mean = np.nanmean(per_sm, axis=0)
    return {"launches": n, "spread_us": float(np.mean(late.max(1) - late.min(1))),
            "corr_by_block": float(np.mean([_corr(late[i], late[j]) for i, j in pairs])) if pairs else 0.0,
            "corr_by_sm": float(np.mean([_corr(per_sm[i, ok], per_sm[j, ok]) for i, j in pairs])) if pairs else 0.0,
            "corr_sm_pair": float(np.mean(pair)) if pair else 0.0,
            "same_sm_share": float(np.mean(sms[1:] == sms[0])) if n > 1 else 1.0,
            "per_sm_mean_spread_us": float(np.nanmax(sm_mean) - np.nanmin(sm_mean)),
            "latest_sms": [int(v) for v in np.argsort(-np.nan_to_num(sm_mean, nan=-1e9))[:6]]}


def _stability_runs(cp, segs, n):
    """``n`` traced launches of segs[0], each between launches of the other weight copies (cold weights, a
    busy stream): per launch, every block's last part end per GEMM stage and its SM."""
    seg = segs[0]
    ends, sms = {}, []
    for _ in range(n):
        for sg in segs[1:]:
            sg.launch()
        seg.launch()
        for sg in segs[1:3]:
            sg.launch()
        cp.cuda.Stream.null.synchronize()
        seg.check()
        bt = seg.block_times()
        t0 = bt[:, 0].min()
        sms.append(bt[:, 3].copy())
        last = {}
        for b, _, op, _, e in seg.timeline():
            d = last.setdefault(op, np.full(seg.s.n_blocks, -np.inf))
            d[b] = max(d[b], (e - t0) / 1e3)
        for op, d in last.items():
            ends.setdefault(op, []).append(d)
    out = {}
    for op in ("gate_up", "down"):
        if op in ends:
            e = np.array(ends[op])
            ran = np.isfinite(e).all(axis=0)          # the blocks that ran a part of this GEMM in every launch
            out[op] = lateness_stability(e[:, ran], np.array(sms)[:, ran])
    return out


def _rel(cp, a, b):
    a, b = (cp.asarray(v).view(np.uint16).astype(np.uint32) << 16 for v in (a, b))
    a, b = a.view(np.float32).astype(np.float64), b.view(np.float32).astype(np.float64)
    return float(cp.linalg.norm(a - b) / cp.linalg.norm(b))


def run_shape(cp, kind, T, read_gbs, timeline=False, repeat=0):
    from ddtree_cupy.kernels import gemm, layers
    from ddtree_cupy.kernels.persistent import PersistentSegment, bind_dense_mlp, default_grid
    F = F_DENSE if kind == "dense" else F_DRAFT
    rng = np.random.default_rng(T)
    r = lambda *s: cp.asarray((rng.standard_normal(s) * 0.05).astype(np.float32)).view(np.uint32)   # noqa: E731
    bf = lambda a: (a >> 16).astype(np.uint16)                                                       # noqa: E731
    attn, h, nw = bf(r(T, H)), bf(r(T, H)), bf(r(H))
    w_gu0, w_dn0 = bf(r(2 * F, H)), bf(r(H, F))
    n_copies = _copies(cp, w_gu0.nbytes + w_dn0.nbytes)
    w_gus = [w_gu0] + [cp.roll(w_gu0, k, axis=0) for k in range(1, n_copies)]    # distinct bytes per copy
    w_dns = [w_dn0] + [cp.roll(w_dn0, k, axis=0) for k in range(1, n_copies)]
    z = lambda *s: cp.zeros(s, np.uint16)                                                            # noqa: E731
    normed, gu, act, out = z(T, H), z(T, 2 * F), z(T, F), z(T, H)
    eps = 1e-6

    def today_k(k):
        def run():
            layers.rms_norm(attn, nw, eps, out=normed, residual=h)
            gemm.gemm_bf16(normed, w_gus[k], gu)
            layers.silu_mul(gu, out=act)
            gemm.gemm_bf16(act, w_dns[k], out)
        return run
    sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    grid = default_grid()
    sc = S.build_layer(_shape(kind, T, F), grid, allreduce="segment", parts=("mlp",),
                       bytes_per_us_per_block=4.0e6 / grid)
    act_p, out_p = z(T, F), z(T, H)
    segs = [PersistentSegment(sc, 0, bind_dense_mlp(sc, attn=attn, h=h, post_norm_w=nw, eps=eps, w_gate_up=w_gus[k],
                                                    w_down=w_dns[k], normed=normed, act=act_p, out=out_p),
                              trace=(timeline or repeat > 0) and k == 0)
            for k in range(n_copies)]
    seg = segs[0]
    h0 = h.copy()                                  # both update the residual in place: one pass each from h0
    today_k(0)()
    h[...] = h0
    seg.launch()
    seg.check()
    err = _rel(cp, out_p, out)
    t_old = time_graph(_Cycle(today_k(k) for k in range(n_copies)))
    t_new = time_graph(_Cycle(sg.launch for sg in segs))
    for sg in segs:
        sg.check()
    w_gu, w_dn = w_gu0, w_dn0
    nbytes = (w_gu.nbytes + w_dn.nbytes + nw.nbytes + 2 * attn.nbytes + 2 * h.nbytes + normed.nbytes * 2
              + gu.nbytes * 2 + act.nbytes * 2 + out.nbytes)
    floor_us = nbytes / (read_gbs * 1e3)
    row = {"kind": kind, "T": T, "sm": int(sm), "blocks": sc.n_blocks, "items": len(sc.items), "today_us": t_old,
           "persistent_us": t_new, "floor_us": floor_us, "today_x_floor": t_old / floor_us,
           "persistent_x_floor": t_new / floor_us, "speedup": t_old / t_new,
           "model_us": sc.predicted_us, "rel_err_vs_today": err, "weight_copies": n_copies}
    # today's chain op by op (cold weights too)
    row["today_ops_us"] = {
        "post_norm": time_graph(lambda: layers.rms_norm(attn, nw, eps, out=normed, residual=h)),
        "gate_up": time_graph(_Cycle((lambda w=w: gemm.gemm_bf16(normed, w, gu)) for w in w_gus)),
        "silu": time_graph(lambda: layers.silu_mul(gu, out=act)),
        "down": time_graph(_Cycle((lambda w=w: gemm.gemm_bf16(act, w, out)) for w in w_dns))}
    row["today_configs"] = {"gate_up": str(gemm.choose_decode(T, 2 * F, H)), "down": str(gemm.choose_decode(T, H, F))}
    if timeline:
        # the trace of segs[0]'s last replay in the timed cycle (graph launches back to back, its weights
        # evicted by the other copies' passes): a single launch after other work measured a different start
        # (the norm rows 3-4 us later, down alone 1 us slower while its graph replays were 1 us faster)
        cp.cuda.Stream.null.synchronize()
        row["breakdown_us"] = _breakdown(seg)
        tl = seg.timeline()
        t0 = min(t for _, _, _, t, _ in tl)
        row["stage_spans_us"] = stage_spans(seg)
        busy = {}
        for b, _, op, a, e in tl:
            busy[b] = busy.get(b, 0) + (e - a)
        row["busiest_blocks"] = [
            (b, busy[b] / 1e3, [(op, round((a - t0) / 1e3, 2), round((e - t0) / 1e3, 2))
                                for bb, _, op, a, e in tl if bb == b])
            for b in sorted(busy, key=busy.get, reverse=True)[:3]]
    if repeat > 1:
        row["lateness"] = _stability_runs(cp, segs, repeat)
    return row


def run_gemm_alone(cp, T, read_gbs, timeline=False):
    """Each GEMM of the MLP half alone: the executor running only its stream-K parts (engine/schedule.
    build_gemm, no waits) against today's plain launch (its automatic config), both on cold weights."""
    from ddtree_cupy.kernels import gemm
    from ddtree_cupy.kernels.persistent import PersistOpArgs, PersistentSegment, default_grid
    rng = np.random.default_rng(100 + T)
    bf = lambda *s: cp.asarray(((rng.standard_normal(s) * 0.05).astype(np.float32).view(np.uint32) >> 16)   # noqa: E731
                               .astype(np.uint16))
    out = []
    for name, N, K in (("gate_up", 2 * F_DENSE, H), ("down", H, F_DENSE)):
        x, w, o, o2 = bf(T, K), bf(N, K), cp.zeros((T, N), np.uint16), cp.zeros((T, N), np.uint16)
        ws = [w] + [cp.roll(w, k, axis=0) for k in range(1, _copies(cp, w.nbytes))]
        grid = default_grid()
        sc = S.build_gemm(T, N, K, grid, bytes_per_us_per_block=4.0e6 / grid)
        segs = [PersistentSegment(sc, 0, {"gemm": PersistOpArgs(x=x, w=wk, out=o, N=N, K=K)},
                                  trace=timeline and k == 0) for k, wk in enumerate(ws)]
        segs[0].launch()
        segs[0].check()
        gemm.gemm_bf16(x, w, o2)
        err = _rel(cp, o, o2)
        t_pers = time_graph(_Cycle(sg.launch for sg in segs))
        for sg in segs:
            sg.check()
        t_plain = time_graph(_Cycle((lambda wk=wk: gemm.gemm_bf16(x, wk, o2)) for wk in ws))
        bd = None
        if timeline:                   # segs[0]'s last replay in the timed cycle (as run_shape)
            bd = _breakdown(segs[0])
        floor = (w.nbytes + x.nbytes + o.nbytes) / (read_gbs * 1e3)
        out.append({"gemm": name, "T": T, "N": N, "K": K, "blocks": grid, "items": len(sc.items),
                    "persistent_us": t_pers, "plain_us": t_plain, "floor_us": floor, "rel_err": err,
                    "weight_copies": len(ws), "breakdown_us": bd,
                    "plain_config": str(gemm.choose_decode(T, N, K))})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.persistent", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 16])
    ap.add_argument("--kinds", nargs="+", default=["dense", "drafter"])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--repeat", type=int, default=0,
                    help="N >= 2 traced launches: does a block's lateness at each GEMM's end repeat, by block or by SM")
    ap.add_argument("--gemm", action="store_true",
                    help="also each GEMM alone: the executor on its tiles only vs a plain launch of that config")
    ap.add_argument("--pdl", action="store_true",
                    help="launch the PDL-capable kernels with programmatic dependent launch, as the engine's decode "
                         "graphs do (today's chain; the executor where its spec is PDL-capable)")
    args = ap.parse_args(argv)
    import cupy as cp
    from ddtree_cupy.kernels import launch
    from ddtree_cupy.kernels.persistent import SPEC
    if args.pdl:
        launch.set_pdl(True)
        print(f"PDL launches: today's chain yes, the executor {'yes' if SPEC.pdl else 'no (its spec is not PDL-capable)'}")
    read = measure_read_bandwidth()
    print(f"read ceiling {read:.0f} GB/s (this run)")
    rows = []
    print(f"{'kind':8} {'T':>3} {'blocks':>6} {'items':>6} {'today us':>9} {'persist us':>10} {'floor us':>8} "
          f"{'today/fl':>8} {'pers/fl':>8} {'speedup':>7} {'model us':>8}")
    for kind, T in ((k, t) for k in args.kinds for t in args.rows):
        r = run_shape(cp, kind, T, read, args.timeline, args.repeat)
        rows.append(r)
        print(f"{kind:8} {T:3d} {r['blocks']:6d} {r['items']:6d} {r['today_us']:9.1f} "
              f"{r['persistent_us']:10.1f} {r['floor_us']:8.1f} {r['today_x_floor']:8.2f} "
              f"{r['persistent_x_floor']:8.2f} {r['speedup']:7.2f} {r['model_us']:8.1f}  "
              f"rel err {r['rel_err_vs_today']:.1e}")
        if args.timeline:
            for op, (a, e) in r["stage_spans_us"].items():
                print(f"    {op:12} {a:8.2f} .. {e:8.2f} us")
            _print_breakdown(r["breakdown_us"])
            print("    today op by op (us): " + ", ".join(f"{k} {v:.1f}" for k, v in r["today_ops_us"].items())
                  + f"  configs {r['today_configs']}")
            for b, busy, seq in r["busiest_blocks"]:
                print(f"    block {b}: busy {busy:.1f} us: " + ", ".join(f"{o}@{a}-{e}" for o, a, e in seq[:12]))
        for op, st in r.get("lateness", {}).items():
            print(f"    {op} end lateness over {st['launches']} launches: spread {st['spread_us']:.2f} us, corr by "
                  f"block {st['corr_by_block']:.2f}, by SM {st['corr_by_sm']:.2f}, SM's two blocks "
                  f"{st['corr_sm_pair']:.2f}, same SM {st['same_sm_share']:.2f}, per-SM mean spread "
                  f"{st['per_sm_mean_spread_us']:.2f} us, latest SMs {st['latest_sms']}")
    alone = []
    if args.gemm:
        print(f"{'gemm':8} {'T':>3} {'blocks':>6} {'items':>6} {'plain us':>9} {'persist us':>10} {'floor us':>8} "
              f"{'rel err':>9}")
        for T in args.rows:
            for g in run_gemm_alone(cp, T, read, args.timeline):
                alone.append(g)
                print(f"{g['gemm']:8} {T:3d} {g['blocks']:6d} {g['items']:6d} {g['plain_us']:9.1f} "
                      f"{g['persistent_us']:10.1f} {g['floor_us']:8.1f} {g['rel_err']:9.2e}")
                if g["breakdown_us"]:
                    _print_breakdown(g["breakdown_us"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"read_gbs": read, "rows": rows, "gemm_alone": alone}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
