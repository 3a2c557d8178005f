"""Launch wrapper of the peer-to-peer all-reduce kernels (cuda_src/allreduce.cu; protocol in allreduce.cuh and
its numpy model ddtree_cupy/comm/protocol.py). ``comm.custom.P2PAllReduce`` owns the buffers and calls this.

One launch = one collective: every rank must launch the same kernel with the same payload size (so the
same grid) in the same order. The kernels start with DDT_PDL_WAIT() and trigger their dependents once every
peer has arrived, so they may be launched with PDL.
"""
from __future__ import annotations

import numpy as np

from ..comm import protocol as P
from .checks import check_array
from .compile import KernelSpec, get_kernel, register

AR_NAMES = tuple(f"p2p_allreduce_kernel<{a}, {f}>" for a in range(len(P.ALGOS)) for f in ("false", "true"))
ALLREDUCE_SPEC = register(KernelSpec("allreduce.cu", AR_NAMES, hot=True, pdl=True,
                                     doc="P2P all-reduce: one-shot / two-shot / two-level, fused residual add + RMSNorm"))


def _name(algo: str, fused: bool) -> str:
    if algo not in P.ALGOS:
        raise ValueError(f"algo: must be one of {P.ALGOS}, got {algo!r}")
    return f"p2p_allreduce_kernel<{P.ALGOS.index(algo)}, {'true' if fused else 'false'}>"


def launch_allreduce(peers, cap: int, rank: int, n: int, x, out, algo: str, timeout_ns: int, err_ptr: int,
                     *, residual=None, residual_out=None, weight=None, normed=None, eps: float = 1e-6,
                     island: int = 0):
    """One collective on the current stream. peers: uint64 [n] device array of every rank's buffer base
    (this rank's at ``rank``); x, out: bf16 (uint16) contiguous arrays of the same shape, N <= cap elements
    (out may be x). ``island``: two-level only, ranks per island (n a multiple of it, >= 2 islands).
    Fused (``residual`` given): x is [T, H] (left as it is: the sum itself is not stored), residual [T, H] is
    updated in place (or written to ``residual_out``), ``normed`` [T, H] = RMSNorm(weight [H]) of the new
    residual."""
    dims: dict = {}
    check_array("peers", peers, np.uint64, (n,))
    if not 1 <= n <= P.MAX_RANKS or not 0 <= rank < n:
        raise ValueError(f"rank / n: rank {rank} of {n} (1..{P.MAX_RANKS} ranks)")
    fused = residual is not None
    _name(algo, fused)
    if algo == "twolevel" and not (2 <= island < n and n % island == 0):
        raise ValueError(f"island: two-level needs islands of >= 2 ranks dividing n = {n} into >= 2, got {island}")
    if fused:
        check_array("x", x, np.uint16, ("T", "H"), dims)
        T, H = dims["T"], dims["H"]
        if H % 8 or H > P.MAX_FUSED_H:
            raise ValueError(f"x: row width H = {H} must be a multiple of 8 and <= {P.MAX_FUSED_H}")
        check_array("residual", residual, np.uint16, ("T", "H"), dims)
        residual_out = residual if residual_out is None else residual_out
        check_array("residual_out", residual_out, np.uint16, ("T", "H"), dims)
        check_array("weight", weight, np.uint16, ("H",), dims)
        check_array("normed", normed, np.uint16, ("T", "H"), dims)
        if not (isinstance(eps, float) and eps > 0):
            raise ValueError(f"eps: must be a positive float, got {eps!r}")
        unit = H
        out = x if out is None else out
    else:
        unit = P.PLAIN_UNIT
    check_array("x", x, np.uint16, (None,) * x.ndim)
    if out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
        raise ValueError(f"out: must be a contiguous {x.shape} uint16 array, got {out.shape} {out.dtype}")
    N = int(x.size)
    if N == 0:
        return out
    if N % 8:
        raise ValueError(f"x: {N} elements, must be a multiple of 8 (16-byte vectors)")
    if N >= 2 ** 31:
        raise ValueError(f"x: {N} elements; the kernels index vectors with 32-bit integers (< 2^31 elements)")
    if N > cap:
        raise ValueError(f"x: {N} elements exceed the all-reduce buffers' capacity of {cap}")
    grid = P.plan_grid(N, unit)
    z = np.uint64(0)
    k = get_kernel(ALLREDUCE_SPEC, _name(algo, fused))
    k((grid,), (P.THREADS,), (peers, np.int64(cap), np.int32(rank), np.int32(n), np.int32(island), x, out,
                              np.int64(N), np.int32(unit), residual if fused else z, residual_out if fused else z, weight if fused else z,
                              normed if fused else z, np.float32(eps), np.int64(timeout_ns), np.uint64(err_ptr)))
    return out
