"""A CPU model of the sorted-cache tree builder (cuda_src/ddtree.cu, `cache_pops`), lane by lane, against the
numpy reference builder (ddtree_cupy/reference/ddtree.py).

The model follows the kernel's state exactly: 32 lanes each holding one entry (ordered score, rank tuple,
info word, parent score, next sibling's log-prob, first child's log-prob) in registers, the warp-uniform
head, the broadcast of lane 1 (`e1`), the two ballots that rank the popped entry's sibling and child among
lanes 1 .. n-1, the one shuffle round (source lane taken modulo 32 as `__shfl_sync` does) and the selects.
Entries past index 31 fall off; the test checks on adversarial inputs that this never changes the tree
for budgets <= 64 (the argument is in the kernel's comment) and that the drop actually happens in the
tests, as do ties decided by the rank tuple and every way of choosing the next head. Budgets above 64 run
v3's loop in the same kernel (modelled in tests/test_ddtree_builder_model.py).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ddtree_cupy.reference import ddtree as dd
from test_ddtree_builder_model import KINDS, _top, digit, from_ordered, kernel_inputs, ordered_sum, pack

SRC = (Path(__file__).resolve().parents[1] / "cuda_src" / "ddtree.cu").read_text()
CACHE = SRC[SRC.index("#define DDT_CACHE_BUDGET"):SRC.index("ddt_build_tree(", SRC.index("#define DDT_CACHE_BUDGET"))]
CACHE_BUDGET = int(re.search(r"#define DDT_CACHE_BUDGET (\d+)", SRC).group(1))
MAX_ROWS = dd.MAX_TREE_ROWS
U64 = (1 << 64) - 1


def pops_before(a, b) -> bool:
    """a = (os, tup, ...) pops before b: score descending, then the rank tuple ascending."""
    return a[0] > b[0] or (a[0] == b[0] and a[1] < b[1])


def ballot(pred) -> int:
    return sum(1 << lane for lane in range(32) if pred(lane))


def build_cache(lp_in, ids, budget, cap_k, include_chain, stats, width=32):
    """cache_pops for one stream (budget <= DDT_CACHE_BUDGET): returns (tokens, parents, depths) of rows
    1..n. ``width`` is the lane count (32 in the kernel; the test shrinks it to show the bound matters).
    The loop stores the popped info word at its row (scratch slots past the rows for the other lanes and
    chain pops) and every lane decodes its rows after the loop."""
    D, K = lp_in.shape
    s_lp, s_id, budget, kf, nc = kernel_inputs(lp_in, ids, budget, cap_k, include_chain)
    t_tok, t_par, t_dep, t_info = {}, {}, {}, {}
    for lane in range(1, nc + 1):    # the chain rows (the kernel's prologue, shared by both loops)
        t_tok[lane], t_par[lane], t_dep[lane] = int(s_id[(lane - 1) * K]), lane - 1, lane
    nodes = nc
    if budget > 0:
        # entry = (os, tup, info, ps, ls, lc)
        h = (ordered_sum(0.0, s_lp[0]), digit(1, 0), pack(1, 0, 0, int(nc >= 1)), np.float32(0.0),
             s_lp[min(1, K - 1)], s_lp[min(1, D - 1) * K])
        c = [h] * width
        n = 1
        while n > 0 and nodes < budget:
            e1 = c[1 % width]                                   # cent_shfl(c, 1)
            os_h, tup, info, ps, ls, lc = h
            d, r, prow, chain = info & 15, (info >> 4) & 255, (info >> 12) & 255, (info >> 20) & 1
            # the carried log-probs are the ones the reference uses
            if r + 1 < kf:
                assert ls == s_lp[(d - 1) * K + r + 1]
            if d < D:
                assert lc == s_lp[d * K]
            has_sib, has_child = r + 1 < kf, d < D
            sc = from_ordered(os_h)
            row = d if chain else nodes + 1
            sib = (ordered_sum(ps, ls), (tup + digit(d, 0)) & U64, pack(d, r + 1, prow, 0), ps,
                   s_lp[(d - 1) * K + min(r + 2, K - 1)], lc)
            ch = (ordered_sum(sc, lc), (tup + (digit(min(d + 1, 8), 0) if has_child else 0)) & U64,
                  pack(d + 1, 0, row, int(bool(chain) and d + 1 <= nc)), sc,
                  s_lp[min(d, D - 1) * K + min(1, K - 1)], s_lp[min(d + 1, D - 1) * K])
            valid = [1 <= lane < n for lane in range(width)]
            bs = ballot(lambda lane: lane < width and valid[lane] and pops_before(c[lane], sib))
            bc = ballot(lambda lane: lane < width and valid[lane] and pops_before(c[lane], ch))
            child_first = pops_before(ch, sib)
            pos_s = bin(bs).count("1") + int(has_child and child_first) if has_sib else 64
            pos_c = bin(bc).count("1") + int(has_sib and not child_first) if has_child else 64
            for lane in range(width):
                t_info[row if (lane == 0 and not chain) else MAX_ROWS + lane] = info
            # one shuffle round: lane j reads lane src (modulo the width), then the selects
            new = []
            for lane in range(width):
                src = lane + 1 - int(pos_s < lane) - int(pos_c < lane)
                moved = c[src % width]
                new.append(sib if lane == pos_s else (ch if lane == pos_c else moved))
            n_full = n - 1 + int(has_sib) + int(has_child)
            stats["drop"] += int(n_full > width)
            stats["head_sib"] += int(pos_s == 0)
            stats["head_child"] += int(pos_c == 0)
            stats["head_e1"] += int(pos_s != 0 and pos_c != 0 and n_full > 0)
            stats["tie"] += int(any(valid[lane] and c[lane][0] in (sib[0], ch[0]) for lane in range(width))
                                or (has_sib and has_child and sib[0] == ch[0]))
            h = sib if pos_s == 0 else (ch if pos_c == 0 else e1)
            c = new
            n = min(n_full, width)
            nodes += 0 if chain else 1
            # the kernel's invariant: entries 0 .. n-1 are sorted in pop order and entry 0 is the head
            if n > 0:
                assert c[0] == h
                assert all(pops_before(c[i], c[i + 1]) for i in range(n - 1)), "cache sorted"
    for i in range(nc + 1, nodes + 1):   # the decode after the loop: rows nc + 1 .. nodes, one lane each
        info = t_info[i]          # KeyError: a row the loop never wrote
        d, r = info & 15, (info >> 4) & 255
        t_tok[i], t_par[i], t_dep[i] = int(s_id[(d - 1) * K + r]), (info >> 12) & 255, d
    rows = range(1, nodes + 1)
    return (np.array([t_tok[i] for i in rows], np.int32), np.array([t_par[i] for i in rows], np.int32),
            np.array([t_dep[i] for i in rows], np.int32))


def _check(lp, ids, budget, cap, chain, stats, msg, width=32):
    t = dd.build_tree(lp, ids, min(max(budget, 0), MAX_ROWS - 1), cap_k=cap or None, include_chain=chain)
    tok, par, dep = build_cache(lp, ids, budget, cap, chain, stats, width)
    np.testing.assert_array_equal(tok, t.tokens, err_msg=msg)
    np.testing.assert_array_equal(par, t.parents, err_msg=msg)
    np.testing.assert_array_equal(dep, t.depths, err_msg=msg)


def _stats():
    return dict(drop=0, head_sib=0, head_child=0, head_e1=0, tie=0)


@pytest.mark.parametrize("kind", KINDS)
def test_cache_model_equals_reference(kind):
    rng = np.random.default_rng(100 + KINDS.index(kind))
    stats = _stats()
    for trial in range(50):
        if trial < 4:            # the largest cached case: depth 8, budget 64 (the cache overflows)
            D, K, budget = 8, 64 + 8 * trial, CACHE_BUDGET
        else:
            D, K, budget = int(rng.integers(1, 9)), int(rng.integers(1, 129)), int(rng.integers(-2, CACHE_BUDGET + 1))
        lp, ids = _top(rng, D, K, kind)
        cap = int(rng.choice([0, 1, 3, 8, 200]))
        chain = bool(rng.integers(0, 2))
        _check(lp, ids, budget, cap, chain, stats, f"trial {trial}: D {D} K {K} budget {budget} cap {cap} chain {chain}")
    assert stats["head_e1"] > 0 and stats["head_child"] > 0 and stats["head_sib"] > 0, stats
    if kind != "normal":
        assert stats["tie"] > 0, stats


def _flat_top(D, K, rng):
    """Log-probs that fall slowly with the rank (-0.05 - 0.1 r, a little noise): nodes of every depth
    interleave in the pop order and the frontier grows by about one entry per pop, the worst case for the
    cache's size (entries fall off its end from pop 32 on)."""
    lp = -(np.float32(0.05) + np.float32(0.1) * np.arange(K, dtype=np.float32)[None, :]
           + rng.random((D, K)).astype(np.float32) * np.float32(0.01))
    lp = -np.sort(-lp, axis=-1)
    return lp.astype(np.float32), rng.integers(0, 50000, size=(D, K)).astype(np.int32)


