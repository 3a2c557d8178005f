"""GPU DDTree kernels (cuda_src/ddtree.cu) against the numpy reference (ddtree_cupy/reference/ddtree.py):
top-K ids exact and log-probs against float64, trees / masks / walks / commit indices exact, vocabulary
shards merged, CUDA-graph replay equal to eager, launches with programmatic dependent launch (PDL) equal to
launches without. Every output buffer is poisoned before each
launch."""
from __future__ import annotations

import numpy as np
import pytest

from ddtree_cupy.reference import ddtree as dd

pytestmark = pytest.mark.gpu

R = dd.MAX_TREE_ROWS
W = dd.MASK_WORDS


@pytest.fixture(params=["scan", "list"])
def topk(request):
    """Both top-K kinds (the SCAN template parameter in ddtree.cu, kernels/ddtree.py TOPK_KINDS) must equal
    the reference."""
    return request.param


def _cp():
    import cupy
    return cupy


def _poison(ws):
    cp = _cp()
    for name, a in ws.outputs().items():
        if a.dtype == cp.float32:
            a.fill(np.nan)
        elif a.dtype == cp.uint64:
            a.fill(np.uint64(0xDEADBEEFDEADBEEF))
        elif a.dtype == cp.uint32:
            a.fill(np.uint32(0xA5A5A5A5))
        else:
            a.fill(-7777)


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bits (uint16)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r


def _bf16_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def _random_logits(rng, S, D, V, kind):
    x = (rng.standard_normal((S, D, V)) * 3.0).astype(np.float32)
    # a few peaked rows, like a confident drafter
    x[:, :, rng.integers(0, V, size=4)] += 12.0
    if kind == "ties":
        x = np.round(x * 2) / 2          # many exactly equal logits
        x[0, 0, :] = 1.25                # a row that is all ties
    if kind == "runs":
        # long runs of the row maximum: chunks whose candidates overflow (exact-select path) next to
        # chunks that hold none of the top-k, and a row whose top-k spans two chunks' equal values
        x[:, :, 3000:9000] = 20.0
        x[1, 3, :] = np.round(x[1, 3, :])
        x[0, 1, 8100:8300] = 25.0
    if kind == "peaked":
        # the whole top-k inside one chunk (its bound is the row's), every other chunk contributes nothing
        x[:, :, 9000:9000 + 40] = 30.0 + rng.standard_normal((S, D, 40)).astype(np.float32)
    return x


