"""INT4 pack/unpack/dequantize/quantize against compressed-tensors and against an independent loop formula."""
from __future__ import annotations

import numpy as np
import pytest

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
from ddtree_cupy.int4 import dequantize, dequantize_bf16, pack_int4, quantize_groupwise, unpack_int4


def _rand_q(rng, n, k):
    return rng.integers(-8, 8, size=(n, k), dtype=np.int8)


def _rand_scale(rng, n, k):
    # positive and negative scales of varied magnitude, stored as bf16 bits
    return to_bf16_bits(rng.standard_normal((n, k // 32)).astype(np.float32) * 0.02)


def _loop_unpack(packed, n, k):
    """Independent formula, element by element, straight from the format description."""
    q = np.empty((n, k), dtype=np.int64)
    for r in range(n):
        for c in range(k):
            word = int(packed[r, c // 8]) & 0xFFFFFFFF
            q[r, c] = ((word >> (4 * (c % 8))) & 0xF) - 8
    return q


def test_unpack_matches_loop_formula():
    rng = np.random.default_rng(1)
    n, k = 5, 64
    packed = rng.integers(-2**31, 2**31, size=(n, k // 8), dtype=np.int64).astype(np.int32)
    q = unpack_int4(packed, None, (n, k))
    assert q.dtype == np.int8 and q.shape == (n, k)
    np.testing.assert_array_equal(q.astype(np.int64), _loop_unpack(packed, n, k))


def test_pack_unpack_round_trip():
    rng = np.random.default_rng(2)
    for n, k in ((1, 8), (7, 96), (64, 2048)):
        q = _rand_q(rng, n, k)
        packed = pack_int4(q)
        assert packed.dtype == np.int32 and packed.shape == (n, k // 8)
        np.testing.assert_array_equal(unpack_int4(packed, None, (n, k)), q)
        # and the other way: any int32 words survive unpack -> pack
        words = rng.integers(-2**31, 2**31, size=(n, k // 8), dtype=np.int64).astype(np.int32)
        np.testing.assert_array_equal(pack_int4(unpack_int4(words, None, (n, k))), words)


def test_known_word():
    # nibbles 0..7 of word 0x76543210 are 0,1,...,7 -> q = -8..-1; 0xFEDCBA98 -> q = 0..7
    packed = np.array([[0x76543210, np.uint32(0xFEDCBA98).view(np.int32)]], dtype=np.int32)
    np.testing.assert_array_equal(unpack_int4(packed, None, (1, 16)), np.arange(-8, 8, dtype=np.int8)[None])


def test_dequantize_matches_loop_formula():
    rng = np.random.default_rng(3)
    n, k = 6, 128
    q = _rand_q(rng, n, k)
    scale = _rand_scale(rng, n, k)
    packed = pack_int4(q)
    w64 = dequantize(packed, scale, (n, k), np.float64)
    sf = bf16_bits_to_f32(scale).astype(np.float64)
    ref = np.empty((n, k))
    for r in range(n):
        for c in range(k):
            ref[r, c] = float(q[r, c]) * sf[r, c // 32]
    np.testing.assert_array_equal(w64, ref)                  # exact: products fit in float64
    w32 = dequantize(packed, scale, (n, k), np.float32)
    assert w32.dtype == np.float32
    np.testing.assert_array_equal(w32.astype(np.float64), ref)  # and in float32 (4-bit x 8-bit mantissas)
    wb = dequantize_bf16(packed, scale, (n, k))
    assert wb.dtype == np.uint16
    np.testing.assert_array_equal(wb, to_bf16_bits(ref.astype(np.float32)))
    # the bf16 variant is one rounding away from the exact product, and actually differs somewhere
    rel = np.abs(bf16_bits_to_f32(wb) - ref) / np.maximum(np.abs(ref), 1e-30)
    assert rel.max() <= 2.0 ** -8 and (bf16_bits_to_f32(wb) != ref).any()


def test_shape_checks_name_the_argument():
    rng = np.random.default_rng(4)
    q = _rand_q(rng, 4, 64)
    packed, scale = pack_int4(q), _rand_scale(rng, 4, 64)
    with pytest.raises(ValueError, match="weight_packed shape"):
        dequantize(packed[:, :-1], scale, (4, 64))
    with pytest.raises(ValueError, match="weight_scale shape"):
        dequantize(packed, scale[:, :1], (4, 64))
    with pytest.raises(ValueError, match="weight_scale"):
        unpack_int4(packed, scale.astype(np.float32), (4, 64))
    with pytest.raises(ValueError, match="int32"):
        unpack_int4(packed.astype(np.int64), None, (4, 64))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(np.full((1, 8), 8, dtype=np.int8))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(np.zeros((1, 12), dtype=np.int8))


def test_quantize_groupwise_error_bound_and_codes():
    rng = np.random.default_rng(5)
    n, k = 32, 256
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w[3, 32:64] = 0.0                                           # an all-zero group
    packed, scale = quantize_groupwise(w)
    assert packed.shape == (n, k // 8) and scale.shape == (n, k // 32) and scale.dtype == np.uint16
    wq = dequantize(packed, scale, (n, k), np.float64)
    s = np.repeat(bf16_bits_to_f32(scale).astype(np.float64), 32, axis=1)
    # every element within half a quantization step (no clipping: |w| <= 7.5 * scale up to bf16 rounding)
    err = np.abs(wq - w)
    assert (err <= 0.5 * s + 1e-12 + np.abs(w) * 2 ** -8).all()
    assert np.all(wq[3, 32:64] == 0.0) and bf16_bits_to_f32(scale)[3, 1] == 0.0
    # relative norm error of 4-bit quantization of a Gaussian is a few percent, far from 0 and from 1
    rel = np.linalg.norm(wq - w) / np.linalg.norm(w)
    assert 0.02 < rel < 0.15
    # q is the nearest code for the stored scale: neither neighbouring code (within -8..7) is closer
    q = unpack_int4(packed, scale, (n, k)).astype(np.float64)
    for d in (-1.0, 1.0):
        alt = q + d
        ok = (alt >= -8) & (alt <= 7)
        assert (np.abs(w - q * s) <= np.abs(w - alt * s) + 1e-12)[ok].all()
    with pytest.raises(ValueError, match="NaN"):
        quantize_groupwise(np.full((1, 32), np.nan, dtype=np.float32))


@pytest.mark.oracle
def test_unpack_and_pack_match_compressed_tensors():
    import torch
    from compressed_tensors.compressors import pack_to_int32, unpack_from_int32

    rng = np.random.default_rng(6)
    for n, k in ((3, 32), (16, 512), (256, 2048)):
        q = _rand_q(rng, n, k)
        ours = pack_int4(q)
        theirs = pack_to_int32(torch.from_numpy(q.copy()), 4).numpy()
        assert theirs.dtype == np.int32
        np.testing.assert_array_equal(ours, theirs)
        words = rng.integers(-2**31, 2**31, size=(n, k // 8), dtype=np.int64).astype(np.int32)
        back = unpack_from_int32(torch.from_numpy(words.copy()), 4, torch.Size((n, k))).numpy()
        np.testing.assert_array_equal(unpack_int4(words, None, (n, k)), back)


@pytest.mark.oracle
def test_dequantize_bf16_matches_compressed_tensors_formula():
    """compressed-tensors' decompressor computes bf16(q.to(bf16) * scale) in torch: same bits as ours."""
    import torch

    rng = np.random.default_rng(7)
    n, k = 64, 256
    q = _rand_q(rng, n, k)
    scale = _rand_scale(rng, n, k)
    tq = torch.from_numpy(q.copy()).to(torch.bfloat16).reshape(n, k // 32, 32)
    ts = torch.from_numpy(scale.astype(np.int16)).view(torch.bfloat16)
    theirs = (tq * ts[:, :, None]).reshape(n, k).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(dequantize_bf16(pack_int4(q), scale, (n, k)), theirs)
