"""CPU stand-in for CuPy and the kernels GpuTarget launches, for running tests/gpu/test_target_model.py
without a GPU (tests/test_models_cpu.py::test_gpu_target_tests_on_cpu_emulation runs it in a subprocess).

Import this module BEFORE anything imports cupy: it installs the numpy-backed ``cupy`` of
tests/_fake_cupy.py (real buffer addresses, graph capture and replay, allocation during a capture raises),
replaces ``get_kernel`` in the kernel wrapper modules so that the REAL wrappers run (every argument check,
stride and pointer computation) and their launches execute (or, in a capture, record) numpy emulations that
decode the raw launch arguments (pointers, element strides, grid). Emulated numerics round to bf16 where the
kernels do (GEMM/norm/RoPE/attention outputs, the MoE intermediate), accumulating in float64. The MoE is
emulated at ``moe_forward`` level from the dequantised experts (``pack_moe_weights`` keeps them), after the
real launch plan has checked the arguments. NCCL is absent (its test skips).
"""
import ctypes

import _fake_cupy as fake      # the callers put tests/ on sys.path
import numpy as np
from numpy.lib.stride_tricks import as_strided

fake.install()
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------------
# kernel emulations from raw launch arguments
# ---------------------------------------------------------------------------------------------------
from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits  # noqa: E402


def _f(a):
    return bf16_bits_to_f32(np.asarray(a).view(np.ndarray)).astype(np.float64)


def _bits(a):
    return to_bf16_bits(np.asarray(a, np.float64).astype(np.float32))


def _null(a):
    return not isinstance(a, np.ndarray)


def _view(a, shape, strides_el):
    """The memory a kernel addresses from base pointer ``a`` with element strides ``strides_el``."""
    a = np.asarray(a).view(np.ndarray)
    it = a.dtype.itemsize
    return as_strided(a, shape=shape, strides=tuple(int(s) * it for s in strides_el), writeable=True)


def _mem_u16(addr, n):
    return np.ctypeslib.as_array((ctypes.c_uint16 * n).from_address(int(addr)))


def _gemm(name, grid, args):
    x, xs0, xs1, w, w_bs, out, os0, os1, _ws, T, N, K, _per = args
    B, T, N, K = grid[2], int(T), int(N), int(K)
    y = np.einsum("btk,bnk->btn", _f(_view(x, (B, T, K), (xs0, xs1, 1))), _f(_view(w, (B, N, K), (w_bs, K, 1))))
    f32_out = name.rstrip(">").split(",")[-1].strip() == "true"
    _view(out, (B, T, N), (os0, os1, 1))[...] = y.astype(np.float32) if f32_out else _bits(y)


def _norm(name, grid, args):
    x, xs0, res, rs0, res_out, ros0, weight, out, os0, out_rows, H, eps = args
    T, H = grid[0], int(H)
    h = _f(_view(x, (T, H), (xs0, 1)))
    if not _null(res):
        h = _f(_bits(h + _f(_view(res, (T, H), (rs0, 1)))))
        _view(res_out, (T, H), (ros0, 1))[...] = _bits(h)
    y = _f(weight) * h / np.sqrt((h * h).mean(-1, keepdims=True) + float(eps))
    assert _null(out_rows), "out_rows scatter is not emulated"
    _view(out, (T, H), (os0, 1))[...] = _bits(y)


