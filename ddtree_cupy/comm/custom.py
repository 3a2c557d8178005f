"""The peer-to-peer all-reduce on GPUs (``P2PAllReduce``) and the communicator that uses it where it is faster
than NCCL (``CustomComm``).

``P2PAllReduce(mpi, cap)``: at construction, once per process --
  * P2P detection for every pair of ranks: each rank maps every peer's PCI bus id to a local device and asks
    ``cudaDeviceCanAccessPeer``; the matrix is gathered, so every rank takes the same decision
    (``p2p_ok``). Ranks on other hosts, or GPUs hidden from each other, count as no P2P;
  * the islands of the topology (``topology``: GPUs joined without a SYS hop): their size enables the
    two-level exchange where the islands are equal rank ranges;
  * one ``cudaMalloc`` per rank (header, 2 input and 2 result slots of ``cap`` bf16, 2 fp32 island-sum slots), its
    IPC handle exchanged over MPI and every peer's opened (``cudaIpcMemLazyEnablePeerAccess``); nothing is
    allocated after this, so calls can be captured in CUDA graphs and replayed any number of times;
  * an error record in host-mapped memory and a watchdog thread: when a kernel's bounded wait expires (a
    peer never arrived within ``timeout_s``), the kernel records who waited for whom and traps; the
    watchdog prints that and aborts the job through the control plane (MPI), so no rank spins forever.

``CustomComm(nccl, table)``: the ``dist.Communicator`` the engine holds. ``all_reduce`` takes one-shot,
two-shot, two-level or NCCL per payload size from a ``CalibrationTable`` (rank 0's, broadcast: every rank must choose
the same); ``all_reduce_add_norm`` is the all-reduce fused with the residual add and the next RMSNorm
(one launch instead of all-reduce + rms_norm), falling back to exactly that pair where NCCL is chosen;
everything else (all-gathers, host objects, barrier, abort) is NCCL's / MPI's.
"""
from __future__ import annotations

import ctypes
import socket
import sys
import threading
import time
from typing import List, Optional, Sequence

import numpy as np

from .. import knobs
from . import protocol as P
from .calibration import ALL_ALGOS, CUSTOM_ALGOS, CalibrationTable, load_table, table_from_json

# A peer more than this late ends the job. Not a few seconds: a rank that compiles a kernel family with NVRTC
# on a cold cache (up to a minute) while its peers already wait in an eager all-reduce must not be taken for dead.
DEFAULT_TIMEOUT_S = 30.0
ERR_WORDS = 8
# NCCL stays the engine's default until a multi-GPU run has measured the P2P path (docs/MULTI_GPU.md); then
# 'auto' (the calibration's choice per payload) replaces it.
DEFAULT_MODE = "nccl"
_NOTICE_GIVEN: set = set()


def notice_once(key: str, message: str, rank: int = 0) -> None:
    """Print ``message`` once per process (rank 0 only): the engine's one notice about its comm path."""
    if key in _NOTICE_GIVEN:
        return
    _NOTICE_GIVEN.add(key)
    if rank == 0:
        print(message, file=sys.stderr, flush=True)


def p2p_matrix(mpi) -> List[List[bool]]:
    """[i][j]: rank i's GPU can access rank j's (True on the diagonal), the same matrix on every rank."""
    import cupy
    rt = cupy.cuda.runtime
    dev = cupy.cuda.Device().id
    me = (socket.gethostname(), rt.deviceGetPCIBusId(dev))
    everyone = mpi.all_gather_obj(me)
    row = []
    for j, (host, bus) in enumerate(everyone):
        if j == mpi.rank:
            row.append(True)
            continue
        ok = False
        if host == me[0]:
            try:
                peer = rt.deviceGetByPCIBusId(bus)
                ok = peer != dev and bool(rt.deviceCanAccessPeer(dev, peer))
            except Exception:          # noqa: BLE001 - a GPU this process cannot see: no P2P with it
                ok = False
        row.append(ok)
    return mpi.all_gather_obj(row)


def rank_island_size(mpi) -> int:
    """Ranks per island of this job's GPUs (``topology.island_size_of_ranks``), agreed by all ranks: rank 0
    reads ``nvidia-smi`` and maps every rank's PCI bus id to its index; 0 where anything is unknown."""
    import cupy
    from .topology import island_size_of_ranks, normalize_bus_id, read_topology, smi_bus_ids
    mine = (socket.gethostname(), normalize_bus_id(cupy.cuda.runtime.deviceGetPCIBusId(cupy.cuda.Device().id)))
    everyone = mpi.all_gather_obj(mine) if mpi.size > 1 else [mine]
    m = 0
    if mpi.rank == 0 and len({h for h, _ in everyone}) == 1:
        topo, buses = read_topology(), smi_bus_ids()
        if topo is not None and buses is not None and len(buses) == topo.n:
            try:
                m = island_size_of_ranks(topo, [buses.index(b) for _, b in everyone])
            except ValueError:          # a rank's GPU is not in nvidia-smi's list
                m = 0
    return int(mpi.broadcast_obj(m, root=0)) if mpi.size > 1 else 0


