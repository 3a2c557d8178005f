"""DDTree in plain numpy: the specification the GPU kernels (cuda_src/ddtree.cu) must equal exactly.

One decode round for one stream, with committed length ``prefix_len`` (s) and pending bonus token b:

1. ``depth_logprobs`` / ``depth_topk`` (or ``topk_logprobs`` straight from logits): per draft depth
   d = 1..D the K best (log-prob, token id), sorted by log-prob descending, ties -> lower token id.
2. ``build_tree``: the ``budget`` highest-scoring prefixes (best-first over a heap), see the total order
   below; returns a ``Tree`` in pop order (a parent always precedes its children).
3. ``flatten``: verify rows [root = b, node 1 .. node n], parents, depths, positions = s + depth,
   ancestor-or-self mask (bool and the packed uint32 layout of docs/CONTRACTS.md).
4. The target verifies all rows in one pass; ``greedy_walk`` / ``sample_walk`` accept a root-to-leaf path.
5. ``commit_plan``: latent-KV slot moves (src -> dst), feature rows for the drafter, new length.

Exact arithmetic (what the GPU reproduces bit for bit)
-----------------------------------------------------
* A node's score is a float32 sum along its path, in depth order, each addition rounded to float32 and
  flushed to zero when subnormal (the GPU compiles with -ftz=true):
  ``score(root) = 0``, ``score(node) = ftz(f32(score(parent) + top_lp[depth-1][rank]))``; subnormal
  ``top_lp`` inputs are read as (signed) zero.
  A sibling's score is recomputed from the parent's score (never "score - lp[r] + lp[r+1]").
* Total order of prefixes (smaller = popped earlier): score descending, then the **rank tuple** of the
  path (r_1, ..., r_d) lexicographically ascending, where a proper prefix sorts before its extensions.
  Rank tuples are unique, so the order is total. The GPU encodes the tuple as the integer
  ``sum_i (r_i + 1) << (8 * (8 - i))`` (depth <= 8, ranks <= 254), whose integer order is exactly this
  lexicographic order.
  Because top_lp rows are sorted descending and log-probs are <= 0, both successors of an entry (next
  sibling, first child) come after it in this order, so the heap pops ALL prefixes in exactly this order:
  the tree is the first ``budget`` prefixes of that order (prefix-closed by construction).
* ``cap_k``: only ranks < min(K, cap_k) are used (K = top_lp.shape[1]).
* ``include_chain``: the top-1 chain (rank 0 at every depth) is forced in. Its min(D, budget) nodes count
  towards the budget and take rows 1..Dc (row d = depth d); the remaining budget - Dc rows are the first
  non-chain prefixes of the total order, in that order. Equivalently: run the same heap, chain entries are
  popped in their place but not emitted again and not counted.

Log-probabilities for the GPU comparison
----------------------------------------
Token SELECTION is by the raw logit (float32 value of the fp32/bf16 input), ties -> lower id; the log-prob
of a selected token is ``logit - logsumexp(row)``. The GPU computes logsumexp in float32 with a different
summation order, so top-K ids must match exactly while log-probs match the float64 path
(``depth_logprobs(..., dtype=np.float64)``) to ~1e-6 relative. The tree builder is exact given its
(top_lp, top_id) input: GPU trees are compared with ``build_tree`` run on the GPU's own top-K arrays.

Sampling (``sample_tokens``): Philox4x32-10 keyed by ``slot_seed(seed, stream)``, counter
``(step << 8) | row`` (``philox_uniform``; the GPU sampler draws exactly these numbers). Emission: a round commits the accepted rows (the root is the previous bonus) and chooses a
new bonus; the GPU's ``out_tokens`` holds both (accepted tokens, then the bonus), so either policy works.
The decode loop (reference/loop.py, docs/CONTRACTS.md) emits the bonus as soon as it is chosen.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

MAX_TREE_ROWS = 129     # root + 128 nodes (docs/CONTRACTS.md)
MASK_WORDS = 5          # ceil(129 / 32)
MAX_DEPTH = 8           # rank-tuple key: 8 bits per depth in a uint64
MAX_RANK = 254          # (rank + 1) must fit in 8 bits
_FLT_MIN = np.float32(1.1754943508222875e-38)


# ----------------------------------------------------------------------------------------------------
# log-probabilities and per-depth top-K
# ----------------------------------------------------------------------------------------------------
def depth_logprobs(logits: np.ndarray, dtype=np.float64) -> np.ndarray:
    """Log-softmax over the last axis of ``logits [D, V]``.

    ``dtype=np.float64`` is the precision that defines the reference for GPU comparisons (the GPU's
    float32 log-sum-exp is checked against it with a relative tolerance). ``np.float32`` computes the same
    formula in float32 (max-shifted, exp, sum, log), as a cheaper engine-side path.
    """
    x = np.asarray(logits)
    if x.ndim != 2:
        raise ValueError(f"logits: expected [D, V], got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("logits: contains NaN or inf")
    x = x.astype(dtype)
    m = x.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=1, keepdims=True, dtype=dtype))
    return (x - lse).astype(dtype)


def depth_topk(logprobs: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
    """Per row of ``logprobs [D, V]`` the ``k`` best entries: (values [D, k] same dtype, ids [D, k] int32),
    sorted by value descending, ties -> lower token id first. Works on logits too (same order)."""
    x = np.asarray(logprobs)
    if x.ndim != 2:
        raise ValueError(f"logprobs: expected [D, V], got shape {x.shape}")
    D, V = x.shape
    if not isinstance(k, (int, np.integer)) or not 1 <= k <= V:
        raise ValueError(f"k: must be an integer in [1, V={V}], got {k!r}")
    if np.isnan(x).any():
        raise ValueError("logprobs: contains NaN")
    # lexsort: last key is primary. Sort by (-value, id): stable order of ids among equal values.
    ids = np.empty((D, k), np.int32)
    vals = np.empty((D, k), x.dtype)
    tok = np.arange(V)
    for d in range(D):
        order = np.lexsort((tok, -x[d].astype(np.float64)))[:k]
        ids[d] = order
        vals[d] = x[d, order]
    return vals, ids


def topk_logprobs(logits: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
    """What the GPU top-K stage computes, from raw logits ``[D, V]`` (float32, or bf16 already widened):
    ids by logit descending (ties -> lower id), log-probs ``float64(logit) - float64 logsumexp``.
    Returns (top_lp float64 [D, k], top_id int32 [D, k])."""
    x = np.asarray(logits, dtype=np.float32)
    _, ids = depth_topk(x, k)
    lp = depth_logprobs(x, np.float64)
    return np.take_along_axis(lp, ids.astype(np.int64), axis=1), ids


# ----------------------------------------------------------------------------------------------------
# tree builder
# ----------------------------------------------------------------------------------------------------
def _ftz(x: np.float32) -> np.float32:
    """Flush a float32 subnormal to (signed) zero, as the GPU does under -ftz=true."""
    if x != 0 and abs(x) < _FLT_MIN:
        return np.float32(np.copysign(0.0, x))
    return x


def add_f32(a, b) -> np.float32:
    """The score addition: float32 add, round to nearest, subnormal result flushed to zero."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _ftz(np.float32(np.float32(a) + np.float32(b)))


