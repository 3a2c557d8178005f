"""GPU: DFlash drafter GQA attention against the float64 reference (TP8 8/1, TP1 64/8, tiny 16/8 heads;
context lengths from 0 to past a split; sliding window over a ring cache; split-KV on/off; partly padded
16-row tiles; graph replay)."""
import numpy as np
import pytest

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
from ddtree_cupy.reference import attention as ra

pytestmark = pytest.mark.gpu

POISON = 0xFFFF
TOL = 5e-3   # fp32 accumulation; P is rounded to bf16 before P V, the output to bf16
SCALE = 128 ** -0.5


def case(rng, S, Hq, Hkv, C, BR=8):
    q = to_bf16_bits(rng.standard_normal((S, BR, Hq, 128)))
    kb = to_bf16_bits(rng.standard_normal((S, BR, Hkv, 128)))
    vb = to_bf16_bits(rng.standard_normal((S, BR, Hkv, 128)))
    kc = to_bf16_bits(rng.standard_normal((S, C, Hkv, 128)))
    vc = to_bf16_bits(rng.standard_normal((S, C, Hkv, 128)))
    return q, kb, vb, kc, vc


def launch(arrs, ctx, window, max_ctx, splits=None, out=None):
    import cupy as cp
    from ddtree_cupy.kernels.attention import drafter_attention
    d = [cp.asarray(a) for a in arrs]
    if out is None:
        out = cp.full(arrs[0].shape, POISON, dtype=cp.uint16)
    drafter_attention(*d, cp.asarray(np.asarray(ctx, np.int32)), softmax_scale=SCALE, max_ctx_len=max_ctx,
                      window=window, out=out, num_splits=splits)
    return out.get()


def rel_err(got, ref):
    g = bf16_bits_to_f32(got).astype(np.float64)
    assert np.isfinite(g).all()
    return np.linalg.norm(g - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("Hq,Hkv", [(8, 1), (64, 8), (16, 8)])
def test_drafter_attention_random(Hq, Hkv):
    rng = np.random.default_rng(Hq * 10 + Hkv)
    for S, C, window in ((1, 3000, 0), (4, 700, 0), (3, 600, 257)):
        arrs = case(rng, S, Hq, Hkv, C)
        if window:
            ctx = [0, 100, 1500]        # 1500 > C: positions wrap around the ring, only the last 257 are read
        else:
            ctx = [int(rng.integers(0, C + 1)) for _ in range(S)]
            ctx[0] = C
        ref = ra.drafter_attention_ref(*arrs, ctx, SCALE, window)
        for splits in (None, 1):
            got = launch(arrs, ctx, window, max(ctx), splits)
            err = rel_err(got, ref)
            assert err < TOL, f"S={S} C={C} window={window} splits={splits}: rel err {err:.3e}"


@pytest.mark.parametrize("BR,Hq", [(5, 8), (1, 8), (3, 16)])
def test_drafter_partial_row_tiles(BR, Hq):
    """Packed rows BR x G = 40 / 8 / 48: the last 16-row tile is partly padding and some warps own no row
    at all; outputs must still match and the padding must not leak into the real rows."""
    rng = np.random.default_rng(BR * 7 + Hq)
    S, Hkv, C = 2, 1, 900
    arrs = case(rng, S, Hq, Hkv, C, BR=BR)
    ctx = [900, 131]
    ref = ra.drafter_attention_ref(*arrs, ctx, SCALE, 0)
    for splits in (None, 1, 5):
        got = launch(arrs, ctx, 0, max(ctx), splits)
        err = rel_err(got, ref)
        assert err < TOL, f"BR={BR} Hq={Hq} splits={splits}: rel err {err:.3e}"


def test_drafter_graph_replay_equals_eager():
    import cupy as cp
    from ddtree_cupy.kernels.attention import DrafterWorkspace, drafter_attention, drafter_num_splits
    rng = np.random.default_rng(5)
    S, Hq, Hkv, C = 3, 8, 1, 2048
    arrs = [cp.asarray(a) for a in case(rng, S, Hq, Hkv, C)]
    ctx = cp.asarray(np.array([10, 2000, 700], np.int32))
    splits = drafter_num_splits(S, Hkv, C, 8, cp.cuda.Device().attributes["MultiProcessorCount"])
    ws = DrafterWorkspace(splits, S, 8, Hq)
    out = cp.full((S, 8, Hq, 128), POISON, dtype=cp.uint16)
    st = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Stream.null.synchronize()  # null-stream work is not ordered before a non-blocking stream
    with st:
        drafter_attention(*arrs, ctx, softmax_scale=SCALE, max_ctx_len=C, out=out, workspace=ws)
        st.synchronize()
        st.begin_capture()
        drafter_attention(*arrs, ctx, softmax_scale=SCALE, max_ctx_len=C, out=out, workspace=ws)
        g = st.end_capture()
    for step in range(2):
        new = np.array([int(rng.integers(0, C + 1)) for _ in range(S)], np.int32)
        ctx[...] = cp.asarray(new)
        arrs[0][...] = cp.asarray(to_bf16_bits(rng.standard_normal((S, 8, Hq, 128))))
        out[...] = POISON
        cp.cuda.Stream.null.synchronize()  # null-stream work is not ordered before a non-blocking stream
        g.launch(st)
        st.synchronize()
        replay = out.get()
        eager = launch([a.get() for a in arrs], new, 0, C, splits)
        assert np.array_equal(replay, eager)
        ref = ra.drafter_attention_ref(*[a.get() for a in arrs], new, SCALE, 0)
        assert rel_err(replay, ref) < TOL


def test_drafter_bad_inputs():
    import cupy as cp
    from ddtree_cupy.kernels.attention import drafter_attention
    rng = np.random.default_rng(6)
    arrs = [cp.asarray(a) for a in case(rng, 2, 8, 1, 64)]
    ctx = cp.asarray(np.array([3, 4], np.int32))
    with pytest.raises(ValueError, match="k_cache: dimension 2"):
        drafter_attention(arrs[0], arrs[1], arrs[2], arrs[3][:, :, :0], arrs[4], ctx, softmax_scale=SCALE,
                          max_ctx_len=64)
    with pytest.raises(ValueError, match="window"):
        drafter_attention(*arrs, ctx, softmax_scale=SCALE, max_ctx_len=64, window=65)
    big = cp.asarray(to_bf16_bits(rng.standard_normal((2, 8, 72, 128))))
    with pytest.raises(ValueError, match="exceeds 64"):
        drafter_attention(big, *arrs[1:], ctx, softmax_scale=SCALE, max_ctx_len=64)
