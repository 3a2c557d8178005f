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


@pytest.mark.parametrize("dev", [H200, SM120], ids=["h200", "sm120"])
@pytest.mark.parametrize("T", [1, 8, 9, 16])
@pytest.mark.parametrize("name,N,K,B", ENGINE, ids=[e[0] for e in ENGINE])
def test_pick_is_compiled_and_serves(dev, T, name, N, K, B):
    c = gemm.choose_decode(T, N, K, B, **dev)
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
    for T, want in zip((1, 16), H200_WINNERS[name]):
        c = gemm.choose_decode(T, N, K, B, **H200)
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
    for c in gemm.DEC_CONFIGS:
        assert c.smem() <= 96 * 1024 and c.stages >= 3
        assert gemm.DEC_WARPS % c.rt == 0 and (c.cs == 1 or c.rt == 1)
        assert c.name(False) != c.name(True)
    names = set(gemm.SPEC.names)
    assert all(c.name(f) in names for c in gemm.DEC_CONFIGS for f in (False, True))


def test_switches():
    old = gemm.set_variant("splitk")
    try:
        assert not gemm.use_decode(1, 2112, 7168)
        gemm.set_variant("decode")
        assert gemm.use_decode(16, 4608, 7168) and not gemm.use_decode(17, 2112, 7168)
        gemm.set_variant("auto")
        assert not gemm.use_decode(16, 4608, 7168) and not gemm.use_decode(17, 2112, 7168)
        assert gemm.use_decode(16, 2112, 7168)
    finally:
        gemm.set_variant(old)
    with pytest.raises(ValueError, match="variant"):
        gemm.set_variant("fast")
    with pytest.raises(ValueError, match="cfg"):
        gemm.set_decode_config(gemm.DecodeConfig(1, 5, 1, 1))
    assert gemm.set_decode_config(gemm.DEC_CONFIGS[0]) is None
    assert gemm.set_decode_config(None) == gemm.DEC_CONFIGS[0]


# ---- bulk-copy family (cuda_src/gemm_bulk.cu): config per token band, split-K model, switches ----------
ALL_K = sorted({K for _, _, K, _ in ENGINE} | {64, 192, 320})


