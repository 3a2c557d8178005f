"""``GpuTargetWeights``: one tensor-parallel rank's target weights on the GPU, in the kernels' layouts.

Preparation (once, at load):
  * ``w_qkv_a``  [q_lora + 576, H]   q_a_proj and kv_a_proj_with_mqa stacked by rows: one GEMM for both
  * ``w_q_b``    [nh * 192, q_lora]  q_b_proj (this rank's heads)
  * ``w_uk_t``   [nh, 512, 128]      W_UK^T per head (kv_b_proj's nope rows, transposed): q_lat = q_nope W_UK
                                     as a batched GEMM in gemm_bf16's [N, K] weight layout
  * ``w_uv``     [nh, 128, 512]      W_UV per head (kv_b_proj's value rows): o = o_lat W_UV^T, batched
  * ``w_o``      [H, nh * 128]       o_proj columns of this rank's heads
  * dense MLP:   ``w_gate_up`` [2F, H] (gate rows then up rows, what silu_mul reads), ``w_down`` [H, F]
  * MoE layer:   ``w_router`` [E, H] bf16 + ``router_bias`` [E] fp32 (replicated), the routed experts
                 repacked by ``kernels.moe.pack_moe_weights`` (``MoEWeights``), the shared expert as
                 ``w_shared_gate_up`` [2 Is, H] / ``w_shared_down`` [H, Is]. With a shared expert,
                 ``w_router`` and ``w_shared_gate_up`` are row views of ONE buffer ``w_router_gate_up``
                 [E + 2 Is, H] (router rows, shared gate rows, shared up rows): the target reads the normed
                 rows once for both in one fp32-output GEMM. The plan lists the two views (no extra bytes).
  * norms [H] / [q_lora] / [512]; ``embed`` and ``lm_head`` vocabulary slices [V / tp, H].
bf16 values are uint16 bit patterns. F, Is and the experts' I are this rank's widths (split by tp).

``weight_plan(cfg, tp)`` lists every GPU tensor with its shape and dtype without a GPU (memory sizing,
CPU tests); ``from_checkpoint`` and ``random`` both fill exactly that plan, layer by layer, so the peak
host/device memory above the final weights is one layer's tensors.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from ..config import TargetConfig

LATENT = 512
ROPE = 64
ROW = LATENT + ROPE
GROUP = 32


# ------------------------------------------------------------------------------------------------------
# the plan (host only)
# ------------------------------------------------------------------------------------------------------
def local_dims(cfg: TargetConfig, tp: int) -> Dict[str, int]:
    """This rank's split sizes: heads, dense FFN, expert / shared-expert widths, vocabulary slice."""
    cfg.validate_tp(tp)
    if cfg.kv_lora_rank != LATENT or cfg.qk_rope_head_dim != ROPE:
        raise ValueError(f"GPU target: kernels are built for kv_lora_rank {LATENT} and qk_rope_head_dim {ROPE}, "
                         f"config has {cfg.kv_lora_rank} and {cfg.qk_rope_head_dim}")
    if cfg.qk_nope_head_dim % 64 or cfg.v_head_dim % 16:
        raise ValueError(f"GPU target: qk_nope_head_dim ({cfg.qk_nope_head_dim}) must be a multiple of 64 and "
                         f"v_head_dim ({cfg.v_head_dim}) of 16 (GEMM tiles)")
    I = cfg.moe_intermediate_size // tp if cfg.n_routed_experts else 0
    return {"H": cfg.hidden_size, "nh": cfg.num_attention_heads // tp, "F": cfg.intermediate_size // tp,
            "I": I, "Is": I * cfg.n_shared_experts, "V": cfg.vocab_size // tp, "ql": cfg.q_lora_rank,
            "dn": cfg.qk_nope_head_dim, "dv": cfg.v_head_dim, "E": cfg.n_routed_experts}


