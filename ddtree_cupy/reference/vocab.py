"""Vocabulary-parallel embedding and output projection, shared by the target and the drafter.

Under tensor parallelism each rank holds rows [rank * V/tp, (rank + 1) * V/tp) of ``embed_tokens`` and
of ``lm_head``. Embedding: each rank looks up the tokens in its slice (zeros elsewhere), then one
all-reduce sums the slices. Projection: each rank computes its logit columns, then an all-gather
concatenates them, so every rank holds the same full logits and takes the same decisions.
With a single-rank communicator both are the plain dense operations.
"""
from __future__ import annotations

import numpy as np


def vocab_embed(table: np.ndarray, tokens, comm) -> np.ndarray:
    """Rows of ``table`` (this rank's [V/tp, H] slice) for ``tokens`` [T], summed over ranks -> [T, H]."""
    tokens = np.asarray(tokens)
    if comm.size == 1:
        return table[tokens]
    start = comm.rank * table.shape[0]
    mine = (tokens >= start) & (tokens < start + table.shape[0])
    h = np.where(mine[:, None], table[np.where(mine, tokens - start, 0)], 0).astype(table.dtype)
    return comm.all_reduce(np.ascontiguousarray(h))


def vocab_project(x: np.ndarray, head: np.ndarray, comm) -> np.ndarray:
    """Full logits [T, V] = x @ head^T with ``head`` this rank's [V/tp, H] slice, gathered over ranks."""
    local = x @ head.T
    if comm.size == 1:
        return local
    parts = comm.all_gather(np.ascontiguousarray(local))          # [tp, T, V/tp]
    return np.concatenate(list(parts), axis=-1)
