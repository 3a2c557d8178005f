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
The stage-1 buffer ``part_keys`` [rows, P, stage1_width(k, kind)] holds per-chunk group keys (the scan kind)
or candidate lists (the list kind): an internal format between ``topk_partial`` and ``topk_merge`` of the
same kind (see cuda_src/ddtree.cu).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .. import knobs
from .checks import check_array, check_range, current_device
from .compile import KernelSpec, get_kernel, register

MAX_TREE_ROWS = 129
MASK_WORDS = 5
MAX_K = 128
MAX_DEPTH = 8
TOPK_THREADS = 256      # DDT_TOPK_THREADS in ddtree.cu (both top-K kernels)
MAX_CHUNK = 8192        # 256 threads x 4 vectors of 8 logits held in registers (DDT_TOPK_VECS)
DEFAULT_CHUNK = 8192    # logits per block in the first top-K stage
MAX_MERGE_SMEM = 90 * 1024   # the merge gathers every list into shared memory (sm_120: 99 KB per block)

# the top-K kernels are templates over the logits' type and the kind (SCAN = the scan kind)
_PARTIAL = {(kind, dt): f"ddt_topk_partial<{t}, {'true' if kind == 'scan' else 'false'}>"
            for kind in ("scan", "list") for dt, t in ((np.float32, "float"), (np.uint16, "bf16_bits"))}
_MERGE = {"scan": "ddt_topk_merge<true>", "list": "ddt_topk_merge<false>"}
_NAMES = (*_PARTIAL.values(), *_MERGE.values(), "ddt_build_tree", "ddt_walk_commit")
# One module. The top-K has two kinds (a template parameter of its kernels in ddtree.cu), chosen by ``kind``
# in the top-K calls below: "scan" (the engine's) = the streaming top-K whose merge keeps each thread's group
# keys in registers and places its output by rank (the merge of shards' exact lists, parts_major, is this
# kernel too); "list" = the candidate-list top-K with the merge's final sort sized to k, which a workspace
# launches for small shapes (``topk_kind``). Same results by construction; the GPU tests run both against
# the reference. The builder pops from a sorted cache for budgets <= 64 (larger ones run builder v3's loop
# in the same kernel) and the walk reads the tree from registers. fast_math stays off: tree scores
# reproduce the reference bit for bit. pdl: every kernel waits (DDT_PDL_WAIT) before its first global
# access. The designs measured and removed are in docs/history/2026-11-29-ddtree.md and
# docs/history/2026-12-02-ddtree.md.
DDTREE_SPEC = register(KernelSpec(
    src="ddtree.cu", names=_NAMES, hot=True, fast_math=False, pdl=True,
    doc="DDTree kernels: scan and list top-K, sorted-cache builder (v3 above budget 64), register walk"))
TOPK_KINDS = tuple(_MERGE)       # ``kind`` of the top-K calls: "scan", "list"
MERGE_REGS_MAX_P = 20            # DDT_MREG in ddtree.cu: the register merge for <= 20 chunks per row
CACHE_MAX_BUDGET = 64         # DDT_CACHE_BUDGET in ddtree.cu: 32 cache entries cover budgets <= 2 * 32


# A workspace hands the top-K of small shapes to the candidate-list kernels: on the H200
# (bench/results/tree_h200.json) the list top-K was faster only at 1 stream (7 rows) and k = 8 (11.8 vs
# 12.3 us; scan: k = 16 12.5 vs 12.8, 4 streams k = 8 15.0 vs 21.8). Measured at V_local = 163840 only.
LIST_TOPK_MAX_ROWS = 7
LIST_TOPK_MAX_K = 8


def topk_kind(rows: int, k: int) -> str:
    """The top-K kind a workspace launches for ``rows`` rows of top-``k`` (rule above; both kinds give
    the same outputs bit for bit)."""
    return "list" if rows <= LIST_TOPK_MAX_ROWS and k <= LIST_TOPK_MAX_K else "scan"


def _kind(kind: str) -> str:
    """``kind``, a key of TOPK_KINDS, checked."""
    if not isinstance(kind, str) or kind not in TOPK_KINDS:
        raise ValueError(f"kind: expected one of {TOPK_KINDS}, got {kind!r}")
    return kind


