"""Shared helpers for the GPU kernel tests: bf16 random data, poisoned outputs, relative errors, recorded kernel
fetches, and the GEMM tests' views, weights and checks."""
import functools
import math

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


def record_kernels(monkeypatch, module) -> list:
    """The names of the kernels ``module`` fetches from now on (one fetch per launch), in order."""
    names = []
    real = module.get_kernel

    def recording(spec, name, **kw):
        names.append(name)
        return real(spec, name, **kw)
    monkeypatch.setattr(module, "get_kernel", recording)
    return names


def gemm_views(cp, rng, xb, N, dt, strided, spare_rows=0):
    """Device x [B, T, K] (the bits ``xb``) and a poisoned out [B, T, N] for a GEMM call; when ``strided``,
    views of wider buffers as the engine passes them: x rows are columns 64.. of [T, B, K + 64] rows (drawn from
    ``rng``), out is columns 16..16+N of a [T + spare_rows, B, N + 32] buffer, so the spare token rows after T
    and the columns on both sides must stay poisoned. Returns (x_dev, out, obuf); obuf is None unless strided."""
    B, T, K = xb.shape
    if not strided:
        return cp.asarray(xb), poisoned(cp, (B, T, N), dt), None
    xbuf = cp.asarray(rand_bf16(rng, (T, B, K + 64))[0])
    xbuf[:, :, 64:] = cp.asarray(xb.transpose(1, 0, 2))
    obuf = poisoned(cp, (T + spare_rows, B, N + 32), dt)
    return xbuf[:, :, 64:].transpose(1, 0, 2), obuf[:T, :, 16:16 + N].transpose(1, 0, 2), obuf


def check_gemm(out, obuf, ref, f32, T, N, B):
    """A GEMM's out against float64 ``ref`` [B, T, N]: relative error overall, per token and per 16-feature
    block (a wrong row or block offset cannot hide); with ``obuf`` (``gemm_views``' buffer) nothing written
    outside the view: no token row >= T, no column outside it."""
    got = (out.get().astype(np.float64) if f32 else f64(out)).reshape(B, T, N)
    tol = 1e-5 if f32 else BF16_TOL           # fp32 out: only the accumulation order differs
    assert rel_err(got, ref) < tol
    err_bt = np.linalg.norm(got - ref, axis=2) / np.linalg.norm(ref, axis=2)
    assert err_bt.max() < 4 * tol, err_bt.max()
    blk = lambda a: a.reshape(B, T, N // 16, 16)  # noqa: E731
    err_blk = np.linalg.norm(blk(got - ref), axis=3) / np.linalg.norm(blk(ref), axis=3)
    assert err_blk.max() < 16 * tol, err_blk.max()
    if obuf is not None:
        pad = obuf.get()
        bad = np.isnan(pad) if f32 else pad == POISON_BF16
        assert bad[T:].all(), "wrote a token row >= T (padded token tile)"
        assert bad[:, :, :16].all() and bad[:, :, 16 + N:].all(), "wrote outside the output columns"


@functools.lru_cache(maxsize=None)
def gemm_weight(N, K, B):
    """(device bits, float64 values) of a [B, N, K] GEMM weight, made once per shape (the inputs are fresh)."""
    import cupy as cp
    wb, w = rand_bf16(np.random.default_rng(N * 131 + K * 7 + B), (B, N, K), 0.05)
    return cp.asarray(wb), w


def gemm_twice(x_dev, w_dev, out, dt):
    """``gemm_bf16`` twice with whatever kernel is forced, the second time into a re-poisoned ``out``; returns
    the first result (the caller compares the bits: the summation order must be fixed)."""
    from ddtree_cupy.kernels import gemm
    gemm.gemm_bf16(x_dev, w_dev, out, out_dtype=dt)
    first = out.copy()
    out.fill(np.nan if np.dtype(dt) == np.float32 else POISON_BF16)
    gemm.gemm_bf16(x_dev, w_dev, out, out_dtype=dt)
    return first


# ---- the timing benches in the GPU test files (run as scripts) --------------------------------------------
def copy_bandwidth(nbytes, reps):
    """Device copy bandwidth in bytes/s (read + write) over ``reps`` copies of ``nbytes``, after one warm copy:
    the ceiling of a pass that reads every weight once."""
    import cupy as cp
    buf = cp.empty(nbytes, cp.uint8)
    dst = cp.empty_like(buf)
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    cp.copyto(dst, buf)
    ev0.record()
    for _ in range(reps):
        cp.copyto(dst, buf)
    ev1.record()
    ev1.synchronize()
    return 2 * nbytes * reps / (cp.cuda.get_elapsed_time(ev0, ev1) * 1e-3)


def graph_us(fn, stream, reps):
    """Microseconds per replay of ``fn`` captured as a CUDA graph on ``stream`` (one eager call first, one warm
    replay, then ``reps`` back-to-back replays between two events)."""
    import cupy as cp
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        fn()
        g = stream.end_capture()
        g.launch(stream)
        stream.synchronize()
        ev0.record(stream)
        for _ in range(reps):
            g.launch(stream)
        ev1.record(stream)
        ev1.synchronize()
    return cp.cuda.get_elapsed_time(ev0, ev1) * 1e3 / reps


# ---- the sampler's statistics ----------------------------------------------------------------------------
def sample_target_probs(logits, temperature, top_k, top_p):
    """The distribution the sampler draws from, float64 (as reference.ddtree.sample_from_logits): softmax(l / T)
    sorted (ties: the lower id first), its first ``top_k``, then the shortest head reaching ``top_p`` of the
    kept mass, renormalised. Returns (p over the vocabulary, the kept ids in sorted order)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.lexsort((np.arange(len(p)), -p))
    ps = p[order]
    if top_k > 0:
        ps = ps[:top_k]
    if top_p < 1:
        c = np.cumsum(ps)
        ps = ps[:int(np.searchsorted(c, top_p * c[-1], side="left")) + 1]
    out = np.zeros_like(p)
    out[order[:len(ps)]] = ps / ps.sum()
    return out, order[:len(ps)]


def chi2_critical(df, z=3.719):
    """Upper quantile of chi-square(df) at a 1e-4 false-alarm rate (z = 3.719), Wilson-Hilferty."""
    a = 2.0 / (9.0 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def logits_on_device(cp, x, dtype):
    """float32 logits ``x`` as a kernel reads them: ``dtype`` 'bf16' rounds them to bf16 bits (the values the
    kernel sees come back float32), anything else keeps float32. Returns (those values, the device array)."""
    if dtype == "bf16":
        bits = to_bf16_bits(x)
        return bf16_bits_to_f32(bits), cp.asarray(bits)
    return x, cp.asarray(x)
