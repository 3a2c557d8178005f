"""GPU: absorbed MLA attention (ddtree_cupy/kernels/attention.py) against the float64 reference.

Random trees (parents drawn at random, parent before child), random prefix lengths crossing page
boundaries, shuffled page tables, 1-10 streams, 1/8/64 heads, every tile configuration (the sm_120 ones
run on any GPU), split-KV on and off. Outputs are poisoned before every launch; rows no stream owns must
stay poisoned. The mask is proven by perturbing every K/V row a query row must not see.

config "model" = the (tile, split count) the planner's "model" policy picks for the test's shape on this GPU
(plan_mla(..., policy="model")), so every plan that policy can make here runs through the same checks as the
default ("measured", config None) plan and the explicit tiles."""
import numpy as np
import pytest

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
from ddtree_cupy.reference import attention as ra

pytestmark = pytest.mark.gpu

SCALE = 0.14467963
POISON = 0xFFFF   # a bf16 NaN
TOL = 1e-2        # relative norm error vs float64; P is rounded to bf16 before P.V, outputs are bf16


def cp():
    import cupy
    return cupy


def attn():
    from ddtree_cupy.kernels import attention
    return attention


def make_case(rng, S, H, n_list, s_list, mode="tree", gap=True, max_rows=None, extra_pages=4):
    """Host arrays of one launch. Streams' rows are packed with random gaps (rows nobody owns)."""
    lengths = [s + n for s, n in zip(s_list, n_list)]
    need = [-(-L // 64) for L in lengths]
    max_pages = max(need) + 2
    num_pages = sum(need) + extra_pages
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.full((S, max_pages), -1, np.int32)
    k = 0
    for b in range(S):
        table[b, :need[b]] = perm[k:k + need[b]]
        k += need[b]
    pool = to_bf16_bits(rng.standard_normal((num_pages, 64, 576)))
    row_start = np.zeros(S, np.int32)
    r = 0
    for b in range(S):
        r += int(rng.integers(0, 3)) if gap else 0
        row_start[b] = r
        r += n_list[b]
    T = r + (1 if gap else 0)
    q = to_bf16_bits(rng.standard_normal((T, H, 576)) * 0.5)
    mask = None
    parents = []
    if mode == "tree":
        mask = np.zeros((S, 129, 5), np.uint32)
        for b in range(S):
            par = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n_list[b])], np.int32)
            parents.append(par)
            mask[b] = ra.ancestor_mask_bits(par, 129)
    return dict(q=q, pool=pool, table=table, prefix=np.array(s_list, np.int32), n=np.array(n_list, np.int32),
                row_start=row_start, mask=mask, H=H, S=S, T=T, parents=parents,
                max_rows=max_rows or max(n_list), max_kv=max(lengths))


# every tile configuration (kernels/attention.py MLA_CONFIGS); the sm_120 ones run on any GPU
ALL_CONFIGS = ["large", "mid", "small", "ks32", "ks32_2stage", "ks16", "ks16_2stage", "ks16_5stage"]
# the mla_attn_ksplit tiles the planner can choose on the H200, each pipeline depth
KSPLIT_CONFIGS = ["ks32", "ks16", "ks16_5stage"]


def skip_unless_fits(config):
    x = cp()
    if config not in (None, "model") and \
            attn().MLA_CONFIGS[config].smem > x.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]:
        pytest.skip(f"{config} tiles do not fit this GPU's shared memory")


def test_the_lists_cover_every_config():
    assert sorted(ALL_CONFIGS) == sorted(attn().MLA_CONFIGS)


def to_dev(c):
    x = cp()
    d = {k: x.asarray(c[k]) for k in ("q", "pool", "table", "prefix", "n", "row_start")}
    d["mask"] = x.asarray(c["mask"]) if c["mask"] is not None else None
    return d


