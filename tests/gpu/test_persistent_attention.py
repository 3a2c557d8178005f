"""The persistent executor on a target layer's attention half around today's attention kernels
(build_layer(parts=("attention",), attention="segment"), kernels/persistent.bind_attention_half), TP = 8 rank
widths of Kimi K2.6: launch 0 (input norm, qkv_a, the qkv_a epilogue, q_b, W_UK + RoPE) and launch 2 (W_UV,
o_proj) on fresh random weights and inputs with every output and the latent cache poisoned first. The norm,
the qkv_a epilogue and the head products equal today's kernels (rms_norm, mla_qkv_a_post, mla_head_gemm) bit
for bit on the executor's own inputs (the bodies are shared); the stream-K GEMMs match a float64 reference to
bf16 rounding; the same bits run to run and from a graph."""
import numpy as np
import pytest

from _kernel_testutil import BF16_TOL, f64, poisoned, rand_bf16, rel_err
from ddtree_cupy.engine import schedule as S

pytestmark = pytest.mark.gpu

H, NH, QL, DN, DV = 7168, 8, 1536, 128, 128
ROW, LAT, PAGE = 576, 512, 64


def _shape(kind, S_, R):
    extra = dict(F=18432 // 8) if kind == "dense" else dict(E=384, k=8, I=256, Is=256)
    return S.LayerShape(kind, S_, R, H=H, nh=NH, ql=QL, dn=DN, dv=DV, **extra)


def _problem(cp, sh, seed, pages=9):
    from ddtree_cupy.reference import yarn_inv_freq
    from ddtree_cupy.config import RopeConfig
    rng = np.random.default_rng(seed)
    T = sh.T
    host = {}
    dev = {}
    for name, shape, scale in (("h", (T, H), 1.0), ("mlp_prev", (T, H), 1.0), ("in_w", (H,), 1.0),
                               ("w_qkv_a", (QL + ROW, H), H ** -0.5), ("q_a_norm", (QL,), 1.0),
                               ("kv_a_norm", (LAT,), 1.0), ("w_q_b", (NH * (DN + 64), QL), QL ** -0.5),
                               ("w_uk_t", (NH, LAT, DN), DN ** -0.5), ("w_uv", (NH, DV, LAT), LAT ** -0.5),
                               ("w_o", (H, NH * DV), (NH * DV) ** -0.5), ("o_lat", (T, NH * LAT), 1.0)):
        b, f = rand_bf16(rng, shape, scale)
        dev[name], host[name] = cp.asarray(b), f
    rope = RopeConfig(theta=50000.0, kind="yarn", factor=64.0, original_max_position_embeddings=4096,
                      beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    dev["inv_freq"] = cp.asarray(yarn_inv_freq(rope, 64).astype(np.float32))
    dev["positions"] = cp.asarray(rng.integers(0, 300000, T).astype(np.int32))
    dev["stream_ids"] = cp.asarray(np.repeat(np.arange(sh.S), sh.R).astype(np.int32))
    kv_pos = np.concatenate([rng.permutation(2 * PAGE)[:sh.R] for _ in range(sh.S)]).astype(np.int32)
    if T > 1:
        kv_pos[0] = -1                                       # a padding row: no cache write
    dev["kv_pos"] = cp.asarray(kv_pos)
    dev["block_table"] = cp.asarray(rng.permutation(pages)[:2 * sh.S].reshape(sh.S, 2).astype(np.int32))
    dev["pool"] = poisoned(cp, (pages, PAGE, ROW))
    return dev, host


def _buffers(cp, T):
    return dict(normed=poisoned(cp, (T, H)), qkv=poisoned(cp, (T, QL + ROW)), c_q=poisoned(cp, (T, QL)),
                q=poisoned(cp, (T, NH * (DN + 64))), q_full=poisoned(cp, (T, NH * ROW)), o=poisoned(cp, (T, NH * DV)),
                attn_part=poisoned(cp, (T, H)), h1=poisoned(cp, (T, H)))


def _segments(cp, sc, dev, bufs, h, **kw):
    from ddtree_cupy.kernels.persistent import PersistentSegment, bind_attention_half
    moe = dict(mlp_prev=dev["mlp_prev"], h1=bufs["h1"]) if sc.shape.kind == "moe" else {}
    ops = bind_attention_half(
        sc, h=h, input_norm_w=dev["in_w"], eps=1e-6, w_qkv_a=dev["w_qkv_a"], q_a_norm=dev["q_a_norm"],
        kv_a_norm=dev["kv_a_norm"], latent_eps=1e-6, w_q_b=dev["w_q_b"], w_uk_t=dev["w_uk_t"], w_uv=dev["w_uv"],
        w_o=dev["w_o"], positions=dev["positions"], inv_freq=dev["inv_freq"], amplitude=1.25,
        stream_ids=dev["stream_ids"], kv_pos=dev["kv_pos"], pool=dev["pool"], block_table=dev["block_table"],
        normed=bufs["normed"], qkv=bufs["qkv"], c_q=bufs["c_q"], q=bufs["q"], q_full=bufs["q_full"],
        o_lat=dev["o_lat"], o=bufs["o"], attn_part=bufs["attn_part"], **moe)
    return PersistentSegment(sc, 0, ops, **kw), PersistentSegment(sc, 2, ops, **kw)


def _same_bits(a, b, what):
    a, b = a.get(), b.get()
    assert a.shape == b.shape
    bad = np.flatnonzero(a.view(np.uint16).ravel() != b.view(np.uint16).ravel())
    assert bad.size == 0, f"{what}: {bad.size} elements differ (first at flat index {bad[0]})"


@pytest.mark.parametrize("kind,S_,R", [("dense", 1, 8), ("dense", 1, 1), ("moe", 1, 16), ("moe", 2, 5)])
@pytest.mark.parametrize("grid", ["device", 37])
def test_attention_half_against_today_and_float64(kind, S_, R, grid):
    import cupy as cp
    from ddtree_cupy.kernels import fused, gemm, layers
    from ddtree_cupy.kernels.persistent import default_grid
    sh = _shape(kind, S_, R)
    T = sh.T
    nb = default_grid() if grid == "device" else grid
    sc = S.build_layer(sh, nb, parts=("attention",), attention="segment", bytes_per_us_per_block=4.0e6 / nb)
    dev, host = _problem(cp, sh, seed=nb + T)
    bufs = _buffers(cp, T)
    h = dev["h"].copy()
    seg0, seg2 = _segments(cp, sc, dev, bufs, h)
    seg0.launch()
    seg2.launch()
    seg0.check()
    seg2.check()

    # the input norm: today's kernel, bit for bit (the same body); an MoE layer's residual add too
    ref_normed = poisoned(cp, (T, H))
    if kind == "moe":
        ref_h = dev["h"].copy()
        layers.rms_norm(dev["mlp_prev"], dev["in_w"], 1e-6, out=ref_normed, residual=ref_h)
        _same_bits(bufs["h1"], ref_h, "h1")
    else:
        layers.rms_norm(dev["h"], dev["in_w"], 1e-6, out=ref_normed)
    _same_bits(bufs["normed"], ref_normed, "normed")
    # the stream-K GEMMs against float64 on their own (bf16) inputs
    assert rel_err(f64(bufs["qkv"]), f64(bufs["normed"]) @ host["w_qkv_a"].T) < BF16_TOL
    assert rel_err(f64(bufs["q"]), f64(bufs["c_q"]) @ host["w_q_b"].T) < BF16_TOL
    assert rel_err(f64(bufs["attn_part"]), f64(bufs["o"]) @ host["w_o"].T) < BF16_TOL
    # the qkv_a epilogue: mla_qkv_a_post on the launch's qkv gives the same c_q and the same cache (a pool
    # poisoned the same way: rows of padding tokens and every other slot stay poisoned in both)
    c_q = poisoned(cp, (T, QL))
    pool = poisoned(cp, dev["pool"].shape)
    fused.mla_qkv_a_post(bufs["qkv"], dev["q_a_norm"], dev["kv_a_norm"], 1e-6, c_q, dev["positions"],
                         dev["inv_freq"], 1.25, dev["stream_ids"], dev["kv_pos"], pool, dev["block_table"])
    _same_bits(bufs["c_q"], c_q, "c_q")
    _same_bits(dev["pool"], pool, "latent cache")
    assert int((dev["pool"].view(np.uint16) != 0xFFFF).sum()) == int((dev["kv_pos"] >= 0).sum()) * ROW
    # the head products: mla_head_gemm on the launch's q / o_lat
    q3 = bufs["q"].reshape(T, NH, DN + 64)
    qf = poisoned(cp, (T, NH, ROW))
    fused.mla_head_gemm(q3[:, :, :DN], dev["w_uk_t"], qf[:, :, :LAT], pe=q3[:, :, DN:], pe_out=qf[:, :, LAT:],
                        positions=dev["positions"], inv_freq=dev["inv_freq"], amplitude=1.25)
    _same_bits(bufs["q_full"], qf.reshape(T, -1), "q_full")
    o = poisoned(cp, (T, NH, DV))
    fused.mla_head_gemm(dev["o_lat"].reshape(T, NH, LAT), dev["w_uv"], o)
    _same_bits(bufs["o"], o.reshape(T, -1), "o")
    # and the whole chain against today's kernels to bf16 level (the GEMMs add in another order)
    qkv_t = poisoned(cp, (T, QL + ROW))
    gemm.gemm_bf16(ref_normed, dev["w_qkv_a"], qkv_t)
    assert rel_err(f64(bufs["qkv"]), f64(qkv_t)) < BF16_TOL


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_attention_half_deterministic_and_graph_replay(kind):
    import cupy as cp
    from ddtree_cupy.kernels.persistent import default_grid
    sh = _shape(kind, 1, 8)
    nb = default_grid()
    sc = S.build_layer(sh, nb, parts=("attention",), attention="segment", bytes_per_us_per_block=4.0e6 / nb)
    dev, _ = _problem(cp, sh, seed=3)
    outs = []
    for mode in ("eager", "eager", "graph"):
        bufs = _buffers(cp, sh.T)
        dev["pool"][...] = 0xFFFF
        h = dev["h"].copy()
        seg0, seg2 = _segments(cp, sc, dev, bufs, h)
        if mode == "graph":
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                seg0.launch()                   # warm-up (compiles, loads) outside the capture
                seg2.launch()
                stream.synchronize()
                for b in bufs.values():
                    b.fill(0xFFFF)
                dev["pool"][...] = 0xFFFF
                stream.begin_capture()
                seg0.launch()
                seg2.launch()
                g = stream.end_capture()
                g.launch(stream)
                g.launch(stream)                 # the second replay: the counter sets alternate
                stream.synchronize()
        else:
            seg0.launch()
            seg2.launch()
        seg0.check()
        seg2.check()
        outs.append({k: v.get() for k, v in bufs.items()} | {"pool": dev["pool"].get()})
    for other in outs[1:]:
        for k in outs[0]:
            np.testing.assert_array_equal(outs[0][k].view(np.uint16), other[k].view(np.uint16), err_msg=k)


def test_attention_half_refuses_bad_stages():
    import cupy as cp
    from ddtree_cupy.kernels.persistent import PersistentSegment, bind_attention_half
    sh = _shape("dense", 1, 4)
    sc = S.build_layer(sh, 16, parts=("attention",), attention="segment")
    dev, _ = _problem(cp, sh, seed=1)
    bufs = _buffers(cp, sh.T)
    with pytest.raises(ValueError, match="attention kinds|item kinds"):
        PersistentSegment(sc, 1, {})                          # today's attention kernels run between launches
    seg0, _ = _segments(cp, sc, dev, bufs, dev["h"].copy())
    ops = dict(seg0.ops)
    ops["qkv_a_post"] = type(ops["qkv_a_post"])(**{**ops["qkv_a_post"].__dict__, "kv_pos": dev["kv_pos"][:2]})
    with pytest.raises(ValueError, match="kv_pos"):
        PersistentSegment(sc, 0, ops)
    ops = dict(seg0.ops)
    ops["w_uk_rope"] = type(ops["w_uk_rope"])(**{**ops["w_uk_rope"].__dict__, "w": dev["w_uv"]})
    with pytest.raises(ValueError, match="w_uk_rope"):
        PersistentSegment(sc, 0, ops)
    with pytest.raises(ValueError, match="w_uk_t"):
        bind_attention_half(sc, **{**_bind_kwargs(dev, bufs), "w_uk_t": dev["w_uv"]})


def _bind_kwargs(dev, bufs):
    return dict(h=dev["h"], input_norm_w=dev["in_w"], eps=1e-6, w_qkv_a=dev["w_qkv_a"], q_a_norm=dev["q_a_norm"],
                kv_a_norm=dev["kv_a_norm"], latent_eps=1e-6, w_q_b=dev["w_q_b"], w_uk_t=dev["w_uk_t"],
                w_uv=dev["w_uv"], w_o=dev["w_o"], positions=dev["positions"], inv_freq=dev["inv_freq"],
                amplitude=1.25, stream_ids=dev["stream_ids"], kv_pos=dev["kv_pos"], pool=dev["pool"],
                block_table=dev["block_table"], normed=bufs["normed"], qkv=bufs["qkv"], c_q=bufs["c_q"],
                q=bufs["q"], q_full=bufs["q_full"], o_lat=dev["o_lat"], o=bufs["o"], attn_part=bufs["attn_part"])
