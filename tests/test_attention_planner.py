"""CPU checks of the MLA split / tile planner (ddtree_cupy/kernels/attention.py, docs/ATTENTION.md "Planner"):
both policies give valid plans for every shape the engine uses on the H200 and on the RTX PRO 6000 (sm_120,
99 KB per block), the "measured" policy is still the rule every committed figure was measured with, the
cost model still reproduces the H200 measurements it was fitted to, and the "model" policy picks the
modelled optimum and never a plan it models slower than the measured one. No GPU needed."""
import json
import math
import os

import numpy as np
import pytest

from ddtree_cupy.kernels import attention as A

# (SMs, shared memory per block opt-in, per SM) as CUDA reports them
H200 = (132, 232448, 233472)
RTX_PRO_6000 = (188, 101376, 102400)   # sm_120: 99 KB per block, 100 KB per SM
ARCHS = {"h200": H200, "sm120": RTX_PRO_6000}
SM120_SMEM = 99 * 1024

# The H200 attention run the planner's measured table and cost model were fitted to (2026-11-29), kept as
# test data: bench/results/ holds only the latest run of each benchmark.
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "attention_planner_fit_h200.json")

# the engine's shape buckets: 1-10 streams x 1..65 verify rows (tree <= 64 + root) at 8 heads (TP8), and
# 64 heads at TP1; contexts 1K-256K
STREAMS = (1, 2, 4, 7, 10)
ROWS = (1, 2, 5, 8, 16, 17, 32, 33, 48, 64, 65)
CTXS = (1024, 4096, 16384, 32768, 65536, 131072, 262144)
GRID = [(S, n, H, c) for S in STREAMS for n in ROWS for H in (8, 64) for c in CTXS]


def name_of(cfg):
    return next(k for k, v in A.MLA_CONFIGS.items() if v == cfg)


def plan(S, n, H, ctx, policy, arch):
    return A.plan_mla_for(S, n, H, ctx + n, policy, *ARCHS[arch])


def cost(cfg, k, S, n, H, ctx, arch):
    num_sms, _, smem_sm = ARCHS[arch]
    return A.mla_cost_us(name_of(cfg), k, S, n, H, ctx + n, num_sms, A._blocks_per_sm(cfg, smem_sm))


