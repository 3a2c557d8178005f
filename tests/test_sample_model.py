"""The exact GPU sampler's algorithm (tests/_sample_kernel_model.py mirrors cuda_src/sample.cu) draws the
reference's token for the same Philox key and counter, across temperatures, top-k, top-p and ties."""
import numpy as np
import pytest

from _sample_kernel_model import sample_row
from ddtree_cupy.reference.ddtree import philox_uniform, sample_counter, sample_from_logits, slot_seed

CASES = [(1.0, 0, 1.0), (1.0, 0, 0.95), (0.7, 50, 0.9), (1.3, 300, 1.0), (0.5, 0, 0.5), (2.0, 2000, 0.99),
         (1e-4, 0, 1.0), (1.0, 1, 1.0), (0.0, 0, 1.0), (0.9, 3000, 0.8), (5.0, 0, 1.0), (1.0, 7, 0.3)]


@pytest.mark.parametrize("kind", ["normal", "wide", "ties", "maxima"])
def test_model_equals_reference(kind):
    rng = np.random.default_rng({"normal": 1, "wide": 2, "ties": 3, "maxima": 4}[kind])
    V = 3000
    for trial, (temp, top_k, top_p) in enumerate(CASES * 2):
        x = rng.standard_normal(V).astype(np.float32) * (4.0 if kind == "wide" else 1.0)
        if kind == "ties":
            x = np.round(x * 3) / 3
        if kind == "maxima":
            x[rng.choice(V, 4, replace=False)] = x.max() + 0.5
        seed = slot_seed(int(rng.integers(0, 2 ** 63)), trial)
        step = sample_counter(int(rng.integers(0, 500)), trial % 129)
        u = float(philox_uniform(seed, np.array([step], np.uint64))[0])
        want = sample_from_logits(x, u, temp, top_p, top_k)
        got = sample_row(x, temp, top_k, top_p, seed, step)
        assert got == want, (kind, temp, top_k, top_p, got, want)
