"""CPU checks of ddtree_cupy/reference/attention.py against brute-force loops and independent references
(reference/mla.py's dense latent attention, reference/ddtree.py's mask packing, reference/target.py's
LatentKVCache.commit). The GPU tests trust these references, so they must be right on their own."""
import numpy as np
import pytest

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
from ddtree_cupy.reference import attention as ra
from ddtree_cupy.reference.ddtree import pack_mask
from ddtree_cupy.reference.mla import latent_attention
from ddtree_cupy.reference.target import LatentKVCache


def random_parents(rng, n):
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], dtype=np.int32)


def paged_setup(rng, lengths, num_pages=None, max_pages=None):
    """A pool with shuffled page ids per stream (so a gather that ignores the table is caught)."""
    need = [-(-L // 64) for L in lengths]
    max_pages = max_pages or max(need) + 1
    num_pages = num_pages or sum(need) + 3
    perm = rng.permutation(num_pages)
    table = np.full((len(lengths), max_pages), -1, np.int32)
    k = 0
    for b, c in enumerate(need):
        table[b, :c] = perm[k:k + c]
        k += c
    pool = to_bf16_bits(rng.standard_normal((num_pages, 64, 576)))
    return pool, table


def test_ancestor_mask_matches_ddtree_packing_and_definition():
    rng = np.random.default_rng(1)
    for n in (1, 2, 33, 64, 129):
        parents = random_parents(rng, n)
        bits = ra.ancestor_mask_bits(parents, rows=129)
        dense = np.zeros((n, n), bool)
        for i in range(n):
            j = i
            while j >= 0:
                dense[i, j] = True
                j = parents[j]
        assert np.array_equal(bits[:n], pack_mask(dense))
        assert not bits[n:].any()
        assert np.array_equal(ra.mask_visible(bits, n), dense)
    with pytest.raises(ValueError, match="parents must precede"):
        ra.ancestor_mask_bits([-1, 2, 0])


def brute_mla(q, pool, table, s, n, r0, scale, visible):
    """Row by row, head by head, token by token: the definition."""
    H = q.shape[1]
    out = np.zeros((n, H, 512))
    qf = bf16_bits_to_f32(q).astype(np.float64)
    for i in range(n):
        toks = list(range(s)) + [s + j for j in range(n) if visible(i, j)]
        rows = [pool[table[t // 64], t % 64] for t in toks]
        kv = bf16_bits_to_f32(np.stack(rows)).astype(np.float64)
        for h in range(H):
            sc = np.array([qf[r0 + i, h] @ kv[k] for k in range(len(toks))]) * scale
            p = np.exp(sc - sc.max())
            out[i, h] = (p / p.sum()) @ kv[:, :512]
    return out


@pytest.mark.parametrize("mode", ["tree", "causal"])
def test_mla_reference_against_brute_force_and_dense_latent_attention(mode):
    rng = np.random.default_rng(2 if mode == "tree" else 3)
    lengths_s = [0, 63, 130]
    ns = [5, 1, 9]
    pool, table = paged_setup(rng, [s + n for s, n in zip(lengths_s, ns)])
    H = 3
    row_start = np.array([2, 8, 9], np.int32)    # rows 0, 1 and 7 belong to no stream
    T = 18
    q = to_bf16_bits(rng.standard_normal((T, H, 576)) * 0.2)
    mask = np.zeros((3, 129, 5), np.uint32)
    parents = [random_parents(rng, n) for n in ns]
    for b in range(3):
        mask[b] = ra.ancestor_mask_bits(parents[b], 129)
    scale = 0.14467963
    got = ra.mla_attention_ref(q, pool, table, lengths_s, ns, row_start, scale, mask if mode == "tree" else None)
    assert np.isnan(got[[0, 1, 7]]).all() and not np.isnan(got[2:7]).any()
    for b in range(3):
        s, n, r0 = lengths_s[b], ns[b], row_start[b]
        if mode == "tree":
            vis = lambda i, j, m=ra.mask_visible(mask[b], n): m[i, j]
        else:
            vis = lambda i, j: j <= i
        want = brute_mla(q, pool, table[b], s, n, r0, scale, vis)
        np.testing.assert_allclose(got[r0:r0 + n], want, rtol=1e-12, atol=1e-12)
        # independent dense implementation (another module) on the gathered rows
        kv = ra.paged_gather(pool, table[b], s + n)
        allowed = np.array([[t < s or vis(i, t - s) for t in range(s + n)] for i in range(n)])
        qf = bf16_bits_to_f32(q[r0:r0 + n]).astype(np.float64)
        dense = latent_attention(qf[..., :512], qf[..., 512:], kv, allowed, scale)
        np.testing.assert_allclose(got[r0:r0 + n], dense, rtol=1e-12, atol=1e-12)


def test_kv_write_reference_and_unassigned_pages():
    rng = np.random.default_rng(4)
    pool, table = paged_setup(rng, [100, 70])
    rows = to_bf16_bits(rng.standard_normal((4, 576)))
    sid = np.array([0, 1, 0, 1], np.int32)
    pos = np.array([99, 64, -1, 0], np.int32)
    out = ra.kv_write_latent_ref(pool, table, sid, pos, rows)
    assert np.array_equal(out[table[0, 1], 35], rows[0])
    assert np.array_equal(out[table[1, 1], 0], rows[1])
    assert np.array_equal(out[table[1, 0], 0], rows[3])
    changed = (out != pool).any(axis=-1).sum()
    assert changed == 3                      # the skipped row (pos -1) wrote nothing
    with pytest.raises(ValueError, match="unassigned page"):
        ra.paged_gather(pool, table[1], 64 * table.shape[1])


def test_compaction_reference_equals_latent_cache_commit():
    rng = np.random.default_rng(5)
    S = 4
    prefix = np.array([0, 61, 127, 200], np.int32)
    n_tree = [9, 17, 5, 12]
    pool, table = paged_setup(rng, [p + n for p, n in zip(prefix, n_tree)])
    acc = np.zeros((S, 8), np.int32)
    n_acc = np.zeros(S, np.int32)
    for b in range(S):
        k = int(rng.integers(1, min(8, n_tree[b]) + 1))
        acc[b, :k] = np.sort(rng.choice(np.arange(1, n_tree[b]), k - 1, replace=False).tolist() + [0])
        n_acc[b] = k
    acc[2, :4] = [0, 1, 2, 3]                 # identity moves must be harmless
    n_acc[2] = 4
    out = ra.kv_compact_latent_ref(pool, table, prefix, n_acc, acc)
    for b in range(S):
        L = prefix[b] + n_tree[b]
        rows = ra.paged_gather(pool, table[b], L)
        cache = LatentKVCache(1, 576)
        cache.append(rows[None])
        cache.commit(int(prefix[b]), prefix[b] + acc[b, :n_acc[b]])
        got = ra.paged_gather(out, table[b], cache.length)
        np.testing.assert_array_equal(got, cache.layer(0))


def test_drafter_reference_against_brute_force():
    rng = np.random.default_rng(6)
    S, BR, Hq, Hkv, C = 2, 8, 4, 2, 50
    q = to_bf16_bits(rng.standard_normal((S, BR, Hq, 128)) * 0.1)
    kb = to_bf16_bits(rng.standard_normal((S, BR, Hkv, 128)))
    vb = to_bf16_bits(rng.standard_normal((S, BR, Hkv, 128)))
    kc = to_bf16_bits(rng.standard_normal((S, C, Hkv, 128)))
    vc = to_bf16_bits(rng.standard_normal((S, C, Hkv, 128)))
    f = lambda a: bf16_bits_to_f32(a).astype(np.float64)
    for ctx, window in (([30, 0], 0), ([70, 45], 20)):
        got = ra.drafter_attention_ref(q, kb, vb, kc, vc, ctx, 0.088, window)
        for b in range(S):
            L = ctx[b]
            pos = list(range(max(0, L - window) if window else 0, L))
            for r in range(BR):
                for h in range(Hq):
                    g = h // (Hq // Hkv)
                    keys = [f(kc[b, p % C, g]) for p in pos] + [f(kb[b, j, g]) for j in range(BR)]
                    vals = [f(vc[b, p % C, g]) for p in pos] + [f(vb[b, j, g]) for j in range(BR)]
                    sc = np.array([f(q[b, r, h]) @ k for k in keys]) * 0.088
                    p = np.exp(sc - sc.max())
                    np.testing.assert_allclose(got[b, r, h], (p / p.sum()) @ np.stack(vals), rtol=1e-12, atol=1e-12)
    k = to_bf16_bits(rng.standard_normal((3, Hkv, 128)))
    v = to_bf16_bits(rng.standard_normal((3, Hkv, 128)))
    kc2, vc2 = ra.drafter_kv_append_ref(kc, vc, k, v, [1, 0, 1], [7, -1, C + 3])
    assert np.array_equal(kc2[1, 7], k[0]) and np.array_equal(vc2[1, 3], v[2])
    assert (kc2 != kc).any(axis=(-1, -2)).sum() == 2
