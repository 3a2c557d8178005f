"""Numpy emulations of every kernel the CPU tests launch, from the raw launch arguments, over the CuPy stand-in
of tests/_fake_cupy.py (the base layer: arrays with real buffer addresses, graph capture and replay; this module is
its one extension: the kernels).

``get_kernel`` replaces ``ddtree_cupy.kernels.*.get_kernel``: the REAL wrappers run (every argument check, stride
and pointer computation) and their launches execute, or inside a capture record, an emulation that decodes the
arguments in the order of the .cu signature (pointers, element strides, grid). Two families:
- the decode step's own kernels (DDTree top-K / builder / walk, KV compaction, the engine glue; ``ENGINE_KERNELS``,
  looked up by exact name at launch time, so a test may add one): each the numpy reference of its kernel;
- the target's kernels (GEMM, norms, RoPE, router, MLA attention, latent writes; ``TARGET_KERNELS``, by name
  prefix): float64 arithmetic rounded to bf16 where the kernels round. Split-K / split-KV partials are skipped
  (emulations write final results straight into ``out``), so the reduction / combine launches are no-ops. The
  MoE is emulated at ``moe_forward`` level from the dequantised experts (``pack_moe_weights`` keeps them), after
  the real launch plan has checked the arguments.

Users: the ``fake_gpu`` fixture of tests/_engine_toys.py (tests/test_engine_cpu.py and the tests built on its
toy models) patches ``get_kernel`` into the engine's wrapper modules per test; the subprocess runs of tests/gpu/
files on the CPU (tests/test_models_cpu.py, tests/test_allreduce_fused_target_cpu.py) and
tests/_engine_target_emul.py call ``install()`` before anything imports cupy. NCCL is absent (its tests skip).
"""
import ctypes

import _fake_cupy as fake      # the callers put tests/ on sys.path
import numpy as np
from numpy.lib.stride_tricks import as_strided

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
from ddtree_cupy.reference import ddtree as rdt

LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------------
# the decode step's own kernels: argument order of the .cu signatures, numpy references
# ---------------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------------
def _ordered(v):
    bits = np.where(v == 0, np.float32(0), v).astype(np.float32).view(np.uint32).astype(np.uint64)
    return np.where(bits >> 31 == 1, (~bits) & 0xFFFFFFFF, bits | 0x80000000)


def _unorder(o):
    o = o.astype(np.uint64)
    bits = np.where(o >> 31 == 1, o & 0x7FFFFFFF, (~o) & 0xFFFFFFFF).astype(np.uint32)
    return bits.view(np.float32)


