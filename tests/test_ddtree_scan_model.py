"""CPU model of the scan top-K (cuda_src/ddtree.cu, the scan kind: stage 1's group keys, the merge's
radix narrowing of them, the re-read of the selected groups). The kernel's exactness is tested on the GPU
(tests/gpu/test_ddtree_gpu.py, top-K kind "scan"); this model checks the argument the merge rests on, with the
kernel's own constants and stopping rule, on inputs that stress it: the candidates it gathers contain the
row's top-k (ties and -inf included), at most cand_cap(k) groups are re-read, at most 32 cand_cap(k)
candidates land in the shared buffer, and the buffer fits the kernel's shared memory (merge_smem)."""
import numpy as np
import pytest

from ddtree_cupy.kernels import ddtree as ddt

THREADS, VEC = ddt.TOPK_THREADS, 8


def _keys(x: np.ndarray, id0: int = 0) -> np.ndarray:
    """The kernels' 64-bit keys: order-preserving float bits (-0.0 as +0.0) << 32 | (2^32 - 1 - id)."""
    b = (x.astype(np.float32) + np.float32(0.0)).view(np.uint32).astype(np.uint64)
    o = np.where(b >> np.uint64(31) == 1, (~b) & np.uint64(0xFFFFFFFF), b | np.uint64(0x80000000))
    ids = np.arange(x.size, dtype=np.uint64) + np.uint64(id0)
    return (o << np.uint64(32)) | (np.uint64(0xFFFFFFFF) - ids)


