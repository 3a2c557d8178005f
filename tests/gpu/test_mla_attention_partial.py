"""GPU: MLA split-KV with bf16 partials (kernels/attention.py PARTIAL_BF16 / DDT_MLA_PARTIAL_BF16, the
MLA_PART_BF16 build of cuda_src/mla_attention.cu) next to today's fp32 partials,
docs/history/2026-11-29-attention.md "bf16 split partials".

Every test runs both variants (parameter ``part``). Besides the float64 reference (relative norm per stream,
the same TOL as test_mla_attention.py), the bf16 runs are checked against the fp32 build at the same plan:
  * the main kernels are the same code up to the partial store (the PTX differs only there), so the bf16
    partials must be the fp32 partials rounded to nearest even, bit for bit, and the log2-sum-exps equal bit
    for bit, for every (owned packed row, split); a wrong row, column or split index in the store fails here;
  * the combine must equal the float64 merge of the bf16 partials it read, up to the output's own bf16
    rounding (<= 2^-8 relative per element);
  * the final outputs of the two variants differ by at most the error analysis' bound u (R + 2), u = 2^-8,
    R = || sum_i w_i |o_i| || / (W || o ||) from the fp32 partials.
Workspaces and outputs are poisoned (NaN) before every launch; rows no stream owns must stay poisoned in both.
"""
import os
import sys

import numpy as np
import pytest

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
from ddtree_cupy.reference import attention as ra

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_mla_attention as base  # noqa: E402  (case builder and reference of the fp32 suite)

pytestmark = pytest.mark.gpu

SCALE = base.SCALE
POISON = base.POISON
TOL = base.TOL
U_BF16 = 2.0 ** -8     # unit roundoff of bf16 (8 significant bits, round to nearest even)
PARTS = [pytest.param(False, id="fp32"), pytest.param(True, id="bf16")]


def cp():
    import cupy
    return cupy


def attn():
    from ddtree_cupy.kernels import attention
    return attention


def fits(cfg):
    return cfg.smem <= cp().cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]


def launch(c, d, cfg, splits, part, unroll=None):
    """One launch with a fresh poisoned workspace; returns (out, part_o, part_lse) on the host."""
    x = cp()
    a = attn()
    ws = a.MlaWorkspace(splits, c["T"], c["H"], part_bf16=part)
    assert ws.part_o.dtype == (x.uint16 if part else x.float32)
    if part:
        ws.part_o.fill(POISON)
    else:
        ws.part_o.fill(np.nan)
    ws.part_lse.fill(np.nan)
    out = x.full((c["T"], c["H"], 512), POISON, dtype=x.uint16)
    a.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"], mask=d["mask"],
                    softmax_scale=SCALE, max_rows=c["max_rows"], max_kv_len=c["max_kv"], out=out, config=cfg,
                    num_splits=splits, workspace=ws, part_bf16=part, combine_unroll_override=unroll)
    x.cuda.get_current_stream().synchronize()
    return out.get(), ws.part_o.get(), ws.part_lse.get()


def owned_packed(c):
    return np.repeat(base.owned_rows(c), c["H"])


def partial_f64(part_o, part):
    return (bf16_bits_to_f32(part_o) if part else part_o).astype(np.float64)