def _fn(name, max_dynamic_smem: int = 0):
    return get_kernel(DDTREE_SPEC, name, max_dynamic_smem=max_dynamic_smem)


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
    """uint64 slots per chunk in the scan kind's ``part_keys`` (scan_width in ddtree.cu): a 3-slot
    header (logits row address | bf16 flag, V_local | id_offset << 32, chunk) and the 256 threads'
    largest keys; k == 1 is the chunk's largest key alone, as in the list kind."""
    return 1 if k == 1 else 3 + TOPK_THREADS


def stage1_width(k: int, kind: str = "scan") -> int:
    """Slots per chunk of ``part_keys`` for top-K kind ``kind``."""
    return scan_width(k) if _kind(kind) == "scan" else part_width(k)


def merge_smem(P: int, k: int, parts_major: bool, kind: str = "scan") -> int:
    """Dynamic shared memory of the merge: every list's keys (capacity) plus P lengths; the scan kind
    (k >= 2): max(256 P group keys, 32 cand_cap(k) candidates) plus cand_cap(k) group indices."""
    if not parts_major and k > 1 and _kind(kind) == "scan":
        return max(P * TOPK_THREADS, 32 * cand_cap(k)) * 8 + cand_cap(k) * 4
    lcap = cand_cap(k) if (not parts_major and k > 1) else k
    return P * lcap * 8 + P * 4


# ----------------------------------------------------------------------------------------------------
# stage launches (checked; no allocation, no host sync)
# ----------------------------------------------------------------------------------------------------
def topk_partial(logits, k: int, part_keys, part_ms, id_offset: int = 0, chunk: int = DEFAULT_CHUNK,
                 kind: str = "scan"):
    """Per row of ``logits`` [rows, V_local] (float32, or uint16 = bf16 bits) and per chunk of ``chunk``
    logits (a multiple of 2048, <= 8192): the chunk's candidate list -> ``part_keys`` uint64
    [rows, P, stage1_width(k, kind)] (the scan kind: its group keys and a header with the logits'
    address, so ``logits`` must stay unchanged until the merge) and its log-sum-exp partial
    (max, sum exp(x - max)) -> ``part_ms`` float32 [rows, P, 2]; P = ceil(V_local / chunk)."""
    dims: dict = {}
    dev = current_device()
    if logits.dtype in (np.float32, np.uint16):
        name = _PARTIAL[(_kind(kind), logits.dtype.type)]
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
    check_array("part_keys", part_keys, np.uint64, ("rows", P, stage1_width(k, kind)), dims, device=dev)
    check_array("part_ms", part_ms, np.float32, ("rows", P, 2), dims, device=dev)
    check_range("id_offset", id_offset, 0, (1 << 31) - 1 - V)
    rows = dims["rows"]
    _fn(name)((P, rows), (TOPK_THREADS,), (logits, np.int32(rows), np.int32(V), np.int32(id_offset),
                                          np.int32(k), np.int32(chunk), part_keys, part_ms))


def topk_merge(keys, ms, k: int, out_keys, out_ms, out_lp, out_id, parts_major: bool = False,
               kind: str = "scan"):
    """Merge P partial lists per row. ``keys`` uint64 [rows, P, stage1_width(k, kind)] with ``ms`` float32
    [rows, P, 2] (parts_major False, stage-1 output) or [P, rows, k] / [P, rows, 2] (parts_major True,
    an all-gather of shards' ``out_keys`` / ``out_ms``). Outputs: out_keys uint64 [rows, k], out_ms float32 [rows, 2], out_lp
    float32 [rows, k] (log-probs against the merged log-sum-exp), out_id int32 [rows, k]."""
    dims: dict = {}
    dev = current_device()
    kind = _kind(kind)
    if parts_major:
        check_array("keys", keys, np.uint64, ("P", "rows", k), dims, device=dev)
        check_array("ms", ms, np.float32, ("P", "rows", 2), dims, device=dev)
    else:
        check_array("keys", keys, np.uint64, ("rows", "P", stage1_width(k, kind)), dims, device=dev)
        check_array("ms", ms, np.float32, ("rows", "P", 2), dims, device=dev)
    check_range("k", k, 1, MAX_K)
    check_array("out_keys", out_keys, np.uint64, ("rows", k), dims, device=dev)
    check_array("out_ms", out_ms, np.float32, ("rows", 2), dims, device=dev)
    check_array("out_lp", out_lp, np.float32, ("rows", k), dims, device=dev)
    check_array("out_id", out_id, np.int32, ("rows", k), dims, device=dev)
    rows, P = dims["rows"], dims["P"]
    smem = merge_smem(P, k, parts_major, kind)
    if smem > MAX_MERGE_SMEM:
        raise ValueError(f"keys: {P} lists of top-{k} need {smem} B of shared memory in the merge "
                         f"(limit {MAX_MERGE_SMEM}); use fewer, larger chunks or shards")
    _fn(_MERGE[kind], smem)((rows,), (TOPK_THREADS,), (
        keys, ms, np.int32(rows), np.int32(P), np.int32(k), np.int32(1 if parts_major else 0), out_keys, out_ms,
        out_lp, out_id), shared_mem=smem)


