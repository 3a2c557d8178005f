"""Diagnostic: is the GPU engine's verify path wrong, or is it bf16 numerics (MoE routing flips)?

Usage (GPU): PYTHONPATH=$PWD python3 bench/diag_verify.py [--quick]   (--quick: part A with the drafter
append only)

On the tiny checkpoint, with the engine configured as tests/gpu/test_engine.py configures it:

A. the engine's state at its first decode step: prompts of 5, 40 and 270 tokens prefilled through the
   engine's own chunked prefill (256 + 14 for the long one) into slots 0..2 (with / without the drafter
   append), then ONE ddtree verify (bucket 4, budget 16) whose draft puts the float64 reference's greedy
   continuation on the top path (a known tree). Dumped from the step's static buffers and checked against
   docs/CONTRACTS.md: tokens, positions = s + depth, kv_pos = s + r (-1 on padding), prefix_len, n_rows,
   row_start, stream_ids, ancestor mask, block table. Then per tree row: GPU logits vs ReferenceTarget
   float64 run on the same tokens / positions / mask (relative error, argmax, top-2 gap), the GPU's routed
   experts vs the reference's (flips, and the reference margin there), and the latent cache rows of every
   layer at positions 0 .. s + rows (per position class: prefill chunk 1, chunk 2, tree rows). The GPU 'ar'
   step at the same state gives the root row's logits through the decode path for comparison.
B. a full ddtree generate (graphs, real drafter, as the failing tests): snapshots of each stream's committed
   cache rows after some steps, compared with a float64 causal forward over the committed tokens (layer 0
   rows are a function of (token, position) only: any compaction / position / slot error shows there), and
   the teacher-forced verdict of every emitted token with the router margin at each non-argmax token.
Prints one table per part and a summary last.
"""
from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(os.path.dirname(HERE), "tests")]

from _oracle_draft import OracleDraft  # noqa: E402  (tests/ on the path)

N_NEW = 104
PROMPT_LENS = (5, 40, 270)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def rows_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1), 1e-30)


