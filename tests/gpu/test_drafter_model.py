"""GPU: the DFlash drafter model (models/drafter.py) against the float64 ReferenceDrafter.

Tiny checkpoints (16 q / 8 kv heads, 2 layers): features from the numpy ReferenceTarget (float64) on random
prompts, rounded to bf16 (what the GPU target hands over) and fed to BOTH drafters. Three streams with
different context lengths plus an idle slot, incremental appends over several steps (rows of the streams
interleaved, padding rows with position -1 and NaN features), window on (a ring smaller than the context)
and off, both RoPE amplitudes, graph capture of append + draft replayed against eager. A synthetic
8 q / 1 kv head drafter covers the Kimi TP8 rank's head layout. Outputs are poisoned before every launch.

The target's vocabulary-parallel embedding / lm_head are borrowed through ``StandInTarget`` (the
embed + GEMM kernels, exactly what GpuTarget.embed / project_vocab launch), so these tests do not depend
on the rest of the GPU target; ``test_draft_with_gpu_target`` checks the real GpuTarget's methods too.

Benchmark (prints, Kimi TP8 rank shapes, random weights): python tests/gpu/test_drafter_model.py --bench
"""
import math
import os
import sys

import numpy as np
import pytest

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits  # noqa: E402
from ddtree_cupy.config import DrafterConfig  # noqa: E402
from ddtree_cupy.reference.drafter import ReferenceDrafter, drafter_weight_shapes  # noqa: E402

pytestmark = pytest.mark.gpu

# Relative-norm tolerance on the logits: the GPU path rounds every intermediate to bf16 (~20 roundings in
# sequence, measured ~4e-3 in a bf16 emulation of the same pipeline); a wrong head, position, slot or
# amplitude moves the logits by > 10%.
TOL = 2e-2
MAX_STREAMS = 4          # 3 live streams + 1 idle slot
LENS = (33, 29, 13)      # prompt length per stream
# committed context length per stream after each step (appends of 0..16 rows per stream per step)
SCHEDULE = ((17, 9, 4), (20, 10, 4), (25, 18, 6), (33, 29, 13))
MAX_APPEND = 40
AMP_ALT = 1.0 + 0.1 * math.log(64.0)


# ---------------------------------------------------------------------------------------------------
# fixtures and helpers

class StandInTarget:
    """The target's embed / project_vocab (vocabulary-parallel, this rank's slice) from the same kernels."""

    def __init__(self, embed_bits, lm_bits, vocab_start=0, comm=None):
        import cupy as cp
        from ddtree_cupy.dist import SingleRank
        from ddtree_cupy.kernels.gemm import MAX_T, choose_split
        self.table, self.lm = cp.asarray(embed_bits), cp.asarray(lm_bits)
        self.vocab_start, self.comm = vocab_start, comm or SingleRank()
        # its own split-K workspace: ranks run as threads in one test, they must not share the global one
        (N, K), sms = self.lm.shape, cp.cuda.Device().attributes["MultiProcessorCount"]
        self.ws = cp.empty(max(choose_split(t, N, K, 1, sms) * t * N for t in range(1, MAX_T + 1)), cp.float32)

    def embed(self, ids, out):
        from ddtree_cupy.kernels.layers import embed
        embed(ids, self.table, self.vocab_start, out)
        self.comm.all_reduce(out)
        return out

    def project_vocab(self, x, out):
        from ddtree_cupy.kernels.gemm import gemm_bf16
        return gemm_bf16(x, self.lm, out, out_dtype=np.float32, workspace=self.ws)


