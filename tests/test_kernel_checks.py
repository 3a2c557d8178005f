"""Argument checks of the kernel wrappers, on the CPU: stand-in array objects replace cupy.ndarray so the
checks (which only read shape/dtype/strides/pointer attributes) run without a GPU, and every wrapper must
reject bad input with a ValueError naming the argument before it launches anything."""
from types import SimpleNamespace

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from ddtree_cupy.kernels import checks


class FakeArray:
    """Enough of cupy.ndarray's attributes for the checks: a C-ordered array at a fake address."""

    def __init__(self, shape, dtype, ptr=0x10000, strides=None, device=0):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.ndim = len(self.shape)
        if strides is None:
            strides, acc = [], self.dtype.itemsize
            for n in reversed(self.shape):
                strides.insert(0, acc)
                acc *= n
        self.strides = tuple(strides)
        self.flags = SimpleNamespace(c_contiguous=True)
        self.data = SimpleNamespace(ptr=ptr)
        self.device = SimpleNamespace(id=device)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize

    def __getitem__(self, idx):
        """Only full slices and None (what the wrappers use: x[:, None, :], out[:, None])."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        shape, strides, d = [], [], 0
        for i in idx:
            if i is None:
                shape.append(1)
                strides.append(self.dtype.itemsize)
            else:
                assert i == slice(None), i
                shape.append(self.shape[d])
                strides.append(self.strides[d])
                d += 1
        shape += self.shape[d:]
        strides += self.strides[d:]
        out = FakeArray(shape, self.dtype, ptr=self.data.ptr)
        out.strides = tuple(strides)
        return out


@pytest.fixture(autouse=True)
def fake_cupy(monkeypatch):
    monkeypatch.setattr(cupy, "ndarray", FakeArray)


def _contig_strides(shape, item):
    s, acc = [], item
    for n in reversed(shape):
        s.insert(0, acc)
        acc *= n
    return tuple(s)


# FakeArray's c_contiguous flag: compare with the C-order strides
def _fake(shape, dtype=np.uint16, strides=None, ptr=0x10000):
    a = FakeArray(shape, dtype, ptr=ptr)
    if strides is not None:
        a.strides = tuple(strides)
        a.flags = SimpleNamespace(c_contiguous=tuple(strides) == _contig_strides(shape, np.dtype(dtype).itemsize))
    return a


def test_check_array_names_the_argument():
    dims = {}
    checks.check_array("x", _fake((4, 16)), np.uint16, ("T", 16), dims)
    assert dims == {"T": 4}
    with pytest.raises(ValueError, match=r"^out: dimension 0 \(T\) is 5"):
        checks.check_array("out", _fake((5, 16)), np.uint16, ("T", 16), dims)
    with pytest.raises(ValueError, match=r"^w: expected dtype uint16.*stored as uint16"):
        checks.check_array("w", _fake((4, 16), np.float32), np.uint16, (None, None))
    with pytest.raises(ValueError, match=r"^w: expected 2 dimensions"):
        checks.check_array("w", _fake((4,)), np.uint16, (None, None))
    with pytest.raises(ValueError, match=r"^w: dimension 1 must be 16"):
        checks.check_array("w", _fake((4, 8)), np.uint16, (None, 16))
    with pytest.raises(ValueError, match=r"^v: must be C-contiguous"):
        checks.check_array("v", _fake((4, 8), strides=(32, 2)), np.uint16, (4, 8))
    with pytest.raises(ValueError, match=r"^x: expected a cupy.ndarray, got ndarray"):
        checks.check_array("x", np.zeros((4, 16), np.uint16), np.uint16, (4, 16))


def test_check_rows_strided_views():
    # q[:, :, 128:] of a [T, 8, 192] bf16 array: fine (strides 3072 and 384 bytes, base +256 bytes)
    v = _fake((5, 8, 64), strides=(3072, 384, 2), ptr=0x10000 + 256)
    assert checks.check_rows("q_pe", v, np.uint16, ("T", 8, 64)) == (1536, 192, 1)
    with pytest.raises(ValueError, match=r"^q_pe: the last dimension must be contiguous"):
        checks.check_rows("q_pe", _fake((5, 64), strides=(256, 4)), np.uint16, (5, 64))
    with pytest.raises(ValueError, match=r"^x: stride 130 B"):
        checks.check_rows("x", _fake((5, 64), strides=(130, 2)), np.uint16, (5, 64))
    with pytest.raises(ValueError, match=r"^x: base address"):
        checks.check_rows("x", _fake((5, 64), ptr=0x10002), np.uint16, (5, 64))


def test_check_range_and_multiple():
    assert checks.check_range("K", 8, 1, 256) == 8
    for bad in (0, 257, 3.5, "8"):
        with pytest.raises(ValueError, match=r"^K: must be an integer in \[1, 256\]"):
            checks.check_range("K", bad, 1, 256)
    with pytest.raises(ValueError, match=r"^N: must be a multiple of 16, got 40"):
        checks.check_multiple("N", 40, 16)


def test_gemm_wrapper_rejects_bad_shapes():
    from ddtree_cupy.kernels.gemm import gemm_bf16
    with pytest.raises(ValueError, match=r"K \(x.shape\[-1\]\): must be a multiple of 64"):
        gemm_bf16(_fake((4, 96)), _fake((64, 96)))
    with pytest.raises(ValueError, match=r"^w: dimension 1 \(K\)"):
        gemm_bf16(_fake((4, 128)), _fake((64, 192)))
    with pytest.raises(ValueError, match=r"tokens T"):
        gemm_bf16(_fake((161, 128)), _fake((64, 128)))
    with pytest.raises(ValueError, match=r"N \(w.shape\[-2\]\): must be a multiple of 16"):
        gemm_bf16(_fake((4, 128)), _fake((40, 128)))
    with pytest.raises(ValueError, match=r"^out: dimension 1"):
        gemm_bf16(_fake((4, 128)), _fake((64, 128)), _fake((4, 32)))
    with pytest.raises(ValueError, match=r"^out_dtype"):
        gemm_bf16(_fake((4, 128)), _fake((64, 128)), out_dtype=np.float16)


def test_layer_wrappers_reject_bad_args():
    from ddtree_cupy.kernels import layers
    x = _fake((3, 512))
    with pytest.raises(ValueError, match=r"^weight: dimension 0 \(H\)"):
        layers.rms_norm(x, _fake((256,)), 1e-6, _fake((3, 512)))
    with pytest.raises(ValueError, match=r"^eps"):
        layers.rms_norm(x, _fake((512,)), 0.0, _fake((3, 512)))
    with pytest.raises(ValueError, match=r"^residual: dimension 0 \(T\)"):
        layers.rms_norm(x, _fake((512,)), 1e-6, _fake((3, 512)), residual=_fake((4, 512)))
    with pytest.raises(ValueError, match=r"^out: required with out_rows"):
        layers.rms_norm(x, _fake((512,)), 1e-6, out_rows=_fake((3,), np.int32))
    with pytest.raises(ValueError, match=r"^positions: expected dtype int32"):
        layers.rope(_fake((3, 2, 64)), _fake((3,), np.int64), inv_freq=_fake((32,), np.float32))
    with pytest.raises(ValueError, match=r"^style"):
        layers.rope(_fake((3, 64)), _fake((3,), np.int32), style="gptj", inv_freq=_fake((32,), np.float32))
    with pytest.raises(ValueError, match=r"^inv_freq: dimension 0 must be 32"):
        layers.rope(_fake((3, 64)), _fake((3,), np.int32), inv_freq=_fake((16,), np.float32))
    with pytest.raises(ValueError, match=r"^inv_freq: required"):
        layers.rope(_fake((3, 64)), _fake((3,), np.int32))
    with pytest.raises(ValueError, match=r"^gate_up: width"):
        layers.silu_mul(_fake((3, 24)), _fake((3, 12)))
    with pytest.raises(ValueError, match=r"^out: dimension 1"):
        layers.silu_mul(_fake((3, 32)), _fake((3, 8)))
    with pytest.raises(ValueError, match=r"^ids: expected dtype int32"):
        layers.embed(_fake((3,), np.int64), _fake((10, 64)), 0, _fake((3, 64)))


def test_topk_sample_router_reject_bad_args():
    from ddtree_cupy.kernels import router, sample, topk
    with pytest.raises(ValueError, match=r"^K: must be an integer in \[1, 256\]"):
        topk.topk(_fake((2, 1000), np.float32), 300, _fake((2, 300), np.float32), _fake((2, 300), np.int32))
    with pytest.raises(ValueError, match=r"^logits: expected dtype float32"):
        topk.topk(_fake((2, 1000), np.float64), 4)
    with pytest.raises(ValueError, match=r"^out_ids: expected dtype int32"):
        topk.topk(_fake((2, 1000), np.float32), 4, _fake((2, 4), np.float32), _fake((2, 4), np.int64))
    with pytest.raises(ValueError, match=r"^out: dimension 0 must be 2"):
        topk.argmax(_fake((2, 1000), np.float32), _fake((3,), np.int32))
    with pytest.raises(ValueError, match=r"^logits: expected 2 dimensions"):
        topk.argmax(_fake((1000,), np.float32))
    with pytest.raises(ValueError, match=r"^cand_ids: dimension 1 \(n\)"):
        topk.topk_merge(_fake((2, 64), np.float32), _fake((2, 32), np.int32), 4)
    T = 2
    good = dict(temperature=_fake((T,), np.float32), top_k=_fake((T,), np.int32), top_p=_fake((T,), np.float32),
                seeds=_fake((T,), np.uint64), steps=_fake((T,), np.int64))
    for name, bad in [("seeds", _fake((T,), np.int64)), ("steps", _fake((T + 1,), np.int64)),
                      ("top_p", _fake((T,), np.float64))]:
        kw = dict(good, **{name: bad})
        with pytest.raises(ValueError, match=rf"^{name}: "):
            sample.sample(_fake((T, 100), np.float32), **kw, out=_fake((T,), np.int32))
    lg = _fake((3, 384), np.float32)
    with pytest.raises(ValueError, match=r"^n_group: 5 does not divide"):
        router.route_logits(lg, _fake((384,), np.float32), 8, n_group=5, topk_group=1)
    with pytest.raises(ValueError, match=r"^topk_group"):
        router.route_logits(lg, _fake((384,), np.float32), 8, n_group=8, topk_group=9)
    with pytest.raises(ValueError, match=r"^k: "):
        router.route_logits(lg, _fake((384,), np.float32), 60, n_group=8, topk_group=1)
    with pytest.raises(ValueError, match=r"^bias: expected dtype float32"):
        router.route_logits(lg, _fake((384,), np.uint16), 8)


def test_choose_split_bounds():
    from ddtree_cupy.kernels.gemm import BK, choose_split, stages_for, smem_bytes, NT_CHOICES
    for T, N, K in [(1, 576, 7168), (160, 2112, 7168), (8, 20480, 7168), (1, 16, 64), (64, 7168, 256)]:
        s = choose_split(T, N, K, 1, 188)
        per = -(-(K // BK) // s)
        assert 1 <= s <= K // BK and (s - 1) * per < K // BK      # no empty split
        assert s == 1 or s * T * 4 <= K * 2 // 4                  # partials at most a quarter of the weight bytes
    for nt in NT_CHOICES:
        assert stages_for(nt) >= 3 and smem_bytes(nt) <= 99 * 1024
