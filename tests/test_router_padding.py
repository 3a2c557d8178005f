"""Padding rows select no expert (CPU): the reference router with ``real=`` and a numpy model of router.cu's
row_pos rule (route_padding before route_token, the lane-by-lane selection of test_router_select_model.py):
padding rows get ids -1 / weights 0, real rows exactly the unmasked selection; the reference MoE skips the
padding rows (zero output, no expert evaluated) and the unique-expert count follows the real rows only."""
from types import SimpleNamespace

import numpy as np
import pytest

from ddtree_cupy.reference.moe import moe_experts, route
from test_router_select_model import select


def _cfg(E, k, H):
    return SimpleNamespace(n_routed_experts=E, num_experts_per_tok=k, hidden_size=H, n_group=1, topk_group=1,
                           norm_topk_prob=True, routed_scaling_factor=2.827)


def kernel_model(logits, bias, k, scale, row_pos):
    """router_topk with row_pos, per token as one warp computes it (float32 sigmoid, choice keys)."""
    T, E = logits.shape
    ids = np.empty((T, k), np.int64)
    w = np.empty((T, k), np.float64)
    for t in range(T):
        if row_pos is not None and row_pos[t] < 0:       # route_padding
            ids[t], w[t] = -1, 0.0
            continue
        s = (1.0 / (1.0 + np.exp(-logits[t].astype(np.float32)))).astype(np.float32)
        ids[t] = select((s + bias).astype(np.float32), k)
        sel = s[ids[t]].astype(np.float64)
        w[t] = sel * scale / (sel.sum() + 1e-20)
    return ids, w


@pytest.mark.parametrize("T,E,k", [(9, 64, 8), (33, 384, 8), (4, 16, 2)])
def test_padding_rows_select_nothing_real_rows_unchanged(T, E, k):
    rng = np.random.default_rng(T * 7 + E)
    H = 24
    x = rng.standard_normal((T, H))
    g = rng.standard_normal((E, H)) * 0.3
    bias = rng.standard_normal(E) * 0.05
    pos = np.arange(T) + 50
    pad = rng.random(T) < 0.4
    pad[0], pad[-1] = False, True
    pos[pad] = -1
    cfg = _cfg(E, k, H)
    ids_all, w_all = route(x, g, bias, cfg)
    ids, w = route(x, g, bias, cfg, real=pos >= 0)
    assert (ids[pad] == -1).all() and (w[pad] == 0).all()
    assert np.array_equal(ids[~pad], ids_all[~pad]) and np.array_equal(w[~pad], w_all[~pad])
    # the kernel's model: same rule, same real-row selection as the reference
    lg = (x @ g.T).astype(np.float32)
    mi, mw = kernel_model(lg, bias.astype(np.float32), k, 2.827, pos)
    assert np.array_equal(mi, ids)
    assert np.abs(mw[~pad] - w[~pad]).max() < 1e-5
    mi0, _ = kernel_model(lg, bias.astype(np.float32), k, 2.827, None)
    assert np.array_equal(mi0, ids_all)


def test_moe_skips_padding_rows_and_counts_real_experts():
    rng = np.random.default_rng(3)
    T, E, k, H, I = 12, 16, 2, 8, 6
    x = rng.standard_normal((T, H))
    gate, up = rng.standard_normal((E, I, H)), rng.standard_normal((E, I, H))
    down = rng.standard_normal((E, H, I))
    real = np.ones(T, bool)
    real[[2, 5, 6, 11]] = False
    ids, w = route(x, rng.standard_normal((E, H)), np.zeros(E), _cfg(E, k, H), real=real)
    y = moe_experts(x, ids, w, gate, up, down)
    assert np.abs(y[~real]).max() == 0.0
    y_real = moe_experts(x[real], ids[real], w[real], gate, up, down)
    assert np.allclose(y[real], y_real, rtol=1e-13, atol=1e-13)
    # the experts touched: those of the real rows, nothing for padding
    assert set(np.unique(ids[ids >= 0]).tolist()) == set(np.unique(ids[real]).tolist())
    with pytest.raises(ValueError, match="real"):
        route(x, rng.standard_normal((E, H)), np.zeros(E), _cfg(E, k, H), real=real[:-1])
    with pytest.raises(ValueError, match="ids must lie"):
        moe_experts(x, np.full((T, k), -2), w, gate, up, down)
