"""The L2 prefetch launch (kernels/l2_prefetch.py) on the GPU: it writes nothing (weights, pool, block table and
a canary unchanged, also with garbage block-table entries and lengths), and a PDL chain through it keeps stream
order: the kernel after it reads what the (long) kernel before it wrote, eagerly and replayed from a graph."""
import numpy as np
import pytest

from _kernel_testutil import rand_bf16

pytestmark = pytest.mark.gpu


def _snap(arrs):
    return [a.get().copy() for a in arrs]


@pytest.mark.parametrize("evict_last", [False, True])
def test_writes_nothing_even_with_garbage_tables(evict_last):
    import cupy as cp
    from ddtree_cupy.kernels.l2_prefetch import l2_prefetch
    rng = np.random.default_rng(5)
    w1 = cp.asarray(rand_bf16(rng, (1000, 776))[0])                 # 1.55 MB: not a multiple of the chunk
    w2 = cp.asarray(rng.integers(0, 2**31, 4100, dtype=np.int64).astype(np.int32))
    pool = cp.asarray(rand_bf16(rng, (37, 64, 576))[0])
    S, M = 5, 9
    bt = rng.integers(-3, 45, (S, M)).astype(np.int32)               # -1s and ids past the pool's 37 pages
    lens = np.array([0, 63, 64, 10**6, -7], np.int32)                # past max_pages, negative
    bt_d, lens_d = cp.asarray(bt), cp.asarray(lens)
    canary = cp.full(1 << 16, 0x5A5A, np.uint16)
    before = _snap([w1, w2, pool, bt_d, lens_d, canary])
    for blocks in (None, 1, 3):
        l2_prefetch([w1, w2], kv=(pool, bt_d, lens_d), evict_last=evict_last, blocks=blocks)
        l2_prefetch([pool, w1, w2, canary], evict_last=evict_last, blocks=blocks)
    cp.cuda.Device().synchronize()
    for a, b in zip(before, _snap([w1, w2, pool, bt_d, lens_d, canary])):
        assert np.array_equal(a, b)


def test_argument_errors():
    import cupy as cp
    from ddtree_cupy.kernels.l2_prefetch import l2_prefetch
    a = cp.zeros(64, np.uint16)
    with pytest.raises(ValueError, match="at most 4"):
        l2_prefetch([a] * 5)
    with pytest.raises(ValueError, match=r"arrays\[0\].*multiple of 16"):
        l2_prefetch([cp.zeros(3, np.uint16)])
    with pytest.raises(ValueError, match=r"arrays\[1\].*C-contiguous"):
        l2_prefetch([a, cp.zeros((64, 64), np.uint16)[:, ::2]])
    with pytest.raises(ValueError, match="kv block_table"):
        l2_prefetch([a], kv=(cp.zeros((2, 64, 576), np.uint16), cp.zeros((2, 3), np.int64), cp.zeros(2, np.int32)))
    with pytest.raises(ValueError, match="kv lengths"):
        l2_prefetch([a], kv=(cp.zeros((2, 64, 576), np.uint16), cp.zeros((2, 3), np.int32), cp.zeros(3, np.int32)))


@pytest.mark.parametrize("graph", [False, True])
def test_pdl_order_holds_through_the_prefetch(graph):
    """big GEMM (writes y) -> prefetch -> silu_mul(y): with PDL the silu must see this round's y, never the
    previous round's or the poison. Rounds use different inputs so a stale read is visible."""
    import cupy as cp
    from ddtree_cupy.kernels import gemm, launch, layers
    from ddtree_cupy.kernels.l2_prefetch import l2_prefetch
    rng = np.random.default_rng(11)
    T, K, N, R = 8, 7168, 8192, 4
    w = cp.asarray(rand_bf16(rng, (N, K), 0.02)[0])                   # 117 MB: a long producer
    xs = cp.asarray(rand_bf16(rng, (R, T, K))[0])
    y = cp.empty((T, N), np.uint16)
    outs = cp.full((R, T, N // 2), 0xFFFF, np.uint16)
    ws = cp.empty(1 << 22, np.float32)

    def chain():
        for r in range(R):
            gemm.gemm_bf16(xs[r], w, y, workspace=ws)
            l2_prefetch([w], evict_last=True)
            layers.silu_mul(y, outs[r])

    launch.set_pdl(False)
    chain()
    cp.cuda.Device().synchronize()
    ref = outs.get()
    outs[...] = 0xFFFF
    cp.cuda.Device().synchronize()
    launch.set_pdl(True)
    try:
        st = cp.cuda.Stream(non_blocking=True)
        with st:
            if graph:
                st.begin_capture()
                chain()
                g = st.end_capture()
                g.launch(st)
            else:
                chain()
        st.synchronize()
    finally:
        launch.set_pdl(False)
    assert np.array_equal(outs.get(), ref)