def _group_of(V: int, chunk: int) -> np.ndarray:
    """Group (chunk * 256 + thread) of every logit: thread t of a chunk holds vectors (u * 256 + t) * 8."""
    i = np.arange(V)
    c, j = i // chunk, i % chunk
    return c * THREADS + (j // VEC) % THREADS


def _window_bound(nz: np.ndarray, k: int, gcap: int):
    """The merge's first try: windows of 256 top-16-bit values from the largest down; the k-th largest
    key's top 16 bits t give thr = t << 48 if at most gcap keys are >= it; None if not (then the radix)."""
    t16 = (nz >> np.uint64(48)).astype(np.int64)
    wtop, remaining, above = int(t16.max()), k, 0
    for w in range(3):
        if wtop < 0:
            break
        d = wtop - t16
        near = d[(d >= 0) & (d < 256)]
        if near.size < remaining:
            remaining -= near.size
            above += near.size
            wtop -= 256
            continue
        hist = np.bincount(near, minlength=256)        # by distance below the window's top
        cum = np.cumsum(hist)
        ds = int(np.searchsorted(cum, remaining))      # the k-th largest's distance
        if above + int(cum[ds]) <= gcap:
            return np.uint64((wtop - ds) << 48), w + 1
        return None, w + 1
    return None, 3


def _radix_bound(gk: np.ndarray, k: int, gcap: int):
    """The merge's narrowing: the windows first (_window_bound), else 8-bit digits from the top over the
    nonzero group keys, stopping at the first bin prefix thr with (keys >= thr) <= gcap; returns (thr,
    passes over the keys)."""
    nz = gk[gk != 0]
    if nz.size < k:
        return np.uint64(1), 0
    thr, wpasses = _window_bound(nz, k, gcap)
    if thr is not None:
        return np.uint64(max(int(thr), 1)), wpasses
    thr, remaining, above = 0, k, 0
    for p, shift in enumerate(range(56, -1, -8)):
        hmask = 0 if shift == 56 else (~0 << (shift + 8)) & (2**64 - 1)
        sel = nz[(nz & np.uint64(hmask)) == np.uint64(thr)]
        hist = np.bincount(((sel >> np.uint64(shift)) & np.uint64(255)).astype(np.int64), minlength=256)
        cum = np.cumsum(hist[::-1])               # keys in bins >= d, d from 255 down
        d = 255 - int(np.searchsorted(cum, remaining))
        a = int(hist[d + 1:].sum())
        thr |= d << shift
        remaining -= a
        above += a
        if above + int(hist[d]) <= gcap:
            return np.uint64(max(thr, 1)), wpasses + p + 1
    raise AssertionError("the narrowing must stop at the last digit")


def model_scan_topk(x: np.ndarray, k: int, chunk: int = ddt.DEFAULT_CHUNK, id0: int = 0):
    V = x.size
    P = ddt.n_chunks(V, chunk)
    keys = _keys(x, id0)
    grp = _group_of(V, chunk)
    gk = np.zeros(P * THREADS, np.uint64)
    np.maximum.at(gk, grp, keys)                 # a group's key: its largest element key
    gcap = ddt.cand_cap(k)
    thr, passes = _radix_bound(gk, k, gcap)
    groups = np.flatnonzero(gk >= thr)
    cand = keys[np.isin(grp, groups) & (keys >= thr)]
    return dict(cand=cand, n_groups=groups.size, gcap=gcap, passes=passes, P=P)


def _rows(rng, V):
    x = (rng.standard_normal(V) * 2.0).astype(np.float32)
    x[rng.integers(0, V, size=8)] += 10.0
    bf = lambda a: ((a.view(np.uint32) + np.uint32(0x8000)) & np.uint32(0xFFFF0000)).view(np.float32)  # noqa: E731
    equal = np.full(V, 1.25, np.float32)
    runs = x.copy()
    runs[3000:9000] = 20.0
    masked = np.full(V, -np.inf, np.float32)      # a masked vocabulary: fewer finite logits than k
    masked[rng.integers(0, V, size=40)] = rng.standard_normal(40).astype(np.float32)
    halves = np.round(x * 2) / 2
    zeros = np.where(rng.random(V) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    return dict(normal=x, bf16=bf(x), equal=equal, runs=runs, masked=masked, halves=halves, zeros=zeros)


@pytest.mark.parametrize("V,k", [(163840, 64), (163840, 128), (163840, 8), (163840, 2), (20480, 128),
                                 (4096 + 264, 33), (512, 128), (1024, 64), (8192 + 64, 128)])
def test_candidates_hold_the_top_k(V, k):
    rng = np.random.default_rng(V + k)
    for name, x in _rows(rng, V).items():
        m = model_scan_topk(x, k, id0=7 * V)
        top = np.sort(_keys(x, 7 * V))[::-1][:k]
        assert np.isin(top, m["cand"]).all(), name          # the row's top-k is among the candidates
        assert m["cand"].size >= k, name
        assert m["n_groups"] <= m["gcap"], name              # s_gl holds gcap group indices
        assert m["cand"].size <= 32 * m["gcap"], name       # the candidate region
        smem = ddt.merge_smem(m["P"], k, parts_major=False, kind="scan")
        assert smem >= m["cand"].size * 8 + m["n_groups"] * 4 and smem <= ddt.MAX_MERGE_SMEM, name


def test_random_rows_stop_early_with_few_candidates():
    """The bench's inputs: bf16 N(0, 2) with 8 raised logits, and a confident row (maximum 40 above a
    N(0, 3) bulk). One window pass decides (no radix) and the re-read yields about k candidates, which is
    what makes the merge cheap; a regression here would not be wrong, only slow."""
    rng = np.random.default_rng(3)
    for k in (8, 16, 32, 64, 128):
        x = _rows(rng, 163840)["bf16"]
        m = model_scan_topk(x, k)
        assert m["passes"] == 1, (k, m["passes"])
        assert m["cand"].size <= 2 * k + 16, (k, m["cand"].size)
        x = (rng.standard_normal(163840) * 3).astype(np.float32)
        x[rng.integers(0, 163840, size=3)] = 40.0
        m = model_scan_topk(x, k)
        assert m["passes"] <= 2, (k, m["passes"])


def test_window_path_and_radix_path_both_taken():
    """The GPU tests' inputs reach both bounds: random rows the windows, all-equal rows and long runs of
    equal maxima the radix (one top-16 value holds more than cand_cap(k) group keys)."""
    rng = np.random.default_rng(5)
    rows = _rows(rng, 163840)
    for k in (8, 64, 128):
        for name, radix in (("normal", False), ("halves", False), ("equal", True), ("runs", True)):
            gk = model_scan_topk(rows[name], k)
            assert (gk["passes"] > 3) == radix, (name, k, gk["passes"])


def _thread_max_bound(gk: np.ndarray, P: int, k: int, gcap: int):
    """Variant 8's first try (merge_scan_regs): thread t holds group keys j * 256 + t; the k-th largest of
    the 256 threads' maxima (top 16 bits, from a one-key-per-thread histogram over the window of 256 values
    below the row's largest) gives t0 = its top 16 bits << 48, accepted when at most gcap group keys are
    >= t0. Returns (t0, groups >= t0) or None (then merge_scan's windows and radix, _radix_bound)."""
    tmax = gk.reshape(P, THREADS).max(axis=0)
    nz = gk[gk != 0]
    top_all = int((nz >> np.uint64(48)).max())
    dm = top_all - (tmax >> np.uint64(48)).astype(np.int64)
    inw = (tmax != 0) & (dm < 256)
    if inw.sum() < k:
        return None
    hist = np.bincount(dm[inw], minlength=256)         # by distance below the largest
    ds = int(np.searchsorted(np.cumsum(hist), k))      # the k-th largest thread maximum's distance
    t0 = np.uint64(max((top_all - ds) << 48, 1))
    n0 = int((gk >= t0).sum())
    return (t0, n0) if n0 <= gcap else None


def model_scan_topk_regs(x: np.ndarray, k: int, chunk: int = ddt.DEFAULT_CHUNK, id0: int = 0):
    """The register merge (merge_scan_regs): the thread-maximum bound first, else merge_scan's thresholds."""
    V = x.size
    P = ddt.n_chunks(V, chunk)
    keys = _keys(x, id0)
    grp = _group_of(V, chunk)
    gk = np.zeros(P * THREADS, np.uint64)
    np.maximum.at(gk, grp, keys)
    gcap = ddt.cand_cap(k)
    first = _thread_max_bound(gk, P, k, gcap) if (gk != 0).sum() >= k else None
    thr = first[0] if first is not None else _radix_bound(gk, k, gcap)[0]
    groups = np.flatnonzero(gk >= max(thr, np.uint64(1)))
    cand = keys[np.isin(grp, groups) & (keys >= thr)]
    return dict(cand=cand, n_groups=groups.size, gcap=gcap, first=first is not None, P=P)


@pytest.mark.parametrize("V,k", [(163840, 64), (163840, 128), (163840, 8), (163840, 2), (20480, 128),
                                 (4096 + 264, 33), (512, 128), (1024, 64), (8192 + 64, 128)])
def test_regs_merge_candidates_hold_the_top_k(V, k):
    """The thread-maximum bound is <= the k-th largest group key (k distinct groups are >= it), so the
    re-read still holds the row's top-k; it never re-reads more than gcap groups."""
    rng = np.random.default_rng(V + 3 * k)
    for name, x in _rows(rng, V).items():
        m = model_scan_topk_regs(x, k, id0=5 * V)
        top = np.sort(_keys(x, 5 * V))[::-1][:k]
        assert np.isin(top, m["cand"]).all(), name
        assert m["n_groups"] <= m["gcap"] and m["cand"].size <= 32 * m["gcap"], name


def test_regs_merge_first_bound_decides_random_rows():
    """On the bench's rows the one-key-per-thread histogram decides (no window pass over every key) with
    about k candidates; all-equal rows and long runs fall through to the windows / radix."""
    rng = np.random.default_rng(11)
    rows = _rows(rng, 163840)
    for k in (8, 16, 32, 64, 128):
        m = model_scan_topk_regs(rows["bf16"], k)
        assert m["first"], k
        assert m["cand"].size <= 2 * k + 16, (k, m["cand"].size)
        for name in ("equal", "runs"):
            assert not model_scan_topk_regs(rows[name], k)["first"], (name, k)


def test_regs_model_follows_the_kernel():
    from pathlib import Path
    src = (Path(__file__).resolve().parents[1] / "cuda_src" / "ddtree.cu").read_text()
    body = src[src.index("__device__ void merge_scan_regs("):]
    for stmt in ("for (int j = 0; j < DDT_MREG; ++j) gk[j] = j < P ? ld_s1(&row[(size_t)j * W + DDT_SCAN_HDR + tid]) : 0ull;",
                 "for (int j = 0; j < DDT_MREG; ++j) tmax = gk[j] > tmax ? gk[j] : tmax;",
                 "const bool inw = tmax != 0ull && dm < 256;",
                 "if (inw) atomicAdd(&sh.hist[255 - dm], 1u);",
                 "if (warp == 0) radix_pick(sh.hist, (unsigned)k, lane, &sh.digit, &sh.above, &sh.bin);",
                 "u64 t0 = (u64)(unsigned)((int)top_all - (255 - sh.digit)) << 48;",
                 "t0 = t0 > 1ull ? t0 : 1ull;",
                 "if (n0 <= gcap) { thr = t0; ng = n0; o = o0; placed = true; }",
                 "if (gk[j] >= thr) s_gl[o++] = j * DDT_TOPK_THREADS + tid;"):
        assert stmt in body, stmt
