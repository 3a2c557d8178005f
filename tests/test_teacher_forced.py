"""CPU self-check of the teacher-forced token judge (tests/_teacher_forced.py) used by the GPU engine tests:
it accepts the reference's own greedy stream, rejects corrupted streams at the corrupted token, and applies
the near-tie / routing-flip allowances exactly as documented."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import _teacher_forced as tf  # noqa: E402


def test_judge_rules_on_constructed_logits():
    rng = np.random.default_rng(3)
    n, V = 6, 50
    lg = rng.standard_normal((n, V)) * 3.0
    out = lg.argmax(1).copy()
    std = lg.std(1)
    margins = np.full(n, 0.1)
    # token 2: a near-tie below NEAR_TIE; token 4: a larger gap at a routing near-tie; token 5: same gap, no tie
    for i, g in ((2, 0.03), (4, 0.4), (5, 0.4)):
        t = (out[i] + 1) % V
        lg[i, t] = lg[i, out[i]] - g * std[i]
        out[i] = t
    margins[4] = 1e-3
    v = tf.judge(lg, margins, out)
    assert v["identical"] == 2 and v["non_argmax"] == 3 and v["flips"] == 1 and v["bad"] == [5]
    assert 0.37 < v["max_gap"] < 0.43     # the std moves a little with the edited logit
    assert "FIRST BAD token 5" in tf.describe("x", v)
    # the same streams with the flip allowance off: token 4 is bad too
    assert tf.judge(lg, margins, out, router_tie=0.0)["bad"] == [4, 5]


@pytest.fixture(scope="module")
def ref_and_stream():
    from ddtree_cupy.checkpoint import load_reference_weights
    from ddtree_cupy.config import TargetConfig
    from ddtree_cupy.reference.target import ReferenceTarget
    from ddtree_cupy.tinymodel import ensure_tiny_checkpoints
    tdir, _ = ensure_tiny_checkpoints()
    cfg = TargetConfig.load(tdir)
    ref = ReferenceTarget(cfg, load_reference_weights(tdir, np.float32, cfg=cfg), np.float32)
    prompt = np.random.default_rng(11).integers(0, cfg.vocab_size, 12).tolist()
    cache = ref.new_cache()
    lg, _ = ref.forward(np.asarray(prompt), np.arange(len(prompt)), cache)
    out = []
    for _ in range(20):                                   # the reference's own greedy stream
        out.append(int(np.argmax(lg[-1])))
        lg, _ = ref.forward(np.asarray([out[-1]]), np.asarray([len(prompt) + len(out) - 1]), cache)
    return ref, prompt, out


def test_reference_stream_passes_and_corruption_fails(ref_and_stream):
    ref, prompt, out = ref_and_stream
    v = tf.check_stream(ref, prompt, out, "reference greedy")
    assert v["identical"] == len(out) and v["max_gap"] < 1e-4 and v["margins"].shape == (len(out),)
    assert np.isfinite(v["margins"]).all() and (v["margins"] >= 0).all()
    # a real bug: one token replaced by the 6th-best candidate there
    lg, m = tf.reference_scores(ref, prompt, out)
    bad = list(out)
    bad[9] = int(np.argsort(-lg[9])[5])
    with pytest.raises(AssertionError, match="FIRST BAD token 9"):
        tf.check_stream(ref, prompt, bad, "corrupted")
    # a stream shifted by one position (an off-by-one in positions or cache rows) fails early
    with pytest.raises(AssertionError, match="FIRST BAD"):
        tf.check_stream(ref, prompt, out[1:] + [out[-1]], "shifted")
    # lossless check: equal streams pass; a difference that is not a tie fails
    assert tf.check_lossless(ref, prompt, out, list(out), "same") == len(out)
    with pytest.raises(AssertionError, match="not a tie"):
        tf.check_lossless(ref, prompt, bad, out, "ddtree vs ar")


def test_router_margins_match_reference_routing(ref_and_stream):
    """The margin is the selection score of route()'s last chosen expert minus the best one left out."""
    from ddtree_cupy.reference.moe import route
    ref = ref_and_stream[0]
    cfg, k = ref.cfg, ref.cfg.num_experts_per_tok
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    p = f"model.layers.{layer}.mlp."
    gate, bias = ref.w[p + "gate.weight"], ref.w[p + "gate.e_score_correction_bias"]
    x = np.random.default_rng(4).standard_normal((7, cfg.hidden_size))
    ids, _ = route(x, gate, bias, cfg)
    choice = 1 / (1 + np.exp(-(x @ gate.T.astype(np.float64)))) + bias
    chosen = np.zeros_like(choice, bool)
    np.put_along_axis(chosen, ids, True, axis=1)
    want = np.where(chosen, choice, np.inf).min(1) - np.where(chosen, -np.inf, choice).max(1)
    assert np.allclose(tf.router_margins(cfg, gate, bias, x), want, rtol=0, atol=1e-12)
    assert ids.shape[1] == k
