"""The tree-budget policy (ddtree_cupy/budget.py): its pieces (path values = the builder's node
probabilities, the cost table, the choice against brute force), drafters of controlled quality against a
synthetic cost table (within 5% of the best fixed budget, small trees for bad drafters, large for good, ~'ar'
for a random drafter), calibration after a mid-run change, and lossless decoding with --budget auto (greedy
== ar with 1-4 streams joining and leaving, sampled runs chi-square against the exact target distribution)."""
import re
from collections import Counter
from itertools import product

import numpy as np
import pytest

from ddtree_cupy import budget_sim as bs
from ddtree_cupy.budget import (BudgetPolicy, Calibration, CostTable, make_policy, parse_budget, path_values,
                                truncate_tree)
from ddtree_cupy.reference.ddtree import build_tree
from ddtree_cupy.reference.loop import DecodeLoop, Request, generate
from test_loop import OracleDrafter, _models, chi2_sf, exact_triples, outputs, pooled_chi2, prompts, run


# ---------------- pieces -------------------------------------------------------------------------------
def test_path_values_are_the_builders_node_probabilities():
    rng = np.random.default_rng(0)
    for _ in range(60):
        D, K, n = int(rng.integers(1, 8)), int(rng.integers(1, 12)), int(rng.integers(1, 40))
        lp = -np.sort(rng.exponential(2.0, (D, K)), axis=1)
        ids = np.tile(np.arange(K), (D, 1)).astype(np.int32)
        tree = build_tree(lp, ids, n)
        pv = path_values(lp, n)
        assert np.allclose(pv[:tree.n], np.exp(tree.scores.astype(np.float64)), rtol=1e-5)
        assert (pv[tree.n:] == 0).all()
        for b in (0, 1, n // 2, n):               # the tree of budget b is the first b nodes
            t2, tb = truncate_tree(tree, b), build_tree(lp, ids, b)
            assert np.array_equal(t2.tokens, tb.tokens) and np.array_equal(t2.parents, tb.parents)
    many = path_values(-np.sort(rng.exponential(1.0, (3, 5, 6)), axis=2), 9, cap_k=2)
    assert many.shape == (3, 9) and (np.diff(many, axis=1) <= 1e-15).all()


def test_cost_table_interpolates_loads_and_checks(tmp_path):
    c = CostTable({2: {2: 1e-3, 10: 2e-3}, 8: {8: 3e-3, 16: 5e-3}}, {2: 0.9e-3, 8: 2.5e-3})
    assert c.draft_s(2, 6) == pytest.approx(1.5e-3)
    assert c.draft_s(1, 2) == pytest.approx(1e-3)            # bucket 1 -> the next larger bucket, 2
    assert c.draft_s(8, 24) == pytest.approx(7e-3)           # beyond the last point: its slope
    assert c.root_s(5) == 2.5e-3
    p = tmp_path / "c.json"
    c.save(str(p))
    c2 = CostTable.load(str(p))
    assert c2.draft == c.draft and c2.root == c.root and "file" in c2.source
    with pytest.raises(ValueError, match="positive"):
        CostTable({1: {1: -1.0}}, {1: 1e-3})
    p.write_text("{}")
    with pytest.raises(ValueError, match="draft"):
        CostTable.load(str(p))
    m = CostTable.model()
    assert m.draft_s(1, 9) == pytest.approx(8.3e-3, rel=0.06)     # the H200 figures it models
    assert m.draft_s(1, 33) == pytest.approx(16.7e-3, rel=0.06)
    assert m.root_s(1) < m.draft_s(1, 1)


def test_budget_argument_parsing():
    assert parse_budget("auto") == "auto" and parse_budget("auto:16") == ("auto", 16) and parse_budget("8") == 8
    for bad in ("fast", "auto:x", "1.5"):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad)
    assert make_policy(8) is None and make_policy("auto").max_nodes == 32
    with pytest.raises(ValueError, match="include_chain"):
        make_policy("auto", include_chain=True)
    with pytest.raises(ValueError, match="largest budget"):
        BudgetPolicy(0)


