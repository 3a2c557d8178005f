"""GPU: the split-KV combine fused with W_UV (cuda_src/mla_attention.cu mla_attn_combine_uv,
``mla_attention(..., w_uv=)``; docs/ATTENTION.md "Session 5: W_UV folded into the combine").

The fused launch must equal the two-launch path it replaces (mla_attn_combine<U> -> bf16 o_lat ->
fused.mla_head_gemm<8>) BIT FOR BIT: the kernel repeats both kernels' operations in the same order (the 8
warp chains of the combine, mla_head_gemm's 4 K quarters of 8 mma k-steps added in quarter order). It must
also match the float64 reference (attention, o_lat rounded to bf16, @ W_UV^T in float64) within bf16
tolerance. Outputs are poisoned before every launch; rows no stream owns must stay poisoned (split plans).
Covered: random partials with empty splits (NaN partials that must never be read) and a row with every
split empty, 2..256 splits, every rows-per-block choice; end to end random trees and chains, 1/4/10 streams,
1/8/16/32 rows, plan / 1 / 2 / 7 splits; graph replay (the arrival counters reset) and a PDL chain; bad
arguments; GpuTarget with the module switch on vs off on the tiny checkpoint.
"""
import numpy as np
import pytest

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
from ddtree_cupy.reference import attention as ra

pytestmark = pytest.mark.gpu

SCALE = 0.14467963
POISON = 0xFFFF        # a bf16 NaN
TOL = 1e-2             # relative norm vs float64: P rounded to bf16 before P V, o_lat and o rounded to bf16
H = 8                  # the engine's heads per TP=8 rank
DV = 128


def cp():
    import cupy
    return cupy


def attn():
    from ddtree_cupy.kernels import attention
    return attention


def f64(bits):
    return bf16_bits_to_f32(np.asarray(bits)).astype(np.float64)


def rand_w(rng, h=H):
    """W_UV [h, 128, 512] bf16 at the scale of a trained projection (outputs O(1))."""
    return to_bf16_bits(rng.standard_normal((h, DV, 512)) / np.sqrt(512))


def make_case(rng, S, n_list, s_list, mode, max_rows=None):
    """Host arrays of one attention launch; streams' rows packed with random gaps (rows no stream owns)."""
    lengths = [s + n for s, n in zip(s_list, n_list)]
    need = [-(-L // 64) for L in lengths]
    num_pages = sum(need) + 3
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.full((S, max(need) + 1), -1, np.int32)
    k = 0
    for b in range(S):
        table[b, :need[b]] = perm[k:k + need[b]]
        k += need[b]
    row_start = np.zeros(S, np.int32)
    r = 0
    for b in range(S):
        r += int(rng.integers(0, 3))
        row_start[b] = r
        r += n_list[b]
    T = r + 1
    mask = None
    if mode == "tree":
        mask = np.zeros((S, 129, 5), np.uint32)
        for b in range(S):
            par = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n_list[b])], np.int32)
            mask[b] = ra.ancestor_mask_bits(par, 129)
    return dict(q=to_bf16_bits(rng.standard_normal((T, H, 576)) * 0.5),
                pool=to_bf16_bits(rng.standard_normal((num_pages, 64, 576))), table=table,
                prefix=np.array(s_list, np.int32), n=np.array(n_list, np.int32), row_start=row_start, mask=mask,
                S=S, T=T, max_rows=max_rows or max(n_list), max_kv=max(lengths))


def to_dev(c):
    x = cp()
    d = {k: x.asarray(c[k]) for k in ("q", "pool", "table", "prefix", "n", "row_start")}
    d["mask"] = x.asarray(c["mask"]) if c["mask"] is not None else None
    return d


def owned_rows(c):
    own = np.zeros(c["T"], bool)
    for b in range(c["S"]):
        own[c["row_start"][b]:c["row_start"][b] + c["n"][b]] = True
    return own


def attention(c, d, out, **kw):
    attn().mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"], mask=d["mask"],
                         softmax_scale=SCALE, max_rows=c["max_rows"], max_kv_len=c["max_kv"], out=out, **kw)


def two_launch(c, d, w_dev, num_splits=None, unroll=None):
    """Today's path: mla_attention -> o_lat (bf16) -> fused.mla_head_gemm."""
    x = cp()
    from ddtree_cupy.kernels.fused import mla_head_gemm
    o_lat = x.full((c["T"], H, 512), POISON, dtype=x.uint16)
    o = x.full((c["T"], H, DV), POISON, dtype=x.uint16)
    attention(c, d, o_lat, num_splits=num_splits, combine_unroll_override=unroll)
    mla_head_gemm(o_lat, w_dev, o)
    x.cuda.get_current_stream().synchronize()
    return o.get()