@pytest.mark.parametrize("part_bf16", (False, True), ids=("fp32", "bf16"))
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("policy", ("measured", "model"))
def test_every_engine_shape_gets_a_valid_plan(policy, arch, part_bf16):
    limit = ARCHS[arch][1]
    seen = set()
    for S, n, H, c in GRID:
        cfg, k = A.plan_mla_for(S, n, H, c + n, policy, *ARCHS[arch], part_bf16)
        key = name_of(cfg)
        seen.add(key)
        assert cfg.smem <= limit, (S, n, H, c, key)
        if arch == "sm120":
            assert cfg.smem <= SM120_SMEM, (S, n, H, c, key)
        kv_tiles = -(-(c + n) // cfg.bn)
        assert 1 <= k <= min(kv_tiles, A.MAX_SPLITS), (S, n, H, c, key, k)
        if policy == "model" and k > 1 and (cfg, k) != plan(S, n, H, c, "measured", arch):
            per = -(-kv_tiles // k)
            assert (k - 1) * per < kv_tiles, f"{(S, n, H, c)}: split {k - 1} of {k} would be empty"
            ws = k * S * n * H * (A.LATENT_DIM * (2 if part_bf16 else 4) + 4)
            assert ws <= A.MLA_MAX_WORKSPACE, (S, n, H, c, k)
        if cfg.bm == 16:   # a 16-row tile only where one m-tile holds a stream
            assert n * H <= 16, (S, n, H, c, key)
    if arch == "sm120":
        assert seen <= {"small", "ks16_2stage", "ks32_2stage"}, seen
    else:
        assert "large" in seen and "ks16" in seen, seen


def test_measured_policy_is_the_rule_of_the_committed_figures():
    """The default policy must keep planning exactly what tests/data/attention_planner_fit_h200.json measured
    (16-row ksplit tile for decode, the 64-row mla_attn_fwd tile above, splits filling the SMs once)."""
    with open(RESULTS) as f:
        rows = json.load(f)["mla"]
    for r in rows:
        cfg, k = plan(r["streams"], r["rows"], 8, r["ctx"], "measured", "h200")
        assert (cfg.name, k) == (r["config"], r["splits"]), r
    assert A.MLA_POLICY in A.MLA_POLICIES


def _fit_points():
    """(config key, streams, rows, kv_len, splits, measured us) of the H200 run the model was fitted to."""
    with open(RESULTS) as f:
        d = json.load(f)
    pts = []
    for r in d["mla"]:
        L = r["ctx"] + r["rows"]
        if r["rows"] == 1:
            pts.append(("ks16", r["streams"], 1, L, r["splits"], r["us"]))
        else:
            pts.append(("large", r["streams"], r["rows"], L, r["splits"], r["us"]))
            if r.get("ks32_us"):
                pts.append(("ks32", r["streams"], r["rows"], L, r["ks32_splits"], r["ks32_us"]))
    for p in d["probe"]:
        key = "ks16" if p["rows"] == 1 else "ks32"
        for k, v in p.items():
            if k.startswith("splits"):
                pts.append((key, p["streams"], p["rows"], p["ctx"] + p["rows"], int(k[6:]), v))
    return pts


def test_cost_model_reproduces_the_h200_measurements():
    pts = _fit_points()
    assert len(pts) >= 120
    logs = []
    for key, S, n, L, k, us in pts:
        cfg = A.MLA_CONFIGS[key]
        t = A.mla_cost_us(key, k, S, n, 8, L, H200[0], A._blocks_per_sm(cfg, H200[2]))
        logs.append(math.log(t / us))
    logs = np.array(logs)
    rms = float(np.sqrt(np.mean(logs ** 2)))
    assert rms < 0.08, f"rms log error {rms:.3f}: the constants no longer describe the measurements"
    assert np.exp(logs).min() > 0.75 and np.exp(logs).max() < 1.35, (np.exp(logs).min(), np.exp(logs).max())
    # the partial-second-wave effect the model exists for: 1 x 32 x 64K with ks32 at 17 splits (136 blocks)
    # costs far more than at 16 (128 blocks), and 1 x 64 x 4K with `large` at 17 splits does not (short last split)
    c = lambda key, k, S, n, L: A.mla_cost_us(key, k, S, n, 8, L, H200[0], 1)
    assert c("ks32", 17, 1, 32, 65568) > 1.5 * c("ks32", 16, 1, 32, 65568)
    assert c("large", 17, 1, 64, 4160) < 1.3 * c("large", 16, 1, 64, 4160)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_model_policy_picks_the_modelled_optimum_and_never_a_modelled_loss(arch):
    num_sms, smem_block, smem_sm = ARCHS[arch]
    rng = np.random.default_rng(5)
    for i in rng.permutation(len(GRID))[:80]:
        S, n, H, c = GRID[i]
        mcfg, mk = plan(S, n, H, c, "measured", arch)
        cfg, k = plan(S, n, H, c, "model", arch)
        t = cost(cfg, k, S, n, H, c, arch)
        t_meas = cost(mcfg, mk, S, n, H, c, arch)
        assert t <= t_meas * (1 + 1e-9), (S, n, H, c)
        if (cfg, k) != (mcfg, mk):
            assert t <= A.MLA_MODEL_MARGIN * t_meas * (1 + 1e-9), (S, n, H, c)
        # brute force over every candidate config and split count
        best = min(cost(A.MLA_CONFIGS[key], kk, S, n, H, c, arch)
                   for key in A._model_candidates(n * H, smem_block)
                   for kk in A.mla_split_candidates(A.MLA_CONFIGS[key], S, n, H, c + n))
        if (cfg, k) != (mcfg, mk):
            assert t <= best * 1.001 + 1e-9, (S, n, H, c, name_of(cfg), k, t, best)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_modelled_time_grows_with_the_work(arch):
    """More context, more streams or more rows never make the planned call cheaper in the model, beyond
    the margin by which the model keeps a measured plan it does not beat by 10% (so a bigger shape may be
    planned up to that much cheaper than a smaller one that kept its measured plan), and the modelled time
    stays above the bytes the call must read at the fitted DRAM rate."""
    slack = 0.98 * A.MLA_MODEL_MARGIN
    for H in (8, 64):
        for S in STREAMS:
            for n in ROWS:
                prev = 0.0
                for c in CTXS:
                    cfg, k = plan(S, n, H, c, "model", arch)
                    t = cost(cfg, k, S, n, H, c, arch)
                    assert t >= prev * slack, (S, n, H, c, t, prev)
                    assert t >= S * (c + n) * 1152 / (A.MLA_DRAM_GBPS * 1e3), (S, n, H, c)
                    prev = t
    for c in CTXS:
        for n in ROWS:
            prev = 0.0
            for S in STREAMS:
                cfg, k = plan(S, n, 8, c, "model", arch)
                t = cost(cfg, k, S, n, 8, c, arch)
                assert t >= prev * slack, (S, n, c, t, prev)
                prev = t
        for S in STREAMS:
            prev = 0.0
            for n in ROWS:
                cfg, k = plan(S, n, 8, c, "model", arch)
                t = cost(cfg, k, S, n, 8, c, arch)
                assert t >= prev * slack, (S, n, c, t, prev)
                prev = t


def test_model_splits_long_contexts_and_avoids_the_nearly_empty_second_wave():
    """Decode of one stream at 256K is split over (nearly) every SM by either policy; where the measured
    rule lands just past a multiple of the SM count on a long context (10 x 64 rows x 64K: 160 blocks of
    1025 tiles; 1 x 64 x 64K: 136 blocks) the model plans a clearly cheaper grid."""
    for policy in ("measured", "model"):
        cfg, k = plan(1, 1, 8, 262144, policy, "h200")
        assert k >= 100, (policy, k)
    for S, n in ((10, 64), (1, 64)):
        mcfg, mk = plan(S, n, 8, 65536, "measured", "h200")
        cfg, k = plan(S, n, 8, 65536, "model", "h200")
        assert cost(cfg, k, S, n, 8, 65536, "h200") < 0.7 * cost(mcfg, mk, S, n, 8, 65536, "h200")


def test_policy_switch(monkeypatch):
    monkeypatch.setattr(A, "_device_attrs", lambda: H200[:2])
    monkeypatch.setattr(A, "_smem_per_sm", lambda: H200[2])
    monkeypatch.setattr(A, "_device_arch", lambda: "sm_90")
    prev = A.set_mla_policy("model")
    try:
        # "auto": the fitted model on sm_90, the measured rule elsewhere
        assert A.plan_mla(10, 16, 8, 32784, policy="auto") == A.plan_mla_for(10, 16, 8, 32784, "model", *H200)
        assert A.resolve_policy("auto", "sm_90") == "model" and A.resolve_policy("auto", "sm_120") == "measured"
        assert A.resolve_policy("measured", "sm_90") == "measured"
        with pytest.raises(ValueError, match="auto"):
            A.plan_mla_for(10, 16, 8, 32784, "auto", *H200)
        assert A.MLA_POLICY == "model"
        assert A.plan_mla(10, 16, 8, 32784) == A.plan_mla_for(10, 16, 8, 32784, "model", *H200)
        assert A.plan_mla(10, 16, 8, 32784, policy="measured") == A.plan_mla_for(10, 16, 8, 32784, "measured", *H200)
        assert A.plan_mla(10, 16, 8, 32784) != A.plan_mla(10, 16, 8, 32784, policy="measured")
        assert A.set_mla_policy("measured") == "model"
        assert A.plan_mla(10, 16, 8, 32784) == A.plan_mla_for(10, 16, 8, 32784, "measured", *H200)
        with pytest.raises(ValueError, match="policy"):
            A.set_mla_policy("fastest")
        with pytest.raises(ValueError, match="policy"):
            A.plan_mla(1, 1, 8, 100, policy="fastest")
    finally:
        A.set_mla_policy(prev)


def test_combine_unroll_rule_matches_the_h200_pairs():
    """combine_unroll: 4 splits per warp in flight while the combine grid fits 2 blocks per SM, 1 past that;
    the shapes are the H200 run's measured pairs (docs/history/2026-11-29-attention.md, "Fixed cost, combine,
    drafter on tensor cores"): the faster variant there."""
    sms = H200[0]
    faster = {(1, 1): 4, (1, 8): 4, (4, 1): 4, (10, 1): 4, (1, 32): 4, (4, 8): 4,    # <= 256 packed rows
              (4, 16): 1, (10, 8): 1, (10, 16): 1, (4, 32): 1, (10, 32): 1}          # >= 512 packed rows
    for (S, n), u in faster.items():
        assert A.combine_unroll(S * n * 8, sms) == u, (S, n)
    assert A.combine_unroll(2 * sms, sms) == 4 and A.combine_unroll(2 * sms + 1, sms) == 1


def test_every_sm120_candidate_and_the_drafter_fit_99_kb():
    for key in A._model_candidates(16, SM120_SMEM):
        assert A.MLA_CONFIGS[key].smem <= SM120_SMEM, key
    assert A.DRAFTER_SMEM <= SM120_SMEM
    assert A.MLA_CONFIGS["ks16_5stage"].smem <= H200[1]   # the H200-only deep tile still fits there


# ---- bf16 split partials (PARTIAL_BF16 / DDT_MLA_PARTIAL_BF16, docs/history/2026-11-29-attention.md "bf16 split partials") ----------------

def test_partial_bf16_env_parsing_and_rule(monkeypatch):
    for v in ("1", "true", "ON", " yes "):
        assert A.parse_partial_bf16(v) is True, v
    for v in ("0", "false", "Off", "no"):
        assert A.parse_partial_bf16(v) is False, v
    assert A.parse_partial_bf16(None) is None and A.parse_partial_bf16("") is None
    for v in ("2", "bf16", "fp32", "-1"):
        with pytest.raises(ValueError, match="DDT_MLA_PARTIAL_BF16"):
            A.parse_partial_bf16(v)
    assert A.PARTIAL_BF16 is False, "fp32 by default: bf16 failed an engine accuracy test (ATTENTION.md, History)"
    monkeypatch.delenv("DDT_MLA_PARTIAL_BF16", raising=False)
    assert A.mla_partial_bf16() is False
    monkeypatch.setattr(A, "PARTIAL_BF16", True)
    assert A.mla_partial_bf16() is True              # the module constant without the environment
    monkeypatch.setenv("DDT_MLA_PARTIAL_BF16", "0")
    assert A.mla_partial_bf16() is False             # the environment overrides it, both ways
    monkeypatch.setattr(A, "PARTIAL_BF16", False)
    monkeypatch.setenv("DDT_MLA_PARTIAL_BF16", "1")
    assert A.mla_partial_bf16() is True
    monkeypatch.setenv("DDT_MLA_PARTIAL_BF16", "maybe")
    with pytest.raises(ValueError, match="DDT_MLA_PARTIAL_BF16"):
        A.mla_partial_bf16()


def test_partial_builds_and_bytes():
    assert A.mla_spec(False) is A.MLA_SPEC and A.mla_spec(True) is A.MLA_SPEC_BF16
    assert not A.spec_part_bf16(A.MLA_SPEC) and A.spec_part_bf16(A.MLA_SPEC_BF16)
    assert A.MLA_SPEC_BF16.names == A.MLA_SPEC.names and A.MLA_SPEC_BF16.src == A.MLA_SPEC.src
    assert dict(A.MLA_SPEC_BF16.defines) == {"MLA_PART_BF16": "1"} and A.MLA_SPEC_BF16.pdl and A.MLA_SPEC_BF16.hot
    assert A.mla_partial_row_bytes(False) == 512 * 4 + 4 and A.mla_partial_row_bytes(True) == 512 * 2 + 4
    # 1 stream x 8 rows x 8 heads at 65 splits (the H200 plan at 4K): 8.5 MB of fp32 partials, 4.3 MB bf16
    assert A.MlaWorkspace.nbytes_for(65, 8, 8, False) == 65 * 64 * 2052
    assert A.MlaWorkspace.nbytes_for(65, 8, 8, True) == 65 * 64 * 1028
    assert A.MlaWorkspace.nbytes_for(0, 8, 8, True) == 64 * 1028   # one split's worth is always allocated


@pytest.mark.parametrize("part_bf16", (False, True))
def test_workspace_is_sized_for_the_dtype(monkeypatch, part_bf16):
    """MlaWorkspace allocates through cupy.empty (here numpy's, no GPU): shapes, dtypes and bytes per dtype,
    the default from the rule."""
    import cupy
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype: np.empty(shape, dtype))
    monkeypatch.setenv("DDT_MLA_PARTIAL_BF16", "1" if part_bf16 else "0")
    for ws in (A.MlaWorkspace(33, 10, 8), A.MlaWorkspace(33, 10, 8, part_bf16=part_bf16)):
        assert ws.part_bf16 is part_bf16 and ws.num_splits == 33 and ws.total_packed == 80
        assert ws.part_o.shape == (33, 80, 512) and ws.part_o.dtype == (np.uint16 if part_bf16 else np.float32)
        assert ws.part_lse.shape == (33, 80) and ws.part_lse.dtype == np.float32
        assert ws.nbytes == A.MlaWorkspace.nbytes_for(33, 10, 8, part_bf16) == ws.part_o.nbytes + ws.part_lse.nbytes
    other = A.MlaWorkspace(33, 10, 8, part_bf16=not part_bf16)
    assert other.part_bf16 is (not part_bf16)


def test_bf16_cost_model_scales_only_the_per_row_split_term():
    """bf16 partials: the combine's per-(packed row, split) term x 1028 / 2052 (bytes written + read), the fixed
    combine term and the forward kernel unchanged; one split (no partials) costs the same."""
    ratio = A.mla_partial_row_bytes(True) / A.mla_partial_row_bytes(False)
    assert A.MLA_COMBINE_BF16_SCALE == ratio
    for key, k, S, n, L in (("ks32", 65, 1, 8, 4104), ("large", 33, 4, 8, 4104), ("large", 3, 10, 32, 4128),
                            ("ks16", 64, 1, 1, 4097)):
        bps = A._blocks_per_sm(A.MLA_CONFIGS[key], H200[2])
        t32 = A.mla_cost_us(key, k, S, n, 8, L, H200[0], bps)
        t16 = A.mla_cost_us(key, k, S, n, 8, L, H200[0], bps, True)
        term = k * S * n * 8 * A.MLA_COMBINE_US_PER_ROW_SPLIT
        assert math.isclose(t32 - t16, term * (1 - ratio), rel_tol=1e-9), (key, k, S, n)
        assert A.mla_cost_us(key, 1, S, n, 8, L, H200[0], bps, True) == A.mla_cost_us(key, 1, S, n, 8, L, H200[0], bps)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_bf16_planner(arch):
    """The measured policy ignores the partial dtype; the model policy with bf16 partials picks the modelled
    optimum under the bf16 costs (brute force), never a plan it models slower than the measured one, and is
    never modelled slower than the fp32 plan; the workspace bound counts bf16 bytes."""
    num_sms, smem_block, smem_sm = ARCHS[arch]
    rng = np.random.default_rng(11)
    replanned = 0
    for i in rng.permutation(len(GRID))[:60]:
        S, n, H, c = GRID[i]
        L = c + n
        assert A.plan_mla_for(S, n, H, L, "measured", *ARCHS[arch], True) == \
            A.plan_mla_for(S, n, H, L, "measured", *ARCHS[arch], False)
        cfg, k = A.plan_mla_for(S, n, H, L, "model", *ARCHS[arch], True)
        cfg32, k32 = A.plan_mla_for(S, n, H, L, "model", *ARCHS[arch], False)
        replanned += (cfg, k) != (cfg32, k32)
        mcfg, mk = A.plan_mla_for(S, n, H, L, "measured", *ARCHS[arch], True)
        c16 = lambda cf, kk: A.mla_cost_us(name_of(cf), kk, S, n, H, L, num_sms, A._blocks_per_sm(cf, smem_sm), True)
        t = c16(cfg, k)
        assert t <= c16(mcfg, mk) * (1 + 1e-9), (S, n, H, c)
        assert t <= c16(cfg32, k32) * (1 + 1e-9), (S, n, H, c)
        if (cfg, k) != (mcfg, mk):
            best = min(c16(A.MLA_CONFIGS[key], kk) for key in A._model_candidates(n * H, smem_block)
                       for kk in A.mla_split_candidates(A.MLA_CONFIGS[key], S, n, H, L, True))
            assert t <= best * 1.001 + 1e-9, (S, n, H, c)
            assert k * S * n * H * A.mla_partial_row_bytes(True) <= A.MLA_MAX_WORKSPACE
    assert replanned < 30, "bf16 pricing should move few plans (it only halves one term)"
    # the workspace bound: 10 streams x 65 rows x 64 heads (41,600 packed rows) allow 3 fp32 / 6 bf16 splits
    cands = lambda pb: A.mla_split_candidates(A.MLA_CONFIGS["large"], 10, 65, 64, 262209, pb)
    assert max(cands(False)) == A.MLA_MAX_WORKSPACE // (41600 * 2052)
    assert max(cands(True)) == A.MLA_MAX_WORKSPACE // (41600 * 1028) > max(cands(False))


def test_plan_mla_follows_the_partial_rule(monkeypatch):
    """plan_mla without part_bf16 prices the dtype the launch will use (a shape the two dtypes plan
    differently on the H200: 4 streams x 32 rows at 4K)."""
    monkeypatch.setattr(A, "_device_attrs", lambda: H200[:2])
    monkeypatch.setattr(A, "_smem_per_sm", lambda: H200[2])
    monkeypatch.setattr(A, "_device_arch", lambda: "sm_90")
    args = (4, 32, 8, 4128)
    p32 = A.plan_mla_for(*args, "model", *H200, False)
    p16 = A.plan_mla_for(*args, "model", *H200, True)
    assert p32 != p16
    monkeypatch.setenv("DDT_MLA_PARTIAL_BF16", "0")
    assert A.plan_mla(*args, policy="model") == p32 and A.plan_mla(*args, policy="model", part_bf16=True) == p16
    monkeypatch.setenv("DDT_MLA_PARTIAL_BF16", "1")
    assert A.plan_mla(*args, policy="model") == p16 and A.plan_mla(*args, policy="model", part_bf16=False) == p32


def test_engine_decode_shapes_still_split_with_bf16():
    """Every engine decode shape (1-10 streams x 8-32 rows @ 4K) plans > 1 split with either dtype on both
    devices (the one-split path writes o_lat directly and is unchanged)."""
    for arch, policy in (("h200", "model"), ("sm120", "measured")):
        for S in (1, 4, 10):
            for n in (8, 16, 32):
                for pb in (False, True):
                    assert A.plan_mla_for(S, n, 8, 4096 + n, policy, *ARCHS[arch], pb)[1] > 1, (arch, S, n, pb)
