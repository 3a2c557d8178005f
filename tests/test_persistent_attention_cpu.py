"""The persistent executor's attention-half items without a GPU: the schedule split around today's attention
kernels, the argument-block layout the kernel's static_asserts pin, and the two launches' encoded schedules
run by the numpy executor model (emulate_segment) against a float64 reference of the same stages, for many
grid sizes and interleavings."""
import numpy as np
import pytest

from ddtree_cupy.engine import schedule as S
from ddtree_cupy.kernels import compile as kc
from ddtree_cupy.kernels import persistent as P

ROW, LAT, PAGE = 576, 512, 64


def _shape(kind="dense", S_=1, R=5, H=256, nh=2, ql=64, dv=128):
    extra = dict(F=64) if kind == "dense" else dict(E=16, k=2, I=64, Is=64)
    return S.LayerShape(kind, S_, R, H=H, nh=nh, ql=ql, dn=128, dv=dv, **extra)


def test_attention_segment_split():
    for kind in ("dense", "moe"):
        sc = S.build_layer(_shape(kind), 13, parts=("attention",), attention="segment")
        assert sc.n_segments == 4
        assert sc.segment_ops(0) == ["input_norm", "qkv_a", "qkv_a_post", "q_b", "w_uk_rope"]
        assert set(sc.segment_kinds(1)) == {"attn_split", "attn_combine"}
        assert sc.segment_ops(2) == ["w_uv", "o_proj"]
        assert sc.segment_kinds(3) == ["boundary"]
        assert P.supported_segment(sc, 0) and P.supported_segment(sc, 2)
        assert not P.supported_segment(sc, 1)          # today's attention kernels run between the launches
        full = S.build_layer(_shape(kind), 13, attention="segment")
        assert full.n_segments == 6 and full.segment_ops(4)[0] == "post_norm"
    # the default keeps the attention items inside the launch
    assert S.build_layer(_shape(), 13, parts=("attention",)).n_segments == 2
    with pytest.raises(ValueError, match="attention must be"):
        S.build_layer(_shape(), 13, attention="kernel")
    with pytest.raises(ValueError, match="parts must be"):
        S.build_layer(_shape(), 13, parts=("mlp", "attention"))


@pytest.mark.parametrize("n_blocks", [1, 2, 7, 64, 132, 188, 200])
def test_attention_segment_schedules_are_valid_on_the_model(n_blocks):
    # every read written before it, nothing written twice, no deadlock, in random interleavings (the grid is
    # co-resident by construction: check_coresident / fit_grid)
    for kind in ("dense", "moe"):
        sc = S.build_layer(_shape(kind, S_=2, R=4), n_blocks, parts=("attention", "mlp"), attention="segment")
        for seed in range(2):
            S.simulate(sc, seed=seed)


def test_aux_layout_matches_the_kernel_struct():
    f = P.AUX_DTYPE.fields
    off = 0
    for name in P.AUX_DTYPE.names:
        dt, o = f[name][0], f[name][1]
        assert o == off and o % dt.base.itemsize == 0, name
        off += dt.itemsize
    assert off == P.AUX_DTYPE.itemsize == 136
    src = (kc.CUDA_SRC_DIR / "persistent_layer.cu").read_text()
    assert "sizeof(PersistAux) == 136" in src
    struct = src[src.index("struct PersistAux {"):src.index("};", src.index("struct PersistAux {"))]
    pos = [struct.index(n) for n in ("* w2;", "* positions;", "* inv_freq;", "* stream_ids;", "* kv_pos;", "* pool;",
                                     "* block_table;", "* pe;", "* pe_out;", "x_head,", "pe_out_head;", "max_pages;",
                                     "half;", "amplitude;")]
    assert pos == sorted(pos), "PersistAux field order differs from AUX_DTYPE"
    # PersistOp's aux offset sits on an 8-byte boundary, the argument blocks after the records too
    assert P.OP_DTYPE.fields["aux"][1] % 8 == 0 and P.OP_DTYPE.itemsize % 8 == 0
    # a whole target layer's op table with its three argument blocks fits beside the rings (sm_120)
    full = S.build_layer(S.LayerShape("moe", 1, 8, H=7168, nh=8, ql=1536, dn=128, dv=128, E=384, k=8, I=256,
                                      Is=256), 188, attention="segment")
    assert P.table_bytes(len(full.ops), 3) <= P.TABLE_BYTES
    assert P.SMEM_BYTES <= 99 * 1024


