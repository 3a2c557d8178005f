"""Tensor-parallel communicators: one interface, three implementations.

* ``SingleRank``  -- TP = 1: every collective is the identity. The engine always talks to a communicator,
  so TP = 1 is simply a group of one and no code path is special-cased.
* ``MPIComm``     -- numpy arrays over mpi4py (the numpy backend under ``mpirun``).
* ``NcclComm``    -- CuPy arrays over NCCL (``cupy.cuda.nccl``), bootstrapped over MPI: rank 0 creates the
  unique id and broadcasts it. Collectives are issued on the current CuPy stream, so they can be captured
  in a CUDA graph as long as every rank captures the same sequence.

``init_communicator(backend)`` picks the right one from the environment (an MPI launch is detected from
the launcher's variables, so a plain ``python -m ddtree_cupy.run`` never needs mpi4py).

``guarded(fn)`` is the failure policy inside a phase that has no agreement point (generation): an exception
or ``sys.exit`` on any rank prints that rank's error once and aborts the whole MPI job (``MPI_Abort``), so no
other rank hangs in a collective waiting for it. Agreement points, fault notices and signals: ``faults.py``.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any, Callable, Optional

import numpy as np

from . import knobs

# Launchers set one of these in every rank's environment (Open MPI, MPICH/Hydra, Intel MPI, Slurm PMI).
_WORLD_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


def mpi_library_name() -> str:
    try:
        from mpi4py import MPI
        return MPI.Get_library_version().splitlines()[0].strip()[:60]
    except Exception:          # noqa: BLE001 - only used inside an error message
        return "unknown MPI"


def launched_with_mpi() -> bool:
    return any(int(os.environ.get(v, "1") or 1) > 1 for v in _WORLD_SIZE_VARS)


class Communicator:
    """The collectives the engine uses. Arrays are reduced in place where the op allows it."""
    rank: int = 0
    size: int = 1
    backend: str = "single"

    def all_reduce(self, x):
        """Sum ``x`` over ranks, in place; returns ``x``."""
        raise NotImplementedError

    def all_gather(self, x):
        """Stack every rank's ``x`` (same shape on all ranks) along a new leading axis of length size."""
        raise NotImplementedError

    def broadcast_obj(self, obj: Any, root: int = 0) -> Any:
        """A picklable host object from ``root`` to every rank (requests, decisions, errors)."""
        raise NotImplementedError

    def all_gather_obj(self, obj: Any) -> list:
        """Every rank's picklable ``obj``, in rank order, on every rank (e.g. per-rank error reports)."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def abort(self, message: str, code: int = 1) -> None:
        """End every rank now. Prints ``message`` once (from the calling rank)."""
        print(message, file=sys.stderr, flush=True)
        os._exit(code)

    @property
    def is_root(self) -> bool:
        return self.rank == 0


class SingleRank(Communicator):
    backend = "single"

    def all_reduce(self, x):
        return x

    def all_gather(self, x):
        xp = _array_module(x)
        return xp.expand_dims(x, 0)

    def broadcast_obj(self, obj, root=0):
        return obj

    def all_gather_obj(self, obj):
        return [obj]

    def barrier(self):
        return None


class MPIComm(Communicator):
    """numpy collectives over mpi4py. bf16 (uint16) payloads are summed in fp32 and rounded back once."""
    backend = "mpi"

    def __init__(self, comm=None):
        from mpi4py import MPI
        self._MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        if not isinstance(x, np.ndarray) or not x.flags.c_contiguous:
            raise ValueError("MPIComm.all_reduce needs a C-contiguous numpy array")
        if x.dtype == np.uint16:   # bf16 bits: reduce in fp32, round once
            from .bf16 import bf16_bits_to_f32, to_bf16_bits
            f = bf16_bits_to_f32(x)
            self.comm.Allreduce(self._MPI.IN_PLACE, f, op=self._MPI.SUM)
            x[...] = to_bf16_bits(f)
            return x
        self.comm.Allreduce(self._MPI.IN_PLACE, x, op=self._MPI.SUM)
        return x

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x)
        out = np.empty((self.size,) + x.shape, dtype=x.dtype)
        self.comm.Allgather(x, out)
        return out

    def broadcast_obj(self, obj, root=0):
        return self.comm.bcast(obj, root=root)

    def all_gather_obj(self, obj):
        return self.comm.allgather(obj)

    def barrier(self):
        self.comm.Barrier()

    def abort(self, message: str, code: int = 1) -> None:
        from .faults import ABORT_FORWARD_S
        print(message, file=sys.stderr, flush=True)
        time.sleep(ABORT_FORWARD_S)           # let the launcher forward the line before the job is torn down
        self.comm.Abort(code)


class NcclComm(Communicator):
    """CuPy collectives over NCCL; the host-side control plane (objects, barrier, abort) stays on MPI."""
    backend = "nccl"

    _DTYPES = {np.dtype(np.float32): "NCCL_FLOAT32", np.dtype(np.float16): "NCCL_FLOAT16",
               np.dtype(np.uint16): "NCCL_BFLOAT16",   # bf16 stored as uint16
               np.dtype(np.int32): "NCCL_INT32", np.dtype(np.int64): "NCCL_INT64",
               np.dtype(np.float64): "NCCL_FLOAT64"}

    def __init__(self, mpi: Optional[Communicator] = None):
        """``mpi``: the host control plane (unique-id broadcast, objects, barrier, abort). Default: MPI
        under mpirun, else a single rank (a real one-rank NCCL communicator, e.g. to test graph capture)."""
        import cupy
        from cupy.cuda import nccl
        self._cp, self._nccl = cupy, nccl
        if mpi is None:
            mpi = MPIComm() if launched_with_mpi() else SingleRank()
        self.mpi = mpi
        self.rank, self.size = self.mpi.rank, self.mpi.size
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = self.mpi.broadcast_obj(uid, root=0)
        self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)

    @classmethod
    def single_process(cls) -> "NcclComm":
        """A one-rank NCCL communicator without MPI (tests: NCCL collectives inside a captured CUDA graph on a
        single GPU). The host-side control plane is SingleRank's."""
        return cls(SingleRank())

    def _dtype(self, x):
        name = self._DTYPES.get(np.dtype(x.dtype))
        if name is None:
            raise ValueError(f"NCCL collective: unsupported dtype {x.dtype}")
        return getattr(self._nccl, name)

    def all_reduce(self, x):
        if not x.flags.c_contiguous:
            raise ValueError("NcclComm.all_reduce needs a C-contiguous cupy array")
        stream = self._cp.cuda.get_current_stream()
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, self._dtype(x), self._nccl.NCCL_SUM, stream.ptr)
        return x

    def all_gather(self, x):
        x = self._cp.ascontiguousarray(x)
        return self.all_gather_into(x, self._cp.empty((self.size,) + x.shape, dtype=x.dtype))

    def all_gather_into(self, x, out):
        """All-gather into a caller-owned contiguous ``out`` [size, *x.shape] (a buffer a captured graph keeps)."""
        if not (x.flags.c_contiguous and out.flags.c_contiguous) or out.shape != (self.size,) + x.shape \
                or out.dtype != x.dtype:
            raise ValueError(f"NcclComm.all_gather_into: out must be a contiguous {(self.size,) + x.shape} "
                             f"{x.dtype} array, got {out.shape} {out.dtype}")
        stream = self._cp.cuda.get_current_stream()
        self.comm.allGather(x.data.ptr, out.data.ptr, x.size, self._dtype(x), stream.ptr)
        return out

    def broadcast_obj(self, obj, root=0):
        return self.mpi.broadcast_obj(obj, root)

    def all_gather_obj(self, obj):
        return self.mpi.all_gather_obj(obj)

    def barrier(self):
        self._cp.cuda.get_current_stream().synchronize()
        self.mpi.barrier()

    def abort(self, message: str, code: int = 1) -> None:
        self.mpi.abort(message, code)


