"""``RankComm``: one TP rank without peers, for rank-shape profiling and benchmarks on one GPU.

Rank ``rank`` of ``size`` builds exactly the shapes and kernels of a real rank; its collectives count calls
and bytes but move nothing: all-reduce is the identity, all-gather writes this rank's array into every part
of a preallocated [size, ...] buffer (graph-capturable: the buffer is allocated on the first, eager call and
reused by a captured graph). A step's collective cost enters only through models of it (bench/step.py's
projection) or a real multi-GPU run (``bench.step --comm nccl``).
"""
from __future__ import annotations


class RankComm:
    backend = "bench"

    def __init__(self, rank: int = 0, size: int = 8):
        if not isinstance(size, int) or size < 1 or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"RankComm: need 0 <= rank < size, got rank {rank!r} of {size!r}")
        self.rank, self.size = rank, size
        self.n_reduce = self.n_gather = self.reduce_bytes = 0
        self._bufs = {}

    def all_reduce(self, x):
        self.n_reduce += 1
        self.reduce_bytes += x.nbytes
        return x

    def all_gather(self, x):
        import cupy
        self.n_gather += 1
        key = (x.shape, x.dtype.str, x.data.ptr)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = cupy.empty((self.size,) + x.shape, x.dtype)
        cupy.copyto(buf, x[None])
        return buf

    def barrier(self):
        pass
