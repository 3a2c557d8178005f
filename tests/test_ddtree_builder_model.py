"""A CPU model of builder v3 (cuda_src/ddtree.cu, budgets above DDT_CACHE_BUDGET), lane by lane, against
the numpy reference builder (ddtree_cupy/reference/ddtree.py). The model follows the kernel's state: the
ordered scores in registers (32 lanes x DDT_SLOTS slots, position p = slot p // 32 of lane p % 32), the
rest of each entry in shared memory at [p] (rank tuple, info word, parent score and the log-probs of the
entry's next sibling and first child, set when the entry is written), the fast pop (one warp max, a
single holder found from one ballot per slot) and the tie pop (per-lane smallest tuple
among its slots equal to the max, then a min over the high and the low 32 bits). It also checks what the
GPU cannot report: every shared entry read was written first, positions stay inside the register slots,
and the tie paths are exercised. The GPU tests (tests/gpu/test_ddtree_gpu.py) run the kernels themselves
against the same reference.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ddtree_cupy.reference import ddtree as dd

SRC = (Path(__file__).resolve().parents[1] / "cuda_src" / "ddtree.cu").read_text()
V3 = SRC[SRC.index("// Builder v3 (budgets above DDT_CACHE_BUDGET)"):]
SLOTS = int(re.search(r"#define DDT_SLOTS (\d+)", V3).group(1))
MAX_ROWS = dd.MAX_TREE_ROWS
MASK32 = 0xFFFFFFFF


def _bits(f) -> int:
    return int(np.array([f], np.float32).view(np.uint32)[0])


def ordered(f) -> int:
    """f32_to_ordered: -0.0 -> +0.0, then negative: flip all bits, positive: set the sign bit."""
    b = _bits(np.float32(f) + np.float32(0.0))
    return (~b) & MASK32 if b & 0x80000000 else b | 0x80000000


def from_ordered(o: int) -> np.float32:
    b = (o & 0x7FFFFFFF) if o & 0x80000000 else (~o) & MASK32
    return np.array([b], np.uint32).view(np.float32)[0]


def ordered_sum(a, b) -> int:
    """v3's ordered_sum: the float32 sum, zero or subnormal (either sign) -> the key of +0.0, else the
    ordered bit map; must equal ordered(add_f32(a, b)) (tested below)."""
    with np.errstate(over="ignore", invalid="ignore"):
        r = np.float32(np.float32(a) + np.float32(b))
    u = 0 if abs(r) < np.float32(1.17549435e-38) else _bits(r)
    return u ^ ((MASK32 if u & 0x80000000 else 0) | 0x80000000)


def digit(d: int, r: int) -> int:      # tuple_digit
    return (r + 1) << (8 * (8 - d))


def pack(d: int, r: int, prow: int, chain: int) -> int:   # pack_info
    return d | (r << 4) | (prow << 12) | (chain << 20)


class Shared:
    """A shared-memory array that remembers which entries were written (reading others is a bug)."""

    def __init__(self, n):
        self.v = [None] * n

    def __getitem__(self, i):
        assert self.v[i] is not None, f"read of unwritten shared entry {i}"
        return self.v[i]

    def __setitem__(self, i, x):
        self.v[i] = x


def kernel_inputs(lp_in, ids, budget, cap_k, include_chain):
    """What both builder loops read first, as the kernel computes it: the log-probs with subnormals flushed
    to signed zero and the ids, flattened; the budget clamped to the row limit; the per-depth fan-out kf
    (cap_k, 0 = no cap); the number of chain rows nc."""
    D, K = lp_in.shape
    lp = np.where(np.abs(lp_in) < np.float32(1.17549435e-38), np.copysign(np.float32(0), lp_in),
                  lp_in).astype(np.float32)
    budget = min(max(int(budget), 0), MAX_ROWS - 1)
    kf = min(K, cap_k) if cap_k > 0 else K
    nc = min(D, budget) if include_chain else 0
    return lp.reshape(-1), ids.reshape(-1), budget, kf, nc


def build_v3(lp_in, ids, budget, cap_k, include_chain, stats):
    """The v3 kernel's builder for one stream: returns (tokens, parents, depths) of rows 1..n. Every lane
    knows the popped position; entries are (info, parent score, next sibling's lp, first child's lp)."""
    D, K = lp_in.shape
    s_lp, s_id, budget, kf, nc = kernel_inputs(lp_in, ids, budget, cap_k, include_chain)
    t_tok, t_par, t_dep = Shared(MAX_ROWS), Shared(MAX_ROWS), Shared(MAX_ROWS)
    for lane in range(1, nc + 1):
        t_tok[lane], t_par[lane], t_dep[lane] = int(s_id[(lane - 1) * K]), lane - 1, lane
    os_ = np.zeros((32, SLOTS), np.int64)
    e_ent, e_tup = Shared(32 * SLOTS), Shared(32 * SLOTS)
    nodes, live, npos = nc, 0, 0
    if budget > 0:
        os_[0, 0] = ordered_sum(0.0, s_lp[0])
        e_ent[0] = [pack(1, 0, 0, int(nc >= 1)), np.float32(0.0), s_lp[min(1, K - 1)], s_lp[min(1, D - 1) * K]]
        e_tup[0] = digit(1, 0)
        live = npos = 1
    while live > 0 and nodes < budget:
        M = int(os_.max())
        assert M > 0, "the frontier is not empty while live > 0"
        w = [sum(1 << lane for lane in range(32) if os_[lane, s] == M) for s in range(SLOTS)]   # ballots
        cnt = sum(bin(x).count("1") for x in w)
        if cnt == 1:
            stats["fast"] += 1
            bs = 0
            for s in range(1, SLOTS):
                bs = s if w[s] else bs
            anyw = 0
            for x in w:
                anyw |= x
            wl = (anyw & -anyw).bit_length() - 1
        else:
            stats["tie"] += 1
            stats["same_lane"] += int(any(sum(os_[lane] == M) > 1 for lane in range(32)))
            bt, lbs = [(1 << 64) - 1] * 32, [-1] * 32
            for lane in range(32):
                for s in range(SLOTS):
                    if os_[lane, s] == M:
                        t = e_tup[s * 32 + lane]
                        if t < bt[lane]:
                            bt[lane], lbs[lane] = t, s
            mh = min(t >> 32 for t in bt)
            tl = [(t & MASK32) if (t >> 32) == mh else MASK32 for t in bt]
            ml = min(tl)
            who = [lane for lane in range(32) if lbs[lane] >= 0 and bt[lane] == (mh << 32 | ml)]
            assert len(who) == 1, "rank tuples are unique"
            wl = who[0]
            bs = lbs[wl]                         # __shfl_sync(lbs, wl)
        p = bs * 32 + wl
        info, ps, lsib, lchild = e_ent[p]
        tup = e_tup[p]
        d, r, prow, chain = info & 15, (info >> 4) & 255, (info >> 12) & 255, (info >> 20) & 1
        # the carried log-probs are the ones the reference uses
        if r + 1 < kf:
            assert lsib == s_lp[(d - 1) * K + r + 1]
        if d < D:
            assert lchild == s_lp[d * K]
        has_sib, has_child = r + 1 < kf, d < D
        sc = from_ordered(M)
        sib_os = ordered_sum(ps, lsib) if has_sib else 0
        child_os = ordered_sum(sc, lchild)
        os_[wl, bs] = sib_os
        if has_child:
            assert npos < 32 * SLOTS, "positions fit the register slots"
            os_[npos & 31, npos >> 5] = child_os
        row = d if chain else nodes + 1
        tok = int(s_id[(d - 1) * K + r])
        l_sib2 = s_lp[(d - 1) * K + min(r + 2, K - 1)]
        l_c1 = s_lp[min(d, D - 1) * K + min(1, K - 1)]
        l_cc = s_lp[min(d + 1, D - 1) * K]
        if not chain:
            t_tok[row], t_par[row], t_dep[row] = tok, prow, d
        if has_sib:
            e_ent[p] = [pack(d, r + 1, prow, 0), ps, l_sib2, lchild]
            e_tup[p] = tup + digit(d, 0)
        if has_child:
            e_ent[npos] = [pack(d + 1, 0, row, int(bool(chain) and d + 1 <= nc)), sc, l_c1, l_cc]
            e_tup[npos] = tup + digit(d + 1, 0)
        nodes += 0 if chain else 1
        live += (1 if has_child else 0) - (0 if has_sib else 1)
        npos += 1 if has_child else 0
    n = nodes
    return (np.array([t_tok[i] for i in range(1, n + 1)], np.int32),
            np.array([t_par[i] for i in range(1, n + 1)], np.int32),
            np.array([t_dep[i] for i in range(1, n + 1)], np.int32))


def _top(rng, D, K, kind):
    if kind == "normal":
        vals = np.minimum((rng.standard_normal((D, K)) * 2 - 3).astype(np.float32), 0)
    elif kind == "dyadic":       # many exact score ties, across lanes and inside one lane
        vals = -rng.integers(0, 4, size=(D, K)).astype(np.float32) * 0.5
    elif kind == "quarter":      # sparser ties: often exactly two maxima, sometimes in one lane's slots,
        vals = -rng.integers(0, 32, size=(D, K)).astype(np.float32) * 0.25   # where slot order != tuple order
    elif kind == "zero":         # every score 0 (+0.0 and -0.0 mixed): the rank tuple decides every pop
        vals = np.where(rng.random((D, K)) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    else:                        # subnormal log-probs (read as zero) next to normal ones
        vals = -rng.integers(0, 3, size=(D, K)).astype(np.float32) * np.float32(1e-39)
        vals[:, K // 2:] = -np.float32(2.0)
    lp = vals if kind == "zero" else -np.sort(-vals, axis=-1)   # zeros of both signs are "sorted" as drawn
    ids = rng.integers(0, 50000, size=(D, K)).astype(np.int32)
    return lp, ids


KINDS = ["normal", "dyadic", "quarter", "zero", "subnormal"]


@pytest.mark.parametrize("kind", KINDS)
def test_builder_model_equals_reference(kind):
    model = build_v3
    rng = np.random.default_rng(KINDS.index(kind) + 1)
    stats = dict(fast=0, tie=0, same_lane=0)
    for trial in range(120 if kind == "quarter" else 60):
        if trial < 4:            # the largest frontier: depth 8, budget 128 (positions up to 137)
            D, K, budget = 8, 128, 128
        else:
            D, K, budget = int(rng.integers(1, 9)), int(rng.integers(1, 129)), int(rng.integers(-2, 131))
        lp, ids = _top(rng, D, K, kind)
        cap = int(rng.choice([0, 1, 3, 8, 200]))
        chain = bool(rng.integers(0, 2))
        t = dd.build_tree(lp, ids, min(max(budget, 0), MAX_ROWS - 1), cap_k=cap or None, include_chain=chain)
        tok, par, dep = model(lp, ids, budget, cap, chain, stats)
        msg = f"trial {trial}: D {D} K {K} budget {budget} cap {cap} chain {chain}"
        np.testing.assert_array_equal(tok, t.tokens, err_msg=msg)
        np.testing.assert_array_equal(par, t.parents, err_msg=msg)
        np.testing.assert_array_equal(dep, t.depths, err_msg=msg)
    # the cases reach the paths they are meant to reach
    assert stats["fast"] > 0 or kind == "zero"
    if kind != "normal":
        assert stats["tie"] > 0 and stats["same_lane"] > 0, stats


def test_models_follow_the_kernels():
    assert SLOTS * 32 >= (MAX_ROWS - 1) + dd.MAX_DEPTH + 1   # pops + 1 <= budget + D + 1 positions
    # the kernels' key statements the models follow (a change there must be mirrored here)
    for stmt in ("w[s] = __ballot_sync(FULL_MASK, os[s] == M);",
                 "for (int s = 1; s < DDT_SLOTS; ++s) bs = w[s] ? s : bs;",
                 "wl = __ffs(any) - 1;",
                 "bs = __shfl_sync(FULL_MASK, lbs, wl);",
                 "for (int s = 0; s < DDT_SLOTS; ++s) os[s] = s == sp ? sib_os : (s == cp ? child_os : os[s]);",
                 "return u ^ ((uint32_t)((int)u >> 31) | 0x80000000u);",
                 "const float l_sib2 = s_lp[(d - 1) * K + min(r + 2, K - 1)];",
                 "const float l_c1 = s_lp[min(d, D - 1) * K + min(1, K - 1)];",
                 "const float l_cc = s_lp[min(d + 1, D - 1) * K];",
                 "e_ent[p].z = __float_as_int(l_sib2);",
                 "e_tup[npos] = tup + tuple_digit(d + 1, 0);"):
        assert stmt in V3, stmt


def test_ordered_sum_equals_the_ordered_score_sum():
    """v3 folds score_add's flush and f32_to_ordered's -0.0 canonicalisation into one step."""
    rng = np.random.default_rng(5)
    tiny = np.float32(1.17549435e-38)
    edge = np.array([0.0, -0.0, tiny, -tiny, tiny / 2, -tiny / 2, np.float32(1e-45), -np.float32(1e-45),
                     1.5 * tiny, -1.5 * tiny, -1.0, -0.5, -np.inf, -3.4e38, 2.0 * tiny], np.float32)
    a = np.concatenate([edge, -np.abs(rng.standard_normal(400).astype(np.float32)) * 8,
                        (rng.standard_normal(200) * 1e-37).astype(np.float32)])
    for x in a:
        for y in edge:
            assert ordered_sum(x, y) == ordered(dd.add_f32(x, y)), (x, y)
            assert ordered_sum(y, x) == ordered(dd.add_f32(y, x)), (y, x)