def _bf16(rng, shape, scale=1.0):
    """float64 values that are exactly representable in bf16 (the reference compares math, not rounding)."""
    x = rng.standard_normal(shape) * scale
    u = x.astype(np.float32).view(np.uint32) & 0xFFFF0000
    return u.view(np.float32).astype(np.float64)


def _problem(sh, rng, pages=6):
    T, H, nh, ql, dv = sh.T, sh.H, sh.nh, sh.ql, sh.dv
    g = lambda *s, scale=1.0: _bf16(rng, s, scale)        # noqa: E731
    p = dict(h=g(T, H), input_norm_w=1 + 0.1 * g(H), w_qkv_a=g(ql + ROW, H, scale=H ** -0.5),
             q_a_norm=1 + 0.1 * g(ql), kv_a_norm=1 + 0.1 * g(LAT), w_q_b=g(nh * 192, ql, scale=ql ** -0.5),
             w_uk_t=g(nh, LAT, 128, scale=128 ** -0.5), w_uv=g(nh, dv, LAT, scale=LAT ** -0.5),
             w_o=g(H, nh * dv, scale=(nh * dv) ** -0.5), inv_freq=10000.0 ** (-np.arange(32) / 32),
             amplitude=1.25, eps=1e-6, latent_eps=1e-5)
    if sh.kind == "moe":
        p["mlp_prev"] = g(T, H)
    # streams of R rows each at cache positions 70.. (the second page); the last row of stream 0 is padding
    p["positions"] = np.array([100 + 3 * t for t in range(T)], np.int32)
    p["stream_ids"] = np.repeat(np.arange(sh.S), sh.R).astype(np.int32)
    p["kv_pos"] = np.array([70 + (t % sh.R) for t in range(T)], np.int32)
    p["kv_pos"][sh.R - 1] = -1
    p["block_table"] = rng.permutation(pages)[:2 * sh.S].reshape(sh.S, 2).astype(np.int32)
    p["pool"] = np.full((pages, PAGE, ROW), np.nan)
    return p


def _reference(sh, p):
    T, nh, ql = sh.T, sh.nh, sh.ql
    rms = lambda x, w, e: w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + e)   # noqa: E731
    x = p["h"] + p["mlp_prev"] if sh.kind == "moe" else p["h"]
    normed = rms(x, p["input_norm_w"], p["eps"])
    qkv = normed @ p["w_qkv_a"].T
    c_q = rms(qkv[:, :ql], p["q_a_norm"], p["latent_eps"])
    latent = rms(qkv[:, ql:ql + LAT], p["kv_a_norm"], p["latent_eps"])
    k_pe = P._rope_pairs(qkv[:, ql + LAT:], p["positions"], p["inv_freq"], p["amplitude"])
    q = (c_q @ p["w_q_b"].T).reshape(T, nh, 192)
    q_full = np.concatenate([np.einsum("thk,hnk->thn", q[:, :, :128], p["w_uk_t"]),
                             P._rope_pairs(q[:, :, 128:], p["positions"][:, None], p["inv_freq"], p["amplitude"])], -1)
    return dict(h1=x, normed=normed, qkv=qkv, c_q=c_q, latent=np.concatenate([latent, k_pe], -1),
                q=q.reshape(T, -1), q_full=q_full.reshape(T, -1))


def _bound(sh, sc, p):
    T, H, nh, ql, dv = sh.T, sh.H, sh.nh, sh.ql, sh.dv
    nan = lambda *s: np.full(s, np.nan)                     # noqa: E731  (outputs poisoned first)
    bufs = dict(normed=nan(T, H), qkv=nan(T, ql + ROW), c_q=nan(T, ql), q=nan(T, nh * 192),
                q_full=nan(T, nh * ROW), o_lat=_bf16(np.random.default_rng(5), (T, nh * LAT)), o=nan(T, nh * dv),
                attn_part=nan(T, H))
    extra = dict(mlp_prev=p["mlp_prev"], h1=nan(T, H)) if sh.kind == "moe" else {}
    keys = ("h", "input_norm_w", "eps", "w_qkv_a", "q_a_norm", "kv_a_norm", "latent_eps", "w_q_b", "w_uk_t", "w_uv",
            "w_o", "positions", "inv_freq", "amplitude", "stream_ids", "kv_pos", "pool", "block_table")
    ops = P.bind_attention_half(sc, **{k: p[k] for k in keys}, **bufs, **extra)
    return ops, bufs, extra


