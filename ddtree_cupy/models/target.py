"""``GpuTarget``: the Kimi K2 / DeepSeek-V3 target forward on the GPU, one tensor-parallel rank.

Per layer (shapes for T rows, this rank's nh heads; docs/MODELS.md has the full table):

    normed = rms_norm(mlp_out_prev + h)               fused residual add: h += mlp_out_prev (layer 0: rms_norm(h))
    qkv_a  = normed @ w_qkv_a^T                       [T, q_lora + 576]  (q_a_proj | kv_a_proj_with_mqa)
    c_q    = rms_norm(qkv_a[:, :q_lora])              [T, q_lora]
    latent = rms_norm(qkv_a[:, q_lora:+512]) | rope(qkv_a[:, -64:])   [T, 576] -> the cache at kv_pos
             (c_q and latent: ONE fused launch, kernels/fused.mla_qkv_a_post)
    q      = c_q @ w_q_b^T                            [T, nh, 192]
    q_full = (q_nope @ W_UK) | rope(q_pe)             [T, nh, 576]  (ONE launch: fused.mla_head_gemm + rope)
    o_lat  = mla_attention(q_full, pool, ...)         [T, nh, 512]  (tree mask or causal, paged cache)
    o      = o_lat @ W_UV^T                           [T, nh * 128] (fused.mla_head_gemm)
    attn   = all_reduce(o @ w_o^T)                    [T, H]
    normed = rms_norm(attn + h)                       fused: h += attn
    mlp    = all_reduce(dense SwiGLU | MoE(routed) + shared expert)   [T, H]
             (MoE: ONE fp32 GEMM for the router logits and the shared expert's gate|up, then the router
             top-k + the shared SwiGLU in one launch)
    (feature layers: h after the next fused add is copied into batch.features)
    final: normed = rms_norm(mlp + h); logits = normed @ lm_head^T (fp32) into batch.logits [T, V / tp]

Everything is enqueued on the current CuPy stream into buffers allocated at construction (``max_tokens``
rows) or, for the attention split partials, on the first forward of a batch shape; a forward after that
allocates nothing and never synchronises, so it can be captured in a CUDA graph.

Tensor parallelism: heads, FFN widths and the vocabulary are split (checkpoint.tp_split); the latent KV is
replicated. Two all-reduces per layer: after o_proj, after the MLP (routed + shared in one), plus one for the
vocabulary-parallel embedding. A communicator with ``all_reduce_add_norm`` (the P2P all-reduce, comm/custom.py)
folds the residual add and the next RMSNorm into each layer all-reduce (``fuses_norms``). ``attention_block`` / ``mlp_block`` with ``reduce=False``
return the rank's partial sums (tests of the TP split on one GPU).
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import numpy as np

from ..config import TargetConfig
from .batch import TargetBatch
from .kv import GpuLatentCache
from .weights import LATENT, ROPE, ROW, GpuTargetWeights, local_dims

GEMM_MAX_T = 160          # kernels/gemm.py MAX_T: longer row counts are issued in chunks


def _chunks(T: int):
    for t0 in range(0, T, GEMM_MAX_T):
        yield t0, min(T, t0 + GEMM_MAX_T)


class GpuTarget:
    def __init__(self, cfg: TargetConfig, weights: GpuTargetWeights, comm=None, max_tokens: int = 256,
                 feature_layers: Sequence[int] = ()):
        import cupy
        from ..dist import SingleRank
        from ..kernels import gemm as gemm_mod
        from ..kernels.moe import MoEWorkspace
        from ..reference.rope import yarn_inv_freq
        if not isinstance(cfg, TargetConfig):
            raise ValueError(f"GpuTarget: cfg must be a TargetConfig, got {type(cfg).__name__}")
        if not isinstance(weights, GpuTargetWeights):
            raise ValueError(f"GpuTarget: weights must be GpuTargetWeights, got {type(weights).__name__}")
        self.comm = comm if comm is not None else SingleRank()
        if (self.comm.rank, self.comm.size) != (weights.tp_rank, weights.tp_size):
            raise ValueError(f"GpuTarget: weights are rank {weights.tp_rank} of {weights.tp_size}, the communicator "
                             f"is rank {self.comm.rank} of {self.comm.size}")
        if not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise ValueError(f"GpuTarget: max_tokens must be a positive integer, got {max_tokens!r}")
        feature_layers = tuple(int(f) for f in feature_layers)
        bad = [f for f in feature_layers if not 0 <= f < cfg.num_hidden_layers]
        if bad or len(set(feature_layers)) != len(feature_layers):
            raise ValueError(f"GpuTarget: feature_layers {list(feature_layers)} must be distinct layers in "
                             f"[0, {cfg.num_hidden_layers})")
        self.cfg, self.w = cfg, weights
        self.tp_rank, self.tp_size = weights.tp_rank, weights.tp_size
        self.d = d = local_dims(cfg, self.tp_size)
        self.max_tokens = int(max_tokens)
        self.feature_layers = feature_layers
        self._feat_index = {layer: c for c, layer in enumerate(feature_layers)}
        self.inv_freq = cupy.asarray(yarn_inv_freq(cfg.rope, ROPE).astype(np.float32))
        self.amplitude = float(cfg.rope.amplitude)
        self.softmax_scale = float(cfg.softmax_scale)

        Tm, H, nh, ql = self.max_tokens, d["H"], d["nh"], d["ql"]
        u16 = np.uint16
        z = lambda *s: cupy.zeros(s, u16)     # noqa: E731  zero-filled: rows never written stay finite
        self.h = z(Tm, H)                    # residual stream
        self.normed = z(Tm, H)
        self.qkv_a = z(Tm, ql + ROW)
        self.c_q = z(Tm, ql)
        self.q = z(Tm, nh * (d["dn"] + ROPE))
        self.q_full = z(Tm, nh, ROW)
        self.o_lat = z(Tm, nh, LATENT)
        self.o = z(Tm, nh * d["dv"])
        self.attn_out = z(Tm, H)
        self.mlp_out = z(Tm, H)
        ffn = max(d["F"] if any(not L.is_moe for L in weights.layers) else 0,
                  d["Is"] if any(L.is_moe and L.w_shared_gate_up is not None for L in weights.layers) else 0, 8)
        self.gate_up = z(Tm, 2 * max(d["F"] if any(not L.is_moe for L in weights.layers) else 0, 8))  # dense
        self.act = z(Tm, ffn)
        self.shared_out = z(Tm, H)
        moe_layers = [L for L in weights.layers if L.is_moe]
        for L in moe_layers:            # router | shared gate_up as one weight (no-op for the loaders' weights)
            L.fuse_router_shared()
        if moe_layers:
            k = cfg.num_experts_per_tok
            # fp32 [router logits E | shared gate Is | shared up Is]: the fused GEMM's output
            self.router_logits = cupy.zeros((Tm, max(L.w_router.shape[0] + (0 if L.w_shared_gate_up is None else
                                                     L.w_shared_gate_up.shape[0]) for L in moe_layers)), np.float32)
            self.topk_ids = cupy.zeros((Tm, k), np.int32)
            self.topk_w = cupy.zeros((Tm, k), np.float32)
            self.moe_ws = MoEWorkspace(Tm, k, moe_layers[0].experts)   # same (E, H, I) in every MoE layer
        else:
            self.moe_ws = None
        # Split-K partials of every GEMM this model issues (one stream: one buffer serves them all).
        sm, smem = gemm_mod._sm_count(), gemm_mod._smem_per_sm()
        need = 0
        shapes = self._gemm_shapes()
        for t in range(1, min(Tm, GEMM_MAX_T) + 1):
            for B, N, K in shapes:
                need = max(need, B * gemm_mod.workspace_split(t, N, K, B, sm, smem) * t * N)
        for t in range(1, GEMM_MAX_T + 1):          # project_vocab (drafter) may run up to 160 rows per chunk
            need = max(need, gemm_mod.workspace_split(t, d["V"], H, 1, sm, smem) * t * d["V"])
        self.gemm_ws = cupy.empty(max(need, 1), np.float32)
        self._mla_ws: Dict[Tuple[int, int, int, int], object] = {}
        self._persist: Dict[Tuple[int, int], object] = {}     # (layer, T) -> persistent MLP segment

    # ---- sizes ----------------------------------------------------------------------------------------
    def _gemm_shapes(self):
        d, cfg = self.d, self.cfg
        H, nh, ql = d["H"], d["nh"], d["ql"]
        s = [(1, ql + ROW, H), (1, nh * (d["dn"] + ROPE), ql), (1, H, nh * d["dv"]), (1, d["V"], H)]
        for L in self.w.layers:
            if L.is_moe:
                if L.w_shared_gate_up is not None:
                    s += [(1, d["E"] + 2 * d["Is"], H), (1, H, d["Is"])]
                else:
                    s.append((1, d["E"], H))
            else:
                s += [(1, 2 * d["F"], H), (1, H, d["F"])]
        return sorted(set(s))

    def workspace_bytes(self) -> int:
        """Device bytes of the activation buffers and workspaces (not the weights, not the KV cache)."""
        arrs = [self.h, self.normed, self.qkv_a, self.c_q, self.q, self.q_full, self.o_lat, self.o,
                self.attn_out, self.mlp_out, self.gate_up, self.act, self.shared_out, self.gemm_ws]
        n = sum(int(a.nbytes) for a in arrs)
        if self.moe_ws is not None:
            n += int(self.router_logits.nbytes + self.topk_ids.nbytes + self.topk_w.nbytes)
            n += self.moe_ws.nbytes()
        for ws in self._mla_ws.values():
            if ws is not None:
                n += int(ws.part_o.nbytes + ws.part_lse.nbytes)
        return n

    # ---- GEMM with row chunking ---------------------------------------------------------------------
    def _gemm(self, x, w, out, out_dtype=np.uint16):
        """out = x @ w^T over the row axis (-2) in chunks of <= 160 rows (the GEMM kernel's token limit)."""
        from ..kernels.gemm import gemm_bf16
        T = x.shape[-2]
        for t0, t1 in _chunks(T):
            if x.ndim == 2:
                gemm_bf16(x[t0:t1], w, out[t0:t1], out_dtype=out_dtype, workspace=self.gemm_ws)
            else:
                gemm_bf16(x[:, t0:t1], w, out[:, t0:t1], out_dtype=out_dtype, workspace=self.gemm_ws)
        return out

    # ---- vocabulary-parallel pieces (also used by the drafter) --------------------------------------
    def embed(self, ids, out, reduce: bool = True):
        """out uint16 [N, H] = embedding rows of ids int32 [N] (vocabulary-parallel: zeros outside this rank's
        slice, then an all-reduce)."""
        from ..kernels.layers import embed
        embed(ids, self.w.embed, self.w.vocab_start, out)
        if reduce:
            self.comm.all_reduce(out)
        return out

    def project_vocab(self, x, out):
        """out float32 [N, V / tp] = x @ lm_head_slice^T for normed x uint16 [N, H] (this rank's slice)."""
        return self._gemm(x, self.w.lm_head, out, out_dtype=np.float32)

    # ---- blocks ---------------------------------------------------------------------------------------
    def _mla_workspace(self, S: int, R: int, T: int, max_kv_len: int):
        from ..kernels.attention import MlaWorkspace, plan_mla
        key = (S, R, T, max_kv_len)
        if key not in self._mla_ws:
            import cupy
            if getattr(cupy.cuda.get_current_stream(), "is_capturing", lambda: False)():
                raise ValueError("GpuTarget.forward: first call for this batch shape inside graph capture; run it "
                                 "once eagerly first (it allocates the attention split workspace)")
            _, splits = plan_mla(S, R, self.d["nh"], max_kv_len)
            self._mla_ws[key] = MlaWorkspace(splits, T, self.d["nh"]) if splits > 1 else None
        return self._mla_ws[key]

    def attention_block(self, i: int, x, batch: TargetBatch, kv: GpuLatentCache, out, reduce: bool = True):
        """Layer i's MLA on normed x uint16 [T, H]: writes the T latent rows to the cache at batch.kv_pos and
        out [T, H] = o_proj output (all-reduced unless reduce=False: this rank's partial sum)."""
        for _, fn in self._attention_stages(i, x, batch, kv, out, reduce):
            fn()
        return out

    def mlp_block(self, i: int, x, out, reduce: bool = True):
        """Layer i's MLP on normed x uint16 [T, H] into out [T, H]: dense SwiGLU, or routed INT4 experts with
        the shared expert's output added in the MoE combine; one all-reduce for both (unless reduce=False)."""
        for _, fn in self._mlp_stages(i, x, out, reduce):
            fn()
        return out

    def fuses_norms(self) -> bool:
        """The communicator does the all-reduce, the residual add and the next RMSNorm in one launch
        (``comm.custom.CustomComm``): then the o_proj / MLP stages end with normed rows and the norm
        stages that follow them only copy features."""
        return self.tp_size > 1 and hasattr(self.comm, "all_reduce_add_norm")

    def next_norm_weight(self, i: int):
        """The RMSNorm weight applied right after layer i's MLP all-reduce: layer i + 1's input norm, or the
        final norm after the last layer."""
        return self.w.layers[i + 1].input_norm if i + 1 < self.cfg.num_hidden_layers else self.w.final_norm

    def layer_stages(self, i: int, batch: TargetBatch, kv: GpuLatentCache):
        """[(name, fn)]: layer i on the residual stream ``self.h`` in launch order (each fn enqueues one kernel
        or a few); ``forward`` runs them, bench/step.py also times each stage as its own graph. The input
        norm adds the previous layer's MLP output to h (layer 0: norm only) and copies h to the features
        when layer i - 1 is a feature layer. With ``fuses_norms()`` the all-reduces after o_proj and after the
        MLP do those adds and norms themselves: no post_norm stage, and input_norm only copies features."""
        from ..kernels.layers import rms_norm
        T, L, eps = batch.T, self.w.layers[i], float(self.cfg.rms_norm_eps)
        h, normed, attn, mlp = self.h[:T], self.normed[:T], self.attn_out[:T], self.mlp_out[:T]
        fused = self.fuses_norms()

        def input_norm():
            if i == 0:
                rms_norm(h, L.input_norm, eps, out=normed)
            else:
                if not fused:
                    rms_norm(mlp, L.input_norm, eps, out=normed, residual=h)     # h += previous layer's MLP
                self._copy_feature(i - 1, batch, h)
        from ..kernels import persistent
        if not fused and persistent.mlp_enabled() and not L.is_moe and T <= persistent.MAX_T:
            tail = self._persistent_mlp_stages(i, T)     # post_norm .. down as one persistent launch
            return [("input_norm", input_norm)] + self._attention_stages(i, normed, batch, kv, attn) + tail
        post = [] if fused else [("post_norm", lambda: rms_norm(attn, L.post_norm, eps, out=normed, residual=h))]
        stages = ([("input_norm", input_norm)]
                  + self._attention_stages(i, normed, batch, kv, attn, norm=(L.post_norm, h, normed) if fused else None)
                  + post   # h += attn
                  + self._mlp_stages(i, normed, mlp, norm=(self.next_norm_weight(i), h, normed) if fused else None,
                                    row_pos=batch.kv_pos[:T]))
        if fused and i > 0 and self._feat_index.get(i - 1) is None:
            stages = stages[1:]          # the input norm stage would do nothing
        return stages

    def _persistent_mlp_stages(self, i: int, T: int):
        """Dense layer i's MLP half at T rows as one persistent launch (kernels/persistent.py), then the
        all-reduce; built on first use for (i, T), like the attention workspaces (not inside a capture)."""
        from ..kernels import persistent
        seg = self._persist.get((i, T))
        if seg is None:
            import cupy
            if getattr(cupy.cuda.get_current_stream(), "is_capturing", lambda: False)():
                raise ValueError("GpuTarget.forward: first persistent MLP call for this row count inside graph "
                                 "capture; run it once eagerly first (it uploads the schedule)")
            L, F = self.w.layers[i], self.w.layers[i].w_down.shape[1]
            seg = persistent.dense_mlp_segment(
                T, attn=self.attn_out[:T], h=self.h[:T], post_norm_w=L.post_norm, eps=float(self.cfg.rms_norm_eps),
                w_gate_up=L.w_gate_up, w_down=L.w_down, normed=self.normed[:T], act=self.act[:T, :F],
                out=self.mlp_out[:T])
            self._persist[(i, T)] = seg
        mlp = self.mlp_out[:T]

        def run():
            seg.launch()
            self.comm.all_reduce(mlp)
        return [("mlp_persistent", run)]

    def _reduce(self, out, norm) -> None:
        """All-reduce ``out`` in place; with ``norm`` = (weight, h, normed) also h += out and normed = RMSNorm(h)
        in the same launch (``fuses_norms``)."""
        if norm is None:
            self.comm.all_reduce(out)
        else:
            w, h, normed = norm
            self.comm.all_reduce_add_norm(out, h, w, float(self.cfg.rms_norm_eps), normed)

    def _attention_stages(self, i: int, x, batch: TargetBatch, kv: GpuLatentCache, out, reduce: bool = True,
                          norm=None):
        from ..kernels.attention import mla_attention
        from ..kernels.fused import mla_head_gemm, mla_qkv_a_post
        cfg, d, L = self.cfg, self.d, self.w.layers[i]
        T, nh, dn = batch.T, d["nh"], d["dn"]
        qkv, c_q, q, qf = self.qkv_a[:T], self.c_q[:T], self.q[:T], self.q_full[:T]
        q3 = q.reshape(T, nh, dn + ROPE)
        max_kv = batch.max_kv_len if batch.max_kv_len is not None else kv.capacity_per_stream
        ws = self._mla_workspace(batch.S, batch.R, T, max_kv)

        def o_proj():
            self._gemm(self.o[:T], L.w_o, out)
            if reduce:
                self._reduce(out, norm)
        return [
            ("qkv_a_gemm", lambda: self._gemm(x, L.w_qkv_a, qkv)),
            # c_q norm, c_kv norm, rope(k_pe) and the latent cache write: one launch
            ("qkv_a_post", lambda: mla_qkv_a_post(
                qkv, L.q_a_norm, L.kv_a_norm, float(cfg.latent_norm_eps), c_q, batch.positions, self.inv_freq,
                self.amplitude, batch.stream_ids, batch.kv_pos, kv.pools[i], kv.block_table)),
            ("q_b_gemm", lambda: self._gemm(c_q, L.w_q_b, q)),
            # q_full = q_nope @ W_UK per head | rope(q_pe): one launch
            ("w_uk_rope", lambda: mla_head_gemm(
                q3[:, :, :dn], L.w_uk_t, qf[:, :, :LATENT], pe=q3[:, :, dn:], pe_out=qf[:, :, LATENT:],
                positions=batch.positions, inv_freq=self.inv_freq, amplitude=self.amplitude)),
            ("attention", lambda: mla_attention(
                qf, kv.pools[i], kv.block_table[:batch.S], batch.prefix_len, batch.n_rows, batch.row_start,
                softmax_scale=self.softmax_scale, max_rows=batch.R, max_kv_len=max_kv, mask=batch.mask,
                out=self.o_lat[:T], workspace=ws)),
            ("w_uv", lambda: mla_head_gemm(self.o_lat[:T], L.w_uv, self.o[:T].reshape(T, nh, d["dv"]))),
            ("o_proj", o_proj)]

    def _mlp_stages(self, i: int, x, out, reduce: bool = True, norm=None, row_pos=None):
        """``row_pos`` (the batch's kv_pos): padding rows (< 0) select no routed expert (router.route_logits).
        ``norm`` = (weight, h, normed): the all-reduce also does the residual add and the next norm."""
        from ..kernels.layers import silu_mul
        from ..kernels.moe import moe_forward
        from ..kernels import router as router_mod
        cfg, L = self.cfg, self.w.layers[i]
        T = x.shape[0]

        def reduce_out():
            if reduce:
                self._reduce(out, norm)
        if not L.is_moe:
            F = L.w_down.shape[1]
            gu, act = self.gate_up[:T, :2 * F], self.act[:T, :F]

            def down():
                self._gemm(act, L.w_down, out)
                reduce_out()
            return [("gate_up_gemm", lambda: self._gemm(x, L.w_gate_up, gu)), ("silu", lambda: silu_mul(gu, out=act)),
                    ("down_gemm", down)]
        ids, wts = self.topk_ids[:T], self.topk_w[:T]
        shared = L.w_shared_gate_up is not None
        E, Is = L.w_router.shape[0], (L.w_shared_down.shape[1] if shared else 0)
        fused = self.router_logits[:T, :E + 2 * Is]         # fp32 [logits | shared gate | shared up]
        act = self.act[:T, :Is]

        def moe():
            moe_forward(x, ids, wts, L.experts, self.moe_ws, out=out, residual=self.shared_out[:T] if shared else None)
            reduce_out()
        # ONE GEMM reads x for the router and the shared expert's gate|up (w_router_gate_up, fp32 out); the
        # route launch also does the shared SwiGLU from the fp32 gate|up columns (rounded to bf16 first, so
        # the same numbers as a bf16 GEMM + silu_mul). route_logits is looked up at call time (bench/step.py
        # records its outputs).
        st = [("router_gate_up_gemm" if shared else "router_gemm", lambda: self._gemm(
            x, L.w_router_gate_up if shared else L.w_router, fused, out_dtype=np.float32))]
        # At small T (router_mod.shared_down_fused's rule) the same launch also does the shared expert's down
        # projection (act formed on the fly, never stored): no separate shared down GEMM.
        down = shared and router_mod.shared_down_fused(T, Is, L.w_shared_down.shape[0])
        if down:
            st.append(("route_silu_down", lambda: router_mod.route_logits(
                fused[:, :E], L.router_bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                cfg.routed_scaling_factor, cfg.norm_topk_prob, out_ids=ids, out_weights=wts,
                gate_up=fused[:, E:], down_w=L.w_shared_down, down_out=self.shared_out[:T], row_pos=row_pos)))
            return st + [("moe", moe)]
        st.append(("route" + ("_silu" if shared else ""), lambda: router_mod.route_logits(
            fused[:, :E], L.router_bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
            cfg.routed_scaling_factor, cfg.norm_topk_prob, out_ids=ids, out_weights=wts,
            gate_up=fused[:, E:] if shared else None, act_out=act if shared else None, row_pos=row_pos)))
        if shared:
            st.append(("shared_down_gemm", lambda: self._gemm(act, L.w_shared_down, self.shared_out[:T])))
        return st + [("moe", moe)]

    def _copy_feature(self, layer: int, batch: TargetBatch, h) -> None:
        """batch.features[:, c] = h for feature layer ``layer`` (a strided device copy, graph-capturable)."""
        import cupy
        c = self._feat_index.get(layer)
        if c is None:
            return
        H = self.d["H"]
        dst = batch.features[:, c, :]
        cupy.cuda.runtime.memcpy2DAsync(dst.data.ptr, batch.features.strides[0], h.data.ptr, h.strides[0], H * 2,
                                        batch.T, cupy.cuda.runtime.memcpyDeviceToDevice,
                                        cupy.cuda.get_current_stream().ptr)

    # ---- forward --------------------------------------------------------------------------------------
    def check_batch(self, batch: TargetBatch, kv: GpuLatentCache) -> None:
        cfg = self.cfg
        if not isinstance(batch, TargetBatch):
            raise ValueError(f"GpuTarget.forward: batch must be a TargetBatch, got {type(batch).__name__}")
        if not isinstance(kv, GpuLatentCache):
            raise ValueError(f"GpuTarget.forward: kv must be a GpuLatentCache, got {type(kv).__name__}")
        if batch.cfg is not cfg and batch.cfg != cfg:
            raise ValueError("GpuTarget.forward: batch was built for a different TargetConfig")
        if batch.T > self.max_tokens:
            raise ValueError(f"GpuTarget.forward: batch has T = {batch.T} rows > max_tokens = {self.max_tokens}")
        if batch.tp != self.tp_size:
            raise ValueError(f"GpuTarget.forward: batch was built for tp = {batch.tp}, model runs tp = {self.tp_size}")
        if batch.n_feat != len(self.feature_layers):
            raise ValueError(f"GpuTarget.forward: batch has n_feat = {batch.n_feat}, model captures "
                             f"{len(self.feature_layers)} feature layers {list(self.feature_layers)}")
        if kv.num_layers != cfg.num_hidden_layers:
            raise ValueError(f"GpuTarget.forward: kv has {kv.num_layers} layers, model {cfg.num_hidden_layers}")
        if kv.max_streams < batch.S:
            raise ValueError(f"GpuTarget.forward: batch has S = {batch.S} slots, kv only {kv.max_streams} streams")
        if batch.max_kv_len is not None and batch.max_kv_len > kv.capacity_per_stream:
            raise ValueError(f"GpuTarget.forward: batch.max_kv_len = {batch.max_kv_len} exceeds the per-stream "
                             f"cache capacity {kv.capacity_per_stream}")

    def forward(self, batch: TargetBatch, kv: GpuLatentCache) -> None:
        """Enqueue the whole forward of ``batch`` on the current stream: logits into batch.logits, the residual
        stream after each feature layer into batch.features, the rows' latent KV into ``kv`` at batch.kv_pos."""
        from ..kernels.layers import rms_norm
        self.check_batch(batch, kv)
        cfg, T = self.cfg, batch.T
        eps = float(cfg.rms_norm_eps)
        h, normed, mlp = self.h[:T], self.normed[:T], self.mlp_out[:T]
        self.embed(batch.tokens, h)
        for i in range(cfg.num_hidden_layers):
            for _, fn in self.layer_stages(i, batch, kv):
                fn()
        if not self.fuses_norms():      # else the last MLP all-reduce did the final add + norm
            rms_norm(mlp, self.w.final_norm, eps, out=normed, residual=h)
        self._copy_feature(cfg.num_hidden_layers - 1, batch, h)
        self.project_vocab(normed, batch.logits)
