"""Run under mpirun: each rank holds an object, prints, ends through dist.end_job; nothing after it runs."""
import sys

from ddtree_cupy.dist import _HELD, MPIComm, end_job, hold_until_exit, init_communicator

c = init_communicator("numpy")
assert isinstance(c, MPIComm), type(c)
held = hold_until_exit(object())
assert _HELD[-1] is held
print(f"rank {c.rank}/{c.size} before end_job", flush=False)      # end_job must flush this
sys.stdout.write("unflushed tail\n")
end_job(0)
print(f"rank {c.rank} AFTER end_job", flush=True)
