"""GPU: latent KV writes, multi-layer compaction and the drafter context append, bit-exact against the
numpy references (pure copies: any difference is a wrong index). Pools start from random data, so a write
to a wrong slot or a missed skip shows up as a changed row."""
import numpy as np
import pytest

from ddtree_cupy.bf16 import to_bf16_bits
from ddtree_cupy.reference import attention as ra

pytestmark = pytest.mark.gpu


def paged(rng, lengths, extra=3):
    need = [-(-L // 64) for L in lengths]
    num_pages = sum(need) + extra
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.full((len(lengths), max(need) + 1), -1, np.int32)
    k = 0
    for b, c in enumerate(need):
        table[b, :c] = perm[k:k + c]
        k += c
    return to_bf16_bits(rng.standard_normal((num_pages, 64, 576))), table


def test_kv_write_packed_split_and_strided_inputs():
    import cupy as cp
    from ddtree_cupy.kernels.kv_cache import kv_write_latent
    rng = np.random.default_rng(1)
    S = 5
    lengths = [int(rng.integers(1, 400)) for _ in range(S)]
    pool, table = paged(rng, lengths)
    T = 300
    sid = rng.integers(0, S, T).astype(np.int32)
    pos = np.array([int(rng.integers(0, lengths[b])) for b in sid], np.int32)
    # unique (stream, pos) so the result does not depend on write order; some rows are padding (-1)
    seen, keep = set(), []
    for i in range(T):
        keep.append((sid[i], pos[i]) not in seen)
        seen.add((sid[i], pos[i]))
    pos = np.where(keep, pos, -1).astype(np.int32)
    pos[::37] = -1
    rows = to_bf16_bits(rng.standard_normal((T, 576)))
    want = ra.kv_write_latent_ref(pool, table, sid, pos, rows)
    d_table, d_sid, d_pos = cp.asarray(table), cp.asarray(sid), cp.asarray(pos)
    # packed [T, 576]
    d_pool = cp.asarray(pool)
    kv_write_latent(d_pool, d_table, d_sid, d_pos, cp.asarray(rows))
    assert np.array_equal(d_pool.get(), want)
    # two inputs, each a strided column slice of a wider buffer (as a fused projection output would be)
    wide = np.concatenate([rows[:, :512], np.zeros((T, 8), np.uint16), rows[:, 512:],
                           np.zeros((T, 24), np.uint16)], axis=1)
    d_wide = cp.asarray(wide)
    d_pool = cp.asarray(pool)
    kv_write_latent(d_pool, d_table, d_sid, d_pos, d_wide[:, :512], rope=d_wide[:, 520:584])
    assert np.array_equal(d_pool.get(), want)
    with pytest.raises(ValueError, match="rope: rows must start on 16-byte boundaries"):
        kv_write_latent(d_pool, d_table, d_sid, d_pos, d_wide[:, :512], rope=d_wide[:, 513:577])
    with pytest.raises(ValueError, match="latent: dimension 1 must be 576"):
        kv_write_latent(d_pool, d_table, d_sid, d_pos, d_wide[:, :512])


def test_compaction_all_layers_equals_reference_permutation():
    import cupy as cp
    from ddtree_cupy.kernels.kv_cache import kv_compact_latent, pool_pointer_array
    rng = np.random.default_rng(2)
    S, L = 7, 3
    prefix = np.array([int(rng.integers(0, 300)) for _ in range(S)], np.int32)
    prefix[0] = 62                      # tree crosses a page boundary
    n_tree = [int(rng.integers(2, 129)) for _ in range(S)]
    pools, table = [], None
    rng_pages = np.random.default_rng(3)
    base_pool, table = paged(rng_pages, [p + n for p, n in zip(prefix, n_tree)])
    pools = [to_bf16_bits(rng.standard_normal(base_pool.shape)) for _ in range(L)]
    acc = np.zeros((S, 8), np.int32)
    n_acc = np.zeros(S, np.int32)
    for b in range(S):
        k = int(rng.integers(1, min(8, n_tree[b]) + 1))
        acc[b, 1:k] = np.sort(rng.choice(np.arange(1, n_tree[b]), k - 1, replace=False))
        n_acc[b] = k
    n_tree[1] = max(n_tree[1], 6)
    acc[1, :5] = [0, 2, 3, 4, 5]        # each copy overwrites the next copy's source: order matters
    n_acc[1] = 5
    n_tree[2] = max(n_tree[2], 4)
    acc[2, :4] = [0, 1, 2, 3]           # identity
    n_acc[2] = 4
    d_pools = [cp.asarray(p) for p in pools]
    ptrs = pool_pointer_array(d_pools)
    kv_compact_latent(ptrs, cp.asarray(table), cp.asarray(prefix), cp.asarray(n_acc), cp.asarray(acc))
    for l in range(L):
        want = ra.kv_compact_latent_ref(pools[l], table, prefix, n_acc, acc)
        assert np.array_equal(d_pools[l].get(), want), f"layer {l}"


def test_drafter_append_ring_and_skips():
    import cupy as cp
    from ddtree_cupy.kernels.kv_cache import drafter_kv_append
    rng = np.random.default_rng(4)
    for S, C, Hkv in ((3, 100, 1), (2, 40, 8)):
        kc = to_bf16_bits(rng.standard_normal((S, C, Hkv, 128)))
        vc = to_bf16_bits(rng.standard_normal((S, C, Hkv, 128)))
        T = 9
        sid = rng.integers(0, S, T).astype(np.int32)
        pos = rng.permutation(3 * C)[:T].astype(np.int32)
        pos[4] = -1
        k = to_bf16_bits(rng.standard_normal((T, Hkv, 128)))
        v = to_bf16_bits(rng.standard_normal((T, Hkv, 128)))
        # keep slots unique per stream so the result is order independent
        slots = set()
        for i in range(T):
            if pos[i] >= 0 and (sid[i], pos[i] % C) in slots:
                pos[i] = -1
            slots.add((sid[i], pos[i] % C))
        wk, wv = ra.drafter_kv_append_ref(kc, vc, k, v, sid, pos)
        dk, dv = cp.asarray(kc), cp.asarray(vc)
        drafter_kv_append(dk, dv, cp.asarray(k), cp.asarray(v), cp.asarray(sid), cp.asarray(pos))
        assert np.array_equal(dk.get(), wk) and np.array_equal(dv.get(), wv)