def rank_key(ranks: Sequence[int]) -> int:
    """Integer encoding of a rank tuple whose integer order is lexicographic order with a proper prefix
    first: sum (r_i + 1) << (8 * (8 - i)) for i = 1..d."""
    key = 0
    for i, r in enumerate(ranks):
        key |= (int(r) + 1) << (8 * (MAX_DEPTH - 1 - i))
    return key


@dataclass
class Tree:
    """A draft tree in pop order. Node i (0-based) is verify row i + 1; row 0 is the root (not stored)."""
    tokens: np.ndarray   # int32 [n] token id of each node
    parents: np.ndarray  # int32 [n] parent ROW (0 = root)
    depths: np.ndarray   # int32 [n] 1..D
    ranks: np.ndarray    # int32 [n] rank of the token in its depth's top-K list
    scores: np.ndarray   # float32 [n] path score (see module doc)

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    def rank_tuples(self) -> List[Tuple[int, ...]]:
        out: List[Tuple[int, ...]] = []
        for i in range(self.n):
            p = int(self.parents[i])
            out.append((out[p - 1] if p > 0 else ()) + (int(self.ranks[i]),))
        return out


def _check_top(top_lp, top_id):
    top_lp = np.asarray(top_lp)
    top_id = np.asarray(top_id)
    if top_lp.ndim != 2:
        raise ValueError(f"top_lp: expected [D, K], got shape {top_lp.shape}")
    if top_id.shape != top_lp.shape:
        raise ValueError(f"top_id: shape {top_id.shape} differs from top_lp {top_lp.shape}")
    D, K = top_lp.shape
    if not 1 <= D <= MAX_DEPTH:
        raise ValueError(f"top_lp: depth D={D} must be in [1, {MAX_DEPTH}]")
    if not 1 <= K <= MAX_RANK + 1:
        raise ValueError(f"top_lp: K={K} must be in [1, {MAX_RANK + 1}]")
    lp = top_lp.astype(np.float32)
    if np.isnan(lp).any():
        raise ValueError("top_lp: contains NaN")
    if (lp > 0).any():
        raise ValueError("top_lp: log-probabilities must be <= 0")
    if (np.diff(lp, axis=1) > 0).any():
        raise ValueError("top_lp: every depth's row must be sorted descending")
    # subnormal inputs are read as zero, like the GPU under -ftz
    lp = np.where(np.abs(lp) < _FLT_MIN, np.copysign(np.float32(0), lp), lp).astype(np.float32)
    return lp, top_id.astype(np.int32), D, K


