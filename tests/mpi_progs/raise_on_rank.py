"""Run under mpirun: rank 1 raises while the others wait in a collective; all must exit promptly."""
import sys

from ddtree_cupy.dist import guarded, init_communicator

c = init_communicator("numpy")


def main():
    if c.rank == 1:
        raise ValueError("deliberate failure on rank one")
    c.barrier()   # without the abort, these ranks would wait here forever
    return 0


sys.exit(guarded(main, c))
