"""NCCL all-reduce latency for the decode step's payloads: bf16 [tokens, 7168], eager and inside a CUDA graph.

    mpirun -np 8 launcher/bind.sh python bench/allreduce.py [--tokens 1 8 16 64 160] [--json out.json]
    python bench/allreduce.py            # one GPU: a single-rank communicator (checks the harness only)

A decode step at TP = 8 issues about 123 all-reduces (61 layers x 2 + the embedding), each of
tokens x 14 KB; this measures the per-call cost the step's projection (bench/step.py) assumes.
Eager: per-call host launch + NCCL. Graph: the same call captured 100 times in one graph and replayed,
which is what the engine pays. Prints a table on rank 0; asserts nothing about speed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H = 7168


def make_comm():
    from ddtree_cupy.dist import NcclComm, hold_until_exit, init_communicator, launched_with_mpi
    # Under mpirun: the engine's own set-up (each rank on GPU local_rank % count, then NCCL bootstrapped over
    # MPI; creating NCCL first would put every rank on GPU 0). One process: a real single-rank NCCL
    # communicator, so the eager and graph paths are exercised (its latency is a copy, not a collective).
    # Held until the process ends: freeing it before the graphs that captured its all-reduces hangs the process
    # (dist.end_job).
    if launched_with_mpi():
        comm = init_communicator("cupy")
        if isinstance(comm, NcclComm):
            return hold_until_exit(comm)
    return hold_until_exit(NcclComm())


def fit_latency_bandwidth(rows, ranks: int) -> dict:
    """Least-squares fit of the graph-captured time to ``latency + bus bytes / bandwidth`` over the measured
    payloads, bus bytes = 2 (ranks - 1) / ranks x payload (what a ring moves through each GPU's link): the two
    constants of ``bench.step``'s projection (``--allreduce-fit``). A single rank has no bus: latency only."""
    t = np.array([r["graph_us"] for r in rows], np.float64)
    if ranks < 2 or len(rows) < 2:
        return {"ranks": ranks, "latency_us": float(t.mean()), "bus_GBps": None}
    bus = np.array([r["bytes"] for r in rows], np.float64) * 2 * (ranks - 1) / ranks
    A = np.stack([np.ones_like(bus), bus], axis=1)
    (lat, per_byte), *_ = np.linalg.lstsq(A, t, rcond=None)
    return {"ranks": ranks, "latency_us": float(lat),
            "bus_GBps": float(1e-3 / per_byte) if per_byte > 0 else None}   # us per byte -> GB/s


def main(argv=None) -> int:
    import cupy as cp
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 160])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    comm = make_comm()
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    with stream:
        for T in a.tokens:
            x = cp.asarray(np.random.default_rng(comm.rank).integers(0, 1 << 15, (T, H)).astype(np.uint16))
            for _ in range(10):
                comm.all_reduce(x)
            stream.synchronize()
            comm.barrier()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            for _ in range(a.iters):
                comm.all_reduce(x)
            e1.record(stream)
            e1.synchronize()
            eager_us = cp.cuda.get_elapsed_time(e0, e1) * 1000 / a.iters
            n_in_graph = 100
            stream.begin_capture()
            for _ in range(n_in_graph):
                comm.all_reduce(x)
            g = stream.end_capture()
            g.launch(stream)
            stream.synchronize()
            comm.barrier()
            reps = max(1, a.iters // n_in_graph)
            e0.record(stream)
            for _ in range(reps):
                g.launch(stream)
            e1.record(stream)
            e1.synchronize()
            graph_us = cp.cuda.get_elapsed_time(e0, e1) * 1000 / (reps * n_in_graph)
            rows.append({"tokens": T, "bytes": T * H * 2, "eager_us": eager_us, "graph_us": graph_us})
    if comm.rank == 0:
        name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        print(f"NCCL all-reduce, bf16 [tokens, {H}], {comm.size} rank(s) on {name}; "
              f"NCCL_PROTO={os.environ.get('NCCL_PROTO', 'default')} NCCL_ALGO={os.environ.get('NCCL_ALGO', 'default')}")
        print(f"{'tokens':>7} {'KB':>8} {'eager us':>9} {'graph us':>9} {'123 calls, ms':>14}")
        for r in rows:
            print(f"{r['tokens']:7d} {r['bytes'] / 1024:8.1f} {r['eager_us']:9.2f} {r['graph_us']:9.2f} "
                  f"{123 * r['graph_us'] / 1000:14.2f}")
        fit = fit_latency_bandwidth(rows, comm.size)
        bw = f"{fit['bus_GBps']:.1f} GB/s" if fit["bus_GBps"] else "n/a"
        print(f"fit (graph us = latency + 2 (n-1)/n x bytes / bus bandwidth): latency {fit['latency_us']:.1f} us, "
              f"bus bandwidth {bw}  -> python -m bench.step --allreduce-fit {a.json or 'THIS.json'}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"ranks": comm.size, "device": name, "rows": rows, "fit": fit}, f, indent=1)
    return 0


if __name__ == "__main__":
    from ddtree_cupy.dist import end_job
    end_job(main())