def build_tree(top_lp: np.ndarray, top_id: np.ndarray, budget: int, cap_k: Optional[int] = None,
               include_chain: bool = False) -> Tree:
    """Best-first DDTree of at most ``budget`` nodes from per-depth top-K lists ``top_lp/top_id [D, K]``
    (depth d = row d - 1, sorted descending). Scores are float32 (``top_lp`` is cast to float32 first).
    See the module docstring for the exact order, ``cap_k`` and ``include_chain``."""
    lp, ids, D, K = _check_top(top_lp, top_id)
    if not isinstance(budget, (int, np.integer)) or not 0 <= budget <= MAX_TREE_ROWS - 1:
        raise ValueError(f"budget: must be an integer in [0, {MAX_TREE_ROWS - 1}], got {budget!r}")
    if cap_k is not None and (not isinstance(cap_k, (int, np.integer)) or cap_k < 1):
        raise ValueError(f"cap_k: must be None or an integer >= 1, got {cap_k!r}")
    k_eff = K if cap_k is None else min(K, int(cap_k))

    toks: List[int] = []
    pars: List[int] = []
    deps: List[int] = []
    rnks: List[int] = []
    scs: List[np.float32] = []

    def emit(depth, rank, parent_row, score):
        toks.append(int(ids[depth - 1, rank]))
        pars.append(parent_row)
        deps.append(depth)
        rnks.append(rank)
        scs.append(score)
        return len(toks)  # its row

    n_chain = min(D, budget) if include_chain else 0
    s = np.float32(0.0)
    for d in range(1, n_chain + 1):
        s = add_f32(s, lp[d - 1, 0])
        emit(d, 0, d - 1, s)

    # heap entry: (-score, rank key, score, parent score, depth, rank, parent row, rank tuple, on chain)
    # -score as a Python float of a float32 value compares exactly like the float32.
    def entry(pscore, depth, rank, prow, ptuple, on_chain):
        sc = add_f32(pscore, lp[depth - 1, rank])
        tup = ptuple + (rank,)
        return (-float(sc), rank_key(tup), sc, pscore, depth, rank, prow, tup, on_chain)

    heap = []
    if budget > 0:
        heap.append(entry(np.float32(0.0), 1, 0, 0, (), n_chain >= 1))
    while heap and len(toks) < budget:
        _, _, sc, psc, depth, rank, prow, tup, on_chain = heapq.heappop(heap)
        row = depth if on_chain else emit(depth, rank, prow, sc)
        if rank + 1 < k_eff:
            heapq.heappush(heap, entry(psc, depth, rank + 1, prow, tup[:-1], False))
        if depth < D:
            heapq.heappush(heap, entry(sc, depth + 1, 0, row, tup, on_chain and depth + 1 <= n_chain))
    return Tree(np.array(toks, np.int32), np.array(pars, np.int32), np.array(deps, np.int32),
                np.array(rnks, np.int32), np.array(scs, np.float32))