class P2PAllReduce:
    """Buffers, IPC handles and launches of the custom all-reduce for one rank (see the module doc)."""

    def __init__(self, mpi, cap: int, timeout_s: Optional[float] = None, watchdog: bool = True,
                 island: Optional[int] = None):
        import cupy
        self._cp = cupy
        rt = cupy.cuda.runtime
        self.mpi = mpi
        self.rank, self.n = mpi.rank, mpi.size
        if not 1 <= self.n <= P.MAX_RANKS:
            raise ValueError(f"P2PAllReduce: {self.n} ranks; the kernels handle 1..{P.MAX_RANKS}")
        if not isinstance(cap, (int, np.integer)) or cap < 8 or cap % 8:
            raise ValueError(f"P2PAllReduce: cap must be a positive multiple of 8 elements, got {cap!r}")
        self.cap = int(cap)
        if timeout_s is None:
            timeout_s = knobs.get().ar_timeout_s or DEFAULT_TIMEOUT_S
        if not timeout_s > 0:
            raise ValueError(f"P2PAllReduce: timeout_s must be positive, got {timeout_s!r}")
        self.timeout_ns = int(timeout_s * 1e9)
        self.matrix = p2p_matrix(mpi) if self.n > 1 else [[True]]
        # two-level exchange: ranks per island from the topology (None: read it here), 0 = not offered
        self.island = rank_island_size(mpi) if island is None else int(island)
        if self.island and not (2 <= self.island < self.n and self.n % self.island == 0):
            raise ValueError(f"P2PAllReduce: island {self.island} must split {self.n} ranks into >= 2 islands")
        self.p2p_ok = all(all(r) for r in self.matrix)
        self.base = 0
        self._opened: List[int] = []
        self.peers = None
        self._err_host = 0
        if not self.p2p_ok:
            return
        self.device = cupy.cuda.Device().id
        nbytes = P.buffer_bytes(self.cap)
        self.base = rt.malloc(nbytes)
        rt.memset(self.base, 0, nbytes)
        handle = rt.ipcGetMemHandle(self.base)
        handles = mpi.all_gather_obj(handle) if self.n > 1 else [handle]
        bases = []
        for j, h in enumerate(handles):
            if j == self.rank:
                bases.append(self.base)
            else:
                p = rt.ipcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess)
                self._opened.append(p)
                bases.append(p)
        self.peers = cupy.asarray(np.array(bases, np.uint64))
        # compile every variant now: a rank compiling on its first call would keep its peers waiting
        from ..kernels.allreduce import ALLREDUCE_SPEC, AR_NAMES
        from ..kernels.compile import get_kernel
        for name in AR_NAMES:
            get_kernel(ALLREDUCE_SPEC, name)
        # host-mapped error record: the device writes it through the same address (unified addressing)
        self._err_host = rt.hostAlloc(ERR_WORDS * 4, rt.hostAllocMapped | rt.hostAllocPortable)
        ctypes.memset(self._err_host, 0, ERR_WORDS * 4)
        cupy.cuda.Device().synchronize()        # every memset done before any peer's first publish
        mpi.barrier()
        self._stop = threading.Event()
        if watchdog and self.n > 1:
            threading.Thread(target=self._watch, name="p2p-allreduce-watchdog", daemon=True).start()

    # ---- errors -------------------------------------------------------------------------------------
    def error_record(self) -> Optional[dict]:
        """The kernel's error record, or None: {rank, block, peer, epoch, phase} of the first expired wait."""
        if not self._err_host:
            return None
        w = (ctypes.c_int * ERR_WORDS).from_address(self._err_host)
        if w[0] == 0:
            return None
        return {"rank": w[1], "block": w[2], "peer": w[3], "epoch": w[4] & 0xFFFFFFFF, "phase": w[5]}

    def error_message(self) -> Optional[str]:
        e = self.error_record()
        if e is None:
            return None
        return (f"p2p all-reduce: rank {e['rank']} waited {self.timeout_ns / 1e9:.1f} s for rank {e['peer']} "
                f"(block {e['block']}, epoch {e['epoch']}, phase {e['phase']}); that rank never arrived "
                f"(it died, hangs, or runs another sequence of collectives)")

    def _watch(self):
        while not self._stop.wait(0.05):
            msg = self.error_message()
            if msg is not None:
                self.mpi.abort(msg, 1)
                return

    # ---- launches -----------------------------------------------------------------------------------
    def all_reduce(self, x, algo: str = "oneshot", out=None):
        from ..kernels.allreduce import launch_allreduce
        self._check_ready()
        return launch_allreduce(self.peers, self.cap, self.rank, self.n, x, x if out is None else out, algo,
                                self.timeout_ns, self._err_host, island=self.island)

    def all_reduce_add_norm(self, x, residual, weight, eps: float, normed, algo: str = "oneshot",
                            residual_out=None):
        from ..kernels.allreduce import launch_allreduce
        self._check_ready()
        return launch_allreduce(self.peers, self.cap, self.rank, self.n, x, x, algo, self.timeout_ns,
                                self._err_host, residual=residual, residual_out=residual_out, weight=weight,
                                normed=normed, eps=eps, island=self.island)

    @property
    def algos(self) -> tuple:
        """The P2P algorithms this group can run (two-level only on a topology of equal islands)."""
        return ("oneshot", "twoshot") + (("twolevel",) if self.island else ())

    def _check_ready(self):
        if not self.p2p_ok:
            raise RuntimeError("P2PAllReduce: peer-to-peer access is missing between some ranks; use NCCL")

    def close(self):
        """Release the IPC mappings and buffers (only when no captured graph uses them any more)."""
        rt = self._cp.cuda.runtime
        if getattr(self, "_stop", None) is not None:
            self._stop.set()
        for p in self._opened:
            rt.ipcCloseMemHandle(p)
        self._opened = []
        if self.base:
            rt.free(self.base)
            self.base = 0
        if self._err_host:
            rt.freeHost(self._err_host)
            self._err_host = 0


