"""The exact GPU sampler (cuda_src/sample.cu) over a full 163840-token vocabulary: no candidate cap, the
target distribution for every temperature / top-k / top-p (chi-square), and token-for-token equality with the
reference sampler fed the same Philox uniform (reference.ddtree.philox_uniform), so a sampled GPU run can be
replayed by the reference."""
import numpy as np
import pytest

from _kernel_testutil import chi2_critical, logits_on_device, poisoned, sample_target_probs
from ddtree_cupy.reference.ddtree import philox_uniform, sample_counter, sample_from_logits, slot_seed

pytestmark = pytest.mark.gpu
V = 163840


def _draw(cp, logits_row, temperature, top_k, top_p, n_draws, rows=2048):
    """n_draws independent draws from one row: batches of ``rows`` copies, every row its own key."""
    from ddtree_cupy.kernels.sample import sample
    L = cp.asarray(np.tile(logits_row, (rows, 1)))
    got = []
    for b in range(0, n_draws, rows):
        out = poisoned(cp, (rows,), np.int32)
        seeds = cp.asarray(np.array([slot_seed(1234, b + i) for i in range(rows)], np.uint64))
        sample(L, cp.full(rows, temperature, np.float32), cp.full(rows, top_k, np.int32),
               cp.full(rows, top_p, np.float32), seeds, cp.full(rows, sample_counter(3, 0), np.int64), out)
        got.append(out.get())
    return np.concatenate(got)[:n_draws]


def _chi2_ok(got, p, kept, min_expected=50):
    """Chi-square of the draws against p over bins of consecutive kept ids (sorted order), each expecting
    >= min_expected draws; nothing outside the kept set may appear."""
    assert np.isin(got, kept).all(), "sampled a token outside the kept set"
    n = got.size
    counts = np.bincount(got, minlength=p.size).astype(np.float64)[kept]
    exp = p[kept] * n
    bins_o, bins_e, o, e = [], [], 0.0, 0.0
    for ci, ei in zip(counts, exp):
        o, e = o + ci, e + ei
        if e >= min_expected:
            bins_o.append(o)
            bins_e.append(e)
            o = e = 0.0
    if bins_e:
        bins_o[-1] += o
        bins_e[-1] += e
    bins_o, bins_e = np.array(bins_o), np.array(bins_e)
    chi2 = float(((bins_o - bins_e) ** 2 / bins_e).sum())
    df = len(bins_e) - 1
    assert df >= 20, f"too few bins ({df + 1}) to test the distribution"
    return chi2, df


@pytest.mark.parametrize("temperature, top_k, top_p, min_kept", [
    (1.0, 0, 0.95, 20000),      # a nucleus of tens of thousands of tokens (the old sampler kept 128)
    (0.8, 1000, 1.0, 1000),     # top-k far above the old 128-candidate cap
    (0.7, 5000, 0.9, 300),      # both filters
])
def test_full_vocabulary_distribution(temperature, top_k, top_p, min_kept):
    import cupy as cp
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(V) * 2.0).astype(np.float32)
    p, kept = sample_target_probs(logits, temperature, top_k, top_p)
    assert kept.size >= min_kept
    got = _draw(cp, logits, temperature, top_k, top_p, 2048 * 100)
    chi2, df = _chi2_ok(got, p, kept)
    assert chi2 < chi2_critical(df), f"chi2 {chi2:.1f} with {df} dof"


def _mixed_rows(rng, T):
    """Rows of different shapes: wide, peaked, with ties (repeated values, repeated maxima), bf16-like."""
    rows = []
    for t in range(T):
        kind = t % 4
        x = rng.standard_normal(V).astype(np.float32) * (0.5, 2.0, 4.0, 1.0)[kind]
        if kind == 2:                     # many exact ties
            x = np.round(x * 4) / 4
        if kind == 3:                     # several equal maxima
            x[rng.choice(V, 5, replace=False)] = x.max() + 1.0
        rows.append(x)
    return np.stack(rows)


CASES = [(1.0, 0, 1.0), (1.0, 0, 0.95), (0.7, 50, 0.9), (1.3, 1000, 1.0), (0.5, 0, 0.5), (2.0, 20000, 0.99),
         (1e-4, 0, 1.0), (1.0, 1, 1.0), (0.0, 0, 1.0), (0.9, 163840, 0.8), (5.0, 0, 1.0), (1.0, 7, 0.3)]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_equals_reference_sampler_same_uniform(dtype):
    """Every row's token is the reference's for the same key and counter (one Philox mapping)."""
    import cupy as cp
    from ddtree_cupy.kernels.sample import sample
    rng = np.random.default_rng(11)
    T = 96
    x = _mixed_rows(rng, T)
    x, dev = logits_on_device(cp, x, dtype)
    cases = [CASES[t % len(CASES)] for t in range(T)]
    seeds = np.array([slot_seed(int(rng.integers(0, 2 ** 63)), t) for t in range(T)], np.uint64)
    steps = np.array([sample_counter(int(rng.integers(0, 1000)), t % 129) for t in range(T)], np.int64)
    out = poisoned(cp, (T,), np.int32)
    sample(dev, cp.asarray(np.array([c[0] for c in cases], np.float32)),
           cp.asarray(np.array([c[1] for c in cases], np.int32)), cp.asarray(np.array([c[2] for c in cases], np.float32)),
           cp.asarray(seeds), cp.asarray(steps), out)
    got = out.get()
    want = np.array([sample_from_logits(x[t], float(philox_uniform(int(seeds[t]), steps[t:t + 1].astype(np.uint64))[0]),
                                        cases[t][0], cases[t][2], cases[t][1]) for t in range(T)])
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(int(t), cases[t], int(got[t]), int(want[t])) for t in bad[:8]]


def test_greedy_and_ties_lowest_id():
    import cupy as cp
    from ddtree_cupy.kernels.sample import sample
    rng = np.random.default_rng(12)
    T = 8
    x = rng.standard_normal((T, V)).astype(np.float32)
    for t in range(T):
        x[t, rng.choice(V, 3, replace=False)] = 9.0          # three equal maxima
    out = poisoned(cp, (T,), np.int32)
    z = lambda v, dt: cp.full(T, v, dt)                        # noqa: E731
    sample(cp.asarray(x), z(0.0, np.float32), z(0, np.int32), z(1.0, np.float32), z(1, np.uint64), z(0, np.int64), out)
    assert np.array_equal(out.get(), x.argmax(1))             # numpy: the first (lowest) maximum
    # top-k 1 at any temperature is the same argmax
    sample(cp.asarray(x), z(1.7, np.float32), z(1, np.int32), z(1.0, np.float32), z(5, np.uint64), z(3, np.int64), out)
    assert np.array_equal(out.get(), x.argmax(1))
