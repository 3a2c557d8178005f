"""Token sampling with temperature / top-k / top-p, reproducible per stream (cuda_src/sample.cu).

    ids = sample(logits [T, V], temperature f32 [T], top_k i32 [T], top_p f32 [T], seeds u64 [T],
                 steps i64 [T], out=i32 [T], k_max=64)

Per row (one row = one stream's position): temperature <= 0 gives the argmax; top_k == 0 and top_p >= 1
sample the full softmax(logits / temperature) exactly (Gumbel-max over every id); otherwise the first
min(top_k, k_max) candidates (k_max when top_k == 0), cut at the smallest prefix reaching top_p mass,
renormalised. Randomness: Philox4x32-10 keyed by seeds[row], counter (id, 0, step) / (~0, 1, step): the
same (seed, step, logits) always gives the same token. All parameters live in device arrays so a
captured graph is reused across steps by overwriting them.
"""
from __future__ import annotations

import math

import numpy as np

from .checks import check_array, check_range
from .compile import KernelSpec, get_kernel, register
from . import topk as _topk

SPEC = register(KernelSpec("sample.cu", ("sample_stats<float>", "sample_stats<bf16_bits>", "sample_pick"),
                           hot=True, doc="temperature/top-k/top-p sampling, Philox4x32-10"))
THREADS = 256
CHUNK = 4096


class SampleBuffers:
    """Everything ``sample`` needs besides its inputs, allocated once (before graph capture)."""

    def __init__(self, T: int, V: int, k_max: int):
        import cupy
        k = min(k_max, V)
        self.k = k
        self.n_chunks = math.ceil(V / CHUNK)
        self.stats = cupy.empty((T, self.n_chunks, 4), dtype=np.float32)
        self.cand_vals = cupy.empty((T, k), dtype=np.float32)
        self.cand_ids = cupy.empty((T, k), dtype=np.int32)
        self.topk_ws = _topk.topk_workspace(T, V, k)


def sample(logits, temperature, top_k, top_p, seeds, steps, out=None, *, k_max: int = 64, buffers=None):
    import cupy
    dims = {}
    if getattr(logits, "dtype", None) == np.uint16:
        check_array("logits", logits, np.uint16, ("T", "V"), dims)
        name = "sample_stats<bf16_bits>"
    else:
        check_array("logits", logits, np.float32, ("T", "V"), dims)
        name = "sample_stats<float>"
    T, V = dims["T"], dims["V"]
    check_array("temperature", temperature, np.float32, ("T",), dims)
    check_array("top_k", top_k, np.int32, ("T",), dims)
    check_array("top_p", top_p, np.float32, ("T",), dims)
    check_array("seeds", seeds, np.uint64, ("T",), dims)
    check_array("steps", steps, np.int64, ("T",), dims)
    check_range("k_max", k_max, 1, _topk.MAX_K)
    if out is None:
        out = cupy.empty((T,), dtype=np.int32)
    check_array("out", out, np.int32, ("T",), dims)
    b = buffers if buffers is not None else SampleBuffers(T, V, k_max)
    if b.stats.shape[:2] != (T, math.ceil(V / CHUNK)) or b.k != min(k_max, V):
        raise ValueError(f"buffers: allocated for another shape (need T={T}, V={V}, k_max={k_max})")
    if T == 0:
        return out
    _topk.topk(logits, b.k, b.cand_vals, b.cand_ids, workspace=b.topk_ws)
    k1 = get_kernel(SPEC, name)
    k1((b.n_chunks, T), (THREADS,), (logits, np.int64(V), np.int32(V), np.int32(CHUNK), temperature, seeds, steps,
                                     b.stats))
    k2 = get_kernel(SPEC, "sample_pick")
    k2((T,), (32,), (b.stats, np.int32(b.n_chunks), b.cand_vals, b.cand_ids, np.int32(b.k), temperature, top_k,
                     top_p, seeds, steps, out))
    return out