def fused(c, d, w_dev, num_splits=None, rows=None, workspace=None):
    x = cp()
    o = x.full((c["T"], H, DV), POISON, dtype=x.uint16)
    attention(c, d, o, num_splits=num_splits, w_uv=w_dev, uv_rows_override=rows, workspace=workspace)
    x.cuda.get_current_stream().synchronize()
    return o.get()


def reference(c, w):
    """float64 attention, o_lat rounded to bf16 (as the combine stores it), @ W_UV^T in float64."""
    lat = ra.mla_attention_ref(c["q"], c["pool"], c["table"], c["prefix"], c["n"], c["row_start"], SCALE, c["mask"])
    lat = f64(to_bf16_bits(lat))
    return np.einsum("thk,hnk->thn", lat, f64(w))


def check_ref(c, got, ref, label):
    for b in range(c["S"]):
        sl = slice(c["row_start"][b], c["row_start"][b] + c["n"][b])
        g = f64(got[sl])
        assert np.isfinite(g).all(), f"{label}: stream {b}: non-finite outputs (unwritten rows?)"
        err = np.linalg.norm(g - ref[sl]) / np.linalg.norm(ref[sl])
        assert err < TOL, f"{label}: stream {b} (s={c['prefix'][b]}, n={c['n'][b]}) rel err {err:.3e}"


