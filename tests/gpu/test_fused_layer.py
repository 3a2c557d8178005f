"""Fused MLA-block kernels (kernels/fused.py, cuda_src/fused_layer.cu) and the router + shared-expert SwiGLU
launch (kernels/router.py) against float64 numpy references, on fresh random inputs with poisoned outputs;
and bit for bit against the chains of unfused kernels they replace."""
import numpy as np
import pytest

from _kernel_testutil import BF16_TOL, POISON_BF16, f64, poisoned, rand_bf16, rel_err
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


# ------------------------------------------------------------------------------- router + shared SwiGLU
@pytest.mark.parametrize("T,I", [(1, 256), (19, 256), (160, 2048)])
def test_router_with_shared_silu(T, I):
    """route_logits(..., gate_up=, act_out=): the same ids / weights as the router alone (bitwise), and the
    shared expert's activation equal to silu_mul's (bitwise) and to the float64 SwiGLU."""
    import cupy as cp
    from ddtree_cupy.kernels.layers import silu_mul
    from ddtree_cupy.kernels.router import route_logits
    rng = np.random.default_rng(300 + T)
    E, k = 384, 8
    logits = cp.asarray(rng.standard_normal((T, E)).astype(np.float32))
    bias = cp.asarray((rng.standard_normal(E) * 0.05).astype(np.float32))
    gub, gu = rand_bf16(rng, (T, 2 * I + 16), 2.0)
    gu_d = cp.asarray(gub)[:, 8:8 + 2 * I]                 # a row-strided view, as the target's buffer
    gu = gu[:, 8:8 + 2 * I]
    ids, wts = poisoned(cp, (T, k), np.int32), poisoned(cp, (T, k), np.float32)
    act = poisoned(cp, (T, I + 8))[:, :I]
    route_logits(logits, bias, k, 8, 4, 2.827, True, ids, wts, gate_up=gu_d, act_out=act)
    ids2, wts2 = poisoned(cp, (T, k), np.int32), poisoned(cp, (T, k), np.float32)
    route_logits(logits, bias, k, 8, 4, 2.827, True, ids2, wts2)
    assert np.array_equal(ids.get(), ids2.get())
    assert np.array_equal(wts.get(), wts2.get())
    g, u = gu[:, :I], gu[:, I:]
    ref = g / (1 + np.exp(-g)) * u
    assert rel_err(f64(act), ref) < BF16_TOL
    assert np.array_equal(act.get(), silu_mul(gu_d).get())
    with pytest.raises(ValueError, match="act_out"):
        route_logits(logits, bias, k, 8, 4, 2.827, True, ids, wts, gate_up=gu_d)
