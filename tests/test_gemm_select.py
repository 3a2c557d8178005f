"""CPU tests of the GEMM kernel selection (kernels/gemm.py): which decode config ``choose_decode`` picks at
the engine's shapes on the H200 and on an sm_120-like device, that every pick is compiled and can serve
the call, and the forcing switches."""
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


# The fastest config per engine shape in the H200 run (gemm_configs_h200.log (in git history) and the
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


# ---- wide-token family (T = 17..160) -------------------------------------------------------------------
WIDE_T = (17, 31, 32, 33, 64, 65, 80, 81, 96, 100, 128, 160)


def test_wide_configs_fit_and_compiled():
    assert len(set(gemm.WIDE_CONFIGS)) == len(gemm.WIDE_CONFIGS)
    names = set(gemm.SPEC.names)
    for c in gemm.WIDE_CONFIGS:
        assert c.smem() <= 96 * 1024 and c.stages >= 3           # sm_120: <= 99 KB per block
        assert c.bm() in (64, 128) and c.bt() in (32, 64, 80) and c.threads() in (128, 256)
        assert all(c.name(f) in names for f in (False, True)) and c.name(False) != c.name(True)
        assert c.name(True).rstrip(">").split(",")[-1].strip() == "true"    # output type last (CPU shim)
        assert c.cs in (1,) + gemm.WIDE_CL_CS
        assert ("_wide_cl<" in c.name(False)) == (c.cs > 1)
        if c.cs > 1:    # the cluster's fp32 tile ([BT][BM + 4]) is parked in the drained ring
            assert c.bt() * (c.bm() + 4) * 4 <= c.smem() and c._replace(cs=1) in gemm.WIDE_CONFIGS
    with pytest.raises(ValueError, match="split must be 4"):
        gemm.set_wide_config((gemm.WIDE_CONFIGS[0]._replace(cs=4), 2))


@pytest.mark.parametrize("dev", [H200, SM120], ids=["h200", "sm120"])
@pytest.mark.parametrize("name,N,K,B", ENGINE + [("router+shared", 896, 7168, 1)],
                         ids=[e[0] for e in ENGINE] + ["router+shared"])
