"""A CPU model of the two-pops-per-round sorted-cache builder (cuda_src/ddtree.cu, `cache_pairs`, variant 12),
lane by lane, against the numpy reference builder (ddtree_cupy/reference/ddtree.py).

It mirrors the kernel's state: 32 lanes each holding one entry (ordered score, rank tuple, info word,
parent score, next sibling's log-prob, first child's log-prob), the warp-uniform head h0, entry 1's
broadcast, the choice of h1 among {entry 1, s0, c0} (entry 1 wins through bit 1 of the ballots of s0 and
c0), the four ballots over lanes 1 .. n-1 with lane 1 masked out when it was popped, the fifth ballot that
orders the new entries among themselves (lane k < 12: is the (k % 3)-th other new entry before new entry
k / 3), the one shuffle round (source lane modulo 32, as `__shfl_sync`), the next head as lane 0's entry,
the info words stored per row and decoded after the loop. Stale lanes (>= n) keep whatever the
shuffles left there, as on the GPU. The test asserts that every path runs: h1 = entry 1 / sibling / child,
odd remainders (the round ends after h0), rounds ending with an empty frontier, drops off the end of the list,
ties decided by the rank tuple, chain pops.
"""
from __future__ import annotations

import numpy as np
import pytest

from ddtree_cupy.reference import ddtree as dd
from test_ddtree_builder_model import KINDS, _top, digit, from_ordered, kernel_inputs, ordered_sum, pack
from test_ddtree_cache_model import CACHE_BUDGET, MAX_ROWS, SRC, U64, _flat_top, ballot, pops_before

PAIR = SRC[SRC.index("#if DDT_CACHE_PAIR\n// ----"):SRC.index("ddt_build_tree(", SRC.index("int cache_pairs("))]


def succ(e, s_lp, D, K, nc, row):
    """cache_succ: the next sibling and the first child of entry e (fields as in the kernel)."""
    os_e, tup, info, ps, ls, lc = e
    d, r, prow, chain = info & 15, (info >> 4) & 255, (info >> 12) & 255, (info >> 20) & 1
    sc = from_ordered(os_e)
    sib = (ordered_sum(ps, ls), (tup + digit(d, 0)) & U64, pack(d, r + 1, prow, 0), ps,
           s_lp[(d - 1) * K + min(r + 2, K - 1)], lc)
    ch = (ordered_sum(sc, lc), (tup + (digit(d, 0) >> 8)) & U64,     # wrong only for a child that does not exist
          pack(d + 1, 0, row, int(bool(chain) and d + 1 <= nc)), sc,
          s_lp[min(d, D - 1) * K + min(1, K - 1)], s_lp[min(d + 1, D - 1) * K])
    return sib, ch


