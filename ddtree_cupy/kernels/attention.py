"""Launch wrappers for the attention kernels (cuda_src/mla_attention.cu, cuda_src/drafter_attention.cu).

* ``mla_attention``: absorbed MLA over the paged latent KV cache, for tree verify (ancestor mask), decode,
  chain and prefill chunks (causal), any number of streams with different prefix lengths in one launch.
* ``drafter_attention``: the DFlash drafter's non-causal GQA attention over its context cache + the block.

Both are graph friendly: the grid and the split count depend only on host-side sizes (the shape bucket:
streams, max rows, max KV length); per-stream lengths, row offsets and masks are read on the device, and
split partials live in a caller-owned workspace so a captured graph keeps valid pointers.
See docs/ATTENTION.md for the design.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import knobs
from .checks import check_array, check_range, current_device
from .compile import KernelSpec, get_kernel, register

LATENT_DIM = 512
ROPE_DIM = 64
ROW_DIM = LATENT_DIM + ROPE_DIM
PAGE_SIZE = 64
MASK_WORDS = 5
MAX_TREE_ROWS = 129
LOG2E = 1.4426950408889634
MAX_SPLITS = 256


@dataclass(frozen=True)
class MlaTileConfig:
    """One instantiation of mla_attn_fwd<MG, VG, BN, STAGES> or, with ``ksplit``, of
    mla_attn_ksplit<MG, BN, STAGES> (8 warps, Q in registers; ``vg`` unused). See the .cu header."""
    mg: int       # 16-row groups per block (BM = 16 * mg packed rows)
    vg: int       # warps sharing a row group (split of the tile's tokens in S, of the 512 columns in O)
    bn: int       # KV tokens per tile
    stages: int   # cp.async pipeline depth
    ksplit: bool = False

    @property
    def name(self) -> str:
        if self.ksplit:
            return f"mla_attn_ksplit<{self.mg}, {self.bn}, {self.stages}>"
        return f"mla_attn_fwd<{self.mg}, {self.vg}, {self.bn}, {self.stages}>"

    @property
    def bm(self) -> int:
        return 16 * self.mg

    @property
    def threads(self) -> int:
        return 256 if self.ksplit else 32 * self.mg * self.vg

    @property
    def smem(self) -> int:
        srow = ROW_DIM + 8
        if self.ksplit:   # K stages | 4 fp32 partial S tiles | P | alpha, 1/l
            return (self.stages * self.bn * srow * 2 + 4 * self.bm * (self.bn + 8) * 4
                    + self.bm * (self.bn + 8) * 2 + 2 * self.bm * 4)
        return (self.bm * srow + self.stages * self.bn * srow + self.bm * (self.bn + 8)) * 2 + 2 * self.vg * self.bm * 4


# Tiles of 64 / 32 / 16 packed (row, head) rows; plan_mla picks the smallest tile that holds a stream's
# packed rows (less padding for decode and short trees), preferring the wider / deeper variant where its
# shared memory fits (H200: all; sm_120, 99 KB per block: "small", "ks32_2stage", "ks16_2stage").
# 16 rows (decode at 8 heads) use mla_attn_ksplit: faster than the mla_attn_fwd 16-row tiles it replaced in
# every decode case measured (docs/ATTENTION.md). ks32* (mla_attn_ksplit, 32 rows) are tested, opt-in
# candidates for the larger shapes: faster in ~40% of them with the current split rule, not yet planned.
MLA_CONFIGS = {
    "large": MlaTileConfig(mg=4, vg=2, bn=32, stages=3),        # 188 KB
    "mid": MlaTileConfig(mg=2, vg=4, bn=32, stages=3),          # 150 KB
    "small": MlaTileConfig(mg=2, vg=2, bn=16, stages=3),        # 93 KB
    "ks32": MlaTileConfig(mg=2, vg=0, bn=32, stages=3, ksplit=True),         # 132 KB
    "ks32_2stage": MlaTileConfig(mg=2, vg=0, bn=32, stages=2, ksplit=True),  # 96 KB (sm_120)
    "ks16": MlaTileConfig(mg=1, vg=0, bn=32, stages=3, ksplit=True),         # 121 KB
    "ks16_2stage": MlaTileConfig(mg=1, vg=0, bn=32, stages=2, ksplit=True),  # 84 KB (sm_120)
    # a deeper cp.async pipeline (H200 only): 4 tiles in flight per block instead of 2. H200 run: 0.92-1.01x
    # the 3-stage tile's time at the same splits (docs/history/2026-11-29-attention.md "Fixed cost, combine, drafter on tensor cores"); the model policy's
    # 16-row tile on the H200. (ks32 with 4 stages measured 0.99-1.01x and 64-token 16-row tiles 0.96-1.14x:
    # both deleted.)
    "ks16_5stage": MlaTileConfig(mg=1, vg=0, bn=32, stages=5, ksplit=True),  # 194 KB
}
_PREFERENCE = {16: ("ks16", "ks16_2stage"), 32: ("mid", "small"), 64: ("large",)}

MLA_KERNEL_NAMES = tuple(c.name for c in MLA_CONFIGS.values()) + ("mla_attn_combine<4>", "mla_attn_combine<1>")
MLA_SPEC = register(KernelSpec(
    src="mla_attention.cu",
    names=MLA_KERNEL_NAMES,
    hot=True,
    pdl=True,
    doc="absorbed MLA attention over the paged latent KV cache + split-KV combine (fp32 split partials)"))
# The same kernels with bf16 split partials (MLA_PART_BF16=1: the main kernels store the normalised partial O
# rows as bf16, the combine reads them as bf16; lse stays fp32). A separate module with the same kernel
# names, compiled only when a launch uses it; which one a launch uses: mla_partial_bf16() below.
MLA_SPEC_BF16 = register(KernelSpec(
    src="mla_attention.cu",
    names=MLA_KERNEL_NAMES,
    defines=(("MLA_PART_BF16", "1"),),
    hot=True,
    pdl=True,
    doc="absorbed MLA attention + split-KV combine, bf16 split partials"))


# ---- split-partial element type: one rule ----------------------------------------------------------------
# PARTIAL_BF16 is the module default: fp32 partials. bf16 partials met the SPEED rule written before the bf16-partials
# H200 run (bf16 / fp32 0.91 median over the decode shapes; PDL step 1 x 8 8.54 -> 8.30 ms), but with them the
# engine's GPU test test_oracle_drafter_long_acceptance failed on the tiny checkpoints: the outputs left the float64
# reference's argmax path at near-ties within 1-10 tokens (fp32: the test passes), so the default stays fp32
# until the error budget is settled on a real checkpoint (docs/history/2026-11-29-attention.md "bf16 split partials"). The environment
# variable DDT_MLA_PARTIAL_BF16=0/1 overrides it. mla_partial_bf16() is the rule MlaWorkspace, plan_mla and
# mla_attention read when not told explicitly.
PARTIAL_BF16 = False
PARTIAL_BF16_ENV = "DDT_MLA_PARTIAL_BF16"


def parse_partial_bf16(value) -> Optional[bool]:
    """The value of DDT_MLA_PARTIAL_BF16: "0" / "1" (also false / true, off / on, no / yes); unset or ""
    -> None (the module default applies). Anything else raises ValueError naming the variable."""
    if value is None:
        return None
    v = str(value).strip().lower()
    if v == "":
        return None
    if v in ("1", "true", "on", "yes"):
        return True
    if v in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{PARTIAL_BF16_ENV}: expected 0 or 1, got {value!r}")


def mla_partial_bf16() -> bool:
    """True when MLA split partials are stored as bf16: the environment override, else PARTIAL_BF16 (read at
    call time, so the engine's workspace sizing and its launches agree as long as neither changes between
    building the engine and capturing its graphs)."""
    env = knobs.get().mla_partial_bf16
    return bool(PARTIAL_BF16) if env is None else env


def mla_spec(part_bf16: bool) -> KernelSpec:
    """The production build for fp32 (MLA_SPEC) or bf16 (MLA_SPEC_BF16) split partials."""
    return MLA_SPEC_BF16 if part_bf16 else MLA_SPEC


def spec_part_bf16(spec: KernelSpec) -> bool:
    """Whether a build of mla_attention.cu stores bf16 partials (its MLA_PART_BF16 define)."""
    return dict(spec.defines).get("MLA_PART_BF16", "0") not in ("0", "")


# Bytes per (packed row, split) of the split partials: the 512-wide O row + its fp32 log2-sum-exp.
def mla_partial_row_bytes(part_bf16: bool) -> int:
    return LATENT_DIM * (2 if part_bf16 else 4) + 4

DRAFTER_SPEC = register(KernelSpec(
    src="drafter_attention.cu",
    names=("drafter_attn_fwd", "drafter_attn_combine<4>"),
    hot=True,
    pdl=True,
    doc="DFlash drafter GQA attention (context cache + block, non-causal) + split combine"))

DRAFTER_HEAD_DIM = 128
DRAFTER_TILE = 64
DRAFTER_MAX_PACKED = 64
DRAFTER_STAGES = 2
DRAFTER_SMEM = DRAFTER_STAGES * 2 * DRAFTER_TILE * (DRAFTER_HEAD_DIM + 8) * 2   # K and V rings, 69,632 B
DRAFTER_THREADS = 128


# The split-KV combine (attn_combine.cuh) loads COMBINE_UNROLL splits per warp at once while its grid (one
# block per output row) fits COMBINE_WIDE_BLOCKS_PER_SM resident blocks per SM (the 4-split variant's
# registers allow 2), one split per warp past that (more resident blocks hide the latency instead).
# H200 run (docs/ATTENTION.md): 4 wins 0.3-3.3 us at <= 256 rows with 14-132 splits, 1 wins 1-8 us at >= 512
# rows with 3-17 splits.
COMBINE_UNROLL = 4
COMBINE_WIDE_BLOCKS_PER_SM = 2


def combine_unroll(rows: int, num_sms: int) -> int:
    """Splits per warp in flight for a combine grid of ``rows`` blocks (4 or 1)."""
    return COMBINE_UNROLL if rows <= COMBINE_WIDE_BLOCKS_PER_SM * num_sms else 1


@functools.lru_cache(maxsize=None)
def _attrs_of(device_id: int):
    import cupy
    a = cupy.cuda.Device(device_id).attributes
    return a["MultiProcessorCount"], a["MaxSharedMemoryPerBlockOptin"], a["MaxSharedMemoryPerMultiprocessor"]


def _device_attrs():
    """(SM count, shared memory per block opt-in) of the current device (cached: launches stay cheap)."""
    return _attrs_of(current_device())[:2]


def _smem_per_sm() -> int:
    return _attrs_of(current_device())[2]


def choose_mla_config(max_smem_per_block: Optional[int] = None, packed_rows: int = 1 << 30) -> MlaTileConfig:
    """The tile configuration for streams of up to ``packed_rows`` = rows x heads: the smallest row tile
    that holds them (the largest one past 64), among those whose shared memory fits the device."""
    if max_smem_per_block is None:
        max_smem_per_block = _device_attrs()[1]
    order = [bm for bm in (16, 32, 64) if bm >= packed_rows] or [64]
    order += [bm for bm in (64, 32, 16) if bm not in order]
    for bm in order:
        for key in _PREFERENCE[bm]:
            if MLA_CONFIGS[key].smem <= max_smem_per_block:
                return MLA_CONFIGS[key]
    raise ValueError(f"no MLA tile configuration fits {max_smem_per_block} bytes of shared memory per block")


def mla_num_splits(n_streams: int, max_rows: int, n_heads: int, max_kv_len: int, num_sms: int,
                   config: MlaTileConfig, blocks_per_sm: int = 1) -> int:
    """Split-KV count from sizes only (so a captured graph keeps it): enough blocks to fill every SM
    (``blocks_per_sm`` resident blocks each), but at least 2 KV tiles per split (the "measured" rule)."""
    m_tiles = -(-max_rows * n_heads // config.bm)
    blocks = n_streams * m_tiles
    kv_tiles = -(-max_kv_len // config.bn)
    want = -(-num_sms * blocks_per_sm // blocks)
    return max(1, min(want, kv_tiles // 2, MAX_SPLITS))


# ---- the split / tile planner ------------------------------------------------------------------------------
# Two policies (docs/ATTENTION.md, "Planner"):
#   "measured": choose_mla_config + mla_num_splits (fill the SMs once, >= 2 tiles per split), the rule every
#               committed figure was measured with;
#   "model":    the (tile, split count) pair with the least modelled time, mla_cost_us below.
# MLA_POLICY is the module-wide default (plan_mla(policy=None) and mla_attention read it at call time), set
# from the environment (DDT_MLA_POLICY) or with set_mla_policy before the engine plans its shapes: the
# engine sizes its split workspace with plan_mla and mla_attention re-plans with the same switch, so the
# switch must not change between the two (between building the engine and capturing its graphs).
# "auto" (the default) is "model" on sm_90, where the model was fitted and measured faster (docs/ATTENTION.md:
# median 0.92x the measured plan's time, no shape > 5% slower at margin 0.8), and "measured" elsewhere: the
# sm_120 tile costs are extrapolated, not measured on an RTX PRO 6000.
MLA_POLICIES = ("auto", "measured", "model")
MLA_POLICY = knobs.get().mla_policy          # validated there against the same three names
assert MLA_POLICY in MLA_POLICIES


def set_mla_policy(policy: str) -> str:
    """Set the module-wide planner policy; returns the previous one."""
    global MLA_POLICY
    if policy not in MLA_POLICIES:
        raise ValueError(f"policy: expected one of {MLA_POLICIES}, got {policy!r}")
    prev, MLA_POLICY = MLA_POLICY, policy
    return prev


# Cost model, microseconds, fitted (least squares on log time) to the 136 H200 points of
# tests/data/attention_planner_fit_h200.json (every planned config, the opt-in ks32 tile and the split-count probes;
# rms error 6.6%, worst 0.80x / 1.28x):
#   one call = max(makespan, KV bytes / MLA_DRAM_GBPS + MLA_BLOCK_US)
#              + (splits > 1) x (MLA_COMBINE_US + splits x packed rows x MLA_COMBINE_US_PER_ROW_SPLIT)
# The makespan lists the blocks in launch order (m-tile fastest, then split, then stream) and gives each
# to the earliest free slot (SMs x resident blocks); a block takes MLA_BLOCK_US + its KV tiles x
# MLA_TILE_US[config] (one block's time per config.bn-token tile with every SM busy). The last split of a
# stream is short (ceil division), which is why a block count just past a multiple of the slots costs a
# whole second wave on long contexts and nearly nothing on short ones. The 2-stage figures are the H200
# ones x 1.15 (the 2-stage tiles were 14-17% slower than their 3-stage twins in the H200 probe); "small" is
# fitted on its one probe point. None of the sm_120 figures was measured on an RTX PRO 6000.
MLA_TILE_US = {"ks16": 1.52, "ks16_2stage": 1.75, "ks32": 1.82, "ks32_2stage": 2.10, "large": 3.38,
               "small": 2.13, "ks16_5stage": 1.52}   # 5 stages: within the fit's error of 3 (0.92-1.01x)
MLA_BLOCK_US = 2.75
MLA_COMBINE_US = 5.3
MLA_COMBINE_US_PER_ROW_SPLIT = 0.98e-3    # 4 KB of fp32 partials written + read per (packed row, split)
# bf16 partials: the per-(packed row, split) term x MLA_COMBINE_BF16_SCALE, the bytes ratio
# mla_partial_row_bytes(True) / mla_partial_row_bytes(False) = 1028 / 2052 = 0.501 (the term was fitted on fp32
# partials as bytes written by the main kernel + read by the combine; it also holds per-split latency that does
# not shrink, so this is the optimistic end: docs/history/2026-11-29-attention.md "bf16 split partials"). 1.0 prices bf16 like fp32 (same
# plans for both dtypes). MLA_COMBINE_US (the combine's fixed cost) is unchanged.
MLA_COMBINE_BF16_SCALE = (LATENT_DIM * 2 + 4) / (LATENT_DIM * 4 + 4)
MLA_DRAM_GBPS = 2626.0                    # what the 2-3-stage tiles stream from DRAM with every SM busy
MLA_MODEL_MARGIN = 0.8   # leave the "measured" plan only for a modelled gain > 20% (3x the fit's rms error):
                         # the loosest margin with no shape > 5% slower in the H200 policy run (0.9 had one)
MLA_MAX_WORKSPACE = 256 << 20   # split partials (o, fp32 or bf16, + fp32 lse) of one shape bucket, bytes
_MODEL_GROUPS = (("ks16_5stage", "ks16", "ks16_2stage"), ("ks32", "ks32_2stage"), ("large", "small"))


def _model_candidates(packed_rows: int, max_smem_per_block: int):
    """Configs the "model" policy weighs: from each group the first that fits the device (the deeper
    pipeline where it fits: 3 stages beat 2 in every H200 probe); the 16-row tile only where one m-tile
    holds a stream (it was never timed on longer row ranges)."""
    keys = []
    for group in _MODEL_GROUPS:
        fits = [k for k in group if MLA_CONFIGS[k].smem <= max_smem_per_block]
        if fits and (MLA_CONFIGS[fits[0]].bm > 16 or packed_rows <= 16):
            keys.append(fits[0])
    return keys


def _makespan_us(n_streams: int, m_tiles: int, splits: int, kv_tiles: int, tile_us: float, slots: int) -> float:
    """Greedy list schedule of the grid's blocks over ``slots`` resident-block slots, in launch order.
    A stream's blocks form at most 3 runs of equal duration (full splits, the short last one, empty ones),
    so each run is applied whole: q rounds to every slot, then the remainder to the earliest-free ones."""
    per = -(-kv_tiles // splits)
    full, last = divmod(kv_tiles, per)
    empty = splits - full - (1 if last else 0)
    runs = [(full * m_tiles, per * tile_us + MLA_BLOCK_US)]
    if last:
        runs.append((m_tiles, last * tile_us + MLA_BLOCK_US))
    if empty:
        runs.append((empty * m_tiles, MLA_BLOCK_US))
    t = np.zeros(slots)
    for _ in range(n_streams):
        for count, dur in runs:
            q, rem = divmod(count, slots)
            t += q * dur
            if rem:
                t[:rem] += dur
                t.sort()
    return float(t.max())


def mla_cost_us(config_key: str, splits: int, n_streams: int, max_rows: int, n_heads: int, max_kv_len: int,
                num_sms: int, blocks_per_sm: int, part_bf16: bool = False) -> float:
    """Modelled time of one call (forward + combine) in microseconds; see MLA_TILE_US. ``part_bf16``: the
    split partials are bf16 (the per-(row, split) combine term scaled by the bytes)."""
    cfg = MLA_CONFIGS[config_key]
    m_tiles = -(-max_rows * n_heads // cfg.bm)
    kv_tiles = -(-max_kv_len // cfg.bn)
    t = _makespan_us(n_streams, m_tiles, splits, kv_tiles, MLA_TILE_US[config_key], num_sms * blocks_per_sm)
    t = max(t, n_streams * max_kv_len * ROW_DIM * 2 / (MLA_DRAM_GBPS * 1e3) + MLA_BLOCK_US)
    if splits > 1:
        per = MLA_COMBINE_US_PER_ROW_SPLIT * (MLA_COMBINE_BF16_SCALE if part_bf16 else 1.0)
        t += MLA_COMBINE_US + splits * n_streams * max_rows * n_heads * per
    return t


def mla_split_candidates(config: MlaTileConfig, n_streams: int, max_rows: int, n_heads: int, max_kv_len: int,
                         part_bf16: bool = False):
    """Split counts the model policy considers: no empty split (k splits of ceil(tiles / k) tiles must all
    hold a tile: an empty one costs a block and a combine term for nothing), at most MAX_SPLITS, and the
    workspace bound (the partials, fp32 or bf16, and lse of every packed row per split)."""
    kv_tiles = -(-max_kv_len // config.bn)
    per_split = n_streams * max_rows * n_heads * mla_partial_row_bytes(part_bf16)
    top = max(1, min(kv_tiles, MAX_SPLITS, MLA_MAX_WORKSPACE // per_split))
    return [k for k in range(1, top + 1) if (k - 1) * -(-kv_tiles // k) < kv_tiles]


@functools.lru_cache(maxsize=4096)
def plan_mla_for(n_streams: int, max_rows: int, n_heads: int, max_kv_len: int, policy: str, num_sms: int,
                 max_smem_per_block: int, smem_per_sm: int, part_bf16: bool = False):
    """(config, num_splits) for a shape bucket on a device described by its SM count and shared memory
    (host only, no GPU needed: the CPU tests plan for the H200 and the RTX PRO 6000 with it). ``policy`` is
    "measured" or "model" ("auto" depends on the architecture: resolve_policy). ``part_bf16``: price the
    combine for bf16 split partials (only the "model" policy has a cost to scale; "measured" ignores it)."""
    part_bf16 = bool(part_bf16)
    if policy not in ("measured", "model"):
        raise ValueError(f"policy: expected 'measured' or 'model' (resolve 'auto' with resolve_policy), "
                         f"got {policy!r}")
    measured = choose_mla_config(max_smem_per_block, max_rows * n_heads)
    splits = mla_num_splits(n_streams, max_rows, n_heads, max_kv_len, num_sms, measured,
                            _blocks_per_sm(measured, smem_per_sm))
    if policy == "measured":
        return measured, splits
    best = None   # (modelled us, config, splits)
    for key in _model_candidates(max_rows * n_heads, max_smem_per_block):
        cfg = MLA_CONFIGS[key]
        bps = _blocks_per_sm(cfg, smem_per_sm)
        for k in mla_split_candidates(cfg, n_streams, max_rows, n_heads, max_kv_len, part_bf16):
            t = mla_cost_us(key, k, n_streams, max_rows, n_heads, max_kv_len, num_sms, bps, part_bf16)
            if best is None or t < best[0] * 0.999:   # near-ties: fewer splits, earlier (smaller) tile
                best = (t, cfg, k)
    if best is None:
        raise ValueError(f"no modelled MLA tile configuration fits {max_smem_per_block} bytes of shared memory")
    # leave the measured plan only for a modelled gain larger than the fit's error
    key = next(k for k, c in MLA_CONFIGS.items() if c == measured)
    if key in MLA_TILE_US:
        t_measured = mla_cost_us(key, splits, n_streams, max_rows, n_heads, max_kv_len, num_sms,
                                 _blocks_per_sm(measured, smem_per_sm), part_bf16)
        if best[0] > MLA_MODEL_MARGIN * t_measured:
            return measured, splits
    return best[1], best[2]


def resolve_policy(policy: str, arch: str) -> str:
    """"auto" -> "model" on sm_90 (fitted and measured there), "measured" on other architectures."""
    if policy not in MLA_POLICIES:
        raise ValueError(f"policy: expected one of {MLA_POLICIES}, got {policy!r}")
    if policy != "auto":
        return policy
    return "model" if arch == "sm_90" else "measured"


def plan_mla(n_streams: int, max_rows: int, n_heads: int, max_kv_len: int, policy: Optional[str] = None,
             part_bf16: Optional[bool] = None):
    """(config, num_splits) for a shape bucket on the current device; policy None = MLA_POLICY, part_bf16
    None = mla_partial_bf16() (the partial dtype the launch will use)."""
    num_sms, smem_block = _device_attrs()
    pb = mla_partial_bf16() if part_bf16 is None else bool(part_bf16)
    return plan_mla_for(n_streams, max_rows, n_heads, max_kv_len, resolve_policy(policy or MLA_POLICY, _device_arch()),
                        num_sms, smem_block, _smem_per_sm(), pb)


def _device_arch() -> str:
    from .compile import device_arch
    return device_arch()


def _blocks_per_sm(cfg: MlaTileConfig, smem_per_sm: Optional[int] = None) -> int:
    """Resident blocks per SM by shared memory and threads; registers cap mla_attn_ksplit: 217 per thread
    for 32 rows (one 8-warp block), 141 for 16 rows with 3 or 5 stages (sm_90 ptxas report); 16 rows with 2
    stages (128) fit two blocks by registers where shared memory allows."""
    if smem_per_sm is None:
        smem_per_sm = _smem_per_sm()
    bps = max(1, min(smem_per_sm // (cfg.smem + 1024), 2048 // cfg.threads))
    if cfg.ksplit and cfg.mg > 1:
        bps = 1
    return bps


class MlaWorkspace:
    """Split partials for one shape bucket: allocate once (outside graph capture) and reuse.

    part_o   [splits, total_rows * H, 512]  float32, or uint16 (bf16 bits) with ``part_bf16``
    part_lse [splits, total_rows * H]       float32 (log2-sum-exp, -inf for an empty split)
    ``part_bf16`` None = mla_partial_bf16() (the module rule / DDT_MLA_PARTIAL_BF16); a launch with this
    workspace uses the kernels of the workspace's dtype."""

    def __init__(self, num_splits: int, total_rows: int, n_heads: int, part_bf16: Optional[bool] = None):
        import cupy
        self.num_splits = num_splits
        self.total_packed = total_rows * n_heads
        self.part_bf16 = mla_partial_bf16() if part_bf16 is None else bool(part_bf16)
        n = max(num_splits, 1)
        self.part_o = cupy.empty((n, self.total_packed, LATENT_DIM),
                                 dtype=cupy.uint16 if self.part_bf16 else cupy.float32)
        self.part_lse = cupy.empty((n, self.total_packed), dtype=cupy.float32)

    @staticmethod
    def nbytes_for(num_splits: int, total_rows: int, n_heads: int, part_bf16: bool) -> int:
        """Device bytes of a workspace of this size (host only)."""
        return max(num_splits, 1) * total_rows * n_heads * mla_partial_row_bytes(part_bf16)

    @property
    def nbytes(self) -> int:
        return int(self.part_o.nbytes + self.part_lse.nbytes)


