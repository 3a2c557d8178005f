"""``--budget auto`` through the GPU engine's own code on the CPU (the emulation of tests/test_engine_cpu.py, toy
models of tests/_engine_toys.py): split steps (draft + top-K graph, host budgets, build + verify + accept graph) and root-only steps without
the drafter give exactly the reference loop's tokens (lossless), with continuous batching, in graphs and eager."""
import numpy as np
import pytest

from ddtree_cupy.budget import BudgetPolicy, CostTable
from ddtree_cupy.reference.loop import DecodeLoop
from _engine_toys import fake_gpu, make, reqs  # noqa: F401  (fixture and helpers)


def flat_costs(per_row=2e-4):
    """One bucket: the cost follows the real rows only (so the loop's and the engine's buckets agree)."""
    return CostTable({1: {1: 4e-3, 64: 4e-3 + 63 * per_row}}, {1: 3.5e-3})


@pytest.mark.parametrize("eager", [False, True])
def test_engine_auto_equals_reference_loop(fake_gpu, eager):  # noqa: F811
    eng, rt, rd = make(eager=eager)
    ref = DecodeLoop(rt, rd, "ddtree", BudgetPolicy(12, flat_costs())).run(reqs())
    pol = BudgetPolicy(12, flat_costs())
    res = eng.generate(reqs(), "ddtree", pol)
    assert [s.output_ids for s in res.streams] == [s.output_ids for s in ref.streams]
    assert [s.finish_reason for s in res.streams] == [s.finish_reason for s in ref.streams]
    assert eng.last_pool.free_pages == eng.last_pool.num_pages
    st = res.budget_stats
    assert st is not None and st["steps"] and st["max_nodes"] == 12
    budgets = [b for s in st["steps"] for b in s["budgets"].values()]
    assert max(budgets) > 0 and max(budgets) <= 12
    assert max(res.accept_lens) >= 3
    kinds = {k for k in eng.steps}
    assert any(k[6] for k in kinds)                      # a split step ran
    # the same decisions as the loop from the same inputs (float32 vs float64 top-K log-probs may only
    # reorder exact ties, which this toy drafter does not produce)
    assert [s.tree_sizes for s in res.streams] == [s.tree_sizes for s in ref.streams]


def test_engine_auto_root_only_steps(fake_gpu):  # noqa: F811
    """Rows so expensive that no node pays: every stream falls back, steps run root-only without the
    drafter (the drafter context still follows), probes come back periodically; tokens equal 'ar'."""
    eng, rt, rd = make()
    costly = CostTable({1: {1: 4e-3, 64: 4e-3 + 63 * 5e-2}}, {1: 3.9e-3})
    ar = DecodeLoop(rt, None, "ar").run(reqs())
    pol = BudgetPolicy(12, costly, probe_every=4)
    res = eng.generate(reqs(), "ddtree", pol)
    ref = DecodeLoop(rt, rd, "ddtree", BudgetPolicy(12, costly, probe_every=4)).run(reqs())
    assert [s.output_ids for s in res.streams] == [s.output_ids for s in ref.streams]
    # 'ar' too (a ddtree stream ends with 'context' D positions earlier: its output is a prefix of ar's)
    for s, a in zip(res.streams, ar.streams):
        assert s.output_ids == a.output_ids[:len(s.output_ids)]
        assert s.finish_reason == a.finish_reason or s.finish_reason == "context"
    steps = res.budget_stats["steps"]
    assert sum(not s["draft"] for s in steps) > 0.5 * len(steps)
    assert any(s["probes"] for s in steps)
    assert any(k[7] for k in eng.steps)                  # the root-only step shape was used
