"""Shared helpers for the GPU kernel tests: bf16 random data, poisoned outputs, relative errors."""
import numpy as np

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits

POISON_BF16 = 0xFFFF        # a NaN pattern: any element a kernel forgets to write shows up
BF16_TOL = 2.0 ** -7        # relative-norm tolerance for one or two bf16 roundings (unit roundoff 2^-9)


def rand_bf16(rng, shape, scale=1.0):
    bits = to_bf16_bits(rng.standard_normal(shape) * scale)
    return bits, bf16_bits_to_f32(bits).astype(np.float64)


def poisoned(cp, shape, dtype=np.uint16):
    a = cp.empty(shape, dtype=dtype)
    if np.dtype(dtype) == np.uint16:
        a.fill(POISON_BF16)
    elif np.dtype(dtype).kind == "f":
        a.fill(np.nan)
    else:
        a.fill(-7777)
    return a


def rel_err(got, ref):
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert np.all(np.isfinite(got)), "non-finite output (an unwritten / poisoned element?)"
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300))


def f64(bits_dev):
    return bf16_bits_to_f32(bits_dev.get()).astype(np.float64)
