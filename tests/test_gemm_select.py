"""CPU tests of the GEMM kernel selection (kernels/gemm.py): which decode config ``choose_decode`` picks at
the engine's shapes on the H200 and on an sm_120-like device, that every pick is compiled and can serve
the call, and the forcing switches."""
import numpy as np
import pytest

from ddtree_cupy.kernels import gemm

H200 = dict(sm_count=132, smem_per_sm=228 * 1024)
SM120 = dict(sm_count=188, smem_per_sm=100 * 1024)
# (name, N, K, batch): one TP=8 rank's GEMMs (bench/kernels.py GEMMS)
ENGINE = [("q_a+kv_a", 2112, 7168, 1), ("q_b", 1536, 1536, 1), ("W_UK^T", 512, 128, 8), ("W_UV", 128, 512, 8),
          ("o_proj", 7168, 1024, 1), ("gate+up", 4608, 7168, 1), ("down", 7168, 2304, 1),
          ("shared gate+up", 512, 7168, 1), ("shared down", 7168, 256, 1), ("router", 384, 7168, 1),
          ("lm_head", 20480, 7168, 1), ("drafter qkv", 1280, 7168, 1)]


def _blocks(c, N, B):
    return N // c.rows() * c.cs * B


@pytest.mark.parametrize("rule", gemm.DEC_RULES)
@pytest.mark.parametrize("dev", [H200, SM120], ids=["h200", "sm120"])
@pytest.mark.parametrize("T", [1, 8, 9, 16])
@pytest.mark.parametrize("name,N,K,B", ENGINE, ids=[e[0] for e in ENGINE])
def test_pick_is_compiled_and_serves(dev, T, name, N, K, B, rule):
    c = gemm.choose_decode(T, N, K, B, rule=rule, **dev)
    if c is None:       # split-K: only for a thin-tail grid at T > 8
        assert T > 8
        base = gemm.DecodeConfig(2, gemm.dec_stages(2), 1, 1)
        waves = (N // 16 * B) / (dev["sm_count"] * max(1, dev["smem_per_sm"] // (base.smem() + 1024)))
        assert 1 < waves < gemm.DEC_THIN_TAIL
        return
    assert c in gemm.DEC_CONFIGS
    assert c.nt * 8 >= T and (c.nt == 1) == (T <= 8)     # the smallest token tile that holds T
    assert N % c.rows() == 0
    assert c.smem() <= 99 * 1024                          # sm_120's per-block limit
    slots = dev["sm_count"] * max(1, dev["smem_per_sm"] // (c.smem() + 1024))
    base = gemm.DecodeConfig(c.nt, gemm.dec_stages(c.nt), 1, 1)
    # a pick other than the base always fits one wave of resident blocks
    assert c == base or _blocks(c, N, B) <= slots
    if c.cs > 1:
        assert K // 64 // c.cs >= gemm.DEC_CS_MIN_K_TILES


# The fastest config per engine shape in the H200 run (bench/results/gemm_configs_h200.log and the
# old-vs-new table): (rt, cs) for T <= 8 and T = 9..16, "light" = the 3-stage NT 1 ring, None = split-K.
H200_WINNERS = {
    "q_a+kv_a": ((1, 1), (1, 1)), "q_b": ((1, 1), (1, 1)), "W_UK^T": ((1, 1), (1, 1)), "W_UV": ((1, 1), (1, 1)),
    "o_proj": ((2, 1), (2, 1)), "gate+up": ("light", None), "down": ((2, 1), (2, 1)),
    "shared gate+up": ((1, 4), (1, 4)), "shared down": ((4, 1), (4, 1)), "router": ((1, 4), (1, 4)),
    "lm_head": ((1, 1), (1, 1)), "drafter qkv": ((1, 2), (1, 2)),
}


@pytest.mark.parametrize("name,N,K,B", ENGINE, ids=[e[0] for e in ENGINE])
def test_h200_picks_are_the_measured_winners(name, N, K, B):
    old = gemm.set_decode_rule("s3")      # session 3's rule, whichever is the default
    try:
        _check_s3_winners(name, N, K, B)
    finally:
        gemm.set_decode_rule(old)


def _check_s3_winners(name, N, K, B):
    for T, want in zip((1, 16), H200_WINNERS[name]):
        c = gemm.choose_decode(T, N, K, B, rule="s3", **H200)
        if want is None:
            assert c is None and not gemm.use_decode(T, N, K, B, **H200)
        elif want == "light":
            assert c == gemm.DecodeConfig(1, 3, 1, 1)
        else:
            assert (c.rt, c.cs) == want and c.stages == gemm.dec_stages(c.nt), c
            assert gemm.use_decode(T, N, K, B, **H200)


def test_sm120_single_slot():
    """One 96 KB block per SM on sm_120: a non-base pick never needs two per SM."""
    for T in (1, 16):
        for _, N, K, B in ENGINE:
            c = gemm.choose_decode(T, N, K, B, **SM120)
            if c is not None and c != gemm.DecodeConfig(c.nt, gemm.dec_stages(c.nt), 1, 1):
                assert _blocks(c, N, B) <= 188


def test_configs_fit_and_unique():
    assert len(set(gemm.DEC_CONFIGS)) == len(gemm.DEC_CONFIGS)
    assert len({c.name(f) for c in gemm.DEC_CONFIGS for f in (False, True)}) == 2 * len(gemm.DEC_CONFIGS)
    for c in gemm.DEC_CONFIGS:
        assert c.smem() <= 96 * 1024 and c.stages >= 3
        assert gemm.DEC_WARPS % c.rt == 0 and (c.cs == 1 or c.rt == 1 or c.sx)
        assert not c.sx or c.rt >= 2          # sx shares a token tile between the RT warps of a K slice
        assert c.name(False) != c.name(True)
    names = set(gemm.SPEC.names)
    assert all(c.name(f) in names for c in gemm.DEC_CONFIGS for f in (False, True))
    # shared memory of the sx rings: groups x stages x (RT weight tiles + one token tile) x 64 x 2 bytes
    assert gemm.DecodeConfig(2, 4, 2, 1, True).smem() == 4 * 4 * (32 + 16) * 128 == 96 * 1024
    assert gemm.DecodeConfig(2, 4, 4, 1, True).smem() == 2 * 4 * (64 + 16) * 128 == 80 * 1024
    assert gemm.DecodeConfig(1, 4, 1, 3).smem() == 8 * 4 * (16 + 8) * 128
    assert gemm.DecodeConfig(2, 4, 2, 4, True).name(True) == "gemm_bf16_kernel_decode_sxcl<2, 4, 2, 4, true>"
    assert gemm.DecodeConfig(2, 4, 4, 1, True).name(False) == "gemm_bf16_kernel_decode_sx<2, 4, 4, false>"


# Session 4's rule (predicted, not yet measured): the changes it makes against session 3 on the H200, per
# engine shape and token tiles (NT 1: T <= 8, NT 2: T = 9..16); every other case keeps session 3's pick.
SX = lambda rt, cs=1: gemm.DecodeConfig(2, 4, rt, cs, True)  # noqa: E731
H200_S4_CHANGES = {
    ("q_a+kv_a", 2): SX(2, 2), ("o_proj", 2): SX(2), ("gate+up", 2): SX(2), ("down", 2): SX(2),
    ("shared down", 2): SX(4), ("drafter qkv", 1): gemm.DecodeConfig(1, 4, 1, 3), ("drafter qkv", 2): SX(2, 4),
}


@pytest.mark.parametrize("name,N,K,B", ENGINE, ids=[e[0] for e in ENGINE])
def test_h200_s4_changes(monkeypatch, name, N, K, B):
    monkeypatch.setattr(gemm, "S4_ENABLED", set(gemm.S4_REPLACEMENTS))   # independent of DDT_GEMM_S4_OFF
    for T in (1, 5, 8, 9, 13, 16):
        s3 = gemm.choose_decode(T, N, K, B, rule="s3", **H200)
        s4 = gemm.choose_decode(T, N, K, B, rule="s4", **H200)
        assert s4 == H200_S4_CHANGES.get((name, 1 if T <= 8 else 2), s3), (name, T, s3, s4)
        if s4 != s3:       # a replacement never leaves one wave of resident blocks
            assert _blocks(s4, N, B) <= 132 * (228 * 1024 // (s4.smem() + 1024))
            assert s4.nt * 8 >= T and N % s4.rows() == 0


def test_sx_same_grid_or_one_wave_on_sm120():
    for T in (9, 16):
        for _, N, K, B in ENGINE:
            c = gemm.choose_decode(T, N, K, B, rule="s4", **SM120)
            if c is not None and c.sx:
                assert _blocks(c, N, B) <= 188


def test_rule_switch_and_env(monkeypatch):
    monkeypatch.setattr(gemm, "S4_ENABLED", set(gemm.S4_REPLACEMENTS))
    assert gemm.DEFAULT_RULE in gemm.DEC_RULES     # "s3" until the lead's run measures "s4"
    old = gemm.set_decode_rule("s4")
    try:
        assert gemm.decode_rule() == "s4"
        assert gemm.choose_decode(16, 7168, 1024) == SX(2)
        assert gemm.use_decode(16, 4608, 7168)            # s4 serves gate+up T = 16 with sx RT 2
        gemm.set_decode_rule("s3")
        assert gemm.choose_decode(16, 7168, 1024) == gemm.DecodeConfig(2, 3, 2, 1)
        assert not gemm.use_decode(16, 4608, 7168)        # s3: split-K there
    finally:
        gemm.set_decode_rule(old)
    with pytest.raises(ValueError, match="rule"):
        gemm.set_decode_rule("s5")
    with pytest.raises(ValueError, match="rule"):
        gemm.choose_decode(1, 2112, 7168, rule="new")
    monkeypatch.setenv("DDT_GEMM_RULE", "s4")
    assert gemm._rule_from_env() == "s4"
    monkeypatch.setenv("DDT_GEMM_RULE", "")
    assert gemm._rule_from_env() == gemm.DEFAULT_RULE
    monkeypatch.setenv("DDT_GEMM_RULE", "fast")
    with pytest.raises(ValueError, match="DDT_GEMM_RULE"):
        gemm._rule_from_env()


def test_switches():
    old, old_rule = gemm.set_variant("splitk"), gemm.set_decode_rule("s3")
    try:
        assert not gemm.use_decode(1, 2112, 7168)
        gemm.set_variant("decode")
        assert gemm.use_decode(16, 4608, 7168) and not gemm.use_decode(17, 2112, 7168)
        gemm.set_variant("auto")
        assert not gemm.use_decode(16, 4608, 7168) and not gemm.use_decode(17, 2112, 7168)
        assert gemm.use_decode(16, 2112, 7168)
    finally:
        gemm.set_variant(old)
        gemm.set_decode_rule(old_rule)
    with pytest.raises(ValueError, match="variant"):
        gemm.set_variant("fast")
    with pytest.raises(ValueError, match="cfg"):
        gemm.set_decode_config(gemm.DecodeConfig(1, 5, 1, 1))
    assert gemm.set_decode_config(gemm.DEC_CONFIGS[0]) is None
    assert gemm.set_decode_config(None) == gemm.DEC_CONFIGS[0]


def test_s4_replacements_switch_individually(monkeypatch):
    """Each session-4 replacement can be dropped on its own (S4_ENABLED / DDT_GEMM_S4_OFF), falling back to
    session 3's pick for exactly the shapes it served."""
    which = {("q_a+kv_a", 2): "sx_cs2", ("o_proj", 2): "sx_rt", ("gate+up", 2): "sx_thin", ("down", 2): "sx_rt",
             ("shared down", 2): "sx_rt", ("drafter qkv", 1): "cs3", ("drafter qkv", 2): "sx_cs4"}
    assert set(which) == set(H200_S4_CHANGES) and set(which.values()) == set(gemm.S4_REPLACEMENTS)
    for off in gemm.S4_REPLACEMENTS:
        monkeypatch.setattr(gemm, "S4_ENABLED", set(gemm.S4_REPLACEMENTS) - {off})
        for name, N, K, B in ENGINE:
            for T in (1, 16):
                key = (name, 1 if T <= 8 else 2)
                s3 = gemm.choose_decode(T, N, K, B, rule="s3", **H200)
                s4 = gemm.choose_decode(T, N, K, B, rule="s4", **H200)
                want = s3 if which.get(key) == off else H200_S4_CHANGES.get(key, s3)
                assert s4 == want, (off, name, T, s4)
    monkeypatch.setenv("DDT_GEMM_S4_OFF", "sx_cs2, cs3")
    assert gemm._s4_from_env() == set(gemm.S4_REPLACEMENTS) - {"sx_cs2", "cs3"} - set(gemm.S4_DEFAULT_OFF)
    monkeypatch.setenv("DDT_GEMM_S4_OFF", "sx_cs3")
    with pytest.raises(ValueError, match="DDT_GEMM_S4_OFF"):
        gemm._s4_from_env()
