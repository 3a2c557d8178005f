"""The wide-token GEMM family (``gemm_bf16_kernel_wide``, T = 17..160) against float64 numpy: every compiled
config forced with split 1, > 1 and uneven K ranges at edge shapes (T 17..160 with padded token tiles, N not
a multiple of the 128-row block, K of 2 to 112 k tiles), bf16 and fp32 out, batched and strided views as
the engine uses them (x a column slice of wider rows, out a column slice of a buffer with spare rows after
T that must stay poisoned); bit-identical repeats; the rule's pick at every engine shape (graph replay of the
rule's picks and the PDL chain of engine shapes are in test_gemm.py, shared with the other families); the
"auto" switch (DDT_GEMM_WIDE / set_wide) routing T > 16 to the wide or the split-K family. The cluster
configs (K split over cs = 2, 4, 8 blocks, reduced through distributed shared memory) run the same cases with
split = cs, including K = 128 (2 k tiles) where some blocks of the cluster get no k tile. Every output buffer is filled on the stream that launches the GEMM."""
import numpy as np
import pytest

from _kernel_testutil import (BF16_TOL, check_gemm, f64, gemm_twice, gemm_views, poisoned, rand_bf16, record_kernels,
                              rel_err)
from _kernel_testutil import gemm_weight as _weight

pytestmark = pytest.mark.gpu


@pytest.fixture
def launched(monkeypatch):
    """Names of the GEMM kernels fetched since the test began (one fetch per launch)."""
    from ddtree_cupy.kernels import gemm
    return record_kernels(monkeypatch, gemm)


def _views(cp, rng, T, N, K, B, dt, strided):
    """x [B, T, K] and a poisoned out [B, T, N] (``gemm_views`` with 8 spare token rows after T that must stay
    poisoned: padded token tiles). Returns (x_dev, out, obuf, x64)."""
    xb, x = rand_bf16(rng, (B, T, K))
    return (*gemm_views(cp, rng, xb, N, dt, strided, spare_rows=8), x)


def _cases():
    """(config index, T, N, K, B, split, f32, strided): each config at T in its padded and exact tiles, N a
    multiple of 128 and not (576, 2112: partial row block; 16: one m16 tile, six of 8 warps idle), K from 2
    k tiles to 112, splits 1, uneven (9 k tiles in 4), more splits than k tiles (clamped) and large."""
    from ddtree_cupy.kernels.gemm import WIDE_CONFIGS
    out = []
    for i, c in enumerate(WIDE_CONFIGS):
        bt = c.bt()
        out += [
            (i, 17, 576, 576, 1, 4, False, True),          # one partial token tile, uneven split, strided
            (i, bt, 2112, 1536, 1, 1, True, False),        # exact tile, no split, fp32 out
            (i, bt + 1, 128, 7168, 1, 14, False, True),    # one row block, second token tile of 1 row
            (i, 2 * bt - 1, 16, 128, 2, 5, True, True),    # batched, N = 16, 2 k tiles split 5 (clamped)
            (i, min(160, 2 * bt + 3), 7168, 1024, 1, 2, False, False),
        ]
    out += [(0, 31, 2112, 7168, 1, 16, False, True), (1, 100, 1040, 2304, 3, 3, False, True),
            (2, 160, 2112, 7168, 1, 5, False, True), (1, 160, 384, 7168, 1, 6, True, False)]
    return out