def _rope(name, grid, args):
    x, xs0, xs1, out, os0, os1, out_rows, positions, T, heads, half, _c, _s, _mp, inv_freq, amp = args
    assert name == "rope_kernel<false, false>" and _null(out_rows), f"{name}: only adjacent pairs + inv_freq emulated"
    T, heads, half = int(T), int(heads), int(half)
    X = _f(_view(x, (T, heads, 2 * half), (xs0, xs1, 1)))
    pos = np.asarray(positions).astype(np.float32)
    ang = (pos[:, None] * np.asarray(inv_freq, np.float32)[None]).astype(np.float32)
    c = (np.cos(ang) * np.float32(amp)).astype(np.float64)[:, None]
    s = (np.sin(ang) * np.float32(amp)).astype(np.float64)[:, None]
    Y = np.empty_like(X)
    Y[..., 0::2] = X[..., 0::2] * c - X[..., 1::2] * s
    Y[..., 1::2] = X[..., 0::2] * s + X[..., 1::2] * c
    _view(out, (T, heads, 2 * half), (os0, os1, 1))[...] = _bits(Y)


def _silu(name, grid, args):
    gu, gs0, out, os0, T, I = args
    T, I = int(T), int(I)
    G = _f(_view(gu, (T, 2 * I), (gs0, 1)))
    g, u = G[:, :I], G[:, I:]
    _view(out, (T, I), (os0, 1))[...] = _bits(g / (1 + np.exp(-g)) * u)


def _embed(name, grid, args):
    ids, table, rows, vs, H, out, os0 = args
    O = _view(out, (grid[0], int(H)), (os0, 1))
    tb = np.asarray(table).view(np.ndarray)
    for t in range(grid[0]):
        r = int(ids[t]) - int(vs)
        O[t] = tb[r] if 0 <= r < int(rows) else 0


def _router(name, grid, args):
    logits, ls0, T, E, bias, n_group, _tg, k, norm, scale, out_ids, out_w, route_blocks, gu, gs0, act, as0, I, rp = args
    T, E, I = int(T), int(E), int(I)
    if I:             # the shared expert's SwiGLU in the extra blocks, from the fp32 gate|up rounded to bf16
        G = _f(_bits(_view(gu, (T, 2 * I), (gs0, 1))))
        g, u = G[:, :I], G[:, I:]
        _view(act, (T, I), (as0, 1))[...] = _bits(g / (1 + np.exp(-g)) * u)
    logits = _view(logits, (T, E), (ls0, 1))
    assert int(n_group) == 1, "group-limited routing is not emulated"
    s = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    choice = s + np.asarray(bias, np.float64)[None]
    pad = np.asarray(rp) < 0 if isinstance(rp, np.ndarray) else np.zeros(T, bool)   # row_pos NULL: none
    for t in range(int(T)):
        if pad[t]:                      # a padding row (row_pos < 0) selects no expert
            out_ids[t], out_w[t] = -1, 0.0
            continue
        ids = np.lexsort((np.arange(int(E)), -choice[t]))[:int(k)]     # descending, ties to the lower id
        w = s[t, ids] / (s[t, ids].sum() if int(norm) else 1.0)
        out_ids[t] = ids
        out_w[t] = (w * float(scale)).astype(np.float32)


def _router_down(name, grid, args):
    """router_topk_down<KS>: the selection, then down_out = act @ W_down^T with act = bf16(silu(g) * u) of the
    fp32 gate|up rounded to bf16 (never stored)."""
    (logits, ls0, T, E, bias, n_group, tg, k, norm, scale, out_ids, out_w, route_blocks, gu, gs0, wd, out, os0,
     N, _col_blocks, rp) = args
    T, N, I = int(T), int(N), 64 * int(name.split("<")[1].rstrip(">"))
    _router("router_topk", grid, (logits, ls0, T, E, bias, n_group, tg, k, norm, scale, out_ids, out_w,
                                  route_blocks, None, 0, None, 0, 0, rp))
    G = _f(_bits(_view(gu, (T, 2 * I), (gs0, 1))))
    g, u = G[:, :I], G[:, I:]
    act = _f(_bits(g / (1 + np.exp(-g)) * u))
    _view(out, (T, N), (os0, 1))[...] = _bits(act @ _f(_view(wd, (N, I), (I, 1))).T)


