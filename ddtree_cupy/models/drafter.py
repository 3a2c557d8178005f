"""DFlash block drafter on the GPU, built from the kernel wrappers (docs/MODELS.md, section "Drafter").

The math is ``reference/drafter.py`` (the spec); this module only lays it out for the kernels:

* ``GpuDrafterWeights``: one tensor-parallel rank's bf16 weights on the device, fused for fewer, larger
  GEMMs: per layer one q/k/v weight for the block ``[(Hq + 2 Hkv) * 128, H]``, one gate+up weight
  ``[2 F, H]``; for the context one k/v weight over ALL layers ``[L, 2 Hkv * 128, H]`` (the context is the
  same input for every layer, so one GEMM projects it for the whole stack). Under TP, ``fc`` is split by
  input columns (its 43008 x 7168 weight is the largest tensor of the Kimi drafter; replicated it would
  cost every rank as much read time as all six layers) and its partial sums are all-reduced.
* ``GpuDrafter``: the per-layer context cache ``[S, C, Hkv, 128]`` (a ring, position p in slot p % C),
  ``append_context`` and ``draft``. Both run on the current CuPy stream, allocate nothing and never wait
  on the host after the first call of a shape, so a decode step containing them can be captured in a
  CUDA graph (the inputs must then be the same static device arrays at every replay).

Per-head RMSNorm needs each head's 128 values as one row of a uniformly strided matrix. The fused
projections therefore run as a batched GEMM with one batch entry per head (the input broadcast with a
zero batch stride), writing a head-major ``[heads, T, 128]`` buffer: all query heads (and all key heads)
are then one contiguous ``[heads * T, 128]`` matrix, normed in one launch, and the RoPE kernel, which
takes a (row, head) strided view, rotates them and writes the token-major layout the attention reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from ..checkpoint import Checkpoint, expected_drafter_tensors
from ..config import DrafterConfig
from ..dist import SingleRank
from ..kernels import attention as attn_k
from ..kernels import gemm as gemm_k
from ..kernels import layers as layers_k
from ..kernels.checks import check_array
from ..kernels.kv_cache import drafter_kv_append
from ..reference.drafter import drafter_weight_shapes, rope_inv_freq

HEAD_DIM = 128            # the drafter attention / cache kernels are built for head_dim 128
GEMM_MAX_T = gemm_k.MAX_T


def _check_supported(cfg: DrafterConfig, tp_size: int) -> None:
    """Raise ValueError for a drafter shape the kernels cannot run (named field, found value)."""
    cfg.validate_tp(tp_size)
    if cfg.head_dim != HEAD_DIM:
        raise ValueError(f"{cfg.source}: head_dim must be {HEAD_DIM} for the GPU drafter kernels, got {cfg.head_dim}")
    hq, hkv = cfg.num_attention_heads // tp_size, cfg.num_key_value_heads // tp_size
    if cfg.block_size * (hq // hkv) > attn_k.DRAFTER_MAX_PACKED:
        raise ValueError(f"{cfg.source}: block_size x query heads per kv head = {cfg.block_size} x {hq // hkv} "
                         f"exceeds the drafter attention kernel's {attn_k.DRAFTER_MAX_PACKED} packed rows")
    for name, v in (("hidden_size", cfg.hidden_size), ("intermediate_size / tp", cfg.intermediate_size // tp_size),
                    ("num_context_features * hidden_size / tp", cfg.num_context_features * cfg.hidden_size // tp_size)):
        if v % gemm_k.BK:
            raise ValueError(f"{cfg.source}: {name} = {v} must be a multiple of {gemm_k.BK} (GEMM K tile)")
    if (cfg.num_context_features * cfg.hidden_size) % tp_size:
        raise ValueError(f"{cfg.source}: fc input width not divisible by the tensor-parallel size {tp_size}")
    if cfg.hidden_size > layers_k.NORM_MAX_H:
        raise ValueError(f"{cfg.source}: hidden_size {cfg.hidden_size} exceeds the RMSNorm kernel's {layers_k.NORM_MAX_H}")
    if (cfg.vocab_size // tp_size) % 16:
        raise ValueError(f"{cfg.source}: vocab_size / tp = {cfg.vocab_size // tp_size} must be a multiple of 16")


# --------------------------------------------------------------------------------------------------
# weights

@dataclass
class GpuDrafterWeights:
    """One rank's drafter weights (bf16 as uint16 CuPy arrays). Layout: module docstring."""
    cfg: DrafterConfig
    tp_rank: int
    tp_size: int
    fc: object                 # [H, n_feat * H / tp]   (columns rank * W/tp .. of the full fc)
    hidden_norm: object        # [H]
    norm: object               # [H]
    ctx_kv: object             # [L, 2 * Hkv_local * 128, H]: layer l's k heads then its v heads
    input_norm: List[object]   # L x [H]
    qkv: List[object]          # L x [(Hq + 2 Hkv) * 128, H]: q heads, k heads, v heads
    q_norm: List[object]       # L x [128]
    k_norm: List[object]       # L x [128]
    o_proj: List[object]       # L x [H, Hq * 128]
    post_norm: List[object]    # L x [H]
    gate_up: List[object]      # L x [2 F, H]: gate rows then up rows (silu_mul's [gate | up])
    down: List[object]         # L x [H, F]

    @property
    def nbytes(self) -> int:
        arrs = [self.fc, self.hidden_norm, self.norm, self.ctx_kv]
        for lst in (self.input_norm, self.qkv, self.q_norm, self.k_norm, self.o_proj, self.post_norm,
                    self.gate_up, self.down):
            arrs += lst
        return int(sum(a.nbytes for a in arrs))

    @staticmethod
    def _assemble(cfg: DrafterConfig, tp_rank: int, tp_size: int, get) -> "GpuDrafterWeights":
        """Fuse the per-name host/device arrays returned by ``get(name)`` (this rank's shard, uint16)."""
        import cupy as cp
        L = cfg.num_hidden_layers
        dev = lambda a: cp.ascontiguousarray(cp.asarray(a, dtype=cp.uint16))
        cat = lambda parts: cp.concatenate([cp.asarray(p, dtype=cp.uint16) for p in parts], axis=0)
        a = "self_attn."
        qkv, ctx_kv = [], []
        for l in range(L):
            p = f"layers.{l}."
            k, v = get(p + a + "k_proj.weight"), get(p + a + "v_proj.weight")
            qkv.append(cat([get(p + a + "q_proj.weight"), k, v]))
            ctx_kv.append(cat([k, v]))
        w = GpuDrafterWeights(
            cfg=cfg, tp_rank=tp_rank, tp_size=tp_size,
            fc=dev(get("fc.weight")), hidden_norm=dev(get("hidden_norm.weight")), norm=dev(get("norm.weight")),
            ctx_kv=cp.ascontiguousarray(cp.stack(ctx_kv)),
            input_norm=[dev(get(f"layers.{l}.input_layernorm.weight")) for l in range(L)],
            qkv=qkv,
            q_norm=[dev(get(f"layers.{l}.{a}q_norm.weight")) for l in range(L)],
            k_norm=[dev(get(f"layers.{l}.{a}k_norm.weight")) for l in range(L)],
            o_proj=[dev(get(f"layers.{l}.{a}o_proj.weight")) for l in range(L)],
            post_norm=[dev(get(f"layers.{l}.post_attention_layernorm.weight")) for l in range(L)],
            gate_up=[cat([get(f"layers.{l}.mlp.gate_proj.weight"), get(f"layers.{l}.mlp.up_proj.weight")])
                     for l in range(L)],
            down=[dev(get(f"layers.{l}.mlp.down_proj.weight")) for l in range(L)])
        w.check()
        return w

    def check(self) -> None:
        """Every tensor has this rank's expected shape and dtype (ValueError naming the first that does not)."""
        c, tp = self.cfg, self.tp_size
        H, hd, L = c.hidden_size, c.head_dim, c.num_hidden_layers
        hq, hkv, F = c.num_attention_heads // tp, c.num_key_value_heads // tp, c.intermediate_size // tp
        want = {"fc": (self.fc, (H, c.num_context_features * H // tp)), "hidden_norm": (self.hidden_norm, (H,)),
                "norm": (self.norm, (H,)), "ctx_kv": (self.ctx_kv, (L, 2 * hkv * hd, H))}
        per = {"input_norm": (H,), "qkv": ((hq + 2 * hkv) * hd, H), "q_norm": (hd,), "k_norm": (hd,),
               "o_proj": (H, hq * hd), "post_norm": (H,), "gate_up": (2 * F, H), "down": (H, F)}
        for name, shape in per.items():
            lst = getattr(self, name)
            if len(lst) != L:
                raise ValueError(f"GpuDrafterWeights.{name}: {len(lst)} layers, expected {L}")
            for l, arr in enumerate(lst):
                want[f"{name}[{l}]"] = (arr, shape)
        for name, (arr, shape) in want.items():
            check_array(f"GpuDrafterWeights.{name}", arr, np.uint16, shape)

    @staticmethod
    def from_checkpoint(drafter_dir: str, dcfg: Optional[DrafterConfig] = None, tp_rank: int = 0,
                        tp_size: int = 1, progress=False) -> "GpuDrafterWeights":
        """Read only this rank's shard of a DFlash drafter checkpoint (bf16) and fuse it on the device."""
        dcfg = dcfg or DrafterConfig.load(drafter_dir)
        _check_supported(dcfg, tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank: must be in [0, {tp_size}), got {tp_rank}")
        with Checkpoint(drafter_dir, prefix="", progress=progress) as ck:
            ck.validate(expected_drafter_tensors(dcfg))

            def get(name: str):
                if name == "fc.weight":
                    # the checkpoint's TP plan replicates fc; the GPU drafter splits its input columns
                    return ck.get(name, "BF16", tp_rank, tp_size, dim=1 if tp_size > 1 else None)
                return ck.get_shard(name, tp_rank, tp_size, dtype="BF16")

            w = GpuDrafterWeights._assemble(dcfg, tp_rank, tp_size, get)
            ck.report()
        return w

    @staticmethod
    def random(dcfg: DrafterConfig, tp_rank: int = 0, tp_size: int = 1, seed: int = 0,
               norm_jitter: float = 0.1) -> "GpuDrafterWeights":
        """Random rank-shaped weights generated on the GPU (benchmarks at the real size: no host copy).
        Linear weights ~ N(0, 1/fan_in) of the FULL layer (activations stay O(1)), norms 1 + jitter."""
        import cupy as cp
        _check_supported(dcfg, tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank: must be in [0, {tp_size}), got {tp_rank}")
        rng = cp.random.default_rng(seed * 1000003 + tp_rank)
        full_in = {"fc.weight": dcfg.num_context_features * dcfg.hidden_size,
                   "o_proj": dcfg.num_attention_heads * dcfg.head_dim, "down_proj": dcfg.intermediate_size}
        shapes = dict(drafter_weight_shapes(dcfg, tp_size))
        shapes["fc.weight"] = (dcfg.hidden_size, dcfg.num_context_features * dcfg.hidden_size // tp_size)

        def get(name: str):
            shape = shapes[name]
            if len(shape) == 1:
                x = 1.0 + norm_jitter * rng.standard_normal(shape, dtype=cp.float32)
            else:
                fan = next((v for k, v in full_in.items() if k in name), shape[1])
                x = rng.standard_normal(shape, dtype=cp.float32) * np.float32(1.0 / math.sqrt(fan))
            return f32_to_bf16_bits_gpu(x)

        return GpuDrafterWeights._assemble(dcfg, tp_rank, tp_size, get)


def f32_to_bf16_bits_gpu(x):
    """float32 CuPy array -> uint16 bf16 bits, round to nearest even (finite inputs), as bf16.to_bf16_bits."""
    import cupy as cp
    u = cp.ascontiguousarray(x, dtype=cp.float32).view(cp.uint32)
    return ((u + cp.uint32(0x7FFF) + ((u >> cp.uint32(16)) & cp.uint32(1))) >> cp.uint32(16)).astype(cp.uint16)


# --------------------------------------------------------------------------------------------------
# the drafter

class GpuDrafter:
    """DFlash drafter of one tensor-parallel rank: context cache + block draft (see the module docstring).

    target: provides ``embed(ids int32 [T], out uint16 [T, H])`` (vocabulary-parallel lookup, summed over
            ranks) and ``project_vocab(x uint16 [T, H], out float32 [T, V/tp])`` (this rank's logit columns).
    comm:   the tensor-parallel communicator (``dist``); ``all_reduce`` sums bf16 buffers in place.
    max_streams S: stream slots; max_ctx: ring slots per stream (>= the longest context when no
            ``draft_window`` is set, >= the window otherwise; raised to max_append if smaller: C);
            max_append: rows per ``append_context``.
    """

    def __init__(self, dcfg: DrafterConfig, weights: GpuDrafterWeights, target, comm=None, max_streams: int = 1,
                 max_ctx: int = 4096, max_append: int = 64):
        import cupy as cp
        self.comm = comm if comm is not None else SingleRank()
        tp = self.comm.size
        _check_supported(dcfg, tp)
        if weights.tp_size != tp or weights.tp_rank != self.comm.rank:
            raise ValueError(f"weights: shard of rank {weights.tp_rank}/{weights.tp_size}, but the communicator is "
                             f"rank {self.comm.rank}/{tp}")
        for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "target_layer_ids"):
            if getattr(weights.cfg, f) != getattr(dcfg, f):
                raise ValueError(f"weights: built for {f} = {getattr(weights.cfg, f)}, config has {getattr(dcfg, f)}")
        weights.check()
        for name in ("max_streams", "max_ctx", "max_append"):
            v = locals()[name]
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        W = dcfg.draft_window
        if W is not None and W > max_ctx:
            raise ValueError(f"max_ctx: the ring ({max_ctx} slots) must hold the draft window ({W} positions)")
        for m in ("embed", "project_vocab"):
            if not callable(getattr(target, m, None)):
                raise ValueError(f"target: has no {m}(...) method (GpuTarget provides embed / project_vocab)")
        self.cfg, self.w, self.target = dcfg, weights, target
        # Ring slots: max_ctx, but at least max_append. One call's rows of a stream are written in parallel,
        # in no order, so they must land in distinct slots: consecutive positions are distinct mod C when
        # there are at most C of them.
        self.S, self.C, self.N_max = int(max_streams), max(int(max_ctx), int(max_append)), int(max_append)
        self.window = 0 if W is None else int(W)
        c = dcfg
        self.L, self.H, self.bs = c.num_hidden_layers, c.hidden_size, c.block_size
        self.D = self.bs - 1
        self.hq, self.hkv = c.num_attention_heads // tp, c.num_key_value_heads // tp
        self.F = c.intermediate_size // tp
        self.V_local = c.vocab_size // tp
        self.n_feat = c.num_context_features
        self.fc_cols = self.n_feat * self.H // tp
        self.eps = float(c.rms_norm_eps)
        self.scale = float(c.head_dim) ** -0.5
        self.amplitude = float(c.effective_rope_amplitude)
        self.inv_freq = cp.asarray(np.asarray(rope_inv_freq(c.rope, c.head_dim), dtype=np.float32))

        S, C, N, bs, H, hd = self.S, self.C, self.N_max, self.bs, self.H, HEAD_DIM
        T = S * bs
        u16 = cp.uint16
        # context cache: zeros (never NaN), so a slot that was never written reads as harmless numbers
        self.k_cache = [cp.zeros((S, C, self.hkv, hd), u16) for _ in range(self.L)]
        self.v_cache = [cp.zeros((S, C, self.hkv, hd), u16) for _ in range(self.L)]
        # append_context buffers
        self._ctx_pre = cp.empty((N, H), u16)
        self._ctx = cp.empty((N, H), u16)
        self._kv_flat = cp.empty(self.L * 2 * self.hkv * N * hd, u16)    # viewed [L*2*Hkv, n, 128] per call
        self._k_rows = cp.empty((N, self.hkv, hd), u16)
        self._v_rows = cp.empty((N, self.hkv, hd), u16)
        # draft buffers
        ids = np.full((S, bs), c.mask_token_id, np.int32)
        self._ids = cp.asarray(ids)                                      # column 0 = bonus, rewritten per call
        self._jpos = cp.arange(bs, dtype=cp.int32)
        self._pos = cp.empty((S, bs), cp.int32)
        self._h = cp.empty((T, H), u16)                                  # bf16 residual stream
        self._x = cp.empty((T, H), u16)                                  # normed layer input
        self._qkv_flat = cp.empty((self.hq + 2 * self.hkv) * T * hd, u16)  # viewed [Hq+2Hkv, T, 128]
        self._q = cp.empty((S, bs, self.hq, hd), u16)
        self._kb = cp.empty((S, bs, self.hkv, hd), u16)
        self._vb = cp.empty((S, bs, self.hkv, hd), u16)
        self._att = cp.empty((S, bs, self.hq, hd), u16)
        self._o = cp.empty((T, H), u16)
        self._gu = cp.empty((T, 2 * self.F), u16)
        self._act = cp.empty((T, self.F), u16)
        self._dn = cp.empty((T, H), u16)
        self._persist = {}                     # (layer, T) -> persistent MLP segment (kernels/persistent.py)
        # final norm scatters block row j >= 1 of slot s to row s*D + j - 1; rows j = 0 go to a spare row
        rows = np.empty((S, bs), np.int32)
        rows[:, 0] = S * self.D
        rows[:, 1:] = np.arange(S)[:, None] * self.D + np.arange(self.D)[None, :]
        self._final_rows = cp.asarray(rows.reshape(-1))
        self._xf = cp.empty((S * self.D + 1, H), u16)
        # split-K partials of every GEMM this drafter launches (sized for the largest), one shared buffer
        self._gemm_ws = cp.empty(max(self._gemm_workspace_elems(), 1), cp.float32)
        self._attn_ws: Dict[int, Optional[attn_k.DrafterWorkspace]] = {}
        self._attn_workspace(S)

    # ---- sizing -----------------------------------------------------------------------------------
    def _gemm_shapes(self):
        """(max rows per launch, N, K, batch) of every GEMM: rows are chunked to the kernel's MAX_T."""
        na, nd = min(self.N_max, GEMM_MAX_T), min(self.S * self.bs, GEMM_MAX_T)
        return [(na, self.H, self.fc_cols, 1), (na, HEAD_DIM, self.H, self.L * 2 * self.hkv),
                (nd, HEAD_DIM, self.H, self.hq + 2 * self.hkv), (nd, self.H, self.hq * HEAD_DIM, 1),
                (nd, 2 * self.F, self.H, 1), (nd, self.H, self.F, 1)]

    def _gemm_workspace_elems(self) -> int:
        import cupy as cp
        sms, smem = cp.cuda.Device().attributes["MultiProcessorCount"], gemm_k._smem_per_sm()
        need = 0
        for tmax, n, k, b in self._gemm_shapes():
            for t in range(1, tmax + 1):     # the split depends on the row count: take the worst one
                split = gemm_k.workspace_split(t, n, k, b, sms, smem)
                if split > 1:
                    need = max(need, b * split * t * n)
        return need

    def _attn_workspace(self, S: int):
        """The split-KV workspace for S active slots (allocated on the first call with that S)."""
        if S not in self._attn_ws:
            import cupy as cp
            if getattr(cp.cuda.get_current_stream(), "is_capturing", lambda: False)():
                raise ValueError(f"draft: first call with {S} stream slots during graph capture; run it once eagerly")
            read = min(self.C, self.window) if self.window else self.C
            sms = cp.cuda.Device().attributes["MultiProcessorCount"]
            n = attn_k.drafter_num_splits(S, self.hkv, read, self.bs, sms)
            self._attn_ws[S] = attn_k.DrafterWorkspace(n, S, self.bs, self.hq) if n > 1 else None
        return self._attn_ws[S]

    @property
    def cache_nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.k_cache + self.v_cache))

    # ---- helpers ----------------------------------------------------------------------------------
    def _gemm(self, x, w, out, out_dtype=np.uint16):
        """gemm_bf16 over row chunks of at most MAX_T (x / out: [T, .] or [B, T, .] views)."""
        T = x.shape[-2]
        for t0 in range(0, T, GEMM_MAX_T):
            t1 = min(T, t0 + GEMM_MAX_T)
            sl = (Ellipsis, slice(t0, t1), slice(None))
            gemm_k.gemm_bf16(x[sl], w, out[sl], out_dtype=out_dtype, workspace=self._gemm_ws)

    def _heads_gemm(self, x, w_heads, flat, n_heads: int, rows: int):
        """Per-head products of x [rows, H] with w_heads [n_heads * 128, H] into a head-major
        [n_heads, rows, 128] view of ``flat``: one batched launch, x broadcast over the batch."""
        import cupy as cp
        out = flat[:n_heads * rows * HEAD_DIM].reshape(n_heads, rows, HEAD_DIM)
        xb = cp.broadcast_to(x[None], (n_heads, rows, x.shape[1]))      # batch stride 0
        self._gemm(xb, w_heads.reshape(n_heads, HEAD_DIM, x.shape[1]), out)
        return out

    def _norm_rope_heads(self, heads, norm_w, positions, out, norm_w2=None, out2=None):
        """Per-head RMSNorm + NeoX RoPE at ``positions`` of head-major heads [n, T, 128] into token-major
        out [T, n_a, 128] (norm_w) and out2 [T, n - n_a, 128] (norm_w2): ONE launch (layers.head_norm_rope;
        the q and k heads of a draft layer together)."""
        layers_k.head_norm_rope(heads, self.eps, positions, self.inv_freq, self.amplitude, norm_w, out, norm_w2, out2)

    def _copy_heads(self, heads, out):
        """A head-major [n, T, 128] block into token-major out [T, n, 128] (the layout the kernels read)."""
        import cupy as cp
        cp.copyto(out, heads.transpose(1, 0, 2))

    # ---- context ----------------------------------------------------------------------------------
    def append_context(self, feats, stream_ids, positions) -> None:
        """Append committed tokens: row i (target features feats[i] [n_feat, H], bf16) becomes stream
        ``stream_ids[i]``'s context at absolute position ``positions[i]`` (slot p % C) in every layer.
        Rows with position -1 are padding: computed, never written. Positions of a stream must continue
        its context (0, 1, 2, ... in commit order) for draft's ctx_len to describe it (C >= max_append
        keeps one call's rows of a stream in distinct ring slots)."""
        import cupy as cp
        dims: dict = {}
        dev = cp.cuda.Device().id
        check_array("feats", feats, np.uint16, ("N", self.n_feat, self.H), dims, device=dev)
        check_array("stream_ids", stream_ids, np.int32, ("N",), dims, device=dev)
        check_array("positions", positions, np.int32, ("N",), dims, device=dev)
        N = dims["N"]
        if N > self.N_max:
            raise ValueError(f"feats: {N} rows exceed max_append = {self.N_max}")
        if N == 0:
            return
        x = feats.reshape(N, self.n_feat * self.H)
        if self.comm.size > 1:      # this rank's fc input columns; partial sums are all-reduced
            r = self.comm.rank
            x = x[:, r * self.fc_cols:(r + 1) * self.fc_cols]
        pre, ctx = self._ctx_pre[:N], self._ctx[:N]
        self._gemm(x, self.w.fc, pre)
        if self.comm.size > 1:
            self.comm.all_reduce(pre)
        layers_k.rms_norm(pre, self.w.hidden_norm, self.eps, out=ctx)
        hkv = self.hkv
        kv = self._heads_gemm(ctx, self.w.ctx_kv, self._kv_flat, self.L * 2 * hkv, N)   # [L*2Hkv, N, 128]
        k_rows = self._k_rows[:N]
        for l in range(self.L):
            base = l * 2 * hkv
            self._norm_rope_heads(kv[base:base + hkv], self.w.k_norm[l], positions, k_rows)
            v = kv[base + hkv:base + 2 * hkv]
            if hkv == 1:
                v_rows = v.reshape(N, 1, HEAD_DIM)       # head-major == token-major for one head
            else:
                v_rows = self._v_rows[:N]
                self._copy_heads(v, v_rows)
            drafter_kv_append(self.k_cache[l], self.v_cache[l], k_rows, v_rows, stream_ids, positions)

    def _reduce_add_norm(self, part, h, weight, out) -> None:
        """part = sum over ranks; h += part (bf16); out = RMSNorm(weight) of h. One launch where the
        communicator fuses them (the P2P all-reduce, comm/custom.py), else all-reduce + rms_norm."""
        if self.comm.size > 1 and hasattr(self.comm, "all_reduce_add_norm"):
            self.comm.all_reduce_add_norm(part, h, weight, self.eps, out)
            return
        self.comm.all_reduce(part)
        layers_k.rms_norm(part, weight, self.eps, out=out, residual=h)

    # ---- draft ------------------------------------------------------------------------------------
    def _persistent_mlp(self, l: int, T: int):
        """Layer l's MLP half at T rows as a persistent segment (kernels/persistent.py), built on first use
        (not inside a capture: it uploads the schedule)."""
        from ..kernels import persistent
        seg = self._persist.get((l, T))
        if seg is None:
            import cupy as cp
            if getattr(cp.cuda.get_current_stream(), "is_capturing", lambda: False)():
                raise ValueError("GpuDrafter.draft: first persistent MLP call for this row count inside graph "
                                 "capture; run it once eagerly first (it uploads the schedule)")
            seg = persistent.dense_mlp_segment(
                T, attn=self._o[:T], h=self._h[:T], post_norm_w=self.w.post_norm[l], eps=float(self.eps),
                w_gate_up=self.w.gate_up[l], w_down=self.w.down[l], normed=self._x[:T], act=self._act[:T],
                out=self._dn[:T])
            self._persist[(l, T)] = seg
        return seg

    def draft(self, bonus, start_pos, ctx_len, out):
        """Draft one block per stream slot b < S: ids [bonus[b], MASK x (bs-1)] at positions
        start_pos[b] + j over the context positions [0, ctx_len[b]) (the last ``draft_window`` of them
        if set). Writes out float32 [S, bs-1, V/tp] (depth d at out[b, d-1], this rank's vocabulary
        columns) and returns it. An idle slot: any bonus, ctx_len 0 (it reads and writes only its own rows)."""
        import cupy as cp
        dims: dict = {}
        dev = cp.cuda.Device().id
        check_array("bonus", bonus, np.int32, ("S",), dims, device=dev)
        check_array("start_pos", start_pos, np.int32, ("S",), dims, device=dev)
        check_array("ctx_len", ctx_len, np.int32, ("S",), dims, device=dev)
        check_array("out", out, np.float32, ("S", self.D, self.V_local), dims, device=dev)
        S = dims["S"]
        if S > self.S:
            raise ValueError(f"bonus: {S} stream slots exceed max_streams = {self.S}")
        ws = self._attn_workspace(S)
        bs, hq, hkv, L = self.bs, self.hq, self.hkv, self.L
        T = S * bs
        ids, pos = self._ids[:S], self._pos[:S]
        cp.copyto(ids[:, 0], bonus)
        cp.add(start_pos[:, None], self._jpos[None, :], out=pos)
        pos_t = pos.reshape(T)
        from ..kernels import persistent
        h, x, o, dn = self._h[:T], self._x[:T], self._o[:T], self._dn[:T]
        q, kb, att = self._q[:S], self._kb[:S], self._att[:S]
        vb = self._vb[:S]
        self.target.embed(ids.reshape(T), h)
        layers_k.rms_norm(h, self.w.input_norm[0], self.eps, out=x)
        for l in range(L):
            qkv = self._heads_gemm(x, self.w.qkv[l], self._qkv_flat, hq + 2 * hkv, T)    # [Hq+2Hkv, T, 128]
            # q and k heads (adjacent in the GEMM output): per-head norm + RoPE in one launch
            self._norm_rope_heads(qkv[:hq + hkv], self.w.q_norm[l], pos_t, q.reshape(T, hq, HEAD_DIM),
                                  self.w.k_norm[l], kb.reshape(T, hkv, HEAD_DIM))
            if hkv == 1:
                v_blk = qkv[hq + 1:hq + 2].reshape(S, bs, 1, HEAD_DIM)
            else:
                self._copy_heads(qkv[hq + hkv:], vb.reshape(T, hkv, HEAD_DIM))
                v_blk = vb
            attn_k.drafter_attention(q, kb, v_blk, self.k_cache[l][:S], self.v_cache[l][:S], ctx_len,
                                     softmax_scale=self.scale, max_ctx_len=self.C, window=self.window,
                                     out=att, workspace=ws, num_splits=ws.num_splits if ws else 1)
            self._gemm(att.reshape(T, hq * HEAD_DIM), self.w.o_proj[l], o)
            if persistent.mlp_enabled() and T <= persistent.MAX_T:
                self.comm.all_reduce(o)
                self._persistent_mlp(l, T).launch()      # h += o, post norm, gate/up, SwiGLU, down: one launch
            else:
                # h += o (rounded to bf16, the residual stream's type); x = post_attention_norm(h)
                self._reduce_add_norm(o, h, self.w.post_norm[l], x)
                gu = self._gu[:T]
                self._gemm(x, self.w.gate_up[l], gu)
                layers_k.silu_mul(gu, out=self._act[:T])
                self._gemm(self._act[:T], self.w.down[l], dn)
            if l + 1 < L:
                self._reduce_add_norm(dn, h, self.w.input_norm[l + 1], x)
            else:   # final norm, block rows 1..bs-1 scattered to [S * D] rows (row 0 to the spare row)
                self.comm.all_reduce(dn)
                layers_k.rms_norm(dn, self.w.norm, self.eps, out=self._xf, residual=h,
                                  out_rows=self._final_rows[:T])
        xf = self._xf[:S * self.D]
        logits = out.reshape(S * self.D, self.V_local)
        for t0 in range(0, S * self.D, GEMM_MAX_T):
            t1 = min(S * self.D, t0 + GEMM_MAX_T)
            self.target.project_vocab(xf[t0:t1], logits[t0:t1])
        return out