def merge_f64(po, lse):
    """float64 merge of partials po [k, P, 512] with log2-sum-exps lse [k, P] (empty splits weigh 0)."""
    fin = np.isfinite(lse)
    mx = np.where(fin, lse, -np.inf).max(0)
    w = np.where(fin, np.exp2(np.where(fin, lse, 0.0) - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
    W = w.sum(0)
    o = np.einsum("kp,kpd->pd", w, np.where(fin[..., None], po, 0.0))
    return o / np.where(W > 0, W, 1.0)[:, None], w, W


def check_one(c, d, cfg, splits, part, label, ref, unroll=None):
    """Run the variant ``part`` at (cfg, splits); checks vs float64 and, for bf16, vs the fp32 build."""
    got, po, lse = launch(c, d, cfg, splits, part, unroll)
    base.check(c, got, label, ref)
    if splits == 1:
        return got
    own = owned_packed(c)
    # the main kernels write partials only for owned packed rows, every split (an empty one: zeros, -inf)
    assert np.isnan(lse[:, ~own]).all(), f"{label}: lse written for rows no stream owns"
    if part:
        assert (po[:, ~own] == POISON).all(), f"{label}: partials written for rows no stream owns"
    else:
        assert np.isnan(po[:, ~own]).all(), f"{label}: partials written for rows no stream owns"
    assert not np.isnan(lse[:splits, own]).any(), f"{label}: a split left an owned row's lse unwritten"
    if not part:
        return got
    got32, po32, lse32 = launch(c, d, cfg, splits, False, unroll)
    # 1. same main-kernel arithmetic: lse bit for bit, bf16 partials = RNE(fp32 partials) bit for bit
    assert np.array_equal(lse[:splits, own].view(np.uint32), lse32[:splits, own].view(np.uint32)), \
        f"{label}: lse differs from the fp32 build"
    want = to_bf16_bits(po32[:splits, own])
    bad = po[:splits, own] != want
    assert not bad.any(), f"{label}: {int(bad.sum())} bf16 partials are not the rounded fp32 partials " \
                          f"(first at split/row/col {np.argwhere(bad)[0].tolist()})"
    # 2. the combine: the float64 merge of the bf16 partials it read, up to the output's bf16 rounding
    g = bf16_bits_to_f32(got.reshape(-1, 512)[own]).astype(np.float64)
    m16, _, _ = merge_f64(partial_f64(po[:splits, own], True), lse[:splits, own].astype(np.float64))
    err = np.linalg.norm(g - m16) / np.linalg.norm(m16)
    assert err <= U_BF16 * 1.01 + 1e-6, f"{label}: combine vs float64 merge of its bf16 partials {err:.2e}"
    # 3. bf16 vs fp32 outputs within the error analysis' bound u (R + 2)
    o32 = po32[:splits, own].astype(np.float64)
    l32 = lse32[:splits, own].astype(np.float64)
    m32, w, W = merge_f64(o32, l32)
    spread = np.einsum("kp,kpd->pd", w, np.abs(np.where(np.isfinite(l32)[..., None], o32, 0.0)))
    spread /= np.where(W > 0, W, 1.0)[:, None]
    R = np.linalg.norm(spread) / np.linalg.norm(m32)
    g32 = bf16_bits_to_f32(got32.reshape(-1, 512)[own]).astype(np.float64)
    diff = np.linalg.norm(g - g32) / np.linalg.norm(g32)
    assert diff <= U_BF16 * (R + 2) * 1.01 + 1e-6, f"{label}: bf16 vs fp32 {diff:.2e} > u (R + 2), R = {R:.2f}"
    return got


def plans(c, part):
    """(label, config, splits) for every configuration the planner can pick, at this shape: the default
    policy's plan, the model policy's plan, and each tile config (its measured split count) that fits."""
    x = cp()
    a = attn()
    S, n, H, L = c["S"], c["max_rows"], c["H"], c["max_kv"]
    out = [("planned",) + a.plan_mla(S, n, H, L, part_bf16=part),
           ("model",) + a.plan_mla(S, n, H, L, policy="model", part_bf16=part)]
    sms = x.cuda.Device().attributes["MultiProcessorCount"]
    for key, cfg in a.MLA_CONFIGS.items():
        if fits(cfg):
            out.append((key, cfg, a.mla_num_splits(S, n, H, L, sms, cfg, a._blocks_per_sm(cfg))))
    return out


# the engine's decode shapes (streams x tree rows, 8 heads) at contexts that give several splits
DECODE = {"1x8": (1, 8, [1500]), "4x16": (4, 16, [1200, 700, 64, 1535]),
          "10x8": (10, 8, [900, 1000, 64, 0, 1300, 65, 511, 1400, 7, 1020])}


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("shape", sorted(DECODE))
def test_every_planned_config_at_decode_shapes(shape, part):
    S, n, s_list = DECODE[shape]
    rng = np.random.default_rng(31 + S + n)
    c = base.make_case(rng, S, 8, [n] * S, s_list, "tree")
    d = base.to_dev(c)
    ref = base.reference(c)
    split_seen = False
    for label, cfg, splits in plans(c, part):
        check_one(c, d, cfg, splits, part, f"{shape} {label} ({cfg.name} x{splits})", ref)
        split_seen |= splits > 1
    assert split_seen, "no plan split: the test would not cover the partials"


@pytest.mark.parametrize("part", PARTS)
def test_ragged_streams_and_forced_split_counts(part):
    """Streams of 1-16 rows over prefixes 0 .. 3100 (page edges, empty splits for the short ones at 17 / 64
    splits), both combine variants (U = 4 and 1)."""
    a = attn()
    rng = np.random.default_rng(37)
    n_list = [1, 16, 5, 9, 2, 13]
    s_list = [0, 63, 64, 2000, 3100, 777]
    c = base.make_case(rng, 6, 8, n_list, s_list, "tree")
    d = base.to_dev(c)
    ref = base.reference(c)
    cfg, planned = a.plan_mla(c["S"], c["max_rows"], 8, c["max_kv"], part_bf16=part)
    for splits in (planned, 3, 17, 64):
        for u in (4, 1):
            check_one(c, d, cfg, splits, part, f"ragged {cfg.name} x{splits} U={u}", ref, unroll=u)
    for key in ("ks16", "ks16_2stage", "small"):   # a 16-row tile and an sm_120 mla_attn_fwd tile
        if fits(a.MLA_CONFIGS[key]):
            check_one(c, d, a.MLA_CONFIGS[key], 7, part, f"ragged {key} x7", ref)


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("unroll", [4, 1])
@pytest.mark.parametrize("num_splits", [2, 33, 256])
def test_combine_kernel_alone(num_splits, unroll, part):
    """mla_attn_combine of each build on random partials of its dtype (30% of the splits empty, their partial
    NaN: reading one would poison the row), a row with every split empty (zeros), an unowned row (stays
    poisoned), against the float64 merge of exactly the values it was given."""
    x = cp()
    a = attn()
    from ddtree_cupy.kernels.compile import get_kernel
    rng = np.random.default_rng(41 + num_splits)
    S, H, T = 3, 8, 8
    n = np.array([3, 1, 2], np.int32)
    row_start = np.array([0, 4, 6], np.int32)     # row 3 belongs to no stream
    P = T * H
    lse = rng.uniform(-8, 8, (num_splits, P)).astype(np.float32)
    lse[rng.random((num_splits, P)) < 0.3] = -np.inf
    lse[:, 5] = -np.inf
    po32 = rng.standard_normal((num_splits, P, 512)).astype(np.float32)
    po32[np.isneginf(lse)] = np.nan
    po = to_bf16_bits(po32) if part else po32
    out = x.full((T, H, 512), POISON, dtype=x.uint16)
    comb = get_kernel(a.mla_spec(part), f"mla_attn_combine<{unroll}>")
    comb((int(n.max()) * H, S), (256,), (x.asarray(po), x.asarray(lse), x.asarray(n), x.asarray(row_start),
                                         np.int32(H), np.int32(P), np.int32(num_splits), out))
    got_bits = out.get().reshape(P, 512)
    own = np.repeat(base.owned_rows(dict(T=T, S=S, n=n, row_start=row_start)), H)
    assert (got_bits[~own] == POISON).all(), "rows no stream owns were written"
    got = bf16_bits_to_f32(got_bits).astype(np.float64)
    vals = partial_f64(po, part)
    for m in np.nonzero(own)[0]:
        ok = np.isfinite(lse[:, m])
        if not ok.any():
            assert (got[m] == 0).all(), f"row {m}: all splits empty must give zeros"
            continue
        w = np.exp2(lse[ok, m].astype(np.float64) - lse[ok, m].max())
        ref = (w[:, None] * vals[ok, m]).sum(0) / w.sum()
        err = np.linalg.norm(got[m] - ref) / np.linalg.norm(ref)
        assert err <= U_BF16 * 1.01 + 1e-6, f"row {m}: rel err {err:.2e}"   # the output's bf16 rounding


@pytest.mark.parametrize("part", PARTS)
def test_graph_replay_with_the_workspace(part):
    """Capture (PDL on where the GPU has it) with a workspace of the variant's dtype, replay with new lengths,
    trees and queries written in place: equal to eager launches bit for bit, and correct."""
    x = cp()
    a = attn()
    from ddtree_cupy.kernels import launch as kl
    rng = np.random.default_rng(43)
    S, H, R = 4, 8, 16
    c = base.make_case(rng, S, H, [R] * S, [900, 1000, 64, 1400], "tree", gap=False, max_rows=R)
    c["max_kv"] = 2048
    c["table"] = np.pad(c["table"], ((0, 0), (0, 32 - c["table"].shape[1])), constant_values=-1)
    extra = rng.permutation(S * 32).astype(np.int32) + c["pool"].shape[0]
    c["pool"] = np.concatenate([c["pool"], to_bf16_bits(rng.standard_normal((S * 32, 64, 576)))])
    for b in range(S):
        have = int((c["table"][b] >= 0).sum())
        c["table"][b, have:32] = extra[b * 32:b * 32 + 32 - have]
    d = base.to_dev(c)
    cfg, splits = a.plan_mla(S, R, H, 2048, part_bf16=part)
    assert splits > 1, "the graph test must cover the split + combine path"
    ws = a.MlaWorkspace(splits, c["T"], H, part_bf16=part)
    out = x.full((c["T"], H, 512), POISON, dtype=x.uint16)
    stream = x.cuda.Stream(non_blocking=True)
    pdl = int(x.cuda.Device().compute_capability) >= 90

    def call():   # no part_bf16: the launch follows the workspace's dtype
        a.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"], mask=d["mask"],
                        softmax_scale=SCALE, max_rows=R, max_kv_len=2048, out=out, workspace=ws, config=cfg)
    try:
        kl.set_pdl(pdl)
        with stream:
            call()     # eager first: compiles and loads the module outside the capture
            stream.synchronize()
            stream.begin_capture()
            call()
            graph = stream.end_capture()
        for step in range(2):
            n_new = rng.integers(1, R + 1, S).astype(np.int32)
            s_new = np.array([int(rng.integers(0, 2048 - k)) for k in n_new], np.int32)
            mask_new = np.zeros((S, 129, 5), np.uint32)
            for b in range(S):
                par = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n_new[b])])
                mask_new[b] = ra.ancestor_mask_bits(par, 129)
            q_new = to_bf16_bits(rng.standard_normal(c["q"].shape) * 0.5)
            d["n"][...] = x.asarray(n_new)
            d["prefix"][...] = x.asarray(s_new)
            d["mask"][...] = x.asarray(mask_new)
            d["q"][...] = x.asarray(q_new)
            out[...] = POISON
            ws.part_o.fill(POISON if part else np.nan)
            x.cuda.Stream.null.synchronize()
            graph.launch(stream)
            stream.synchronize()
            replay = out.get()
            kl.set_pdl(False)
            c2 = dict(c, n=n_new, prefix=s_new, mask=mask_new, q=q_new)
            eager, _, _ = launch(c2, base.to_dev(c2), cfg, splits, part)
            kl.set_pdl(pdl)
            assert np.array_equal(replay, eager), f"step {step}: graph replay differs from eager"
            base.check(c2, replay, f"graph step {step}")
    finally:
        kl.set_pdl(False)


