"""CPU checks of the INT4 MoE weight layout (ddtree_cupy/kernels/moe/layout.py, cuda_src/moe_int4.cu).

The decisive test emulates the GEMM's inner loop on the CPU: repacked words -> lop3/fma dequantisation ->
A fragments, natural activation rows -> B fragments as the kernel loads them, mma.sync m16n8k16 assembled
from the PTX ISA fragment tables (written out here independently of the module), per-group fp32 scales ->
compared with the dense q * scale matmul. A wrong nibble position, row, column, k mapping or scale slot
changes the result by O(1).
"""
from __future__ import annotations

import numpy as np
import pytest

from ddtree_cupy.bf16 import bf16_bits_to_f32, round_bf16
from ddtree_cupy.kernels import moe

# PTX ISA, mma.m16n8k16 with .bf16 operands (per lane l, groupID = l >> 2, threadID_in_group = l % 4):
#   A element a_i: row = groupID + 8 * ((i >> 1) & 1), col = 2 * tig + (i & 1) + 8 * (i >> 2)
#   B element b_i: row = 2 * tig + (i & 1) + 8 * (i >> 1), col = groupID
#   C element c_i: row = groupID + 8 * (i >> 1), col = 2 * tig + (i & 1)
PTX_A = [[((l >> 2) + 8 * ((i >> 1) & 1), 2 * (l & 3) + (i & 1) + 8 * (i >> 2)) for i in range(8)] for l in range(32)]
PTX_B = [[(2 * (l & 3) + (i & 1) + 8 * (i >> 1), l >> 2) for i in range(4)] for l in range(32)]
PTX_C = [[((l >> 2) + 8 * (i >> 1), 2 * (l & 3) + (i & 1)) for i in range(4)] for l in range(32)]


def _bf16_halves(v: np.ndarray):
    return bf16_bits_to_f32((v & 0xFFFF).astype(np.uint16)), bf16_bits_to_f32((v >> 16).astype(np.uint16))


def _dequant_word(word: int):
    """Emulates dequant_word: 4 registers of (low, high) values."""
    regs = []
    for j in range(4):
        v = ((np.uint32(word) >> np.uint32(4 * j)) & np.uint32(0x000F000F)) | np.uint32(0x43004300)
        lo, hi = _bf16_halves(np.array([v], np.uint32))
        regs.append((float(lo[0]) - 136.0, float(hi[0]) - 136.0))   # fma(v, 1, -136) is exact here
    return regs


