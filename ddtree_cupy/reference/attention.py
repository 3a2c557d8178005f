"""float64 numpy references of the GPU attention kernels and KV cache operations (docs/ATTENTION.md).

Everything takes the same arrays as the kernels (bf16 as uint16 bit patterns, int32 tables, uint32 mask
bits) so tests can feed one set of inputs to both. Layouts follow docs/CONTRACTS.md:

* latent pool per layer uint16 [num_pages, 64, 576]; stream b's position p: page block_table[b, p // 64],
  row p % 64;
* tree mask uint32 [S, R, 5]: bit j of word j // 32 of row i <=> tree row j is visible to row i;
* query rows of stream b are rows row_start[b] .. row_start[b] + n_rows[b] - 1 of q [T, H, 576];
  their own KV sits at cache positions s .. s + n - 1 (s = prefix_len[b]).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..bf16 import bf16_bits_to_f32

PAGE_SIZE = 64
LATENT_DIM = 512
ROW_DIM = 576
MASK_WORDS = 5


def _f64(bits) -> np.ndarray:
    return bf16_bits_to_f32(np.asarray(bits)).astype(np.float64)


def ancestor_mask_bits(parents: Sequence[int], rows: Optional[int] = None) -> np.ndarray:
    """uint32 [rows, 5]: row i has bit j set iff j == i or j is an ancestor of i (parents[root] = -1,
    a parent precedes its child). Rows past len(parents) stay zero."""
    parents = np.asarray(parents, dtype=np.int64)
    n = len(parents)
    rows = n if rows is None else rows
    if n > 32 * MASK_WORDS or rows < n:
        raise ValueError(f"parents: {n} rows do not fit a [{rows}, {MASK_WORDS}] x 32-bit mask")
    out = np.zeros((rows, MASK_WORDS), np.uint32)
    for i in range(n):
        if parents[i] >= i:
            raise ValueError(f"parents: row {i} has parent {parents[i]}, parents must precede children")
        j = i
        while j >= 0:
            out[i, j // 32] |= np.uint32(1 << (j % 32))
            j = int(parents[j])
    return out


def mask_visible(mask_bits: np.ndarray, n: int) -> np.ndarray:
    """bool [n, n] from uint32 [>= n, 5] bits: visible[i, j] = bit j of row i."""
    j = np.arange(n)
    words = mask_bits[:n, j // 32]                                   # [n, n]
    return ((words >> (j % 32).astype(np.uint32)) & 1).astype(bool)


def paged_positions_to_rows(block_table_row: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Flat row indices into pool.reshape(-1, 576) for cache positions of one stream."""
    positions = np.asarray(positions, dtype=np.int64)
    pages = np.asarray(block_table_row, dtype=np.int64)[positions // PAGE_SIZE]
    if (pages < 0).any():
        raise ValueError("block_table: a position maps to an unassigned page (-1)")
    return pages * PAGE_SIZE + positions % PAGE_SIZE


def paged_gather(pool: np.ndarray, block_table_row: np.ndarray, length: int) -> np.ndarray:
    """float64 [length, 576]: the stream's cache positions 0 .. length-1."""
    rows = paged_positions_to_rows(block_table_row, np.arange(length))
    return _f64(pool.reshape(-1, pool.shape[-1])[rows])


def kv_write_latent_ref(pool: np.ndarray, block_table: np.ndarray, stream_ids, positions, rows) -> np.ndarray:
    """A copy of ``pool`` with rows[i] (uint16 [T, 576]) written at (stream_ids[i], positions[i]);
    negative positions are skipped."""
    out = pool.copy()
    flat = out.reshape(-1, pool.shape[-1])
    for i, (b, p) in enumerate(zip(np.asarray(stream_ids), np.asarray(positions))):
        if p < 0:
            continue
        flat[paged_positions_to_rows(block_table[b], np.array([p]))[0]] = rows[i]
    return out


def kv_compact_latent_ref(pool: np.ndarray, block_table: np.ndarray, prefix_len, n_accept, acc_rows) -> np.ndarray:
    """A copy of ``pool`` after the commit: per stream b, position s + acc_rows[b, j] -> s + j, for
    j = 1 .. n_accept[b] - 1 in ascending order (s = prefix_len[b])."""
    out = pool.copy()
    flat = out.reshape(-1, pool.shape[-1])
    for b in range(len(prefix_len)):
        s = int(prefix_len[b])
        for j in range(1, int(n_accept[b])):
            src, dst = paged_positions_to_rows(block_table[b], np.array([s + acc_rows[b, j], s + j]))
            flat[dst] = flat[src]
    return out


def mla_attention_ref(q: np.ndarray, pool: np.ndarray, block_table: np.ndarray, prefix_len, n_rows, row_start,
                      softmax_scale: float, mask: Optional[np.ndarray] = None) -> np.ndarray:
    """Absorbed MLA over the paged cache in float64: o_lat [T, H, 512]; rows no stream owns are NaN.

    Row i of stream b sees positions [0, s) and s + j for j with mask bit j of row i (tree mode) or
    j <= i (mask None: causal mode, used for decode, chains and prefill chunks)."""
    T, H, D = q.shape
    out = np.full((T, H, LATENT_DIM), np.nan)
    qf = _f64(q)
    for b in range(len(prefix_len)):
        s, n, r0 = int(prefix_len[b]), int(n_rows[b]), int(row_start[b])
        kv = paged_gather(pool, block_table[b], s + n)               # [s+n, 576]
        if mask is None:
            tree_vis = np.tril(np.ones((n, n), bool))
        else:
            tree_vis = mask_visible(mask[b], n)
        vis = np.concatenate([np.ones((n, s), bool), tree_vis], axis=1)   # [n, s+n]
        qs = qf[r0:r0 + n].reshape(n * H, D)                           # packed (row, head)
        scores = (qs @ kv.T).reshape(n, H, s + n) * softmax_scale
        scores = np.where(vis[:, None, :], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out[r0:r0 + n] = (p.reshape(n * H, s + n) @ kv[:, :LATENT_DIM]).reshape(n, H, LATENT_DIM)
    return out


def drafter_kv_append_ref(k_cache, v_cache, k, v, stream_ids, positions):
    """Copies of the drafter caches with row i at slot positions[i] % C of stream stream_ids[i]."""
    kc, vc = k_cache.copy(), v_cache.copy()
    C = kc.shape[1]
    for i, (b, p) in enumerate(zip(np.asarray(stream_ids), np.asarray(positions))):
        if p < 0:
            continue
        kc[b, p % C] = k[i]
        vc[b, p % C] = v[i]
    return kc, vc


def drafter_attention_ref(q, k_block, v_block, k_cache, v_cache, ctx_len, softmax_scale: float,
                          window: int = 0) -> np.ndarray:
    """DFlash drafter attention in float64: [S, BR, Hq, 128]. Every block row of stream b sees context
    positions [lo, len) (lo = max(0, len - window) if window else 0, slot p % C) and all BR block rows;
    query head h uses kv head h // (Hq / Hkv)."""
    S, BR, Hq, D = q.shape
    Hkv = k_block.shape[2]
    C = k_cache.shape[1]
    G = Hq // Hkv
    out = np.empty((S, BR, Hq, D))
    for b in range(S):
        L = int(ctx_len[b])
        lo = max(0, L - window) if window else 0
        slots = np.arange(lo, L) % C
        keys = np.concatenate([_f64(k_cache[b, slots]), _f64(k_block[b])], axis=0)   # [N, Hkv, D]
        vals = np.concatenate([_f64(v_cache[b, slots]), _f64(v_block[b])], axis=0)
        kh = np.repeat(keys, G, axis=1)                                 # [N, Hq, D]
        vh = np.repeat(vals, G, axis=1)
        scores = np.einsum("rhd,nhd->rhn", _f64(q[b]), kh) * softmax_scale
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out[b] = np.einsum("rhn,nhd->rhd", p, vh)
    return out