def test_choice_matches_brute_force():
    """The merged-list choice equals the best allocation over every per-stream budget vector (objective:
    tokens - rate x time for the policy's rate; first step: the ratio)."""
    rng = np.random.default_rng(5)
    costs = CostTable({4: {4: 4e-3, 12: 6e-3, 40: 16e-3}}, {4: 3e-3})
    for trial in range(20):
        S = int(rng.integers(1, 4))
        raw = {k: np.sort(rng.random(4) ** 2)[::-1] for k in range(S)}
        pol = BudgetPolicy(4, costs)
        if trial % 2:
            pol.rate = float(rng.uniform(200, 900))
            score = lambda tk, t, r=pol.rate: tk - r * t        # noqa: E731
        else:
            score = lambda tk, t: tk / t                         # noqa: E731
        plan = pol.plan(4, list(range(S)), dict(raw))
        got = score(sum(plan.expected.values()), costs.draft_s(4, S + sum(plan.budgets.values())))
        best = max(score(S + sum(raw[k][:b[k]].sum() for k in range(S)), costs.draft_s(4, S + sum(b)))
                   for b in product(range(5), repeat=S))
        assert got == pytest.approx(best, rel=1e-12)


# ---------------- drafters of controlled quality --------------------------------------------------------
COSTS = CostTable.model()


@pytest.mark.parametrize("noise", [0.0, 0.25, 0.5, 0.75])
def test_policy_within_5_percent_of_best_fixed_budget(noise):
    r = bs.run([bs.mixed_drafter(noise)] * 2, COSTS, 300, seed=1)
    best = r.best_fixed()
    assert r.rate("auto") >= 0.95 * r.rate(best), (noise, best, {k: r.rate(k) for k in r.tokens})


def test_random_drafter_is_within_5_percent_of_ar():
    r = bs.run([bs.mixed_drafter(1.0, alpha=0.3)] * 2, COSTS, 300, seed=2)
    assert r.best_fixed() == "ar"
    assert r.rate("auto") >= 0.95 * r.rate("ar"), {k: r.rate(k) for k in r.tokens}
    assert np.mean(r.budgets[50:]) < 0.3              # nearly always root-only after the first steps


def test_small_trees_for_bad_drafters_large_for_good():
    good = bs.run([bs.curve_drafter()], COSTS, 200, seed=3)
    bad = bs.run([bs.mixed_drafter(0.75)], COSTS, 200, seed=3)
    assert np.mean(good.budgets) > 4.0 and np.mean(bad.budgets) < 2.0
    assert good.rate("auto") >= 0.95 * good.rate(good.best_fixed())
    assert good.rate("auto") > 2.0 * good.rate("ar")


def test_calibration_converges_after_a_change():
    """A stream whose drafter turns from good to a quarter-scale copy of its probabilities' truth: the
    correction ratio follows (expected ~ realised accepted length) and the budgets shrink."""
    pol = BudgetPolicy(32, COSTS)
    over = bs.curve_drafter(temp=0.5)                # overconfident drafter (sharpened probabilities)
    bs.run([bs.curve_drafter()], COSTS, 300, seed=4, policy=pol, switch={150: [over]})
    st = pol.state[0]
    e, r, b = np.array(st.expected), np.array(st.realised), np.array(st.budgets)
    late = slice(250, 300)
    assert abs(e[late].mean() - r[late].mean()) < 0.15 * r[late].mean()
    early = slice(100, 150)
    assert abs(e[early].mean() - r[early].mean()) < 0.15 * r[early].mean()
    cal = Calibration()
    for _ in range(100):                              # ratio of hits to raw mass, as stated
        cal.observe(np.full(4, 0.1), 1)
    g = sum(0.95 ** i for i in range(100))          # the decayed count of the 100 observations
    H, M, n = g, 0.4 * g, 4 * g
    assert cal.ratio() == pytest.approx((H + 4 * M / n) / (M + 4 * M / n), rel=1e-12)   # (H + W pbar)/(M + W pbar)
    assert np.allclose(cal.correct(np.array([0.5, 0.1])), [1.0, 0.1 * cal.ratio()])
    with pytest.raises(ValueError, match="accepted nodes"):
        cal.observe(np.full(2, 0.1), 3)


# ---------------- lossless through the reference loop ---------------------------------------------------
@pytest.mark.parametrize("n_streams,drafter", [(1, "dflash"), (2, "oracle"), (4, "dflash"), (3, "oracle")])
def test_auto_greedy_equals_ar(tmp_path_factory, n_streams, drafter):
    d = str(tmp_path_factory.getbasetemp() / "tiny_budget")
    tgt, dr = _models(d, 1)
    if drafter == "oracle":
        dr = OracleDrafter(tgt, kind="logits", noise=0.7, seed=n_streams)
    ps = prompts(n_streams, 20 + n_streams)
    ar = outputs(run(tgt, dr, ps, "ar", n_new=40))
    res = run(tgt, dr, ps, "ddtree", "auto", n_new=40)
    assert outputs(res) == ar
    st = res.budget_stats
    assert len(st["steps"]) == res.steps and set(st["streams"]) == {str(i) for i in range(n_streams)}
    if drafter == "oracle":
        assert res.mean_accept_len > 1.3 and max(res.tree_sizes) > 1