def measure_table(comm_nccl, ar: P2PAllReduce, rows: Sequence[int], H: int = 7168, calls: int = 20,
                  reps: int = 5, algos: Optional[Sequence[str]] = None) -> CalibrationTable:
    """Start-up calibration: in-graph time per call of each algorithm at each payload of ``rows`` x H bf16,
    rank 0's measurement broadcast (every rank must choose the same)."""
    import cupy as cp
    algos = ("nccl",) + ar.algos if algos is None else tuple(algos)
    stream = cp.cuda.Stream(non_blocking=True)
    rows = sorted(set(int(r) for r in rows if r * H <= ar.cap or "nccl" in algos))
    times = {a: [] for a in algos}
    keep = []
    with stream:
        for T in rows:
            x = cp.asarray(np.random.default_rng(comm_nccl.rank + T).integers(0, 1 << 14, (T, H)).astype(np.uint16))
            for a in algos:
                if a != "nccl" and T * H > ar.cap:
                    times[a].append(None)
                    continue
                fn = (lambda: comm_nccl.all_reduce(x)) if a == "nccl" else (lambda: ar.all_reduce(x, a))
                fn()
                stream.synchronize()
                comm_nccl.barrier()
                stream.begin_capture()
                for _ in range(calls):
                    fn()
                g = stream.end_capture()
                keep.append(g)
                g.launch(stream)
                stream.synchronize()
                comm_nccl.barrier()
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(stream)
                for _ in range(reps):
                    g.launch(stream)
                e1.record(stream)
                e1.synchronize()
                times[a].append(cp.cuda.get_elapsed_time(e0, e1) * 1000 / (reps * calls))
    table = CalibrationTable(comm_nccl.size, [T * H * 2 for T in rows], times, source="start-up calibration",
                             cap_bytes=ar.cap * 2)
    return table_from_json(comm_nccl.broadcast_obj(table.to_json(), root=0), source="start-up calibration")


