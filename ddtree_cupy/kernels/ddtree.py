"""Launch wrappers for cuda_src/ddtree.cu: per-depth top-K, tree builder, walk + commit (all streams per
launch, graph-capturable). The exact semantics are ddtree_cupy/reference/ddtree.py; layouts are in
docs/CONTRACTS.md ("Tree layout") and docs/DDTREE.md.

Typical single-GPU step (all buffers preallocated in a ``DDTreeWorkspace``):

    ws = DDTreeWorkspace(streams=S, depth=D, vocab_local=V, k=B)
    ws.topk(draft_logits)                       # [S, D, V] f32 or uint16 (bf16) -> ws.top_lp, ws.top_id
    ws.build(budgets, prefix_len, bonus)        # -> ws.tokens, parents, depths, positions, n_rows, mask
    ...target verifies the tree, writes post tokens [S, R] (argmax or samples per row)...
    ws.walk_commit(post, prefix_len, row_offset)  # -> acc_rows, n_acc, kv_src/kv_dst, feat_rows, ...

Vocabulary-parallel: each rank runs ``ws.topk(local_logits, id_offset=rank * V_local)`` (its
``ws.keys`` [S*D, k] and ``ws.ms`` [S*D] are the shard's result), all-gathers them into
keys [ranks, S*D, k] (uint64) and ms [ranks, S*D] (float32 pairs), then ``topk_merge(..., parts_major=True)``.
The stage-1 buffer ``part_keys`` [rows, P, part_width(k)] holds per-chunk candidate lists (an internal
format between ``topk_partial`` and ``topk_merge``; see cuda_src/ddtree.cu).
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from .. import knobs
from .checks import check_array, check_range, current_device
from .compile import KernelSpec, get_kernel, register
from .launch import pdl_enabled

MAX_TREE_ROWS = 129
MASK_WORDS = 5
MAX_K = 128
MAX_DEPTH = 8
TOPK_THREADS = 256      # DDT_TOPK_THREADS in ddtree.cu (both top-K kernels)
MAX_CHUNK = 8192        # 256 threads x 4 vectors of 8 logits held in registers (DDT_TOPK_VECS)
DEFAULT_CHUNK = 8192    # logits per block in the first top-K stage
MAX_MERGE_SMEM = 90 * 1024   # the merge gathers every list into shared memory (sm_120: 99 KB per block)

_NAMES = ("ddt_topk_partial_f32", "ddt_topk_partial_bf16", "ddt_topk_merge", "ddt_build_tree",
          "ddt_walk_commit")
# Kernel variants (cuda_src/ddtree.cu, DDT_FAST), chosen by ``fast`` in every call below: 0 / False = the
# frontier in shared memory and the candidate-list top-K (verified first: the plain twin); 3 = builder v3
# (only the frontier's ordered scores in registers, the popped position known to every lane) with the
# candidate-list top-K and the merge's final sort sized to k (kept for the top-K of small shapes,
# ``topk_variant``); 7 = the streaming ("scan") top-K with the merge's output placed by rank and the
# sorted-cache builder; 8 (DEFAULT_VARIANT) = 7 with the register merge, the lean cache loop and the register
# walk; 11 = 8 with the merge overlapping stage 1 (per-row arrival counters, below). Same results by
# construction; the GPU tests run every variant against the reference. fast_math stays off: tree scores
# reproduce the reference bit for bit. pdl: every kernel waits (DDT_PDL_WAIT) before its first global access
# (variant 11's merge waits for its row's stage-1 blocks instead, see OVERLAP_VARIANTS).
# Variants 4 (scan: builder v3 + scan top-K), 5 (4 + rank-placed merge) and 6 (4 + sorted cache) were slower
# than 7 and 8 on every H200 bench case (docs/DDTREE.md "Figures of record") and are deleted; so are 1, 2 (builders) and
# 9, 10 (docs/history/2026-11-29-ddtree.md "Variants 9 and 10").
DDTREE_SPEC = register(KernelSpec(
    src="ddtree.cu", names=_NAMES, defines=(("DDT_FAST", "0"),), hot=True, fast_math=False, pdl=True,
    doc="DDTree per-depth top-K (candidate lists + merge), best-first builder, acceptance walk + commit"))
DDTREE_V3_SPEC = register(KernelSpec(
    src="ddtree.cu", names=_NAMES, defines=(("DDT_FAST", "3"),), hot=True, fast_math=False, pdl=True,
    doc="DDTree kernels, builder v3 (scores in registers, warp-uniform pop), merge sort sized to k"))
# Variant 7 ("scan-rank-cache"): the streaming top-K (stage 1 writes each thread's largest key, the merge
# narrows those and re-reads the few 32-logit groups that can hold the top-k) with the merge's output placed
# by rank, and a builder that pops from a sorted 32-entry cache held one entry per lane for budgets <= 64
# (CACHE_MAX_BUDGET; larger budgets run v3's loop in the same kernel). H200: 1.2 us faster than 8 on f32
# logits only.
DDTREE_SCAN_RANK_CACHE_SPEC = register(KernelSpec(
    src="ddtree.cu", names=_NAMES, defines=(("DDT_FAST", "7"),), hot=True, fast_math=False, pdl=True,
    doc="DDTree kernels, scan top-K with the merge output placed by rank, sorted-cache builder (budgets <= 64)"))
# Variant 8 ("scan-rank-cache-regs"): 7 whose scan merge keeps each thread's group keys in registers (one
# batch of loads) and places the selected groups and candidates by block scans of per-thread counts, rows of
# <= 20 chunks (MERGE_REGS_MAX_P: V_local <= 163840; larger rows take variant 7's merge); its cache loop
# stores one info word per pop and its walk reads the tree from registers (one batch of loads).
DDTREE_SCAN_RANK_CACHE_REGS_SPEC = register(KernelSpec(
    src="ddtree.cu", names=_NAMES, defines=(("DDT_FAST", "8"),), hot=True, fast_math=False, pdl=True,
    doc="DDTree kernels, variant 7 with the scan merge's group keys in registers and scan-placed selections"))
# Variant 11 ("scan-rank-cache-regs-ovl"): 8 whose merge overlaps stage 1. Stage 1 triggers its dependents
# right after its own PDL wait and counts its finished chunks per row (``row_cnt`` [rows] uint32, owned by the
# workspace, zero between launches); with PDL the merge grid then launches during stage 1's last wave and
# each merge block waits for its own row's count (and resets it) instead of the whole stage-1 grid, so the
# rows of the earlier waves are merged while later rows still stream. The merge and the builder also trigger
# their dependents early (those still wait for the whole grid); stage 1 runs at 5 blocks per SM (48 registers,
# no spill; measured 9.6 -> 9.2 us at 10 x 64 in revision 3's variant 10). ``DDTreeWorkspace.topk`` passes the
# counters only while PDL is enabled (launch.pdl_enabled()): without PDL the merge cannot start early, so both
# launches get a null row_cnt and run variant 8's path (no counting, no early trigger, the merge waits for the
# whole grid). Kernel signatures: the top-K kernels take ``row_cnt`` as one more argument. Same outputs as 8
# bit for bit.
DDTREE_OVERLAP_SPEC = register(KernelSpec(
    src="ddtree.cu", names=_NAMES, defines=(("DDT_FAST", "11"),), hot=True, fast_math=False, pdl=True,
    doc="DDTree kernels, variant 8 with the merge overlapping stage 1 (per-row arrival counters, early PDL triggers)"))
_SPECS = {0: DDTREE_SPEC, 3: DDTREE_V3_SPEC, 7: DDTREE_SCAN_RANK_CACHE_SPEC, 8: DDTREE_SCAN_RANK_CACHE_REGS_SPEC,
          11: DDTREE_OVERLAP_SPEC}
VARIANTS = {0: "verified", 3: "v3", 7: "scan-rank-cache", 8: "scan-rank-cache-regs",
            11: "scan-rank-cache-regs-ovl"}   # ``fast`` -> its name in tests and bench
SCAN_VARIANTS = (7, 8, 11)       # variants whose stage 1 writes group keys (scan_width), not candidate lists
CACHE_VARIANTS = (7, 8, 11)      # variants with the sorted-cache builder
OVERLAP_VARIANTS = (11,)         # variants whose top-K kernels take row_cnt (DDT_OVERLAP in ddtree.cu)
MERGE_REGS_MAX_P = 20            # DDT_MREG in ddtree.cu: the register merge (8, 11) for <= 20 chunks per row
CACHE_MAX_BUDGET = 64         # DDT_CACHE_BUDGET in ddtree.cu: 32 cache entries cover budgets <= 2 * 32
# The variant the engine uses; DDT_TREE_VARIANT (one of VARIANTS) overrides it (whole-engine checks of a
# variant, or the fallback: DDT_TREE_VARIANT=7 is the previous H200-proven default).
# 8: the integration run of revision 3 (bench/results/tree_h200.json; every DDTree GPU test passed): 10 x 64
# bf16 total 40.5 (7) -> 35.8 us (PDL 35.2): build 15.9 -> 13.2, top-K 21.1 -> 18.1, walk 3.5 -> 2.8.
# 11 (revision 4, the integration run, tree_h200_ovl.json (in git history); all its GPU tests passed): 10 x 64 bf16
# total with PDL 35.0 (8) -> 34.6 us, 0.3-0.6 us elsewhere at bf16: the rule set before the run was met, but the
# engine launches with PDL only at <= 64 rows, where 11 saves ~0.3 us of a ~9 ms step, and its protocol adds a
# cross-kernel spin-wait; 8 stays the default (docs/history/2026-11-29-ddtree.md "Variant 11 measured"). DDT_TREE_VARIANT=11
# selects it (the engine's CPU emulation, tests/test_engine_cpu.py KERNELS, would then need the top-K kernels'
# extra row_cnt argument).
DEFAULT_VARIANT = 8
if knobs.get().tree_variant is not None:
    DEFAULT_VARIANT = knobs.get().tree_variant
    if DEFAULT_VARIANT not in VARIANTS:
        raise ValueError(f"DDT_TREE_VARIANT: expected one of {sorted(VARIANTS)}, got {DEFAULT_VARIANT}")


# The scan variant hands the top-K of small shapes to the candidate-list kernels (variant 3's module; the
# builder and walk are the same code in both): on the H200 (bench/results/tree_h200.json) the list top-K
# was faster only at 1 stream (7 rows) and k = 8 (11.8 vs 12.3 us; scan: k = 16 12.5 vs 12.8, 4 streams
# k = 8 15.0 vs 21.8). Measured at V_local = 163840 only.
LIST_TOPK_MAX_ROWS = 7
LIST_TOPK_MAX_K = 8


def topk_variant(rows: int, k: int, fast=True) -> int:
    """The kernel variant whose top-K a workspace of variant ``fast`` launches for ``rows`` rows of top-``k``
    (rule above; every variant's top-K gives the same outputs bit for bit)."""
    v = variant(fast)
    if v in SCAN_VARIANTS and rows <= LIST_TOPK_MAX_ROWS and k <= LIST_TOPK_MAX_K:
        return 3
    return v


def variant(fast) -> int:
    """``fast`` (False -> 0, True -> DEFAULT_VARIANT, or a variant number) -> the DDT_FAST variant."""
    v = (DEFAULT_VARIANT if fast else 0) if isinstance(fast, (bool, np.bool_)) else int(fast)
    if v not in VARIANTS:
        raise ValueError(f"fast: expected False/True or a variant in {sorted(VARIANTS)}, got {fast!r}")
    return v


def _fn(name, fast=True, max_dynamic_smem: int = 0):
    return get_kernel(_SPECS[variant(fast)], name, max_dynamic_smem=max_dynamic_smem)


def n_chunks(vocab_local: int, chunk: int = DEFAULT_CHUNK) -> int:
    return (vocab_local + chunk - 1) // chunk


def cand_cap(k: int) -> int:
    """Most candidate keys a stage-1 chunk list holds (cand_cap in ddtree.cu): ~1.2-1.4 k pass the bound
    on random logits; more (long runs of equal logits) switch that chunk to an exact select."""
    return 64 if k <= 32 else (128 if k <= 64 else 256)


def part_width(k: int) -> int:
    """uint64 slots per chunk in ``part_keys`` (part_width in ddtree.cu): [bound, count, keys...], or
    the chunk's largest key alone when k == 1."""
    return 1 if k == 1 else 2 + cand_cap(k)


def scan_width(k: int) -> int:
    """uint64 slots per chunk in the scan variant's ``part_keys`` (scan_width in ddtree.cu): a 3-slot
    header (logits row address | bf16 flag, V_local | id_offset << 32, chunk) and the 256 threads'
    largest keys; k == 1 is the chunk's largest key alone, as in the other variants."""
    return 1 if k == 1 else 3 + TOPK_THREADS


def stage1_width(k: int, fast=True) -> int:
    """Slots per chunk of ``part_keys`` for kernel variant ``fast``."""
    return scan_width(k) if variant(fast) in SCAN_VARIANTS else part_width(k)


def merge_smem(P: int, k: int, parts_major: bool, fast=False) -> int:
    """Dynamic shared memory of ``ddt_topk_merge``: every list's keys (capacity) plus P lengths; the scan
    variant (k >= 2): max(256 P group keys, 32 cand_cap(k) candidates) plus cand_cap(k) group indices."""
    if not parts_major and k > 1 and variant(fast) in SCAN_VARIANTS:
        return max(P * TOPK_THREADS, 32 * cand_cap(k)) * 8 + cand_cap(k) * 4
    lcap = cand_cap(k) if (not parts_major and k > 1) else k
    return P * lcap * 8 + P * 4


# ----------------------------------------------------------------------------------------------------
# stage launches (checked; no allocation, no host sync)
# ----------------------------------------------------------------------------------------------------
def _row_cnt_arg(row_cnt, rows: int, fast, dims: dict, dev):
    """The top-K kernels' extra argument in OVERLAP_VARIANTS (a null pointer when ``row_cnt`` is None); other
    variants take none and refuse a counter buffer."""
    if variant(fast) not in OVERLAP_VARIANTS:
        if row_cnt is not None:
            raise ValueError(f"row_cnt: only the overlap variants {OVERLAP_VARIANTS} count stage-1 arrivals, "
                             f"got variant {variant(fast)}")
        return ()
    if row_cnt is None:
        return (np.uint64(0),)
    return (check_array("row_cnt", row_cnt, np.uint32, (rows,), dims, device=dev),)


def topk_partial(logits, k: int, part_keys, part_ms, id_offset: int = 0, chunk: int = DEFAULT_CHUNK,
                 fast=True, row_cnt=None):
    """Per row of ``logits`` [rows, V_local] (float32, or uint16 = bf16 bits) and per chunk of ``chunk``
    logits (a multiple of 2048, <= 8192): the chunk's candidate list -> ``part_keys`` uint64
    [rows, P, stage1_width(k, fast)] (the scan variant: its group keys and a header with the logits'
    address, so ``logits`` must stay unchanged until the merge) and its log-sum-exp partial
    (max, sum exp(x - max)) -> ``part_ms`` float32 [rows, P, 2]; P = ceil(V_local / chunk).
    ``row_cnt`` (OVERLAP_VARIANTS only; uint32 [rows], zero): every finished chunk adds 1 to its row's count,
    and the merge launched next with the same buffer waits on it and resets it to zero, so a launch with
    ``row_cnt`` must be followed by exactly one such ``topk_merge`` (``DDTreeWorkspace.topk`` does both)."""
    dims: dict = {}
    dev = current_device()
    if logits.dtype == np.float32:
        name = "ddt_topk_partial_f32"
    elif logits.dtype == np.uint16:
        name = "ddt_topk_partial_bf16"
    else:
        raise ValueError(f"logits: expected float32 or uint16 (bf16 bits), got {logits.dtype}")
    check_array("logits", logits, logits.dtype, ("rows", "V"), dims, device=dev)
    V = dims["V"]
    if V % 8:
        raise ValueError(f"logits: V_local={V} must be a multiple of 8 (16-byte vector loads)")
    check_range("k", k, 1, MAX_K)
    if k > V:
        raise ValueError(f"k: {k} exceeds the shard's vocabulary V_local={V}")
    check_range("chunk", chunk, 2048, MAX_CHUNK)
    if chunk % 2048:
        raise ValueError(f"chunk: must be a multiple of 2048, got {chunk}")
    P = n_chunks(V, chunk)
    check_array("part_keys", part_keys, np.uint64, ("rows", P, stage1_width(k, fast)), dims, device=dev)
    check_array("part_ms", part_ms, np.float32, ("rows", P, 2), dims, device=dev)
    check_range("id_offset", id_offset, 0, (1 << 31) - 1 - V)
    rows = dims["rows"]
    cnt = _row_cnt_arg(row_cnt, rows, fast, dims, dev)
    _fn(name, fast)((P, rows), (TOPK_THREADS,), (logits, np.int32(rows), np.int32(V), np.int32(id_offset),
                                          np.int32(k), np.int32(chunk), part_keys, part_ms) + cnt)


def topk_merge(keys, ms, k: int, out_keys, out_ms, out_lp, out_id, parts_major: bool = False,
               fast=True, row_cnt=None):
    """Merge P partial lists per row. ``keys`` uint64 [rows, P, stage1_width(k, fast)] with ``ms`` float32
    [rows, P, 2] (parts_major False, stage-1 output) or [P, rows, k] / [P, rows, 2] (parts_major True,
    an all-gather of shards' ``out_keys`` / ``out_ms``). Outputs: out_keys uint64 [rows, k], out_ms float32 [rows, 2], out_lp
    float32 [rows, k] (log-probs against the merged log-sum-exp), out_id int32 [rows, k]. ``row_cnt``: the
    buffer the stage-1 launch just before counted into (``topk_partial``); each row waits for its own P
    stage-1 blocks instead of the whole stage-1 grid, then resets its count."""
    dims: dict = {}
    dev = current_device()
    if parts_major:
        check_array("keys", keys, np.uint64, ("P", "rows", k), dims, device=dev)
        check_array("ms", ms, np.float32, ("P", "rows", 2), dims, device=dev)
    else:
        check_array("keys", keys, np.uint64, ("rows", "P", stage1_width(k, fast)), dims, device=dev)
        check_array("ms", ms, np.float32, ("rows", "P", 2), dims, device=dev)
    check_range("k", k, 1, MAX_K)
    check_array("out_keys", out_keys, np.uint64, ("rows", k), dims, device=dev)
    check_array("out_ms", out_ms, np.float32, ("rows", 2), dims, device=dev)
    check_array("out_lp", out_lp, np.float32, ("rows", k), dims, device=dev)
    check_array("out_id", out_id, np.int32, ("rows", k), dims, device=dev)
    rows, P = dims["rows"], dims["P"]
    if parts_major and row_cnt is not None:
        raise ValueError("row_cnt: a merge of shards' lists (parts_major) has no stage-1 launch to wait for")
    cnt = _row_cnt_arg(row_cnt, rows, fast, dims, dev)
    smem = merge_smem(P, k, parts_major, fast)
    if smem > MAX_MERGE_SMEM:
        raise ValueError(f"keys: {P} lists of top-{k} need {smem} B of shared memory in the merge "
                         f"(limit {MAX_MERGE_SMEM}); use fewer, larger chunks or shards")
    _fn("ddt_topk_merge", fast, smem)((rows,), (TOPK_THREADS,), (
        keys, ms, np.int32(rows), np.int32(P), np.int32(k), np.int32(1 if parts_major else 0), out_keys, out_ms,
        out_lp, out_id) + cnt, shared_mem=smem)


def build_tree(top_lp, top_id, budgets, prefix_len, bonus, tokens, parents, depths, positions, n_rows,
               mask, cap_k: int = 0, include_chain: bool = False, fast=True):
    """The best-first tree of every stream: ``top_lp`` float32 / ``top_id`` int32 [S, D, K] (sorted
    descending per depth), ``budgets``/``prefix_len``/``bonus`` int32 [S] (read on the device; budgets
    clamp to [0, 128]). Outputs int32 [S, 129] tokens/parents/depths/positions, n_rows int32 [S] (= nodes
    + 1), mask uint32 [S, 129, 5]. ``cap_k`` 0 = no cap."""
    dims: dict = {}
    dev = current_device()
    check_array("top_lp", top_lp, np.float32, ("S", "D", "K"), dims, device=dev)
    check_array("top_id", top_id, np.int32, ("S", "D", "K"), dims, device=dev)
    check_range("D (top_lp.shape[1])", dims["D"], 1, MAX_DEPTH)
    check_range("K (top_lp.shape[2])", dims["K"], 1, MAX_K)
    for nm, a in (("budgets", budgets), ("prefix_len", prefix_len), ("bonus", bonus), ("n_rows", n_rows)):
        check_array(nm, a, np.int32, ("S",), dims, device=dev)
    for nm, a in (("tokens", tokens), ("parents", parents), ("depths", depths), ("positions", positions)):
        check_array(nm, a, np.int32, ("S", MAX_TREE_ROWS), dims, device=dev)
    check_array("mask", mask, np.uint32, ("S", MAX_TREE_ROWS, MASK_WORDS), dims, device=dev)
    check_range("cap_k", cap_k, 0, 1 << 30)
    _fn("ddt_build_tree", fast)((dims["S"],), (32,), (
        top_lp, top_id, np.int32(dims["D"]), np.int32(dims["K"]), budgets, prefix_len, bonus,
        np.int32(cap_k), np.int32(1 if include_chain else 0), tokens, parents, depths, positions, n_rows, mask))


def walk_commit(tokens, parents, n_rows, post, prefix_len, row_offset, acc_rows, n_acc, kv_src, kv_dst,
                feat_rows, out_tokens, new_len, new_bonus, update_len=None, update_bonus=None, fast=True):
    """Accept a path per stream and plan its commit. ``post`` int32 [S, 129]: the target's token at each
    tree row (argmax, or a sample). Outputs [S, A] int32 (A = max accepted, D + 1), padded with -1:
    acc_rows, kv_src (= prefix + row), kv_dst (= prefix + j), feat_rows (= row_offset + row); out_tokens
    [S, A + 1] (accepted tokens, then the new bonus, then -1); n_acc, new_len, new_bonus [S].
    ``update_len`` / ``update_bonus`` (optional [S] int32, may be ``prefix_len`` / the bonus buffer):
    also written in place. Note the KV compaction needs the PRE-step prefix length."""
    dims: dict = {}
    dev = current_device()
    for nm, a in (("tokens", tokens), ("parents", parents), ("post", post)):
        check_array(nm, a, np.int32, ("S", MAX_TREE_ROWS), dims, device=dev)
    for nm, a in (("n_rows", n_rows), ("prefix_len", prefix_len), ("row_offset", row_offset),
                  ("n_acc", n_acc), ("new_len", new_len), ("new_bonus", new_bonus)):
        check_array(nm, a, np.int32, ("S",), dims, device=dev)
    for nm, a in (("acc_rows", acc_rows), ("kv_src", kv_src), ("kv_dst", kv_dst), ("feat_rows", feat_rows)):
        check_array(nm, a, np.int32, ("S", "A"), dims, device=dev)
    check_range("A (acc_rows.shape[1])", dims["A"], 1, MAX_DEPTH + 1)
    check_array("out_tokens", out_tokens, np.int32, ("S", dims["A"] + 1), dims, device=dev)
    upd = []
    for nm, a in (("update_len", update_len), ("update_bonus", update_bonus)):
        if a is None:
            upd.append(np.uint64(0))    # null pointer
        else:
            upd.append(check_array(nm, a, np.int32, ("S",), dims, device=dev))
    _fn("ddt_walk_commit", fast)((dims["S"],), (32,), (
        tokens, parents, n_rows, post, prefix_len, row_offset, np.int32(dims["A"]), acc_rows, n_acc, kv_src,
        kv_dst, feat_rows, out_tokens, new_len, new_bonus, upd[0], upd[1]))


# ----------------------------------------------------------------------------------------------------
# preallocated per-step buffers
# ----------------------------------------------------------------------------------------------------
class DDTreeWorkspace:
    """Static buffers for ``streams`` streams, draft depth ``depth``, ``vocab_local`` logits per row and
    top-``k`` per depth (k >= the largest budget, or the cap); ``fast`` picks the kernel variant (False /
    True or a number in VARIANTS). Every method launches on the current
    stream without allocating, so a sequence of calls can be captured in a CUDA graph."""

    def __init__(self, streams: int, depth: int, vocab_local: int, k: int, chunk: int = DEFAULT_CHUNK,
                 fast=DEFAULT_VARIANT):
        import cupy
        self.fast = variant(fast)   # a key of VARIANTS; passed to every launch
        check_range("streams", streams, 1, 1 << 16)
        check_range("depth", depth, 1, MAX_DEPTH)
        check_range("k", k, 1, MAX_K)
        if k > vocab_local:
            raise ValueError(f"k: {k} exceeds vocab_local={vocab_local}")
        self.S, self.D, self.V, self.k, self.chunk = streams, depth, vocab_local, k, chunk
        rows = streams * depth
        self.P = n_chunks(vocab_local, chunk)
        R, A = MAX_TREE_ROWS, depth + 1
        self.A = A
        i32 = lambda *s: cupy.empty(s, cupy.int32)   # noqa: E731
        self.topk_fast = topk_variant(rows, k, self.fast)   # the top-K kernels' variant (topk_variant)
        self.part_keys = cupy.empty((rows, self.P, stage1_width(k, self.topk_fast)), cupy.uint64)
        self.part_ms = cupy.empty((rows, self.P, 2), cupy.float32)
        self.keys = cupy.empty((rows, k), cupy.uint64)
        self.ms = cupy.empty((rows, 2), cupy.float32)
        # per-row stage-1 arrival counts of the overlap variants (zero between topk() calls; not an output)
        self.row_cnt = cupy.zeros(rows, cupy.uint32) if self.topk_fast in OVERLAP_VARIANTS else None
        self.top_lp = cupy.empty((streams, depth, k), cupy.float32)
        self.top_id = i32(streams, depth, k)
        self.tokens, self.parents, self.depths, self.positions = (i32(streams, R) for _ in range(4))
        self.n_rows = i32(streams)
        self.mask = cupy.empty((streams, R, MASK_WORDS), cupy.uint32)
        self.acc_rows, self.kv_src, self.kv_dst, self.feat_rows = (i32(streams, A) for _ in range(4))
        self.out_tokens = i32(streams, A + 1)
        self.n_acc, self.new_len, self.new_bonus = i32(streams), i32(streams), i32(streams)

    def topk(self, logits, id_offset: int = 0):
        """logits [S, D, V_local] (float32 or uint16 bf16) -> top_lp / top_id [S, D, k] (and keys, ms)."""
        dims: dict = {}
        check_array("logits", logits, logits.dtype, (self.S, self.D, self.V), dims)
        flat = logits.reshape(self.S * self.D, self.V)
        # The counters only pay when the merge can start before stage 1 ends, i.e. with PDL (decided per launch
        # by kernels/launch.py, so also at graph capture): without it both launches get a null row_cnt and run
        # as variant 8. Every argument is checked by topk_partial before its launch and the merge's are this
        # workspace's own buffers: a stage-1 launch that counts is always followed by the merge that resets.
        cnt = self.row_cnt if (self.row_cnt is not None and pdl_enabled()) else None
        topk_partial(flat, self.k, self.part_keys, self.part_ms, id_offset, self.chunk, fast=self.topk_fast,
                     row_cnt=cnt)
        topk_merge(self.part_keys, self.part_ms, self.k, self.keys, self.ms,
                   self.top_lp.reshape(self.S * self.D, self.k), self.top_id.reshape(self.S * self.D, self.k),
                   fast=self.topk_fast, row_cnt=cnt)

    def build(self, budgets, prefix_len, bonus, cap_k: int = 0, include_chain: bool = False):
        build_tree(self.top_lp, self.top_id, budgets, prefix_len, bonus, self.tokens, self.parents,
                   self.depths, self.positions, self.n_rows, self.mask, cap_k, include_chain, fast=self.fast)

    def walk_commit(self, post, prefix_len, row_offset, update_len=None, update_bonus=None):
        walk_commit(self.tokens, self.parents, self.n_rows, post, prefix_len, row_offset, self.acc_rows,
                    self.n_acc, self.kv_src, self.kv_dst, self.feat_rows, self.out_tokens, self.new_len,
                    self.new_bonus, update_len, update_bonus, fast=self.fast)

    def outputs(self):
        """Every output buffer by name (tests poison them before launches)."""
        return {n: getattr(self, n) for n in (
            "part_keys", "part_ms", "keys", "ms", "top_lp", "top_id", "tokens", "parents", "depths",
            "positions", "n_rows", "mask", "acc_rows", "kv_src", "kv_dst", "feat_rows", "out_tokens",
            "n_acc", "new_len", "new_bonus")}
