"""GPU: MLA split-KV merged inside the attention kernel (mla_attn_ksplit<..., 1>: the splits of a (stream,
row tile) group meet at a barrier in global memory and merge their own partials; kernels/attention.py
``fused=``, FUSED_COMBINE) against the float64 reference and the two-launch path (mla_attn_combine).

Every ksplit tile, 1-16 rows x 8 heads, 1-4 ragged streams, split counts from 2 to 256 (including counts
with empty splits and shares with no unit), tree and causal mode. Outputs poisoned; rows no stream owns must
stay poisoned; the two paths agree to the output's bf16 rounding (they add the same terms in another order).
Graph replay == eager bit for bit with the barrier words back at zero after every launch; chain == causal bit
for bit; PDL chain == plain launches; a barrier that can never complete times out into the fault word (no
hang), check_mla_faults raises and resets, and the next launch is correct; the launch refuses grids that
cannot be co-resident."""
import os
import sys

import numpy as np
import pytest

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
from ddtree_cupy.reference import attention as ra

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_mla_attention as base  # noqa: E402  (case builder, reference and checks of the main suite)

pytestmark = pytest.mark.gpu

SCALE, POISON = base.SCALE, base.POISON
KSPLIT = ["ks16", "ks16_2stage", "ks16_5stage", "ks32", "ks32_2stage"]


def cp():
    import cupy
    return cupy


def attn():
    from ddtree_cupy.kernels import attention
    return attention


def launch(c, d, cfg, splits, fused, ws=None, out=None):
    x = cp()
    a = attn()
    if ws is None:
        ws = a.MlaWorkspace(splits, c["T"], c["H"])
        ws.part_o.fill(np.nan)
        ws.part_lse.fill(np.nan)
    if out is None:
        out = x.full((c["T"], c["H"], 512), POISON, dtype=x.uint16)
    a.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"], mask=d["mask"],
                    softmax_scale=SCALE, max_rows=c["max_rows"], max_kv_len=c["max_kv"], out=out, config=cfg,
                    num_splits=splits, workspace=ws, fused=fused)
    x.cuda.get_current_stream().synchronize()
    assert not ws.sync.any(), "barrier words not back at zero after the launch"
    a.check_mla_faults()
    return out.get()


def agree(got, other, c, label):
    """The fused and the two-launch outputs: same rows written, equal to the bf16 rounding of each (the
    merge adds the same products in another order: a few fp32 ulps, then one bf16 rounding each)."""
    own = base.owned_rows(c)
    assert (got[~own] == POISON).all(), f"{label}: rows no stream owns were written"
    g = bf16_bits_to_f32(got[own]).astype(np.float64)
    o = bf16_bits_to_f32(other[own]).astype(np.float64)
    diff = np.abs(g - o)
    # one bf16 ulp (2^-7 relative at most) plus the fp32 reordering error of elements near zero, which is
    # absolute (~1e-7 of the terms' size): 2^-16 of the largest output
    bound = 2.0 ** -7 * np.abs(o) + 2.0 ** -16 * np.abs(o).max()
    assert (diff <= bound).all(), f"{label}: max diff {diff.max():.3e} (worst excess {(diff - bound).max():.3e})"


def fits(cfg):
    return cfg.smem <= cp().cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]


CASES = [  # (streams, rows per stream, prefixes, split counts)
    (1, [8], [4096], [2, 3, 17, 65, 129]),
    (1, [1], [4000], [2, 64, 126]),
    (1, [16], [1500], [2, 7, 33, 48]),
    (2, [8, 3], [700, 2900], [5, 33]),
    (4, [2, 1, 4, 3], [63, 64, 1029, 0], [3, 17]),
]