def init_communicator(backend: str = "numpy") -> Communicator:
    """The communicator for this process: SingleRank unless launched by mpirun with several ranks."""
    if not launched_with_mpi():
        return SingleRank()
    try:
        mpi = MPIComm()
    except ImportError as e:
        raise RuntimeError("launched under mpirun with several ranks, but mpi4py is not installed "
                           "(pip install -e '.[mpi]')") from e
    if mpi.size == 1:
        # The launcher said several ranks but MPI formed a world of one: mpirun belongs to another MPI than
        # the one mpi4py loaded, and every process would silently run the whole model alone.
        want = max(int(os.environ.get(v, "1") or 1) for v in _WORLD_SIZE_VARS)
        raise RuntimeError(
            f"launched by mpirun with {want} ranks, but MPI sees a world of 1: this mpirun is not from the MPI "
            f"that mpi4py uses ({mpi_library_name()}); use that MPI's mpirun (launcher/README.md)")
    if backend == "cupy":
        import cupy
        ndev = cupy.cuda.runtime.getDeviceCount()
        local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("MPI_LOCALRANKID",
                    os.environ.get("PMI_LOCAL_RANK", mpi.rank))))
        cupy.cuda.Device(local % ndev).use()
        return NcclComm(mpi)
    return mpi


# Objects that must outlive every CUDA graph of the process (see end_job): never freed before it ends.
_HELD: list = []