def moe_layout_shapes(E: int, H: int, I: int) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
    """Shapes of ``MoEWeights`` (kernels/moe/forward.py) for E experts of width I over hidden size H."""
    Ip = -(-I // 64) * 64
    u32, u16 = np.dtype(np.uint32), np.dtype(np.uint16)
    return {"w13": ((E, 2 * I // 16, H // 64, 32, 4), u32), "s13": ((E, 2 * I // 16, H // 64, 8, 4), u16),
            "w2": ((E, H // 16, Ip // 64, 32, 4), u32), "s2": ((E, H // 16, Ip // 64, 8, 4), u16)}


def weight_plan(cfg: TargetConfig, tp: int = 1) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
    """Every GPU tensor of one rank: {name: (shape, dtype)}. Names: ``layers.{i}.{field}``, globals by field."""
    d = local_dims(cfg, tp)
    H, nh, ql, dn, dv = d["H"], d["nh"], d["ql"], d["dn"], d["dv"]
    u16, f32 = np.dtype(np.uint16), np.dtype(np.float32)
    plan: Dict[str, Tuple[Tuple[int, ...], np.dtype]] = {
        "embed": ((d["V"], H), u16), "lm_head": ((d["V"], H), u16), "final_norm": ((H,), u16)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        plan.update({
            p + "input_norm": ((H,), u16), p + "post_norm": ((H,), u16),
            p + "w_qkv_a": ((ql + ROW, H), u16), p + "q_a_norm": ((ql,), u16), p + "kv_a_norm": ((LATENT,), u16),
            p + "w_q_b": ((nh * (dn + ROPE), ql), u16), p + "w_uk_t": ((nh, LATENT, dn), u16),
            p + "w_uv": ((nh, dv, LATENT), u16), p + "w_o": ((H, nh * dv), u16)})
        if cfg.is_moe_layer(i):
            plan[p + "w_router"] = ((d["E"], H), u16)
            plan[p + "router_bias"] = ((d["E"],), f32)
            for k, v in moe_layout_shapes(d["E"], H, d["I"]).items():
                plan[p + "experts." + k] = v
            if cfg.n_shared_experts:
                plan[p + "w_shared_gate_up"] = ((2 * d["Is"], H), u16)
                plan[p + "w_shared_down"] = ((H, d["Is"]), u16)
        else:
            plan[p + "w_gate_up"] = ((2 * d["F"], H), u16)
            plan[p + "w_down"] = ((H, d["F"]), u16)
    return plan


def plan_bytes(cfg: TargetConfig, tp: int = 1) -> Dict[str, int]:
    """Bytes per category of one rank's weights: experts, attention, dense+shared MLP, router, vocab, norms."""
    out = {"experts": 0, "attention": 0, "mlp": 0, "router": 0, "vocab": 0, "norms": 0}
    for name, (shape, dt) in weight_plan(cfg, tp).items():
        n = int(np.prod(shape)) * dt.itemsize
        leaf = name.split(".")[-1]
        if ".experts." in name:
            out["experts"] += n
        elif leaf in ("w_qkv_a", "w_q_b", "w_uk_t", "w_uv", "w_o"):
            out["attention"] += n
        elif leaf in ("w_gate_up", "w_down", "w_shared_gate_up", "w_shared_down"):
            out["mlp"] += n
        elif leaf.startswith("router") or leaf == "w_router":
            out["router"] += n
        elif leaf in ("embed", "lm_head"):
            out["vocab"] += n
        else:
            out["norms"] += n
    out["total"] = sum(out.values())
    return out


# ------------------------------------------------------------------------------------------------------
# containers
# ------------------------------------------------------------------------------------------------------
@dataclass
class GpuLayerWeights:
    input_norm: object
    post_norm: object
    w_qkv_a: object
    q_a_norm: object
    kv_a_norm: object
    w_q_b: object
    w_uk_t: object
    w_uv: object
    w_o: object
    # dense layers
    w_gate_up: object = None
    w_down: object = None
    # MoE layers
    w_router: object = None
    router_bias: object = None
    experts: object = None            # kernels.moe.MoEWeights
    w_shared_gate_up: object = None
    w_shared_down: object = None
    # [E + 2 Is, H]: w_router and w_shared_gate_up are views of its rows (not in the plan: the views are)
    w_router_gate_up: object = None

    @property
    def is_moe(self) -> bool:
        return self.experts is not None

    def router_shared_fused(self) -> bool:
        """True when w_router and w_shared_gate_up are the two row blocks of w_router_gate_up."""
        f, r, s = self.w_router_gate_up, self.w_router, self.w_shared_gate_up
        if f is None or r is None or s is None:
            return False
        E, H = r.shape
        return (tuple(f.shape) == (E + s.shape[0], H) and r.data.ptr == f.data.ptr
                and s.data.ptr == f.data.ptr + E * H * f.itemsize and r.flags.c_contiguous and s.flags.c_contiguous)

    def fuse_router_shared(self) -> None:
        """Make w_router / w_shared_gate_up views of one [E + 2 Is, H] buffer (a no-op when they already are
        or there is no shared expert). Copies both into a new buffer and drops the old arrays, so the extra
        device memory is one router + shared gate_up for the moment of the copy."""
        import cupy
        if self.w_shared_gate_up is None or self.router_shared_fused():
            return
        E, H = self.w_router.shape
        fused = cupy.empty((E + self.w_shared_gate_up.shape[0], H), self.w_router.dtype)
        fused[:E] = self.w_router
        fused[E:] = self.w_shared_gate_up
        self.set_router_shared(fused, E)

    def set_router_shared(self, fused, E: int) -> None:
        """Install ``fused`` [E + 2 Is, H] (router rows first) as w_router_gate_up and its two row views."""
        self.w_router_gate_up = fused
        self.w_router, self.w_shared_gate_up = fused[:E], fused[E:]

    def arrays(self) -> Dict[str, object]:
        out = {k: v for k, v in self.__dict__.items()
               if k not in ("experts", "w_router_gate_up") and v is not None}
        if self.experts is not None:
            for k in ("w13", "s13", "w2", "s2"):
                out["experts." + k] = getattr(self.experts, k)
        return out


@dataclass
class GpuTargetWeights:
    cfg: TargetConfig
    tp_rank: int
    tp_size: int
    embed: object
    lm_head: object
    final_norm: object
    layers: List[GpuLayerWeights] = field(default_factory=list)

    @property
    def vocab_start(self) -> int:
        return self.tp_rank * (self.cfg.vocab_size // self.tp_size)

    def arrays(self) -> Dict[str, object]:
        out = {"embed": self.embed, "lm_head": self.lm_head, "final_norm": self.final_norm}
        for i, L in enumerate(self.layers):
            out.update({f"layers.{i}.{k}": v for k, v in L.arrays().items()})
        return out

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays().values())

    def check_plan(self) -> None:
        """Every array has the planned shape and dtype (ValueError naming the first mismatch)."""
        plan = weight_plan(self.cfg, self.tp_size)
        have = self.arrays()
        if set(plan) != set(have):
            raise ValueError(f"GpuTargetWeights: tensors {sorted(set(plan) ^ set(have))[:6]} differ from the plan")
        for k, (shape, dt) in plan.items():
            a = have[k]
            if tuple(a.shape) != tuple(shape) or a.dtype != dt:
                raise ValueError(f"GpuTargetWeights: {k} is {a.dtype} {tuple(a.shape)}, planned {dt} {shape}")

    # ---- loading ------------------------------------------------------------------------------------
    @staticmethod
    def from_checkpoint(model_dir: str, cfg: Optional[TargetConfig] = None, tp_rank: int = 0, tp_size: int = 1,
                        progress: Union[bool, Callable[[int, float], None], None] = False) -> "GpuTargetWeights":
        """Load rank ``tp_rank``'s shard (only its slices are read from disk) and prepare it on the GPU.
        Routed experts must be INT4 (compressed-tensors pack-quantized): the MoE kernel is W4A16."""
        import cupy
        from ..checkpoint import Checkpoint, expected_target_tensors
        from ..kernels.moe import pack_moe_weights
        cfg = cfg or TargetConfig.load(model_dir)
        _check_rank(tp_rank, tp_size)
        d = local_dims(cfg, tp_size)
        if cfg.n_routed_experts and cfg.quant is None:
            raise ValueError(f"{cfg.source}: routed experts are bf16, the GPU MoE kernel needs INT4 "
                             f"(compressed-tensors pack-quantized) experts")
        dev = lambda a: cupy.asarray(np.ascontiguousarray(a))   # noqa: E731
        with Checkpoint(model_dir, prefix=cfg.weight_prefix, progress=progress) as ck:
            ck.validate(expected_target_tensors(cfg))
            get = lambda n: ck.get_shard(n, tp_rank, tp_size, dtype="BF16")   # noqa: E731
            w = GpuTargetWeights(cfg, tp_rank, tp_size, embed=dev(get("model.embed_tokens.weight")),
                                 lm_head=dev(get("lm_head.weight")), final_norm=dev(get("model.norm.weight")))
            for i in range(cfg.num_hidden_layers):
                p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
                kvb = dev(get(a + "kv_b_proj.weight")).reshape(d["nh"], d["dn"] + d["dv"], LATENT)
                L = GpuLayerWeights(
                    input_norm=dev(get(p + "input_layernorm.weight")),
                    post_norm=dev(get(p + "post_attention_layernorm.weight")),
                    w_qkv_a=dev(np.concatenate([get(a + "q_a_proj.weight"), get(a + "kv_a_proj_with_mqa.weight")])),
                    q_a_norm=dev(get(a + "q_a_layernorm.weight")),
                    kv_a_norm=dev(get(a + "kv_a_layernorm.weight")),
                    w_q_b=dev(get(a + "q_b_proj.weight")),
                    w_uk_t=cupy.ascontiguousarray(kvb[:, :d["dn"], :].transpose(0, 2, 1)),
                    w_uv=cupy.ascontiguousarray(kvb[:, d["dn"]:, :]),
                    w_o=dev(get(a + "o_proj.weight")))
                del kvb
                m = p + "mlp."
                if cfg.is_moe_layer(i):
                    if cfg.n_shared_experts:      # router | shared gate | shared up: one buffer, one upload
                        s = m + "shared_experts."
                        L.set_router_shared(dev(np.concatenate([get(m + "gate.weight"), get(s + "gate_proj.weight"),
                                                                get(s + "up_proj.weight")])), d["E"])
                        L.w_shared_down = dev(get(s + "down_proj.weight"))
                    else:
                        L.w_router = dev(get(m + "gate.weight"))
                    L.router_bias = dev(ck.get_shard(m + "gate.e_score_correction_bias", tp_rank, tp_size,
                                                     dtype="F32"))
                    stacks = []
                    for proj in ("gate_proj", "up_proj", "down_proj"):
                        packed, scale, _ = ck.get_experts_int4(i, proj, cfg.n_routed_experts, tp_rank, tp_size)
                        stacks += [dev(packed), dev(scale)]
                        del packed, scale
                    L.experts = pack_moe_weights(*stacks)
                    del stacks
                else:
                    L.w_gate_up = dev(np.concatenate([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]))
                    L.w_down = dev(get(m + "down_proj.weight"))
                w.layers.append(L)
            ck.report()
        w.check_plan()
        return w

    @staticmethod
    def random(cfg: TargetConfig, tp_rank: int = 0, tp_size: int = 1, seed: int = 0,
               progress: bool = False) -> "GpuTargetWeights":
        """Random weights of the plan's shapes, generated on the GPU layer by layer (rank-shape benchmarks;
        no checkpoint). bf16 linears ~ N(0, 1/K) (unit-RMS activations stay O(1)), norms ~ 1 +- 0.1,
        router bias ~ N(0, 0.05); INT4 experts: uniform random packed words (every nibble 0..15) with
        bf16 group scales uniform in [0.6, 1.4] / (4 sqrt(K)), repacked by ``pack_moe_weights`` like real
        experts. The peak extra device memory is about twice one layer's expert bytes."""
        import cupy
        from ..kernels.moe import pack_moe_weights
        _check_rank(tp_rank, tp_size)
        d = local_dims(cfg, tp_size)
        H, nh, ql, dn, dv = d["H"], d["nh"], d["ql"], d["dn"], d["dv"]
        # Different ranks get different streams: a rank-shape benchmark of rank r sees its own values.
        rs = cupy.random.RandomState(seed * 1009 + tp_rank)
        lin = lambda n, k: _rand_bf16(rs, (n, k), k ** -0.5)               # noqa: E731
        norm = lambda n: _rand_bf16(rs, (n,), 0.1, 1.0)                      # noqa: E731
        t0 = time.perf_counter()
        w = GpuTargetWeights(cfg, tp_rank, tp_size, embed=_rand_bf16(rs, (d["V"], H), 1.0),
                             lm_head=lin(d["V"], H), final_norm=norm(H))
        for i in range(cfg.num_hidden_layers):
            L = GpuLayerWeights(input_norm=norm(H), post_norm=norm(H), w_qkv_a=lin(ql + ROW, H),
                                q_a_norm=norm(ql), kv_a_norm=norm(LATENT), w_q_b=lin(nh * (dn + ROPE), ql),
                                w_uk_t=_rand_bf16(rs, (nh, LATENT, dn), dn ** -0.5),
                                w_uv=_rand_bf16(rs, (nh, dv, LATENT), LATENT ** -0.5), w_o=lin(H, nh * dv))
            if cfg.is_moe_layer(i):
                E, I = d["E"], d["I"]
                if cfg.n_shared_experts:      # router | shared gate | shared up (same N(0, 1/H) draws)
                    L.set_router_shared(lin(E + 2 * d["Is"], H), E)
                    L.w_shared_down = lin(H, d["Is"])
                else:
                    L.w_router = lin(E, H)
                L.router_bias = (rs.standard_normal(E, dtype=np.float32) * np.float32(0.05)).astype(np.float32)
                gp, gs = _rand_int4(rs, (E, I, H))
                up, us = _rand_int4(rs, (E, I, H))
                dp, ds = _rand_int4(rs, (E, H, I))
                L.experts = pack_moe_weights(gp, gs, up, us, dp, ds)
                del gp, gs, up, us, dp, ds
            else:
                L.w_gate_up = lin(2 * d["F"], H)
                L.w_down = lin(H, d["F"])
            w.layers.append(L)
            if progress:
                cupy.cuda.get_current_stream().synchronize()
                print(f"[random weights] layer {i + 1}/{cfg.num_hidden_layers}: "
                      f"{w.nbytes() / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        w.check_plan()
        return w


def _check_rank(tp_rank: int, tp_size: int) -> None:
    if not (isinstance(tp_size, (int, np.integer)) and tp_size >= 1 and isinstance(tp_rank, (int, np.integer))
            and 0 <= tp_rank < tp_size):
        raise ValueError(f"GpuTargetWeights: invalid tensor-parallel rank {tp_rank!r} of size {tp_size!r}")


def _f32_to_bf16_bits(x):
    """cupy float32 -> uint16 bf16 bits, round to nearest even (finite inputs)."""
    import cupy
    u = x.view(cupy.uint32)
    return ((u + cupy.uint32(0x7FFF) + ((u >> 16) & cupy.uint32(1))) >> 16).astype(cupy.uint16)


def _rand_bf16(rs, shape, std: float, mean: float = 0.0):
    x = rs.standard_normal(shape, dtype=np.float32)
    x *= np.float32(std)
    if mean:
        x += np.float32(mean)
    out = _f32_to_bf16_bits(x)
    del x
    return out


def _rand_int4(rs, shape):
    """Random compressed-tensors INT4 linear stack: packed int32 [E, N, K/8], scale bf16 [E, N, K/32]."""
    import cupy
    E, N, K = shape
    halves = rs.randint(0, 1 << 16, size=(2, E, N, K // 8), dtype=np.int32).astype(cupy.uint32)
    packed = (halves[0] | (halves[1] << 16)).view(cupy.int32)
    del halves
    s = rs.uniform(0.6, 1.4, size=(E, N, K // GROUP), dtype=np.float32)
    s *= np.float32(0.25 * K ** -0.5)
    scale = _f32_to_bf16_bits(s)
    return packed, scale