@pytest.fixture(scope="module")
def tiny():
    from ddtree_cupy.checkpoint import load_drafter_weights, load_reference_weights
    from ddtree_cupy.config import TargetConfig
    from ddtree_cupy.reference.target import ReferenceTarget
    from ddtree_cupy.tinymodel import ensure_tiny_checkpoints
    td, dd = ensure_tiny_checkpoints()
    tcfg, dcfg = TargetConfig.load(td), DrafterConfig.load(dd)
    tw = load_reference_weights(td, np.float64)
    tgt = ReferenceTarget(tcfg, tw, np.float64)
    rng = np.random.default_rng(20261129)
    feats = []
    for n in LENS:
        toks = rng.integers(0, tcfg.vocab_size, n)
        _, f = tgt.forward(toks, np.arange(n), tgt.new_cache(), capture_layers=dcfg.target_layer_ids)
        feats.append(to_bf16_bits(f))                      # the GPU target hands over bf16 features
    embed, lm = tw["model.embed_tokens.weight"], tw["lm_head.weight"]
    return dict(td=td, dd=dd, dcfg=dcfg, feats=feats, dw=load_drafter_weights(dd, np.float64),
                embed=embed, lm=lm, embed_bits=to_bf16_bits(embed), lm_bits=to_bf16_bits(lm))


def rel(got, ref):
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), "non-finite output (an unwritten / poisoned element?)"
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def f64(bits):
    return bf16_bits_to_f32(bits).astype(np.float64)


def step_calls(rng, feats, prev, have, n_pad, n_feat, H, max_rows):
    """A step's append calls: every stream's new rows (prev[b] .. have[b]) in position order cut into calls
    of at most max_rows rows (n_pad padding rows -- position -1, NaN features, a live stream id -- in the
    first), each call's rows in a random interleaved order."""
    rows = sorted(((b, p) for b in range(len(have)) for p in range(prev[b], have[b])), key=lambda r: r[1])
    rows = [(int(rng.integers(0, len(have))), -1)] * n_pad + rows
    calls = []
    for c0 in range(0, len(rows), max_rows):
        part = [rows[c0 + i] for i in rng.permutation(min(max_rows, len(rows) - c0))]
        f = np.full((len(part), n_feat, H), 0x7FC0, np.uint16)      # NaN: a padding row must never land
        for i, (b, p) in enumerate(part):
            if p >= 0:
                f[i] = feats[b][p]
        calls.append((f, np.array([b for b, _ in part], np.int32), np.array([p for _, p in part], np.int32)))
    return calls


def padded(f, sid, pos, n):
    """Pad an append to exactly n rows (the static shape a captured graph reads)."""
    k = n - f.shape[0]
    assert k >= 0
    return (np.concatenate([f, np.full((k,) + f.shape[1:], 0x7FC0, np.uint16)]),
            np.concatenate([sid, np.zeros(k, np.int32)]), np.concatenate([pos, np.full(k, -1, np.int32)]))


def reference_drafts(ref, caches, feats, prev, have, bonus):
    """Append the same rows to the reference caches (float64 of the bf16 features) and draft."""
    out = []
    for b, c in enumerate(caches):
        if have[b] > prev[b]:
            ref.append_context(c, f64(feats[b][prev[b]:have[b]]), np.arange(prev[b], have[b]))
        out.append(ref.draft(c, int(bonus[b]), have[b]))
    return out


def make_drafter(t, dcfg, max_ctx, weights=None, target=None):
    from ddtree_cupy.models.drafter import GpuDrafter, GpuDrafterWeights
    w = weights or GpuDrafterWeights.from_checkpoint(t["dd"], dcfg)
    tgt = target or StandInTarget(t["embed_bits"], t["lm_bits"])
    return GpuDrafter(dcfg, w, tgt, None, max_streams=MAX_STREAMS, max_ctx=max_ctx,
                      max_append=min(MAX_APPEND, max_ctx))