@pytest.mark.parametrize("ci,T,N,K,B,split,f32,strided", _cases())
def test_every_wide_config(launched, ci, T, N, K, B, split, f32, strided):
    """Forced (config, split): twice into a re-poisoned output (same bits), the launched kernels are the
    config's (plus the split-K reduce when the clamped split > 1), right against float64."""
    import cupy as cp
    from ddtree_cupy.kernels import gemm
    cfg = gemm.WIDE_CONFIGS[ci]
    rng = np.random.default_rng(ci * 100003 + T * 1009 + N + K + split)
    dt = np.float32 if f32 else np.uint16
    w_dev, w = _weight(N, K, B)
    x_dev, out, obuf, x = _views(cp, rng, T, N, K, B, dt, strided)
    if B == 1:
        x_dev, out, w_dev = x_dev[0], out[0], w_dev[0]
    if cfg.cs > 1:
        split = cfg.cs              # a cluster config splits K over its blocks (some get no k tile at K = 128)
    old_c, old_v = gemm.set_wide_config((cfg, split)), gemm.set_variant("wide")
    try:
        first = gemm_twice(x_dev, w_dev, out, dt)
    finally:
        gemm.set_wide_config(old_c)
        gemm.set_variant(old_v)
    eff = min(split, K // 64) if cfg.cs == 1 else 1      # the cluster reduces in-kernel: no reduce launch
    red = f"gemm_splitk_reduce<{'true' if f32 else 'false'}>"
    assert launched == ([cfg.name(f32)] + ([red] if eff > 1 else [])) * 2, launched
    assert cp.array_equal(first, out), "repeat differs: the summation order must be fixed"
    check_gemm(out, obuf, np.matmul(x, w.transpose(0, 2, 1)), f32, T, N, B)


ENGINE = [  # (name, N, K, batch, fp32 out): the engine's GEMMs at T > 16 (bench/kernels.py GEMMS, lm_head aside)
    ("q_a+kv_a", 2112, 7168, 1, False), ("q_b", 1536, 1536, 1, False), ("W_UK^T", 512, 128, 8, False),
    ("W_UV", 128, 512, 8, False), ("o_proj", 7168, 1024, 1, False), ("dense gate+up", 4608, 7168, 1, False),
    ("dense down", 7168, 2304, 1, False), ("router+shared gate/up", 896, 7168, 1, True),
    ("drafter qkv", 1280, 7168, 1, False),
]


@pytest.mark.parametrize("T", [17, 64, 160])
@pytest.mark.parametrize("name,N,K,B,f32", ENGINE, ids=[e[0] for e in ENGINE])
def test_engine_shapes_rule_pick(launched, name, N, K, B, f32, T):
    """The rule's own (config, split) at every engine shape through set_variant("wide"); odd T and batched
    shapes through strided views."""
    import cupy as cp
    from ddtree_cupy.kernels import gemm
    rng = np.random.default_rng(T * 7 + N + K)
    dt = np.float32 if f32 else np.uint16
    w_dev, w = _weight(N, K, B)
    strided = B > 1 or T % 2 == 1
    x_dev, out, obuf, x = _views(cp, rng, T, N, K, B, dt, strided)
    if B == 1:
        x_dev, out, w_dev = x_dev[0], out[0], w_dev[0]
    old = gemm.set_variant("wide")
    try:
        gemm.gemm_bf16(x_dev, w_dev, out, out_dtype=dt)
    finally:
        gemm.set_variant(old)
    cfg, split = gemm.choose_wide(T, N, K, B, gemm._sm_count(), gemm._smem_per_sm())
    assert launched[0] == cfg.name(f32) and len(launched) == (2 if split > 1 and cfg.cs == 1 else 1), launched
    check_gemm(out, obuf, np.matmul(x, w.transpose(0, 2, 1)), f32, T, N, B)


# Graph replay of the rule's wide picks: tests/gpu/test_gemm.py::test_auto_pick_graph_replay_equals_eager.
# The PDL chain of engine shapes on the wide family: tests/gpu/test_gemm.py::test_engine_pdl_chain_equals_plain.


@pytest.mark.parametrize("env,forced", [("0", None), ("1", None), ("0", True), ("1", False)])
def test_auto_switch(monkeypatch, launched, env, forced):
    """Under "auto": DDT_GEMM_WIDE (and set_wide over it) sends T = 40 to the wide or the split-K kernel,
    both right, the two results within bf16 rounding of each other; T = 16 never goes wide."""
    import cupy as cp
    from ddtree_cupy.kernels import gemm
    monkeypatch.setenv("DDT_GEMM_WIDE", env)
    old_w, old_v = gemm.set_wide(forced), gemm.set_variant("auto")
    try:
        on = (env == "1") if forced is None else forced
        assert gemm.wide_enabled() == on
        rng = np.random.default_rng(int(env) * 2 + (forced is None))
        w_dev, w = _weight(2112, 7168, 1)
        for T in (40, 16):
            xb, x = rand_bf16(rng, (T, 7168))
            out = poisoned(cp, (T, 2112))
            del launched[:]
            gemm.gemm_bf16(cp.asarray(xb), w_dev[0], out)
            assert rel_err(f64(out), x @ w[0].T) < BF16_TOL
            wide = launched[0].startswith("gemm_bf16_kernel_wide")
            assert wide == (on and T > 16), launched
    finally:
        gemm.set_wide(old_w)
        gemm.set_variant(old_v)