def hold_until_exit(obj):
    """Keep ``obj`` (an NCCL communicator) alive until the process ends; returns it. See ``end_job``."""
    _HELD.append(obj)
    return obj


def end_job(rc: int = 0) -> None:
    """End this process now, cleanly for the MPI job: flush, let every rank get here, finalize MPI, exit.

    For programs that capture NCCL collectives in CUDA graphs (the benchmarks). Measured on 2 H200s (NCCL
    2.28.9, Open MPI 4.1.6): a process that frees its NCCL communicator while a CUDA graph holding one of its
    collectives still exists never ends -- NCCL waits for the graph to release the communicator, and at
    interpreter teardown (or when a function's locals die) nothing fixes the order; with the graph freed first,
    or with no teardown at all, it ends. So the benchmarks keep the communicator with ``hold_until_exit`` (their
    graphs die first, when ``main`` returns) and end through here, which skips the interpreter's teardown;
    finalizing MPI first keeps mpirun from reporting a rank that exited without finalizing.
    ``ddtree_cupy.run`` needs neither: its graphs belong to its engine and die with it, before the communicator."""
    sys.stdout.flush()
    sys.stderr.flush()
    if launched_with_mpi():
        if "cupy" in sys.modules:
            sys.modules["cupy"].cuda.runtime.deviceSynchronize()
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
        MPI.Finalize()
    os._exit(rc)


def guarded(fn: Callable[[], int], comm: Optional[Communicator] = None) -> int:
    """Run ``fn``; on an exception on this rank, report it once and end every rank (never a hang).

    With several ranks ``sys.exit`` inside ``fn`` is a fault too: one rank leaving on its own would leave
    the others waiting in their next collective forever (docs: launcher/README.md, "Fault model")."""
    try:
        return fn()
    except SystemExit as e:
        c = comm if comm is not None else (SingleRank() if not launched_with_mpi() else MPIComm())
        if c.size == 1:
            raise
        code = e.code if isinstance(e.code, int) and e.code else 1
        c.abort(f"error on rank {c.rank}/{c.size}: exited early (sys.exit({e.code!r})) while the other ranks "
                f"were still running", code)
        return code
    except BaseException as e:  # noqa: BLE001 - the whole point is to catch everything
        c = comm if comm is not None else (SingleRank() if not launched_with_mpi() else MPIComm())
        detail = "".join(traceback.format_exception(type(e), e, e.__traceback__)) if knobs.get().traceback else ""
        what = "interrupted (KeyboardInterrupt)" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        c.abort(f"{detail}error on rank {c.rank}/{c.size}: {what}", 130 if isinstance(e, KeyboardInterrupt) else 1)
        return 1


def _array_module(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy
    return cupy