class CustomComm:
    """A ``dist.Communicator``: NCCL for everything, the P2P all-reduce where ``table`` says it is faster.

    Built by ``make_custom_comm``; ``mode`` 'custom' forces the custom kernels for every payload that fits
    (one-shot up to ``oneshot_max_bytes``, else two-shot) -- the tests and benchmarks use it."""
    backend = "nccl+p2p"

    def __init__(self, nccl, ar: P2PAllReduce, table: Optional[CalibrationTable], mode: str = "auto",
                 oneshot_max_bytes: int = 256 * 1024):
        if mode not in ("auto", "custom", "nccl"):
            raise ValueError(f"CustomComm: mode must be auto, custom or nccl, got {mode!r}")
        self.nccl, self.ar, self.table, self.mode = nccl, ar, table, mode
        self.rank, self.size = nccl.rank, nccl.size
        self.oneshot_max_bytes = int(oneshot_max_bytes)
        self.counts = {a: 0 for a in ALL_ALGOS}
        self.fused_calls = 0

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def choose(self, nbytes: int) -> str:
        if self.mode == "nccl" or not self.ar.p2p_ok or nbytes > self.ar.cap * 2:
            return "nccl"
        if self.mode == "custom":
            return "oneshot" if nbytes <= self.oneshot_max_bytes else "twoshot"
        if self.table is None:
            return "nccl"
        return self.table.choose(nbytes, cap_bytes=self.ar.cap * 2, allowed=("nccl",) + tuple(self.ar.algos))

    def all_reduce(self, x):
        a = self.choose(int(x.nbytes)) if x.dtype == np.uint16 and x.flags.c_contiguous and x.size % 8 == 0 \
            else "nccl"
        self.counts[a] += 1
        if a == "nccl":
            return self.nccl.all_reduce(x)
        return self.ar.all_reduce(x, a)

    def all_reduce_add_norm(self, x, residual, weight, eps: float, normed, residual_out=None):
        """residual(_out) = bf16(sum over ranks of x [T, H] + residual); normed = RMSNorm(weight) of it. One
        fused launch on the P2P path (x left as it is); all-reduce of x in place + ``rms_norm(residual=...)``
        where NCCL is chosen. Callers must not read x afterwards."""
        a = self.choose(int(x.nbytes))
        self.counts[a] += 1
        if a == "nccl":
            from ..kernels.layers import rms_norm
            self.nccl.all_reduce(x)
            return rms_norm(x, weight, eps, out=normed, residual=residual, residual_out=residual_out)
        self.fused_calls += 1
        self.ar.all_reduce_add_norm(x, residual, weight, eps, normed, algo=a, residual_out=residual_out)
        return normed

    # everything else is NCCL's / the control plane's
    def all_gather(self, x):
        return self.nccl.all_gather(x)

    def all_gather_into(self, x, out):
        return self.nccl.all_gather_into(x, out)

    def broadcast_obj(self, obj, root=0):
        return self.nccl.broadcast_obj(obj, root)

    def all_gather_obj(self, obj):
        return self.nccl.all_gather_obj(obj)

    def barrier(self):
        self.nccl.barrier()

    def abort(self, message: str, code: int = 1) -> None:
        self.nccl.abort(message, code)

    def describe(self) -> str:
        t = self.table
        cross = ", ".join(f"{c['algo']} from {c['bytes'] // 1024} KB" for c in t.crossovers()) if t else "no table"
        isl = f"islands of {self.ar.island}" if self.ar.island else "one island"
        return (f"all-reduce: {self.mode}, P2P {'yes' if self.ar.p2p_ok else 'no'} across {self.size} ranks "
                f"({isl}), buffers {self.ar.cap * 2 // 1024} KB, {cross}")


def make_custom_comm(nccl, cap: int, mode: Optional[str] = None, table_path: Optional[str] = None,
                     calibrate_rows: Sequence[int] = (1, 8, 16, 32, 64, 128, 160, 320), H: int = 7168):
    """The engine's communicator for TP > 1 on GPUs: ``CustomComm`` when every pair has P2P, else ``nccl``
    itself, with one notice saying so. ``mode`` (default ``DDT_ALLREDUCE``, else ``DEFAULT_MODE``): 'auto'
    picks per payload from ``table_path`` (default ``DDT_ALLREDUCE_TABLE``: bench/allreduce.py --json output)
    or, without one, from a start-up calibration; 'custom' always the P2P kernels; 'nccl' never."""
    mode = mode or knobs.get().allreduce or DEFAULT_MODE
    if mode not in ("auto", "custom", "nccl"):
        raise ValueError(f"DDT_ALLREDUCE: must be auto, custom or nccl, got {mode!r}")
    if mode == "nccl" or nccl.size == 1:
        return nccl
    ar = P2PAllReduce(nccl, cap)
    if not ar.p2p_ok:
        bad = [(i, j) for i, r in enumerate(ar.matrix) for j, ok in enumerate(r) if not ok]
        notice_once("no-p2p", f"all-reduce: no peer-to-peer access between GPU pairs (rank pairs {bad[:6]}"
                              f"{' ...' if len(bad) > 6 else ''}); using NCCL for every collective", nccl.rank)
        return nccl
    table = None
    if mode == "auto":
        table_path = table_path or knobs.get().allreduce_table or None
        if table_path:
            table = table_from_json(nccl.broadcast_obj(load_table(table_path).to_json() if nccl.rank == 0 else None),
                                    source=table_path)
            if table.ranks != nccl.size:
                raise ValueError(f"{table_path}: calibrated for {table.ranks} ranks, this job has {nccl.size}")
        else:
            table = measure_table(nccl, ar, [r for r in calibrate_rows if r * H <= cap], H=H)
    comm = CustomComm(nccl, ar, table, mode=mode)
    notice_once("p2p", comm.describe(), nccl.rank)
    return comm