def run_steps(t, dcfg, max_ctx, check_extra=None, seed=0, dr=None):
    """Drive GPU and reference drafters through SCHEDULE; per step compare every live stream and the idle
    slot (empty context, block only). Returns the worst relative error."""
    import cupy as cp
    rng = np.random.default_rng(seed)
    dr = dr or make_drafter(t, dcfg, max_ctx)
    ref = ReferenceDrafter(dcfg, t["dw"], t["embed"], t["lm"], np.float64)
    caches = [ref.new_cache() for _ in LENS]
    V, D = dcfg.vocab_size, dcfg.block_size - 1
    prev = (0, 0, 0)
    worst = 0.0
    for step, have in enumerate(SCHEDULE):
        for f, sid, pos in step_calls(rng, t["feats"], prev, have, 2 + step, dcfg.num_context_features,
                                      dcfg.hidden_size, dr.N_max):
            dr.append_context(cp.asarray(f), cp.asarray(sid), cp.asarray(pos))
        bonus = rng.integers(0, V, MAX_STREAMS).astype(np.int32)
        start = np.array(list(have) + [0], np.int32)
        ctx = np.array(list(have) + [0], np.int32)            # slot 3 idle: empty context
        out = cp.full((MAX_STREAMS, D, V), np.nan, cp.float32)
        dr.draft(cp.asarray(bonus), cp.asarray(start), cp.asarray(ctx), out)
        got = out.get()
        refs = reference_drafts(ref, caches, t["feats"], prev, have, bonus)
        refs.append(ref.draft(ref.new_cache(), int(bonus[3]), 0))
        for b in range(MAX_STREAMS):
            e = rel(got[b], refs[b])
            worst = max(worst, e)
            assert e < TOL, f"step {step} slot {b} (ctx {ctx[b]}): rel err {e:.3e}"
            if check_extra is not None and b < 3:
                check_extra(step, b, caches[b], bonus[b], have[b], got[b], refs[b], e)
        prev = have
    return worst


# ---------------------------------------------------------------------------------------------------
# tests