@pytest.mark.parametrize("kind,S_,R,n_blocks", [("dense", 1, 5, 1), ("dense", 1, 5, 13), ("dense", 2, 8, 132),
                                                 ("moe", 1, 5, 7), ("moe", 2, 6, 188)])
def test_emulated_attention_half_matches_float64(kind, S_, R, n_blocks):
    sh = _shape(kind, S_, R)
    sc = S.build_layer(sh, n_blocks, parts=("attention",), attention="segment")
    rng = np.random.default_rng(n_blocks)
    p = _problem(sh, rng)
    ref = _reference(sh, p)
    for seed in range(2):
        p["pool"][...] = np.nan
        ops, bufs, extra = _bound(sh, sc, p)
        n0 = P.emulate_segment(sc, 0, ops, seed=seed)
        n2 = P.emulate_segment(sc, 2, ops, seed=seed)
        assert n0 == sum(1 for it in sc.items if it.segment == 0)
        assert n2 == sum(1 for it in sc.items if it.segment == 2)
        for name in ("normed", "qkv", "c_q", "q", "q_full"):
            err = np.linalg.norm(bufs[name] - ref[name]) / np.linalg.norm(ref[name])
            assert err < 1e-12, (name, err)
        if kind == "moe":
            np.testing.assert_array_equal(extra["h1"], ref["h1"])
        # the latent rows land at their streams' pages and slots; the padding row (kv_pos < 0) writes nothing
        written = 0
        for t in range(sh.T):
            pos = int(p["kv_pos"][t])
            if pos < 0:
                continue
            page = p["block_table"][p["stream_ids"][t], pos // PAGE]
            np.testing.assert_allclose(p["pool"][page, pos % PAGE], ref["latent"][t], rtol=1e-12, atol=1e-12)
            written += 1
        assert np.isnan(p["pool"]).sum() == p["pool"].size - written * ROW
        # segment 2 from the attention's output (random here): o per head, then o_proj
        o = np.einsum("thk,hnk->thn", bufs["o_lat"].reshape(sh.T, sh.nh, LAT), p["w_uv"]).reshape(sh.T, -1)
        np.testing.assert_allclose(bufs["o"], o, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(bufs["attn_part"], o @ p["w_o"].T, rtol=1e-10, atol=1e-10)


def test_bind_attention_half_refuses_wrong_shapes():
    sh = _shape()
    sc = S.build_layer(sh, 7, parts=("attention",), attention="segment")
    p = _problem(sh, np.random.default_rng(0))
    p["w_uv"] = p["w_uv"][:, :64]
    with pytest.raises(ValueError, match="w_uv"):
        _bound(sh, sc, p)
    sh_moe = _shape("moe")
    sc_moe = S.build_layer(sh_moe, 7, parts=("attention",), attention="segment")
    p = _problem(sh_moe, np.random.default_rng(0))
    del p["mlp_prev"]
    with pytest.raises(ValueError, match="mlp_prev"):
        keys = ("h", "input_norm_w", "eps", "w_qkv_a", "q_a_norm", "kv_a_norm", "latent_eps", "w_q_b", "w_uk_t",
                "w_uv", "w_o", "positions", "inv_freq", "amplitude", "stream_ids", "kv_pos", "pool", "block_table")
        T = sh_moe.T
        P.bind_attention_half(sc_moe, **{k: p[k] for k in keys}, normed=None, qkv=None, c_q=None,
                              q=np.zeros((T, 384)), q_full=np.zeros((T, 1152)), o_lat=np.zeros((T, 1024)),
                              o=np.zeros((T, 256)), attn_part=None)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_emulated_attention_half_from_normed_rows(kind):
    # the engine's form: the all-reduce before the layer has added and normed, the launch starts at qkv_a
    sh = _shape(kind, 2, 4)
    sc = S.build_layer(sh, 37, parts=("attention",), attention="segment", input_norm=False)
    assert "input_norm" not in sc.ops and sc.segment_ops(0)[0] == "qkv_a"
    p = _problem(sh, np.random.default_rng(9))
    ref = _reference(sh, p)
    ops, bufs, _ = _bound(sh, sc, p)
    bufs["normed"][...] = ref["normed"]
    P.emulate_segment(sc, 0, ops, seed=1)
    for name in ("qkv", "c_q", "q", "q_full"):
        assert np.linalg.norm(bufs[name] - ref[name]) / np.linalg.norm(ref[name]) < 1e-12, name
    with pytest.raises(ValueError, match="input_norm=False"):
        S.build_layer(sh, 37, input_norm=False)
