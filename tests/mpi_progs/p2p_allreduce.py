"""Run under mpirun -np N (N GPUs, N >= 2): the P2P all-reduce across real GPUs.

    mpirun -np N launcher/bind.sh python tests/mpi_progs/p2p_allreduce.py            # the checks
    mpirun -np N launcher/bind.sh python tests/mpi_progs/p2p_allreduce.py --dead     # the last rank hangs

Checks (rank 0 prints "P2P ALLREDUCE OK"): for 1..320 rows x 7168 bf16, one-shot, two-shot and (on a
topology of equal islands, e.g. 4 + 4 GPUs on two sockets) two-level, equal to NCCL
within bf16 rounding and to the rank-ordered fp32 sum bit for bit, identical bits on every rank; the fused
residual add + RMSNorm equal to all-reduce + rms_norm; 10^4 calls replayed from a CUDA graph. ``--dead``: the
last rank never makes its call; the others must end the job with the error naming it (DDT_AR_TIMEOUT_S).
A machine without P2P between its GPUs prints "NO P2P" and exits 0 (nothing to check).
"""
import hashlib
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits   # noqa: E402
from ddtree_cupy.comm import protocol as P                     # noqa: E402
from ddtree_cupy.dist import NcclComm, end_job, hold_until_exit, init_communicator   # noqa: E402

H = 7168


def main() -> int:
    import cupy as cp
    from ddtree_cupy.comm.custom import P2PAllReduce
    from ddtree_cupy.kernels.layers import rms_norm
    nccl = init_communicator("cupy")
    assert isinstance(nccl, NcclComm), type(nccl)
    hold_until_exit(nccl)
    n, rank = nccl.size, nccl.rank
    ar = P2PAllReduce(nccl, 320 * H)
    if not ar.p2p_ok:
        if rank == 0:
            print(f"NO P2P between these GPUs: {ar.matrix}", flush=True)
        return 0
    dead = "--dead" in sys.argv
    stream = cp.cuda.Stream(non_blocking=True)
    if dead:
        x = cp.ones((8, H), np.uint16)
        nccl.barrier()
        if rank == n - 1:
            # hangs instead of exiting: a rank that exits is reaped by mpirun anyway; one that hangs (or is
            # stopped) is what only the bounded wait can turn into an error
            print(f"rank {rank}: never starting its all-reduce", flush=True)
            time.sleep(300)
            return 4
        t0 = time.time()
        with stream:
            ar.all_reduce(x, "oneshot")
        time.sleep(120)                      # the watchdog must end the job long before this
        print(f"rank {rank}: STILL RUNNING after {time.time() - t0:.0f} s", flush=True)
        return 3
    with stream:
        for T in (1, 2, 8, 16, 32, 80, 160, 320):
            rng = np.random.default_rng(T)         # the same table on every rank; rank r takes part r
            parts = [to_bf16_bits(rng.standard_normal((T, H)).astype(np.float32)) for _ in range(n)]
            ref_nccl = cp.asarray(parts[rank])
            nccl.all_reduce(ref_nccl)
            for algo in ar.algos:
                isl = ar.island if algo == "twolevel" else 0
                want = P.reference_sum(parts, isl)
                x = cp.asarray(parts[rank])
                out = cp.full((T, H), 0xFFFF, np.uint16)
                stream.synchronize()
                ar.all_reduce(x, algo, out=out)
                got = out.get()
                assert np.array_equal(got, want), f"T {T} {algo} rank {rank}: not the rank-ordered sum"
                digests = nccl.all_gather_obj(hashlib.sha1(got.tobytes()).hexdigest())
                assert len(set(digests)) == 1, f"T {T} {algo}: ranks hold different bits"
                a, b = bf16_bits_to_f32(got).astype(np.float64), bf16_bits_to_f32(ref_nccl.get()).astype(np.float64)
                rel = np.linalg.norm(a - b) / np.linalg.norm(b)
                assert rel < 2 ** -7, f"T {T} {algo}: {rel:.2e} from NCCL"
                # fused: residual add + RMSNorm vs the unfused pair
                res0 = to_bf16_bits(rng.standard_normal((T, H)).astype(np.float32))
                w = cp.asarray(to_bf16_bits(rng.uniform(0.5, 1.5, H).astype(np.float32)))
                x = cp.asarray(parts[rank])
                res, normed = cp.asarray(res0), cp.full((T, H), 0xFFFF, np.uint16)
                ar.all_reduce_add_norm(x, res, w, 1e-6, normed, algo=algo)
                s, res_u, normed_u = cp.asarray(want), cp.asarray(res0), cp.full((T, H), 0xFFFF, np.uint16)
                rms_norm(s, w, 1e-6, out=normed_u, residual=res_u)
                assert np.array_equal(res.get(), res_u.get()), f"T {T} {algo}: fused residual differs"
                assert np.array_equal(normed.get(), normed_u.get()), f"T {T} {algo}: fused norm differs"
        # 10^4 graph replays: 100 calls per graph x 100 launches, alternating algorithms
        T = 8
        rng = np.random.default_rng(99)
        parts = [to_bf16_bits(rng.standard_normal((T, H)).astype(np.float32)) for _ in range(n)]
        x, out = cp.asarray(parts[rank]), cp.full((T, H), 0xFFFF, np.uint16)
        stream.synchronize()
        nccl.barrier()
        stream.begin_capture()
        for i in range(100):
            ar.all_reduce(x, P.ALGOS[i % 2], out=out)
        g = stream.end_capture()
        for _ in range(100):
            g.launch(stream)
        stream.synchronize()
        assert np.array_equal(out.get(), P.reference_sum(parts)), f"rank {rank}: wrong after 10^4 replays"
    nccl.barrier()
    if rank == 0:
        print(f"P2P ALLREDUCE OK ({n} ranks; algorithms {', '.join(ar.algos)})", flush=True)
    return 0


if __name__ == "__main__":
    end_job(main())