# ----------------------------------------------------------------------------------------------------
# flattening for verification
# ----------------------------------------------------------------------------------------------------
@dataclass
class FlatTree:
    """Verify rows 0..n (row 0 = root = bonus token)."""
    tokens: np.ndarray     # int32 [n+1]
    parents: np.ndarray    # int32 [n+1], -1 for the root
    depths: np.ndarray     # int32 [n+1], 0 for the root
    positions: np.ndarray  # int32 [n+1] = prefix_len + depth (RoPE position)
    mask: np.ndarray       # bool [n+1, n+1], mask[i, j] = row j is an ancestor of row i or j == i
    mask_bits: np.ndarray  # uint32 [n+1, MASK_WORDS]: bit j % 32 of word j // 32 <=> mask[i, j]

    @property
    def n_rows(self) -> int:
        return int(self.tokens.shape[0])


def pack_mask(mask: np.ndarray) -> np.ndarray:
    """bool [R, C] (C <= 160) -> uint32 [R, MASK_WORDS] in the CONTRACTS.md bit layout."""
    R, C = mask.shape
    if C > 32 * MASK_WORDS:
        raise ValueError(f"mask: {C} columns exceed {32 * MASK_WORDS}")
    out = np.zeros((R, MASK_WORDS), np.uint32)
    for j in range(C):
        out[:, j // 32] |= mask[:, j].astype(np.uint32) << np.uint32(j % 32)
    return out


def flatten(tree: Tree, bonus: int, prefix_len: int) -> FlatTree:
    """Verify input of ``tree`` for a stream whose committed length is ``prefix_len``."""
    if prefix_len < 0:
        raise ValueError(f"prefix_len: must be >= 0, got {prefix_len}")
    n = tree.n
    tokens = np.concatenate([[bonus], tree.tokens]).astype(np.int32)
    parents = np.concatenate([[-1], tree.parents]).astype(np.int32)
    depths = np.concatenate([[0], tree.depths]).astype(np.int32)
    positions = (prefix_len + depths).astype(np.int32)
    mask = np.zeros((n + 1, n + 1), bool)
    for i in range(n + 1):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return FlatTree(tokens, parents, depths, positions, mask, pack_mask(mask))


# ----------------------------------------------------------------------------------------------------
# acceptance walks
# ----------------------------------------------------------------------------------------------------
def greedy_walk(tokens: np.ndarray, parents: np.ndarray, post_tokens: np.ndarray) -> Tuple[List[int], int]:
    """Walk the flattened tree (rows 0..n, ``tokens``/``parents`` as from ``flatten``) with the target's
    per-row token ``post_tokens [n+1]`` (argmax for greedy, a sample for ``sample_walk``): from the root,
    move to the child whose token equals post[current] (lowest row if several) until none does.
    Returns (accepted rows starting with 0, new bonus token = post[last accepted row])."""
    tokens = np.asarray(tokens)
    parents = np.asarray(parents)
    post = np.asarray(post_tokens)
    if not (tokens.shape == parents.shape == post.shape) or tokens.ndim != 1:
        raise ValueError(f"tokens/parents/post_tokens: need equal 1-D shapes, got {tokens.shape}, "
                         f"{parents.shape}, {post.shape}")
    rows = [0]
    cur = 0
    while True:
        nxt = -1
        for c in range(cur + 1, tokens.shape[0]):   # children always come after their parent
            if parents[c] == cur and tokens[c] == post[cur]:
                nxt = c
                break
        if nxt < 0:
            return rows, int(post[cur])
        rows.append(nxt)
        cur = nxt


def argmax_lowest(logits: np.ndarray) -> np.ndarray:
    """Per-row argmax with ties -> lowest id (numpy's argmax already returns the first maximum)."""
    return np.asarray(logits).argmax(axis=-1).astype(np.int32)


# --- Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) ---------------
_PHILOX_M0 = np.uint64(0xD2511F53)
_PHILOX_M1 = np.uint64(0xCD9E8D57)
_PHILOX_W0 = np.uint32(0x9E3779B9)
_PHILOX_W1 = np.uint32(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32(counter: np.ndarray, key: Tuple[int, int]) -> np.ndarray:
    """Philox4x32 with 10 rounds. ``counter`` uint32 [..., 4], ``key`` (k0, k1) -> uint32 [..., 4]."""
    c = np.asarray(counter, dtype=np.uint32)
    if c.shape[-1] != 4:
        raise ValueError(f"counter: last dimension must be 4, got {c.shape}")
    c0, c1, c2, c3 = (c[..., i].astype(np.uint64) for i in range(4))
    k0 = np.uint32(key[0] & 0xFFFFFFFF)
    k1 = np.uint32(key[1] & 0xFFFFFFFF)
    for _ in range(10):
        p0 = _PHILOX_M0 * c0            # 32 x 32 -> 64 bit products, exact in uint64
        p1 = _PHILOX_M1 * c2
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
        c0, c1, c2, c3 = (hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0)
        k0 = np.uint32((int(k0) + int(_PHILOX_W0)) & 0xFFFFFFFF)
        k1 = np.uint32((int(k1) + int(_PHILOX_W1)) & 0xFFFFFFFF)
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


_M64 = 0xFFFFFFFFFFFFFFFF


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def slot_seed(seed: int, sample_stream: int) -> int:
    """The Philox key of a stream: the request seed mixed with its sample_stream (two streams with the same
    seed draw independent numbers). The GPU sampler is keyed by exactly this value."""
    return splitmix64((int(seed) ^ splitmix64(int(sample_stream) + 1)) & _M64)


def sample_counter(step: int, row: int) -> int:
    """The 64-bit Philox counter of tree row ``row`` (< 256) at decode step ``step`` (0 = prefill): the
    GPU sampler's ``steps`` value, (step << 8) | row."""
    return ((int(step) << 8) | int(row)) & _M64


def philox_uniform(key: int, counter: np.ndarray) -> np.ndarray:
    """THE sampling mapping, shared with cuda_src/sample.cu: Philox4x32-10 with key (key low 32, key high 32)
    and counter (counter low 32, counter high 32, 0, 0); u = ((x0 >> 8) + 0.5) / 2^24, exactly
    representable, in (0, 1)."""
    c = np.asarray(counter, dtype=np.uint64).reshape(-1)
    ctr = np.zeros((c.shape[0], 4), np.uint32)
    ctr[:, 0] = (c & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    ctr[:, 1] = (c >> np.uint64(32)).astype(np.uint32)
    x = philox4x32(ctr, (key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF))
    return ((x[:, 0] >> np.uint32(8)).astype(np.float64) + 0.5) / float(1 << 24)


def sampling_uniforms(seed: int, stream: int, step: int, rows: int) -> np.ndarray:
    """One uniform per tree row: ``philox_uniform(slot_seed(seed, stream), sample_counter(step, row))``."""
    if not 0 <= rows <= 256:
        raise ValueError(f"rows: at most 256 tree rows per step (8-bit row field), got {rows}")
    ctr = np.array([sample_counter(step, r) for r in range(rows)], np.uint64)
    return philox_uniform(slot_seed(seed, stream), ctr)


def sample_from_logits(logits: np.ndarray, u: float, temperature: float, top_p: float = 1.0,
                       top_k: int = 0) -> int:
    """One token from ``logits [V]`` with uniform ``u`` in (0, 1). Order of operations (float64):
    temperature <= 0 -> argmax (lowest id on ties). Otherwise p = softmax(logits / T); candidates sorted by
    p descending, ties -> lower id; keep the first top_k (0 = all); then keep the shortest head whose
    cumulative sum >= top_p * (sum of the kept); renormalise; return the first sorted candidate whose
    running cumulative sum exceeds u * total."""
    x = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        return int(x.argmax())
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
    z = x / temperature
    p = np.exp(z - z.max())
    order = np.lexsort((np.arange(x.shape[0]), -p))
    ps = p[order]
    if top_k and top_k > 0:
        ps = ps[:top_k]
    c = np.cumsum(ps)
    if top_p < 1.0:
        keep = int(np.searchsorted(c, top_p * c[-1], side="left")) + 1
        ps = ps[:keep]
        c = c[:keep]
    idx = int(np.searchsorted(c, u * c[-1], side="right"))
    return int(order[min(idx, ps.shape[0] - 1)])


def sample_tokens(logits: np.ndarray, temperature: float, top_p: float, top_k: int, seed: int,
                  stream: int, step: int) -> np.ndarray:
    """Per-row target samples ``[n+1]`` for the tree rows' target logits ``[n+1, V]``."""
    u = sampling_uniforms(seed, stream, step, logits.shape[0])
    return np.array([sample_from_logits(logits[i], u[i], temperature, top_p, top_k)
                     for i in range(logits.shape[0])], np.int32)


def sample_walk(tokens: np.ndarray, parents: np.ndarray, target_logits: np.ndarray, temperature: float,
                top_p: float, top_k: int, seed: int, stream: int, step: int) -> Tuple[List[int], int]:
    """The greedy walk with post[i] SAMPLED from the target's distribution at row i (lossless)."""
    post = sample_tokens(target_logits, temperature, top_p, top_k, seed, stream, step)
    return greedy_walk(tokens, parents, post)


# ----------------------------------------------------------------------------------------------------
# commit
# ----------------------------------------------------------------------------------------------------
@dataclass
class CommitPlan:
    src_slots: np.ndarray     # int32 [a] cache positions prefix_len + row(j)
    dst_slots: np.ndarray     # int32 [a] cache positions prefix_len + j (copy in this order, j ascending)
    feature_rows: np.ndarray  # int32 [a] tree rows whose target features feed the drafter's next context
    new_len: int              # prefix_len + a


def commit_plan(accepted_rows: Sequence[int], depths: np.ndarray, prefix_len: int) -> CommitPlan:
    """KV compaction and drafter-context rows for accepted tree rows (``accepted_rows[0] == 0``, the j-th
    accepted row has depth j). Copying src[j] -> dst[j] for j ascending never overwrites an unread source
    because rows are strictly increasing along a root path, so row(k) >= k > j for every later k.
    The j = 0 entry (the root, src == dst) is included: a copy kernel may skip src == dst."""
    rows = np.asarray(list(accepted_rows), np.int32)
    depths = np.asarray(depths)
    if rows.ndim != 1 or rows.shape[0] < 1 or rows[0] != 0:
        raise ValueError(f"accepted_rows: must start with the root row 0, got {rows.tolist()}")
    if (np.diff(rows) <= 0).any():
        raise ValueError(f"accepted_rows: must be strictly increasing, got {rows.tolist()}")
    if not np.array_equal(depths[rows], np.arange(rows.shape[0])):
        raise ValueError(f"accepted_rows: depth of the j-th accepted row must be j, got {depths[rows]}")
    a = rows.shape[0]
    return CommitPlan((prefix_len + rows).astype(np.int32),
                      (prefix_len + np.arange(a)).astype(np.int32), rows.copy(), int(prefix_len + a))