def run(c, d=None, config=None, num_splits=None, out=None, unroll=None):
    x = cp()
    a = attn()
    d = d or to_dev(c)
    if out is None:
        out = x.full((c["T"], c["H"], 512), POISON, dtype=x.uint16)
    if config == "model":
        cfg, planned = a.plan_mla(c["S"], c["max_rows"], c["H"], c["max_kv"], policy="model")
        num_splits = planned if num_splits is None else num_splits
    else:
        cfg = a.MLA_CONFIGS[config] if config else None
    a.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"], mask=d["mask"],
                    softmax_scale=SCALE, max_rows=c["max_rows"], max_kv_len=c["max_kv"], out=out,
                    config=cfg, num_splits=num_splits, combine_unroll_override=unroll)
    x.cuda.get_current_stream().synchronize()
    return out.get()


def owned_rows(c):
    own = np.zeros(c["T"], bool)
    for b in range(c["S"]):
        own[c["row_start"][b]:c["row_start"][b] + c["n"][b]] = True
    return own


def reference(c):
    return ra.mla_attention_ref(c["q"], c["pool"], c["table"], c["prefix"], c["n"], c["row_start"], SCALE, c["mask"])


def check(c, got, label="", ref=None):
    if ref is None:
        ref = reference(c)
    own = owned_rows(c)
    assert (got[~own] == POISON).all(), f"{label}: rows no stream owns were written"
    g = bf16_bits_to_f32(got[own]).astype(np.float64)
    assert np.isfinite(g).all(), f"{label}: non-finite outputs"
    for b in range(c["S"]):
        sl = slice(c["row_start"][b], c["row_start"][b] + c["n"][b])
        gb = bf16_bits_to_f32(got[sl]).astype(np.float64)
        err = np.linalg.norm(gb - ref[sl]) / np.linalg.norm(ref[sl])
        assert err < TOL, f"{label}: stream {b} (s={c['prefix'][b]}, n={c['n'][b]}) rel err {err:.3e}"
    return ref


@pytest.mark.parametrize("config", ALL_CONFIGS + ["model"])
@pytest.mark.parametrize("H", [1, 8, 64])
def test_tree_verify_random(config, H):
    x = cp()
    a = attn()
    if config != "model" and a.MLA_CONFIGS[config].smem > x.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]:
        pytest.skip(f"{config} tiles do not fit this GPU's shared memory")
    rng = np.random.default_rng(100 + H + len(config))
    for trial in range(3):
        S = int(rng.integers(1, 11))
        max_n = 65 if H == 64 else 129
        n_list = [int(rng.integers(1, max_n + 1)) for _ in range(S)]
        s_hi = 300 if H == 64 else 1500
        s_list = [int(rng.choice([0, 63, 64, 65, int(rng.integers(0, s_hi))])) for _ in range(S)]
        c = make_case(rng, S, H, n_list, s_list, "tree")
        ref = reference(c)
        for splits in (None, 1):
            got = run(c, config=config, num_splits=splits)
            check(c, got, f"{config} H={H} trial {trial} splits={splits}", ref)


