"""bench/persistent.py's lateness analysis on synthetic launches (no GPU): it tells an SM-bound lateness
(the same SMs late in every launch, whichever blocks land on them) from a block-bound one and from noise."""
import numpy as np

from bench.persistent import lateness_stability


def _sms(rng, n, n_sm, per_sm=2):
    return np.array([rng.permutation(np.repeat(np.arange(n_sm), per_sm)) for _ in range(n)])


def test_lateness_that_follows_the_sm():
    rng = np.random.default_rng(1)
    sms = _sms(rng, 5, 66)
    slow = rng.standard_normal(66)
    st = lateness_stability(20 + slow[sms] + 0.05 * rng.standard_normal(sms.shape), sms)
    assert st["corr_by_sm"] > 0.95 and st["corr_sm_pair"] > 0.9 and abs(st["corr_by_block"]) < 0.3
    assert st["same_sm_share"] < 0.2 and st["launches"] == 5
    assert set(st["latest_sms"][:3]) <= set(np.argsort(-slow)[:6].tolist())
    assert abs(st["per_sm_mean_spread_us"] - (slow.max() - slow.min())) < 0.2


def test_lateness_that_follows_the_block_or_nothing():
    rng = np.random.default_rng(2)
    sms = _sms(rng, 4, 50)
    slow_block = rng.standard_normal(100)
    st = lateness_stability(20 + slow_block[None, :] + 0.05 * rng.standard_normal(sms.shape), sms)
    assert st["corr_by_block"] > 0.95 and st["corr_by_sm"] < 0.8
    noise = lateness_stability(20 + rng.standard_normal(sms.shape), sms)
    assert abs(noise["corr_by_block"]) < 0.3 and abs(noise["corr_by_sm"]) < 0.3
    assert noise["spread_us"] > 2.0


def test_edge_slope_is_the_least_squares_cost_per_stage():
    from bench.persistent_edges import STAGES, slope
    n = list(STAGES)
    assert abs(slope(n, [3.0 + 1.5 * k for k in n]) - 1.5) < 1e-12
    noisy = [3.0 + 1.5 * k + e for k, e in zip(n, (0.1, -0.1, 0.1, -0.1))]
    x = np.array(n, float)
    assert abs(slope(n, noisy) - np.polyfit(x, noisy, 1)[0]) < 1e-12