def test_weights_from_checkpoint_fused(tiny):
    """The fused device tensors are the checkpoint's tensors in the documented order."""
    from ddtree_cupy.models.drafter import GpuDrafterWeights
    dcfg, dw = tiny["dcfg"], tiny["dw"]
    w = GpuDrafterWeights.from_checkpoint(tiny["dd"], dcfg)
    b = lambda n: to_bf16_bits(dw[n])       # the checkpoint is bf16: float64 -> bits is exact
    for l in range(dcfg.num_hidden_layers):
        p = f"layers.{l}."
        np.testing.assert_array_equal(w.qkv[l].get(), np.concatenate(
            [b(p + "self_attn.q_proj.weight"), b(p + "self_attn.k_proj.weight"), b(p + "self_attn.v_proj.weight")]))
        np.testing.assert_array_equal(w.ctx_kv[l].get(), np.concatenate(
            [b(p + "self_attn.k_proj.weight"), b(p + "self_attn.v_proj.weight")]))
        np.testing.assert_array_equal(w.gate_up[l].get(), np.concatenate(
            [b(p + "mlp.gate_proj.weight"), b(p + "mlp.up_proj.weight")]))
        np.testing.assert_array_equal(w.down[l].get(), b(p + "mlp.down_proj.weight"))
        np.testing.assert_array_equal(w.k_norm[l].get(), b(p + "self_attn.k_norm.weight"))
    np.testing.assert_array_equal(w.fc.get(), b("fc.weight"))
    # a TP=2 shard: heads split by rows, o_proj / down by columns, fc by input columns
    w2 = GpuDrafterWeights.from_checkpoint(tiny["dd"], dcfg, tp_rank=1, tp_size=2)
    hd, nq = dcfg.head_dim, dcfg.num_attention_heads * dcfg.head_dim // 2
    nkv = dcfg.num_key_value_heads * hd // 2
    q = b("layers.1.self_attn.q_proj.weight")[nq:]
    k = b("layers.1.self_attn.k_proj.weight")[nkv:]
    v = b("layers.1.self_attn.v_proj.weight")[nkv:]
    np.testing.assert_array_equal(w2.qkv[1].get(), np.concatenate([q, k, v]))
    np.testing.assert_array_equal(w2.o_proj[1].get(), b("layers.1.self_attn.o_proj.weight")[:, nq:])
    W = dcfg.num_context_features * dcfg.hidden_size
    np.testing.assert_array_equal(w2.fc.get(), b("fc.weight")[:, W // 2:])


def test_draft_matches_reference(tiny):
    """3 streams (contexts 4..33), incremental appends, no window (C = 64 >= every context)."""
    worst = run_steps(tiny, tiny["dcfg"], max_ctx=64)
    print(f"worst rel err {worst:.3e}")


def test_draft_window_over_ring(tiny):
    """Window 8 over a ring of 16 slots: stream contexts reach 33 positions, so slots wrap twice; the GPU
    must match the window-8 reference and be far closer to it than to a window-9 one."""
    dcfg = tiny["dcfg"].with_options(draft_window=8)
    ref9 = ReferenceDrafter(tiny["dcfg"].with_options(draft_window=9), tiny["dw"], tiny["embed"], tiny["lm"],
                            np.float64)

    def extra(step, b, cache, bonus, s, got, ref, err):
        if s > 8:
            alt = ref9.draft(cache, int(bonus), s)
            d = rel(alt, ref)
            assert err < 0.5 * d, f"step {step} slot {b}: error {err:.3e} not well below the window-9 gap {d:.3e}"

    run_steps(tiny, dcfg, max_ctx=16, check_extra=extra, seed=1)


def test_draft_rope_amplitude(tiny):
    """Amplitude 1 + 0.1 ln 64 (the option) is applied to q and k: match it, and be far from amplitude 1."""
    dcfg = tiny["dcfg"].with_options(rope_amplitude=AMP_ALT)
    ref1 = ReferenceDrafter(tiny["dcfg"], tiny["dw"], tiny["embed"], tiny["lm"], np.float64)

    def extra(step, b, cache, bonus, s, got, ref, err):
        d = rel(ref1.draft(cache, int(bonus), s), ref)
        assert err < 0.5 * d, f"step {step} slot {b}: error {err:.3e} not well below the amplitude gap {d:.3e}"

    run_steps(tiny, dcfg, max_ctx=64, check_extra=extra, seed=2)


def test_graph_replay_equals_eager(tiny):
    """append_context + draft captured once; replays with new inputs written in place equal eager calls
    on a twin drafter bit for bit, and the reference within TOL."""
    import cupy as cp
    from ddtree_cupy.models.drafter import GpuDrafterWeights
    dcfg = tiny["dcfg"]
    V, D, nf, H = dcfg.vocab_size, dcfg.block_size - 1, dcfg.num_context_features, dcfg.hidden_size
    w = GpuDrafterWeights.from_checkpoint(tiny["dd"], dcfg)
    eager, graphed = make_drafter(tiny, dcfg, 64, w), make_drafter(tiny, dcfg, 64, w)
    ref = ReferenceDrafter(dcfg, tiny["dw"], tiny["embed"], tiny["lm"], np.float64)
    caches = [ref.new_cache() for _ in LENS]
    rng = np.random.default_rng(3)
    st = cp.cuda.Stream(non_blocking=True)
    s_f = cp.empty((MAX_APPEND, nf, H), cp.uint16)
    s_sid, s_pos = cp.empty(MAX_APPEND, cp.int32), cp.empty(MAX_APPEND, cp.int32)
    s_bonus, s_start, s_ctx = (cp.empty(MAX_STREAMS, cp.int32) for _ in range(3))
    out_e = cp.empty((MAX_STREAMS, D, V), cp.float32)
    out_g = cp.empty((MAX_STREAMS, D, V), cp.float32)
    prev, graph = (0, 0, 0), None
    for step, have in enumerate(SCHEDULE):
        (call,) = step_calls(rng, tiny["feats"], prev, have, 1, nf, H, MAX_APPEND)
        f, sid, pos = padded(*call, MAX_APPEND)
        bonus = rng.integers(0, V, MAX_STREAMS).astype(np.int32)
        with st:
            for dst, src in ((s_f, f), (s_sid, sid), (s_pos, pos), (s_bonus, bonus),
                             (s_start, np.array(list(have) + [0], np.int32)),
                             (s_ctx, np.array(list(have) + [0], np.int32))):
                dst.set(src, stream=st)
            out_e.fill(np.nan)
            out_g.fill(np.nan)
            eager.append_context(s_f, s_sid, s_pos)
            eager.draft(s_bonus, s_start, s_ctx, out_e)
            if step == 0:       # the graphed twin's first call is eager (it compiles and sizes)
                graphed.append_context(s_f, s_sid, s_pos)
                graphed.draft(s_bonus, s_start, s_ctx, out_g)
                st.synchronize()
                st.begin_capture()
                graphed.append_context(s_f, s_sid, s_pos)
                graphed.draft(s_bonus, s_start, s_ctx, out_g)
                graph = st.end_capture()
            else:
                graph.launch(st)
            st.synchronize()
        ge, gg = out_e.get(), out_g.get()
        assert np.array_equal(ge, gg), f"step {step}: graph replay differs from eager"
        refs = reference_drafts(ref, caches, tiny["feats"], prev, have, bonus)
        for b in range(3):
            e = rel(gg[b], refs[b])
            assert e < TOL, f"graph step {step} slot {b}: rel err {e:.3e}"
        prev = have


def _synthetic_cfg(hq, hkv, H=1024, F=1536, V=2048, layers=2, bs=8):
    d = {"hidden_size": H, "intermediate_size": F, "num_hidden_layers": layers, "num_attention_heads": hq,
         "num_key_value_heads": hkv, "head_dim": 128, "vocab_size": V, "rms_norm_eps": 1e-6, "block_size": bs,
         "rope_theta": 5e4, "max_position_embeddings": 262144,
         "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
         "dflash_config": {"target_layer_ids": [1, 4, 7, 9], "mask_token_id": V - 2}}
    return DrafterConfig.from_dict(d, "synthetic-drafter")


def _synthetic_weights(cfg, rng):
    """bf16 random drafter weights (bits) and their float64 values, HF names."""
    bits = {}
    for name, shape in drafter_weight_shapes(cfg).items():
        x = 1.0 + 0.2 * rng.standard_normal(shape) if len(shape) == 1 else \
            rng.standard_normal(shape) / math.sqrt(shape[1])
        bits[name] = to_bf16_bits(x)
    return bits


def _weights_from_bits(cfg, bits):
    from ddtree_cupy.models.drafter import GpuDrafterWeights
    return GpuDrafterWeights._assemble(cfg, 0, 1, lambda n: bits[n])


def test_kimi_rank_head_layout():
    """8 query heads / 1 kv head (a Kimi TP8 rank: 64 packed attention rows, the v head used in place),
    one append of 187 rows (two GEMM row chunks), a window of 150 over a 256-slot ring: stream 0 sits at
    positions 100000.. (YaRN long range; its ring slots wrap), stream 1 at 0..36, slot 2 idle."""
    import cupy as cp
    from ddtree_cupy.models.drafter import GpuDrafter
    rng = np.random.default_rng(11)
    cfg = _synthetic_cfg(8, 1).with_options(draft_window=150)
    bits = _synthetic_weights(cfg, rng)
    H, V, nf, D = cfg.hidden_size, cfg.vocab_size, cfg.num_context_features, cfg.block_size - 1
    emb, lm = to_bf16_bits(rng.standard_normal((V, H))), to_bf16_bits(rng.standard_normal((V, H)) / math.sqrt(H) * 3)
    dr = GpuDrafter(cfg, _weights_from_bits(cfg, bits), StandInTarget(emb, lm), None, max_streams=3,
                    max_ctx=256, max_append=200)
    ref = ReferenceDrafter(cfg, {k: f64(v) for k, v in bits.items()}, f64(emb), f64(lm), np.float64)
    lens, base = (150, 37), (100000, 0)
    feats = [to_bf16_bits(rng.standard_normal((n, nf, H)) * 1.5) for n in lens]
    f = np.concatenate(feats)
    sid = np.concatenate([np.full(n, b, np.int32) for b, n in enumerate(lens)])
    pos = np.concatenate([np.arange(p, p + n, dtype=np.int32) for p, n in zip(base, lens)])
    order = rng.permutation(len(pos))
    dr.append_context(cp.asarray(f[order]), cp.asarray(sid[order]), cp.asarray(pos[order]))
    caches = []
    for b, n in enumerate(lens):
        c = ref.new_cache()
        ref.append_context(c, f64(feats[b]), np.arange(base[b], base[b] + n))
        caches.append(c)
    bonus = np.array([17, 1900, 3], np.int32)
    ctx = np.array([base[0] + lens[0], lens[1], 0], np.int32)
    out = cp.full((3, D, V), np.nan, cp.float32)
    dr.draft(cp.asarray(bonus), cp.asarray(ctx), cp.asarray(ctx), out)
    got = out.get()
    exp = [ref.draft(caches[0], 17, int(ctx[0])), ref.draft(caches[1], 1900, int(ctx[1])), ref.draft(ref.new_cache(), 3, 0)]
    for b in range(3):
        e = rel(got[b], exp[b])
        assert e < TOL, f"slot {b}: rel err {e:.3e}"


def test_draft_with_gpu_target(tiny):
    """The same draft with the real GpuTarget's embed / project_vocab (tiny checkpoint)."""
    from ddtree_cupy.config import TargetConfig
    from ddtree_cupy.models.target import GpuTarget
    from ddtree_cupy.models.weights import GpuTargetWeights
    tcfg = TargetConfig.load(tiny["td"])
    tgt = GpuTarget(tcfg, GpuTargetWeights.from_checkpoint(tiny["td"], tcfg), None, max_tokens=64,
                    feature_layers=tiny["dcfg"].target_layer_ids)
    dr = make_drafter(tiny, tiny["dcfg"], 64, target=tgt)
    run_steps(tiny, tiny["dcfg"], 64, seed=4, dr=dr)


class _ThreadComm:
    """Tensor-parallel ranks as threads on one GPU: all_reduce syncs the device, sums every rank's buffer in
    fp32 (rounded to bf16 once, as NCCL's bf16 sum), hands the sum back. A barrier timeout ends a hang."""

    def __init__(self, rank, shared):
        self.rank, self.size, self.sh = rank, shared["size"], shared

    def all_reduce(self, x):
        import cupy as cp
        from ddtree_cupy.models.drafter import f32_to_bf16_bits_gpu
        sh, bar = self.sh, self.sh["barrier"]
        cp.cuda.Device().synchronize()
        sh["slots"][self.rank] = x
        bar.wait(timeout=120)
        if self.rank == 0:
            acc = sum((s.astype(cp.uint32) << 16).view(cp.float32) for s in sh["slots"])
            sh["sum"] = f32_to_bf16_bits_gpu(acc)
            cp.cuda.Device().synchronize()
        bar.wait(timeout=120)
        x[...] = sh["sum"]
        cp.cuda.Device().synchronize()
        bar.wait(timeout=120)
        return x


def test_tensor_parallel_two_ranks(tiny):
    """TP = 2 as two threads on one GPU (heads, MLP width, fc input columns and the vocabulary split;
    o_proj / down / fc / embedding all-reduced): the gathered logits equal the TP = 1 float64 reference."""
    import threading
    import cupy as cp
    from ddtree_cupy.models.drafter import GpuDrafter, GpuDrafterWeights
    dcfg, tp = tiny["dcfg"], 2
    V, D, nf, H = dcfg.vocab_size, dcfg.block_size - 1, dcfg.num_context_features, dcfg.hidden_size
    Vl = V // tp
    rng = np.random.default_rng(5)
    steps, prev = [], (0, 0, 0)
    for have in SCHEDULE:
        calls = step_calls(rng, tiny["feats"], prev, have, 1, nf, H, MAX_APPEND)
        steps.append((calls, rng.integers(0, V, MAX_STREAMS).astype(np.int32), np.array(list(have) + [0], np.int32)))
        prev = have
    shared = {"size": tp, "barrier": threading.Barrier(tp), "slots": [None] * tp}
    results, errors = [[] for _ in range(tp)], []

    def rank_main(r):
        try:
            comm = _ThreadComm(r, shared)
            w = GpuDrafterWeights.from_checkpoint(tiny["dd"], dcfg, r, tp)
            tgt = StandInTarget(tiny["embed_bits"][r * Vl:(r + 1) * Vl], tiny["lm_bits"][r * Vl:(r + 1) * Vl],
                                vocab_start=r * Vl, comm=comm)
            dr = GpuDrafter(dcfg, w, tgt, comm, max_streams=MAX_STREAMS, max_ctx=64, max_append=MAX_APPEND)
            for calls, bonus, ctx in steps:
                for f, sid, pos in calls:
                    dr.append_context(cp.asarray(f), cp.asarray(sid), cp.asarray(pos))
                out = cp.full((MAX_STREAMS, D, Vl), np.nan, cp.float32)
                dr.draft(cp.asarray(bonus), cp.asarray(ctx), cp.asarray(ctx), out)
                results[r].append(out.get())
        except BaseException as e:     # noqa: BLE001 - reported by the main thread
            errors.append((r, e))
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, f"rank errors: {errors}"
    ref = ReferenceDrafter(dcfg, tiny["dw"], tiny["embed"], tiny["lm"], np.float64)
    caches, prev = [ref.new_cache() for _ in LENS], (0, 0, 0)
    for i, (have, (_, bonus, ctx)) in enumerate(zip(SCHEDULE, steps)):
        got = np.concatenate([results[r][i] for r in range(tp)], axis=-1)
        refs = reference_drafts(ref, caches, tiny["feats"], prev, have, bonus)
        refs.append(ref.draft(ref.new_cache(), int(bonus[3]), 0))
        for b in range(MAX_STREAMS):
            e = rel(got[b], refs[b])
            assert e < TOL, f"TP=2 step {i} slot {b}: rel err {e:.3e}"
        prev = have


def test_bad_inputs_raise(tiny):
    import cupy as cp
    dcfg = tiny["dcfg"]
    dr = make_drafter(tiny, dcfg, 64)
    V, D, nf, H = dcfg.vocab_size, dcfg.block_size - 1, dcfg.num_context_features, dcfg.hidden_size
    i32 = lambda n: cp.zeros(n, cp.int32)
    with pytest.raises(ValueError, match="feats"):
        dr.append_context(cp.zeros((MAX_APPEND + 1, nf, H), cp.uint16), i32(MAX_APPEND + 1), i32(MAX_APPEND + 1))
    with pytest.raises(ValueError, match="positions"):
        dr.append_context(cp.zeros((3, nf, H), cp.uint16), i32(3), cp.zeros(3, cp.int64))
    with pytest.raises(ValueError, match="out"):
        dr.draft(i32(2), i32(2), i32(2), cp.zeros((2, D + 1, V), cp.float32))
    with pytest.raises(ValueError, match="max_streams"):
        dr.draft(i32(5), i32(5), i32(5), cp.zeros((5, D, V), cp.float32))
    with pytest.raises(ValueError, match="max_ctx"):
        make_drafter(tiny, dcfg.with_options(draft_window=65), 64)
    # the ring grows to max_append: one call's rows of a stream must fall in distinct slots
    from ddtree_cupy.models.drafter import GpuDrafter
    small = GpuDrafter(dcfg.with_options(draft_window=8), dr.w, dr.target, None, max_streams=2, max_ctx=8,
                       max_append=40)
    assert small.C == 40 and small.k_cache[0].shape == (2, 40, dcfg.num_key_value_heads, 128)


# ---------------------------------------------------------------------------------------------------
# benchmark: Kimi drafter, one TP8 rank (random weights), all-reduces replaced by a no-op

class _RankComm:
    """Rank 0 of 8 with no peers: all-reduce is the identity (the benchmark times one rank's kernels)."""
    rank, size = 0, 8

    def all_reduce(self, x):
        return x


def bench(streams=(1, 4, 8, 16), ctx=4096, reps=20):
    import cupy as cp
    from _kernel_testutil import copy_bandwidth, graph_us
    from ddtree_cupy.models.drafter import GpuDrafter, GpuDrafterWeights
    cfg = DrafterConfig.load(os.path.join(os.path.dirname(__file__), "..", "data", "kimi-k2.5-dflash-drafter.json"))
    cfg = cfg.with_options(draft_window=ctx)
    w = GpuDrafterWeights.random(cfg, 0, 8, seed=1)
    V, H = cfg.vocab_size // 8, cfg.hidden_size
    rs = cp.random.default_rng(2)
    from ddtree_cupy.models.drafter import f32_to_bf16_bits_gpu
    emb = f32_to_bf16_bits_gpu(rs.standard_normal((V, H), dtype=cp.float32))
    lm = f32_to_bf16_bits_gpu(rs.standard_normal((V, H), dtype=cp.float32) * np.float32(H ** -0.5))
    tgt = StandInTarget(emb, lm)
    # copy bandwidth measured here: the ceiling for a pass that must read every weight once
    bw = copy_bandwidth(1 << 29, 10)
    layer_bytes = w.nbytes - w.fc.nbytes - w.ctx_kv.nbytes
    print(f"Kimi drafter TP8 rank: weights {w.nbytes / 1e6:.0f} MB (block layers {layer_bytes / 1e6:.0f} MB, "
          f"fc shard {w.fc.nbytes / 1e6:.0f} MB, ctx k/v {w.ctx_kv.nbytes / 1e6:.0f} MB), lm_head slice "
          f"{lm.nbytes / 1e6:.0f} MB, copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'S':>3} {'ctx':>5} {'draft us':>9} {'ceil us':>8} {'append(4S) us':>14} {'ceil us':>8}")
    for S in streams:
        dr = GpuDrafter(cfg, w, tgt, _RankComm(), max_streams=S, max_ctx=ctx, max_append=8 * S)
        n = 4 * S
        f = cp.asarray(to_bf16_bits(np.random.default_rng(0).standard_normal((n, cfg.num_context_features, H))))
        sid = cp.asarray(np.repeat(np.arange(S, dtype=np.int32), 4))
        pos = cp.asarray(np.tile(np.arange(ctx - 4, ctx, dtype=np.int32), S))
        bonus, start = cp.zeros(S, cp.int32), cp.full(S, ctx, cp.int32)
        clen = cp.full(S, ctx, cp.int32)
        out = cp.empty((S, cfg.block_size - 1, V), cp.float32)
        times = {}
        for name, fn in (("draft", lambda: dr.draft(bonus, start, clen, out)),
                         ("append", lambda: dr.append_context(f, sid, pos))):
            fn()
            times[name] = graph_us(fn, cp.cuda.Stream(non_blocking=True), reps)
        kv_read = 2 * S * min(ctx, cfg.draft_window or ctx) * 128 * 2 * cfg.num_hidden_layers
        ceil_d = (layer_bytes + lm.nbytes + kv_read) / bw * 1e6
        ceil_a = (w.fc.nbytes + w.ctx_kv.nbytes) / bw * 1e6
        print(f"{S:>3} {ctx:>5} {times['draft']:>9.1f} {ceil_d:>8.1f} {times['append']:>14.1f} {ceil_a:>8.1f}")


if __name__ == "__main__":
    if "--bench" in sys.argv:
        bench()