def test_auto_streams_joining_and_leaving(tmp_path_factory):
    d = str(tmp_path_factory.getbasetemp() / "tiny_budget")
    tgt, _ = _models(d, 1)
    dr = OracleDrafter(tgt, kind="logits", noise=0.5)
    ps = prompts(4, 31)
    lens = [12, 40, 25, 30]
    loop = DecodeLoop(tgt, dr, "ddtree", "auto")
    loop.add(Request(ps[0], lens[0]))
    loop.add(Request(ps[1], lens[1]))
    for i in range(30):
        if i == 3:
            loop.add(Request(ps[2], lens[2]))
        if i == 8:
            loop.add(Request(ps[3], lens[3]))
        loop.step()
    while loop.active:
        loop.step()
    for s, p, n in zip(loop.streams, ps, lens):
        want = generate(tgt, None, [Request(p, n)], "ar").streams[0].output_ids
        assert s.output_ids == want


def test_auto_sampling_matches_target_distribution(tmp_path_factory):
    d = str(tmp_path_factory.getbasetemp() / "tiny_budget")
    tgt, _ = _models(d, 3)
    prompt = prompts(1, 13)[0][:4]
    T, K, N = 1.3, 3, 300
    exact = exact_triples(tgt, prompt, T, K)
    dr = OracleDrafter(tgt, block_size=4, kind="logits")
    res = generate(tgt, dr, [Request(prompt, 3, temperature=T, top_k=K, seed=5000 + i) for i in range(N)],
                   "ddtree", BudgetPolicy(8, CostTable({1: {1: 4e-3, 10 ** 4: 4.01e-3}}, {1: 3.9e-3})))  # rows ~free
    assert res.mean_accept_len > 1.3 and max(res.tree_sizes) > 1
    counts = Counter(tuple(s.output_ids) for s in res.streams)
    assert set(counts) <= set(exact)
    stat, obs, _ = pooled_chi2(counts, exact, N)
    assert len(obs) >= 4
    assert chi2_sf(stat, len(obs) - 1) > 1e-3


# ---------------- the CLI -------------------------------------------------------------------------------
def test_cli_budget_auto_default_and_statistics(tmp_path_factory, capsys, tmp_path):
    import json
    from _specs import SMALL as CLI_SMALL
    from test_cli import call, last_json
    from ddtree_cupy.tinymodel import ensure_tiny_checkpoints
    t, d = ensure_tiny_checkpoints(str(tmp_path_factory.mktemp("cli_budget")), seed=5, spec=CLI_SMALL)
    base = ["--model", t, "--drafter", d, "--prompt-ids", "1,2,3,4", "--prompt-ids", "9,8,7", "--max-new-tokens", 16,
            "--backend", "numpy", "--json", "--ignore-eos"]
    rc, out, _ = call(capsys, *base)                               # --budget auto is the default
    assert rc == 0
    st = last_json(out)["stats"]
    assert st["budget"] == "auto"
    bp = st["budget_policy"]
    assert bp["policy"] == "auto" and bp["max_nodes"] == 32 and bp["cost_table"] == "model"
    assert len(bp["steps"]) == st["steps"]
    for s in bp["steps"]:
        assert set(s) >= {"budgets", "expected", "realised", "est_tokens_per_s", "draft", "probes"}
    assert set(bp["streams"]) == {"0", "1"}
    ar = last_json(call(capsys, *base, "--mode", "ar")[1])
    assert [s["output_ids"] for s in last_json(out)["streams"]] == [s["output_ids"] for s in ar["streams"]]
    table = tmp_path / "costs.json"
    CostTable.model(buckets=(1, 2)).save(str(table))
    rc, out, _ = call(capsys, *base, "--budget", "auto:8", "--cost-table", table)
    assert rc == 0 and last_json(out)["stats"]["budget_policy"]["cost_table"].startswith("file")
    assert max(last_json(out)["stats"]["tree_sizes"]) <= 8
    for args, msg in ((["--budget", "fast"], "--budget: budget: expected"), (["--budget", "auto:0"], r"\[1, 128\]"),
                      (["--budget", "8", "--cost-table", table], "only used with --budget auto"),
                      (["--cost-table", tmp_path / "none.json"], "cannot read")):
        rc, out, err = call(capsys, *base, *args)
        assert rc == 2 and re.search(msg, err), (args, err)
