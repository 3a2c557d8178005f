"""Programmatic dependent launch (kernels/launch.py) on the GPU: producer/consumer chains of PDL-aware
kernels (GEMM, RMSNorm, silu_mul, RoPE, embedding) give bit-identical results with PDL on and off, eagerly
and replayed from a CUDA graph. The producer GEMM is large (a 117 MB weight, multi-wave grid) so the
consumer's blocks really are resident and waiting while it drains; every chain step reads what the step
before wrote, with new inputs each round, so a missing DDT_PDL_WAIT() would read a stale or poisoned
buffer."""
import numpy as np
import pytest

from _kernel_testutil import BF16_TOL, f64, rand_bf16, rel_err

pytestmark = pytest.mark.gpu

T, H, NB, I = 8, 1024, 8192, 1024      # tokens, model width, big producer width, MLP width
ROUNDS = 6


@pytest.fixture(scope="module")
def chain():
    import cupy as cp
    rng = np.random.default_rng(2024)
    bufs = dict(
        table=cp.asarray(rand_bf16(rng, (512, H))[0]),
        norm_w=cp.asarray(rand_bf16(rng, (H,))[0]),
        w_big=cp.asarray(rand_bf16(rng, (NB, 7168), 0.02)[0]),     # 117 MB: the long producer
        w_in=cp.asarray(rand_bf16(rng, (7168, H), 0.05)[0]),
        w_gu=cp.asarray(rand_bf16(rng, (2 * I, NB), 0.02)[0]),
        w_down=cp.asarray(rand_bf16(rng, (H, I), 0.05)[0]),
        inv=cp.asarray((1.0 / 10000.0 ** (np.arange(32) / 32)).astype(np.float32)),
        ids=cp.asarray(rng.integers(0, 512, (ROUNDS, T)).astype(np.int32)),
        pos=cp.asarray(rng.integers(0, 4000, (ROUNDS, T)).astype(np.int32)),
    )
    return bufs


def _run_chain(cp, b, outs):
    """ROUNDS x (embed -> norm -> GEMM up to 7168 -> big GEMM -> GEMM gate/up -> silu -> GEMM down ->
    RoPE in place), each round's final output kept in outs[r]."""
    from ddtree_cupy.kernels import gemm, layers
    e, n = outs["e"], outs["n"]
    for r in range(ROUNDS):
        layers.embed(b["ids"][r], b["table"], 0, e)
        layers.rms_norm(e, b["norm_w"], 1e-6, n)
        gemm.gemm_bf16(n, b["w_in"], outs["h"], workspace=outs["ws"])
        gemm.gemm_bf16(outs["h"], b["w_big"], outs["big"], workspace=outs["ws"])    # ~60 us, multi-wave
        gemm.gemm_bf16(outs["big"], b["w_gu"], outs["gu"], workspace=outs["ws"])
        layers.silu_mul(outs["gu"], outs["a"])
        gemm.gemm_bf16(outs["a"], b["w_down"], outs["y"][r], workspace=outs["ws"])
        layers.rope(outs["y"][r][:, None, 960:], b["pos"][r], inv_freq=b["inv"])


def _outs(cp):
    return dict(e=cp.empty((T, H), np.uint16), n=cp.empty((T, H), np.uint16), h=cp.empty((T, 7168), np.uint16),
                big=cp.empty((T, NB), np.uint16), gu=cp.empty((T, 2 * I), np.uint16),
                a=cp.empty((T, I), np.uint16), y=cp.full((ROUNDS, T, H), 0xFFFF, np.uint16),
                ws=cp.empty(1 << 22, np.float32))


@pytest.fixture()
def count_pdl(monkeypatch):
    """[launches of pdl=True kernels, of those the ones that went through cuLaunchKernelEx with PDL]."""
    from ddtree_cupy.kernels import launch
    n = [0, 0]
    real_launch, real_call = launch.launch_pdl, launch.PdlKernel.__call__

    def counting_launch(*a, **k):
        n[1] += 1
        return real_launch(*a, **k)

    def counting_call(self, *a, **k):
        n[0] += 1
        return real_call(self, *a, **k)
    monkeypatch.setattr(launch, "launch_pdl", counting_launch)
    monkeypatch.setattr(launch.PdlKernel, "__call__", counting_call)
    yield n
    launch.set_pdl(False)


def _reference(cp, chain):
    from ddtree_cupy.kernels import launch
    launch.set_pdl(False)
    ref = _outs(cp)
    cp.cuda.Stream.null.synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        _run_chain(cp, chain, ref)
        s.synchronize()
    return ref["y"].get()


def test_pdl_chain_eager_matches_plain(chain, count_pdl):
    import cupy as cp
    from ddtree_cupy.kernels import launch
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("PDL needs sm_90+")
    ref = _reference(cp, chain)
    assert np.all(ref != 0xFFFF), "the plain chain left outputs unwritten"
    assert count_pdl[0] >= ROUNDS * 8 and count_pdl[1] == 0, "PDL launches while disabled"
    count_pdl[0] = 0
    launch.set_pdl(True)
    s = cp.cuda.Stream(non_blocking=True)
    for _ in range(3):
        got = _outs(cp)
        cp.cuda.Stream.null.synchronize()
        with s:
            _run_chain(cp, chain, got)
            s.synchronize()
        assert np.array_equal(got["y"].get(), ref), "PDL changed the result (a kernel read too early?)"
    # every launch of the chain (8 per round, plus the split-K reductions) went through the PDL path
    assert count_pdl[0] >= 3 * ROUNDS * 8 and count_pdl[1] == count_pdl[0], count_pdl


def test_pdl_chain_graph_replay_matches_plain(chain, count_pdl):
    import cupy as cp
    from ddtree_cupy.kernels import launch
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("PDL needs sm_90+")
    ref = _reference(cp, chain)
    count_pdl[0] = 0
    launch.set_pdl(True)
    got = _outs(cp)
    cp.cuda.Stream.null.synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        _run_chain(cp, chain, got)       # eager warm-up: workspace tickets exist before capture
        s.synchronize()
        s.begin_capture()
        _run_chain(cp, chain, got)
        g = s.end_capture()
        for _ in range(3):
            got["y"].fill(0xFFFF)
            got["big"].fill(0xFFFF)      # poison an intermediate too: a consumer reading early sees NaN
            g.launch(s)
            s.synchronize()
            assert np.array_equal(got["y"].get(), ref)
    assert count_pdl[0] >= 2 * ROUNDS * 8 and count_pdl[1] == count_pdl[0], count_pdl


def test_pdl_chain_first_stage_against_float64(chain):
    """The chain's first GEMM (norm output x w_in) against float64, so the bitwise comparisons above
    compare against a right answer, not just a reproducible one."""
    import cupy as cp
    from ddtree_cupy.bf16 import bf16_bits_to_f32
    from ddtree_cupy.kernels import gemm, launch, layers
    launch.set_pdl(True)      # on the legacy default stream this time
    try:
        e, n, h = cp.empty((T, H), np.uint16), cp.empty((T, H), np.uint16), cp.empty((T, 7168), np.uint16)
        layers.embed(chain["ids"][0], chain["table"], 0, e)
        layers.rms_norm(e, chain["norm_w"], 1e-6, n)
        gemm.gemm_bf16(n, chain["w_in"], h)
        cp.cuda.Stream.null.synchronize()
        ref = f64(n) @ bf16_bits_to_f32(chain["w_in"].get()).astype(np.float64).T
        assert rel_err(f64(h), ref) < BF16_TOL
    finally:
        launch.set_pdl(False)
