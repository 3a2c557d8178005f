"""The P2P all-reduce kernels (cuda_src/allreduce.cu) on ONE GPU: n ranks emulated in one process, each rank's
buffer an ordinary allocation and each rank's launch on its own stream (the kernels of all ranks run
concurrently and meet through the same flags they use across GPUs). Against the numpy model of the protocol
(ddtree_cupy/comm/protocol.py): the rank-ordered sum bit for bit on every rank, the fused residual add +
RMSNorm equal to the unfused all-reduce + rms_norm kernel bit for bit and to the float64 reference within bf16
rounding, 10^4 calls replayed from a CUDA graph (epochs advance, no reset), and a rank that never arrives
ends the process with the error record naming it.

Co-residency: the blocks of all emulated ranks must be resident together (a waiting block holds its SM),
so shapes whose n x grid exceeds the SM count are left to the multi-GPU tests (tests/mpi_progs/p2p_allreduce.py).
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
from ddtree_cupy.comm import protocol as P

from _kernel_testutil import POISON_BF16, f64, poisoned, rel_err

pytestmark = pytest.mark.gpu
H = 7168
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class LocalGroup:
    """n ranks' buffers on this GPU; launch(r, ...) issues rank r's kernel on rank r's stream."""

    def __init__(self, cp, n, cap, timeout_s=10.0):
        self.cp, self.n, self.cap = cp, n, cap
        self.bufs = [cp.zeros(P.buffer_bytes(cap), np.uint8) for _ in range(n)]
        self.peers = cp.asarray(np.array([b.data.ptr for b in self.bufs], np.uint64))
        rt = cp.cuda.runtime
        self.err = rt.hostAlloc(32, rt.hostAllocMapped | rt.hostAllocPortable)
        import ctypes
        ctypes.memset(self.err, 0, 32)
        self.streams = [cp.cuda.Stream(non_blocking=True) for _ in range(n)]
        self.timeout_ns = int(timeout_s * 1e9)
        cp.cuda.Device().synchronize()

    def launch(self, r, x, out, algo, island=0, **fused):
        from ddtree_cupy.kernels.allreduce import launch_allreduce
        with self.streams[r]:
            launch_allreduce(self.peers, self.cap, r, self.n, x, out, algo, self.timeout_ns, self.err,
                             island=island, **fused)

    def sync(self):
        for s in self.streams:
            s.synchronize()

    def epoch1(self, r, blk=0):
        return int(self.bufs[r][:P.HEADER_BYTES].view(np.uint32)[2 * P.MAX_BLOCKS * P.MAX_RANKS + blk].get())


def _sms(cp):
    return cp.cuda.Device().attributes["MultiProcessorCount"]


def _parts(rng, n, shape):
    out = []
    for _ in range(n):
        v = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-8, 9, shape)).astype(np.float32)
        out.append(to_bf16_bits(v))
    sel = rng.random(shape) < 0.25        # +B on rank 0, -B on the last: a wrong summation order shows
    big = to_bf16_bits(rng.standard_normal(shape).astype(np.float32) * np.float32(2 ** 16))
    out[0][sel] = big[sel]
    out[-1][sel] = big[sel] ^ np.uint16(0x8000)
    return out


CASES = ([(a, n, 0) for a in ("oneshot", "twoshot") for n in (1, 2, 3, 4, 8)]
         + [("twolevel", n, m) for n, m in ((4, 2), (6, 3), (8, 4), (8, 2))])


@pytest.mark.parametrize("algo,n,island", CASES)
@pytest.mark.parametrize("T", [1, 3, 8, 16])
def test_sum_bits_every_rank(algo, n, island, T):
    import cupy as cp
    grid = P.plan_grid(T * H, P.PLAIN_UNIT)
    if n * grid > _sms(cp):
        pytest.skip(f"{n} emulated ranks x {grid} blocks exceed {_sms(cp)} SMs (multi-GPU test covers it)")
    rng = np.random.default_rng(1000 * n + T)
    g = LocalGroup(cp, n, 16 * H)
    parts = _parts(rng, n, (T, H))
    want = P.reference_sum(parts, island)
    for rep in range(3):                        # three calls: both parity slots, then the first again
        xs = [cp.asarray(p) for p in parts]
        outs = [poisoned(cp, (T, H)) for _ in range(n)]
        cp.cuda.Device().synchronize()          # inputs were written on the default stream
        for r in range(n):
            g.launch(r, xs[r], outs[r], algo, island)
        g.sync()
        for r in range(n):
            assert np.array_equal(outs[r].get(), want), f"rep {rep} rank {r}: not the rank-ordered sum"
    assert g.epoch1(0) == 3


@pytest.mark.parametrize("algo,n,island", [(a, n, 0) for a in ("oneshot", "twoshot") for n in (1, 2, 4)]
                         + [("twolevel", 4, 2)])
