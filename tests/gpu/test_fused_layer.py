"""Fused MLA-block kernels (kernels/fused.py, cuda_src/fused_layer.cu) and the router + shared-expert SwiGLU
launch (kernels/router.py) against float64 numpy references, on fresh random inputs with poisoned outputs;
and bit for bit against the chains of unfused kernels they replace."""
import numpy as np
import pytest

from _kernel_testutil import BF16_TOL, POISON_BF16, copy_bandwidth, f64, graph_us, poisoned, rand_bf16, rel_err
from ddtree_cupy.bf16 import bf16_bits_to_f32
from ddtree_cupy.config import RopeConfig
from ddtree_cupy.reference import apply_rope_adjacent, rms_norm, yarn_inv_freq

pytestmark = pytest.mark.gpu

KIMI_ROPE = RopeConfig(theta=50000.0, kind="yarn", factor=64.0, original_max_position_embeddings=4096,
                       beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
AMP = 1.0 + 0.1 * np.log(64.0)


def _row_errs(got, ref):
    """Relative error of every row (last axis): one wrong index shows up as an O(1) error in its rows."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(got)), "non-finite output (an unwritten / poisoned element?)"
    num = np.linalg.norm(got - ref, axis=-1)
    return num / np.maximum(np.linalg.norm(ref, axis=-1), 1e-300)


# ------------------------------------------------------------------------------- q_a / kv_a post-processing
@pytest.mark.parametrize("T,ql", [(1, 1536), (37, 1536), (160, 256)])
def test_qkv_a_post(T, ql):
    import cupy as cp
    from ddtree_cupy.kernels.fused import mla_qkv_a_post
    from ddtree_cupy.kernels.kv_cache import kv_write_latent
    from ddtree_cupy.kernels.layers import rms_norm as k_norm, rope as k_rope
    rng = np.random.default_rng(T + ql)
    W = ql + 576
    big_b, big = rand_bf16(rng, (T, W + 64), 2.0)            # qkv_a as a row-strided view of a wider buffer
    qwb, qw = rand_bf16(rng, (ql,))
    kwb, kw = rand_bf16(rng, (512,))
    eps = 1e-6
    S, pages_per = 3, 4
    n_pages = S * pages_per + 2
    table = rng.permutation(n_pages)[:S * pages_per].reshape(S, pages_per).astype(np.int32)
    sids = rng.integers(0, S, T).astype(np.int32)
    # distinct cache positions per stream, some rows padding (-1), positions past the YaRN range
    kv_pos = np.full(T, -1, np.int32)
    for s in range(S):
        rows = np.flatnonzero(sids == s)
        kv_pos[rows] = rng.permutation(pages_per * 64)[:rows.size]
    keep = kv_pos.copy()
    kv_pos[rng.random(T) < 0.2] = -1
    kv_pos[-1] = keep[-1]               # at least one real row
    if T > 1:
        kv_pos[0] = -1                  # and at least one padding row
    positions = rng.integers(0, 300000, T).astype(np.int32)
    inv = yarn_inv_freq(KIMI_ROPE, 64)
    inv32 = inv.astype(np.float32)
    dev = lambda a: cp.asarray(a)  # noqa: E731
    big_d = dev(big_b)
    qkv = big_d[:, 32:32 + W]
    pool = poisoned(cp, (n_pages, 64, 576))
    c_q = poisoned(cp, (T, ql + 8))[:, :ql]
    mla_qkv_a_post(qkv, dev(qwb), dev(kwb), eps, c_q, dev(positions), dev(inv32), AMP, dev(sids), dev(kv_pos),
                   pool, dev(table))
    x = big[:, 32:32 + W]
    ref_cq = rms_norm(x[:, :ql], qw, eps)
    assert rel_err(f64(c_q), ref_cq) < BF16_TOL
    assert _row_errs(f64(c_q), ref_cq).max() < 2 * BF16_TOL
    ref_lat = np.concatenate([rms_norm(x[:, ql:ql + 512], kw, eps),
                              apply_rope_adjacent(x[:, ql + 512:], positions, inv, AMP)], axis=1)
    P = pool.get()
    real = np.flatnonzero(kv_pos >= 0)
    got = bf16_bits_to_f32(P[table[sids[real], kv_pos[real] // 64], kv_pos[real] % 64])
    assert rel_err(got, ref_lat[real]) < BF16_TOL
    assert _row_errs(got, ref_lat[real]).max() < 2 * BF16_TOL
    written = np.zeros((n_pages, 64), bool)
    written[table[sids[real], kv_pos[real] // 64], kv_pos[real] % 64] = True
    assert np.all(P[~written] == POISON_BF16), "a padding row (kv_pos -1) or a foreign row was written"
    assert np.array_equal(big_d.get(), big_b), "input must stay untouched"

    # equal to the chain it replaces (2 x rms_norm + rope + kv_write_latent): same arithmetic and reduction
    # order, so bit for bit unless the compiler contracts a rope product into an FMA differently (1 ulp)
    pool2 = poisoned(cp, (n_pages, 64, 576))
    c_q2 = poisoned(cp, (T, ql))
    lat = poisoned(cp, (T, 576))
    k_norm(qkv[:, :ql], dev(qwb), eps, out=c_q2)
    k_norm(qkv[:, ql:ql + 512], dev(kwb), eps, out=lat[:, :512])
    k_rope(qkv[:, ql + 512:], dev(positions), out=lat[:, 512:], inv_freq=dev(inv32), amplitude=AMP)
    kv_write_latent(pool2, dev(table), dev(sids), dev(kv_pos), lat)
    _assert_same_bits(c_q.get(), c_q2.get())
    _assert_same_bits(pool.get(), pool2.get())


def _assert_same_bits(a, b):
    """Equal bf16 bit patterns, allowing a 1-ulp difference on at most 1% of the elements."""
    a, b = a.astype(np.int32), b.astype(np.int32)
    ne = a != b
    assert np.abs(a - b).max() <= 1 and ne.mean() <= 0.01, (int(ne.sum()), int(np.abs(a - b).max()))


# ------------------------------------------------------------------------------- per-head GEMM (+ q_pe rope)
@pytest.mark.parametrize("T", [1, 8, 37, 320])
def test_head_gemm_w_uk_with_rope(T):
    """q_full[:, h, :512] = q_nope[:, h] @ W_UK^T[h]^T and q_full[:, h, 512:] = rope(q_pe[:, h]), from the
    strided head views of q [T, nh, 192] into q_full [T, nh, 576] (the target's buffers)."""
    import cupy as cp
    from ddtree_cupy.kernels.fused import mla_head_gemm
    rng = np.random.default_rng(100 + T)
    nh = 8
    qb, q = rand_bf16(rng, (T, nh, 192))
    wb, w = rand_bf16(rng, (nh, 512, 128), 128 ** -0.5)
    positions = rng.integers(0, 300000, T).astype(np.int32)
    inv = yarn_inv_freq(KIMI_ROPE, 64)
    q_d = cp.asarray(qb)
    qf = poisoned(cp, (T, nh, 576))
    mla_head_gemm(q_d[:, :, :128], cp.asarray(wb), qf[:, :, :512], pe=q_d[:, :, 128:], pe_out=qf[:, :, 512:],
                  positions=cp.asarray(positions), inv_freq=cp.asarray(inv.astype(np.float32)), amplitude=AMP)
    got = f64(qf)
    ref = np.einsum("thk,hnk->thn", q[:, :, :128], w)
    assert rel_err(got[:, :, :512], ref) < BF16_TOL
    assert _row_errs(got[:, :, :512], ref).max() < 2 * BF16_TOL      # every (token, head) row
    ref_pe = apply_rope_adjacent(q[:, :, 128:], positions, inv, AMP)
    assert rel_err(got[:, :, 512:], ref_pe) < BF16_TOL
    assert _row_errs(got[:, :, 512:], ref_pe).max() < 2 * BF16_TOL
    assert np.array_equal(q_d.get(), qb), "input must stay untouched"


@pytest.mark.parametrize("T", [1, 8, 45, 320])
def test_head_gemm_w_uv(T):
    """o[:, h * 128:(h + 1) * 128] = o_lat[:, h] @ W_UV[h]^T (K 512), output rows as head views."""
    import cupy as cp
    from ddtree_cupy.kernels.fused import mla_head_gemm
    from ddtree_cupy.kernels.gemm import gemm_bf16
    rng = np.random.default_rng(200 + T)
    nh = 8
    xb, x = rand_bf16(rng, (T, nh, 512))
    wb, w = rand_bf16(rng, (nh, 128, 512), 512 ** -0.5)
    o = poisoned(cp, (T + 1, nh * 128))             # one extra row that must stay poisoned
    x_d, w_d = cp.asarray(xb), cp.asarray(wb)
    mla_head_gemm(x_d, w_d, o[:T].reshape(T, nh, 128))
    got = o.get()
    assert np.all(got[T] == POISON_BF16), "wrote past T rows"
    got = bf16_bits_to_f32(got[:T]).astype(np.float64).reshape(T, nh, 128)
    ref = np.einsum("thk,hnk->thn", x, w)
    assert rel_err(got, ref) < BF16_TOL
    assert _row_errs(got, ref).max() < 2 * BF16_TOL
    # the batched GEMM it replaces, as a second opinion on the same bf16 inputs (fp32 sums in another order)
    if T <= 160:
        o2 = gemm_bf16(x_d.transpose(1, 0, 2), w_d).transpose(1, 0, 2)
        assert rel_err(got, f64(cp.ascontiguousarray(o2))) < BF16_TOL


def test_head_gemm_argument_errors():
    import cupy as cp
    from ddtree_cupy.kernels.fused import mla_head_gemm
    x = cp.zeros((4, 8, 128), np.uint16)
    w = cp.zeros((8, 512, 128), np.uint16)
    out = cp.zeros((4, 8, 512), np.uint16)
    with pytest.raises(ValueError, match="K = 192"):
        mla_head_gemm(cp.zeros((4, 8, 192), np.uint16), cp.zeros((8, 512, 192), np.uint16), out)
    with pytest.raises(ValueError, match="out"):
        mla_head_gemm(x, w, cp.zeros((4, 8, 256), np.uint16))
    with pytest.raises(ValueError, match="without pe"):
        mla_head_gemm(x, w, out, positions=cp.zeros(4, np.int32))


# ------------------------------------------------------------------------ router | shared gate_up + SwiGLU
def _route_ref(logits, bias, k, n_group, topk_group, scale=2.827, normalize=True):
    """reference.route on given logits: x = logits (float64), gate = identity, so x @ gate^T = logits."""
    from types import SimpleNamespace
    from ddtree_cupy.reference import route
    T, E = logits.shape
    cfg = SimpleNamespace(n_routed_experts=E, num_experts_per_tok=k, hidden_size=E, n_group=n_group,
                          topk_group=topk_group, norm_topk_prob=normalize, routed_scaling_factor=scale)
    return route(np.asarray(logits, np.float64), np.eye(E), np.asarray(bias, np.float64), cfg)


@pytest.mark.parametrize("T,I,n_group,topk_group", [(1, 256, 1, 1), (8, 256, 1, 1), (19, 256, 8, 4),
                                                    (37, 128, 1, 1), (160, 2048, 8, 4)])
def test_router_shared_gate_up_fused(T, I, n_group, topk_group):
    """The target's MoE head: ONE fp32 GEMM x @ [router | shared gate | shared up]^T, then route_logits on
    its column slices with the shared SwiGLU in the same launch. ids exactly the float64 reference's,
    weights within 1e-5; the activation equal bit for bit to silu_mul of the fp32 gate|up rounded to bf16
    on the host and to the bf16-epilogue GEMM + silu_mul chain, and within bf16 of the float64 SwiGLU."""
    import cupy as cp
    from ddtree_cupy.bf16 import to_bf16_bits
    from ddtree_cupy.kernels.gemm import gemm_bf16
    from ddtree_cupy.kernels.layers import silu_mul
    from ddtree_cupy.kernels.router import route_logits
    rng = np.random.default_rng(300 + T + I)
    E, k, H = 384, 8, 1024
    xb, x = rand_bf16(rng, (T, H))
    rb, r = rand_bf16(rng, (E, H), 0.1)           # router logits O(3): a spread of sigmoid scores
    gb, g = rand_bf16(rng, (2 * I, H), H ** -0.5 * 2)
    bias = (rng.standard_normal(E) * 0.05).astype(np.float32)
    w = cp.asarray(np.concatenate([rb, gb]))
    fused = poisoned(cp, (T, E + 2 * I), np.float32)
    gemm_bf16(cp.asarray(xb), w, fused, out_dtype=np.float32)
    ids, wts = poisoned(cp, (T, k), np.int32), poisoned(cp, (T, k), np.float32)
    act = poisoned(cp, (T, I + 8))[:, :I]             # a row-strided output, its tail must stay poisoned
    route_logits(fused[:, :E], cp.asarray(bias), k, n_group, topk_group, 2.827, True, ids, wts,
                 gate_up=fused[:, E:], act_out=act)
    fh = fused.get()
    ids_ref, w_ref = _route_ref(fh[:, :E], bias, k, n_group, topk_group)
    assert np.array_equal(ids.get(), ids_ref.astype(np.int32))
    assert rel_err(wts.get(), w_ref) < 1e-5
    ids2, wts2 = poisoned(cp, (T, k), np.int32), poisoned(cp, (T, k), np.float32)
    route_logits(fused[:, :E], cp.asarray(bias), k, n_group, topk_group, 2.827, True, ids2, wts2)
    assert np.array_equal(ids.get(), ids2.get()) and np.array_equal(wts.get(), wts2.get())
    gu_bits = to_bf16_bits(fh[:, E:])
    assert np.array_equal(act.get(), silu_mul(cp.asarray(gu_bits)).get())
    assert np.all(act.base.get()[:, I:] == POISON_BF16)
    gl, ul = x @ g[:I].T, x @ g[I:].T
    assert rel_err(f64(act), gl / (1 + np.exp(-gl)) * ul) < BF16_TOL
    assert rel_err(fh[:, :E], x @ r.T) < 1e-5
    # the chain it replaces: the same GEMM with the bf16 epilogue, then silu_mul (bit for bit)
    gu16 = gemm_bf16(cp.asarray(xb), w)[:, E:]
    assert np.array_equal(gu16.get(), gu_bits)
    assert np.array_equal(act.get(), silu_mul(gu16).get())


@pytest.mark.parametrize("T,I,H,n_group,topk_group", [(1, 256, 7168, 1, 1), (8, 256, 7168, 1, 1),
                                                      (19, 128, 1024, 8, 4), (37, 64, 512, 1, 1),
                                                      (64, 256, 1024, 1, 1), (100, 256, 2048, 1, 1)])
def test_router_shared_down_fused(T, I, H, n_group, topk_group):
    """router_topk_down (route_logits(down_w=, down_out=)): the selection, the shared SwiGLU formed on the
    fly and the shared down projection in one launch, on the fused head GEMM's fp32 output. ids / weights
    bit-equal to the plain selection (and ids to the float64 reference); down_out vs float64 of the exact
    bf16 act (silu_mul of the host-rounded gate|up) per row, and vs the chain it replaces (route_logits with
    act_out, then gemm_bf16): at most 1 bf16 ulp apart (fp32 sums in another order). T = 100 runs the
    token-tile loop (the rule never sends it, DDT_ROUTER_DOWN=1 may). Poisoned outputs: a column block and a
    row past the view must stay poisoned."""
    import cupy as cp
    from ddtree_cupy.bf16 import to_bf16_bits
    from ddtree_cupy.kernels.gemm import gemm_bf16
    from ddtree_cupy.kernels.router import route_logits
    rng = np.random.default_rng(700 + T + I + H)
    E, k, Hx = 384, 8, 1024
    xb, x = rand_bf16(rng, (T, Hx))
    rb, _ = rand_bf16(rng, (E, Hx), 0.1)
    gb, _ = rand_bf16(rng, (2 * I, Hx), Hx ** -0.5 * 2)
    db, d = rand_bf16(rng, (H, I), I ** -0.5)
    bias = (rng.standard_normal(E) * 0.05).astype(np.float32)
    fused = poisoned(cp, (T, E + 2 * I), np.float32)
    gemm_bf16(cp.asarray(xb), cp.asarray(np.concatenate([rb, gb])), fused, out_dtype=np.float32)
    ids, wts = poisoned(cp, (T, k), np.int32), poisoned(cp, (T, k), np.float32)
    big = poisoned(cp, (T + 1, H + 32))
    out = big[:T, :H]                                     # row-strided view; its tail column block and row T
    wd = cp.asarray(db)
    route_logits(fused[:, :E], cp.asarray(bias), k, n_group, topk_group, 2.827, True, ids, wts,
                 gate_up=fused[:, E:], down_w=wd, down_out=out)
    fh = fused.get()
    ids_ref, _ = _route_ref(fh[:, :E], bias, k, n_group, topk_group)
    assert np.array_equal(ids.get(), ids_ref.astype(np.int32))
    ids2, wts2 = poisoned(cp, (T, k), np.int32), poisoned(cp, (T, k), np.float32)
    route_logits(fused[:, :E], cp.asarray(bias), k, n_group, topk_group, 2.827, True, ids2, wts2)
    assert np.array_equal(ids.get(), ids2.get()) and np.array_equal(wts.get(), wts2.get())
    # the act the fused kernel forms (never stored) is the plain path's act_out: test_router_shared_gate_up_fused
    # proves that one bit-equal to silu_mul; here it is the operand of the float64 reference
    act_d = poisoned(cp, (T, I))
    route_logits(fused[:, :E], cp.asarray(bias), k, n_group, topk_group, 2.827, True, ids2, wts2,
                 gate_up=fused[:, E:], act_out=act_d)
    act = f64(act_d)
    gu = bf16_bits_to_f32(to_bf16_bits(fh[:, E:])).astype(np.float64)
    g, u = gu[:, :I], gu[:, I:]
    assert rel_err(act, g / (1 + np.exp(-g)) * u) < BF16_TOL
    got = f64(out)
    errs = _row_errs(got, act @ d.T)
    assert errs.max() < 4e-3, (errs.max(), int(errs.argmax()))     # one bf16 rounding of the output
    bh = big.get()
    assert np.all(bh[:, H:] == POISON_BF16) and np.all(bh[T] == POISON_BF16)
    # the chain it replaces: route + SwiGLU into act (above), then the bf16 GEMM
    ref16 = gemm_bf16(act_d, wd).get().astype(np.int32)
    ulps = np.abs(out.get().astype(np.int32) - ref16)       # same sign and binade almost always: bits ~ ulps
    assert np.mean(ulps > 1) < 1e-3 and rel_err(got, bf16_bits_to_f32(ref16.astype(np.uint16))) < 2e-3
    # eager launches are deterministic (graph replay = the same launch)
    out2 = poisoned(cp, (T, H))
    route_logits(fused[:, :E], cp.asarray(bias), k, n_group, topk_group, 2.827, True, ids2, wts2,
                 gate_up=fused[:, E:], down_w=wd, down_out=out2)
    assert np.array_equal(out2.get(), out.get())


def test_router_shared_down_args_and_rule(monkeypatch):
    import cupy as cp
    from ddtree_cupy.kernels.router import DOWN_MAX_T, shared_down_fused, route_logits
    lg = cp.zeros((4, 384 + 512), np.float32)
    bias = cp.zeros(384, np.float32)
    wd, out = cp.zeros((1024, 256), np.uint16), cp.zeros((4, 1024), np.uint16)
    with pytest.raises(ValueError, match="down_w / down_out"):
        route_logits(lg[:, :384], bias, 8, gate_up=lg[:, 384:], down_w=wd)
    with pytest.raises(ValueError, match="gate_up"):
        route_logits(lg[:, :384], bias, 8, down_w=wd, down_out=out)
    with pytest.raises(ValueError, match="act_out"):
        route_logits(lg[:, :384], bias, 8, gate_up=lg[:, 384:], act_out=cp.zeros((4, 256), np.uint16),
                     down_w=wd, down_out=out)
    with pytest.raises(ValueError, match="down_w"):
        route_logits(lg[:, :384], bias, 8, gate_up=lg[:, 384:], down_w=wd[:, :128], down_out=out)
    with pytest.raises(ValueError, match="gate_up: width"):
        lg3 = cp.zeros((4, 384 + 384), np.float32)              # I = 192: no instance
        route_logits(lg3[:, :384], bias, 8, gate_up=lg3[:, 384:], down_w=cp.zeros((1024, 192), np.uint16),
                     down_out=out)
    with pytest.raises(ValueError, match="multiple of 32"):
        route_logits(lg[:, :384], bias, 8, gate_up=lg[:, 384:], down_w=cp.zeros((1000, 256), np.uint16),
                     down_out=cp.zeros((4, 1000), np.uint16))
    with pytest.raises(ValueError, match="down_out"):
        route_logits(lg[:, :384], bias, 8, gate_up=lg[:, 384:], down_w=wd, down_out=cp.zeros((5, 1024), np.uint16))
    monkeypatch.delenv("DDT_ROUTER_DOWN", raising=False)
    assert shared_down_fused(8, 256, 7168) and shared_down_fused(DOWN_MAX_T, 64, 512)
    assert not shared_down_fused(DOWN_MAX_T + 1, 256, 7168) and not shared_down_fused(8, 192, 7168)
    assert not shared_down_fused(8, 2048, 7168) and not shared_down_fused(8, 256, 1000)
    monkeypatch.setenv("DDT_ROUTER_DOWN", "0")
    assert not shared_down_fused(8, 256, 7168)
    monkeypatch.setenv("DDT_ROUTER_DOWN", "1")
    assert shared_down_fused(160, 256, 7168) and not shared_down_fused(8, 2048, 7168)
    monkeypatch.setenv("DDT_ROUTER_DOWN", "yes")
    with pytest.raises(ValueError, match="DDT_ROUTER_DOWN"):
        shared_down_fused(8, 256, 7168)


def test_router_shared_args():
    import cupy as cp
    from ddtree_cupy.kernels.router import route_logits
    lg = cp.zeros((4, 384 + 512), np.float32)
    bias = cp.zeros(384, np.float32)
    act = cp.zeros((4, 256), np.uint16)
    with pytest.raises(ValueError, match="act_out"):
        route_logits(lg[:, :384], bias, 8, gate_up=lg[:, 384:])
    with pytest.raises(ValueError, match="gate_up"):
        route_logits(lg[:, :384], bias, 8, gate_up=cp.zeros((4, 512), np.uint16), act_out=act)   # bf16: old API
    lg2 = cp.zeros((4, 384 + 512 + 4), np.float32)             # 3600-byte rows: a 16-byte multiple
    with pytest.raises(ValueError, match="gate_up: base address"):
        route_logits(lg2[:, :384], bias, 8, gate_up=lg2[:, 386:898], act_out=act)            # not 16-B aligned
    with pytest.raises(ValueError, match="act_out"):
        route_logits(lg[:, :384], bias, 8, act_out=act)


@pytest.mark.parametrize("E,k,n_group,topk_group", [(384, 8, 1, 1), (384, 8, 8, 4), (72, 6, 3, 2),
                                                     (512, 32, 16, 3), (48, 8, 1, 1), (256, 8, 8, 1)])
def test_router_selection_exact_ties_and_groups(E, k, n_group, topk_group):
    """Register top-k selection vs the float64 reference with CONSTRUCTED ties: equal choice values at the
    k-th / (k+1)-th place on the same lane (ids 32 apart) and on different lanes (the lower id must win),
    a row of all-equal logits, whole groups that tie on their top-2 score (the lower group must win), and
    E that is not a multiple of 32 (lanes with fewer candidates). Outputs poisoned."""
    import cupy as cp
    from ddtree_cupy.kernels.router import route_logits
    rng = np.random.default_rng(E * 7 + k + n_group)
    T = 13
    lg = rng.standard_normal((T, E)).astype(np.float32)
    bias = np.zeros(E, np.float32)
    bias[rng.choice(E, E // 4, replace=False)] = 0.01 * rng.standard_normal(E // 4)
    gs = E // n_group
    # row 0: 2k experts share the top value (bias 0 on them): the k lowest ids must be taken, in id order
    tied = np.sort(rng.choice(E, 2 * k, replace=False))
    bias[tied] = 0.0
    lg[0, tied] = 4.0
    # row 1: all logits equal (choice = s + bias, the bias alone orders them, then ids)
    lg[1] = 0.5
    # row 2: ties on one lane (ids e, e + 32, e + 64) and across lanes at the top
    for e in (5, 37, 69, 4, 6):
        if e < E:
            bias[e] = 0.0
            lg[2, e] = 5.0
    # rows 3..: with groups, copy group 0's values into another group (a group-score tie)
    if n_group > 1:
        for t in range(3, T):
            a, b = rng.choice(n_group, 2, replace=False)
            lg[t, b * gs:(b + 1) * gs] = lg[t, a * gs:(a + 1) * gs] + 3.0
            lg[t, a * gs:(a + 1) * gs] += 3.0
            bias[a * gs:(a + 1) * gs] = 0.0
            bias[b * gs:(b + 1) * gs] = 0.0
    ids, wts = poisoned(cp, (T, k), np.int32), poisoned(cp, (T, k), np.float32)
    route_logits(cp.asarray(lg), cp.asarray(bias), k, n_group, topk_group, 2.827, True, ids, wts)
    ids_ref, w_ref = _route_ref(lg, bias, k, n_group, topk_group)
    got = ids.get()
    for t in range(T):
        assert np.array_equal(got[t], ids_ref[t].astype(np.int32)), (t, got[t], ids_ref[t])
    assert rel_err(wts.get(), w_ref) < 1e-5
    assert np.array_equal(got[0], tied[:k].astype(np.int32)) or n_group > 1
    # unnormalised weights are the plain sigmoid scores times the scale
    route_logits(cp.asarray(lg), cp.asarray(bias), k, n_group, topk_group, 1.5, False, ids, wts)
    ids_ref, w_ref = _route_ref(lg, bias, k, n_group, topk_group, 1.5, False)
    assert np.array_equal(ids.get(), ids_ref.astype(np.int32))
    assert rel_err(wts.get(), w_ref) < 1e-6


# ------------------------------------------------------------------------------------------- benchmark
def bench(old_src=None, out_json=None, layers=8, reps=20, old_norm_src=None):
    """The MoE layer's head at Kimi TP = 8 rank shapes, as CUDA graphs with PDL (as the engine captures):
    ``layers`` copies of [rms_norm -> router | shared gate_up -> route + SwiGLU -> shared down GEMM] with
    distinct weights (~100 MB: beyond the H200's L2, as consecutive layers are), per layer; and the
    selection launch alone. ``old_src``: the previous router.cu (bf16 gate_up, no logits stride) compiled
    from that path, timed in the same process as the old chain (router GEMM fp32 + shared gate_up GEMM
    bf16 + the old route_silu). Ceiling: the head's weight bytes at the copy bandwidth of this run.
    E2 (docs/MODELS.md): ``down`` = the same head with the shared down projection inside the route launch
    (router_topk_down, no shared down GEMM) next to ``new`` (route + SwiGLU, then gemm_bf16) - the
    DDT_ROUTER_DOWN decision; ``old_norm_src``: the previous norm.cu, its rms_norm (with the residual add,
    as the layer runs it) timed against the current one in the same chain."""
    import json
    import os
    import cupy as cp
    from ddtree_cupy.kernels import launch
    from ddtree_cupy.kernels.compile import CUDA_SRC_DIR, KernelSpec, get_kernel
    from ddtree_cupy.kernels.gemm import gemm_bf16
    from ddtree_cupy.kernels.layers import rms_norm
    from ddtree_cupy.kernels.router import WARPS, route_logits
    launch.set_pdl(True)
    H, E, Is, k = 7168, 384, 256, 8
    rng = cp.random.RandomState(1)

    def bf(*shape):     # random bf16 bit patterns (truncated fp32), N(0, 0.02^2)
        return ((rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)).view(np.uint32) >> 16).astype(
            np.uint16)
    Ws = [dict(rgu=bf(E + 2 * Is, H), down=bf(H, Is), bias=(rng.standard_normal(E, dtype=np.float32) * 0.05),
               norm=bf(H)) for _ in range(layers)]
    for W in Ws:    # the old chain's two weights: views of the same rows (same bytes read)
        W["router"], W["gu"] = W["rgu"][:E], W["rgu"][E:]
    bw = copy_bandwidth(1 << 30, 5)
    old_k = old_norm_k = None
    if old_norm_src:
        nspec = KernelSpec(os.path.relpath(os.path.abspath(old_norm_src), CUDA_SRC_DIR), ("rmsnorm_kernel",),
                           pdl=True)
        old_norm_k = get_kernel(nspec, "rmsnorm_kernel")
    if old_src:
        spec = KernelSpec(os.path.relpath(os.path.abspath(old_src), CUDA_SRC_DIR), ("router_topk",), pdl=True)
        old_k = get_kernel(spec, "router_topk")

    def old_route(lg, bias, ids, wts, gu, act, T):
        rb = (T + WARPS - 1) // WARPS
        ab = max(1, min(512, -(-T * Is // 8 // (32 * WARPS))))
        old_k((rb + ab,), (32 * WARPS,), (lg, np.int32(T), np.int32(E), bias, np.int32(1), np.int32(1), np.int32(k),
                                         np.int32(1), np.float32(2.827), ids, wts, np.int32(rb), gu,
                                         np.int64(2 * Is), act, np.int64(Is), np.int32(Is)))

    def timed(fn, st):
        return graph_us(fn, st, reps)

    rows, res = [], []
    st = cp.cuda.Stream(non_blocking=True)
    for T in (1, 8, 32, 64, 80, 160):
        h = bf(T, H)
        x = cp.empty((T, H), np.uint16)
        fused = cp.empty((T, E + 2 * Is), np.float32)
        lg = cp.empty((T, E), np.float32)
        gu = cp.empty((T, 2 * Is), np.uint16)
        act = cp.empty((T, Is), np.uint16)
        sh = cp.empty((T, H), np.uint16)
        ids, wts = cp.empty((T, k), np.int32), cp.empty((T, k), np.float32)
        ws = cp.empty(64 << 20, np.float32)

        def new_layers():
            for W in Ws:
                rms_norm(h, W["norm"], 1e-6, out=x)
                gemm_bf16(x, W["rgu"], fused, out_dtype=np.float32, workspace=ws)
                route_logits(fused[:, :E], W["bias"], k, 1, 1, 2.827, True, ids, wts, gate_up=fused[:, E:],
                             act_out=act)
                gemm_bf16(act, W["down"], sh, workspace=ws)

        def old_layers():
            for W in Ws:
                rms_norm(h, W["norm"], 1e-6, out=x)
                gemm_bf16(x, W["router"], lg, out_dtype=np.float32, workspace=ws)
                gemm_bf16(x, W["gu"], gu, workspace=ws)
                old_route(lg, W["bias"], ids, wts, gu, act, T)
                gemm_bf16(act, W["down"], sh, workspace=ws)

        def new_route():
            for W in Ws:
                route_logits(fused[:, :E], W["bias"], k, 1, 1, 2.827, True, ids, wts, gate_up=fused[:, E:],
                             act_out=act)

        def old_route_only():
            for W in Ws:
                old_route(lg, W["bias"], ids, wts, gu, act, T)

        def norm_only():
            for W in Ws:
                rms_norm(h, W["norm"], 1e-6, out=x)

        def down_layers():
            for W in Ws:
                rms_norm(h, W["norm"], 1e-6, out=x)
                gemm_bf16(x, W["rgu"], fused, out_dtype=np.float32, workspace=ws)
                route_logits(fused[:, :E], W["bias"], k, 1, 1, 2.827, True, ids, wts, gate_up=fused[:, E:],
                             down_w=W["down"], down_out=sh)

        def route_down():
            for W in Ws:
                route_logits(fused[:, :E], W["bias"], k, 1, 1, 2.827, True, ids, wts, gate_up=fused[:, E:],
                             down_w=W["down"], down_out=sh)

        def norm_res():         # the layer's form: h += x (in place), x = norm(h)
            for W in Ws:
                rms_norm(x, W["norm"], 1e-6, out=x2, residual=h)

        def old_norm_res():
            for W in Ws:
                old_norm_k((T,), (256,), (x, np.int64(H), h, np.int64(H), h, np.int64(H), W["norm"], x2,
                                          np.int64(H), np.uint64(0), np.int32(H), np.float32(1e-6)))
        x2 = cp.empty((T, H), np.uint16)

        # order matters: norm_only fills x, new_layers fills the fp32 head output the selections read
        r = dict(T=T, norm_us=timed(norm_only, st) / layers, new_us=timed(new_layers, st) / layers,
                 new_route_us=timed(new_route, st) / layers, down_us=timed(down_layers, st) / layers,
                 route_down_us=timed(route_down, st) / layers,
                 ceiling_us=(Ws[0]["rgu"].nbytes + Ws[0]["down"].nbytes + Ws[0]["norm"].nbytes) / bw * 1e6)
        r.update(norm_res_us=timed(norm_res, st) / layers)
        if old_k is not None:
            r.update(old_us=timed(old_layers, st) / layers, old_route_us=timed(old_route_only, st) / layers)
        if old_norm_k is not None:
            r.update(old_norm_res_us=timed(old_norm_res, st) / layers)
        res.append(r)
    print(f"\nMoE head per layer (norm -> router|shared gate_up -> route+SwiGLU -> shared down), PDL graphs, "
          f"{layers} layers of distinct weights, copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'T':>4} {'norm':>6} {'old head':>9} {'new head':>9} {'ceiling':>8} {'old route':>10} {'new route':>10}")
    for r in res:
        print(f"{r['T']:>4} {r['norm_us']:>6.1f} {r.get('old_us', float('nan')):>9.1f} {r['new_us']:>9.1f} "
              f"{r['ceiling_us']:>8.1f} {r.get('old_route_us', float('nan')):>10.1f} {r['new_route_us']:>10.1f}")
    print("\nE2 variants, us per layer: head = norm -> GEMM -> route (+SwiGLU) [-> shared down GEMM]; "
          "DDT_ROUTER_DOWN default wins where 'down head' < 'sep head'")
    print(f"{'T':>4} {'sep head':>9} {'down head':>10} {'route+silu':>11} {'route+down':>11} {'norm+res old':>13} "
          f"{'norm+res new':>13}")
    for r in res:
        print(f"{r['T']:>4} {r['new_us']:>9.1f} {r['down_us']:>10.1f} {r['new_route_us']:>11.1f} "
              f"{r['route_down_us']:>11.1f} {r.get('old_norm_res_us', float('nan')):>13.1f} {r['norm_res_us']:>13.1f}")
    if out_json:
        with open(out_json, "w") as f:
            json.dump(dict(copy_bw_GBps=bw / 1e9, layers=layers, reps=reps, device=cp.cuda.runtime.getDeviceProperties(
                0)["name"].decode(), rows=res, note="us per layer; head includes the rms_norm producer"), f, indent=1)


if __name__ == "__main__":
    import argparse
    import sys
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--old-src", default=None, help="the previous router.cu, timed in the same run")
    ap.add_argument("--old-norm-src", default=None, help="the previous norm.cu, timed in the same run")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.bench:
        bench(a.old_src, a.json, old_norm_src=a.old_norm_src)
