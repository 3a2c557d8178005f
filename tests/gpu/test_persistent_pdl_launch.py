"""The persistent dense MLP half launched with PDL between PDL kernels (the engine's decode graphs launch that
way): a norm writing its input before it, a GEMM reading its output after it. Eagerly and replayed from a
graph, the same bits as with ordinary launches, launch after launch."""
import numpy as np
import pytest

from _kernel_testutil import poisoned, rand_bf16
from ddtree_cupy.engine import schedule as S

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T", [1, 8])
def test_pdl_launches_equal_ordinary_launches(T):
    import cupy as cp
    from ddtree_cupy.kernels import gemm, launch, layers
    from ddtree_cupy.kernels.persistent import PersistentSegment, bind_dense_mlp, default_grid
    H, F, eps = 7168, 2304, 1e-6
    rng = np.random.default_rng(60 + T)
    dev = {k: cp.asarray(rand_bf16(rng, s, sc)[0]) for k, s, sc in
           (("x", (T, H), 1.0), ("w0", (H,), 1.0), ("h0", (T, H), 1.0), ("nw", (H,), 1.0),
            ("w_gu", (2 * F, H), H ** -0.5), ("w_dn", (H, F), F ** -0.5), ("w_post", (512, H), H ** -0.5))}
    attn, h, normed, act, out, y = (poisoned(cp, s) for s in ((T, H), (T, H), (T, H), (T, F), (T, H), (T, 512)))
    sc = S.build_layer(S.LayerShape("dense", 1, T, H=H, nh=8, ql=1536, dn=128, dv=128, F=F), default_grid(),
                       parts=("mlp",))
    seg = PersistentSegment(sc, 0, bind_dense_mlp(sc, attn=attn, h=h, post_norm_w=dev["nw"], eps=eps,
                                                  w_gate_up=dev["w_gu"], w_down=dev["w_dn"], normed=normed,
                                                  act=act, out=out))

    def step():
        h[...] = dev["h0"]
        layers.rms_norm(dev["x"], dev["w0"], eps, out=attn)       # writes the segment's input
        seg.launch()
        gemm.gemm_bf16(out, dev["w_post"], y)                     # reads the segment's output

    def state():
        return [a.get() for a in (attn, h, normed, act, out, y)]

    before = launch.pdl_enabled()
    try:
        launch.set_pdl(False)
        step()
        seg.check()
        ref = state()
        launch.set_pdl(True)
        for _ in range(3):
            for a in (normed, act, out, y):
                a.fill(0x7FC1)
            step()
            seg.check()
            assert all(np.array_equal(r, g) for r, g in zip(ref, state())), "PDL eager launch differs"
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            step()
            step()
            graph = stream.end_capture()
            for _ in range(3):
                for a in (normed, act, out, y):
                    a.fill(0x7FC1)
                graph.launch(stream)
                stream.synchronize()
                seg.check()
                assert all(np.array_equal(r, g) for r, g in zip(ref, state())), "PDL graph replay differs"
    finally:
        launch.set_pdl(before)
