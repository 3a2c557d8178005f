"""Run under mpirun: the fault model's cases, chosen by argv[1] (tests/test_faults.py).

  stuck   rank 1 fails inside a phase; rank 0 is blocked in a collective rank 1 never joins
  agree   rank 1 fails inside a phase; every rank reaches the agreement point
  exit    rank 1 calls sys.exit(0) in the middle of generation; rank 0 waits in a collective
  signal  every rank waits in a collective; the test sends SIGTERM to rank 1 (pids printed on stdout)
"""
import os
import sys
import time

from ddtree_cupy.dist import guarded, init_communicator
from ddtree_cupy.faults import FaultGuard, JobFailed, run_phase

case = sys.argv[1]
c = init_communicator("numpy")
g = FaultGuard(c, grace_s=1.0)


def classify(e):
    return 2, f"error: {e}"


def body():
    if c.rank == 1:
        raise ValueError("deliberate failure in the load phase")
    if case == "stuck":
        c.barrier()             # rank 1 never comes: only the fault notice can end this
    return 0


try:
    if case in ("stuck", "agree"):
        _, problem = run_phase(body, classify)
        g.agree("load", problem)
        rc = 0
    elif case == "exit":
        def gen():
            if c.rank == 1:
                sys.exit(0)
            c.barrier()
            return 0
        rc = guarded(gen, c)
    else:
        print(f"pid {c.rank} {os.getpid()} ", flush=True)
        c.barrier()             # everyone is up
        while True:
            c.barrier()
            time.sleep(0.01)
except JobFailed as f:
    if c.rank == 0:
        print(f.report(), file=sys.stderr, flush=True)
    rc = f.code
finally:
    g.close()
sys.exit(rc)
