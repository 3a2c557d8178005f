"""CPU-testable parts of the GPU models: the weight plan (shapes, bytes per rank), batch input preparation
(layout, padding rows, mask packing, argument errors), GEMM row chunking and rank checks."""
import json
import os
from dataclasses import replace

import numpy as np
import pytest

from ddtree_cupy.config import ConfigError, TargetConfig
from ddtree_cupy.models.batch import MASK_WORDS, prepare_inputs
from ddtree_cupy.models.kv import latent_cache_bytes
from ddtree_cupy.models.target import GEMM_MAX_T, _chunks
from ddtree_cupy.models.weights import _check_rank, local_dims, moe_layout_shapes, plan_bytes, weight_plan

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def kimi():
    with open(os.path.join(HERE, "data", "kimi-k2.6-text.json")) as f:
        return TargetConfig.from_dict(json.load(f), "kimi-k2.6-text.json")


@pytest.fixture(scope="module")
def tiny():
    from ddtree_cupy.tinymodel import TinySpec
    return TinySpec().target_config()


def test_kimi_rank_plan_shapes_and_bytes(kimi):
    p = weight_plan(kimi, 8)
    u16 = np.dtype(np.uint16)
    assert p["layers.0.w_qkv_a"] == ((1536 + 576, 7168), u16)
    assert p["layers.0.w_q_b"] == ((8 * 192, 1536), u16)
    assert p["layers.0.w_uk_t"] == ((8, 512, 128), u16)
    assert p["layers.0.w_uv"] == ((8, 128, 512), u16)
    assert p["layers.0.w_o"] == ((7168, 8 * 128), u16)
    assert p["layers.0.w_gate_up"] == ((2 * 18432 // 8, 7168), u16)
    assert p["layers.0.w_down"] == ((7168, 18432 // 8), u16)
    assert "layers.0.experts.w13" not in p and "layers.1.w_gate_up" not in p
    assert p["layers.1.experts.w13"] == ((384, 2 * 256 // 16, 7168 // 64, 32, 4), np.dtype(np.uint32))
    assert p["layers.1.experts.w2"] == ((384, 7168 // 16, 256 // 64, 32, 4), np.dtype(np.uint32))
    assert p["layers.1.router_bias"] == ((384,), np.dtype(np.float32))
    assert p["layers.1.w_shared_gate_up"] == ((2 * 256, 7168), u16)
    assert p["embed"] == ((163840 // 8, 7168), u16) == p["lm_head"]
    b = plan_bytes(kimi, 8)
    # INT4 experts: 0.5 byte per weight + one bf16 scale per 32 weights, 60 MoE layers
    per_layer = 384 * 3 * 256 * 7168 * (0.5 + 2 / 32)
    assert b["experts"] == pytest.approx(60 * per_layer, rel=0) and 70e9 < b["experts"] < 72.5e9
    assert b["total"] == sum(v for k, v in b.items() if k != "total")
    assert b["total"] == sum(int(np.prod(s)) * d.itemsize for s, d in p.values())


def test_tiny_plan_every_tp(tiny):
    for tp in (1, 2, 4):
        d = local_dims(tiny, tp)
        p = weight_plan(tiny, tp)
        assert p["layers.1.w_q_b"][0] == (d["nh"] * 192, tiny.q_lora_rank)
        assert p["layers.0.w_down"][0] == (tiny.hidden_size, tiny.intermediate_size // tp)
        assert p["embed"][0] == (tiny.vocab_size // tp, tiny.hidden_size)
        assert set(moe_layout_shapes(32, 512, d["I"])) == {"w13", "s13", "w2", "s2"}
    with pytest.raises(ConfigError, match="tensor-parallel size 3"):
        weight_plan(tiny, 3)


def test_plan_refuses_other_latent_dims(tiny):
    with pytest.raises(ValueError, match="kv_lora_rank 512"):
        local_dims(replace(tiny, kv_lora_rank=256), 1)


def test_moe_layout_pads_expert_width():
    s = moe_layout_shapes(4, 128, 96)             # I = 96 -> Ip = 128 (two k64 steps)
    assert s["w2"][0] == (4, 128 // 16, 2, 32, 4) and s["w13"][0] == (4, 2 * 96 // 16, 2, 32, 4)


def test_prepare_inputs_layout_and_defaults():
    S, R = 3, 4
    tok = np.arange(12).reshape(S, R)
    h = prepare_inputs(S, R, 100, False, None, tokens=tok, positions=tok, n_rows=[4, 2, 0], prefix_len=[5, 0, 9])
    assert h["tokens"].dtype == np.int32 and h["tokens"].tolist() == list(range(12))
    # kv_pos: s + r on rows in use, -1 on padding rows and on the whole idle slot
    assert h["kv_pos"].tolist() == [5, 6, 7, 8, 0, 1, -1, -1, -1, -1, -1, -1]
    assert h["mask"] is None


def test_prepare_inputs_mask_packing():
    S, R = 2, 40
    rng = np.random.default_rng(0)
    vis = rng.random((S, R, R)) < 0.3
    h = prepare_inputs(S, R, 10, True, None, tokens=np.zeros((S, R), int), positions=np.zeros((S, R), int),
                       n_rows=[R, 3], prefix_len=[0, 0], mask=vis)
    m = h["mask"]
    assert m.shape == (S, R, MASK_WORDS) and m.dtype == np.uint32
    for b, i, j in [(0, 0, 0), (0, 5, 33), (1, 39, 39), (1, 2, 31), (0, 17, 32)]:
        assert bool((int(m[b, i, j // 32]) >> (j % 32)) & 1) == vis[b, i, j]
    assert (m[..., 2:] == 0).all()             # rows of 40 use two words
    h2 = prepare_inputs(S, R, 10, True, None, tokens=np.zeros((S, R), int), positions=np.zeros((S, R), int),
                        n_rows=[R, 3], prefix_len=[0, 0], mask=m)
    assert np.array_equal(h2["mask"], m)


@pytest.mark.parametrize("kw, msg", [
    (dict(n_rows=[5, 1]), "n_rows must lie in"),
    (dict(prefix_len=[-1, 0]), "prefix_len must be >= 0"),
    (dict(tokens=np.full((2, 4), 100)), "tokens must lie in"),
    (dict(positions=-np.ones((2, 4), int)), "positions must be >= 0"),
    (dict(kv_pos=np.zeros((2, 4), int)), "kv_pos must be -1 on rows"),
    (dict(tokens=np.zeros((2, 3), int)), "tokens has shape"),
    (dict(tokens=np.zeros((2, 4))), "tokens must be an integer array"),
    (dict(mask=np.zeros((2, 4, 4), bool)), "mask given for a causal batch"),
    (dict(prefix_len=[7, 0], max_kv_len=10), "exceeds max_kv_len"),
])
def test_prepare_inputs_errors(kw, msg):
    args = dict(tokens=np.zeros((2, 4), int), positions=np.zeros((2, 4), int), n_rows=[4, 1], prefix_len=[0, 0])
    max_kv = kw.pop("max_kv_len", None)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        prepare_inputs(2, 4, 100, False, max_kv, **args)


def test_prepare_inputs_tree_needs_mask():
    with pytest.raises(ValueError, match="mask is required"):
        prepare_inputs(1, 2, 10, True, None, tokens=[[0, 0]], positions=[[0, 0]], n_rows=[2], prefix_len=[0])
    with pytest.raises(ValueError, match="mask must be bool"):
        prepare_inputs(1, 2, 10, True, None, tokens=[[0, 0]], positions=[[0, 0]], n_rows=[2], prefix_len=[0],
                       mask=np.zeros((1, 2, 2), np.int32))


def test_gemm_row_chunks():
    for T in (1, GEMM_MAX_T, GEMM_MAX_T + 1, 387, 1032):
        c = list(_chunks(T))
        assert c[0][0] == 0 and c[-1][1] == T and all(b - a <= GEMM_MAX_T for a, b in c)
        assert all(c[i][1] == c[i + 1][0] for i in range(len(c) - 1))


def test_rank_checks_and_cache_bytes():
    for r, s in ((0, 0), (2, 2), (-1, 4), (1.0, 2)):
        with pytest.raises(ValueError, match="invalid tensor-parallel rank"):
            _check_rank(r, s)
    _check_rank(7, 8)
    # Kimi: 61 layers x 576 bf16 per token = 70272 B per token (ARCHITECTURE.md: ~70 KB)
    assert latent_cache_bytes(61, 1) == 61 * 64 * 576 * 2


@pytest.mark.slow
def test_gpu_target_tests_on_cpu_emulation():
    """tests/gpu/test_target_model.py (all but the Kimi-size test) through the CPU stand-in for CuPy and the
    kernels (tests/_kernel_emul.py), in a subprocess: GpuTarget's plumbing (views, strides, buffers, feature
    copies, graph capture without allocation, TP partial sums) against the float64 reference without a GPU."""
    import subprocess
    import sys
    root = os.path.dirname(HERE)
    code = ("import sys; sys.path[:0] = [%r, %r]; import _kernel_emul; _kernel_emul.install(); "
            "import pytest; "
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-k', 'not kimi', %r]))"
            % (root, HERE, os.path.join(HERE, "gpu", "test_target_model.py")))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=170)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    # NCCL skips: no NCCL on the CPU; the launch-sequence test runs for both shared-down variants
    assert "8 passed" in r.stdout and "1 skipped" in r.stdout, tail