def test_the_rule_reaches_workspace_plan_and_launch(monkeypatch):
    """DDT_MLA_PARTIAL_BF16 overrides PARTIAL_BF16 for the workspace dtype, the plan and a config-less launch;
    a workspace or a build of the other dtype is refused, naming the argument."""
    x = cp()
    a = attn()
    rng = np.random.default_rng(47)
    c = base.make_case(rng, 1, 8, [8], [1500], "tree")
    d = base.to_dev(c)
    cfg, splits = a.plan_mla(1, 8, 8, c["max_kv"], part_bf16=True)
    assert splits > 1
    explicit, _, _ = launch(c, d, cfg, splits, True)
    monkeypatch.setattr(a, "PARTIAL_BF16", False)
    monkeypatch.setenv("DDT_MLA_PARTIAL_BF16", "1")
    assert a.mla_partial_bf16()
    ws = a.MlaWorkspace(splits, c["T"], 8)
    assert ws.part_bf16 and ws.part_o.dtype == x.uint16
    assert ws.nbytes == a.MlaWorkspace.nbytes_for(splits, c["T"], 8, True)
    assert a.plan_mla(1, 8, 8, c["max_kv"]) == (cfg, splits)
    out = x.full((c["T"], 8, 512), POISON, dtype=x.uint16)
    kw = dict(mask=d["mask"], softmax_scale=SCALE, max_rows=8, max_kv_len=c["max_kv"], out=out)
    args = (d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"])
    a.mla_attention(*args, **kw)                      # rule -> bf16 plan, bf16 workspace, bf16 build
    x.cuda.get_current_stream().synchronize()
    assert np.array_equal(out.get(), explicit)
    monkeypatch.setenv("DDT_MLA_PARTIAL_BF16", "0")
    ws32 = a.MlaWorkspace(splits, c["T"], 8)
    assert not ws32.part_bf16 and ws32.part_o.dtype == x.float32
    with pytest.raises(ValueError, match="workspace"):
        a.mla_attention(*args, **kw, workspace=ws32, part_bf16=True)
    with pytest.raises(ValueError, match="spec"):
        a.mla_attention(*args, **kw, workspace=ws, spec=a.MLA_SPEC)
    monkeypatch.setenv("DDT_MLA_PARTIAL_BF16", "2")
    with pytest.raises(ValueError, match="DDT_MLA_PARTIAL_BF16"):
        a.mla_attention(*args, **kw)
