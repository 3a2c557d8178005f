"""Launch wrappers for cuda_src/engine_glue.cu: the decode step's small gathers/scatters between the tree
builder, the target batch, the walk and the drafter append (ddtree_cupy/engine/step.py). Every function
has a numpy twin (``*_ref``) that states its exact semantics; tests/gpu/test_engine.py compares them.

``ctrl`` is the per-step control block int32 [5, S] (api.py's CTRL_* rows: prefix_len, bonus, active,
budget, step; packed by engine/scheduler.py). Launches allocate nothing and never synchronise: graph-capturable.
"""
from __future__ import annotations

import numpy as np

from .checks import check_array, check_range, current_device
from .compile import KernelSpec, get_kernel, register

MAX_TREE_ROWS = 129
MASK_WORDS = 5
from ..api import CTRL_ACTIVE, CTRL_BONUS, CTRL_BUDGET, CTRL_FIELDS, CTRL_PREFIX, CTRL_STEP  # noqa: E402,F401

SPEC = register(KernelSpec(
    src="engine_glue.cu",
    names=("eg_root_tree", "eg_tree_to_batch", "eg_post_scatter", "eg_after_walk", "eg_sample_params",
           "eg_vocab_rows"),
    doc="decode-step glue: root trees, tree -> batch rows, per-row tokens -> walk layout, accepted features "
        "-> drafter append, packed step output, per-row sampling parameters, gathered vocabulary shards -> "
        "whole rows"))

_NULL = np.uint64(0)    # CuPy passes None as 0xffffffff: null pointers must be an explicit 0


def _k(name):
    return get_kernel(SPEC, name)


def _ctrl(ctrl, dims, dev):
    return check_array("ctrl", ctrl, np.int32, (CTRL_FIELDS, "S"), dims, device=dev)


# ---------------------------------------------------------------------------------------------------
def root_tree(ctrl, tokens, parents, depths, positions, n_rows, mask):
    """Root-only trees (autoregressive mode): row 0 = bonus at position prefix, n_rows = 1."""
    dims: dict = {}
    dev = current_device()
    _ctrl(ctrl, dims, dev)
    for nm, a in (("tokens", tokens), ("parents", parents), ("depths", depths), ("positions", positions)):
        check_array(nm, a, np.int32, ("S", MAX_TREE_ROWS), dims, device=dev)
    check_array("n_rows", n_rows, np.int32, ("S",), dims, device=dev)
    check_array("mask", mask, np.uint32, ("S", MAX_TREE_ROWS, MASK_WORDS), dims, device=dev)
    S = dims["S"]
    _k("eg_root_tree")((S,), (32,), (ctrl, np.int32(S), tokens, parents, depths, positions, n_rows, mask))


def root_tree_ref(ctrl, tokens, parents, depths, positions, n_rows, mask):
    tokens[:, 0] = ctrl[CTRL_BONUS]
    parents[:, 0] = -1
    depths[:, 0] = 0
    positions[:, 0] = ctrl[CTRL_PREFIX]
    n_rows[:] = 1
    mask[:, 0, :] = 0
    mask[:, 0, 0] = 1


# ---------------------------------------------------------------------------------------------------
def tree_to_batch(ctrl, R: int, tr_tokens, tr_positions, tr_n_rows, tr_mask, tokens, positions, kv_pos,
                  stream_ids, prefix_len, n_rows, row_start, mask=None):
    """Tree rows [S, 129] -> target batch rows [S * R] (+ per-slot prefix_len/n_rows/row_start, and the
    ancestor mask [S, R, 5] when ``mask`` is given)."""
    dims: dict = {}
    dev = current_device()
    _ctrl(ctrl, dims, dev)
    check_range("R", R, 1, MAX_TREE_ROWS)
    check_array("tr_tokens", tr_tokens, np.int32, ("S", MAX_TREE_ROWS), dims, device=dev)
    check_array("tr_positions", tr_positions, np.int32, ("S", MAX_TREE_ROWS), dims, device=dev)
    check_array("tr_n_rows", tr_n_rows, np.int32, ("S",), dims, device=dev)
    check_array("tr_mask", tr_mask, np.uint32, ("S", MAX_TREE_ROWS, MASK_WORDS), dims, device=dev)
    S = dims["S"]
    dims["T"] = S * R
    for nm, a in (("tokens", tokens), ("positions", positions), ("kv_pos", kv_pos), ("stream_ids", stream_ids)):
        check_array(nm, a, np.int32, ("T",), dims, device=dev)
    for nm, a in (("prefix_len", prefix_len), ("n_rows", n_rows), ("row_start", row_start)):
        check_array(nm, a, np.int32, ("S",), dims, device=dev)
    if mask is not None:
        check_array("mask", mask, np.uint32, ("S", R, MASK_WORDS), dims, device=dev)
    _k("eg_tree_to_batch")((S,), (128,), (ctrl, np.int32(S), np.int32(R), tr_tokens, tr_positions, tr_n_rows,
                                          tr_mask, tokens, positions, kv_pos, stream_ids, prefix_len, n_rows,
                                          row_start, mask if mask is not None else _NULL))


