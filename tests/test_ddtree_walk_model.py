"""A CPU model of the register walk (cuda_src/ddtree.cu, ddt_walk_commit), lane by
lane, against the reference walk (ddtree_cupy/reference/ddtree.py greedy_walk): row i's parent, token and
post token in slot i // 32 of lane i % 32, post[cur] by a select over the slots and a shuffle from lane
cur % 32, the lowest matching row from one ballot per slot (lowest nonzero slot, lowest lane), the
accepted tokens recorded as the matched `want` values. Trees come from the reference builder and from
random parent arrays with repeated sibling tokens (the lowest row must win)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ddtree_cupy.reference import ddtree as dd

SRC = (Path(__file__).resolve().parents[1] / "cuda_src" / "ddtree.cu").read_text()
R = dd.MAX_TREE_ROWS
SLOTS = (R + 31) // 32


def walk_regs(tokens, parents, n, post, A):
    """The kernel's register walk for one stream: (accepted rows, out tokens incl. the bonus, bonus)."""
    r_par = [[parents[q * 32 + lane] if q * 32 + lane < n else -2 for lane in range(32)] for q in range(SLOTS)]
    r_tok = [[tokens[q * 32 + lane] if q * 32 + lane < n else 0 for lane in range(32)] for q in range(SLOTS)]
    r_pst = [[post[q * 32 + lane] if q * 32 + lane < n else 0 for lane in range(32)] for q in range(SLOTS)]
    root_tok = r_tok[0][0]
    cur, a = 0, 1
    rows, tokv = [0], [root_tok]
    while True:
        pv = [r_pst[0][lane] for lane in range(32)]
        for q in range(1, SLOTS):
            pv = [r_pst[q][lane] if (cur >> 5) == q else pv[lane] for lane in range(32)]
        want = pv[cur & 31]
        if a >= A:
            break
        found = -1
        for q in range(SLOTS - 1, -1, -1):
            m = sum(1 << lane for lane in range(32) if r_par[q][lane] == cur and r_tok[q][lane] == want)
            found = q * 32 + ((m & -m).bit_length() - 1) if m else found
        if found < 0:
            break
        cur = found
        rows.append(cur)
        tokv.append(want)
        a += 1
    return rows, tokv + [want], want


def _random_tree(rng, n, vocab):
    """Parents before children; few distinct tokens so siblings repeat tokens."""
    parents = np.full(R, -1, np.int64)
    for i in range(1, n):
        parents[i] = int(rng.integers(0, i))
    tokens = rng.integers(0, vocab, size=R).astype(np.int64)
    return tokens, parents


def _path_post(rng, tokens, parents, n, vocab):
    post = rng.integers(0, vocab, size=R).astype(np.int64)
    r = int(rng.integers(0, n))
    while r > 0:
        post[parents[r]] = tokens[r]
        r = int(parents[r])
    return post


@pytest.mark.parametrize("source", ["builder", "random"])
def test_register_walk_equals_reference(source):
    rng = np.random.default_rng(21 if source == "builder" else 22)
    deep = 0
    for trial in range(150):
        D = int(rng.integers(1, 9))
        A = D + 1
        if source == "builder":
            K = int(rng.integers(1, 65))
            lp = -np.sort(rng.random((D, K)).astype(np.float32) * 3, axis=-1)
            lp = -np.sort(-lp, axis=-1)
            ids = rng.integers(0, 300, size=(D, K)).astype(np.int32)
            t = dd.build_tree(lp, ids, int(rng.integers(0, R)))
            ft = dd.flatten(t, int(rng.integers(0, 300)), 0)
            n = ft.n_rows
            tokens = np.zeros(R, np.int64)
            parents = np.full(R, -1, np.int64)
            tokens[:n], parents[:n] = ft.tokens, ft.parents
            vocab = 300
        else:
            n = int(rng.integers(1, R + 1))
            vocab = int(rng.integers(2, 6))
            tokens, parents = _random_tree(rng, n, vocab)
            A = dd.MAX_DEPTH + 1
        post = _path_post(rng, tokens, parents, n, vocab)
        rows, out_tok, bonus = walk_regs(tokens, parents, n, post, A)
        ref_rows, ref_bonus = dd.greedy_walk(tokens[:n], parents[:n], post[:n])
        ref_rows = list(ref_rows)[:A]
        if len(ref_rows) == A:       # the kernel stops at A accepted rows: its bonus is post of the last
            ref_bonus = int(post[ref_rows[-1]])
        assert rows == ref_rows, (trial, rows, ref_rows)
        assert bonus == ref_bonus, trial
        assert out_tok == [int(tokens[r]) for r in rows] + [bonus], trial
        deep += len(rows) >= 3
    assert deep > 20


def test_walk_model_follows_the_kernel():
    body = SRC[SRC.index("    // Every row's parent, token and post token in registers first"):]
    for stmt in ("r_par[q] = i < n ? par[i] : -2;",
                 "for (int q = 1; q < DDT_WALK_SLOTS; ++q) pv = (cur >> 5) == q ? r_pst[q] : pv;",
                 "want = __shfl_sync(FULL_MASK, pv, cur & 31);",
                 "if (a >= A) break;",
                 "for (int q = DDT_WALK_SLOTS - 1; q >= 0; --q) {",
                 "const unsigned m = __ballot_sync(FULL_MASK, r_par[q] == cur && r_tok[q] == want);",
                 "found = m ? q * 32 + __ffs(m) - 1 : found;",
                 "if (lane == 0) { s_rows[a] = cur; s_tokv[a] = want; }",
                 "const int bonus_tok = want;",
                 "out_tokens[(size_t)st * (A + 1) + j] = j < a ? s_tokv[j] : (j == a ? bonus_tok : -1);"):
        assert stmt in body, stmt
    assert "#define DDT_WALK_SLOTS ((DDT_MAX_TREE_ROWS + 31) / 32)" in SRC