def bits_to_bool(words: np.ndarray, n: int) -> np.ndarray:
    """uint32 [R, 5] packed mask -> bool [n, n] (row i sees row j)."""
    j = np.arange(n)
    return ((words[:n, j // 32] >> (j % 32).astype(np.uint32)) & 1).astype(bool)


def ref_router_record(ref):
    """Wrap ref.mlp_block to record (layer, x) of every MoE call; returns (records list, undo)."""
    recs = []
    orig = ref.mlp_block

    def rec(i, x):
        if ref.cfg.is_moe_layer(i):
            recs.append((i, np.array(x)))
        return orig(i, x)
    ref.mlp_block = rec
    return recs, lambda: delattr(ref, "mlp_block")


def gpu_router_record(tgt):
    recs = []
    orig = tgt.mlp_block

    def rec(i, x, out, reduce=True):
        r = orig(i, x, out, reduce)
        if tgt.w.layers[i].is_moe:
            T = x.shape[0]
            E = tgt.cfg.n_routed_experts       # router_logits holds [logits E | shared gate | shared up]
            recs.append((i, tgt.router_logits[:T, :E].get(), tgt.topk_ids[:T].get()))
        return r
    tgt.mlp_block = rec
    return recs, lambda: delattr(tgt, "mlp_block")


def choice_scores(ref, i, x):
    p = f"model.layers.{i}.mlp."
    lg = np.asarray(x, np.float64) @ np.asarray(ref.w[p + "gate.weight"], np.float64).T
    return 1 / (1 + np.exp(-lg)) + np.asarray(ref.w[p + "gate.e_score_correction_bias"], np.float64)


def part_a_nosplit(eng, ref, cfg, prompts, conts, report):
    """Part A again with the attention's split-KV forced off (one split: no partials, no combine)."""
    import ddtree_cupy.kernels.attention as att
    orig = att.plan_mla
    att.plan_mla = lambda *a: (orig(*a)[0], 1)
    saved = dict(eng.target._mla_ws)
    eng.target._mla_ws.clear()
    try:
        part_a(eng, ref, cfg, prompts, conts, True, report, tag_extra=" splits=1")
    finally:
        att.plan_mla = orig
        eng.target._mla_ws.clear()
        eng.target._mla_ws.update(saved)


def part_a(eng, ref, cfg, prompts, conts, use_drafter, report, tag_extra=""):
    import cupy as cp
    from ddtree_cupy.engine.kv_pool import KVPool
    from ddtree_cupy.engine.step import DecodeStep
    from ddtree_cupy.kernels.engine_glue import CTRL_ACTIVE, CTRL_BONUS, CTRL_BUDGET, CTRL_FIELDS, CTRL_PREFIX, CTRL_STEP
    from ddtree_cupy.api import Request
    from ddtree_cupy.models.kv import PAGE
    tag = f"A[{'drafter append' if use_drafter else 'no drafter append'}{tag_extra}]"
    print(f"\n===== {tag}: engine prefill + one ddtree verify (bucket 4, budget 16), known tree =====")
    S, budget = 4, 16
    pool = KVPool(eng.num_pages, PAGE, eng.max_streams, eng.max_pages_per_stream, budget + 1)
    slots = [pool.admit(i, len(p), N_NEW) for i, p in enumerate(prompts)]
    eng.stream.synchronize()
    with eng.stream:
        eng.kv.set_block_table(pool.block_table)
    eng.stream.synchronize()
    eng.prefill_runner.graphs = False
    bonus = [eng.prefill_runner.run(sl, p, Request(p, N_NEW), use_drafter) for sl, p in zip(slots, prompts)]
    print(f"{tag}: slots {slots}, prefill bonus GPU {bonus}, reference {[c[0] for c in conts]}")
    key = ("A", use_drafter, tag_extra)
    step = DecodeStep(eng.models, S, "ddtree", budget, None, False, False)
    seqs = {sl: list(p) + list(c) for sl, p, c in zip(slots, prompts, conts)}
    eng.drafter.draft = OracleDraft(seqs)   # the continuation on the tree's top path
    ctrl = np.zeros((CTRL_FIELDS, S), np.int32)
    for sl, p, b in zip(slots, prompts, bonus):
        ctrl[CTRL_PREFIX, sl], ctrl[CTRL_BONUS, sl], ctrl[CTRL_ACTIVE, sl] = len(p), b, 1
        ctrl[CTRL_BUDGET, sl], ctrl[CTRL_STEP, sl] = budget, 1
    step.upload(ctrl)
    grec, gundo = gpu_router_record(eng.target)
    try:
        with eng.stream:
            step._draft()
            step._tree()
            step._verify()
        eng.stream.synchronize()
    finally:
        gundo()
        del eng.drafter.draft
    b, ws, R = step.batch, step.ws, step.R
    d = {k: getattr(b, k).get() for k in ("tokens", "positions", "kv_pos", "stream_ids", "prefix_len", "n_rows",
                                          "row_start", "mask", "logits")}
    parents, depths, wn = ws.parents.get(), ws.depths.get(), ws.n_rows.get()
    table = eng.kv.block_table.get()
    # ---- contract checks of the verify inputs ----
    problems = []
    for sl in range(S):
        n = int(d["n_rows"][sl])
        r0 = sl * R
        if sl not in slots:
            if n != 0 or (d["kv_pos"][r0:r0 + R] != -1).any():
                problems.append(f"idle slot {sl}: n_rows {n}, kv_pos {d['kv_pos'][r0:r0 + R][:4]}")
            continue
        P = len(prompts[slots.index(sl)])
        par, dep = parents[sl, :n], depths[sl, :n]
        want_mask = np.zeros((n, n), bool)
        for i in range(n):
            j = i
            while j >= 0:
                want_mask[i, j] = True
                j = par[j]
        chk = {
            "n_rows = tree rows": n == wn[sl],
            "prefix_len = s": d["prefix_len"][sl] == P,
            "row_start = b * R": d["row_start"][sl] == r0,
            "stream_ids = b": (d["stream_ids"][r0:r0 + R] == sl).all(),
            "root token = bonus": d["tokens"][r0] == bonus[slots.index(sl)],
            "root parent -1, parents precede": par[0] == -1 and all(0 <= par[i] < i for i in range(1, n)),
            "depth = parent depth + 1": all(dep[i] == dep[par[i]] + 1 for i in range(1, n)) and dep[0] == 0,
            "positions = s + depth": (d["positions"][r0:r0 + n] == P + dep).all(),
            "kv_pos = s + r": (d["kv_pos"][r0:r0 + n] == P + np.arange(n)).all(),
            "kv_pos = -1 on padding": (d["kv_pos"][r0 + n:r0 + R] == -1).all(),
            "mask = ancestors + self": (bits_to_bool(d["mask"][sl], n) == want_mask).all(),
            "block table = pool's": (table[sl] == pool.block_table[sl]).all(),
            "pages cover s + R": (table[sl, :-(-(P + R) // PAGE)] >= 0).all(),
        }
        problems += [f"slot {sl}: {k}" for k, v in chk.items() if not v]
        chain = list(conts[slots.index(sl)][1:])
        on_path = [int(d["tokens"][r0 + i]) for i in range(n) if dep[i] > 0]
        print(f"{tag} slot {sl}: s {P}, rows {n}, depths {dep.tolist()}, reference chain {chain[:D_SHOW]} in tree: "
              f"{[t in on_path for t in chain[:D_SHOW]]}")
    print(f"{tag}: verify inputs vs docs/CONTRACTS.md: {'OK' if not problems else problems}")
    report[key + ("contract",)] = not problems
    # ---- reference float64 on the same tokens / positions / mask ----
    for sl, p in zip(slots, prompts):
        P, n, r0 = len(p), int(d["n_rows"][sl]), sl * R
        cache = ref.new_cache()
        recs, undo = ref_router_record(ref)
        try:
            ref.forward(np.asarray(p), np.arange(P), cache)
            vis = bits_to_bool(d["mask"][sl], n)
            lg, _ = ref.forward(d["tokens"][r0:r0 + n].astype(np.int64), d["positions"][r0:r0 + n].astype(np.int64),
                                cache, visible=vis)
        finally:
            undo()
        g = d["logits"][r0:r0 + n]
        e = rows_rel(g, lg)
        am = (g.argmax(1) == lg.argmax(1))
        top2 = -np.sort(-lg, axis=1)[:, :2]
        gap = (top2[:, 0] - top2[:, 1]) / lg.std(1)
        # routing: reference records: prefill (P rows) then tree (n rows) per MoE layer
        flips, margins = [], []
        moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        ref_tree = {i: x for (i, x) in recs[len(moe_layers):]}
        gpu_tree = {i: (lgt, ids) for (i, lgt, ids) in grec}
        kk = cfg.num_experts_per_tok
        router_err = []
        for i in moe_layers:
            ch = choice_scores(ref, i, ref_tree[i])
            srt = -np.sort(-ch, axis=1)
            margins.append(srt[:, kk - 1] - srt[:, kk])
            ref_ids = np.argsort(-ch, axis=1, kind="stable")[:, :kk]
            gl, gids = gpu_tree[i]
            gl, gids = gl[r0:r0 + n], gids[r0:r0 + n]
            gch = 1 / (1 + np.exp(-gl.astype(np.float64))) + np.asarray(
                ref.w[f"model.layers.{i}.mlp.gate.e_score_correction_bias"], np.float64)
            router_err.append(np.abs(gch - ch).max(axis=1))
            flips.append(np.array([set(gids[r].tolist()) != set(ref_ids[r].tolist()) for r in range(n)]))
        margins, flips, router_err = np.stack(margins), np.stack(flips), np.stack(router_err)
        # router noise proper: selection-score error of each MoE layer on rows whose experts agreed in every
        # earlier MoE layer (after a flip the layer input itself differs: that is not router noise)
        clean = np.cumsum(np.vstack([np.zeros((1, n), bool), flips[:-1]]), axis=0) == 0
        noise = [f"L{moe_layers[j]} med {np.median(router_err[j][clean[j]]):.1e} max {router_err[j][clean[j]].max():.1e}"
                 for j in range(len(moe_layers)) if clean[j].any()]
        print(f"{tag} slot {sl}: router selection-score error on unflipped inputs: " + "; ".join(noise))
        report[key + (sl, "router_noise_max")] = max(float(router_err[j][clean[j]].max())
                                                     for j in range(len(moe_layers)) if clean[j].any())
        print(f"{tag} slot {sl} (s {P}): tree rows logits rel err median {np.median(e):.2e} max {e.max():.2e}; "
              f"argmax equal {int(am.sum())}/{n}; max router score err {router_err.max():.2e}; "
              f"expert-set flips {int(flips.sum())} (rows {np.nonzero(flips.any(0))[0].tolist()})")
        print("   row depth pos  tok   relerr   argmaxGPU/ref  refgap(std) min_router_margin flip_layers")
        for r in range(n):
            fl = [moe_layers[j] for j in range(len(moe_layers)) if flips[j, r]]
            print(f"   {r:3d} {depths[sl, r]:4d} {d['positions'][r0 + r]:4d} {d['tokens'][r0 + r]:4d}  {e[r]:.2e}  "
                  f"{g[r].argmax():4d}/{lg[r].argmax():4d}  {gap[r]:8.3f}  {margins[:, r].min():.2e}  {fl}")
        report[key + (sl, "row_err")] = (float(np.median(e)), float(e.max()), int(flips.sum()),
                                         int((~am).sum()), float(router_err.max()))
        # GPU routing of the PREFILL rows is not recorded (the prefill ran without the hook); the tree's is.
        # ---- latent cache rows, every layer, positions 0 .. s + n ----
        classes = {"chunk1 [0,256)": np.arange(min(P, 256)), "chunk2 [256,s)": np.arange(256, P),
                   "tree [s,s+n)": np.arange(P, P + n)}
        line = []
        worst = 0.0
        for layer in range(cfg.num_hidden_layers):
            from ddtree_cupy.bf16 import bf16_bits_to_f32
            gr = bf16_bits_to_f32(eng.kv.read_rows(layer, sl, np.arange(P + n)))
            rr = cache.layer(layer)[:P + n]
            er = rows_rel(gr, rr)
            parts = []
            for cname, idx in classes.items():
                if idx.size:
                    parts.append(f"{cname} med {np.median(er[idx]):.1e} max {er[idx].max():.1e}")
                    worst = max(worst, float(er[idx].max()))
            line.append(f"   layer {layer}: " + "; ".join(parts))
        print(f"{tag} slot {sl}: latent cache rows GPU vs float64 (per-row rel err):")
        print("\n".join(line))
        report[key + (sl, "cache_worst")] = worst
    # ---- the decode ('ar') path at the same state: root row logits ----
    ar = DecodeStep(eng.models, S, "ar", 1, None, False, False)
    c2 = ctrl.copy()
    c2[CTRL_BUDGET] = 0
    ar.upload(c2)
    with eng.stream:
        ar._root()
        ar._verify()
    eng.stream.synchronize()
    arl = ar.batch.logits.get()
    for sl, p in zip(slots, prompts):
        cache = ref.new_cache()
        lg, _ = ref.forward(np.asarray(list(p) + [bonus[slots.index(sl)]]), np.arange(len(p) + 1), cache)
        root_tree = d["logits"][sl * R]
        print(f"{tag} slot {sl}: root row: tree-verify vs ar-decode rel diff {rel(root_tree, arl[sl]):.2e}; "
              f"vs float64: tree {rel(root_tree, lg[-1]):.2e}, ar {rel(arl[sl], lg[-1]):.2e}; argmax tree "
              f"{root_tree.argmax()} ar {arl[sl].argmax()} ref {lg[-1].argmax()}")
        report[key + (sl, "root")] = (rel(root_tree, arl[sl]), rel(root_tree, lg[-1]), rel(arl[sl], lg[-1]))
    pool_release = [pool.release(s) for s in slots]
    del pool_release


D_SHOW = 6


def part_b(eng, ref, cfg, prompts, report):
    import _teacher_forced as tf
    from ddtree_cupy.bf16 import bf16_bits_to_f32
    from ddtree_cupy.api import Request
    print("\n===== B: full ddtree b16 generate (graphs, real drafter) =====")
    eng.eager = False
    snaps = {}

    def on_tokens(st, em):
        k = len(st.output_ids)
        for thr in (8, 60):
            if k >= thr and (st.index, thr) not in snaps and not st.done:
                P = st.prompt_len
                c = st.committed
                seq = list(st.request.prompt_ids) + list(st.output_ids[:c - P])
                rows = [bf16_bits_to_f32(eng.kv.read_rows(l, st.slot, np.arange(c))) for l in range(cfg.num_hidden_layers)]
                snaps[(st.index, thr)] = (seq, rows)
    res = eng.generate([Request(p, N_NEW, sample_stream=i) for i, p in enumerate(prompts)], "ddtree", 16,
                       on_tokens=on_tokens)
    print(f"B: mean acceptance {res.mean_accept_len:.2f}, steps {res.steps}")
    for (si, thr), (seq, rows) in sorted(snaps.items()):
        cache = ref.new_cache()
        ref.forward(np.asarray(seq), np.arange(len(seq)), cache)
        P = len(prompts[si])
        parts = []
        worst_gen = []
        for l in range(cfg.num_hidden_layers):
            er = rows_rel(rows[l], cache.layer(l))
            gen = er[P:]
            parts.append(f"L{l} prompt max {er[:P].max():.1e} gen med {np.median(gen):.1e} max {gen.max():.1e}"
                         f"@{P + int(gen.argmax())}")
            worst_gen.append(float(gen.max()))
        print(f"B stream {si} after {thr}+ tokens (committed {len(seq)}): cache rows vs float64: " + "; ".join(parts))
        report[("B", si, thr, "cache_gen_worst")] = worst_gen
    for i, (p, s) in enumerate(zip(prompts, res.streams)):
        lg, m = tf.reference_scores(ref, p, s.output_ids)
        v = tf.judge(lg, m, s.output_ids)
        print(tf.describe(f"B stream {i} teacher-forced", v))
        off = np.nonzero(v["gaps"] > 0)[0]
        print("   non-argmax tokens (index: gap std, router margin): " +
              ", ".join(f"{j}: {v['gaps'][j]:.3f}, {v['margins'][j]:.1e}" for j in off))
        report[("B", i, "tf")] = (v["identical"], v["non_argmax"], v["max_gap"], v["flips"], len(v["bad"]))


def main():
    import cupy as cp  # noqa: F401
    from ddtree_cupy.checkpoint import load_reference_weights
    from ddtree_cupy.config import DrafterConfig, TargetConfig
    from ddtree_cupy.engine.gpu_engine import GpuEngine
    from ddtree_cupy.reference.target import ReferenceTarget
    from ddtree_cupy.tinymodel import ensure_tiny_checkpoints
    tdir, ddir = ensure_tiny_checkpoints()
    cfg, dcfg = TargetConfig.load(tdir), DrafterConfig.load(ddir)
    ref = ReferenceTarget(cfg, load_reference_weights(tdir, np.float64, cfg=cfg), np.float64)
    rng = np.random.default_rng(2024)                      # the prompts of tests/gpu/test_engine.py
    prompts = [rng.integers(0, cfg.vocab_size - 256, n).tolist() for n in PROMPT_LENS]
    conts = []
    for p in prompts:                                      # float64 greedy continuation, D + 2 tokens
        cache = ref.new_cache()
        lg, _ = ref.forward(np.asarray(p), np.arange(len(p)), cache)
        c = []
        for _ in range(dcfg.block_size + 2):
            c.append(int(lg[-1].argmax()))
            lg, _ = ref.forward(np.asarray([c[-1]]), np.asarray([len(p) + len(c) - 1]), cache)
        conts.append(c)
    eng = GpuEngine(cfg, tdir, dcfg, ddir, max_streams=4, max_budget=16, kv_tokens=64 * 64, max_context=1024,
                    eager=True)
    report = {}
    import traceback
    parts = ((part_a, (True,)), (part_a_nosplit, ()), (part_a, (False,)), (part_b, ()))
    if "--quick" in sys.argv:            # part A with the drafter append only (router noise, one verify)
        parts = parts[:1]
    for fn, args in parts:
        try:                      # one failing part must not hide the others' evidence
            if fn is not part_b:
                fn(eng, ref, cfg, prompts, conts, *args, report)
            else:
                fn(eng, ref, cfg, prompts, report)
        except Exception:
            traceback.print_exc()
            report[(fn.__name__, args, "FAILED")] = True
    print("\n===== SUMMARY =====")
    for k, v in report.items():
        print(k, v)


if __name__ == "__main__":
    main()