# ---- the kernel on its own: random partials ---------------------------------------------------------------
@pytest.mark.parametrize("num_splits", [2, 9, 65, 256])
@pytest.mark.parametrize("rows", [1, 3, 16, None])
def test_combine_uv_kernel_bitwise_and_float64(num_splits, rows):
    """mla_attn_combine_uv on random partials (some splits empty: lse -inf and a NaN partial that would poison
    the row if read; packed row 5 with every split empty: o = 0) vs (a) mla_attn_combine<U> + mla_head_gemm
    for U = 4 and 1, bit for bit, (b) the float64 merge rounded to bf16 @ W_UV. Streams of 3, 1 and 17 rows
    (17: two row groups at 16 rows per block), rows no stream owns stay poisoned, counters back to zero."""
    x = cp()
    a = attn()
    from ddtree_cupy.kernels.compile import get_kernel
    from ddtree_cupy.kernels.fused import mla_head_gemm
    rng = np.random.default_rng(31 + num_splits + (rows or 0))
    S = 3
    n = np.array([3, 1, 17], np.int32)
    row_start = np.array([0, 4, 6], np.int32)     # row 3 and rows 23.. belong to no stream
    T = 25
    P = T * H
    lse = rng.uniform(-8, 8, (num_splits, P)).astype(np.float32)
    lse[rng.random((num_splits, P)) < 0.3] = -np.inf
    lse[:, 5] = -np.inf
    po = rng.standard_normal((num_splits, P, 512)).astype(np.float32)
    po[np.isneginf(lse)] = np.nan
    w = rand_w(rng)
    po_d, lse_d, n_d, rs_d, w_d = (x.asarray(v) for v in (po, lse, n, row_start, w))
    ws = a.MlaWorkspace(num_splits, T, H, fused_uv=True)
    ws.uv_part.fill(np.nan)   # only what the quarter blocks wrote may be read back
    num_sms = x.cuda.Device().attributes["MultiProcessorCount"]
    rt = rows or a.uv_rows_per_block(S, int(n.max()), H, num_sms)
    groups = -(-int(n.max()) // rt)
    out = x.full((T, H, DV), POISON, dtype=x.uint16)
    k = get_kernel(a.MLA_SPEC, "mla_attn_combine_uv")
    for rep in range(2):      # twice: the second launch needs the counters the first one reset
        out.fill(POISON)
        k((H, 4, S * groups), (256,), (po_d, lse_d, n_d, rs_d, np.int32(H), np.int32(P), np.int32(num_splits),
                                       np.int32(rt), np.int32(groups), w_d, ws.uv_part, ws.uv_count, out,
                                       np.int64(H * DV), np.int64(DV)))
        x.cuda.get_current_stream().synchronize()
        assert int(ws.uv_count.sum()) == 0 and int(abs(ws.uv_count).max()) == 0, "arrival counters not reset"
    got = out.get()
    own = np.zeros(T, bool)
    for b in range(S):
        own[row_start[b]:row_start[b] + n[b]] = True
    assert (got[~own] == POISON).all(), "rows no stream owns were written"
    for u in (4, 1):
        lat = x.full((T, H, 512), POISON, dtype=x.uint16)
        comb = get_kernel(a.MLA_SPEC, f"mla_attn_combine<{u}>")
        comb((int(n.max()) * H, S), (256,), (po_d, lse_d, n_d, rs_d, np.int32(H), np.int32(P),
                                             np.int32(num_splits), lat))
        two = x.full((T, H, DV), POISON, dtype=x.uint16)
        mla_head_gemm(lat, w_d, two)
        two = two.get()
        diff = np.nonzero((got[own] != two[own]).any(-1))
        assert np.array_equal(got[own], two[own]), f"U={u}: differs from combine + mla_head_gemm at {diff}"
    # float64: merge, bf16 rounding of o_lat, product
    lse64 = lse.astype(np.float64)
    lat_ref = np.zeros((P, 512))
    for m in range(P):
        ok = np.isfinite(lse64[:, m])
        if ok.any():
            wt = np.exp2(lse64[ok, m] - lse64[ok, m].max())
            lat_ref[m] = (wt[:, None] * po[ok, m].astype(np.float64)).sum(0) / wt.sum()
    lat_ref = f64(to_bf16_bits(lat_ref)).reshape(T, H, 512)
    ref = np.einsum("thk,hnk->thn", lat_ref, f64(w))
    g = f64(got)
    assert (g.reshape(P, DV)[5] == 0).all(), "a row whose splits are all empty must give zeros"
    assert np.isfinite(g[own]).all()
    err = np.linalg.norm(g[own] - ref[own]) / np.linalg.norm(ref[own])
    assert err < 6e-3, f"rel err {err:.2e}"   # bf16 rounding of o (2^-9) plus o_lat's occasional last-bit flips


# ---- end to end through mla_attention ---------------------------------------------------------------------
CASES = [   # (streams, rows per stream, prefix range, mode)
    (1, 1, 1500, "causal"), (1, 8, 1500, "tree"), (1, 16, 900, "tree"), (1, 32, 900, "chain"),
    (4, 8, 700, "tree"), (4, 16, 500, "causal"), (10, 8, 300, "tree"), (10, 32, 200, "tree"),
]


@pytest.mark.parametrize("S,R,s_hi,mode", CASES)
def test_fused_uv_equals_two_launch_path(S, R, s_hi, mode):
    """mla_attention(out=o, w_uv=W) vs mla_attention(out=o_lat) + mla_head_gemm: bit for bit on every owned row,
    at the plan's split count, one split (the W_UV launch stays separate there), 2 and 7 splits; and the
    float64 reference. "chain": a tree whose node i's parent is i - 1 (= causal, through the mask path)."""
    x = cp()
    rng = np.random.default_rng(1000 * S + R + len(mode))
    n_list = [R] + [int(rng.integers(1, R + 1)) for _ in range(S - 1)]   # max_rows = R, ragged streams
    # stream 0 long (a many-split plan), the others around page boundaries or random
    s_list = [int(rng.integers(s_hi // 2, s_hi))] + \
        [int(rng.choice([0, 63, 64, int(rng.integers(0, s_hi))])) for _ in range(S - 1)]
    c = make_case(rng, S, n_list, s_list, "causal" if mode == "causal" else "tree")
    if mode == "chain":
        for b in range(S):
            c["mask"][b] = ra.ancestor_mask_bits(np.arange(-1, n_list[b] - 1, dtype=np.int32), 129)
    d = to_dev(c)
    w = rand_w(rng)
    w_d = x.asarray(w)
    ref = reference(c, w)
    own = owned_rows(c)
    _, planned = attn().plan_mla(S, c["max_rows"], H, c["max_kv"])
    for k in sorted({planned, 1, 2, 7}):
        two = two_launch(c, d, w_d, num_splits=k)
        got = fused(c, d, w_d, num_splits=k)
        label = f"S={S} R={R} {mode} splits={k}"
        if k > 1:
            assert (got[~own] == POISON).all(), f"{label}: rows no stream owns were written"
        assert np.array_equal(got[own], two[own]), f"{label}: fused differs from the two-launch path"
        check_ref(c, got, ref, label)


def test_rows_per_block_choices_agree():
    """Every rows-per-block choice (1..16, incl. ones that do not divide the rows) gives the same bits."""
    x = cp()
    rng = np.random.default_rng(77)
    c = make_case(rng, 3, [32, 13, 20], [500, 64, 1100], "tree")
    d = to_dev(c)
    w_d = x.asarray(rand_w(rng))
    base = fused(c, d, w_d, num_splits=5, rows=16)
    own = owned_rows(c)
    for rt in (1, 2, 3, 4, 8, 11):
        got = fused(c, d, w_d, num_splits=5, rows=rt)
        assert np.array_equal(got[own], base[own]), f"rows per block {rt} differs from 16"
        assert (got[~own] == POISON).all()


# ---- graphs and PDL -----------------------------------------------------------------------------------------
def test_graph_replay_equals_eager_with_new_lengths():
    """A captured fused launch replayed with new lengths / trees / queries written in place: equal to the
    eager fused launch and to the two-launch path (the arrival counters must be back at zero each time)."""
    x = cp()
    a = attn()
    rng = np.random.default_rng(17)
    S, R, max_kv = 4, 16, 1024
    c = make_case(rng, S, [R] * S, [900, 1000, 64, 700], "tree", max_rows=R)
    c["max_kv"] = max_kv
    # every stream gets pages for the bucket's 1024 positions
    c["table"] = np.pad(c["table"], ((0, 0), (0, max(0, 17 - c["table"].shape[1]))), constant_values=-1)
    extra = rng.permutation(S * 16).astype(np.int32) + c["pool"].shape[0]
    c["pool"] = np.concatenate([c["pool"], to_bf16_bits(rng.standard_normal((S * 16, 64, 576)))])
    for b in range(S):
        have = int((c["table"][b] >= 0).sum())
        c["table"][b, have:16] = extra[b * 16:b * 16 + 16 - have]
    c["row_start"] = np.arange(S, dtype=np.int32) * R
    c["T"] = S * R
    c["q"] = c["q"][:S * R]
    d = to_dev(c)
    w_d = x.asarray(rand_w(rng))
    _, splits = a.plan_mla(S, R, H, max_kv)
    assert splits > 1, "the graph test must cover the fused combine"
    ws = a.MlaWorkspace(splits, c["T"], H, fused_uv=True)
    o = x.full((c["T"], H, DV), POISON, dtype=x.uint16)
    stream = x.cuda.Stream(non_blocking=True)
    with stream:
        attention(c, d, o, w_uv=w_d, workspace=ws)      # eager first: compiles outside the capture
        stream.synchronize()
        stream.begin_capture()
        attention(c, d, o, w_uv=w_d, workspace=ws)
        graph = stream.end_capture()
    for step in range(3):
        n_new = rng.integers(1, R + 1, S).astype(np.int32)
        s_new = np.array([int(rng.integers(0, max_kv - nn)) for nn in n_new], np.int32)
        mask_new = np.zeros((S, 129, 5), np.uint32)
        for b in range(S):
            par = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n_new[b])])
            mask_new[b] = ra.ancestor_mask_bits(par, 129)
        d["n"][...] = x.asarray(n_new)
        d["prefix"][...] = x.asarray(s_new)
        d["mask"][...] = x.asarray(mask_new)
        o[...] = POISON
        x.cuda.Stream.null.synchronize()  # the null-stream writes above are not ordered before a non-blocking stream
        graph.launch(stream)
        stream.synchronize()
        replay = o.get()
        assert int(abs(ws.uv_count).max()) == 0, f"step {step}: arrival counters not reset"
        c2 = dict(c, n=n_new, prefix=s_new, mask=mask_new)
        d2 = to_dev(c2)
        eager = fused(c2, d2, w_d, num_splits=splits)
        two = two_launch(c2, d2, w_d, num_splits=splits)
        own = owned_rows(c2)
        assert np.array_equal(replay, eager), f"step {step}: graph replay differs from eager"
        assert np.array_equal(replay[own], two[own]), f"step {step}: replay differs from the two-launch path"
        assert (replay[~own] == POISON).all()


def test_pdl_chain_equals_plain_launches():
    """kv_write_latent -> mla_attention(w_uv=) with programmatic dependent launch: each round rewrites the whole
    context and the queries, so a fused block that read partials / lse before its DDT_PDL_WAIT() (only W_UV may
    be read there) would use the previous round's. Bit-identical to plain launches, eagerly and from a graph."""
    x = cp()
    a = attn()
    from ddtree_cupy.kernels import launch
    from ddtree_cupy.kernels.kv_cache import kv_write_latent
    if int(x.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90+")
    rng = np.random.default_rng(23)
    S, n = 3, 8
    c = make_case(rng, S, [n] * S, [700, 1500, 64], "tree")
    d = to_dev(c)
    w_d = x.asarray(rand_w(rng))
    lengths = c["prefix"] + c["n"]
    sid = x.asarray(np.concatenate([np.full(L, b, np.int32) for b, L in enumerate(lengths)]))
    pos = x.asarray(np.concatenate([np.arange(L, dtype=np.int32) for L in lengths]))
    _, splits = a.plan_mla(S, n, H, c["max_kv"])
    assert splits > 1, "the chain must include the fused combine"
    ws = a.MlaWorkspace(splits, c["T"], H, fused_uv=True)
    lat = x.empty((len(pos), 576), x.uint16)
    o = x.empty((c["T"], H, DV), x.uint16)
    stream = x.cuda.Stream(non_blocking=True)

    def step():
        kv_write_latent(d["pool"], d["table"], sid, pos, lat)
        attention(c, d, o, w_uv=w_d, workspace=ws)

    def fresh(round_):
        r = np.random.default_rng(1000 + round_)
        lat[...] = x.asarray(to_bf16_bits(r.standard_normal(lat.shape)))
        d["q"][...] = x.asarray(to_bf16_bits(r.standard_normal(c["q"].shape) * 0.5))

    own = owned_rows(c)
    try:
        with stream:
            for rnd in range(2):
                results = []
                for pdl in (False, True):
                    fresh(rnd)
                    o[...] = POISON
                    launch.set_pdl(pdl)
                    step()
                    stream.synchronize()
                    results.append(o.get())
                assert np.array_equal(results[0], results[1]), f"round {rnd}: PDL result differs"
                assert np.isfinite(f64(results[1][own])).all() and (results[1][~own] == POISON).all()
            launch.set_pdl(True)
            stream.begin_capture()
            step()
            graph = stream.end_capture()
            for rnd in range(2, 4):
                fresh(rnd)
                o[...] = POISON
                graph.launch(stream)
                stream.synchronize()
                replay = o.get()
                launch.set_pdl(False)
                fresh(rnd)
                o[...] = POISON
                step()
                stream.synchronize()
                launch.set_pdl(True)
                assert np.array_equal(replay, o.get()), f"round {rnd}: graph replay with PDL differs"
    finally:
        launch.set_pdl(False)


def test_bad_inputs_name_the_argument():
    x = cp()
    a = attn()
    rng = np.random.default_rng(19)
    c = make_case(rng, 2, [4, 4], [10, 700], "tree")
    d = to_dev(c)
    w_d = x.asarray(rand_w(rng))
    o = x.empty((c["T"], H, DV), x.uint16)
    with pytest.raises(ValueError, match="w_uv"):
        attention(c, d, o, w_uv=w_d[:, :64])
    with pytest.raises(ValueError, match="w_uv"):
        attention(c, d, o, w_uv=w_d.astype(x.float32))
    with pytest.raises(ValueError, match="out"):
        attention(c, d, x.empty((c["T"], H, 512), x.uint16), w_uv=w_d)
    with pytest.raises(ValueError, match="w_uv"):   # o_lat / uv_rows_override only mean something with w_uv
        attention(c, d, x.empty((c["T"], H, 512), x.uint16), uv_rows_override=2)
    with pytest.raises(ValueError, match="uv_rows_override"):
        attention(c, d, o, w_uv=w_d, num_splits=3, uv_rows_override=17)
    with pytest.raises(ValueError, match="workspace"):
        attention(c, d, o, w_uv=w_d, num_splits=3, workspace=a.MlaWorkspace(3, c["T"], H))


# ---- the model ---------------------------------------------------------------------------------------------
def test_target_forward_switch_on_equals_off():
    """GpuTarget on the tiny checkpoint: a causal prefill then a tree step, with DDT_MLA_FUSED_UV off and on
    (set_mla_fused_uv): the same logits and features bit for bit on every real row, and with the switch on no
    "w_uv" stage and one mla_attn_combine_uv launch per layer instead of combine + mla_head_gemm."""
    x = cp()
    a = attn()
    from ddtree_cupy.config import DrafterConfig, TargetConfig
    from ddtree_cupy.engine.profile import count_launches
    from ddtree_cupy.models.batch import TargetBatch
    from ddtree_cupy.models.kv import GpuLatentCache
    from ddtree_cupy.models.target import GpuTarget
    from ddtree_cupy.models.weights import GpuTargetWeights
    from ddtree_cupy.tinymodel import ensure_tiny_checkpoints
    tdir, ddir = ensure_tiny_checkpoints()
    cfg = TargetConfig.load(tdir)
    feat = tuple(DrafterConfig.load(ddir).target_layer_ids)
    w = GpuTargetWeights.from_checkpoint(tdir, cfg, 0, 1)
    L = cfg.num_hidden_layers
    S, Rp, Rt, pages = 2, 64, 8, 16
    lens = np.array([64, 50])
    results, counts, names = [], [], []
    prev = a.MLA_FUSED_UV
    try:
        for on in (False, True):
            a.set_mla_fused_uv(on)
            rng = np.random.default_rng(41)
            tgt = GpuTarget(cfg, w, None, max_tokens=S * Rp, feature_layers=feat)
            nh = tgt.d["nh"]
            kv = GpuLatentCache(L, S * pages + 2, S, pages)
            kv.set_block_table(rng.permutation(S * pages + 2)[:S * pages].reshape(S, pages))
            for p in kv.pools:
                p.fill(POISON)
            for name in ("o_lat", "o", "attn_out"):
                getattr(tgt, name).fill(POISON)
            bp = TargetBatch(S, Rp, cfg, 1, len(feat), tree=False)
            bp.set(tokens=rng.integers(0, cfg.vocab_size, (S, Rp)), positions=np.tile(np.arange(Rp), (S, 1)),
                   n_rows=lens, prefix_len=np.zeros(S, int))
            tgt.forward(bp, kv)
            pre = bp.logits.get()
            bt = TargetBatch(S, Rt, cfg, 1, len(feat), tree=True)
            vis = np.zeros((S, Rt, Rt), bool)
            pos = np.zeros((S, Rt), int)
            n_rows = np.array([Rt, 5])
            for s in range(S):
                par = [-1] + [int(rng.integers(0, i)) for i in range(1, n_rows[s])]
                dep = [0] * n_rows[s]
                for i in range(n_rows[s]):
                    j = i
                    while j >= 0:
                        vis[s, i, j] = True
                        j = par[j]
                    dep[i] = dep[par[i]] + 1 if i else 0
                for r in range(n_rows[s], Rt):
                    vis[s, r, 0] = vis[s, r, r] = True
                pos[s, :n_rows[s]] = lens[s] + np.array(dep)
                pos[s, n_rows[s]:] = lens[s]
            bt.set(tokens=rng.integers(0, cfg.vocab_size, (S, Rt)), positions=pos, n_rows=n_rows, prefix_len=lens,
                   mask=vis)
            _, splits = a.plan_mla(S, Rt, nh, kv.capacity_per_stream)
            assert splits > 1, "the tree step must use a split plan (the fused combine)"
            names.append([n for n, _ in tgt.layer_stages(0, bt, kv)])
            with count_launches() as lc:
                tgt.forward(bt, kv)
            x.cuda.get_current_stream().synchronize()
            counts.append(dict(lc.counts))
            rows = np.r_[0:Rt, Rt:Rt + n_rows[1]]
            prows = np.r_[0:lens[0], Rp:Rp + lens[1]]
            results.append((pre[prows], bt.logits.get()[rows], bt.features.get()[rows]))
    finally:
        a.set_mla_fused_uv(prev)
    off, on_ = results
    assert np.isfinite(off[1]).all() and np.isfinite(off[0]).all()
    assert "w_uv" in names[0] and "w_uv" not in names[1], names
    assert counts[0].get("mla_head_gemm") == 2 * L and counts[0].get("mla_attn_combine") == L, counts[0]
    assert counts[1].get("mla_head_gemm") == L and counts[1].get("mla_attn_combine_uv") == L, counts[1]
    assert "mla_attn_combine" not in counts[1], counts[1]
    for what, g, r in zip(("prefill logits", "tree logits", "tree features"), on_, off):
        assert np.array_equal(g, r), f"{what}: switch on differs from off (max abs " \
                                     f"{np.abs(np.asarray(g, np.float64) - np.asarray(r, np.float64)).max():.3g})"