def _mla(name, grid, args):
    q, pool, table, prefix_len, n_rows, row_start, mask, out, _po, _pl, _mp, _mr, H, _th, _ns, scale_log2 = args
    P, tb = np.asarray(pool).view(np.ndarray), np.asarray(table).view(np.ndarray)
    Q, O = np.asarray(q).view(np.ndarray), np.asarray(out).view(np.ndarray)
    scale = float(scale_log2) / LOG2E
    for b in range(grid[2]):
        n, s, rs = int(n_rows[b]), int(prefix_len[b]), int(row_start[b])
        if n == 0:
            continue
        pos = np.arange(s + n)
        keys = _f(P[tb[b, pos // 64], pos % 64])
        for i in range(n):
            if _null(mask):
                own = np.arange(n) <= i
            else:
                words = np.asarray(mask).view(np.ndarray)[b, i].astype(np.int64)
                own = np.array([(words[j // 32] >> (j % 32)) & 1 for j in range(n)], bool)
            kk = keys[np.concatenate([np.ones(s, bool), own])]
            sc = _f(Q[rs + i]) @ kk.T * scale
            p = np.exp(sc - sc.max(-1, keepdims=True))
            O[rs + i] = _bits((p / p.sum(-1, keepdims=True)) @ kk[:, :512])


def _kv_write(name, grid, args):
    lat, lat_stride, rope, rope_stride, sids, positions, pool, table, _mp = args
    P, tb = np.asarray(pool).view(np.ndarray), np.asarray(table).view(np.ndarray)
    for t in range(grid[0]):
        p = int(positions[t])
        if p < 0:
            continue
        page = tb[int(sids[t]), p // 64]
        assert page >= 0, "latent write to a stream position without a page"
        P[page, p % 64, :512] = _mem_u16(int(lat) + 2 * t * int(lat_stride), 512)
        P[page, p % 64, 512:] = _mem_u16(int(rope) + 2 * t * int(rope_stride), 64)


def _qkv_a_post(name, grid, args):
    (qkv, qs0, ql, qw, kvw, eps, cq, cs0, positions, inv_freq, amp, sids, kv_pos, pool, table, _mp) = args
    T, ql = grid[0], int(ql)
    X = _f(_view(qkv, (T, ql + 576), (qs0, 1)))
    norm = lambda h, w: _f(w) * h / np.sqrt((h * h).mean(-1, keepdims=True) + float(eps))  # noqa: E731
    _view(cq, (T, ql), (cs0, 1))[...] = _bits(norm(X[:, :ql], qw))
    lat = _f(_bits(norm(X[:, ql:ql + 512], kvw)))
    pe = np.zeros((T, 1, 64), np.uint16)
    _rope("rope_kernel<false, false>", None, (_bits(X[:, ql + 512:])[:, None], 64, 64, pe, 64, 64, np.uint64(0),
                                              positions, T, 1, 32, None, None, 0, inv_freq, amp))
    P, tb = np.asarray(pool).view(np.ndarray), np.asarray(table).view(np.ndarray)
    for t in range(T):
        p = int(kv_pos[t])
        if p >= 0:
            page = tb[int(sids[t]), p // 64]
            assert page >= 0, "latent write to a stream position without a page"
            P[page, p % 64, :512] = _bits(lat[t])
            P[page, p % 64, 512:] = pe[t, 0]


def _head_gemm(name, grid, args):
    (x, xs0, xs1, w, out, os0, os1, T, N, pe, ps0, ps1, pe_out, pos0, pos1, positions, inv_freq, amp, half) = args
    nh, T, N = grid[0], int(T), int(N)
    K = 64 * int(name.split("<")[1].rstrip(">"))
    y = np.einsum("thk,hnk->thn", _f(_view(x, (T, nh, K), (xs0, xs1, 1))), _f(_view(w, (nh, N, K), (N * K, K, 1))))
    _view(out, (T, nh, N), (os0, os1, 1))[...] = _bits(y)
    if not _null(pe):
        _rope("rope_kernel<false, false>", None, (pe, ps0, ps1, pe_out, pos0, pos1, np.uint64(0), positions, T, nh,
                                                  half, None, None, 0, inv_freq, amp))


def _noop(name, grid, args):
    pass


_TABLE = [("gemm_bf16_kernel", _gemm), ("gemm_splitk_reduce", _noop), ("rmsnorm_kernel", _norm),
          ("rope_kernel", _rope), ("silu_mul_kernel", _silu), ("embed_gather_kernel", _embed),
          ("router_topk_down", _router_down), ("router_topk", _router), ("mla_attn_fwd", _mla), ("mla_attn_ksplit", _mla), ("mla_attn_combine", _noop),
          ("kv_write_latent", _kv_write), ("moe_", _noop), ("mla_qkv_a_post", _qkv_a_post),
          ("mla_head_gemm", _head_gemm)]


def _get_kernel(spec, name, max_dynamic_smem=0):
    """Emulations write final results straight into ``out`` (split-K / split-KV partials are skipped, so
    the reduction / combine launches are no-ops)."""
    for prefix, fn in _TABLE:
        if name.startswith(prefix):
            return fake.launcher(lambda grid, args, _fn=fn: _fn(name, grid, args))
    raise KeyError(f"no emulation for kernel {name}")


import ddtree_cupy.kernels.attention as _attention  # noqa: E402
import ddtree_cupy.kernels.compile as _compile  # noqa: E402
import ddtree_cupy.kernels.fused as _fused  # noqa: E402
import ddtree_cupy.kernels.gemm as _gemm_mod  # noqa: E402
import ddtree_cupy.kernels.kv_cache as _kv_cache  # noqa: E402
import ddtree_cupy.kernels.layers as _layers  # noqa: E402
import ddtree_cupy.kernels.moe as _moe  # noqa: E402
import ddtree_cupy.kernels.moe.forward as _moe_forward_mod  # noqa: E402
import ddtree_cupy.kernels.router as _router_mod  # noqa: E402

for _m in (_gemm_mod, _layers, _router_mod, _attention, _kv_cache, _moe_forward_mod, _fused):
    _m.get_kernel = _get_kernel
_compile.device_arch = lambda: "sm_90"
_orig_pack, _orig_plan = _moe.pack_moe_weights, _moe.moe_launch_plan


def _pack(gp, gs, up, us, dp, ds):
    w = _orig_pack(gp, gs, up, us, dp, ds)
    deq = lambda p, s: _moe.dequant_numpy(np.asarray(p).view(np.ndarray), np.asarray(s).view(np.ndarray))  # noqa
    w.dense_for_emulation = (deq(gp, gs), deq(up, us), deq(dp, ds))
    return w


def _moe_forward(x, topk_ids, topk_weights, weights, ws, out=None, residual=None, tiles=None, l2_prefetch=None,
                 pf_steps=_moe.PF_STEPS):
    _orig_plan(x, topk_ids, topk_weights, weights, ws, out, residual, tiles, l2_prefetch, pf_steps)  # the checks
    G, U, D = weights.dense_for_emulation

    def op():
        X = _f(x)
        acc = np.zeros((X.shape[0], weights.hidden)) if residual is None else _f(residual)
        ids, wts = np.asarray(topk_ids).view(np.ndarray), np.asarray(topk_weights, np.float64)
        for t in range(X.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                if 0 <= e < weights.n_experts:           # out-of-range ids are skipped, as the kernel does
                    g, u = X[t] @ G[e].T, X[t] @ U[e].T
                    acc[t] += wts[t, j] * (_f(_bits(g / (1 + np.exp(-g)) * u)) @ D[e].T)
        np.asarray(out).view(np.ndarray)[...] = _bits(acc)
    fake.run_or_record(op)
    return out


_moe.pack_moe_weights, _moe.moe_forward = _pack, _moe_forward