def test_cache_drops_only_entries_that_never_pop():
    """Flat and tie-heavy inputs at budgets 33..64: entries fall off the 32-entry cache and the tree is
    still the reference's; with fewer lanes than budget / 2 the same inputs give a different tree (the bound
    in the kernel's comment is what makes the drop safe, and the test can tell)."""
    rng = np.random.default_rng(7)
    stats = _stats()
    for trial in range(24):
        D, K = 8, int(rng.integers(32, 129))
        budget = int(rng.integers(33, CACHE_BUDGET + 1)) if trial else CACHE_BUDGET
        lp, ids = _flat_top(D, K, rng) if trial % 2 == 0 else _top(rng, D, K, "dyadic")
        _check(lp, ids, budget, 0, bool(trial % 3 == 0), stats, f"trial {trial}: K {K} budget {budget}")
    assert stats["drop"] > 0, stats
    lp, ids = _flat_top(8, 128, rng)
    t = dd.build_tree(lp, ids, CACHE_BUDGET)
    tok, _, _ = build_cache(lp, ids, CACHE_BUDGET, 0, False, _stats(), width=16)
    assert not np.array_equal(tok, t.tokens), "16 entries must be too few for budget 64 on a flat draft"


def test_cache_model_follows_the_kernel():
    assert CACHE_BUDGET == 64 and 2 * 32 >= CACHE_BUDGET
    from ddtree_cupy.kernels import ddtree as ddt
    assert ddt.CACHE_MAX_BUDGET == CACHE_BUDGET
    for stmt in ("return oa > ob || (oa == ob && ta < tb);",
                 "const CEnt e1 = cent_shfl(c, 1);",
                 "sib.os = ordered_sum(h.ps, h.ls);",
                 "sib.tup = h.tup + tuple_digit(d, 0);",
                 "ch.os = ordered_sum(sc, h.lc);",
                 "ch.tup = h.tup + (has_child ? tuple_digit(min(d + 1, DDT_MAX_DEPTH), 0) : 0ull);",
                 "const bool valid = lane >= 1 && lane < n;",
                 "const unsigned bs = __ballot_sync(FULL_MASK, valid && pops_before(c.os, c.tup, sib.os, sib.tup));",
                 "const unsigned bc = __ballot_sync(FULL_MASK, valid && pops_before(c.os, c.tup, ch.os, ch.tup));",
                 "const bool child_first = pops_before(ch.os, ch.tup, sib.os, sib.tup);",
                 "const int pos_s = has_sib ? __popc(bs) + (has_child && child_first ? 1 : 0) : 64;",
                 "const int pos_c = has_child ? __popc(bc) + (has_sib && !child_first ? 1 : 0) : 64;",
                 "sib.info = pack_info(d, r + 1, prow, 0);",
                 "sib.ls = s_lp[(d - 1) * K + min(r + 2, K - 1)];",
                 "sib.lc = h.lc;",
                 "ch.info = pack_info(d + 1, 0, row, chain && d + 1 <= nc);",
                 "ch.ls = s_lp[min(d, D - 1) * K + min(1, K - 1)];",
                 "ch.lc = s_lp[min(d + 1, D - 1) * K];",
                 "const int src = lane + 1 - (pos_s < lane ? 1 : 0) - (pos_c < lane ? 1 : 0);",
                 "const CEnt moved = cent_shfl(c, src);",
                 "c = cent_sel(lane == pos_s, sib, cent_sel(lane == pos_c, ch, moved));",
                 "h = cent_sel(pos_s == 0, sib, cent_sel(pos_c == 0, ch, e1));",
                 "n = min(n - 1 + (has_sib ? 1 : 0) + (has_child ? 1 : 0), 32);",
                 "while (n > 0 && nodes < budget) {",
                 "t_info[lane == 0 && !chain ? row : DDT_MAX_TREE_ROWS + lane] = h.info;",
                 "for (int i = nc + 1 + lane; i <= nodes; i += 32) {",
                 "const int d = info & 15, r = (info >> 4) & 255;",
                 "t_tok[i] = s_id[(d - 1) * K + r];",
                 "t_par[i] = (info >> 12) & 255;"):
        assert stmt in CACHE, stmt
    assert "if (budget <= DDT_CACHE_BUDGET) {" in SRC