def build_pair(lp_in, ids, budget, cap_k, include_chain, stats, width=32):
    """cache_pairs for one stream (budget <= DDT_CACHE_BUDGET): (tokens, parents, depths) of rows 1..n."""
    D, K = lp_in.shape
    s_lp, s_id, budget, kf, nc = kernel_inputs(lp_in, ids, budget, cap_k, include_chain)
    t_tok, t_par, t_dep, t_info = {}, {}, {}, {}
    for lane in range(1, nc + 1):    # the chain rows (the kernel's prologue)
        t_tok[lane], t_par[lane], t_dep[lane] = int(s_id[(lane - 1) * K]), lane - 1, lane
    nodes = nc
    if nodes < budget:   # `if (nodes >= budget) return nodes;`
        h = (ordered_sum(0.0, s_lp[0]), digit(1, 0), pack(1, 0, 0, int(nc >= 1)), np.float32(0.0),
             s_lp[min(1, K - 1)], s_lp[min(1, D - 1) * K])
        c = [h] * width
        n = 1
        while True:
            assert n > 0 and nodes < budget
            assert c[0] == h and all(pops_before(c[i], c[i + 1]) for i in range(n - 1)), "cache sorted"
            e1 = c[1 % width]
            # pop h0
            d0, r0, ch0 = h[2] & 15, (h[2] >> 4) & 255, (h[2] >> 20) & 1
            hs0, hc0 = r0 + 1 < kf, d0 < D
            row0 = d0 if ch0 else nodes + 1
            s0, c0 = succ(h, s_lp, D, K, nc, row0)
            for lane in range(width):
                t_info[row0 if (lane == 0 and not ch0) else MAX_ROWS + lane] = h[2]
            nodes += 0 if ch0 else 1
            stats["chain"] += ch0
            n1 = n - 1 + int(hs0) + int(hc0)
            valid = [1 <= lane < n for lane in range(width)]
            ba = ballot(lambda lane: lane < width and valid[lane] and pops_before(c[lane], s0))
            bb = ballot(lambda lane: lane < width and valid[lane] and pops_before(c[lane], c0))
            if n1 == 0 or nodes >= budget:
                stats["end_h0_empty" if n1 == 0 else "end_h0_budget"] += 1
                break
            # pop h1 = the best of {entry 1, s0, c0}
            child_first0 = pops_before(c0, s0)
            use_s0 = hs0 and (not hc0 or not child_first0)
            e1_first = (n >= 2) & (not hs0 or bool((ba >> 1) & 1)) & (not hc0 or bool((bb >> 1) & 1))
            g = e1 if e1_first else (s0 if use_s0 else c0)
            # the choice is the true best of the three (the exactness argument, checked independently)
            cands = ([c[1]] if n >= 2 else []) + ([s0] if hs0 else []) + ([c0] if hc0 else [])
            assert all(g is x or pops_before(g, x) for x in cands)
            stats["h1_e1" if e1_first else ("h1_sib" if use_s0 else "h1_child")] += 1
            d1, r1, ch1 = g[2] & 15, (g[2] >> 4) & 255, (g[2] >> 20) & 1
            hs1, hc1 = r1 + 1 < kf, d1 < D
            row1 = d1 if ch1 else nodes + 1
            s1, c1 = succ(g, s_lp, D, K, nc, row1)
            for lane in range(width):
                t_info[row1 if (lane == 0 and not ch1) else MAX_ROWS + lane] = g[2]
            nodes += 0 if ch1 else 1
            stats["chain"] += ch1
            bc = ballot(lambda lane: lane < width and valid[lane] and pops_before(c[lane], s1))
            bd = ballot(lambda lane: lane < width and valid[lane] and pops_before(c[lane], c1))
            # place the new entries
            xa, xb, xc, xd = hs0 and (e1_first or not use_s0), hc0 and (e1_first or use_s0), hs1, hc1
            keep = (~2 if e1_first else ~0) & 0xFFFFFFFF
            # the new entries' order among themselves: one ballot, lane k < 12 compares entry ky with entry kx
            ex = int(xa) | int(xb) << 1 | int(xc) << 2 | int(xd) << 3
            news = (s0, c0, s1, c1)

            def pair_pred(lane):
                kx, ky = lane // 3, lane % 3 + int(lane % 3 >= lane // 3)
                kx1, kx2, ky1, ky2 = kx & 1, kx & 2, ky & 1, ky & 2
                # the kernel's selects on lane-constant bits (lanes >= 12 select some entry: masked out)
                xe = (c1 if kx1 else s1) if kx2 else (c0 if kx1 else s0)
                ye = (c1 if ky1 else s1) if ky2 else (c0 if ky1 else s0)
                if lane < 12:
                    assert xe is news[kx] and ye is news[ky] and kx != ky
                return (lane < 12) & bool((ex >> ky) & 1) & pops_before(ye, xe)
            w = ballot(lambda lane: lane < width and pair_pred(lane))
            pc_ = lambda x: bin(x).count("1")
            pa = pc_(ba & keep) + pc_(w & 0x7) if xa else 64
            pb = pc_(bb & keep) + pc_(w & 0x38) if xb else 64
            pc = pc_(bc & keep) + pc_(w & 0x1C0) if xc else 64
            pd = pc_(bd & keep) + pc_(w & 0xE00) if xd else 64
            new = []
            for lane in range(width):
                src = lane + (2 if e1_first else 1) - (pa < lane) - (pb < lane) - (pc < lane) - (pd < lane)
                moved = c[src % width]
                new.append(s0 if lane == pa else c0 if lane == pb else s1 if lane == pc else c1 if lane == pd
                           else moved)
            n_full = n1 - 1 + int(hs1) + int(hc1)
            stats["drop"] += int(n_full > width)
            stats["four_new"] += int(xa and xb and xc and xd)
            stats["tie"] += int(len({x[0] for x in (s0, c0, s1, c1)}) < 4
                                or any(valid[lane] and c[lane][0] in (s0[0], c0[0], s1[0], c1[0])
                                       for lane in range(width)))
            c = new
            n = min(n_full, width)
            if n == 0 or nodes >= budget:
                stats["end_round"] += 1
                break
            h = c[0]
    for i in range(nc + 1, nodes + 1):   # the decode after the loop
        info = t_info[i]          # KeyError: a row the loop never wrote
        d, r = info & 15, (info >> 4) & 255
        t_tok[i], t_par[i], t_dep[i] = int(s_id[(d - 1) * K + r]), (info >> 12) & 255, d
    rows = range(1, nodes + 1)
    return (np.array([t_tok[i] for i in rows], np.int32), np.array([t_par[i] for i in rows], np.int32),
            np.array([t_dep[i] for i in rows], np.int32))