def mla_attention(q, pool, block_table, prefix_len, n_rows, row_start, *, softmax_scale: float,
                  max_rows: int, max_kv_len: int, mask=None, out=None, num_splits: Optional[int] = None,
                  config: Optional[MlaTileConfig] = None, workspace: Optional[MlaWorkspace] = None,
                  stream=None, spec: Optional[KernelSpec] = None, combine_unroll_override: Optional[int] = None,
                  part_bf16: Optional[bool] = None):
    """Absorbed MLA attention; returns ``out`` (uint16 bf16 [total_rows, H, 512], o_lat before W_UV).

    q            uint16 [total_rows, H, 576]  q_lat (512) | rotated q_pe (64), per query row and head
    pool         uint16 [num_pages, 64, 576]  this layer's latent pool
    block_table  int32 [S, max_pages]          page ids per stream
    prefix_len   int32 [S]  committed length s: every row sees cache positions [0, s)
    n_rows       int32 [S]  query rows of the stream (1..max_rows); their KV sits at positions s .. s+n-1
    row_start    int32 [S]  first row of the stream in q / out
    mask         uint32 [S, R, 5] ancestor mask (tree mode: row i sees s + j iff bit j of row i), or None
                 for causal mode (row i sees s + j for j <= i: decode, chain, prefill chunks)
    max_rows / max_kv_len: the shape bucket's bounds (>= every stream's n_rows / s + n_rows); they fix the
                 grid and the split count, so a graph captured for the bucket serves any lengths inside it.
    config / num_splits: override the plan (tests, benchmarks); workspace: preallocated split partials
                 (required for graph capture when the plan splits); spec: a profiling build of the kernels
                 (it must name the config's kernel and, when the plan splits, the combine).
    combine_unroll_override: 1 or 4 splits per combine warp in flight instead of combine_unroll's rule (tests,
                 benchmarks).
    part_bf16:   split partials in bf16 (True) or fp32 (False); None = the workspace's dtype when one is
                 given, else mla_partial_bf16(). Plans with one split write o_lat directly either way.
    """
    import cupy
    dims: dict = {}
    dev = current_device()
    check_array("q", q, np.uint16, ("T", "H", ROW_DIM), dims, device=dev)
    check_array("pool", pool, np.uint16, (None, PAGE_SIZE, ROW_DIM), dims, device=dev)
    check_array("block_table", block_table, np.int32, ("S", None), dims, device=dev)
    for name, arr in (("prefix_len", prefix_len), ("n_rows", n_rows), ("row_start", row_start)):
        check_array(name, arr, np.int32, ("S",), dims, device=dev)
    T, H, S = dims["T"], dims["H"], dims["S"]
    check_range("max_rows", max_rows, 1, max(T, 1))
    check_range("max_kv_len", max_kv_len, 1, block_table.shape[1] * PAGE_SIZE)
    if mask is not None:
        check_array("mask", mask, np.uint32, ("S", None, MASK_WORDS), dims, device=dev)
        if max_rows > mask.shape[1] or max_rows > MAX_TREE_ROWS:
            raise ValueError(f"max_rows: tree mode supports at most {min(mask.shape[1], MAX_TREE_ROWS)} rows "
                             f"per stream (mask has {mask.shape[1]}), got {max_rows}")
    if not (isinstance(softmax_scale, (float, int, np.floating)) and math.isfinite(softmax_scale)
            and softmax_scale > 0):
        raise ValueError(f"softmax_scale: must be a positive finite number, got {softmax_scale!r}")
    if out is None:
        out = cupy.empty((T, H, LATENT_DIM), dtype=cupy.uint16)
    check_array("out", out, np.uint16, ("T", "H", LATENT_DIM), dims, device=dev)
    num_sms, smem_limit = _device_attrs()
    # one partial dtype for the plan, the workspace and the kernels
    if part_bf16 is None:
        part_bf16 = workspace.part_bf16 if workspace is not None else mla_partial_bf16()
    part_bf16 = bool(part_bf16)
    if workspace is not None and workspace.part_bf16 != part_bf16:
        raise ValueError(f"workspace: holds {'bf16' if workspace.part_bf16 else 'fp32'} partials, the launch "
                         f"asks for {'bf16' if part_bf16 else 'fp32'} (part_bf16={part_bf16})")
    if spec is not None and spec_part_bf16(spec) != part_bf16:
        raise ValueError(f"spec: built for {'bf16' if spec_part_bf16(spec) else 'fp32'} partials "
                         f"(MLA_PART_BF16), the launch uses {'bf16' if part_bf16 else 'fp32'}")
    spec = spec or mla_spec(part_bf16)
    plan_cfg, plan_splits = plan_mla(S, max_rows, H, max_kv_len, part_bf16=part_bf16)
    if config is None:
        config = plan_cfg
    elif config.smem > smem_limit:
        raise ValueError(f"config: needs {config.smem} bytes of shared memory, the device allows {smem_limit}")
    if num_splits is None:
        if workspace is not None:
            num_splits = workspace.num_splits
        elif config == plan_cfg:
            num_splits = plan_splits
        else:
            num_splits = mla_num_splits(S, max_rows, H, max_kv_len, num_sms, config, _blocks_per_sm(config))
    check_range("num_splits", num_splits, 1, MAX_SPLITS)
    if num_splits > 1:
        if workspace is None:
            workspace = MlaWorkspace(num_splits, T, H, part_bf16=part_bf16)
        if workspace.num_splits < num_splits or workspace.total_packed != T * H:
            raise ValueError(f"workspace: sized for {workspace.num_splits} splits x {workspace.total_packed} "
                             f"packed rows, launch needs {num_splits} x {T * H}")
        part_o, part_lse = workspace.part_o, workspace.part_lse
    else:
        part_o = part_lse = None
    fwd = get_kernel(spec, config.name, config.smem)
    m_tiles = -(-max_rows * H // config.bm)
    null = np.uintp(0)
    args = (q, pool, block_table, prefix_len, n_rows, row_start,
            mask if mask is not None else null, out,
            part_o if part_o is not None else null, part_lse if part_lse is not None else null,
            np.int32(block_table.shape[1]), np.int32(mask.shape[1] if mask is not None else 0), np.int32(H),
            np.int32(T * H), np.int32(num_splits), np.float32(float(softmax_scale) * LOG2E))
    st = stream if stream is not None else cupy.cuda.get_current_stream()
    with st:
        fwd((m_tiles, num_splits, S), (config.threads,), args, shared_mem=config.smem)
        if num_splits > 1:
            u = combine_unroll_override or combine_unroll(max_rows * H * S, num_sms)
            if u not in (1, COMBINE_UNROLL):
                raise ValueError(f"combine_unroll_override: expected 1 or {COMBINE_UNROLL}, got {u}")
            comb = get_kernel(spec, f"mla_attn_combine<{u}>")
            comb((max_rows * H, S), (256,),
                 (part_o, part_lse, n_rows, row_start, np.int32(H), np.int32(T * H), np.int32(num_splits), out))
    return out


def drafter_num_splits(n_streams: int, kv_heads: int, max_ctx_len: int, block_rows: int, num_sms: int) -> int:
    """Two blocks for every SM (70 KB of shared memory each: 1 per SM on sm_120, 3 fit on the H200), at
    least one 64-token tile per split."""
    tiles = -(-(max_ctx_len + block_rows) // DRAFTER_TILE)
    want = -(-2 * num_sms // (n_streams * kv_heads))
    return max(1, min(want, tiles, MAX_SPLITS))


class DrafterWorkspace:
    def __init__(self, num_splits: int, n_streams: int, block_rows: int, q_heads: int):
        import cupy
        self.num_splits = num_splits
        self.total_rows = n_streams * block_rows * q_heads
        n = max(num_splits, 1)
        self.part_o = cupy.empty((n, self.total_rows, DRAFTER_HEAD_DIM), dtype=cupy.float32)
        self.part_lse = cupy.empty((n, self.total_rows), dtype=cupy.float32)


def drafter_attention(q, k_block, v_block, k_cache, v_cache, ctx_len, *, softmax_scale: float,
                      max_ctx_len: int, window: int = 0, out=None, num_splits: Optional[int] = None,
                      workspace: Optional[DrafterWorkspace] = None, stream=None):
    """DFlash drafter attention; returns ``out`` uint16 bf16 [S, BR, Hq, 128].

    q        uint16 [S, BR, Hq, 128]   block queries (normed, rotated)
    k_block, v_block uint16 [S, BR, Hkv, 128]  the block's own K/V (seen by every block row)
    k_cache, v_cache uint16 [S, C, Hkv, 128]   drafter context cache, position p in slot p % C
    ctx_len  int32 [S]  committed context length; rows see positions [max(0, len - window), len) (all of
             [0, len) when window == 0; then len must be <= C) plus the BR block rows, no causal mask
    max_ctx_len: the bucket's bound on the context actually read (fixes the split count).
    """
    import cupy
    dims: dict = {}
    dev = current_device()
    check_array("q", q, np.uint16, ("S", "BR", "Hq", DRAFTER_HEAD_DIM), dims, device=dev)
    check_array("k_block", k_block, np.uint16, ("S", "BR", "Hkv", DRAFTER_HEAD_DIM), dims, device=dev)
    check_array("v_block", v_block, np.uint16, ("S", "BR", "Hkv", DRAFTER_HEAD_DIM), dims, device=dev)
    check_array("k_cache", k_cache, np.uint16, ("S", "C", "Hkv", DRAFTER_HEAD_DIM), dims, device=dev)
    check_array("v_cache", v_cache, np.uint16, ("S", "C", "Hkv", DRAFTER_HEAD_DIM), dims, device=dev)
    check_array("ctx_len", ctx_len, np.int32, ("S",), dims, device=dev)
    S, BR, Hq, Hkv, C = dims["S"], dims["BR"], dims["Hq"], dims["Hkv"], dims["C"]
    if Hq % Hkv:
        raise ValueError(f"q: {Hq} query heads are not a multiple of the {Hkv} kv heads")
    if BR * (Hq // Hkv) > DRAFTER_MAX_PACKED:
        raise ValueError(f"q: block rows x heads per kv head = {BR} x {Hq // Hkv} exceeds "
                         f"{DRAFTER_MAX_PACKED} (kernel limit)")
    check_range("window", window, 0, C)
    check_range("max_ctx_len", max_ctx_len, 0, 1 << 30)
    if not (isinstance(softmax_scale, (float, int, np.floating)) and math.isfinite(softmax_scale)
            and softmax_scale > 0):
        raise ValueError(f"softmax_scale: must be a positive finite number, got {softmax_scale!r}")
    if out is None:
        out = cupy.empty((S, BR, Hq, DRAFTER_HEAD_DIM), dtype=cupy.uint16)
    check_array("out", out, np.uint16, ("S", "BR", "Hq", DRAFTER_HEAD_DIM), dims, device=dev)
    read_len = min(max_ctx_len, window) if window else max_ctx_len
    if num_splits is None:
        num_splits = workspace.num_splits if workspace is not None else \
            drafter_num_splits(S, Hkv, read_len, BR, _device_attrs()[0])
    check_range("num_splits", num_splits, 1, MAX_SPLITS)
    null = np.uintp(0)
    part_o = part_lse = None
    if num_splits > 1:
        if workspace is None:
            workspace = DrafterWorkspace(num_splits, S, BR, Hq)
        if workspace.num_splits < num_splits or workspace.total_rows != S * BR * Hq:
            raise ValueError(f"workspace: sized for {workspace.num_splits} splits x {workspace.total_rows} rows, "
                             f"launch needs {num_splits} x {S * BR * Hq}")
        part_o, part_lse = workspace.part_o, workspace.part_lse
    fwd = get_kernel(DRAFTER_SPEC, "drafter_attn_fwd", DRAFTER_SMEM)
    st = stream if stream is not None else cupy.cuda.get_current_stream()
    with st:
        fwd((num_splits, Hkv, S), (DRAFTER_THREADS,),
            (q, k_block, v_block, k_cache, v_cache, ctx_len, np.int32(C), np.int32(window), np.int32(BR),
             np.int32(Hq), np.int32(Hkv), np.float32(float(softmax_scale) * LOG2E), np.int32(num_splits), out,
             part_o if part_o is not None else null, part_lse if part_lse is not None else null),
            shared_mem=DRAFTER_SMEM)
        if num_splits > 1:
            rows = S * BR * Hq
            # 128-wide rows: 4 splits in flight cost no extra registers (32 on sm_90), so always 4
            comb = get_kernel(DRAFTER_SPEC, f"drafter_attn_combine<{COMBINE_UNROLL}>")
            comb((rows,), (256,), (part_o, part_lse, np.int32(rows), np.int32(num_splits), out))
    return out
