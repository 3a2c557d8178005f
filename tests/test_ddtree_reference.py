"""CPU tests of the DDTree numpy reference (ddtree_cupy/reference/ddtree.py)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from ddtree_cupy.reference import ddtree as dd


# ----------------------------------------------------------------------------------------------------
# independent brute-force oracle
# ----------------------------------------------------------------------------------------------------
def _all_prefixes_in_order(lp32: np.ndarray, k_eff: int):
    """Every prefix (rank tuple) with its float32 depth-order score, sorted by the documented total order
    (score descending, then rank tuple lexicographic with a proper prefix first)."""
    D = lp32.shape[0]
    items = []
    for d in range(1, D + 1):
        for tup in itertools.product(range(k_eff), repeat=d):
            s = np.float32(0.0)
            for i, r in enumerate(tup):
                s = dd.add_f32(s, lp32[i, r])
            items.append((tup, s))
    # Python tuple comparison is lexicographic with a proper prefix first: the order the GPU key encodes.
    items.sort(key=lambda t: (-float(t[1]), t[0]))
    return items


def _expected_tuples(lp, budget, cap_k=None, include_chain=False):
    lp32 = np.asarray(lp, np.float32)
    D, K = lp32.shape
    k_eff = K if cap_k is None else min(K, cap_k)
    order = _all_prefixes_in_order(lp32, k_eff)
    if not include_chain:
        return [t for t, _ in order[:budget]], [s for _, s in order[:budget]]
    n_chain = min(D, budget)
    chain = [(0,) * d for d in range(1, n_chain + 1)]
    rest = [(t, s) for t, s in order if t not in chain][:budget - n_chain]
    sc = []
    s = np.float32(0.0)
    for d in range(n_chain):
        s = dd.add_f32(s, lp32[d, 0])
        sc.append(s)
    return chain + [t for t, _ in rest], sc + [s for _, s in rest]


def _random_top(rng, D, K, ties=False):
    if ties:
        # few distinct dyadic values: many exactly equal path scores, sums exact in float32
        vals = -rng.integers(0, 4, size=(D, K)).astype(np.float32) * 0.5
    else:
        vals = np.log(rng.dirichlet(np.ones(K * 3), size=D)[:, :K]).astype(np.float32)
    lp = -np.sort(-vals, axis=1)
    ids = np.stack([rng.permutation(1000)[:K] for _ in range(D)]).astype(np.int32)
    return lp, ids


def _check_structure(tree: dd.Tree, lp, ids):
    tups = tree.rank_tuples()
    for i in range(tree.n):
        p = int(tree.parents[i])
        assert 0 <= p <= i, "parent row must precede the child"
        assert tree.depths[i] == (tree.depths[p - 1] + 1 if p > 0 else 1)
        assert tree.tokens[i] == ids[tree.depths[i] - 1, tree.ranks[i]]
        if len(tups[i]) > 1:
            assert tups[i][:-1] in tups[:i], "prefix-closed"
    assert len(set(tups)) == len(tups)


# ----------------------------------------------------------------------------------------------------
# builder against brute force
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("ties", [False, True])
def test_build_tree_equals_brute_force(seed, ties):
    rng = np.random.default_rng(seed)
    D = int(rng.integers(1, 5))
    K = int(rng.integers(1, 5))
    lp, ids = _random_top(rng, D, K, ties)
    total = sum(K ** d for d in range(1, D + 1))
    for budget in sorted({0, 1, 2, 5, 9, total, total + 3}):
        budget = min(budget, 128)
        tree = dd.build_tree(lp, ids, budget)
        want, want_sc = _expected_tuples(lp, budget)
        assert tree.rank_tuples() == want
        assert tree.scores.tolist() == [float(s) for s in want_sc]
        _check_structure(tree, lp, ids)


@pytest.mark.parametrize("seed", range(8))
def test_cap_k_and_chain(seed):
    rng = np.random.default_rng(100 + seed)
    D, K = int(rng.integers(2, 5)), int(rng.integers(2, 6))
    lp, ids = _random_top(rng, D, K, ties=seed % 2 == 1)
    for budget in (1, 3, D, D + 4, 20):
        for cap in (None, 1, 2, 3):
            for chain in (False, True):
                tree = dd.build_tree(lp, ids, budget, cap_k=cap, include_chain=chain)
                want, _ = _expected_tuples(lp, budget, cap, chain)
                assert tree.rank_tuples() == want, (budget, cap, chain)
                _check_structure(tree, lp, ids)
                assert tree.n <= budget
                if cap is not None:
                    assert (tree.ranks < cap).all()
                if chain:
                    nc = min(D, budget)
                    assert tree.rank_tuples()[:nc] == [(0,) * d for d in range(1, nc + 1)]


def test_chain_forced_when_it_would_lose():
    # depth 2's top-1 is weak, so without the chain option (0, 0) is not among the best 3
    lp = np.array([[-0.1, -0.2, -0.3], [-5.0, -5.0, -6.0]], np.float32)
    ids = np.array([[10, 11, 12], [20, 21, 22]], np.int32)
    assert dd.build_tree(lp, ids, 3).rank_tuples() == [(0,), (1,), (2,)]
    t = dd.build_tree(lp, ids, 3, include_chain=True)
    assert t.rank_tuples() == [(0,), (0, 0), (1,)]
    assert t.parents.tolist() == [0, 1, 0]


def test_exact_tie_order():
    # all scores tie: order is then purely by rank tuple, prefix first
    lp = np.zeros((3, 2), np.float32)
    ids = np.array([[1, 2], [3, 4], [5, 6]], np.int32)
    t = dd.build_tree(lp, ids, 14)
    assert t.rank_tuples() == [(0,), (0, 0), (0, 0, 0), (0, 0, 1), (0, 1), (0, 1, 0), (0, 1, 1),
                               (1,), (1, 0), (1, 0, 0), (1, 0, 1), (1, 1), (1, 1, 0), (1, 1, 1)]
    # equal scores at different depths: (1,) = -1 ties (0, 0) = -0.5 + -0.5; (0, 0) sorts first
    lp = np.array([[-0.5, -1.0], [-0.5, -2.0]], np.float32)
    assert dd.build_tree(lp, ids[:2], 3).rank_tuples() == [(0,), (0, 0), (1,)]


def test_score_arithmetic_is_float32_in_depth_order():
    lp = np.array([[-1e-8], [-1.0], [-1e-8]], np.float32)
    t = dd.build_tree(lp, np.array([[1], [2], [3]], np.int32), 3)
    s = np.float32(0)
    for d in range(3):
        s = np.float32(s + lp[d, 0])
        assert t.scores[d] == s
    # subnormal sums flush to zero like the GPU's -ftz
    tiny = np.float32(-1e-39)
    assert dd.add_f32(np.float32(0), tiny) == 0


def test_bad_inputs_raise_naming_the_argument():
    lp = np.array([[-0.1, -0.5]], np.float32)
    ids = np.array([[1, 2]], np.int32)
    with pytest.raises(ValueError, match="top_lp"):
        dd.build_tree(lp[:, ::-1], ids, 2)
    with pytest.raises(ValueError, match="top_id"):
        dd.build_tree(lp, ids[:, :1], 2)
    with pytest.raises(ValueError, match="budget"):
        dd.build_tree(lp, ids, 500)
    with pytest.raises(ValueError, match="cap_k"):
        dd.build_tree(lp, ids, 2, cap_k=0)
    with pytest.raises(ValueError, match="top_lp"):
        dd.build_tree(-lp, ids, 2)
    with pytest.raises(ValueError, match="k"):
        dd.depth_topk(lp, 3)


# ----------------------------------------------------------------------------------------------------
# log-probs and top-K
# ----------------------------------------------------------------------------------------------------
def test_depth_logprobs_and_topk():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((5, 300)) * 4).astype(np.float32)
    lp64 = dd.depth_logprobs(x, np.float64)
    assert np.allclose(np.exp(lp64).sum(1), 1.0, rtol=1e-12)
    lp32 = dd.depth_logprobs(x, np.float32)
    assert lp32.dtype == np.float32
    assert np.linalg.norm(lp32 - lp64) / np.linalg.norm(lp64) < 1e-6
    # ties: bf16-like rounding creates equal values; order must be value desc then lower id
    xr = np.round(x * 2) / 2
    vals, ids = dd.depth_topk(xr, 40)
    for d in range(5):
        ref = sorted(range(300), key=lambda t: (-xr[d, t], t))[:40]
        assert ids[d].tolist() == ref
        assert np.array_equal(vals[d], xr[d, ref])
    lp, ids2 = dd.topk_logprobs(xr, 40)
    assert np.array_equal(ids2, ids)
    assert np.allclose(lp, np.take_along_axis(dd.depth_logprobs(xr), ids.astype(int), 1), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------
# flatten
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_flatten_mask_is_ancestor_or_self(seed):
    rng = np.random.default_rng(200 + seed)
    lp, ids = _random_top(rng, 7, 12)
    tree = dd.build_tree(lp, ids, int(rng.integers(1, 129)))
    ft = dd.flatten(tree, bonus=77, prefix_len=1234)
    n = tree.n
    tups = [()] + tree.rank_tuples()
    for i in range(n + 1):
        for j in range(n + 1):
            assert ft.mask[i, j] == (tups[i][:len(tups[j])] == tups[j])
    assert ft.tokens[0] == 77 and ft.parents[0] == -1 and ft.depths[0] == 0
    assert np.array_equal(ft.positions, 1234 + ft.depths)
    assert np.array_equal(ft.tokens[1:], tree.tokens)
    bits = ft.mask_bits
    assert bits.shape == (n + 1, dd.MASK_WORDS) and bits.dtype == np.uint32
    for i in range(n + 1):
        for j in range(32 * dd.MASK_WORDS):
            bit = (int(bits[i, j // 32]) >> (j % 32)) & 1
            assert bit == (j <= n and ft.mask[i, j])


# ----------------------------------------------------------------------------------------------------
# walks
# ----------------------------------------------------------------------------------------------------
def _hand_tree():
    #            row: 0    1    2    3    4    5    6
    tokens = np.array([50, 10, 11, 20, 21, 30, 22], np.int32)
    parents = np.array([-1, 0, 0, 1, 1, 3, 2], np.int32)
    return tokens, parents


def test_greedy_walk_hand_built():
    tokens, parents = _hand_tree()
    assert dd.greedy_walk(tokens, parents, np.array([10, 21, 0, 0, 99, 0, 0])) == ([0, 1, 4], 99)
    assert dd.greedy_walk(tokens, parents, np.array([10, 20, 0, 30, 0, 5, 0])) == ([0, 1, 3, 5], 5)
    assert dd.greedy_walk(tokens, parents, np.array([11, 0, 22, 0, 0, 0, 8])) == ([0, 2, 6], 8)
    # a token that matches a grandchild but not a child is not accepted
    assert dd.greedy_walk(tokens, parents, np.array([20, 0, 0, 0, 0, 0, 0])) == ([0], 20)


def test_greedy_walk_from_logits_argmax():
    tokens, parents = _hand_tree()
    logits = np.zeros((7, 40))
    logits[0, 11] = 3
    logits[2, 22] = 1
    logits[2, 5] = 1          # tie: lowest id (5) wins, which is not a child token
    assert dd.greedy_walk(tokens, parents, dd.argmax_lowest(logits)) == ([0, 2], 5)


def test_sample_walk_reproducible_and_matches_distribution():
    tokens, parents = _hand_tree()
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((7, 40))
    a = dd.sample_walk(tokens, parents, logits, 0.8, 0.9, 20, seed=123, stream=2, step=5)
    b = dd.sample_walk(tokens, parents, logits, 0.8, 0.9, 20, seed=123, stream=2, step=5)
    assert a == b
    post = dd.sample_tokens(logits, 0.8, 0.9, 20, 123, 2, 5)
    assert a == dd.greedy_walk(tokens, parents, post)
    # the sampler with many keys reproduces the filtered distribution
    x = np.array([2.0, 1.0, 0.5, 0.0, -1.0])
    T, top_p, top_k = 0.7, 0.9, 4
    p = np.exp(x / T)
    p /= p.sum()
    head = p[:top_k] / p[:top_k].sum()            # x is already sorted descending
    keep = list(range(int(np.searchsorted(np.cumsum(head), top_p)) + 1))
    assert keep == [0, 1, 2]                       # the top-p cut really removes one of the top-k
    q = np.zeros(5)
    q[keep] = p[keep] / p[keep].sum()
    u = dd.philox_uniform(dd.slot_seed(99, 0), np.arange(20000, dtype=np.uint64))
    draws = np.array([dd.sample_from_logits(x, ui, T, top_p, top_k) for ui in u])
    freq = np.bincount(draws, minlength=5) / draws.size
    assert np.abs(freq - q).max() < 0.015
    assert dd.sample_from_logits(x, 0.5, 0.0) == 0


def test_philox_known_answers():
    # Random123 known-answer vectors for Philox4x32-10
    out = dd.philox4x32(np.zeros(4, np.uint32), (0, 0))
    assert [hex(int(v)) for v in out] == ["0x6627e8d5", "0xe169c58d", "0xbc57ac4c", "0x9b00dbd8"]
    out = dd.philox4x32(np.array([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], np.uint32),
                        (0xA4093822, 0x299F31D0))
    assert [hex(int(v)) for v in out] == ["0xd16cfe09", "0x94fdcceb", "0x5001e420", "0x24126ea1"]
    u = dd.philox_uniform(1 << 40 | 5, np.arange(1000, dtype=np.uint64) << np.uint64(8))
    assert (u > 0).all() and (u < 1).all() and abs(u.mean() - 0.5) < 0.05
    assert not np.array_equal(u, dd.philox_uniform(5, np.arange(1000, dtype=np.uint64) << np.uint64(8)))  # key high word
    # the counter's high word matters too (steps beyond 2^24 rounds)
    assert not np.array_equal(u, dd.philox_uniform(1 << 40 | 5, (np.arange(1000, dtype=np.uint64) << np.uint64(8))
                                                   | np.uint64(1 << 40)))
    # the per-row uniforms of a step are philox_uniform(slot_seed(seed, stream), (step << 8) | row)
    rows = dd.sampling_uniforms(7, 3, 9, 129)
    assert np.array_equal(rows, dd.philox_uniform(dd.slot_seed(7, 3), (np.uint64(9) << np.uint64(8))
                                                  | np.arange(129, dtype=np.uint64)))
    assert not np.array_equal(rows, dd.sampling_uniforms(7, 4, 9, 129))     # streams draw independently
    with pytest.raises(ValueError, match="256"):
        dd.sampling_uniforms(7, 3, 9, 257)


# ----------------------------------------------------------------------------------------------------
# commit
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_commit_plan_moves_accepted_rows_without_clobbering(seed):
    rng = np.random.default_rng(300 + seed)
    lp, ids = _random_top(rng, 7, 6)
    tree = dd.build_tree(lp, ids, 40)
    s = int(rng.integers(0, 500))
    ft = dd.flatten(tree, bonus=1, prefix_len=s)
    # post tokens that follow a random root-to-leaf path
    leaf = int(rng.integers(0, tree.n + 1))
    path = []
    r = leaf
    while r >= 0:
        path.append(r)
        r = int(ft.parents[r])
    path = path[::-1]
    post = rng.integers(2000, 3000, size=tree.n + 1).astype(np.int32)
    for a, b in zip(path[:-1], path[1:]):
        post[a] = ft.tokens[b]
    rows, bonus = dd.greedy_walk(ft.tokens, ft.parents, post)
    assert rows == path and bonus == post[leaf]
    plan = dd.commit_plan(rows, ft.depths, s)
    assert plan.new_len == s + len(rows)
    assert plan.feature_rows.tolist() == rows
    cache = np.arange(s + tree.n + 1) * 10 + 7      # content = a label per slot
    for src, dst in zip(plan.src_slots, plan.dst_slots):
        cache[dst] = cache[src]                     # in plan order
    assert cache[s:s + len(rows)].tolist() == [(s + r) * 10 + 7 for r in rows]
    assert cache[:s].tolist() == [i * 10 + 7 for i in range(s)]


def test_commit_plan_rejects_bad_rows():
    depths = np.array([0, 1, 2, 1])
    with pytest.raises(ValueError, match="accepted_rows"):
        dd.commit_plan([1, 2], depths, 0)
    with pytest.raises(ValueError, match="accepted_rows"):
        dd.commit_plan([0, 3, 2], depths, 0)
    with pytest.raises(ValueError, match="accepted_rows"):
        dd.commit_plan([0, 2], depths, 0)
