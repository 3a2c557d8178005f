"""``TargetBatch``: the static device buffers of one captured target-forward shape (docs/CONTRACTS.md).

S stream slots x R rows per slot (tree rows incl. the root; 1 for decode; the chunk length for a prefill
chunk); T = S * R and row r of slot b is row b * R + r in every per-row buffer. The buffers are allocated
once; the engine (or an earlier kernel of the same captured step) overwrites their contents in place
before each replay, so a CUDA graph captured over ``GpuTarget.forward(batch, kv)`` stays valid.

Slot b of a batch uses row b of the KV cache's block table (``GpuLatentCache.block_table``): the engine
keeps batch slots and KV-pool slots the same (a bucket of S streams uses slots 0..S-1).

Rows that carry nothing (rows r >= n_rows[b], every row of an idle slot with n_rows[b] = 0) must have
kv_pos = -1: nothing is written to the cache for them and attention skips them. They still flow through
the row-wise GEMMs, norms and the MoE (extra work on finite values, no effect on real rows).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..config import TargetConfig
from ..reference.ddtree import pack_mask

MASK_WORDS = 5          # DDT_MASK_WORDS in cuda_src/common.cuh
MAX_TREE_ROWS = 129     # root + budget <= 128


class TargetBatch:
    """Static per-shape input/output buffers of the target forward.

    tokens int32 [T], positions int32 [T], kv_pos int32 [T] (-1 = padding), stream_ids int32 [T],
    prefix_len int32 [S], n_rows int32 [S], row_start int32 [S] (= b * R, fixed), mask uint32 [S, R, 5]
    or None (causal within a slot's rows), logits float32 [T, V / tp], features uint16 [T, n_feat, H].

    ``max_kv_len``: the bucket's bound on prefix_len[b] + n_rows[b] (fixes the attention grid and split
    count); None = the whole per-stream capacity of the KV cache the batch runs against.
    """

    def __init__(self, S: int, R: int, cfg: TargetConfig, tp: int = 1, n_feat: int = 0, tree: bool = False,
                 max_kv_len: Optional[int] = None):
        import cupy
        for name, v, lo in (("S", S, 1), ("R", R, 1), ("tp", tp, 1), ("n_feat", n_feat, 0)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
                raise ValueError(f"TargetBatch: {name} must be an integer >= {lo}, got {v!r}")
        if not isinstance(cfg, TargetConfig):
            raise ValueError(f"TargetBatch: cfg must be a TargetConfig, got {type(cfg).__name__}")
        cfg.validate_tp(tp)
        if tree and R > MAX_TREE_ROWS:
            raise ValueError(f"TargetBatch: a tree batch has at most {MAX_TREE_ROWS} rows per slot, got R={R}")
        if max_kv_len is not None and (not isinstance(max_kv_len, (int, np.integer)) or max_kv_len < R):
            raise ValueError(f"TargetBatch: max_kv_len must be an integer >= R ({R}) or None, got {max_kv_len!r}")
        self.S, self.R, self.T = int(S), int(R), int(S) * int(R)
        self.cfg, self.tp, self.n_feat, self.tree = cfg, int(tp), int(n_feat), bool(tree)
        self.max_kv_len = None if max_kv_len is None else int(max_kv_len)
        T, H = self.T, cfg.hidden_size
        i32 = np.int32
        self.tokens = cupy.zeros(T, i32)
        self.positions = cupy.zeros(T, i32)
        self.kv_pos = cupy.full(T, -1, i32)
        self.stream_ids = cupy.asarray(np.repeat(np.arange(S, dtype=i32), R))
        self.prefix_len = cupy.zeros(S, i32)
        self.n_rows = cupy.zeros(S, i32)
        self.row_start = cupy.asarray(np.arange(S, dtype=i32) * R)
        self.mask = cupy.zeros((S, R, MASK_WORDS), np.uint32) if tree else None
        self.logits = cupy.zeros((T, cfg.vocab_size // tp), np.float32)
        self.features = cupy.zeros((T, n_feat, H), np.uint16)

    # ---- host-side filling (tests, prefill setup; the decode loop writes the buffers on the device) ----
    def set(self, *, tokens, positions, n_rows, prefix_len, kv_pos=None, mask=None) -> None:
        """Copy host inputs into the buffers (host->device copies: not for use inside graph capture).
        Arguments as ``prepare_inputs``."""
        h = prepare_inputs(self.S, self.R, self.cfg.vocab_size, self.tree, self.max_kv_len, tokens=tokens,
                           positions=positions, n_rows=n_rows, prefix_len=prefix_len, kv_pos=kv_pos, mask=mask)
        if self.tree:
            self.mask.set(h["mask"])
        for k in ("tokens", "positions", "kv_pos", "n_rows", "prefix_len"):
            getattr(self, k).set(h[k])

    def nbytes(self) -> int:
        arrs = [self.tokens, self.positions, self.kv_pos, self.stream_ids, self.prefix_len, self.n_rows,
                self.row_start, self.logits, self.features] + ([self.mask] if self.mask is not None else [])
        return sum(int(a.nbytes) for a in arrs)



def _int_array(name, a, shape):
    a = np.asarray(a)
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"TargetBatch.set: {name} must be an integer array, got {a.dtype}")
    if a.ndim == 1 and len(shape) == 2 and a.size == shape[0] * shape[1]:
        a = a.reshape(shape)
    if a.shape != tuple(shape):
        raise ValueError(f"TargetBatch.set: {name} has shape {a.shape}, expected {tuple(shape)}")
    return np.ascontiguousarray(a, dtype=np.int32)


def prepare_inputs(S: int, R: int, vocab_size: int, tree: bool, max_kv_len: Optional[int], *, tokens, positions,
                   n_rows, prefix_len, kv_pos=None, mask=None) -> dict:
    """Check host inputs of a batch and flatten them to the device layout (host only; what ``set`` copies).

    tokens / positions: int [S, R] (or [S * R]); n_rows, prefix_len: int [S]; kv_pos: int [S, R] (default:
    prefix_len[b] + r for r < n_rows[b], -1 elsewhere; must be -1 on padding rows); mask: bool [S, R, R]
    (row i sees row j) or packed uint32 [S, R, 5], required for a tree batch and refused for a causal one.
    Returns {tokens, positions, kv_pos: int32 [S * R], n_rows, prefix_len: int32 [S], mask: uint32 or None}.
    """
    n_rows = _int_array("n_rows", n_rows, (S,))
    prefix_len = _int_array("prefix_len", prefix_len, (S,))
    if (n_rows < 0).any() or (n_rows > R).any():
        raise ValueError(f"TargetBatch.set: n_rows must lie in [0, {R}], got {n_rows.tolist()}")
    if (prefix_len < 0).any():
        raise ValueError(f"TargetBatch.set: prefix_len must be >= 0, got {prefix_len.tolist()}")
    tokens = _int_array("tokens", tokens, (S, R))
    positions = _int_array("positions", positions, (S, R))
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"TargetBatch.set: tokens must lie in [0, {vocab_size}), got range "
                         f"[{tokens.min()}, {tokens.max()}]")
    if positions.min() < 0:
        raise ValueError(f"TargetBatch.set: positions must be >= 0, got min {positions.min()}")
    used = np.arange(R)[None, :] < n_rows[:, None]
    if kv_pos is None:
        kv_pos = np.where(used, prefix_len[:, None] + np.arange(R)[None, :], -1).astype(np.int32)
    else:
        kv_pos = _int_array("kv_pos", kv_pos, (S, R))
        if (kv_pos[~used] != -1).any():
            raise ValueError("TargetBatch.set: kv_pos must be -1 on rows r >= n_rows[b] (padding)")
        if (kv_pos[used] < 0).any():
            raise ValueError("TargetBatch.set: kv_pos must be >= 0 on the rows in use")
    if max_kv_len is not None and (prefix_len + n_rows > max_kv_len).any():
        raise ValueError(f"TargetBatch.set: prefix_len + n_rows = {(prefix_len + n_rows).tolist()} exceeds "
                         f"max_kv_len = {max_kv_len}")
    packed = None
    if tree:
        if mask is None:
            raise ValueError("TargetBatch.set: mask is required for a tree batch")
        mask = np.asarray(mask)
        if mask.dtype == np.bool_ and mask.shape == (S, R, R):
            packed = np.stack([pack_mask(m) for m in mask])
        elif mask.dtype == np.uint32 and mask.shape == (S, R, MASK_WORDS):
            packed = np.ascontiguousarray(mask)
        else:
            raise ValueError(f"TargetBatch.set: mask must be bool [{S}, {R}, {R}] or uint32 "
                             f"[{S}, {R}, {MASK_WORDS}], got {mask.dtype} {mask.shape}")
    elif mask is not None:
        raise ValueError("TargetBatch.set: mask given for a causal batch (built with tree=False)")
    return {"tokens": tokens.reshape(-1), "positions": positions.reshape(-1), "kv_pos": kv_pos.reshape(-1),
            "n_rows": n_rows, "prefix_len": prefix_len, "mask": packed}