def _random_linear(rng, N, K):
    nib = rng.integers(0, 16, size=(1, N, K), dtype=np.uint32)
    words = np.zeros((1, N, K // 8), np.uint32)
    for p in range(8):
        words |= nib[:, :, p::8] << np.uint32(4 * p)
    scale = rng.uniform(0.002, 0.05, size=(1, N, K // 32)).astype(np.float32)
    scale_bits = (round_bf16(scale).view(np.uint32) >> 16).astype(np.uint16)
    return words.view(np.int32), scale_bits, nib[0].astype(np.float64) - 8.0


def test_layout_tables_are_a_bijection():
    row, k = moe.layout_tables()
    cells = row * 64 + k
    assert sorted(cells.ravel().tolist()) == list(range(16 * 64))
    # nat_k is a bijection of (w, kappa) onto 0..63 and each mma (fixed w) stays inside one 32-group
    w = np.arange(4)[:, None]
    kap = np.arange(16)[None, :]
    nk = moe.nat_k(w, kap)
    assert sorted(nk.ravel().tolist()) == list(range(64))
    assert np.all(nk // 32 == (w >> 1))
    srow, sgrp = moe.scale_tables()
    assert sorted((srow * 2 + sgrp).ravel().tolist()) == list(range(32))


def test_module_fragment_formulas_match_ptx_tables():
    for l in range(32):
        for i in range(8):
            assert (int(moe.frag_row(l >> 2, i)), int(moe.frag_col(l & 3, i))) == PTX_A[l][i]


def test_lop3_dequant_gives_q_for_every_nibble():
    for lo in range(16):
        for hi in range(16):
            word = lo | (hi << 16)
            regs = _dequant_word(word)
            assert regs[0] == (lo - 8.0, hi - 8.0)


@pytest.mark.parametrize("N,K,fused", [(32, 128, False), (32, 64, True), (16, 32, False)])
def test_emulated_mma_equals_dense_matmul(N, K, fused):
    rng = np.random.default_rng(N * 1000 + K + fused)
    p0, s0, q0 = _random_linear(rng, N, K)
    if fused:
        p1, s1, q1 = _random_linear(rng, N, K)
        wp, sp = moe.repack_numpy(p0, s0, p1, s1)
        dense = np.stack([moe.dequant_numpy(p0, s0)[0].reshape(N // 16, 16, K),
                          moe.dequant_numpy(p1, s1)[0].reshape(N // 16, 16, K)], axis=1).reshape(2 * N, K)
    else:
        wp, sp = moe.repack_numpy(p0, s0)
        dense = moe.dequant_numpy(p0, s0)[0]
    Nf = dense.shape[0]
    Kp = -(-K // 64) * 64
    X = np.zeros((8, Kp))
    X[:, :K] = round_bf16(rng.standard_normal((8, K)))
    out = np.zeros((Nf, 8))
    for tile in range(Nf // 16):
        acc = np.zeros((16, 8))
        for step in range(Kp // 64):
            k0 = step * 64
            for grp in range(2):
                D = np.zeros((16, 8))
                for w in (2 * grp, 2 * grp + 1):
                    A = np.full((16, 16), np.nan)
                    B = np.full((16, 8), np.nan)
                    for l in range(32):
                        g, t = l >> 2, l & 3
                        regs = _dequant_word(int(wp[0, tile, step, l, w]))
                        for i in range(8):
                            r, c = PTX_A[l][i]
                            A[r, c] = regs[i >> 1][i & 1]
                        # the kernel's B loads: vector #(w>>1) = X[g, k0 + 32*(w>>1) + 8t : +8],
                        # b0b1 = pair (w&1)*2, b2b3 = pair (w&1)*2 + 1
                        vec = X[g, k0 + 32 * (w >> 1) + 8 * t: k0 + 32 * (w >> 1) + 8 * t + 8]
                        bvals = [vec[2 * ((w & 1) * 2) + 0], vec[2 * ((w & 1) * 2) + 1],
                                 vec[2 * ((w & 1) * 2 + 1) + 0], vec[2 * ((w & 1) * 2 + 1) + 1]]
                        for i in range(4):
                            r, c = PTX_B[l][i]
                            B[r, c] = bvals[i]
                    assert not np.isnan(A).any() and not np.isnan(B).any()
                    D += A @ B
                for l in range(32):
                    g = l >> 2
                    rec = bf16_bits_to_f32(sp[0, tile, step, g])      # (g,grp0), (g+8,grp0), (g,grp1), (g+8,grp1)
                    for i in range(4):
                        r, c = PTX_C[l][i]
                        acc[r, c] += rec[2 * grp + (i >> 1)] * D[r, c]
        out[tile * 16:(tile + 1) * 16] = acc
    ref = dense.astype(np.float64) @ X[:, :K].T
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_padding_is_neutral():
    rng = np.random.default_rng(5)
    p, s, _ = _random_linear(rng, 16, 32)
    wp, sp = moe.repack_numpy(p, s)
    assert wp.shape == (1, 1, 1, 32, 4) and sp.shape == (1, 1, 1, 8, 4)
    row, k = moe.layout_tables()
    nib = (wp[0, 0, 0][:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    assert np.all(nib[k >= 32] == 8)                 # q = 0 in the padding columns
    assert np.all(sp[0, 0, 0][:, 2:] == 0)           # scale 0 for the padding group


def test_reference_moe_matches_per_token_loop():
    rng = np.random.default_rng(7)
    T, H, I, E, k = 5, 16, 8, 6, 3
    x = rng.standard_normal((T, H))
    gate, up = rng.standard_normal((E, I, H)), rng.standard_normal((E, I, H))
    down = rng.standard_normal((E, H, I))
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)])
    wts = rng.random((T, k))
    res = rng.standard_normal((T, H))
    got = moe.moe_reference(x, ids, wts, gate, up, down, residual=res)
    for t in range(T):
        want = res[t].copy()
        for j in range(k):
            e = ids[t, j]
            g, u = gate[e] @ x[t], up[e] @ x[t]
            want += wts[t, j] * (down[e] @ (g / (1 + np.exp(-g)) * u))
        np.testing.assert_allclose(got[t], want, rtol=1e-12, atol=1e-12)


def test_tile_table_fits_sm120_shared_memory():
    for tiles in moe.all_table_tiles():
        for tile in (tiles.gateup, tiles.down):
            assert moe.SORT_SMEM + tile.smem_static(tiles.nt) <= 99 * 1024      # the gate/up's fused sort
            assert tile.threads <= 1024
    assert moe.select_tiles("sm_90", 1, 256).nt == 1
    assert {t.nt for t in moe.all_table_tiles()} == {1}      # one token tile of 8 at every T the ring runs


def test_k_loop_variants_in_the_table_and_the_registry(monkeypatch):
    # the table's k loop follows lean_for(T) (LEAN_T1 at T = 1, LEAN_T_GE_2 above); both loops of every
    # register-ring table entry are compiled (registry names)
    names = moe._all_gemm_names()
    for T, inter in ((1, 256), (1, 2048), (2, 256), (8, 256), (32, 2048)):
        for arch in ("sm_90", "sm_120"):
            t = moe.select_tiles(arch, T, inter)
            want = moe.LEAN_T1 if T == 1 else moe.LEAN_T_GE_2
            assert t.gateup.lean == t.down.lean == want == moe.lean_for(T)
            for lean in (1, 2):
                v = moe.with_lean(t, lean)
                assert v.gateup.lean == v.down.lean == lean
                assert (v.gateup.wm, v.gateup.wk, v.gateup.u) == (t.gateup.wm, t.gateup.wk, t.gateup.u)
                for mode, tile in ((0, v.gateup), (1, v.down)):
                    assert moe._gemm_name(mode, tile, v.nt) in names
    assert len(names) == 2 * 2 * 2          # (1 x 8 | 8 x 1) and (2 x 4 | 2 x 4) blocks x 2 modes x 2 loops
    monkeypatch.setattr(moe.tables, "LEAN_T_GE_2", 1)
    assert moe.select_tiles("sm_90", 8, 256).down.lean == 1
    assert moe._gemm_name(1, moe.select_tiles("sm_90", 1, 256).down, 1) == "moe_gemm<1, 8, 1, 1, 3, 1>"
    with pytest.raises(ValueError, match="lean"):
        moe.with_lean(moe.select_tiles("sm_90", 8, 256), 0)


def test_fused_sort_model_contract():
    # the model of the gate/up prologue's sort (the GPU test compares the kernel's published arrays to it)
    rng = np.random.default_rng(5)
    for T, E, k, chunk in ((1, 384, 8, 8), (32, 384, 8, 8), (20, 64, 8, 16), (32, 1024, 8, 32), (5, 4, 8, 8)):
        ids = rng.integers(-1, E + 1, size=(T, k)).astype(np.int32)
        ids[0, :3] = ids[0, 0]                                   # duplicates inside a token
        chunks, slot_pair, bad = moe.fused_sort_numpy(ids, E, chunk)
        flat = ids.reshape(-1)
        valid = (flat >= 0) & (flat < E)
        assert bad == int((~valid).sum())
        assert sorted(slot_pair.tolist()) == np.nonzero(valid)[0].tolist()      # every valid pair once
        assert len(chunks) <= min(T * k, E) + T * k // 8 <= moe.FUSED_MAX_PAIRS + moe.FUSED_MAX_PAIRS // 8
        covered = 0
        for e, s0, n, _ in chunks:
            assert 1 <= n <= chunk and s0 == covered
            assert (flat[slot_pair[s0:s0 + n]] == e).all()
            covered += n
        assert covered == len(slot_pair)
        for e in np.unique(flat[valid]):                              # inside an expert: pair order
            pe = slot_pair[flat[slot_pair] == e]
            assert (np.diff(pe) > 0).all()
    assert moe.fuse_route_default(32, 8) and not moe.fuse_route_default(33, 8)


def test_bulk_tiles_fit_sm120_and_the_producer_warp():
    # moe_bulk.cu: one producer lane per copy (2*wm weight tiles + their scales + 8 token rows <= 32 lanes),
    # stages a multiple of 128 B (the bulk copies' 16-byte alignment), <= 99 KB per block on sm_120
    for bt in (moe.BULK_GATEUP, moe.BULK_DOWN) + moe.BULK_GATEUP_CANDIDATES + moe.BULK_DOWN_CANDIDATES:
        assert 4 * bt.wm + bt.xr <= 32
        assert bt.stage_bytes() % 128 == 0
        assert bt.smem_dynamic + bt.smem_static <= moe.SMEM_LIMIT, bt


def test_large_t_bulk_tiles_fit_without_the_sort_arrays():
    # G = 1 (moe_route's global arrays) drops BULK_META from the dynamic shared memory; every large-T block
    # fits sm_120's 99 KB per block that way, and is compiled under a G = 1 name distinct from the G = 0 one
    blocks = (moe.BULK_GATEUP_LARGE, moe.BULK_DOWN_LARGE) + moe.BULK_GATEUP_LARGE_CANDIDATES \
        + moe.BULK_DOWN_LARGE_CANDIDATES
    for bt in blocks:
        assert 4 * bt.wm + 8 <= 32 and bt.stage_bytes() % 128 == 0
        assert bt.smem_dyn(1) == bt.smem_dyn(0) - moe.BULK_META
        assert bt.smem_dyn(1) + bt.smem_static <= moe.SMEM_LIMIT, bt
    names = moe._all_bulk_names()
    assert len(set(names)) == len(names)
    for mode, bt in [(0, b) for b in (moe.BULK_GATEUP_LARGE,) + moe.BULK_GATEUP_LARGE_CANDIDATES] + \
            [(1, b) for b in (moe.BULK_DOWN_LARGE,) + moe.BULK_DOWN_LARGE_CANDIDATES]:
        assert moe._bulk_name(mode, bt, 1) in names
    for mode, bt in [(0, b) for b in (moe.BULK_GATEUP,) + moe.BULK_GATEUP_CANDIDATES] + \
            [(1, b) for b in (moe.BULK_DOWN,) + moe.BULK_DOWN_CANDIDATES]:
        assert moe._bulk_name(mode, bt, 0) in names
    assert moe._bulk_name(0, moe.BULK_GATEUP, 1) == moe._bulk_name(0, moe.BULK_GATEUP).replace(", 0>", ", 1>")
    # the decode table's blocks also run fed by moe_route (fuse_route=False): compiled with G = 1 too
    assert moe._bulk_name(0, moe.BULK_GATEUP, 1) in names and moe._bulk_name(1, moe.BULK_DOWN, 1) in names
    assert moe.BULK_GATEUP in moe._bulk_compiled(1)["gu"] and moe.BULK_DOWN in moe._bulk_compiled(1)["dn"]


def test_the_production_spec_compiles_the_tables_blocks_alone():
    # the registered spec compiles every bulk-copy block (the build CLI checks them all); the production one, the same
    # source and options, holds the blocks the tables pick (every width, both routing sources) and nothing else
    prod, every = set(moe.SPEC_BULK.names), set(moe.SPEC_BULK_ALL.names)
    assert prod < every and every == set(moe._all_bulk_names())
    assert (moe.SPEC_BULK.src, moe.SPEC_BULK.defines, moe.SPEC_BULK.pdl) == \
        (moe.SPEC_BULK_ALL.src, moe.SPEC_BULK_ALL.defines, moe.SPEC_BULK_ALL.pdl)
    assert moe.SPEC_BULK.options("sm_90") == moe.SPEC_BULK_ALL.options("sm_90")
    table = set()
    for large in (False, True):
        for inter in (256, 512, 2048):
            gu, dn = moe._bulk_tiles_for(large, None if large else inter)
            g = 1 if large else 0
            table |= {moe._bulk_name(0, gu, g), moe._bulk_name(1, dn, g)}
    assert table == prod and len(prod) == 5
    for n in every:
        assert moe.bulk_spec(n) is (moe.SPEC_BULK if n in prod else moe.SPEC_BULK_ALL)
    from ddtree_cupy.kernels import compile as kc
    assert moe.SPEC_BULK_ALL in kc.registered_specs()


def test_large_t_always_runs_the_bulk_gemms(monkeypatch):
    # above FUSED_MAX_PAIRS the bulk-copy GEMMs fed by moe_route are the only implementation; BULK_FORCE keeps
    # its range (T*k <= FUSED_MAX_PAIRS)
    monkeypatch.setattr(moe.tables, "BULK_FORCE", None)
    assert moe.bulk_for(33, 8) is True and moe.bulk_for(320, 8) is True and moe.bulk_for(32, 8) is True
    monkeypatch.setattr(moe.tables, "BULK_FORCE", False)
    assert moe.bulk_for(33, 8) is True and moe.bulk_for(64, 8) is True and moe.bulk_for(8, 8) is False


def test_large_t_bulk_tiles_override(monkeypatch):
    monkeypatch.setattr(moe.tables, "BULK_LARGE_TILES", "gu=2,4,2,3;dn=4,1,4,3")
    assert moe._bulk_tiles_for(True) == (moe.BulkTile(2, 4, 2, 3), moe.BulkTile(4, 1, 4, 3))
    monkeypatch.setattr(moe.tables, "BULK_LARGE_TILES", "gu=1,4,4,2")     # a decode-only block
    with pytest.raises(ValueError, match="BULK_LARGE_TILES.*compiled"):
        moe._bulk_tiles_for(True)
    monkeypatch.setattr(moe.tables, "BULK_LARGE_TILES", "")
    assert moe._bulk_tiles_for(True) == (moe.BULK_GATEUP_LARGE, moe.BULK_DOWN_LARGE)


def test_bulk_rule_applies_only_where_both_kernels_sort_in_shared_memory(monkeypatch):
    monkeypatch.setattr(moe.tables, "BULK_FORCE", None)
    assert moe.bulk_for(moe.BULK_MIN_T, 8) is moe.BULK_DEFAULT and moe.bulk_for(moe.BULK_MIN_T - 1, 8) is False
    monkeypatch.setattr(moe.tables, "BULK_FORCE", True)
    assert moe.bulk_for(1, 8) is True and moe.bulk_for(32, 8) is True
    monkeypatch.setattr(moe.tables, "BULK_FORCE", False)
    assert not moe.bulk_for(1, 8) and not moe.bulk_for(32, 8)


def test_bulk_tiles_override(monkeypatch):
    monkeypatch.setattr(moe.tables, "BULK_TILES", "gu=1,8,2,2;dn=4,1,4,3")
    assert moe._bulk_tiles_for() == (moe.BulkTile(1, 8, 2, 2), moe.BulkTile(4, 1, 4, 3))
    monkeypatch.setattr(moe.tables, "BULK_TILES", "gu=3,3,3,3")
    with pytest.raises(ValueError, match="compiled"):
        moe._bulk_tiles_for()
    monkeypatch.setattr(moe.tables, "BULK_TILES", "gu=1,x")
    with pytest.raises(ValueError, match="BULK_TILES"):
        moe._bulk_tiles_for()


# ---------------------------------------------------------------------------------------------------------
# Compact token rows (gate/up stages of xr = 4 / 2 token rows, a third stage; docs/MOE.md)
# ---------------------------------------------------------------------------------------------------------
def test_compact_gateup_blocks_fit_and_are_named_apart():
    compact = [bt for bt in moe.BULK_GATEUP_CANDIDATES if bt.xr != 8]
    assert {(bt.xr, bt.nst) for bt in compact} == {(4, 3), (2, 3)}
    for bt in compact:
        # the table's block with fewer token rows and one more stage: same warps, same k64 steps per stage
        assert (bt.wm, bt.wk, bt.spw) == (moe.BULK_GATEUP.wm, moe.BULK_GATEUP.wk, moe.BULK_GATEUP.spw)
        assert bt.stage_bytes() == 2 * bt.wm * bt.steps * 576 + bt.xr * (bt.steps * 128 + 64)
        assert bt.stage_bytes() % 128 == 0 and 4 * bt.wm + bt.xr <= 32
        assert bt.smem_dyn(0) + bt.smem_static <= moe.SMEM_LIMIT, bt          # one block on sm_120
        assert 2 * (bt.smem_dyn(0) + bt.smem_static + 1024) <= 228 * 1024     # two blocks per H200 SM
        # the K-split partials hold only the 4*xr lanes whose columns can be tokens
        assert bt.smem_static == moe.BULK_GATEUP.smem_static * bt.xr // 8
        name = moe._bulk_name(0, bt)
        assert name == f"moe_gemm_bulk<0, 1, 8, 2, {bt.nst}, 0, {bt.xr}>" and name in moe._all_bulk_names()
        # decode only: moe_route's chunks are 8 tokens (G = 1 is not compiled with xr < 8)
        assert bt not in moe._bulk_compiled(1)["gu"]
        assert not any(n.endswith(f", 1, {bt.xr}>") for n in moe._all_bulk_names())
    # xr = 8 keeps the previous names (the template's default)
    assert moe._bulk_name(0, moe.BULK_GATEUP) == "moe_gemm_bulk<0, 1, 8, 2, 2, 0>"
    assert moe.BulkTile(1, 8, 2, 2) == moe.BULK_GATEUP and moe.BULK_GATEUP.xr == 8


def test_compact_blocks_third_stage_needs_the_compact_partials():
    # why the partials are compacted: with 32 lanes' partials the xr = 4, 3-stage block would not fit sm_120
    bt = moe.BulkTile(1, 8, 2, 3, 4)
    full_red = 2 * bt.wm * bt.wk * 2 * 4 * 32 * 4
    assert bt.smem_dyn(0) + full_red > moe.SMEM_LIMIT >= bt.smem_dyn(0) + bt.smem_static


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slots_do_not_depend_on_the_chunk_size(seed):
    # the compact gate/up sorts with chunks of xr tokens, the down kernel with 8: h[slot] is only consistent if
    # the slot order is the same (sort_pairs_block: slot = expert's run offset + the pair's rank)
    rng = np.random.default_rng(seed)
    E, T, k = 24, 32, 8
    ids = rng.integers(0, E, size=(T, k)).astype(np.int32)
    ids[:5] = 7                      # an expert with 40 tokens: 5 chunks of 8, 10 of 4, 20 of 2
    ids[9, 3] = E + 2                # a bad id
    c8, s8, b8 = moe.fused_sort_numpy(ids, E, 8)
    for xr in (4, 2):
        c, s, b = moe.fused_sort_numpy(ids, E, xr)
        np.testing.assert_array_equal(s, s8)
        assert b == b8 == 1
        assert c[:, 2].max() <= xr and c[:, 2].sum() == c8[:, 2].sum() == len(s8)
        # every chunk of 8 is the concatenation of its chunks of xr (same expert, contiguous slots)
        for e, first, n, _ in c8:
            sub = c[(c[:, 0] == e) & (c[:, 1] >= first) & (c[:, 1] < first + n)]
            assert sub[:, 2].sum() == n and sub[0, 1] == first
            np.testing.assert_array_equal(sub[1:, 1], sub[:-1, 1] + sub[:-1, 2])
        # at most one chunk per pair (FUSED_MAX_CHUNKS bounds the shared-memory chunk list)
        assert len(c) <= min(T * k, moe.FUSED_MAX_PAIRS + moe.FUSED_MAX_PAIRS // 8)
        assert len(c) == sum(-(-int(n) // xr) for n in np.bincount(ids[(ids >= 0) & (ids < E)], minlength=E))


def test_compact_blocks_override(monkeypatch):
    # BULK_TILES takes an optional fifth number, the token rows (gu=1,8,2,3,4)
    monkeypatch.setattr(moe.tables, "BULK_TILES", "gu=1,8,2,3,4")
    assert moe._bulk_tiles_for() == (moe.BulkTile(1, 8, 2, 3, 4), moe.BULK_DOWN)
    monkeypatch.setattr(moe.tables, "BULK_TILES", "gu=1,8,2,3,2;dn=4,1,4,3")
    assert moe._bulk_tiles_for() == (moe.BulkTile(1, 8, 2, 3, 2), moe.BulkTile(4, 1, 4, 3))
    monkeypatch.setattr(moe.tables, "BULK_TILES", "gu=1,8,2,3,8")          # xr = 8 with 3 stages: not compiled
    with pytest.raises(ValueError, match="compiled"):
        moe._bulk_tiles_for()
    monkeypatch.setattr(moe.tables, "BULK_TILES", "dn=4,1,4,2,4")          # the down kernel keeps chunks of 8
    with pytest.raises(ValueError, match="compiled"):
        moe._bulk_tiles_for()
    monkeypatch.setattr(moe.tables, "BULK_LARGE_TILES", "gu=1,8,2,3,4")    # decode only
    with pytest.raises(ValueError, match="BULK_LARGE_TILES.*compiled"):
        moe._bulk_tiles_for(True)
    monkeypatch.setattr(moe.tables, "BULK_TILES", "")
    monkeypatch.setattr(moe.tables, "BULK_LARGE_TILES", "")
    assert moe._bulk_tiles_for() == (moe.BULK_GATEUP, moe.BULK_DOWN)
    assert moe.BULK_GATEUP.xr == 8 and moe.BULK_GATEUP.nst == 2
    # the table by expert width: the compact gate/up up to BULK_COMPACT_MAX_I (shared-memory sort only)
    assert moe._bulk_tiles_for(False, 256) == (moe.BulkTile(1, 8, 2, 3, 4), moe.BULK_DOWN)
    assert moe._bulk_tiles_for(False, moe.BULK_COMPACT_MAX_I)[0] == moe.BULK_GATEUP_COMPACT
    assert moe._bulk_tiles_for(False, 2048) == (moe.BULK_GATEUP, moe.BULK_DOWN)
    assert moe._bulk_tiles_for(True, 256) == (moe.BULK_GATEUP_LARGE, moe.BULK_DOWN_LARGE)
    assert moe.BULK_GATEUP_COMPACT in moe.BULK_GATEUP_CANDIDATES
    monkeypatch.setattr(moe.tables, "BULK_TILES", "gu=1,8,2,2")             # the environment still decides
    assert moe._bulk_tiles_for(False, 256)[0] == moe.BULK_GATEUP