def _expected_tree(top_lp, top_id, budget, prefix, bonus, cap_k, chain):
    b = min(max(int(budget), 0), R - 1)
    t = dd.build_tree(top_lp, top_id, b, cap_k=cap_k or None, include_chain=chain)
    ft = dd.flatten(t, int(bonus), int(prefix))
    n1 = ft.n_rows
    tokens = np.full(R, bonus, np.int32)
    parents = np.full(R, -1, np.int32)
    depths = np.zeros(R, np.int32)
    positions = np.full(R, prefix, np.int32)
    mask = np.zeros((R, W), np.uint32)
    tokens[:n1], parents[:n1], depths[:n1], positions[:n1] = ft.tokens, ft.parents, ft.depths, ft.positions
    mask[:n1] = ft.mask_bits
    for i in range(n1, R):                # padding rows: root bit + own bit
        mask[i, 0] |= 1
        mask[i, i // 32] |= np.uint32(1 << (i % 32))
    return dict(tokens=tokens, parents=parents, depths=depths, positions=positions, mask=mask, n_rows=n1)


def _check_tree(ws, top_lp, top_id, budgets, prefix, bonus, cap_k, chain):
    got = {k: getattr(ws, k).get() for k in ("tokens", "parents", "depths", "positions", "mask", "n_rows")}
    for s in range(budgets.shape[0]):
        exp = _expected_tree(top_lp[s], top_id[s], budgets[s], prefix[s], bonus[s], cap_k, chain)
        for key in ("tokens", "parents", "depths", "positions", "mask"):
            np.testing.assert_array_equal(got[key][s], exp[key], err_msg=f"stream {s} {key} "
                                          f"(budget {budgets[s]}, cap {cap_k}, chain {chain})")
        assert got["n_rows"][s] == exp["n_rows"], s


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("V,k,kind", [(163840, 64, "normal"), (163840, 128, "ties"), (10000, 8, "ties"),
                                      (2048, 1, "normal"), (4096 + 264, 33, "normal"), (8192 + 64, 128, "normal"),
                                      (163840, 1, "ties"), (40960, 128, "runs"), (24576, 32, "peaked"),
                                      # short rows: 64 groups of 8 logits, fewer than k (the scan merge takes
                                      # every group), and 128 groups for k = 64 (half of them selected)
                                      (512, 128, "normal"), (1024, 64, "ties")])
def test_topk_matches_reference(dtype, V, k, kind, topk):
    cp = _cp()
    from ddtree_cupy.kernels.ddtree import DDTreeWorkspace
    rng = np.random.default_rng(V + k)
    S, D = 2, 7
    x = _random_logits(rng, S, D, V, kind)
    if dtype == "bf16":
        bits = _to_bf16_bits(x)
        x = _bf16_to_f32(bits)
        dev = cp.asarray(bits)
    else:
        dev = cp.asarray(x)
    ws = DDTreeWorkspace(S, D, V, k, topk=topk)
    _poison(ws)
    ws.topk(dev)
    lp, ids = ws.top_lp.get(), ws.top_id.get()
    for s in range(S):
        ref_lp, ref_id = dd.topk_logprobs(x[s], k)
        np.testing.assert_array_equal(ids[s], ref_id, err_msg=f"stream {s}")
        err = np.linalg.norm(lp[s] - ref_lp) / np.linalg.norm(ref_lp)
        assert err < 2e-6, err
        assert (np.diff(lp[s], axis=1) <= 0).all()
    # the merged log-sum-exp partial: m = row max, m + log(s) = logsumexp
    ms = ws.ms.get().reshape(S, D, 2)
    xs = x.astype(np.float64)
    lse = xs.max(-1) + np.log(np.exp(xs - xs.max(-1, keepdims=True)).sum(-1))
    np.testing.assert_array_equal(ms[..., 0], x.max(-1))
    assert np.abs(ms[..., 0] + np.log(ms[..., 1]) - lse).max() < 2e-5


@pytest.mark.parametrize("shards,k", [(2, 64), (4, 64), (8, 64), (4, 1), (8, 128)])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_topk_vocab_shards_merge(shards, k, dtype, topk):
    cp = _cp()
    from ddtree_cupy.kernels.ddtree import DDTreeWorkspace, topk_merge
    rng = np.random.default_rng(shards + k)
    S, D, V = 3, 7, 163840
    x = _random_logits(rng, S, D, V, "ties")
    if dtype == "bf16":
        bits = _to_bf16_bits(x)
        x = _bf16_to_f32(bits)
        full = cp.asarray(bits)
    else:
        full = cp.asarray(x)
    Vl = V // shards
    keys = cp.empty((shards, S * D, k), cp.uint64)
    ms = cp.empty((shards, S * D, 2), cp.float32)
    for r in range(shards):
        ws = DDTreeWorkspace(S, D, Vl, k, topk=topk)
        _poison(ws)
        ws.topk(cp.ascontiguousarray(full[:, :, r * Vl:(r + 1) * Vl]), id_offset=r * Vl)
        keys[r] = ws.keys
        ms[r] = ws.ms
    out_keys = cp.empty((S * D, k), cp.uint64)
    out_ms = cp.empty((S * D, 2), cp.float32)
    out_lp = cp.full((S * D, k), np.nan, cp.float32)
    out_id = cp.full((S * D, k), -7, cp.int32)
    topk_merge(keys, ms, k, out_keys, out_ms, out_lp, out_id, parts_major=True, kind=topk)
    whole = DDTreeWorkspace(S, D, V, k, topk=topk)
    _poison(whole)
    whole.topk(full)
    np.testing.assert_array_equal(out_keys.get(), whole.keys.get())
    ids = out_id.get().reshape(S, D, k)
    lp = out_lp.get().reshape(S, D, k)
    for s in range(S):
        ref_lp, ref_id = dd.topk_logprobs(x[s], k)
        np.testing.assert_array_equal(ids[s], ref_id)
        assert np.linalg.norm(lp[s] - ref_lp) / np.linalg.norm(ref_lp) < 2e-6


def _tie_top(rng, S, D, K, levels=4, step=0.5):
    """Sorted log-probs on a dyadic grid: exact score ties. 4 levels of 0.5: many-way ties across lanes;
    128 levels of 0.125 ("sparse"): often exactly two maxima, sometimes in two slots of one lane of the
    register builders where the slot order is not the rank-tuple order (tests/test_ddtree_builder_model.py:
    a builder that took the lower slot there fails these inputs in a few streams)."""
    vals = -rng.integers(0, levels, size=(S, D, K)).astype(np.float32) * step
    lp = -np.sort(-vals, axis=-1)
    ids = np.stack([[rng.permutation(50000)[:K] for _ in range(D)] for _ in range(S)]).astype(np.int32)
    return lp, ids


@pytest.mark.parametrize("source", ["logits", "ties", "sparse", "zero", "flat"])
@pytest.mark.parametrize("cap_k,chain", [(0, False), (0, True), (8, False), (3, True), (1, False)])
def test_build_tree_matches_reference(source, cap_k, chain):
    cp = _cp()
    from ddtree_cupy.kernels.ddtree import DDTreeWorkspace
    rng = np.random.default_rng(11 + cap_k + 100 * chain + 1000 * len(source))
    # budgets on both sides of the sorted-cache builder's limit (64; builder v3 above it)
    budgets = np.array([64, 1, 0, 8, 128, 33, 16, 7, 2, 100, 128, 96, 50, 127, 63, 65, 32, 40], np.int32)
    S, D, K = budgets.shape[0], 7, 128
    if source in ("sparse", "zero", "flat"):   # depth 8 (the most): the largest frontier (137 positions)
        D = 8
    ws = DDTreeWorkspace(S, D, 8192, K)
    _poison(ws)
    if source == "logits":
        ws.topk(cp.asarray(_random_logits(rng, S, D, 8192, "normal")))
    else:
        if source == "zero":   # every score 0 (signed zeros mixed): the rank tuple decides every pop
            lp = np.where(rng.random((S, D, K)) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
            ids = rng.integers(0, 50000, size=(S, D, K)).astype(np.int32)
        elif source == "flat":  # log-probs falling slowly with the rank: the frontier grows by ~1 per pop,
            # so the sorted cache (32 entries) drops entries from pop 32 on (tests/test_ddtree_cache_model.py)
            lp = -(np.float32(0.05) + np.float32(0.1) * np.arange(K, dtype=np.float32)
                   + rng.random((S, D, K)).astype(np.float32) * np.float32(0.01))
            lp = -np.sort(-lp, axis=-1).astype(np.float32)
            ids = rng.integers(0, 50000, size=(S, D, K)).astype(np.int32)
        else:
            lp, ids = _tie_top(rng, S, D, K, *((128, 0.125) if source == "sparse" else (4, 0.5)))
        ws.top_lp[...] = cp.asarray(lp)
        ws.top_id[...] = cp.asarray(ids)
    top_lp, top_id = ws.top_lp.get(), ws.top_id.get()
    prefix = rng.integers(0, 5000, size=S).astype(np.int32)
    bonus = rng.integers(0, 163840, size=S).astype(np.int32)
    ws.build(cp.asarray(budgets), cp.asarray(prefix), cp.asarray(bonus), cap_k=cap_k, include_chain=chain)
    _check_tree(ws, top_lp, top_id, budgets, prefix, bonus, cap_k, chain)


@pytest.mark.parametrize("D,K", [(1, 1), (1, 5), (3, 1), (2, 2), (8, 3), (5, 128)])
@pytest.mark.parametrize("chain", [False, True])
def test_build_tree_small_shapes(D, K, chain):
    """Depth 1, K = 1 and the like: the frontier's clamped log-prob indices (v3 carries the next sibling's
    and first child's log-probs in each entry) and budgets larger than the whole tree."""
    cp = _cp()
    from ddtree_cupy.kernels.ddtree import DDTreeWorkspace
    rng = np.random.default_rng(D * 1000 + K + 7 * chain)
    budgets = np.array([0, 1, 2, 5, 17, 128], np.int32)
    S = budgets.shape[0]
    ws = DDTreeWorkspace(S, D, 4096, K)
    lp, ids = _tie_top(rng, S, D, K, 8, 0.25)
    lp[1] = -np.sort(rng.random((D, K)).astype(np.float32) * 3, axis=-1)   # stream 1 without ties
    prefix = rng.integers(0, 5000, size=S).astype(np.int32)
    bonus = rng.integers(0, 163840, size=S).astype(np.int32)
    for cap_k in (0, 1, 2):
        _poison(ws)
        ws.top_lp[...] = cp.asarray(lp)
        ws.top_id[...] = cp.asarray(ids)
        ws.build(cp.asarray(budgets), cp.asarray(prefix), cp.asarray(bonus), cap_k=cap_k, include_chain=chain)
        _check_tree(ws, lp, ids, budgets, prefix, bonus, cap_k, chain)


def _post_for(rng, tokens, parents, n1):
    """Per-row target tokens that follow a random root-to-row path, with near-misses elsewhere."""
    post = rng.choice(tokens[:n1], size=R).astype(np.int32)           # often a token of the tree
    post[n1:] = rng.integers(0, 163840, size=R - n1)
    leaf = int(rng.integers(0, n1))
    path = []
    r = leaf
    while r >= 0:
        path.append(r)
        r = int(parents[r])
    path = path[::-1]
    for a, b in zip(path[:-1], path[1:]):
        post[a] = tokens[b]
    return post


def _check_walk(ws, tokens, parents, n_rows, post, prefix, row_off, D):
    A = D + 1
    got = {k: getattr(ws, k).get() for k in ("acc_rows", "n_acc", "kv_src", "kv_dst", "feat_rows",
                                             "out_tokens", "new_len", "new_bonus")}
    for s in range(tokens.shape[0]):
        n1 = int(n_rows[s])
        rows, bonus = dd.greedy_walk(tokens[s, :n1], parents[s, :n1], post[s, :n1])
        depths = np.zeros(n1, np.int64)
        for i in range(1, n1):
            depths[i] = depths[parents[s, i]] + 1
        plan = dd.commit_plan(rows, depths, int(prefix[s]))
        a = len(rows)
        pad = lambda v, w: np.concatenate([np.asarray(v, np.int32), np.full(w - len(v), -1, np.int32)])  # noqa
        np.testing.assert_array_equal(got["acc_rows"][s], pad(rows, A))
        np.testing.assert_array_equal(got["kv_src"][s], pad(plan.src_slots, A))
        np.testing.assert_array_equal(got["kv_dst"][s], pad(plan.dst_slots, A))
        np.testing.assert_array_equal(got["feat_rows"][s], pad(plan.feature_rows + row_off[s], A))
        np.testing.assert_array_equal(got["out_tokens"][s], pad(list(tokens[s, rows]) + [bonus], A + 1))
        assert got["n_acc"][s] == a and got["new_len"][s] == plan.new_len and got["new_bonus"][s] == bonus


@pytest.mark.parametrize("sampled", [False, True])
def test_walk_commit_matches_reference(sampled):
    cp = _cp()
    from ddtree_cupy.kernels.ddtree import DDTreeWorkspace
    rng = np.random.default_rng(5 + sampled)
    budgets = np.array([64, 1, 0, 8, 128, 33, 16, 7], np.int32)
    S, D, K = budgets.shape[0], 7, 128
    ws = DDTreeWorkspace(S, D, 4096, K)
    _poison(ws)
    x = _random_logits(rng, S, D, 4096, "normal")
    x_dev = cp.asarray(x)
    ws.topk(x_dev)
    prefix = rng.integers(0, 5000, size=S).astype(np.int32)
    bonus = rng.integers(0, 4096, size=S).astype(np.int32)
    ws.build(cp.asarray(budgets), cp.asarray(prefix), cp.asarray(bonus))
    tokens, parents, n_rows = ws.tokens.get(), ws.parents.get(), ws.n_rows.get()
    if sampled:
        # target logits that favour the tree's tokens so sampled walks go deep; samples from the reference
        post = np.zeros((S, R), np.int32)
        for s in range(S):
            n1 = int(n_rows[s])
            logits = rng.standard_normal((n1, 4096))
            for i in range(1, n1):
                logits[parents[s, i], tokens[s, i]] += 8.0
            post[s, :n1] = dd.sample_tokens(logits, 0.9, 0.95, 50, seed=77, stream=s, step=3)
            post[s, n1:] = rng.integers(0, 4096, size=R - n1)
    else:
        post = np.stack([_post_for(rng, tokens[s], parents[s], int(n_rows[s])) for s in range(S)])
    row_off = (np.arange(S) * R + 3).astype(np.int32)
    pre_dev = cp.asarray(prefix)
    bonus_dev = cp.asarray(bonus)
    ws.walk_commit(cp.asarray(post), pre_dev, cp.asarray(row_off))
    _check_walk(ws, tokens, parents, n_rows, post, prefix, row_off, D)
    assert ws.n_acc.get().max() >= 3      # the test really walks
    # in-place state update, aliasing the prefix length the kernel reads
    _poison(ws)
    ws.topk(x_dev)
    ws.build(cp.asarray(budgets), pre_dev, bonus_dev)
    ws.walk_commit(cp.asarray(post), pre_dev, cp.asarray(row_off), update_len=pre_dev, update_bonus=bonus_dev)
    _check_walk(ws, tokens, parents, n_rows, post, prefix, row_off, D)
    np.testing.assert_array_equal(pre_dev.get(), ws.new_len.get())
    np.testing.assert_array_equal(bonus_dev.get(), ws.new_bonus.get())


def _assert_same_candidate_sets(a, b, trial):
    """Stage-1 rows [bound, n, key_0 .. key_{n-1}, unused...]: bound and n equal, the n keys equal as sets
    (their order comes from shared-memory atomics; the slots past n are not written)."""
    np.testing.assert_array_equal(a[..., :2], b[..., :2], err_msg=f"part_keys bound/count (trial {trial})")
    n = a[..., 1].astype(np.int64)
    assert (n >= 1).all() and (n <= a.shape[-1] - 2).all()
    for idx in np.ndindex(*a.shape[:-1]):
        m = int(n[idx])
        np.testing.assert_array_equal(np.sort(a[idx][2:2 + m]), np.sort(b[idx][2:2 + m]),
                                      err_msg=f"part_keys {idx} (trial {trial})")


def test_graph_replay_equals_eager(topk):
    cp = _cp()
    from ddtree_cupy.kernels.ddtree import DDTreeWorkspace
    rng = np.random.default_rng(99)
    S, D, V, K = 10, 7, 163840, 64
    ws = DDTreeWorkspace(S, D, V, K, topk=topk)
    logits = cp.asarray(_to_bf16_bits(_random_logits(rng, S, D, V, "normal")))
    budgets = cp.asarray(rng.integers(0, 65, size=S).astype(np.int32))
    prefix = cp.asarray(rng.integers(0, 9000, size=S).astype(np.int32))
    bonus = cp.asarray(rng.integers(0, V, size=S).astype(np.int32))
    post = cp.asarray(rng.integers(0, V, size=(S, R)).astype(np.int32))
    row_off = cp.asarray((np.arange(S) * R).astype(np.int32))

    def step():
        ws.topk(logits)
        ws.build(budgets, prefix, bonus, cap_k=16, include_chain=True)
        ws.walk_commit(post, prefix, row_off)

    def snapshot():
        return {k: v.get() for k, v in ws.outputs().items()}

    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Stream.null.synchronize()  # null-stream work is not ordered before a non-blocking stream
    with stream:
        step()                               # compile outside the capture
        stream.synchronize()
        stream.begin_capture()
        step()
        graph = stream.end_capture()
    for trial in range(2):
        if trial == 1:                       # new inputs written in place: the graph must see them
            logits[...] = cp.asarray(_to_bf16_bits(_random_logits(rng, S, D, V, "normal")))
            budgets[...] = cp.asarray(rng.integers(0, 65, size=S).astype(np.int32))
            prefix[...] = cp.asarray(rng.integers(0, 9000, size=S).astype(np.int32))
        # post follows a path through the tree that eager builds for these inputs
        cp.cuda.Stream.null.synchronize()  # null-stream work is not ordered before a non-blocking stream
        with stream:
            ws.topk(logits)
            ws.build(budgets, prefix, bonus, cap_k=16, include_chain=True)
        stream.synchronize()
        tk, pa, nr = ws.tokens.get(), ws.parents.get(), ws.n_rows.get()
        post[...] = cp.asarray(np.stack([_post_for(rng, tk[s], pa[s], int(nr[s])) for s in range(S)]))
        _poison(ws)
        cp.cuda.Stream.null.synchronize()  # null-stream work is not ordered before a non-blocking stream
        with stream:
            step()
        stream.synchronize()
        eager = snapshot()
        _poison(ws)
        cp.cuda.Stream.null.synchronize()  # the null-stream writes above are not ordered before a non-blocking stream
        graph.launch(stream)
        stream.synchronize()
        replay = snapshot()
        for k in eager:
            # per-chunk candidate lists: a set, stored in atomic (run-dependent) order; the scan kind's
            # group keys and header have fixed places: compared bit for bit below
            if k == "part_keys" and ws.topk_kind != "scan":
                _assert_same_candidate_sets(replay[k], eager[k], trial)
                continue
            np.testing.assert_array_equal(replay[k], eager[k], err_msg=f"{k} (trial {trial})")
        _check_tree(ws, ws.top_lp.get(), ws.top_id.get(), budgets.get(), prefix.get(), bonus.get(), 16, True)


def test_bad_arguments_name_the_tensor():
    cp = _cp()
    from ddtree_cupy.kernels.ddtree import DDTreeWorkspace, build_tree
    ws = DDTreeWorkspace(2, 7, 4096, 16)
    with pytest.raises(ValueError, match="logits"):
        ws.topk(cp.zeros((2, 7, 4096), cp.float64))
    with pytest.raises(ValueError, match="logits"):
        ws.topk(cp.zeros((2, 6, 4096), cp.float32))
    i32 = lambda *s: cp.zeros(s, cp.int32)  # noqa: E731
    with pytest.raises(ValueError, match="budgets"):
        ws.build(i32(3), i32(2), i32(2))
    with pytest.raises(ValueError, match="mask"):
        build_tree(ws.top_lp, ws.top_id, i32(2), i32(2), i32(2), ws.tokens, ws.parents, ws.depths,
                   ws.positions, ws.n_rows, cp.zeros((2, 129, 4), cp.uint32))
    with pytest.raises(ValueError, match="post"):
        ws.walk_commit(i32(2, 128), i32(2), i32(2))


@pytest.fixture()
def pdl_on():
    """Programmatic dependent launch on for one test (kernels/launch.py), restored afterwards."""
    from ddtree_cupy.kernels import launch
    was = launch.pdl_enabled()
    launch.set_pdl(True)
    yield launch
    launch.set_pdl(was)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("V,K", [(163840, 64), (172032, 32), (163840, 1)])   # register merge / 21 chunks
# (merge_scan) / k = 1 (the list merge)
def test_topk_with_pdl_equals_without(V, K, dtype, pdl_on):
    """With PDL the merge may launch while stage 1 drains (10 x 7 rows x 20 chunks = 1400 blocks, several
    waves) and must wait before reading. Every round has new logits and poisoned outputs, stage-1 buffers
    included, so a merge that read a row before all of its chunks were written would give other keys. Each
    round is compared bit for bit with the same workspace launched without PDL, and the first round's ids /
    log-probs with the reference on a few rows; the stand-alone launches (the bench's 'stage 1' / 'merge
    alone') must give the same keys."""
    cp = _cp()
    from ddtree_cupy.kernels.ddtree import DDTreeWorkspace, topk_merge, topk_partial
    launch = pdl_on
    rng = np.random.default_rng(329 + (dtype == "f32") + V + K)
    S, D = 10, 7
    ws = DDTreeWorkspace(S, D, V, K)
    names = ("keys", "ms", "top_lp", "top_id")
    for rnd in range(3):
        x = _random_logits(rng, S, D, V, "normal" if rnd != 2 else "ties")
        if dtype == "bf16":
            bits = _to_bf16_bits(x)
            x = _bf16_to_f32(bits)
            dev = cp.asarray(bits)
        else:
            dev = cp.asarray(x)
        launch.set_pdl(False)
        _poison(ws)
        ws.topk(dev)
        cp.cuda.get_current_stream().synchronize()
        plain = {n: getattr(ws, n).get() for n in names}
        launch.set_pdl(True)
        for rep in range(2):
            _poison(ws)
            ws.topk(dev)
            cp.cuda.get_current_stream().synchronize()
            for n in names:
                np.testing.assert_array_equal(getattr(ws, n).get(), plain[n], err_msg=f"{n} (round {rnd}, rep {rep})")
        if rnd == 0:
            for s, d in ((0, 0), (4, 3), (S - 1, D - 1)):
                ref_lp, ref_id = dd.topk_logprobs(x[s, d:d + 1], K)
                np.testing.assert_array_equal(plain["top_id"][s, d], ref_id[0], err_msg=f"row {s},{d}")
                err = np.linalg.norm(plain["top_lp"][s, d] - ref_lp[0]) / np.linalg.norm(ref_lp[0])
                assert err < 2e-6, err
    # stand-alone launches (no counters; the merge waits for the whole stage-1 grid)
    _poison(ws)
    flat = dev.reshape(S * D, V)
    topk_partial(flat, K, ws.part_keys, ws.part_ms, kind=ws.topk_kind)
    topk_merge(ws.part_keys, ws.part_ms, K, ws.keys, ws.ms, ws.top_lp.reshape(S * D, K), ws.top_id.reshape(S * D, K),
               kind=ws.topk_kind)
    cp.cuda.get_current_stream().synchronize()
    for n in names:
        np.testing.assert_array_equal(getattr(ws, n).get(), plain[n], err_msg=f"{n} (stand-alone launches)")


def test_step_graph_with_pdl_equals_eager(pdl_on):
    """The whole step (top-K, builder, walk) captured with PDL and replayed several times with new logits
    written in place: equal to eager launches without PDL, bit for bit (stage-1 buffers included: the scan
    layout has fixed places)."""
    cp = _cp()
    from ddtree_cupy.kernels.ddtree import DDTreeWorkspace
    launch = pdl_on
    rng = np.random.default_rng(85)
    S, D, V, K = 10, 7, 163840, 64
    ws = DDTreeWorkspace(S, D, V, K)
    logits = cp.asarray(_to_bf16_bits(_random_logits(rng, S, D, V, "normal")))
    budgets = cp.asarray(rng.integers(0, 65, size=S).astype(np.int32))
    prefix = cp.asarray(rng.integers(0, 9000, size=S).astype(np.int32))
    bonus = cp.asarray(rng.integers(0, V, size=S).astype(np.int32))
    post = cp.asarray(rng.integers(0, V, size=(S, R)).astype(np.int32))
    row_off = cp.asarray((np.arange(S) * R).astype(np.int32))

    def step():
        ws.topk(logits)
        ws.build(budgets, prefix, bonus)
        ws.walk_commit(post, prefix, row_off)

    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Stream.null.synchronize()  # null-stream work is not ordered before a non-blocking stream
    with stream:
        step()
        stream.synchronize()
        stream.begin_capture()
        for _ in range(3):   # back to back in one graph: each stage 1 follows the previous round's walk
            step()
        graph = stream.end_capture()
    for trial in range(3):
        if trial:
            logits[...] = cp.asarray(_to_bf16_bits(_random_logits(rng, S, D, V, "normal")))
            budgets[...] = cp.asarray(rng.integers(0, 65, size=S).astype(np.int32))
        launch.set_pdl(False)
        cp.cuda.Stream.null.synchronize()  # null-stream work is not ordered before a non-blocking stream
        with stream:
            ws.topk(logits)
            ws.build(budgets, prefix, bonus)
        stream.synchronize()
        tk, pa, nr = ws.tokens.get(), ws.parents.get(), ws.n_rows.get()
        post[...] = cp.asarray(np.stack([_post_for(rng, tk[s], pa[s], int(nr[s])) for s in range(S)]))
        _poison(ws)
        cp.cuda.Stream.null.synchronize()  # null-stream work is not ordered before a non-blocking stream
        with stream:
            step()
        stream.synchronize()
        eager = {k: v.get() for k, v in ws.outputs().items()}
        launch.set_pdl(True)
        _poison(ws)
        cp.cuda.Stream.null.synchronize()  # the null-stream writes above are not ordered before a non-blocking stream
        graph.launch(stream)
        stream.synchronize()
        for k, v in ws.outputs().items():
            np.testing.assert_array_equal(v.get(), eager[k], err_msg=f"{k} (trial {trial})")
        _check_tree(ws, ws.top_lp.get(), ws.top_id.get(), budgets.get(), prefix.get(), bonus.get(), 0, False)
