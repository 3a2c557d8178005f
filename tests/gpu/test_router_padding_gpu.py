"""Padding rows are free in the MoE: router.cu with row_pos (the batch's kv_pos) writes ids -1 / weights 0 for
rows with row_pos < 0 in every launch variant (plain, + shared SwiGLU, + shared down projection), and leaves
the real rows' selection bit for bit what the unmasked launch gives (and the float64 reference's). That the
MoE skips ids -1 (no expert bytes, the residual only) is tests/gpu/test_moe.py's bad-ids test."""
import numpy as np
import pytest

from _kernel_testutil import poisoned, rand_bf16, rel_err
from ddtree_cupy.reference.moe import route as ref_route

pytestmark = pytest.mark.gpu


def _case(T, E, H, I, seed):
    import cupy as cp
    from ddtree_cupy.kernels.gemm import gemm_bf16
    rng = np.random.default_rng(seed)
    xb, x = rand_bf16(rng, (T, H))
    rb, r = rand_bf16(rng, (E, H), 0.1)
    gb, _ = rand_bf16(rng, (2 * I, H), H ** -0.5 * 2)
    bias = (rng.standard_normal(E) * 0.05).astype(np.float32)
    fused = poisoned(cp, (T, E + 2 * I), np.float32)
    gemm_bf16(cp.asarray(xb), cp.asarray(np.concatenate([rb, gb])), fused, out_dtype=np.float32)
    # padding: a stream's tail rows and a whole idle slot (kv_pos -1), real rows at increasing positions
    pos = np.arange(T, dtype=np.int32) + 100
    pad = rng.random(T) < 0.4
    pad[:2] = [False, True]
    pos[pad] = -1
    return fused, cp.asarray(bias), cp.asarray(pos), pad, x, r, bias


@pytest.mark.parametrize("variant", ["plain", "silu", "down"])
@pytest.mark.parametrize("T", [5, 33])
def test_padding_rows_select_no_expert(variant, T):
    import cupy as cp
    from ddtree_cupy.kernels.router import route_logits
    E, k, H, I = 384, 8, 1024, 256
    fused, bias, pos, pad, _, _, bias_h = _case(T, E, H, I, 70 + T)
    extra = {}
    if variant == "silu":
        extra = dict(gate_up=fused[:, E:], act_out=poisoned(cp, (T, I)))
    elif variant == "down":
        wd = cp.asarray(rand_bf16(np.random.default_rng(5), (H, I), I ** -0.5)[0])
        extra = dict(gate_up=fused[:, E:], down_w=wd, down_out=poisoned(cp, (T, H)))
    ids, wts = poisoned(cp, (T, k), np.int32), poisoned(cp, (T, k), np.float32)
    route_logits(fused[:, :E], bias, k, 1, 1, 2.827, True, ids, wts, row_pos=pos, **extra)
    ids0, wts0 = poisoned(cp, (T, k), np.int32), poisoned(cp, (T, k), np.float32)
    route_logits(fused[:, :E], bias, k, 1, 1, 2.827, True, ids0, wts0)
    got_i, got_w, all_i, all_w = ids.get(), wts.get(), ids0.get(), wts0.get()
    assert (got_i[pad] == -1).all() and (got_w[pad] == 0).all()
    assert np.array_equal(got_i[~pad], all_i[~pad]) and np.array_equal(got_w[~pad], all_w[~pad])
    cfg = type("C", (), dict(n_routed_experts=E, num_experts_per_tok=k, hidden_size=E, n_group=1, topk_group=1,
                             norm_topk_prob=True, routed_scaling_factor=2.827))
    lg = fused[:, :E].get().astype(np.float64)
    # the reference from the kernel's own fp32 logits (x @ r^T through identity weights)
    ref_i, ref_w = ref_route(lg, np.eye(E), bias_h.astype(np.float64), cfg, real=~pad)
    assert np.array_equal(got_i, ref_i.astype(np.int32))
    assert rel_err(got_w[~pad], ref_w[~pad]) < 1e-5


def test_row_pos_is_checked():
    import cupy as cp
    from ddtree_cupy.kernels.router import route_logits
    lg = cp.zeros((4, 64), cp.float32)
    with pytest.raises(ValueError, match="row_pos"):
        route_logits(lg, cp.zeros(64, cp.float32), 8, row_pos=cp.zeros(3, cp.int32))
    with pytest.raises(ValueError, match="row_pos"):
        route_logits(lg, cp.zeros(64, cp.float32), 8, row_pos=cp.zeros(4, cp.int64))
