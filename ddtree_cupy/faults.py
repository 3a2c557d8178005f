"""The fault model of a multi-rank run (launcher/README.md, "Fault model").

Every rank runs the same phases in the same order (``ddtree_cupy.run``: prepare, load, generate, end). A
phase ends at ONE agreement point, ``FaultGuard.agree(phase, problem, payload)``: a single object all-gather
that carries the phase name, this rank's problem (None when healthy) and whatever the phase reports (load
statistics). Collectives on the control path are therefore paired by construction: the gather of phase P
on one rank can only meet the gather of phase P on another, and a mismatch (a code path that skipped a
phase) is detected and ends the job instead of pairing two unrelated collectives.

What ends the job, and how:

* a problem inside a phase (bad input, a corrupt shard, any exception): the rank sends a fault notice to
  every other rank (a point-to-point message on a private communicator), then enters the agreement. A rank
  that receives a notice while still inside the phase (for instance blocked in a collective that the failed
  rank will never join) gets ``grace_s`` seconds to reach the agreement; if it does not, its watchdog
  thread ends the whole job with ``MPI_Abort``, printing the failed rank's message. Otherwise the agreement
  completes on every rank, rank 0 prints the first problem once, naming its rank, and every rank exits
  with that problem's code.
* SIGINT or SIGTERM on any rank: the signal's C handler wakes this rank's watchdog thread (through
  ``signal.set_wakeup_fd``; it runs even while the main thread is blocked inside an MPI or NCCL wait), which
  prints one line naming the rank and the signal and aborts the job (exit 130 / 143).
* an exception or ``sys.exit`` during generation (``guarded``): the rank prints its message and aborts the job.

The watchdog polls every ``POLL_S`` seconds; mpi4py releases the GIL inside blocking MPI calls, so it runs
while the main thread waits in a collective (MPI is initialised with MPI_THREAD_MULTIPLE, mpi4py's default).
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, List, Optional, Tuple

from . import knobs

FAULT_TAG = 0x7A17
ABORT_FORWARD_S = 0.25        # seconds between printing an abort's cause and MPI Abort (stderr forwarding)
POLL_S = 0.05
GRACE_S = 3.0
MAX_NOTICE = 4096
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class PhaseMismatch(RuntimeError):
    """Ranks met at agreement points of different phases: a control-path bug."""


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


class FaultGuard:
    """Agreement points, fault notices and the signal watchdog for one MPI job (see the module doc).

    ``comm``: an ``MPIComm`` or an ``NcclComm`` (whose host control plane, ``.mpi``, is used)."""

    def __init__(self, comm, grace_s: Optional[float] = None, install_signals: bool = True):
        mpi = getattr(comm, "mpi", comm)
        self._MPI = mpi._MPI
        self.rank, self.size = comm.rank, comm.size
        if grace_s is None:
            grace_s = knobs.get().fault_grace_s
        self.grace_s = float(GRACE_S if grace_s is None else grace_s)
        self._world = mpi.comm
        # A private communicator: fault notices can never match the engine's own messages. Dup is a
        # collective every rank calls here, at start-up, before anything can fail.
        self._chan = mpi.comm.Dup()
        self._buf = bytearray(MAX_NOTICE)
        self._status = self._MPI.Status()
        self._recv = self._chan.Irecv([self._buf, self._MPI.BYTE], source=self._MPI.ANY_SOURCE, tag=FAULT_TAG)
        self._sends: list = []
        self._notice_sent = False
        self._at_agreement = threading.Event()
        self._stop = threading.Event()
        self._aborting = threading.Lock()
        self._rfd = self._wfd = None
        self._old_handlers: dict = {}
        if install_signals and threading.current_thread() is threading.main_thread():
            self._rfd, self._wfd = os.pipe()
            os.set_blocking(self._rfd, False)
            os.set_blocking(self._wfd, False)
            self._old_wakeup = signal.set_wakeup_fd(self._wfd)
            for sig in EXIT_SIGNAL:
                # The Python-level handler does nothing: the watchdog, woken through the wakeup fd, ends the
                # job even when the main thread is blocked in C and would never run a Python handler.
                self._old_handlers[sig] = signal.signal(sig, lambda *_: None)
        self._thread = threading.Thread(target=self._watch, name="ddtree-fault-watchdog", daemon=True)
        self._thread.start()

    # ---- the job's end -------------------------------------------------------------------------------
    def abort(self, message: str, code: int) -> None:
        """Print ``message`` (one line per cause) and end every rank of the job with exit code ``code``."""
        with self._aborting:
            sys.stdout.flush()
            print(message, file=sys.stderr, flush=True)
            # the launcher forwards each rank's stderr through its own proxy; Abort tears the job down at
            # once, and under load the line could be lost on the way (seen on a 2-core machine): give the
            # proxy a moment to pass it on, so the job always names its cause
            time.sleep(ABORT_FORWARD_S)
            self._world.Abort(int(code) or 1)

    def _watch(self) -> None:
        while not self._stop.is_set():
            if self._rfd is not None:
                ready, _, _ = select.select([self._rfd], [], [], POLL_S)
                if ready:
                    try:
                        data = os.read(self._rfd, 64)
                    except BlockingIOError:
                        data = b""
                    sigs = [s for s in data if s in EXIT_SIGNAL]
                    if sigs:
                        self.abort(f"error on rank {self.rank}/{self.size}: interrupted by {_signal_name(sigs[0])}",
                                   EXIT_SIGNAL[sigs[0]])
            else:
                time.sleep(POLL_S)
            if self._recv is not None and self._recv.Test(self._status):
                n = self._status.Get_count(self._MPI.BYTE)
                code, _, msg = bytes(self._buf[:n]).decode("utf-8", "replace").partition("\n")
                self._recv = None
                self._on_notice(msg, int(code or 1))

    def _on_notice(self, msg: str, code: int) -> None:
        """Another rank failed inside a phase: it is waiting at the agreement point; so must this rank be,
        within the grace period, or it is stuck where the failed rank will never come."""
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if self._at_agreement.is_set():
                return
            time.sleep(POLL_S)
        if not self._stop.is_set() and not self._at_agreement.is_set():
            self.abort(f"{msg} (rank {self.rank} did not reach the agreement point within {self.grace_s:g} s: "
                       f"job aborted)", code)

    def notify(self, message: str, code: int) -> None:
        """Tell every other rank, without waiting for them, that this rank failed (once per job)."""
        if self._notice_sent or self.size == 1:
            return
        self._notice_sent = True
        data = f"{int(code)}\n{message}".encode("utf-8")[:MAX_NOTICE]
        for r in range(self.size):
            if r != self.rank:
                self._sends.append(self._chan.Isend([data, self._MPI.BYTE], dest=r, tag=FAULT_TAG))

    # ---- agreement points ----------------------------------------------------------------------------
    def agree(self, phase: str, problem: Optional[Tuple[int, str]] = None, payload: Any = None) -> List[Any]:
        """The one agreement point of ``phase``. ``problem``: (exit code, message) when this rank failed.

        Returns every rank's payload (rank order) when no rank failed; raises ``JobFailed`` carrying the first
        failed rank's problem otherwise (the same on every rank)."""
        if problem is not None:
            self.notify(f"{problem[1]} (on rank {self.rank} of {self.size})", problem[0])
        self._at_agreement.set()
        try:
            got = self._world.allgather((phase, problem, payload))
        finally:
            self._at_agreement.clear()
        phases = [g[0] for g in got]
        if any(p != phase for p in phases):
            self.abort(f"error on rank {self.rank}/{self.size}: ranks met at different agreement points "
                       f"{phases} (control-path bug)", 1)
            raise PhaseMismatch(str(phases))      # only reached with a fake communicator (tests)
        bad = [(r, g[1]) for r, g in enumerate(got) if g[1] is not None]
        if bad:
            r, (code, msg) = bad[0]
            raise JobFailed(code, msg, r, self.size)
        return [g[2] for g in got]

    def close(self) -> None:
        """Stop the watchdog and release the fault channel (before MPI is finalised at exit)."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        if self._recv is not None:
            self._recv.Cancel()
            self._recv.Wait()
            self._recv = None
        # Notices are a few bytes, sent eagerly: they complete at once. Never wait on one without a bound
        # (a receiver that already left would make that wait endless); leave any straggler to MPI.
        deadline = time.monotonic() + 1.0
        while self._sends and time.monotonic() < deadline:
            self._sends = [s for s in self._sends if not s.Test()]
            if self._sends:
                time.sleep(POLL_S)
        self._sends = []
        for sig, h in self._old_handlers.items():
            signal.signal(sig, h)
        if self._wfd is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            os.close(self._rfd)
            os.close(self._wfd)
            self._rfd = self._wfd = None
        self._chan.Free()


class JobFailed(Exception):
    """A rank reported a problem at an agreement point: every rank raises the same one."""

    def __init__(self, code: int, message: str, rank: int, size: int):
        super().__init__(message)
        self.code, self.message, self.rank, self.size = int(code), message, rank, size

    def report(self) -> str:
        return f"{self.message} (on rank {self.rank} of {self.size})"


def run_phase(fn: Callable[[], Any], classify: Callable[[BaseException], Tuple[int, str]]):
    """Run a phase body; returns (result, None) or (None, (exit code, message)) for ANY exception,
    ``sys.exit`` included (a rank must never leave the job on its own between agreement points)."""
    try:
        return fn(), None
    except BaseException as e:  # noqa: BLE001 - every way out of a phase must reach the agreement point
        if knobs.get().traceback:
            traceback.print_exc()
        return None, classify(e)