def _check(lp, ids, budget, cap, chain, stats, msg, width=32):
    t = dd.build_tree(lp, ids, min(max(budget, 0), MAX_ROWS - 1), cap_k=cap or None, include_chain=chain)
    tok, par, dep = build_pair(lp, ids, budget, cap, chain, stats, width)
    np.testing.assert_array_equal(tok, t.tokens, err_msg=msg)
    np.testing.assert_array_equal(par, t.parents, err_msg=msg)
    np.testing.assert_array_equal(dep, t.depths, err_msg=msg)


def _stats():
    return dict(drop=0, h1_e1=0, h1_sib=0, h1_child=0, end_h0_empty=0, end_h0_budget=0, end_round=0, tie=0,
                chain=0, four_new=0)


@pytest.mark.parametrize("kind", KINDS)
def test_pair_model_equals_reference(kind):
    rng = np.random.default_rng(200 + KINDS.index(kind))
    stats = _stats()
    for trial in range(120):
        if trial < 4:            # the largest cached case: depth 8, budget 64 (the cache overflows)
            D, K, budget = 8, 64 + 8 * trial, CACHE_BUDGET
        elif trial < 8:          # tiny frontiers: the round ends on an empty frontier
            D, K, budget = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 12))
        else:
            D, K, budget = int(rng.integers(1, 9)), int(rng.integers(1, 129)), int(rng.integers(-2, CACHE_BUDGET + 1))
        lp, ids = _top(rng, D, K, kind)
        cap = int(rng.choice([0, 1, 3, 8, 200]))
        chain = bool(rng.integers(0, 2))
        _check(lp, ids, budget, cap, chain, stats, f"trial {trial}: D {D} K {K} budget {budget} cap {cap} chain {chain}")
    for key in ("h1_e1", "h1_sib", "h1_child", "end_h0_empty", "end_h0_budget", "end_round", "chain", "four_new"):
        # all-zero (or subnormal: read as zero) log-probs: every score ties and a proper prefix pops first,
        # so when h0 has a child, h1 is that child: h1 = entry 1 with four new entries cannot happen
        assert stats[key] > 0 or (kind in ("zero", "subnormal") and key == "four_new"), (key, stats)
    if kind != "normal":
        assert stats["tie"] > 0, stats


