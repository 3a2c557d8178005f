"""All-reduce latency for the decode step's payloads, bf16 [rows, 7168]: NCCL and the P2P kernels (one-shot,
two-shot, and two-level where the topology has equal islands; comm/custom.py) side by side in one run, eager and inside a CUDA graph.

    mpirun -np N launcher/bind.sh python bench/allreduce.py [--rows 1 8 16 ... 320] [--json out.json]
    NCCL_P2P_DISABLE=1 mpirun -np N ... bench/allreduce.py    # NCCL without P2P (the custom path still
                                                             # runs where the driver allows P2P)
    python bench/allreduce.py                                 # one GPU: the harness only (one rank)

A decode step at TP = 8 issues 137 all-reduces (61 layers x 2 + the embedding + the drafter's), each of
rows x 14 KB. Eager: per-call host launch. Graph: 100 calls captured in one graph and replayed, which is what
the engine pays. Per payload and algorithm: latency (us), algorithm bandwidth (payload bytes / time) and,
for the P2P kernels, the fraction of the bandwidth ceiling measured in the same run (a one-rank copy of
the same payload through this GPU's memory is not it: the ceiling is the slowest rank's P2P copy rate into its
next peer's buffer, 64 MB, all ranks at once). The crossovers are what ``CalibrationTable.choose`` picks; the
JSON (``--json``) is the table the engine reads (DDT_ALLREDUCE_TABLE). Asserts nothing about speed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H = 7168
DEFAULT_ROWS = [1, 2, 4, 8, 16, 32, 64, 80, 128, 160, 320]


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


def _time(stream, fn, iters: int, in_graph: int, barrier):
    """(eager us, graph us) per call of ``fn`` on ``stream``."""
    import cupy as cp
    for _ in range(5):
        fn()
    stream.synchronize()
    barrier()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record(stream)
    for _ in range(iters):
        fn()
    e1.record(stream)
    e1.synchronize()
    eager = cp.cuda.get_elapsed_time(e0, e1) * 1000 / iters
    stream.begin_capture()
    for _ in range(in_graph):
        fn()
    g = stream.end_capture()
    g.launch(stream)
    stream.synchronize()
    barrier()
    reps = max(1, iters // in_graph)
    e0.record(stream)
    for _ in range(reps):
        g.launch(stream)
    e1.record(stream)
    e1.synchronize()
    return eager, cp.cuda.get_elapsed_time(e0, e1) * 1000 / (reps * in_graph), g


def p2p_ceiling_GBps(comm, ar) -> float:
    """The slowest rank's one-way P2P copy rate (cudaMemcpy of this rank's buffer into rank r + 1's IPC-mapped
    data slots, every rank at once): what one link moves. A one-shot all-reduce pulls (n - 1) x the payload
    into each GPU, two-shot 2 (n - 1) / n x."""
    import cupy as cp
    from ddtree_cupy.comm import protocol as P
    nbytes = min(64 << 20, 4 * ar.cap) // 16 * 16
    peers = ar.peers.get()
    src = cp.empty(nbytes, np.uint8)
    dst = int(peers[(comm.rank + 1) % comm.size]) + P.HEADER_BYTES
    cp.cuda.Device().synchronize()
    comm.barrier()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record()
    for _ in range(5):
        cp.cuda.runtime.memcpyAsync(dst, src.data.ptr, nbytes, cp.cuda.runtime.memcpyDefault, 0)
    e1.record()
    e1.synchronize()
    rate = 5 * nbytes / (cp.cuda.get_elapsed_time(e0, e1) * 1e-3) / 1e9
    comm.barrier()
    return float(min(comm.all_gather_obj(rate)))


def main(argv=None) -> int:
    import cupy as cp
    from ddtree_cupy.comm.calibration import table_from_json
    from ddtree_cupy.comm.custom import P2PAllReduce
    from ddtree_cupy.comm.topology import read_topology
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", "--tokens", type=int, nargs="+", default=DEFAULT_ROWS, dest="rows")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--no-custom", action="store_true", help="NCCL only (the custom path off)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    comm = make_comm()
    stream = cp.cuda.Stream(non_blocking=True)
    ar = None if a.no_custom else P2PAllReduce(comm, max(a.rows) * H)
    custom = ar is not None and ar.p2p_ok
    algos = ["nccl"] + (list(ar.algos) if custom else [])
    rows = []
    keep = []
    with stream:
        for T in a.rows:
            x = cp.asarray(np.random.default_rng(comm.rank).integers(0, 1 << 14, (T, H)).astype(np.uint16))
            r = {"tokens": T, "bytes": T * H * 2}
            for al in algos:
                fn = (lambda: comm.all_reduce(x)) if al == "nccl" else (lambda al=al: ar.all_reduce(x, al))
                eager, graph, g = _time(stream, fn, a.iters, 100, comm.barrier)
                keep.append(g)
                r[f"{al}_eager_us"], r[f"{al}_graph_us"] = eager, graph
            r["eager_us"], r["graph_us"] = r["nccl_eager_us"], r["nccl_graph_us"]    # the NCCL-only format
            rows.append(r)
    ceiling = p2p_ceiling_GBps(comm, ar) if custom and comm.size > 1 else float("nan")
    topo = read_topology()
    if comm.rank == 0:
        name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        print(f"all-reduce, bf16 [rows, {H}], {comm.size} rank(s) on {name}; NCCL_P2P_DISABLE="
              f"{os.environ.get('NCCL_P2P_DISABLE', '0')} NCCL_PROTO={os.environ.get('NCCL_PROTO', 'default')}; "
              f"P2P kernels: {'on' if custom else 'off (' + ('--no-custom' if ar is None else 'no P2P') + ')'}; "
              f"topology: {topo.describe() if topo else 'nvidia-smi topo -m unavailable'}")
        if custom:
            print(f"P2P copy ceiling (slowest pair, one way): {ceiling:.1f} GB/s")
        hdr = f"{'rows':>5} {'KB':>7}" + "".join(f" {al + ' eager':>14} {al + ' graph':>14} {'GB/s':>6}" for al in algos)
        print(hdr + "   pick")
        table = table_from_json({"ranks": comm.size, "rows": rows})
        for r in rows:
            line = f"{r['tokens']:5d} {r['bytes'] / 1024:7.1f}"
            for al in algos:
                line += f" {r[al + '_eager_us']:14.2f} {r[al + '_graph_us']:14.2f} {r['bytes'] / r[al + '_graph_us'] / 1e3:6.1f}"
            print(line + f"   {table.choose(r['bytes'])}")
        if custom and comm.size > 1:
            n = comm.size
            for r in rows:
                # payloads into each GPU: one-shot n - 1, two-shot 2 (n - 1) / n, two-level m - 1 bf16 inside the
                # island + 2 (k - 1) fp32-sized across (the busiest link's share is what the ceiling bounds)
                m = ar.island or n
                per = {"oneshot": n - 1, "twoshot": 2 * (n - 1) / n, "twolevel": (m - 1) + 2 * (n // m - 1)}
                for al in ar.algos:
                    r[f"{al}_link_fraction"] = r["bytes"] * per[al] / (r[al + "_graph_us"] * 1e3) / ceiling
            big = rows[-1]
            print(f"largest payload: one-shot moves {big['oneshot_link_fraction']:.2f}, two-shot "
                  f"{big['twoshot_link_fraction']:.2f} of the P2P ceiling over the slowest link")
        cross = table.crossovers()
        print("choice by payload: " + ", ".join(f"{c['algo']} from {c['bytes'] / 1024:.0f} KB" for c in cross))
        fit = fit_latency_bandwidth(rows, comm.size)
        # what the engine's 'auto' choice pays: the fastest algorithm's time per payload, fitted the same way
        best_rows = [{"bytes": r["bytes"], "graph_us": min(r[al + "_graph_us"] for al in algos)} for r in rows]
        fit_best = fit_latency_bandwidth(best_rows, comm.size)
        bw = f"{fit['bus_GBps']:.1f} GB/s" if fit["bus_GBps"] else "n/a"
        print(f"NCCL fit (graph us = latency + 2 (n-1)/n x bytes / bus bandwidth): latency {fit['latency_us']:.1f} us, "
              f"bus bandwidth {bw}  -> python -m bench.step --allreduce-fit {a.json or 'THIS.json'}")
        if custom:
            bwb = f"{fit_best['bus_GBps']:.1f} GB/s" if fit_best["bus_GBps"] else "n/a"
            print(f"fastest-algorithm fit: latency {fit_best['latency_us']:.1f} us, bus bandwidth {bwb}  -> "
                  f"python -m bench.step --allreduce-fit {a.json or 'THIS.json'} --allreduce-fit-algo best")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"ranks": comm.size, "device": name, "rows": rows, "fit": fit, "fit_best": fit_best,
                           "crossovers": cross,
                           "p2p_ceiling_GBps": ceiling, "p2p": custom,
                           "topology": topo.describe() if topo else None,
                           "cap_bytes": (ar.cap * 2) if custom else None}, f, indent=1)
    return 0


if __name__ == "__main__":
    from ddtree_cupy.dist import end_job
    end_job(main())