def build_tree(top_lp, top_id, budgets, prefix_len, bonus, tokens, parents, depths, positions, n_rows,
               mask, cap_k: int = 0, include_chain: bool = False):
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
    _fn("ddt_build_tree")((dims["S"],), (32,), (
        top_lp, top_id, np.int32(dims["D"]), np.int32(dims["K"]), budgets, prefix_len, bonus,
        np.int32(cap_k), np.int32(1 if include_chain else 0), tokens, parents, depths, positions, n_rows, mask))


def walk_commit(tokens, parents, n_rows, post, prefix_len, row_offset, acc_rows, n_acc, kv_src, kv_dst,
                feat_rows, out_tokens, new_len, new_bonus, update_len=None, update_bonus=None):
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
    _fn("ddt_walk_commit")((dims["S"],), (32,), (
        tokens, parents, n_rows, post, prefix_len, row_offset, np.int32(dims["A"]), acc_rows, n_acc, kv_src,
        kv_dst, feat_rows, out_tokens, new_len, new_bonus, upd[0], upd[1]))


# ----------------------------------------------------------------------------------------------------
# preallocated per-step buffers
# ----------------------------------------------------------------------------------------------------
class DDTreeWorkspace:
    """Static buffers for ``streams`` streams, draft depth ``depth``, ``vocab_local`` logits per row and
    top-``k`` per depth (k >= the largest budget, or the cap); ``topk`` picks the top-K kind (a key of
    TOPK_KINDS; None: DDT_TREE_TOPK if set, else ``topk_kind``'s rule). Every method launches on the current
    stream without allocating, so a sequence of calls can be captured in a CUDA graph."""

    def __init__(self, streams: int, depth: int, vocab_local: int, k: int, chunk: int = DEFAULT_CHUNK,
                 topk: Optional[str] = None):
        import cupy
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
        # the top-K kernels' kind, passed to both top-K launches
        if topk is None:
            topk = knobs.get().tree_topk or topk_kind(rows, k)
        self.topk_kind = _kind(topk)
        self.part_keys = cupy.empty((rows, self.P, stage1_width(k, self.topk_kind)), cupy.uint64)
        self.part_ms = cupy.empty((rows, self.P, 2), cupy.float32)
        self.keys = cupy.empty((rows, k), cupy.uint64)
        self.ms = cupy.empty((rows, 2), cupy.float32)
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
        topk_partial(flat, self.k, self.part_keys, self.part_ms, id_offset, self.chunk, kind=self.topk_kind)
        topk_merge(self.part_keys, self.part_ms, self.k, self.keys, self.ms,
                   self.top_lp.reshape(self.S * self.D, self.k), self.top_id.reshape(self.S * self.D, self.k),
                   kind=self.topk_kind)

    def build(self, budgets, prefix_len, bonus, cap_k: int = 0, include_chain: bool = False):
        build_tree(self.top_lp, self.top_id, budgets, prefix_len, bonus, self.tokens, self.parents,
                   self.depths, self.positions, self.n_rows, self.mask, cap_k, include_chain)

    def walk_commit(self, post, prefix_len, row_offset, update_len=None, update_bonus=None):
        walk_commit(self.tokens, self.parents, self.n_rows, post, prefix_len, row_offset, self.acc_rows,
                    self.n_acc, self.kv_src, self.kv_dst, self.feat_rows, self.out_tokens, self.new_len,
                    self.new_bonus, update_len, update_bonus)

    def outputs(self):
        """Every output buffer by name (tests poison them before launches)."""
        return {n: getattr(self, n) for n in (
            "part_keys", "part_ms", "keys", "ms", "top_lp", "top_id", "tokens", "parents", "depths",
            "positions", "n_rows", "mask", "acc_rows", "kv_src", "kv_dst", "feat_rows", "out_tokens",
            "n_acc", "new_len", "new_bonus")}