def test_wide_pick_serves_and_fits_the_workspace(dev, name, N, K, B):
    """For every T: a compiled 256- or 128-thread config of the rule's set, a split that leaves >= 4 k tiles per
    block and is the slot model's minimum (waves of resident blocks x (k tiles + fill)), and a workspace_split
    (what the models size their workspaces with) that covers it and split-K's factor."""
    import math
    for T in WIDE_T:
        cfg, split = gemm.choose_wide(T, N, K, B, **dev)
        shape = cfg._replace(cs=1)
        assert shape in gemm.WIDE_RULE_CONFIGS and shape == gemm.wide_config_for(T) and cfg in gemm.WIDE_CONFIGS
        assert cfg.bt() >= T or T > 80                    # one token tile up to 80 rows
        assert split == cfg.cs if cfg.cs > 1 else (split == 1 or K // 64 // split >= gemm.WIDE_MIN_K_TILES)
        blocks = math.ceil(T / cfg.bt()) * math.ceil(N / cfg.bm()) * B
        slots = dev["sm_count"] * max(1, dev["smem_per_sm"] // (cfg.smem() + 1024))

        def cost(s, cl=False):     # written out again here: waves x (k tiles (x 1.2 in a cluster) + fill) + reduce
            per = math.ceil(K // 64 / s) * (gemm.WIDE_CL_TILE_FACTOR if cl else 1)
            c = math.ceil(blocks * s / slots) * (per + gemm.WIDE_FILL_TILES) * gemm.WIDE_TILE_US
            return c + (gemm.WIDE_REDUCE_LAUNCH_US + 8e6 * s * B * T * N / gemm.WIDE_REDUCE_BPS if s > 1 and not cl
                        else 0)
        cap = max(1, K // 64 // gemm.WIDE_MIN_K_TILES)
        costs = [cost(s) for s in range(1, cap + 1)]
        costs += [cost(cs, True) for cs in gemm.WIDE_CL_CS if K // 64 >= gemm.WIDE_CL_MIN_K_TILES * cs]
        assert math.isclose(cost(split, cfg.cs > 1), min(costs))
        ws = gemm.workspace_split(T, N, K, B, dev["sm_count"], dev["smem_per_sm"])
        assert ws >= gemm.choose_split(T, N, K, B, dev["sm_count"])
        assert cfg.cs > 1 or ws >= split
        old = gemm.WIDE_CLUSTER
        gemm.WIDE_CLUSTER = False       # the workspace also covers the rule with the cluster splits off
        try:
            c0, s0 = gemm.choose_wide(T, N, K, B, **dev)
        finally:
            gemm.WIDE_CLUSTER = old
        assert c0 == shape and ws >= s0 and s0 == gemm.wide_split(shape, T, N, K, B, **dev)


def test_wide_cluster_picks_h200():
    """The cluster split's H200 sweeps (gemm_s8_wideconfigs_h200.json (in git history) and gemm_s8_wide160_h200.json,
    docs/KERNELS.md "Wide kernel: K split over a thread-block cluster"): short-K weights take the cluster split that measured fastest (o_proj, dense down: 4 blocks up
    to 80 rows, 2 above; q_b 8), long-K narrow ones keep the workspace split (their best splits, 14-28, exceed
    a cluster's 8); above 128 rows the 4-warp 80-token block (two token tiles), each pick the sweep's fastest."""
    pick = {(n, T): ("cl" if c.cs > 1 else "k") + str(s)
            for n, N, K in (("q_a", 2112, 7168), ("q_b", 1536, 1536), ("o_proj", 7168, 1024),
                            ("gate+up", 4608, 7168), ("down", 7168, 2304), ("router+shared", 896, 7168))
            for T in (32, 64, 80, 100, 160) for c, s in [gemm.choose_wide(T, N, K, 1, **H200)]}
    for T in (32, 64, 80):
        assert pick[("o_proj", T)] == pick[("down", T)] == "cl4" and pick[("q_b", T)] == "cl8"
        assert pick[("q_a", T)] == "k14" and pick[("gate+up", T)] == "k7" and pick[("router+shared", T)] == "k28"
    assert pick[("o_proj", 100)] == pick[("down", 100)] == pick[("o_proj", 160)] == pick[("down", 160)] == "cl2"
    assert pick[("q_a", 160)] == "k7" and pick[("gate+up", 160)] == "k3" and pick[("router+shared", 160)] == "k16"
    for T, bt, warps in ((32, 32, 8), (64, 64, 8), (80, 80, 8), (100, 64, 4), (128, 64, 4), (129, 80, 4), (160, 80, 4)):
        c = gemm.wide_config_for(T)
        assert (c.bt(), c.threads() // 32) == (bt, warps), T


def test_wide_picks_h200():
    """The H200 picks at the engine's shapes, pinned to the wide-token kernel's first sweep's fastest (config,
    split) where the rule reaches it (gemm_s5_wideconfigs_h200.json (in git history);
    docs/history/2026-11-29-kernels.md "Wide rule confirmed").
    Exceptions, within 3%: o_proj T = 64 (k 4 here: 13.0 us; k 1 12.6), gate+up and down at T = 160 (BT 64 x 3
    tiles: 64.1 / 37.6 us; the fastest, BT 80: 62.2 / 36.4); drafter qkv T = 64 (k 23, not in the sweep; k 26
    13.6 us, BT 32 k 12 12.0). The cluster split moved T = 129-160 to the 4-warp BT 80 block (two token tiles), which
    that sweep measured fastest at 6 of 7 shapes; the T = 160 rows below are its workspace picks."""
    old = gemm.WIDE_CLUSTER
    gemm.WIDE_CLUSTER = False           # the rule before the cluster split (workspace splits only), as pinned then
    try:
        got = {(n, T): (c.bt(), c.threads(), s) for n, N, K in (("q_a", 2112, 7168), ("o_proj", 7168, 1024),
                                                                ("gate+up", 4608, 7168), ("down", 7168, 2304),
                                                                ("drafter qkv", 1280, 7168))
               for T in (32, 64, 160) for c, s in [gemm.choose_wide(T, N, K, 1, **H200)]}
    finally:
        gemm.WIDE_CLUSTER = old
    assert got == {
        ("q_a", 32): (32, 256, 14), ("q_a", 64): (64, 256, 14), ("q_a", 160): (80, 128, 7),
        ("o_proj", 32): (32, 256, 4), ("o_proj", 64): (64, 256, 4), ("o_proj", 160): (80, 128, 2),
        ("gate+up", 32): (32, 256, 7), ("gate+up", 64): (64, 256, 7), ("gate+up", 160): (80, 128, 3),
        ("down", 32): (32, 256, 4), ("down", 64): (64, 256, 4), ("down", 160): (80, 128, 2),
        ("drafter qkv", 32): (32, 256, 23), ("drafter qkv", 64): (64, 256, 23), ("drafter qkv", 160): (80, 128, 13)}


def test_wide_range_and_switches(monkeypatch):
    assert gemm.choose_wide(16, 2112, 7168) is None and gemm.choose_wide(161, 2112, 7168) is None
    monkeypatch.delenv("DDT_GEMM_WIDE", raising=False)
    old_w, old_v = gemm.set_wide(None), gemm.set_variant("auto")
    try:
        assert gemm.wide_enabled() is gemm.WIDE_DEFAULT is True       # on since its first H200 run
        assert gemm.use_wide(40)
        monkeypatch.setenv("DDT_GEMM_WIDE", "1")
        assert gemm.use_wide(17) and gemm.use_wide(160) and not gemm.use_wide(16)
        assert gemm.use_decode(16, 2112, 7168)           # T <= 16 is untouched
        gemm.set_wide(False)
        assert not gemm.use_wide(40)
        gemm.set_wide(None)
        monkeypatch.setenv("DDT_GEMM_WIDE", "0")
        assert not gemm.use_wide(40)
        gemm.set_variant("wide")                          # forced: wide above 16 whatever the switch says
        assert gemm.use_wide(40) and not gemm.use_wide(8)
        assert gemm.use_decode(8, 2112, 7168)             # and the rule below
        gemm.set_variant("splitk")
        monkeypatch.setenv("DDT_GEMM_WIDE", "1")
        assert not gemm.use_wide(40)
        monkeypatch.setenv("DDT_GEMM_WIDE", "yes")
        gemm.set_variant("auto")
        with pytest.raises(ValueError, match="DDT_GEMM_WIDE"):
            gemm.use_wide(40)
    finally:
        gemm.set_wide(old_w)
        gemm.set_variant(old_v)
    with pytest.raises(ValueError, match="on"):
        gemm.set_wide(1)
    with pytest.raises(ValueError, match="cfg"):
        gemm.set_wide_config((gemm.WideConfig(2, 3, 4, 2, 4), 2))
    with pytest.raises(ValueError, match="cfg"):
        gemm.set_wide_config((gemm.WIDE_CONFIGS[0], 0))
    assert gemm.set_wide_config((gemm.WIDE_CONFIGS[0], 3)) is None
    assert gemm.set_wide_config(None) == (gemm.WIDE_CONFIGS[0], 3)


def test_bench_wide_sweep_cases():
    """bench.kernels' wideconfigs sweep holds the rule's pick once (tagged), only valid splits, and split-K;
    its forcing wrapper sets the variant and (config, split) for the call and restores both after."""
    import bench.kernels as bk
    for _, N, K, B in ENGINE:
        for T in (17, 64, 160):
            cands = bk.wide_candidates(T, N, K, B, H200["sm_count"], H200["smem_per_sm"])
            assert cands[-1] == "splitk"
            rule = [(c, s) for tag, c, s in cands[:-1] if tag == "wide-rule"]
            assert rule == [gemm.choose_wide(T, N, K, B, **H200)]
            assert all(1 <= s <= K // 64 for _, _, s in cands[:-1])
            assert len(set(cands)) == len(cands)
    seen = []
    cfg = gemm.WIDE_CONFIGS[1]
    bk._with_variant(("wide", cfg, 3), lambda: seen.append((gemm._VARIANT[0], gemm._FORCED_WIDE[0])))()
    assert seen == [("wide", (cfg, 3))]
    assert gemm._VARIANT[0] == "auto" and gemm._FORCED_WIDE[0] is None
    assert bk._tag(("wide-rule", cfg, 3)) == " [wide bt64 w8 s4 k3 *rule*]" and bk._tag("wide") == " [wide]"
    assert bk._tag(("wide", gemm.WIDE_BM64._replace(cs=8), 8)) == " [wide bm64 bt32 w4 s4 cl8]"
    assert bk._variants(16, ("splitk", "wide")) == ["splitk"] and bk._variants(17, ("wide",)) == ["wide"]