@pytest.mark.parametrize("config", KSPLIT)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("mode", ["tree", "causal"])
def test_fused_equals_float64_and_the_two_launch_path(config, case, mode):
    x = cp()
    a = attn()
    cfg = a.MLA_CONFIGS[config]
    if not fits(cfg):
        pytest.skip(f"{config} does not fit this GPU's shared memory")
    S, n_list, s_list, split_list = CASES[case]
    rng = np.random.default_rng(100 * case + len(config) + (mode == "tree"))
    c = base.make_case(rng, S, 8, n_list, s_list, mode)
    d = base.to_dev(c)
    ref = base.reference(c)
    m_tiles = -(-c["max_rows"] * 8 // cfg.bm)
    resident = a._resident_blocks(x.cuda.Device().id, a.MLA_SPEC, cfg.fused_name, cfg.threads, cfg.smem)
    ran = 0
    for splits in split_list:
        if m_tiles * splits * S > resident:
            continue
        fused = launch(c, d, cfg, splits, True)
        base.check(c, fused, f"{config} x{splits} fused", ref=ref)
        plain = launch(c, d, cfg, splits, False)
        agree(fused, plain, c, f"{config} x{splits}")
        again = launch(c, d, cfg, splits, True)
        assert np.array_equal(fused, again), f"{config} x{splits}: fused result not deterministic"
        ran += 1
    assert ran, "no split count of the case fits the device at once"


@pytest.mark.parametrize("config", ["ks16", "ks32"])
def test_chain_equals_causal_bitwise(config):
    x = cp()
    a = attn()
    cfg = a.MLA_CONFIGS[config]
    rng = np.random.default_rng(5)
    S, n = 2, 6
    c_causal = base.make_case(rng, S, 8, [n] * S, [2100, 333], "causal", gap=False)
    c_chain = dict(c_causal)
    mask = np.zeros((S, 129, 5), np.uint32)
    for b in range(S):
        mask[b] = ra.ancestor_mask_bits(np.arange(-1, n - 1, dtype=np.int32), 129)
    c_chain["mask"] = mask
    for splits in (2, 7, 40):
        got = [launch(c, base.to_dev(c), cfg, splits, True) for c in (c_causal, c_chain)]
        assert np.array_equal(got[0], got[1]), f"x{splits}: chain differs from causal"
        base.check(c_causal, got[0], f"causal x{splits}")


def test_graph_replay_equals_eager_and_rearms():
    """Captured once, replayed with new lengths / trees / queries written in place: equal to eager launches
    bit for bit, the barrier words back at zero after every replay (no memset in the graph)."""
    x = cp()
    a = attn()
    rng = np.random.default_rng(31)
    S, R, H, L = 1, 8, 8, 4104
    cfg, splits = a.plan_mla(S, R, H, L)
    if not cfg.ksplit or splits < 2:
        cfg, splits = a.MLA_CONFIGS["ks32" if fits(a.MLA_CONFIGS["ks32"]) else "ks32_2stage"], 65
    c = base.make_case(rng, S, H, [R], [L - R], "tree", gap=False)
    d = base.to_dev(c)
    ws = a.MlaWorkspace(splits, c["T"], H)
    out = x.full((c["T"], H, 512), POISON, dtype=x.uint16)
    stream = x.cuda.Stream(non_blocking=True)

    def call():
        a.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"], mask=d["mask"],
                        softmax_scale=SCALE, max_rows=R, max_kv_len=L, out=out, workspace=ws, config=cfg,
                        num_splits=splits, fused=True)
    with stream:
        call()
        stream.synchronize()
        stream.begin_capture()
        call()
        graph = stream.end_capture()
    for step in range(4):
        n_new = np.array([int(rng.integers(1, R + 1))], np.int32)
        s_new = np.array([int(rng.integers(0, L - n_new[0]))], np.int32)
        par = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n_new[0])])
        mask_new = ra.ancestor_mask_bits(par, 129)[None]
        q_new = to_bf16_bits(rng.standard_normal(c["q"].shape) * 0.5)
        d["n"][...] = x.asarray(n_new)
        d["prefix"][...] = x.asarray(s_new)
        d["mask"][...] = x.asarray(mask_new)
        d["q"][...] = x.asarray(q_new)
        out[...] = POISON
        x.cuda.Stream.null.synchronize()
        for _ in range(2):
            graph.launch(stream)
        stream.synchronize()
        assert not ws.sync.any(), f"step {step}: barrier words not back at zero"
        replay = out.get()
        c2 = dict(c, n=n_new, prefix=s_new, mask=mask_new, q=q_new)
        eager = launch(c2, base.to_dev(c2), cfg, splits, True)
        assert np.array_equal(replay, eager), f"step {step}: graph replay differs from eager"
        base.check(c2, replay, f"graph step {step}")