@pytest.mark.parametrize("T", [1, 5, 16])
def test_fused_add_norm_vs_unfused(algo, n, island, T):
    """The fused kernel == all-reduce then rms_norm(residual=...) (same arithmetic, bit for bit), and within
    bf16 rounding of the float64 reference."""
    import cupy as cp
    from ddtree_cupy.kernels.layers import rms_norm
    from ddtree_cupy.reference.norm import rms_norm as ref_norm
    if n * T > _sms(cp):
        pytest.skip("emulated ranks exceed the SM count")
    rng = np.random.default_rng(7 * n + T)
    eps = 1e-6
    g = LocalGroup(cp, n, 16 * H)
    parts = _parts(rng, n, (T, H))
    res0 = to_bf16_bits(rng.standard_normal((T, H)).astype(np.float32))
    w = cp.asarray(to_bf16_bits(rng.uniform(0.5, 1.5, H).astype(np.float32)))
    res = [cp.asarray(res0) for _ in range(n)]
    normed = [poisoned(cp, (T, H)) for _ in range(n)]
    xs = [cp.asarray(p) for p in parts]
    cp.cuda.Device().synchronize()
    for r in range(n):
        g.launch(r, xs[r], xs[r], algo, island, residual=res[r], weight=w, normed=normed[r], eps=eps)
    g.sync()
    s = cp.asarray(P.reference_sum(parts, island))
    res_u = cp.asarray(res0)
    normed_u = poisoned(cp, (T, H))
    rms_norm(s, w, eps, out=normed_u, residual=res_u)
    cp.cuda.Device().synchronize()
    h = to_bf16_bits(bf16_bits_to_f32(P.reference_sum(parts, island)) + bf16_bits_to_f32(res0))
    ref = ref_norm(bf16_bits_to_f32(h).astype(np.float64), bf16_bits_to_f32(w.get()).astype(np.float64), eps)
    for r in range(n):
        assert np.array_equal(res[r].get(), h), f"rank {r}: residual != bf16(sum + residual)"
        assert np.array_equal(normed[r].get(), normed_u.get()), f"rank {r}: fused != unfused"
        assert rel_err(f64(normed[r]), ref) < 2 ** -7


def test_graph_replays_10k():
    """2 emulated ranks, 10 calls each (one-shot and two-shot in turn) captured in one graph (a fork onto the
    second rank's stream), replayed 1000 times: 10^4 calls, epochs advance with no host reset, the result
    stays the rank-ordered sum."""
    import cupy as cp
    n, T, calls, reps = 2, 2, 10, 1000
    rng = np.random.default_rng(3)
    g = LocalGroup(cp, n, 4 * H)
    parts = _parts(rng, n, (T, H))
    xs = [cp.asarray(p) for p in parts]
    outs = [poisoned(cp, (T, H)) for _ in range(n)]
    main = g.streams[0]
    cp.cuda.Device().synchronize()
    main.begin_capture()
    fork = cp.cuda.Event()
    fork.record(main)
    g.streams[1].wait_event(fork)
    for i in range(calls):
        for r in range(n):
            g.launch(r, xs[r], outs[r], P.ALGOS[i % 2])
    join = cp.cuda.Event()
    join.record(g.streams[1])
    main.wait_event(join)
    graph = main.end_capture()
    for _ in range(reps):
        graph.launch(main)
    main.synchronize()
    want = P.reference_sum(parts)
    for r in range(n):
        assert np.array_equal(outs[r].get(), want)
    assert g.epoch1(0) == calls * reps and g.epoch1(1) == calls * reps


def test_absent_rank_ends_with_error_record():
    """Rank 0 of 2 launches, rank 1 never does: the kernel waits 1 s, records who waited for whom and traps;
    the process then reports it instead of hanging."""
    prog = textwrap.dedent(f"""
        import ctypes, sys, time
        import numpy as np, cupy as cp
        sys.path.insert(0, {ROOT!r})
        from ddtree_cupy.comm import protocol as P
        from ddtree_cupy.kernels.allreduce import launch_allreduce
        cap = 8 * 7168
        bufs = [cp.zeros(P.buffer_bytes(cap), np.uint8) for _ in range(2)]
        peers = cp.asarray(np.array([b.data.ptr for b in bufs], np.uint64))
        rt = cp.cuda.runtime
        err = rt.hostAlloc(32, rt.hostAllocMapped | rt.hostAllocPortable)
        ctypes.memset(err, 0, 32)
        x = cp.ones((1, 7168), np.uint16)
        cp.cuda.Device().synchronize()
        t0 = time.time()
        launch_allreduce(peers, cap, 0, 2, x, x, "oneshot", int(1e9), err)
        try:
            cp.cuda.Device().synchronize()
            print("NO ERROR")
        except Exception as e:
            w = (ctypes.c_int * 8).from_address(err)
            print(f"TRAPPED after {{time.time() - t0:.1f}} s: code {{w[0]}} rank {{w[1]}} peer {{w[3]}} epoch {{w[4]}}")
    """)
    p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert "TRAPPED" in out and "code 1 rank 0 peer 1 epoch 1" in out, out[-3000:]
    secs = float(out.split("TRAPPED after ")[1].split(" s")[0])
    assert secs < 20, out


def test_wrapper_errors():
    import cupy as cp
    from ddtree_cupy.kernels.allreduce import launch_allreduce
    g = LocalGroup(cp, 1, 1024)
    x = cp.zeros(2048, np.uint16)
    with pytest.raises(ValueError, match="capacity"):
        launch_allreduce(g.peers, g.cap, 0, 1, x, x, "oneshot", 10 ** 9, g.err)
    with pytest.raises(ValueError, match="algo"):
        launch_allreduce(g.peers, g.cap, 0, 1, x[:8], x[:8], "ring", 10 ** 9, g.err)
    with pytest.raises(ValueError, match="multiple of 8"):
        launch_allreduce(g.peers, g.cap, 0, 1, x[:12], x[:12], "oneshot", 10 ** 9, g.err)
    with pytest.raises(ValueError, match="rank / n"):
        launch_allreduce(g.peers, g.cap, 1, 1, x[:8], x[:8], "oneshot", 10 ** 9, g.err)
    assert POISON_BF16 == 0xFFFF