def test_pair_drops_only_entries_that_never_pop():
    """Flat and tie-heavy inputs at budgets 33..64: entries fall off the 32-entry list and the tree is still
    the reference's; with 16 lanes the same kind of input gives a different tree (the bound matters)."""
    rng = np.random.default_rng(9)
    stats = _stats()
    for trial in range(24):
        D, K = 8, int(rng.integers(32, 129))
        budget = int(rng.integers(33, CACHE_BUDGET + 1)) if trial else CACHE_BUDGET
        lp, ids = _flat_top(D, K, rng) if trial % 2 == 0 else _top(rng, D, K, "dyadic")
        _check(lp, ids, budget, 0, bool(trial % 3 == 0), stats, f"trial {trial}: K {K} budget {budget}")
    assert stats["drop"] > 0, stats
    lp, ids = _flat_top(8, 128, rng)
    t = dd.build_tree(lp, ids, CACHE_BUDGET)
    tok, _, _ = build_pair(lp, ids, CACHE_BUDGET, 0, False, _stats(), width=16)
    assert not np.array_equal(tok, t.tokens), "16 entries must be too few for budget 64 on a flat draft"


def test_pair_model_follows_the_kernel():
    from ddtree_cupy.kernels import ddtree as ddt
    assert ddt.VARIANTS[12] == "scan-rank-cache-regs-pair" and 12 in ddt.CACHE_VARIANTS and 12 in ddt.SCAN_VARIANTS
    assert "#define DDT_CACHE_PAIR (DDT_FAST == 12)" in SRC
    for stmt in ("if (nodes >= budget) return nodes;",
                 "const CEnt e1 = cent_shfl(c, 1);",
                 "sib.os = ordered_sum(e.ps, e.ls);",
                 "const u64 dig = tuple_digit(d, 0);",
                 "sib.tup = e.tup + dig;",
                 "ch.os = ordered_sum(sc, e.lc);",
                 "ch.tup = e.tup + (dig >> 8);",
                 "sib.info = pack_info(d, r + 1, prow, 0);",
                 "sib.ls = s_lp[(d - 1) * K + min(r + 2, K - 1)];",
                 "sib.lc = e.lc;",
                 "ch.info = pack_info(d + 1, 0, row, chain && d + 1 <= nc);",
                 "ch.ps = sc;",
                 "ch.ls = s_lp[min(d, D - 1) * K + min(1, K - 1)];",
                 "ch.lc = s_lp[min(d + 1, D - 1) * K];",
                 "const bool hs0 = r0 + 1 < kf, hc0 = d0 < D;",
                 "const int row0 = chain0 ? d0 : nodes + 1;",
                 "t_info[lane == 0 && !chain0 ? row0 : DDT_MAX_TREE_ROWS + lane] = h.info;",
                 "const int n1 = n - 1 + (hs0 ? 1 : 0) + (hc0 ? 1 : 0);",
                 "const bool valid = lane >= 1 && lane < n;",
                 "const unsigned ba = __ballot_sync(FULL_MASK, DDT_LANE_AND(valid, pops_before(c.os, c.tup, s0.os, s0.tup)));",
                 "const unsigned bb = __ballot_sync(FULL_MASK, DDT_LANE_AND(valid, pops_before(c.os, c.tup, c0.os, c0.tup)));",
                 "if (n1 == 0 || nodes >= budget) break;",
                 "const bool child_first0 = pops_before(c0.os, c0.tup, s0.os, s0.tup);",
                 "const bool use_s0 = hs0 && (!hc0 || !child_first0);",
                 "const bool e1_first = (n >= 2) & (!hs0 | ((ba >> 1) & 1)) & (!hc0 | ((bb >> 1) & 1));",
                 "const CEnt g = cent_sel(e1_first, e1, cent_sel(use_s0, s0, c0));",
                 "const bool hs1 = r1 + 1 < kf, hc1 = d1 < D;",
                 "const int row1 = chain1 ? d1 : nodes + 1;",
                 "t_info[lane == 0 && !chain1 ? row1 : DDT_MAX_TREE_ROWS + lane] = g.info;",
                 "const unsigned bc = __ballot_sync(FULL_MASK, DDT_LANE_AND(valid, pops_before(c.os, c.tup, s1.os, s1.tup)));",
                 "const unsigned bd = __ballot_sync(FULL_MASK, DDT_LANE_AND(valid, pops_before(c.os, c.tup, c1.os, c1.tup)));",
                 "const bool xa = hs0 && (e1_first || !use_s0), xb = hc0 && (e1_first || use_s0), xc = hs1, xd = hc1;",
                 "const unsigned keep = e1_first ? ~2u : ~0u;",
                 "const int kx = lane / 3, ky = lane % 3 + (lane % 3 >= lane / 3 ? 1 : 0);",
                 "const bool kx1 = kx & 1, kx2 = kx & 2, ky1 = ky & 1, ky2 = ky & 2;",
                 "const int ex = (xa ? 1 : 0) | (xb ? 2 : 0) | (xc ? 4 : 0) | (xd ? 8 : 0);",
                 "const uint32_t xo = kx2 ? (kx1 ? c1.os : s1.os) : (kx1 ? c0.os : s0.os);",
                 "const u64 xt = kx2 ? (kx1 ? c1.tup : s1.tup) : (kx1 ? c0.tup : s0.tup);",
                 "const uint32_t yo = ky2 ? (ky1 ? c1.os : s1.os) : (ky1 ? c0.os : s0.os);",
                 "const u64 yt = ky2 ? (ky1 ? c1.tup : s1.tup) : (ky1 ? c0.tup : s0.tup);",
                 "const unsigned w = __ballot_sync(FULL_MASK, (lane < 12) & ((ex >> ky) & 1) & pops_before(yo, yt, xo, xt));",
                 "const int pa = xa ? __popc(ba & keep) + __popc(w & 0x7u) : 64;",
                 "const int pb = xb ? __popc(bb & keep) + __popc(w & 0x38u) : 64;",
                 "const int pc = xc ? __popc(bc & keep) + __popc(w & 0x1c0u) : 64;",
                 "const int pd = xd ? __popc(bd & keep) + __popc(w & 0xe00u) : 64;",
                 "const int src = lane + (e1_first ? 2 : 1) - (pa < lane) - (pb < lane) - (pc < lane) - (pd < lane);",
                 "const CEnt moved = cent_shfl(c, src);",
                 "c = cent_sel(lane == pa, s0, cent_sel(lane == pb, c0, cent_sel(lane == pc, s1, cent_sel(lane == pd, c1, moved))));",
                 "n = min(n1 - 1 + (hs1 ? 1 : 0) + (hc1 ? 1 : 0), 32);",
                 "if (n == 0 || nodes >= budget) break;",
                 "h = cent_shfl(c, 0);",
                 "for (int i = nc + 1 + lane; i <= nodes; i += 32) {",
                 "t_tok[i] = s_id[(d - 1) * K + r];",
                 "t_par[i] = (info >> 12) & 255;"):
        assert stmt in PAIR, stmt
    assert "nodes = cache_pairs(s_lp, s_id, D, K, kf, budget, nc, lane, t_tok, t_par, t_dep, t_info);" in SRC


def test_pair_variant_changes_only_the_builder():
    """Variant 12 differs from 8 only in the cache loop: DDT_CACHE_PAIR is read nowhere before the sorted-cache
    builder (so the GPU top-K tests need not run 12: its top-K and walk are 8's code), and every feature macro
    that holds for 8 holds for 12 except the overlap (11 only)."""
    uses = [m for m in range(len(SRC)) if SRC.startswith("DDT_CACHE_PAIR", m)]
    builder = SRC.index("// Builder, sorted cache (variants 6, 7;")
    define = SRC.index("#define DDT_CACHE_PAIR") + len("#define ")
    assert len(uses) >= 3 and all(u == define or u > builder for u in uses), uses
    for macro in ("DDT_SCAN (DDT_FAST >= 7)", "DDT_RANK_OUT (DDT_FAST >= 7)", "DDT_CACHE (DDT_FAST >= 7)",
                  "DDT_MERGE_REGS (DDT_FAST >= 8)", "DDT_CACHE_LEAN (DDT_FAST >= 8)", "DDT_WALK_REGS (DDT_FAST >= 8)",
                  "DDT_OVERLAP (DDT_FAST == 11)"):
        assert "#define " + macro in SRC, macro