def test_pdl_chain_equals_plain_launches():
    """kv_write_latent -> fused mla_attention with programmatic dependent launch (the attention grid starts
    while the producer runs): bit-identical to ordinary launches, eagerly and from a graph."""
    x = cp()
    a = attn()
    from ddtree_cupy.kernels import launch as L
    from ddtree_cupy.kernels.kv_cache import kv_write_latent
    if int(x.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90+")
    rng = np.random.default_rng(41)
    S, H, n = 1, 8, 8
    c = base.make_case(rng, S, H, [n], [4000], "tree", gap=False)
    d = base.to_dev(c)
    cfg = a.MLA_CONFIGS["ks32" if fits(a.MLA_CONFIGS["ks32"]) else "ks32_2stage"]
    splits = 65
    lengths = c["prefix"] + c["n"]
    sid = x.asarray(np.zeros(int(lengths[0]), np.int32))
    pos = x.asarray(np.arange(int(lengths[0]), dtype=np.int32))
    ws = a.MlaWorkspace(splits, c["T"], H)
    lat = x.empty((len(pos), 576), x.uint16)
    out = x.empty((c["T"], H, 512), x.uint16)
    stream = x.cuda.Stream(non_blocking=True)

    def step():
        kv_write_latent(d["pool"], d["table"], sid, pos, lat)
        a.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"], mask=d["mask"],
                        softmax_scale=SCALE, max_rows=n, max_kv_len=c["max_kv"], out=out, workspace=ws,
                        config=cfg, num_splits=splits, fused=True)
    try:
        with stream:
            for rnd in range(3):
                results = []
                for pdl in (False, True):
                    lat[...] = x.asarray(to_bf16_bits(np.random.default_rng(rnd).standard_normal(lat.shape)))
                    out[...] = POISON
                    L.set_pdl(pdl)
                    step()
                    stream.synchronize()
                    results.append(out.get())
                assert np.array_equal(results[0], results[1]), f"round {rnd}: PDL result differs"
                base.check(dict(c, pool=d["pool"].get()), results[1], f"pdl round {rnd}")
            L.set_pdl(True)
            stream.begin_capture()
            step()
            graph = stream.end_capture()
            out[...] = POISON
            graph.launch(stream)
            stream.synchronize()
            assert np.array_equal(out.get(), results[1]), "graph replay with PDL differs"
            assert not ws.sync.any()
    finally:
        L.set_pdl(False)
    a.check_mla_faults()


def test_barrier_timeout_sets_the_fault_word_and_recovers(monkeypatch):
    """A group whose arrivals word is corrupt can never complete: the launch ends anyway (bounded polls), the
    device's fault word is set, check_mla_faults raises and zeroes the barrier words, and the next launch is
    correct."""
    x = cp()
    a = attn()
    monkeypatch.setattr(a, "FC_SPIN_LIMIT", 2000)
    rng = np.random.default_rng(43)
    c = base.make_case(rng, 1, 8, [8], [3000], "tree", gap=False)
    d = base.to_dev(c)
    cfg = a.MLA_CONFIGS["ks32" if fits(a.MLA_CONFIGS["ks32"]) else "ks32_2stage"]
    ws = a.MlaWorkspace(17, c["T"], 8)
    ws.sync[0] = -1000          # group 0 would need 1017 arrivals
    out = x.full((c["T"], 8, 512), POISON, dtype=x.uint16)
    a.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"], mask=d["mask"],
                    softmax_scale=SCALE, max_rows=8, max_kv_len=c["max_kv"], out=out, config=cfg,
                    num_splits=17, workspace=ws, fused=True)
    x.cuda.get_current_stream().synchronize()
    assert int(a.mla_fault_word()[0]) == 1
    with pytest.raises(RuntimeError, match="barrier timed out"):
        a.check_mla_faults()
    assert int(a.mla_fault_word()[0]) == 0 and not ws.sync.any()
    got = launch(c, d, cfg, 17, True, ws=ws)
    base.check(c, got, "after the reset")


def test_refuses_what_it_cannot_run():
    x = cp()
    a = attn()
    rng = np.random.default_rng(47)
    c = base.make_case(rng, 1, 8, [8], [3000], "tree", gap=False)
    d = base.to_dev(c)
    out = x.empty((c["T"], 8, 512), x.uint16)
    big = a.MLA_CONFIGS["large" if fits(a.MLA_CONFIGS["large"]) else "small"]
    with pytest.raises(ValueError, match="not an mla_attn_ksplit"):
        a.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"], mask=d["mask"],
                        softmax_scale=SCALE, max_rows=8, max_kv_len=c["max_kv"], out=out, config=big,
                        num_splits=4, fused=True)
    cfg = a.MLA_CONFIGS["ks16_2stage"]
    resident = a._resident_blocks(x.cuda.Device().id, a.MLA_SPEC, cfg.fused_name, cfg.threads, cfg.smem)
    splits = min(a.MAX_SPLITS, resident // 4 + 1)       # 4 row tiles x splits > resident
    with pytest.raises(ValueError, match="co-resident"):
        a.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"], mask=d["mask"],
                        softmax_scale=SCALE, max_rows=8, max_kv_len=c["max_kv"], out=out, config=cfg,
                        num_splits=splits, fused=True)