def k_topk_partial(logits, rows, V, id_offset, k, chunk, part_keys, part_ms):
    L = np.asarray(logits).reshape(int(rows), int(V)).astype(np.float32)
    P = -(-int(V) // int(chunk))
    for r in range(int(rows)):
        for p in range(P):
            x = L[r, p * chunk:(p + 1) * chunk]
            ids = int(id_offset) + p * int(chunk) + np.arange(x.size)
            keys = (_ordered(x) << np.uint64(32)) | (np.uint64(0xFFFFFFFF) - ids.astype(np.uint64))
            top = np.sort(keys)[::-1][:int(k)]
            part_keys[r, p, :] = 0
            part_keys[r, p, :top.size] = top
            m = x.max()
            part_ms[r, p] = (m, np.exp(x.astype(np.float64) - m).sum())


def k_topk_merge(keys, ms, rows, P, k, parts_major, out_keys, out_ms, out_lp, out_id):
    keys, ms = np.asarray(keys), np.asarray(ms)
    if int(parts_major):
        keys, ms = keys.transpose(1, 0, 2), ms.transpose(1, 0, 2)
    for r in range(int(rows)):
        top = np.sort(keys[r].reshape(-1))[::-1][:int(k)]
        m = ms[r, :, 0].max()
        s = (ms[r, :, 1] * np.exp(ms[r, :, 0].astype(np.float64) - m)).sum()
        out_keys[r] = top
        out_ms[r] = (m, s)
        out_lp[r] = _unorder(top >> np.uint64(32)) - np.float32(m + np.log(s))
        out_id[r] = (np.uint64(0xFFFFFFFF) - (top & np.uint64(0xFFFFFFFF))).astype(np.int64).astype(np.int32)


def k_build_tree(top_lp, top_id, D, K, budgets, prefix_len, bonus, cap_k, include_chain, tokens, parents, depths,
                 positions, n_rows, mask):
    for s in range(top_lp.shape[0]):
        b = int(np.clip(budgets[s], 0, 128))
        tree = rdt.build_tree(np.asarray(top_lp[s]), np.asarray(top_id[s]), b, cap_k=int(cap_k) or None,
                              include_chain=bool(include_chain))
        flat = rdt.flatten(tree, int(bonus[s]), int(prefix_len[s]))
        n = flat.n_rows
        tokens[s], parents[s], depths[s], positions[s] = int(bonus[s]), -1, 0, int(prefix_len[s])
        mask[s] = 0
        mask[s, :, 0] = 1
        r = np.arange(129)
        mask[s, r, r // 32] |= (np.uint32(1) << (r % 32).astype(np.uint32))
        tokens[s, :n], parents[s, :n], depths[s, :n], positions[s, :n] = (flat.tokens, flat.parents, flat.depths,
                                                                          flat.positions)
        mask[s, :n] = flat.mask_bits
        n_rows[s] = n


def k_walk_commit(tokens, parents, n_rows, post, prefix_len, row_offset, A, acc_rows, n_acc, kv_src, kv_dst,
                  feat_rows, out_tokens, new_len, new_bonus, upd_len, upd_bonus):
    A = int(A)
    for s in range(tokens.shape[0]):
        n = min(max(int(n_rows[s]), 1), 129)
        rows, cur = [0], 0
        while len(rows) < A:
            ch = [c for c in range(cur + 1, n) if parents[s, c] == cur and tokens[s, c] == post[s, cur]]
            if not ch:
                break
            cur = ch[0]
            rows.append(cur)
        a, pre = len(rows), int(prefix_len[s])
        pad = lambda v: v + [-1] * (A - len(v))  # noqa: E731
        acc_rows[s] = pad(rows)
        kv_src[s] = pad([pre + r for r in rows])
        kv_dst[s] = pad([pre + j for j in range(a)])
        feat_rows[s] = pad([int(row_offset[s]) + r for r in rows])
        out_tokens[s] = [int(tokens[s, r]) for r in rows] + [int(post[s, cur])] + [-1] * (A - a)
        n_acc[s], new_len[s], new_bonus[s] = a, pre + a, int(post[s, cur])
        assert isinstance(upd_len, np.uint64) and isinstance(upd_bonus, np.uint64)   # the engine passes null


def k_kv_compact(pool_ptrs, block_table, maxpages, prefix_len, n_accept, acc_rows, A):
    for pool in map(fake.array_at, np.asarray(pool_ptrs)):     # the pointer table, dereferenced
        for s in range(block_table.shape[0]):
            pre = int(prefix_len[s])
            for j in range(1, int(n_accept[s])):
                src, dst = pre + int(acc_rows[s, j]), pre + j
                pool[block_table[s, dst // 64], dst % 64] = pool[block_table[s, src // 64], src % 64]


def k_root_tree(ctrl, S, tokens, parents, depths, positions, n_rows, mask):
    from ddtree_cupy.kernels import engine_glue as g
    g.root_tree_ref(np.asarray(ctrl).reshape(5, int(S)), tokens, parents, depths, positions, n_rows, mask)


def k_tree_to_batch(ctrl, S, R, trt, trp, trn, trm, tokens, positions, kv_pos, stream_ids, prefix_len, n_rows,
                    row_start, mask_out):
    from ddtree_cupy.kernels import engine_glue as g
    o = g.tree_to_batch_ref(np.asarray(ctrl), int(R), np.asarray(trt), np.asarray(trp), np.asarray(trn),
                            np.asarray(trm))
    for k, a in (("tokens", tokens), ("positions", positions), ("kv_pos", kv_pos), ("stream_ids", stream_ids),
                 ("prefix_len", prefix_len), ("n_rows", n_rows), ("row_start", row_start)):
        a[...] = o[k]
    if not isinstance(mask_out, np.uint64):
        mask_out[...] = o["mask"]


def k_post_scatter(ids, S, R, post):
    from ddtree_cupy.kernels import engine_glue as g
    post[...] = g.post_scatter_ref(np.asarray(ids), int(S), int(R))


def k_after_walk(ctrl, S, A, n_acc, trn, out_tokens, feat_rows, features, width, app_feats, app_sid, app_pos,
                 packed):
    from ddtree_cupy.kernels import engine_glue as g
    has = not isinstance(features, np.uint64)
    o = g.after_walk_ref(np.asarray(ctrl), np.asarray(n_acc), np.asarray(trn), np.asarray(out_tokens),
                         np.asarray(feat_rows), np.asarray(features) if has else None)
    packed[...] = o["packed"]
    if has:
        assert int(width) == features.shape[1] * features.shape[2]
        app_sid[...] = o["app_sid"]
        app_pos[...] = o["app_pos"]
        app_feats[o["use"]] = o["app_feats"][o["use"]]


def k_sample_params(ctrl, S, R, step_field, st, sk, sp, ss, temp, topk, topp, seeds, steps):
    from ddtree_cupy.kernels import engine_glue as g
    o = g.sample_params_ref(np.asarray(ctrl), int(R), np.asarray(st), np.asarray(sk), np.asarray(sp), np.asarray(ss))
    assert int(step_field) == g.CTRL_STEP
    for k, a in (("temp", temp), ("topk", topk), ("topp", topp), ("seeds", seeds), ("steps", steps)):
        a[...] = o[k]


def k_vocab_rows(parts, tp, T, Vl, out):
    from ddtree_cupy.kernels import engine_glue as g
    out[...] = g.vocab_rows_ref(np.asarray(parts))


ENGINE_KERNELS = {"ddt_topk_partial<float, true>": k_topk_partial, "ddt_topk_merge<true>": k_topk_merge,
                  "ddt_topk_partial<float, false>": k_topk_partial, "ddt_topk_merge<false>": k_topk_merge,  # same results
                  "ddt_build_tree": k_build_tree,
                  "ddt_walk_commit": k_walk_commit, "kv_compact_latent": k_kv_compact, "eg_root_tree": k_root_tree,
                  "eg_tree_to_batch": k_tree_to_batch, "eg_post_scatter": k_post_scatter, "eg_after_walk": k_after_walk,
                  "eg_sample_params": k_sample_params, "eg_vocab_rows": k_vocab_rows}


# ---------------------------------------------------------------------------------------------------
# the target's kernels: float64 arithmetic, bf16 rounding where the kernels round
# ---------------------------------------------------------------------------------------------------
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


TARGET_KERNELS = [("gemm_bf16_kernel", _gemm), ("gemm_splitk_reduce", _noop), ("rmsnorm_kernel", _norm),
                  ("rope_kernel", _rope), ("silu_mul_kernel", _silu), ("embed_gather_kernel", _embed),
                  ("router_topk_down", _router_down), ("router_topk", _router), ("mla_attn_fwd", _mla),
                  ("mla_attn_ksplit", _mla), ("mla_attn_combine", _noop), ("kv_write_latent", _kv_write),
                  ("moe_", _noop), ("mla_qkv_a_post", _qkv_a_post), ("mla_head_gemm", _head_gemm)]


def get_kernel(spec, name, max_dynamic_smem=0):
    """The emulation of kernel ``name`` as a launch (``fake.launcher``): a step kernel by exact name, else a
    target kernel by prefix."""
    if name in ENGINE_KERNELS:
        return fake.launcher(lambda grid, args: ENGINE_KERNELS[name](*args))
    for prefix, fn in TARGET_KERNELS:
        if name.startswith(prefix):
            return fake.launcher(lambda grid, args, _fn=fn: _fn(name, grid, args))
    raise KeyError(f"no emulation for kernel {name}")


def patch_get_kernel(modules, setattr_=setattr):
    """``get_kernel`` of each wrapper module replaced by the emulations' (``setattr_``: a monkeypatch's
    ``setattr`` to undo it after a test)."""
    for m in modules:
        setattr_(m, "get_kernel", get_kernel)


# ---------------------------------------------------------------------------------------------------
# the MoE at moe_forward level
# ---------------------------------------------------------------------------------------------------
def _emulate_moe(moe):
    """``moe.pack_moe_weights`` keeps the dequantised experts, ``moe.moe_forward`` checks its arguments through
    the real launch plan and computes the MoE from them."""
    orig_pack, orig_plan = moe.pack_moe_weights, moe.moe_launch_plan

    def pack(gp, gs, up, us, dp, ds):
        w = orig_pack(gp, gs, up, us, dp, ds)
        deq = lambda p, s: moe.dequant_numpy(np.asarray(p).view(np.ndarray), np.asarray(s).view(np.ndarray))  # noqa
        w.dense_for_emulation = (deq(gp, gs), deq(up, us), deq(dp, ds))
        return w

    def moe_forward(x, topk_ids, topk_weights, weights, ws, out=None, residual=None, tiles=None, l2_prefetch=None,
                    pf_steps=moe.PF_STEPS):
        orig_plan(x, topk_ids, topk_weights, weights, ws, out, residual, tiles, l2_prefetch, pf_steps)  # the checks
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

    moe.pack_moe_weights, moe.moe_forward = pack, moe_forward


def install():
    """For a whole process (the subprocess runs): the CuPy stand-in in ``sys.modules`` before anything imports
    cupy, every kernel wrapper module launching the emulations, an H200's architecture, the MoE emulated."""
    fake.install()
    from ddtree_cupy.kernels import (attention, compile, ddtree, engine_glue, fused, gemm, kv_cache, layers, moe,
                                     router)
    from ddtree_cupy.kernels.moe import forward as moe_forward_mod       # where the MoE launches its kernels
    patch_get_kernel((gemm, layers, router, attention, kv_cache, moe_forward_mod, fused, ddtree, engine_glue))
    compile.device_arch = lambda: "sm_90"
    _emulate_moe(moe)