@pytest.mark.parametrize("config", ALL_CONFIGS + ["model"])
def test_mask_hides_every_invisible_row(config):
    """Perturb the K/V of every tree slot that a chosen row must not see (and every page no stream
    owns): that row's outputs must not change by a single bit, while rows that see a perturbed slot do."""
    x = cp()
    a = attn()
    if config != "model" and a.MLA_CONFIGS[config].smem > x.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]:
        pytest.skip("tiles do not fit")
    rng = np.random.default_rng(7)
    S, H = 6, 8
    n_list = [int(rng.integers(2, 130)) for _ in range(S)]
    s_list = [int(rng.integers(0, 700)) for _ in range(S)]
    c = make_case(rng, S, H, n_list, s_list, "tree", extra_pages=6)
    base = run(c, config=config)
    check(c, base, "base")
    pool2 = c["pool"].copy()
    used = set(c["table"][c["table"] >= 0].tolist())
    for p in range(pool2.shape[0]):
        if p not in used:
            pool2[p] = to_bf16_bits(rng.standard_normal((64, 576)) * 30)
    chosen = []
    for b in range(S):
        n, s = c["n"][b], c["prefix"][b]
        i = int(rng.integers(0, n))
        chosen.append(i)
        vis = ra.mask_visible(c["mask"][b], n)[i]
        for j in np.nonzero(~vis)[0]:
            pos = s + j
            pool2[c["table"][b, pos // 64], pos % 64] = to_bf16_bits(rng.standard_normal(576) * 30)
    c2 = dict(c, pool=pool2)
    got = run(c2, config=config)
    changed_any = False
    for b in range(S):
        r = c["row_start"][b] + chosen[b]
        assert np.array_equal(got[r], base[r]), f"stream {b} row {chosen[b]} saw an invisible slot"
        sl = slice(c["row_start"][b], c["row_start"][b] + c["n"][b])
        changed_any |= not np.array_equal(got[sl], base[sl])
    assert changed_any, "the perturbation changed nothing at all: the test would not catch a mask bug"
    check(c2, got, "perturbed")


@pytest.mark.parametrize("config", [None, "model"] + KSPLIT_CONFIGS)
def test_decode_equals_tree_of_one_and_chain_equals_causal(config):
    skip_unless_fits(config)
    rng = np.random.default_rng(9)
    S, H = 5, 8
    s_list = [int(rng.integers(1, 3000)) for _ in range(S)]
    c1 = make_case(rng, S, H, [1] * S, s_list, "tree")
    tree = run(c1, config=config)
    dec = run(dict(c1, mask=None), config=config)
    assert np.array_equal(tree, dec)
    check(c1, tree, "decode")
    n_list = [int(rng.integers(2, 20)) for _ in range(S)]
    c2 = make_case(rng, S, H, n_list, s_list, "tree")
    for b in range(S):   # a chain: parent of row i is i - 1
        c2["mask"][b] = ra.ancestor_mask_bits(np.arange(n_list[b]) - 1, 129)
    # split boundaries must not depend on the causal clipping of a row tile (7 splits: several per stream)
    for splits in (None, 1, 7):
        chain_tree = run(c2, config=config, num_splits=splits)
        chain_causal = run(dict(c2, mask=None), config=config, num_splits=splits)
        assert np.array_equal(chain_tree, chain_causal), f"splits={splits}"
        check(c2, chain_tree, "chain")


@pytest.mark.parametrize("config", [None, "model", "ks32", "ks16"])
@pytest.mark.parametrize("H", [8, 64])
def test_prefill_chunks_equal_one_causal_pass(H, config):
    rng = np.random.default_rng(11 + H)
    N = 400 if H == 8 else 200
    cuts = [0, 150, 151, N] if H == 8 else [0, 130, N]
    full = make_case(rng, 1, H, [N], [0], "causal", gap=False)
    one = run(full, config=config)
    ref = check(full, one, "single pass")
    got = np.empty_like(one)
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        ck = dict(full, q=full["q"][lo:hi], prefix=np.array([lo], np.int32), n=np.array([hi - lo], np.int32),
                  T=hi - lo, max_rows=hi - lo, max_kv=hi)
        part = run(ck, config=config)
        check(ck, part, f"chunk {lo}:{hi}")
        got[lo:hi] = part
    g = bf16_bits_to_f32(got).astype(np.float64)
    o = bf16_bits_to_f32(one).astype(np.float64)
    assert np.linalg.norm(g - o) / np.linalg.norm(ref) < TOL


@pytest.mark.parametrize("config", [None, "model"] + KSPLIT_CONFIGS)
def test_split_count_does_not_change_results_beyond_rounding(config):
    """Also the combine's edges: split counts that are not a multiple of the splits it loads per round
    (8 warps x 4), empty splits (64 and 256 splits give the 2109-position stream empty ones: lse = -inf,
    their partials are never read) and the largest count, 256 (MAX_SPLITS)."""
    skip_unless_fits(config)
    rng = np.random.default_rng(13)
    c = make_case(rng, 2, 8, [16, 9], [5000, 2100], "tree")
    ref = reference(c)
    outs = []
    for k in (1, 3, 17, 33, 64, 256):
        for u in (4, 1):   # both combine variants (the rule picks 4 for this small grid)
            got = run(c, num_splits=k, config=config, unroll=u)
            check(c, got, f"splits={k} unroll={u}", ref)
            outs.append(bf16_bits_to_f32(got).astype(np.float64))
    own = owned_rows(c)
    for o in outs[1:]:
        assert np.linalg.norm(o[own] - outs[0][own]) / np.linalg.norm(ref[own]) < TOL


@pytest.mark.parametrize("config", [None, "model"] + KSPLIT_CONFIGS)
def test_graph_replay_equals_eager_with_new_lengths_written_in_place(config):
    skip_unless_fits(config)
    x = cp()
    a = attn()
    rng = np.random.default_rng(17)
    S, H = 4, 8
    c = make_case(rng, S, H, [32] * S, [900, 1000, 64, 1400], "tree", gap=False, max_rows=32)
    c["max_kv"] = 2048
    c["table"] = np.pad(c["table"], ((0, 0), (0, 40 - c["table"].shape[1])), constant_values=-1)
    # give every stream enough pages for the bucket's 2048 positions
    extra = rng.permutation(S * 32).astype(np.int32) + c["pool"].shape[0]
    c["pool"] = np.concatenate([c["pool"], to_bf16_bits(rng.standard_normal((S * 32, 64, 576)))])
    for b in range(S):
        have = int((c["table"][b] >= 0).sum())
        c["table"][b, have:32] = extra[b * 32:b * 32 + 32 - have]
    d = to_dev(c)
    cfg, splits = a.plan_mla(S, 32, H, 2048, policy="model" if config == "model" else None)
    if config not in (None, "model"):
        cfg = a.MLA_CONFIGS[config]
        splits = a.mla_num_splits(S, 32, H, 2048, x.cuda.Device().attributes["MultiProcessorCount"], cfg)
    assert splits > 1, "the graph test must cover the split + combine path"
    ws = a.MlaWorkspace(splits, c["T"], H)
    out = x.full((c["T"], H, 512), POISON, dtype=x.uint16)
    stream = x.cuda.Stream(non_blocking=True)
    with stream:   # eager first: compiles and loads the module outside the capture
        a.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"], mask=d["mask"],
                        softmax_scale=SCALE, max_rows=32, max_kv_len=2048, out=out, workspace=ws, config=cfg)
        stream.synchronize()
        stream.begin_capture()
        a.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"], mask=d["mask"],
                        softmax_scale=SCALE, max_rows=32, max_kv_len=2048, out=out, workspace=ws, config=cfg)
        graph = stream.end_capture()
    for step in range(3):
        # new lengths / trees / queries written into the captured buffers
        n_new = rng.integers(1, 33, S).astype(np.int32)
        s_new = np.array([int(rng.integers(0, 2048 - n)) for n in n_new], np.int32)
        mask_new = np.zeros((S, 129, 5), np.uint32)
        for b in range(S):
            par = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n_new[b])])
            mask_new[b] = ra.ancestor_mask_bits(par, 129)
        d["n"][...] = x.asarray(n_new)
        d["prefix"][...] = x.asarray(s_new)
        d["mask"][...] = x.asarray(mask_new)
        d["row_start"][...] = x.asarray(np.arange(S, dtype=np.int32) * 32)
        out[...] = POISON
        x.cuda.Stream.null.synchronize()  # the null-stream writes above are not ordered before a non-blocking stream
        graph.launch(stream)
        stream.synchronize()
        replay = out.get()
        c2 = dict(c, n=n_new, prefix=s_new, mask=mask_new, row_start=np.arange(S, dtype=np.int32) * 32,
                  T=c["T"], max_rows=32)
        eager = run(c2, d=to_dev(c2), num_splits=splits, config=config)
        assert np.array_equal(replay, eager), f"step {step}: graph replay differs from eager"
        check(c2, replay, f"graph step {step}")