def tree_to_batch_ref(ctrl, R, tr_tokens, tr_positions, tr_n_rows, tr_mask):
    """numpy: returns dict of the outputs."""
    S = ctrl.shape[1]
    active = ctrl[CTRL_ACTIVE] != 0
    prefix = np.where(active, ctrl[CTRL_PREFIX], 0).astype(np.int32)
    n = np.where(active, np.clip(tr_n_rows, 0, R), 0).astype(np.int32)
    r = np.arange(R)
    out = {
        "tokens": np.where(active[:, None], tr_tokens[:, :R], 0).reshape(-1).astype(np.int32),
        "positions": np.where(active[:, None], tr_positions[:, :R], 0).reshape(-1).astype(np.int32),
        "kv_pos": np.where(r[None, :] < n[:, None], prefix[:, None] + r[None, :], -1).reshape(-1).astype(np.int32),
        "stream_ids": np.repeat(np.arange(S, dtype=np.int32), R),
        "prefix_len": prefix, "n_rows": n, "row_start": (np.arange(S) * R).astype(np.int32),
    }
    idle = np.zeros((R, MASK_WORDS), np.uint32)
    idle[:, 0] = 1
    idle[r, r // 32] |= (np.uint32(1) << (r % 32).astype(np.uint32))
    out["mask"] = np.where(active[:, None, None], tr_mask[:, :R, :], idle[None]).astype(np.uint32)
    return out


# ---------------------------------------------------------------------------------------------------
def post_scatter(ids, R: int, post):
    """Per-row tokens of the batch ids [S * R] -> post [S, 129] (rows >= R: -1)."""
    dims: dict = {}
    dev = current_device()
    check_array("post", post, np.int32, ("S", MAX_TREE_ROWS), dims, device=dev)
    check_range("R", R, 1, MAX_TREE_ROWS)
    check_array("ids", ids, np.int32, (dims["S"] * R,), dims, device=dev)
    S = dims["S"]
    _k("eg_post_scatter")((S,), (128,), (ids, np.int32(S), np.int32(R), post))


def post_scatter_ref(ids, S, R):
    post = np.full((S, MAX_TREE_ROWS), -1, np.int32)
    post[:, :R] = np.asarray(ids).reshape(S, R)
    return post


# ---------------------------------------------------------------------------------------------------
def after_walk(ctrl, n_acc, tr_n_rows, out_tokens, feat_rows, features, app_feats, app_sid, app_pos, packed):
    """Drafter append batch from the accepted rows' features, and the packed per-slot step output
    ``packed`` int32 [S, A + 3] = (n_acc or 0 when idle, tree rows or 0, out_tokens[0..A]).
    ``features``: the target batch's features [T, n_feat, H] (uint16), or None (autoregressive: then
    app_feats/app_sid/app_pos are not written and may be None)."""
    dims: dict = {}
    dev = current_device()
    _ctrl(ctrl, dims, dev)
    check_array("n_acc", n_acc, np.int32, ("S",), dims, device=dev)
    check_array("tr_n_rows", tr_n_rows, np.int32, ("S",), dims, device=dev)
    check_array("feat_rows", feat_rows, np.int32, ("S", "A"), dims, device=dev)
    S, A = dims["S"], dims["A"]
    check_array("out_tokens", out_tokens, np.int32, (S, A + 1), dims, device=dev)
    check_array("packed", packed, np.int32, (S, A + 3), dims, device=dev)
    if features is not None:
        check_array("features", features, np.uint16, ("T", "F", "H"), dims, device=dev)
        width = dims["F"] * dims["H"]
        check_array("app_feats", app_feats, np.uint16, (S * A, dims["F"], dims["H"]), dims, device=dev)
        check_array("app_sid", app_sid, np.int32, (S * A,), dims, device=dev)
        check_array("app_pos", app_pos, np.int32, (S * A,), dims, device=dev)
        if features.data.ptr % 16 or app_feats.data.ptr % 16:
            raise ValueError("features/app_feats: must be 16-byte aligned")
        fargs = (features, np.int64(width), app_feats, app_sid, app_pos)
    else:
        fargs = (_NULL, np.int64(0), _NULL, _NULL, _NULL)
    _k("eg_after_walk")((A, S), (128,), (ctrl, np.int32(S), np.int32(A), n_acc, tr_n_rows, out_tokens, feat_rows)
                        + fargs + (packed,))


def after_walk_ref(ctrl, n_acc, tr_n_rows, out_tokens, feat_rows, features):
    S, A = feat_rows.shape
    active = ctrl[CTRL_ACTIVE] != 0
    packed = np.zeros((S, A + 3), np.int32)
    packed[:, 0] = np.where(active, n_acc, 0)
    packed[:, 1] = np.where(active, tr_n_rows, 0)
    packed[:, 2:] = out_tokens
    out = {"packed": packed}
    if features is not None:
        j = np.arange(A)
        use = active[:, None] & (j[None, :] < n_acc[:, None])
        out["app_pos"] = np.where(use, ctrl[CTRL_PREFIX][:, None] + j[None, :], -1).reshape(-1).astype(np.int32)
        out["app_sid"] = np.repeat(np.arange(S, dtype=np.int32), A)
        out["use"] = use.reshape(-1)
        rows = np.where(use, feat_rows, 0).reshape(-1)
        out["app_feats"] = features[rows]          # only rows with use are defined
    return out


# ---------------------------------------------------------------------------------------------------
def sample_params(ctrl, R: int, slot_temp, slot_topk, slot_topp, slot_seed, temp, topk, topp, seeds, steps):
    """Per-row sampling parameters [S * R] from per-slot ones [S]; steps = (round << 8) | row."""
    dims: dict = {}
    dev = current_device()
    _ctrl(ctrl, dims, dev)
    check_range("R", R, 1, MAX_TREE_ROWS)
    S = dims["S"]
    check_array("slot_temp", slot_temp, np.float32, (S,), device=dev)
    check_array("slot_topk", slot_topk, np.int32, (S,), device=dev)
    check_array("slot_topp", slot_topp, np.float32, (S,), device=dev)
    check_array("slot_seed", slot_seed, np.uint64, (S,), device=dev)
    T = S * R
    check_array("temp", temp, np.float32, (T,), device=dev)
    check_array("topk", topk, np.int32, (T,), device=dev)
    check_array("topp", topp, np.float32, (T,), device=dev)
    check_array("seeds", seeds, np.uint64, (T,), device=dev)
    check_array("steps", steps, np.int64, (T,), device=dev)
    _k("eg_sample_params")((S,), (128,), (ctrl, np.int32(S), np.int32(R), np.int32(CTRL_STEP), slot_temp, slot_topk,
                                          slot_topp, slot_seed, temp, topk, topp, seeds, steps))


def sample_params_ref(ctrl, R, slot_temp, slot_topk, slot_topp, slot_seed):
    rep = lambda a: np.repeat(np.asarray(a), R)  # noqa: E731
    steps = (np.repeat(ctrl[CTRL_STEP].astype(np.int64), R) << 8) | np.tile(np.arange(R, dtype=np.int64), len(slot_temp))
    return {"temp": rep(slot_temp), "topk": rep(slot_topk), "topp": rep(slot_topp), "seeds": rep(slot_seed),
            "steps": steps}


# ---------------------------------------------------------------------------------------------------
def vocab_rows(parts, out):
    """All-gathered vocabulary shards float32 [tp, T, V/tp] -> whole rows [T, V] (rank r's columns at
    r * V/tp): what sampled decoding needs under tensor parallelism."""
    dims: dict = {}
    dev = current_device()
    check_array("parts", parts, np.float32, ("tp", "T", "Vl"), dims, device=dev)
    check_array("out", out, np.float32, ("T", dims["tp"] * dims["Vl"]), dims, device=dev)
    tp, T, Vl = dims["tp"], dims["T"], dims["Vl"]
    _k("eg_vocab_rows")((T, tp), (256,), (parts, np.int32(tp), np.int32(T), np.int32(Vl), out))


def vocab_rows_ref(parts) -> np.ndarray:
    parts = np.asarray(parts)
    return parts.transpose(1, 0, 2).reshape(parts.shape[1], -1)
