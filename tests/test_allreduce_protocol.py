"""The peer-to-peer all-reduce protocol (cuda_src/allreduce.cuh) on a model of N ranks: numpy buffers stand in
for the IPC-shared peer memory, every block of every rank is a coroutine that yields where the kernel spins,
and a seeded scheduler (or one OS thread per rank) interleaves them in any order. Every rank must end with the
rank-ordered fp32 sum rounded to bf16, bit for bit, over many replays with the epoch counters wrapping and no
host reset in between; a rank that never arrives must end the others with a PeerTimeout naming it."""
import random

import numpy as np
import pytest

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
from ddtree_cupy.comm import protocol as P

H = 7168


def _parts(rng, n, N):
    # fresh random bf16 values (never zeros), one partial sum per rank, exponents spread over 2^-24..2^24 so
    # that fp32 sums of them round, and a sum in another order than 0..n-1 gives other bits
    return [to_bf16_bits(rng.standard_normal(N).astype(np.float32)
                         * np.exp2(rng.integers(-24, 25, N)).astype(np.float32)) for _ in range(n)]


def _cancelling(rng, n, N):
    """_parts with +B on the first and -B on the last rank for half the elements (B ~ 2^20): the rank-order
    sum loses the middle ranks' small values there, any other order keeps some (a wrong order is visible)."""
    parts = _parts(rng, n, N)
    sel = rng.random(N) < 0.5
    big = to_bf16_bits(rng.standard_normal(N).astype(np.float32) * np.float32(2 ** 20))
    parts[0][sel] = big[sel]
    parts[-1][sel] = big[sel] ^ np.uint16(0x8000)
    return parts


def _one(bufs, parts, unit, algo, rng, island=0, **kw):
    outs = [np.full(p.shape, 0xFFFF, np.uint16) for p in parts]          # poisoned (NaN bf16)
    calls = [P.Call(x=p.copy(), out=o, unit=unit, algo=algo, island=island) for p, o in zip(parts, outs)]
    P.run_interleaved(bufs, calls, rng, **kw)
    return outs


CASES = ([("oneshot", n, 0) for n in range(2, 9)] + [("twoshot", n, 0) for n in range(2, 9)]
         + [("twolevel", n, m) for n, m in ((4, 2), (6, 2), (6, 3), (8, 2), (8, 4))])


@pytest.mark.parametrize("algo,n,island", CASES)
def test_every_size_class_and_rank_count(algo, n, island):
    """1 row (one unit per block, fewer units than ranks), 8 rows, 40 rows (more units than blocks: grid
    stride) and a payload whose last unit is partial; every rank holds the reference bits."""
    rng = np.random.default_rng(100 + n)
    sched = random.Random(n)
    cap = 40 * H
    bufs = [P.RankBuffers(cap) for _ in range(n)]
    for N, unit in ((H, P.PLAIN_UNIT), (8 * H, P.PLAIN_UNIT), (40 * H, P.PLAIN_UNIT), (8 * 1000, 1024), (64, 8)):
        parts = _cancelling(rng, n, N)
        want = P.reference_sum(parts, island)
        outs = _one(bufs, parts, unit, algo, sched, island)
        for r, o in enumerate(outs):
            assert np.array_equal(o, want), f"rank {r}, N {N}: wrong sum"
    # the reference itself: fp32 sum in rank order (a wrong order would change some bits of 8 parts)
    f = sum(bf16_bits_to_f32(p).astype(np.float64) for p in parts)
    err = np.abs(bf16_bits_to_f32(want) - f)
    assert np.all(err <= np.abs(f) * 2 ** -8 + sum(np.abs(bf16_bits_to_f32(p)) for p in parts) * n * 2 ** -23)


def test_rank_order_matters():
    """The reference is the rank-ordered sum: a reversed order differs for some elements (so the bit
    comparisons above would catch a kernel summing in another order); the two-level order is another one."""
    rng = np.random.default_rng(3)
    parts = _cancelling(rng, 8, 4096)
    assert not np.array_equal(P.reference_sum(parts), P.reference_sum(parts, island=4))
    assert not np.array_equal(P.reference_sum(parts), P.reference_sum(parts[1:] + parts[:1]))
    assert not np.array_equal(P.reference_sum(parts), P.reference_sum(parts[::-1]))


@pytest.mark.slow
@pytest.mark.parametrize("algo", P.ALGOS)
def test_replays_wrap_epochs_any_order(algo):
    """3000 back-to-back calls on 3-bit epoch counters (wrap every 8 calls), alternating payload sizes (so
    blocks are used unevenly), every fifth call with the next algorithm (a two-level call publishes to every
    rank but waits only for its island and its partners); a fresh random interleaving every call."""
    n, bits = 4, 3
    rng = np.random.default_rng(7)
    sched = random.Random(11)
    bufs = [P.RankBuffers(4 * 1024, epoch_bits=bits) for _ in range(n)]
    for i in range(3000):
        N = (64, 1024, 4096)[i % 3]
        a = algo if i % 5 else P.ALGOS[(P.ALGOS.index(algo) + 1) % len(P.ALGOS)]
        isl = 2 if a == "twolevel" else 0
        parts = _parts(rng, n, N)
        want = P.reference_sum(parts, isl)
        outs = _one(bufs, parts, 256, a, sched, isl)
        for r, o in enumerate(outs):
            assert np.array_equal(o, want), f"call {i} rank {r}"
    assert int(bufs[0].epoch1[0]) == 3000 % (1 << bits)