@pytest.mark.parametrize("unroll", [4, 1])
@pytest.mark.parametrize("num_splits", [2, 5, 32, 33, 100, 256])
def test_combine_kernel_against_float64(num_splits, unroll):
    """mla_attn_combine on its own (attn_combine.cuh): random partials and log2-sum-exps with some splits
    empty (lse = -inf, partial NaN: a read of it would poison the row), a row whose splits are all empty
    (zeros), rows no stream owns (must stay poisoned). Against the float64 merge."""
    x = cp()
    a = attn()
    from ddtree_cupy.kernels.compile import get_kernel
    rng = np.random.default_rng(23 + num_splits)
    S, H = 3, 8
    n = np.array([3, 1, 2], np.int32)
    row_start = np.array([0, 4, 6], np.int32)     # row 3 belongs to no stream
    T = 8
    P = T * H
    lse = rng.uniform(-8, 8, (num_splits, P)).astype(np.float32)
    lse[rng.random((num_splits, P)) < 0.3] = -np.inf
    lse[:, 5] = -np.inf                           # packed row 5 (stream 0, row 0, head 5): nothing visible
    po = rng.standard_normal((num_splits, P, 512)).astype(np.float32)
    po[np.isneginf(lse)] = np.nan
    out = x.full((T, H, 512), POISON, dtype=x.uint16)
    comb = get_kernel(a.MLA_SPEC, f"mla_attn_combine<{unroll}>")
    comb((int(n.max()) * H, S), (256,), (x.asarray(po), x.asarray(lse), x.asarray(n), x.asarray(row_start),
                                         np.int32(H), np.int32(P), np.int32(num_splits), out))
    got = bf16_bits_to_f32(out.get()).reshape(P, 512).astype(np.float64)
    lse64 = lse.astype(np.float64)
    own = np.zeros(T, bool)
    for b in range(S):
        own[row_start[b]:row_start[b] + n[b]] = True
    own_p = np.repeat(own, H)
    assert (out.get().reshape(P, 512)[~own_p] == POISON).all(), "rows no stream owns were written"
    for m in np.nonzero(own_p)[0]:
        ok = np.isfinite(lse64[:, m])
        if not ok.any():
            assert (got[m] == 0).all(), f"row {m}: all splits empty must give zeros"
            continue
        w = np.exp2(lse64[ok, m] - lse64[ok, m].max())
        ref = (w[:, None] * po[ok, m].astype(np.float64)).sum(0) / w.sum()
        err = np.linalg.norm(got[m] - ref) / np.linalg.norm(ref)
        assert err < 4e-3, f"row {m}: rel err {err:.2e}"   # bf16 output rounding: <= 2^-9 per element


