"""Exact top-K / argmax over long rows (cuda_src/topk.cu), ties broken by the lowest id.

    vals, ids = topk(logits [T, V] fp32|bf16, K)              # values fp32 [T, K] descending, ids int32
    ids = argmax(logits)                                      # int32 [T]
    vals, ids = topk_merge(cand_vals [T, n], cand_ids [T, n], K)   # merge of shards' lists (global ids)

A vocabulary shard passes ``id_offset`` (its vocab_start) so its candidates carry global ids; after an
all-gather of every shard's [T, K] lists, ``topk_merge`` gives the global top-K. Buffers: pass ``out_vals``/
``out_ids`` and ``workspace`` (from ``topk_workspace``) to make the calls graph-capturable.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np

from .checks import check_array, check_range
from .compile import KernelSpec, get_kernel, register

THREADS = 256
MAX_K = 256
MAX_ITEMS = 8192        # items a block holds in shared memory (64 KB of keys)

SPEC = register(KernelSpec("topk.cu", ("topk_chunk<float>", "topk_chunk<bf16_bits>", "topk_merge"), hot=True,
                           doc="exact top-K / argmax, radix select on (value, ~id) keys"))


def _kpad(K: int) -> int:
    return 1 << max(0, (K - 1).bit_length())


def plan(V: int, K: int) -> Tuple[int, int]:
    """(chunk, n_chunks) for rows of V items: chunks fit a block's shared memory and the merged
    candidate list (n_chunks * K) fits one block too."""
    max_chunks = max(1, MAX_ITEMS // K)
    chunk = max(min(4096, V), math.ceil(V / max_chunks))
    if chunk > MAX_ITEMS:
        raise ValueError(f"logits: V = {V} too long for K = {K} (V * K must stay below {MAX_ITEMS ** 2})")
    return chunk, math.ceil(V / chunk)


def topk_workspace(T: int, V: int, K: int):
    """Preallocated stage-1 candidate buffers (vals, ids) for ``topk(..., workspace=)``."""
    import cupy
    _, n = plan(V, K)
    return cupy.empty((T, n * K), dtype=np.float32), cupy.empty((T, n * K), dtype=np.int32)


def _smem(items: int, K: int) -> int:
    return (items + _kpad(K)) * 8


def topk(logits, K: int, out_vals=None, out_ids=None, *, id_offset: int = 0, workspace=None):
    """Top-K per row of logits [T, V] (float32 or bf16 as uint16): values fp32 [T, K] descending, ids int32
    [T, K] (+ id_offset), ties to the lower id; rows shorter than K pad with (-inf, -1)."""
    import cupy
    dims = {}
    if getattr(logits, "dtype", None) == np.uint16:
        check_array("logits", logits, np.uint16, ("T", "V"), dims)
        name = "topk_chunk<bf16_bits>"
    else:
        check_array("logits", logits, np.float32, ("T", "V"), dims)
        name = "topk_chunk<float>"
    T, V = dims["T"], dims["V"]
    check_range("K", K, 1, MAX_K)
    check_range("V (logits.shape[1])", V, 1, 2**31 - 1)
    check_range("id_offset", id_offset, 0, 2**31 - 1 - V)
    chunk, n = plan(V, K)
    if out_vals is None:
        out_vals = cupy.empty((T, K), dtype=np.float32)
    if out_ids is None:
        out_ids = cupy.empty((T, K), dtype=np.int32)
    check_array("out_vals", out_vals, np.float32, (T, K))
    check_array("out_ids", out_ids, np.int32, (T, K))
    if T == 0:
        return out_vals, out_ids
    if n == 1:
        cv, ci = out_vals, out_ids
    else:
        cv, ci = workspace if workspace is not None else topk_workspace(T, V, K)
        check_array("workspace[0]", cv, np.float32, (T, n * K))
        check_array("workspace[1]", ci, np.int32, (T, n * K))
    smem = _smem(chunk, K)
    k1 = get_kernel(SPEC, name, max_dynamic_smem=smem)
    k1((n, T), (THREADS,), (logits, np.int64(V), np.int32(V), np.int32(chunk), np.int32(K), np.int32(_kpad(K)),
                            np.int32(id_offset), cv, ci), shared_mem=smem)
    if n > 1:
        _merge(cv, ci, K, out_vals, out_ids)
    return out_vals, out_ids


def _merge(cv, ci, K, out_vals, out_ids):
    T, n = cv.shape
    smem = _smem(n, K)
    k2 = get_kernel(SPEC, "topk_merge", max_dynamic_smem=smem)
    k2((T,), (THREADS,), (cv, ci, np.int32(n), np.int32(K), np.int32(_kpad(K)), out_vals, out_ids), shared_mem=smem)


def topk_merge(cand_vals, cand_ids, K: int, out_vals=None, out_ids=None):
    """Top-K of per-row candidate lists (e.g. every vocabulary shard's top-K, concatenated): cand_vals
    float32 [T, n], cand_ids int32 [T, n] (global ids; id < 0 marks padding)."""
    import cupy
    dims = {}
    check_array("cand_vals", cand_vals, np.float32, ("T", "n"), dims)
    check_array("cand_ids", cand_ids, np.int32, ("T", "n"), dims)
    check_range("K", K, 1, MAX_K)
    check_range("n (cand_vals.shape[1])", dims["n"], 1, MAX_ITEMS)
    T = dims["T"]
    if out_vals is None:
        out_vals = cupy.empty((T, K), dtype=np.float32)
    if out_ids is None:
        out_ids = cupy.empty((T, K), dtype=np.int32)
    check_array("out_vals", out_vals, np.float32, (T, K))
    check_array("out_ids", out_ids, np.int32, (T, K))
    if T:
        _merge(cand_vals, cand_ids, K, out_vals, out_ids)
    return out_vals, out_ids


def argmax(logits, out=None, *, id_offset: int = 0, workspace=None, out_vals=None):
    """Index of the largest value per row (lowest index on ties), int32 [T] (+ id_offset).
    ``out_vals`` (float32 [T, 1]) receives the maximum itself (useful for a cross-shard merge);
    ``workspace`` is ``topk_workspace(T, V, 1)``."""
    import cupy
    dims = {}
    check_array("logits", logits, np.uint16 if getattr(logits, "dtype", None) == np.uint16 else np.float32,
                ("T", "V"), dims)
    T = dims["T"]
    if out is None:
        out = cupy.empty((T,), dtype=np.int32)
    check_array("out", out, np.int32, (T,))
    if out_vals is None:
        out_vals = cupy.empty((T, 1), dtype=np.float32)
    topk(logits, 1, out_vals, out.reshape(T, 1), id_offset=id_offset, workspace=workspace)
    return out
