"""Exact token sampling with temperature / top-k / top-p over the whole vocabulary (cuda_src/sample.cu).

    ids = sample(logits [T, V] f32|bf16, temperature f32 [T], top_k i32 [T], top_p f32 [T], seeds u64 [T],
                 steps i64 [T], out=i32 [T])

Per row: temperature <= 0 gives the argmax (lowest id on ties); otherwise the token
``reference.ddtree.sample_from_logits(row, u, temperature, top_p, top_k)`` returns for the uniform
``u = reference.ddtree.philox_uniform(seeds[row], steps[row])``: softmax(logits / T) sorted by probability
(ties: lower id), the first top_k kept (0 or >= V: all), then the shortest head reaching top_p of the kept
mass, then inverse-CDF. No candidate cap: any top-k, any nucleus width, V up to 2^31 - 1. Probabilities are
weighed in 2^-40 fixed point relative to the row's maximum (exact, order-independent sums), so the result is
the same on every run, grid and tensor-parallel rank, and a sampled GPU run is replayed token for token by the
reference (up to float rounding exactly at a boundary). All parameters live in device arrays, so a captured
graph is reused across steps by overwriting them.
"""
from __future__ import annotations

import numpy as np

from .checks import check_array
from .compile import KernelSpec, get_kernel, register

SPEC = register(KernelSpec("sample.cu", ("sample_exact<float>", "sample_exact<bf16_bits>"),
                           hot=True, doc="exact temperature/top-k/top-p sampling, Philox4x32-10"))
THREADS = 512


def sample(logits, temperature, top_k, top_p, seeds, steps, out=None):
    import cupy
    dims = {}
    if getattr(logits, "dtype", None) == np.uint16:
        check_array("logits", logits, np.uint16, ("T", "V"), dims)
        name = "sample_exact<bf16_bits>"
    else:
        check_array("logits", logits, np.float32, ("T", "V"), dims)
        name = "sample_exact<float>"
    T, V = dims["T"], dims["V"]
    if V >= 2 ** 31:
        raise ValueError(f"logits: vocabulary of {V} ids exceeds int32 ids")
    check_array("temperature", temperature, np.float32, ("T",), dims)
    check_array("top_k", top_k, np.int32, ("T",), dims)
    check_array("top_p", top_p, np.float32, ("T",), dims)
    check_array("seeds", seeds, np.uint64, ("T",), dims)
    check_array("steps", steps, np.int64, ("T",), dims)
    if out is None:
        out = cupy.empty((T,), dtype=np.int32)
    check_array("out", out, np.int32, ("T",), dims)
    if T == 0:
        return out
    k = get_kernel(SPEC, name)
    k((T,), (THREADS,), (logits, np.int64(logits.strides[0] // logits.itemsize), np.int32(V), temperature, top_k,
                         top_p, seeds, steps, out))
    return out