def test_bad_inputs_name_the_argument():
    x = cp()
    a = attn()
    rng = np.random.default_rng(19)
    c = make_case(rng, 2, 8, [4, 4], [10, 70], "tree")
    d = to_dev(c)
    kw = dict(mask=d["mask"], softmax_scale=SCALE, max_rows=4, max_kv_len=74)
    with pytest.raises(ValueError, match="q: expected dtype uint16"):
        a.mla_attention(d["q"].astype(x.float32), d["pool"], d["table"], d["prefix"], d["n"], d["row_start"], **kw)
    with pytest.raises(ValueError, match="pool: dimension 2 must be 576"):
        a.mla_attention(d["q"], d["pool"][..., :512], d["table"], d["prefix"], d["n"], d["row_start"], **kw)
    with pytest.raises(ValueError, match="n_rows"):
        a.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"][:1], d["row_start"], **kw)
    with pytest.raises(ValueError, match="mask"):
        a.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"],
                        **dict(kw, mask=d["mask"][:, :, :4]))
    with pytest.raises(ValueError, match="softmax_scale"):
        a.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"],
                        **dict(kw, softmax_scale=float("nan")))


@pytest.mark.parametrize("policy", ["measured", "model"])
def test_pdl_chain_equals_plain_launches(policy):
    """kv_write_latent -> mla_attention (split + combine) with programmatic dependent launch: every round
    rewrites the whole context of every stream (a multi-wave producer grid) and then attends over it, so
    an attention block that read the cache, the queries or the partials before its DDT_PDL_WAIT() would
    see the previous round's rows. Bit-identical to ordinary launches, eagerly and replayed from a graph."""
    x = cp()
    a = attn()
    from ddtree_cupy.kernels import launch
    from ddtree_cupy.kernels.kv_cache import kv_write_latent
    if int(x.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90+")
    rng = np.random.default_rng(23)
    S, H, n = 3, 8, 16
    c = make_case(rng, S, H, [n] * S, [700, 1500, 64], "tree", gap=False)
    d = to_dev(c)
    lengths = c["prefix"] + c["n"]
    sid = x.asarray(np.concatenate([np.full(L, b, np.int32) for b, L in enumerate(lengths)]))
    pos = x.asarray(np.concatenate([np.arange(L, dtype=np.int32) for L in lengths]))
    prev_policy = a.set_mla_policy(policy)
    cfg, splits = a.plan_mla(S, n, H, c["max_kv"])
    assert splits > 1, "the chain must include the combine launch"
    ws = a.MlaWorkspace(splits, c["T"], H)
    lat = x.empty((len(pos), 576), x.uint16)
    out = x.empty((c["T"], H, 512), x.uint16)
    stream = x.cuda.Stream(non_blocking=True)

    def step():
        kv_write_latent(d["pool"], d["table"], sid, pos, lat)
        a.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"], mask=d["mask"],
                        softmax_scale=SCALE, max_rows=n, max_kv_len=c["max_kv"], out=out, workspace=ws)

    def fresh(round_):
        r = np.random.default_rng(1000 + round_)
        lat[...] = x.asarray(to_bf16_bits(r.standard_normal(lat.shape)))
        d["q"][...] = x.asarray(to_bf16_bits(r.standard_normal(c["q"].shape) * 0.5))

    try:
        with stream:
            for rnd in range(3):
                results = []
                for pdl in (False, True):
                    fresh(rnd)
                    out[...] = POISON
                    launch.set_pdl(pdl)
                    step()
                    stream.synchronize()
                    results.append(out.get())
                assert np.array_equal(results[0], results[1]), f"round {rnd}: PDL result differs"
                c_now = dict(c, q=d["q"].get(), pool=d["pool"].get())
                check(c_now, results[1], f"pdl round {rnd}")
            launch.set_pdl(True)
            stream.begin_capture()
            step()
            graph = stream.end_capture()
            for rnd in range(3, 5):
                fresh(rnd)
                out[...] = POISON
                graph.launch(stream)
                stream.synchronize()
                replay = out.get()
                launch.set_pdl(False)
                fresh(rnd)
                out[...] = POISON
                step()
                stream.synchronize()
                launch.set_pdl(True)
                assert np.array_equal(replay, out.get()), f"round {rnd}: graph replay with PDL differs"
    finally:
        launch.set_pdl(False)
        a.set_mla_policy(prev_policy)


def test_module_policy_switch_reaches_the_launch():
    """set_mla_policy("model") changes what mla_attention launches without a config (a shape where the two
    policies plan differently on this GPU): bit-identical to the explicit model plan, and correct."""
    x = cp()
    a = attn()
    rng = np.random.default_rng(29)
    S, H = 4, 8
    shape = None
    for n_try in (16, 19, 32, 8):
        args = (S, n_try, H, 2000 + n_try)
        if a.plan_mla(*args, policy="model") != a.plan_mla(*args, policy="measured"):
            shape = n_try
            break
    assert shape is not None, "no test shape where the two policies differ on this GPU"
    c = make_case(rng, S, H, [shape] * S, [2000, 1700, 64, 999], "tree", gap=False)
    c["max_kv"] = 2000 + shape
    explicit = run(c, config="model")
    prev = a.set_mla_policy("model")
    try:
        switched = run(c)
    finally:
        a.set_mla_policy(prev)
    assert np.array_equal(explicit, switched)
    check(c, switched, "module policy model")
