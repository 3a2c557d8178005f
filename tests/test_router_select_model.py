"""A lane-by-lane numpy model of router.cu's per-token selection (route_token): each lane's best candidate
by a linear scan of its 16 registers, the pick by a warp max of keys then reduce_min of the holders' ids. Checked
against the reference order (descending choice key, ties to the lower expert id) on random rows and on
constructed ties, so the algorithm is verified without a GPU (tests/gpu/test_fused_layer.py runs the kernels)."""
import numpy as np
import pytest

PER_LANE = 16


def ord_key(f):
    u = np.asarray(f, np.float32).view(np.uint32).astype(np.uint64)
    return np.where(u & 0x80000000, ~u & 0xFFFFFFFF, u | 0x80000000).astype(np.uint64)


def lane_best(key, live):
    """(best_key, best_j) of one lane; best_j -1 when none is live (router.cu lane_best: a linear scan)."""
    bk, bj = 0, -1
    for j in range(PER_LANE):
        if (live >> j) & 1 and (bj < 0 or key[j] > bk):
            bk, bj = int(key[j]), j
    return bk, bj


def select(choice, k):
    """ids in pick order, as route_token computes them (n_group 1)."""
    E = choice.size
    keys = np.zeros((32, PER_LANE), np.uint64)
    live = [0] * 32
    ck = ord_key(choice)
    for e in range(E):
        keys[e % 32, e // 32] = ck[e]
        live[e % 32] |= 1 << (e // 32)
    best = [lane_best(keys[ln], live[ln]) for ln in range(32)]
    ids = []
    for _ in range(k):
        m = max(bk if bj >= 0 else 0 for bk, bj in best)
        cand = [ln + 32 * bj if (bj >= 0 and bk == m) else 0xFFFFFFFF for ln, (bk, bj) in enumerate(best)]
        eid = min(cand)                 # __reduce_min_sync: the lowest id among the holders of the maximum
        owner = eid & 31
        ids.append(eid)
        live[owner] &= ~(1 << best[owner][1])
        best[owner] = lane_best(keys[owner], live[owner])
    return np.array(ids)


def reference(choice, k):
    return np.lexsort((np.arange(choice.size), -choice.astype(np.float64)))[:k]


@pytest.mark.parametrize("E,k", [(384, 8), (48, 8), (512, 32), (72, 6), (33, 4)])
def test_selection_model_matches_reference(E, k):
    rng = np.random.default_rng(E + k)
    rows = [rng.standard_normal(E).astype(np.float32) for _ in range(6)]
    tied = rng.standard_normal(E).astype(np.float32)
    tied[rng.choice(E, 2 * k, replace=False)] = 3.0         # 2k equal maxima on random lanes
    rows.append(tied)
    same_lane = rng.standard_normal(E).astype(np.float32)
    same_lane[[e for e in (5, 37, 69, 101) if e < E]] = 4.0  # one lane holds several equal maxima
    rows.append(same_lane)
    rows.append(np.full(E, 0.5, np.float32))                # all equal: ids 0..k-1
    coarse = np.round(rng.standard_normal(E) * 2).astype(np.float32)   # many ties everywhere
    rows.append(coarse)
    for c in rows:
        got, want = select(c, k), reference(c, k)
        assert np.array_equal(got, want), (got, want)
