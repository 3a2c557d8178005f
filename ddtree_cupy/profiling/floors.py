"""Byte and FLOP floors of one rank's decode step, its phases, layers and layer stages (host arithmetic only).

A floor is what a piece of work must at least move and compute: every weight it reads once, the latent
cache rows its attention reads, the logits it writes and reads back; FLOPs of its matrix products
(2 x rows x weight elements; attention 2 x rows x heads x context x (576 + 512)). Divided by the ceilings
measured in the same run (``Ceilings``), the larger of the two times is the piece's floor time: a kernel at
1.0 x floor cannot go faster on this device. Activations are left out (a few MB per step: they stay in L2).

Everything here comes from the configs and the weight plan (``models.weights.weight_plan``), so it runs
without a GPU and the CPU tests check it against sums written out by hand.

Routed experts: a layer's MoE reads only the experts its rows picked. Unless the caller passes the
measured count, the floor assumes uniform routing, whose expected number of distinct experts among
``rows`` draws of k distinct out of E is E (1 - (1 - k / E) ** rows) (PERFORMANCE.md's model of real
routing; bench/step.py's ``UniformRouting`` makes the random-weight model route that way).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence

import numpy as np

from ..models.weights import local_dims, weight_plan

LATENT, ROPE = 512, 64
LATENT_ROW_BYTES = (LATENT + ROPE) * 2          # one token's latent cache row in one layer (bf16)

# The weight-plan leaves each layer stage reads (stage names of ``GpuTarget.layer_stages``).
STAGE_WEIGHTS: Dict[str, Sequence[str]] = {
    "input_norm": ("input_norm",), "qkv_a_gemm": ("w_qkv_a",), "qkv_a_post": ("q_a_norm", "kv_a_norm"),
    "q_b_gemm": ("w_q_b",), "w_uk_rope": ("w_uk_t",), "attention": (), "w_uv": ("w_uv",), "o_proj": ("w_o",),
    "post_norm": ("post_norm",), "gate_up_gemm": ("w_gate_up",), "silu": (), "down_gemm": ("w_down",),
    "router_gemm": ("w_router",), "router_gate_up_gemm": ("w_router", "w_shared_gate_up"),
    "route": ("router_bias",), "route_silu": ("router_bias",), "route_silu_down": ("router_bias", "w_shared_down"),
    "shared_down_gemm": ("w_shared_down",), "moe": (),
}
# stages that are matrix products over their weights (FLOPs = 2 x rows x weight elements)
GEMM_STAGES = {"qkv_a_gemm", "q_b_gemm", "w_uk_rope", "w_uv", "o_proj", "gate_up_gemm", "down_gemm", "router_gemm",
               "router_gate_up_gemm", "shared_down_gemm", "route_silu_down"}
EXPERT_PARTS = ("w13", "s13", "w2", "s2")


@dataclass(frozen=True)
class Floor:
    """Bytes that must be read or written and FLOPs that must be done by one piece of work."""
    bytes: float = 0.0
    flops: float = 0.0

    def __add__(self, other: "Floor") -> "Floor":
        return Floor(self.bytes + other.bytes, self.flops + other.flops)

    def seconds(self, ceilings) -> float:
        """The larger of bytes / read ceiling and FLOPs / mma ceiling (``Ceilings`` of this run)."""
        return max(self.bytes / (ceilings.read_GBps * 1e9), self.flops / (ceilings.mma_TFLOPs * 1e12))

    def bound(self, ceilings) -> str:
        """Which ceiling sets the floor: 'memory' or 'compute'."""
        mem = self.bytes / (ceilings.read_GBps * 1e9)
        return "memory" if mem >= self.flops / (ceilings.mma_TFLOPs * 1e12) else "compute"


def sum_floors(floors: Iterable[Floor]) -> Floor:
    out = Floor()
    for f in floors:
        out = out + f
    return out


def expected_unique_experts(E: int, k: int, rows: int) -> float:
    """Expected distinct experts among ``rows`` rows that each pick k distinct experts uniformly from E."""
    if E < 1 or not 0 < k <= E or rows < 0:
        raise ValueError(f"expected_unique_experts: need E >= 1, 0 < k <= E, rows >= 0 (got {E}, {k}, {rows})")
    return E * (1.0 - (1.0 - k / E) ** rows)


class StepFloors:
    """Floors of one rank (``tp``, from ``tcfg``'s weight plan) for a step of ``streams`` streams with
    ``rows`` verify rows each at ``ctx`` committed tokens, drafting ``depth`` tokens per stream.
    ``drafter_weight_bytes``: the drafter shard's bytes (the engine knows them: ``GpuDrafterWeights.nbytes``);
    ``dcfg``: the drafter config (its context cache); both optional (no draft phase without them)."""

    def __init__(self, tcfg, tp: int, streams: int, rows: int, ctx: int, dcfg=None, drafter_weight_bytes: int = 0):
        for nm, v, lo in (("tp", tp, 1), ("streams", streams, 1), ("rows", rows, 1), ("ctx", ctx, 0)):
            if not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"StepFloors: {nm} must be an integer >= {lo}, got {v!r}")
        self.cfg, self.dcfg, self.tp = tcfg, dcfg, int(tp)
        self.S, self.R, self.ctx = int(streams), int(rows), int(ctx)
        self.T = self.S * self.R
        self.d = local_dims(tcfg, self.tp)
        self.plan = weight_plan(tcfg, self.tp)
        self.drafter_weight_bytes = int(drafter_weight_bytes)
        self.depth = (dcfg.block_size - 1) if dcfg is not None else 0

    # ---- pieces ------------------------------------------------------------------------------------
    def _leaf(self, layer: int, leaf: str):
        """(bytes, elements) of one weight of ``layer`` (0, 0 when this layer has no such weight)."""
        ent = self.plan.get(f"layers.{layer}.{leaf}")
        if ent is None:
            return 0, 0
        n = int(np.prod(ent[0]))
        return n * ent[1].itemsize, n

    def expert_bytes(self, layer: int) -> int:
        """One routed expert's shard in ``layer`` (packed INT4 gate|up and down plus their scales)."""
        E = self.d["E"]
        return sum(self._leaf(layer, "experts." + p)[0] for p in EXPERT_PARTS) // max(E, 1)

    def stage(self, layer: int, name: str, unique_experts: Optional[float] = None) -> Floor:
        """Floor of stage ``name`` of ``layer`` at this step's shape."""
        if name not in STAGE_WEIGHTS:
            raise ValueError(f"StepFloors.stage: unknown stage {name!r} (known: {', '.join(STAGE_WEIGHTS)})")
        if not 0 <= layer < self.cfg.num_hidden_layers:
            raise ValueError(f"StepFloors.stage: layer {layer} outside 0..{self.cfg.num_hidden_layers - 1}")
        nbytes = elems = 0
        for leaf in STAGE_WEIGHTS[name]:
            b, n = self._leaf(layer, leaf)
            nbytes, elems = nbytes + b, elems + n
        flops = 2.0 * self.T * elems if name in GEMM_STAGES else 0.0
        if name == "attention":
            # every stream reads its whole prefix plus its own tree rows once, written rows included
            kv_rows = self.S * (self.ctx + self.R)
            nbytes += kv_rows * LATENT_ROW_BYTES
            flops = 2.0 * self.T * self.d["nh"] * (self.ctx + self.R) * (LATENT + ROPE + LATENT)
        elif name == "qkv_a_post":
            nbytes += self.T * LATENT_ROW_BYTES                 # the rows' latent KV written
        elif name == "moe":
            if not self.cfg.is_moe_layer(layer):
                raise ValueError(f"StepFloors.stage: layer {layer} is dense, it has no 'moe' stage")
            k, E = self.cfg.num_experts_per_tok, self.d["E"]
            u = expected_unique_experts(E, k, self.T) if unique_experts is None else float(unique_experts)
            nbytes += u * self.expert_bytes(layer)
            flops = 2.0 * self.T * k * 3 * self.d["H"] * self.d["I"]
        return Floor(float(nbytes), float(flops))

    def stage_names(self, layer: int, shared_down_fused: Optional[bool] = None) -> list:
        """The stage names of ``layer`` in ``GpuTarget.layer_stages`` order (the MoE head's form, fused shared
        down or not, follows ``kernels.router.shared_down_fused`` unless given)."""
        attn = ["input_norm", "qkv_a_gemm", "qkv_a_post", "q_b_gemm", "w_uk_rope", "attention", "w_uv", "o_proj",
                "post_norm"]
        if not self.cfg.is_moe_layer(layer):
            return attn + ["gate_up_gemm", "silu", "down_gemm"]
        if not self.cfg.n_shared_experts:
            return attn + ["router_gemm", "route", "moe"]
        if shared_down_fused is None:
            from ..kernels.router import shared_down_fused as rule
            shared_down_fused = rule(self.T, self.d["Is"], self.d["H"])
        return attn + (["router_gate_up_gemm", "route_silu_down", "moe"] if shared_down_fused else
                       ["router_gate_up_gemm", "route_silu", "shared_down_gemm", "moe"])

    def layer(self, layer: int, unique_experts: Optional[float] = None, stages: Optional[Sequence[str]] = None) -> Floor:
        names = stages if stages is not None else self.stage_names(layer)
        return sum_floors(self.stage(layer, n, unique_experts if n == "moe" else None) for n in names)

    def lm_head(self, rows: int) -> Floor:
        b, n = int(np.prod(self.plan["lm_head"][0])) * 2, int(np.prod(self.plan["lm_head"][0]))
        return Floor(float(b + rows * self.d["V"] * 4), 2.0 * rows * n)      # weights + fp32 logits written

    # ---- phases ------------------------------------------------------------------------------------
    def verify(self, unique_experts: Optional[Sequence[float]] = None) -> Floor:
        """All layers, the final norm and the vocabulary projection of the T verify rows, plus the argmax's
        read of the logits."""
        L = self.cfg.num_hidden_layers
        u = list(unique_experts) if unique_experts is not None else None
        moe_layers = [i for i in range(L) if self.cfg.is_moe_layer(i)]
        if u is not None and len(u) != len(moe_layers):
            raise ValueError(f"StepFloors.verify: {len(u)} unique-expert counts for {len(moe_layers)} MoE layers")
        per = {i: (u[moe_layers.index(i)] if u is not None and i in moe_layers else None) for i in range(L)}
        out = sum_floors(self.layer(i, per[i]) for i in range(L))
        return out + self.lm_head(self.T) + Floor(float(self.T * self.d["V"] * 4), 0.0)

    def draft(self) -> Floor:
        """The drafter's weights, its context cache (the draft window of every stream), the target's lm_head
        over the S x depth draft rows."""
        if self.dcfg is None:
            return Floor()
        dc = self.dcfg
        W = min(self.ctx, dc.draft_window or self.ctx)
        hkv = max(1, dc.num_key_value_heads // self.tp)
        ctx_bytes = self.S * W * hkv * dc.head_dim * 2 * 2 * dc.num_hidden_layers
        return Floor(float(self.drafter_weight_bytes + ctx_bytes), 0.0) + self.lm_head(self.S * self.depth)

    def tree(self) -> Floor:
        """The per-depth top-K reads the draft logits once."""
        return Floor(float(self.S * self.depth * self.d["V"] * 4), 0.0)

    def accept(self) -> Floor:
        """The compaction moves at most depth + 1 accepted latent rows per stream and layer (read + write)."""
        return Floor(float(2 * self.S * (self.depth + 1) * LATENT_ROW_BYTES * self.cfg.num_hidden_layers), 0.0)

    def phases(self, unique_experts: Optional[Sequence[float]] = None) -> Dict[str, Floor]:
        out = {"draft": self.draft(), "tree": self.tree()} if self.dcfg is not None else {"tree": Floor()}
        out.update(verify=self.verify(unique_experts), accept=self.accept())
        return out

    def step(self, unique_experts: Optional[Sequence[float]] = None) -> Floor:
        return sum_floors(self.phases(unique_experts).values())