def test_bulk_configs_fit_and_cover_every_T():
    cs = gemm.BULK_CONFIGS
    assert len(set(cs)) == len(cs)
    assert [c.tokens() for c in cs] == sorted(c.tokens() for c in cs) and cs[-1].tokens() == gemm.MAX_T
    alts = gemm.BULK_ALT_CONFIGS
    assert not set(alts) & set(cs) and all(any(a.tokens() == c.tokens() for c in cs) for a in alts)
    for c in cs + alts:
        assert c.smem() <= 96 * 1024, c               # sm_120: <= 99 KB per block, with headroom
        assert c.stages >= (3 if c in cs else 2) and 2 * c.stages * 8 <= gemm.BULK_BAR_BYTES   # alts: 2 allowed
        assert c.ntw == 1 or c.ntw % 2 == 0           # the kernel loads token fragments in pairs
        assert c.bk in (32, 64, 128) and (2 * c.bk + 16) % 16 == 0
        assert c.threads() == 32 * (c.wm * c.wn + 1) <= 1024
        # the pad keeps the 8 rows of an ldmatrix phase in 8 distinct 4-bank groups
        assert len({(r * (2 * c.bk + 16) // 4) % 32 // 4 for r in range(8)}) == 8
    names = set(gemm.BULK_SPEC.names)
    assert all(c.name(f) in names for c in cs + alts for f in (False, True))
    assert all(c.name(True).endswith(", true>") for c in cs + alts)   # the output type last (_target_shim.py)
    for T in range(1, gemm.MAX_T + 1):
        c = gemm.choose_bulk(T)
        assert c.tokens() >= T
        smaller = [d for d in cs if d.tokens() < c.tokens()]
        assert all(d.tokens() < T for d in smaller)    # the smallest token tile that holds T
    with pytest.raises(ValueError, match="T"):
        gemm.choose_bulk(161)


def _split_ranges(cfg, K, split):
    """The k-stage ranges the kernel's blocks cover for a launched split (as in gemm_bulk.cu)."""
    ks = K // cfg.bk
    per = -(-ks // split)
    split = -(-ks // per)
    return [(s * per, min(per, ks - s * per)) for s in range(split)]


@pytest.mark.parametrize("dev", [H200, SM120], ids=["h200", "sm120"])
@pytest.mark.parametrize("T", [1, 8, 16, 17, 32, 64, 97, 160])
def test_bulk_split_covers_k_once(dev, T):
    """Every split the rule returns is launched as is (no empty split) and its blocks cover K exactly once;
    each split keeps a ring's worth of stages unless K is shorter; the pick is no worse than s = 1 in the
    model."""
    cfg = gemm.choose_bulk(T)
    for _, N, K, B in ENGINE + [("odd", 48, 320, 3), ("one stage", 2112, 128, 1)]:
        if K % cfg.bk:
            continue
        s = gemm.choose_bulk_split(cfg, T, N, K, B, **dev)
        ranges = _split_ranges(cfg, K, s)
        assert len(ranges) == s and all(n >= 1 for _, n in ranges)
        assert sum(n for _, n in ranges) == K // cfg.bk and ranges[-1][0] + ranges[-1][1] == K // cfg.bk
        assert s == 1 or min(n for _, n in ranges) >= gemm.BULK_MIN_STAGES_PER_SPLIT
        cost = lambda q: gemm.bulk_split_cost(cfg, T, N, K, B, dev["sm_count"], q, dev["smem_per_sm"])  # noqa: E731
        assert cost(s) <= cost(1) + 1e-6


def test_bulk_split_model_examples():
    """Bytes-bound calls fill every resident slot (H200: 2 per SM, sm_120: 1); mma-bound ones the SMs, with
    fp32 partials well below the weight bytes."""
    c1, c160 = gemm.choose_bulk(1), gemm.choose_bulk(160)
    assert 2 * 98 * 1024 < 228 * 1024 and c1.smem() < 98 * 1024                  # 2 resident per H200 SM
    assert gemm.choose_bulk_split(c1, 1, 2112, 7168, 1, **H200) == 8           # 33 row blocks x 8 = 264
    assert gemm.choose_bulk_split(c1, 1, 2112, 7168, 1, **SM120) == 5          # 165 blocks on 188 SMs
    assert gemm.choose_bulk_split(c1, 1, 7168, 2304, 1, **H200) == 2           # 224 blocks in 264 slots
    s = gemm.choose_bulk_split(c160, 160, 2112, 7168, 1, **H200)
    assert 1 < s and s * 160 * 2112 * 4 <= 0.5 * 2112 * 7168 * 2              # partials < half the weight
    assert 17 * s <= 132                                                       # one block per SM (mma-bound)
    assert gemm.choose_bulk_split(c160, 160, 7168, 1024, 1, **H200) <= 2


def test_bulk_switches_and_plan(monkeypatch):
    old = gemm.set_bulk("off")
    try:
        assert not gemm.use_bulk(1) and not gemm.use_bulk(160) and gemm.bulk_plan(160, 2112, 7168) is None
        gemm.set_bulk("large")
        assert not gemm.use_bulk(16) and gemm.use_bulk(17) and gemm.bulk_plan(16, 2112, 7168) is None
        cfg, s = gemm.bulk_plan(17, 2112, 7168, 1, **H200)
        assert cfg == gemm.choose_bulk(17) and s == gemm.choose_bulk_split(cfg, 17, 2112, 7168, 1, **H200)
        gemm.set_bulk("all")
        assert gemm.use_bulk(1) and gemm.bulk_plan(1, 2112, 7168, 1, 132)[0] == gemm.BULK_CONFIGS[0]
        assert gemm.bulk_plan(1, 2112, 64, 1, 132) is None          # K % BK (128): the session-3 kernels
        assert gemm.bulk_plan(40, 2112, 64, 1, 132)[0].bk == 64
        # a forced config wins (split clamped to K / BK) and refuses calls it cannot serve
        c = gemm.BULK_CONFIGS[2]
        assert gemm.set_bulk_config(c, 99) is None
        assert gemm.bulk_plan(5, 2112, 1024, 1, 132) == (c, 1024 // c.bk)
        with pytest.raises(ValueError, match="cannot serve"):
            gemm.bulk_plan(33, 2112, 1024, 1, 132)
        with pytest.raises(ValueError, match="cannot serve"):
            gemm.bulk_plan(8, 2112, 96, 1, 132)
        assert gemm.set_bulk_config(None) == (c, 99)
        a = gemm.BULK_ALT_CONFIGS[0]                 # alternatives can be forced (never picked by the rule)
        gemm.set_bulk_config(a)
        assert gemm.bulk_plan(8, 2112, 7168, 1, **H200) == (a, gemm.choose_bulk_split(a, 8, 2112, 7168, 1, **H200))
        gemm.set_bulk_config(None)
        assert all(gemm.choose_bulk(T) not in gemm.BULK_ALT_CONFIGS for T in range(1, 161))
        with pytest.raises(ValueError, match="cfg"):
            gemm.set_bulk_config(gemm.BulkConfig(1, 1, 4, 1, 128, 7))
        with pytest.raises(ValueError, match="mode"):
            gemm.set_bulk("fast")
    finally:
        gemm.set_bulk(old)
        gemm.set_bulk_config(None)
    assert gemm.BULK_DEFAULT == "off"            # session-3 kernels stay the default until measured
    for env, mode in (("", gemm.BULK_DEFAULT), ("0", "off"), ("1", "all"), ("large", "large")):
        monkeypatch.setenv("DDT_GEMM_BULK", env)
        assert gemm._bulk_from_env() == mode
    monkeypatch.setenv("DDT_GEMM_BULK", "yes")
    with pytest.raises(ValueError, match="DDT_GEMM_BULK"):
        gemm._bulk_from_env()


def test_partial_elems_follows_the_switch():
    old = gemm.set_bulk("off")
    try:
        for T, N, K, B in ((1, 2112, 7168, 1), (160, 20480, 7168, 1), (16, 512, 128, 8)):
            s = gemm.choose_split(T, N, K, B, 132)
            assert gemm.partial_elems(T, N, K, B, **H200) == (B * s * T * N if s > 1 else 0)
        gemm.set_bulk("all")
        for T, N, K, B in ((1, 20480, 7168, 1), (160, 2112, 7168, 1), (16, 512, 128, 8)):
            cfg, s = gemm.bulk_plan(T, N, K, B, **H200)
            assert gemm.partial_elems(T, N, K, B, **H200) == (B * s * T * N if s > 1 else 0)
        assert gemm.partial_elems(1, 20480, 7168, 1, **H200) > gemm.choose_split(1, 20480, 7168) * 20480
    finally:
        gemm.set_bulk(old)