@pytest.mark.slow
def test_threads_no_host_reset():
    """One OS thread per rank replaying 400 calls, the three algorithms in turn, with no barrier between them
    (a rank may run one epoch ahead of a slow peer and publish its next flag before the peer read the current
    one)."""
    n = 4
    rng = np.random.default_rng(5)
    R = 400
    parts = [[_parts(rng, n, 512)[r] for r in range(n)] for _ in range(R)]
    outs = [[np.full(512, 0xFFFF, np.uint16) for _ in range(n)] for _ in range(R)]
    bufs = [P.RankBuffers(512, epoch_bits=4) for _ in range(n)]

    def call(r, i):
        return P.Call(x=parts[i][r].copy(), out=outs[i][r], unit=64, algo=P.ALGOS[i % 3], island=2)
    errs = P.run_threads(bufs, call, R, seed=1)
    assert errs == [None] * n, errs
    for i in range(R):
        want = P.reference_sum(parts[i], 2 if i % 3 == 2 else 0)
        for r in range(n):
            assert np.array_equal(outs[i][r], want), f"call {i} rank {r}"


def test_in_place():
    """out aliasing x (the engine reduces its GEMM output in place)."""
    n = 6
    rng = np.random.default_rng(9)
    bufs = [P.RankBuffers(3 * H) for _ in range(n)]
    for algo in P.ALGOS:
        isl = 3 if algo == "twolevel" else 0
        parts = _parts(rng, n, 3 * H)
        want = P.reference_sum(parts, isl)
        xs = [p.copy() for p in parts]
        P.run_interleaved(bufs, [P.Call(x=x, out=x, unit=P.PLAIN_UNIT, algo=algo, island=isl) for x in xs],
                          random.Random(2))
        for x in xs:
            assert np.array_equal(x, want)


@pytest.mark.parametrize("algo", P.ALGOS)
def test_fused_add_norm(algo):
    """Fused: h += sum (bf16), normed = rmsnorm(h) on every rank, identical bits, equal to the unfused chain
    (all-reduce, then the float64 reference add + norm)."""
    from ddtree_cupy.reference.norm import rms_norm
    n, T, Hs = 4, 6, 1024
    rng = np.random.default_rng(21)
    bufs = [P.RankBuffers(T * Hs) for _ in range(n)]
    parts = _parts(rng, n, T * Hs)
    res0 = to_bf16_bits(rng.standard_normal((T, Hs)).astype(np.float32))
    w = to_bf16_bits(rng.uniform(0.5, 1.5, Hs).astype(np.float32))
    res = [res0.copy() for _ in range(n)]
    normed = [np.full((T, Hs), 0xFFFF, np.uint16) for _ in range(n)]
    isl = 2 if algo == "twolevel" else 0
    calls = [P.Call(x=parts[r].copy(), out=parts[r].copy(), unit=Hs, algo=algo, residual=res[r], weight=w,
                    normed=normed[r], eps=1e-6, island=isl) for r in range(n)]
    P.run_interleaved(bufs, calls, random.Random(4))
    s = P.reference_sum(parts, isl).reshape(T, Hs)
    h = to_bf16_bits(bf16_bits_to_f32(s) + bf16_bits_to_f32(res0))
    ref = rms_norm(bf16_bits_to_f32(h).astype(np.float64), bf16_bits_to_f32(w).astype(np.float64), 1e-6)
    for r in range(n):
        assert np.array_equal(res[r], h)
        assert np.array_equal(normed[r], normed[0])
        got = bf16_bits_to_f32(normed[r]).astype(np.float64)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 4e-3


@pytest.mark.parametrize("algo", P.ALGOS)
def test_absent_peer_times_out_naming_it(algo):
    n = 4
    rng = np.random.default_rng(1)
    bufs = [P.RankBuffers(1024) for _ in range(n)]
    parts = _parts(rng, n, 1024)
    calls = [P.Call(x=p.copy(), out=p.copy(), unit=256, algo=algo, island=2) for p in parts]
    with pytest.raises(P.PeerTimeout, match="waited for rank 2 .* never arrived"):
        P.run_interleaved(bufs, calls, random.Random(0), max_spins=200, absent=(2,))
    with pytest.raises(ValueError, match="island size"):
        next(P.block_program(bufs, 0, 0, 1, P.Call(x=parts[0], out=parts[0], unit=256, algo="twolevel", island=3)))


def test_plan_grid():
    assert P.plan_grid(7168, P.PLAIN_UNIT) == 4
    assert P.plan_grid(320 * 7168, 7168) == P.MAX_BLOCKS
    assert P.plan_grid(8 * 7168, 7168) == 8
    for bad in ((0, 8), (12, 8), (16, 12)):
        with pytest.raises(ValueError, match="multiples of 8"):
            P.plan_grid(*bad)
    assert P.buffer_bytes(1000) == P.HEADER_BYTES + 8000 + 8000


def test_layout_matches_the_kernel_header():
    """The Python constants are the ones cuda_src/allreduce.cuh defines."""
    import re
    from ddtree_cupy.kernels.compile import CUDA_SRC_DIR
    src = (CUDA_SRC_DIR / "allreduce.cuh").read_text()
    got = {k: int(v) for k, v in re.findall(r"#define (AR_\w+) (\d+)", src)}
    assert got["AR_MAX_RANKS"] == P.MAX_RANKS and got["AR_MAX_BLOCKS"] == P.MAX_BLOCKS
    assert got["AR_THREADS"] == P.THREADS and got["AR_HEADER_BYTES"] == P.HEADER_BYTES
    assert 8 * got["AR_MAXV"] * got["AR_THREADS"] == P.MAX_FUSED_H
    assert (2 * P.MAX_BLOCKS * P.MAX_RANKS + 2 * P.MAX_BLOCKS) * 4 <= P.HEADER_BYTES
