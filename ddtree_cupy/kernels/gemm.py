"""Skinny bf16 GEMM (cuda_src/gemm_bf16.cu): y[T, N] = x[T, K] @ W[N, K]^T, fp32 accumulate.

Decode shapes: T = 1..160 tokens, K 64..7168, N 16..20480. The weight is streamed once; split-K spreads a
narrow weight over every SM. Optional batch dimension (per-head products): x [B, T, K], w [B, N, K],
out [B, T, N]; x and out may be strided views (inner dimension contiguous, 16-byte aligned rows).
Two kernel families serve a call, chosen by ``use_decode`` (overridable with ``set_variant``):
 * "splitk": ``gemm_bf16_kernel`` (64 weight rows per block, split-K across blocks, fp32 partials in a
   workspace summed by ``gemm_splitk_reduce``, a second launch); every T <= 160;
 * "decode": ``gemm_bf16_kernel_decode`` / ``_decode_cl`` (T <= 16: 16 RT weight rows per block, K split
   across the block's 8 warps and, for CS > 1, across a cluster of CS blocks, reduced in (distributed)
   shared memory: one launch, no workspace). ``choose_decode`` picks the config (``set_decode_config``
   forces one);
 * "wide": ``gemm_bf16_kernel_wide`` (T = 17..160: 2-D block tiles of 128 weight rows x 32-80 tokens,
   split-K across blocks through the same workspace + reduce) and ``gemm_bf16_kernel_wide_cl`` (the K split
   over a thread-block cluster, reduced through distributed shared memory: one launch, no workspace; revision
   8); ``choose_wide`` picks block shape and split.
   The default above 16 tokens since the H200 run that confirmed the wide rule (``WIDE_DEFAULT``; env DDT_GEMM_WIDE=0/1,
   ``set_variant("wide")``; docs/KERNELS.md "Wide-token kernel").
Every kernel obeys the PDL rule (``pdl=True``): with ``launch.set_pdl(True)`` they launch through
cuLaunchKernelEx with programmatic dependent launch (kernels/launch.py).
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import numpy as np

from .. import knobs
from .checks import check_array, check_multiple, check_range, check_rows
from .compile import KernelSpec, get_kernel, register

BN, BK, THREADS = 64, 64, 128
MAX_T = 160
NT_CHOICES = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20)     # token tiles of 8 compiled; T rounds up to one
SMEM_BUDGET = 96 * 1024                              # below sm_120's 99 KB per block


def stages_for(nt: int) -> int:
    """Pipeline depth: as many stages (<= 6) as fit the shared-memory budget."""
    return min(6, SMEM_BUDGET // ((BN + nt * 8) * BK * 2))


def smem_bytes(nt: int) -> int:
    return stages_for(nt) * (BN + nt * 8) * BK * 2


def _name(nt: int, out_f32: bool) -> str:
    return f"gemm_bf16_kernel<{nt}, {stages_for(nt)}, {'true' if out_f32 else 'false'}>"


# Decode family (T <= 16): a block = RT m16 row tiles x its K range x all tokens (NT n8 tiles); the block's
# DEC_WARPS warps are RT row tiles x (DEC_WARPS / RT) K slices, each with its own ring of (16 + 8 NT) rows
# x BK per stage; CS > 1 splits K over a cluster of CS blocks (distributed shared memory reduction).
DEC_ROWS, DEC_WARPS = 16, 8
DEC_THREADS = 32 * DEC_WARPS
DEC_MAX_T = 16
DEC_NT = (1, 2)


class DecodeConfig(NamedTuple):
    nt: int        # n8 token tiles (T <= 8 nt)
    stages: int    # ring depth per warp
    rt: int        # m16 row tiles per block
    cs: int        # blocks per cluster splitting K (1: no cluster)

    def smem(self) -> int:
        return DEC_WARPS * self.stages * (DEC_ROWS + 8 * self.nt) * BK * 2

    def rows(self) -> int:
        return DEC_ROWS * self.rt

    def name(self, out_f32: bool) -> str:
        f = "true" if out_f32 else "false"
        if self.cs == 1:      # the output type last, as in every GEMM kernel (tests/_kernel_emul.py reads it)
            return f"gemm_bf16_kernel_decode<{self.nt}, {self.stages}, {self.rt}, {f}>"
        return f"gemm_bf16_kernel_decode_cl<{self.nt}, {self.stages}, {self.cs}, {f}>"


def dec_stages(nt: int) -> int:
    """Full ring depth per warp: as many stages (<= 6) as fit the shared-memory budget (NT 1: 4, NT 2: 3)."""
    return min(6, SMEM_BUDGET // (DEC_WARPS * (DEC_ROWS + 8 * nt) * BK * 2))


def dec_smem_bytes(nt: int) -> int:
    return DecodeConfig(nt, dec_stages(nt), 1, 1).smem()


# Every compiled decode config (the selection below picks only from these; the tests run each one).
# The light ring (NT = 1, 3 stages, 72 KB) lets 3 blocks share an H200 SM (gate+up: 288 blocks, 396 slots).
DEC_CONFIGS = tuple(DecodeConfig(nt, dec_stages(nt), rt, cs) for nt in DEC_NT
                    for rt, cs in ((1, 1), (2, 1), (4, 1), (1, 2), (1, 4))) + (DecodeConfig(1, 3, 1, 1),)
DEC_CS_MIN_K_TILES = 24        # a cluster split must leave each block >= 24 k tiles (3 per warp)
DEC_RT_MIN_TILES_PER_WARP = 2  # RT > 1 must leave each warp >= 2 k tiles
DEC_THIN_TAIL = 1.5            # base grids of (1, 1.5) waves: light ring (NT 1) or split-K (NT 2)


def _dec_base(nt: int) -> DecodeConfig:
    return DecodeConfig(nt, dec_stages(nt), 1, 1)


def _slots(c: DecodeConfig, sm_count: int, smem_per_sm: int) -> int:
    return sm_count * max(1, smem_per_sm // (c.smem() + 1024))


def choose_decode(T: int, N: int, K: int, batch: int = 1, sm_count: int = 132,
                  smem_per_sm: int = 228 * 1024) -> Optional[DecodeConfig]:
    """The decode config for a call (docs/history/2026-11-29-kernels.md "Decode configs"), a rule fitted to the H200 run of every
    config at the engine's shapes. With B = N / 16 x batch base blocks (one m16 tile each) and W waves of
    resident full-ring blocks:
     * B < SMs: a cluster K split: among CS in 2, 4 that keep >= DEC_CS_MIN_K_TILES k tiles per block and
       fit one wave, the smallest with B x CS >= SMs, else the largest (drafter qkv CS 2, router / shared
       gate+up CS 4; q_b stays at the base);
     * 1 < W < DEC_THIN_TAIL (a thin second wave): NT 1: the light ring if the grid then fits one wave
       (dense gate+up); NT 2: None, i.e. split-K (it measured faster than every decode config there);
     * W >= DEC_THIN_TAIL: the smallest RT in 2, 4 that fits one wave with >= DEC_RT_MIN_TILES_PER_WARP k
       tiles per warp (o_proj, dense down RT 2; shared down RT 4); else the base (lm_head);
     * otherwise the base (q_a+kv_a: 132 blocks; its cluster split measured slower)."""
    nt = 1 if T <= 8 else 2
    base = _dec_base(nt)
    k_tiles = K // BK
    blocks = N // DEC_ROWS * batch
    if blocks < sm_count:
        ok = [c for c in (DecodeConfig(nt, base.stages, 1, cs) for cs in (2, 4))
              if k_tiles // c.cs >= DEC_CS_MIN_K_TILES and blocks * c.cs <= _slots(c, sm_count, smem_per_sm)]
        full = [c for c in ok if blocks * c.cs >= sm_count]
        return full[0] if full else (ok[-1] if ok else base)
    waves = blocks / _slots(base, sm_count, smem_per_sm)
    if waves <= 1:
        return base
    if waves < DEC_THIN_TAIL:
        if nt == 1:
            light = DecodeConfig(1, 3, 1, 1)
            if blocks <= _slots(light, sm_count, smem_per_sm):
                return light
            return base
        return None
    for rt in (2, 4):
        c = DecodeConfig(nt, base.stages, rt, 1)
        if (N % c.rows() == 0 and blocks // rt <= _slots(c, sm_count, smem_per_sm)
                and k_tiles / (DEC_WARPS // rt) >= DEC_RT_MIN_TILES_PER_WARP):
            return c
    return base


# Wide-token family (T = 17..160, docs/KERNELS.md "Wide-token kernel"): a block = BM = 16 WM WARPS_M weight rows x
# BT = 8 WN WARPS_N tokens, WARPS_M x WARPS_N warps each holding WM m16 x WN n8 fragment tiles, one ring of
# STAGES x (BM + BT) rows x BK shared by the block; K split across blocks (workspace + gemm_splitk_reduce).
WIDE_MIN_T = DEC_MAX_T + 1


class WideConfig(NamedTuple):
    wm: int        # m16 weight tiles per warp
    wn: int        # n8 token tiles per warp
    warps_m: int   # warps along the weight rows
    warps_n: int   # warps along the tokens
    stages: int    # ring depth
    cs: int = 1    # > 1: K split over a cluster of cs blocks, reduced in distributed shared memory (split = cs)

    def bm(self) -> int:
        return 16 * self.wm * self.warps_m

    def bt(self) -> int:
        return 8 * self.wn * self.warps_n

    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    def smem(self) -> int:
        return self.stages * (self.bm() + self.bt()) * BK * 2

    def name(self, out_f32: bool) -> str:
        f = "true" if out_f32 else "false"
        if self.cs == 1:
            return f"gemm_bf16_kernel_wide<{self.wm}, {self.wn}, {self.warps_m}, {self.warps_n}, {self.stages}, {f}>"
        return (f"gemm_bf16_kernel_wide_cl<{self.wm}, {self.wn}, {self.warps_m}, {self.warps_n}, {self.stages}, "
                f"{self.cs}, {f}>")


def _wide(wm: int, wn: int, warps_m: int, warps_n: int) -> WideConfig:
    """As many stages (<= 4) as fit the shared-memory budget."""
    per = (16 * wm * warps_m + 8 * wn * warps_n) * BK * 2
    return WideConfig(wm, wn, warps_m, warps_n, min(4, SMEM_BUDGET // per))


# 8 warps (4 x 2, 32-row warp tiles): BM 128 x BT 32 (4 stages, 80 KB), 64 (4, 96 KB), 80 (3, 78 KB); 4 warps
# (2 x 2, 64-row warp tiles: 0.375 / 0.35 ldmatrix per mma instead of 0.5): BT 64 (the rule's pick for 81-128
# tokens) and 80 (129-160). Every compiled config; the tests run each one. (BT 160 with 8 warps,
# WN 10, was built and dropped: 80 accumulators per thread spill on sm_90 under the 128-register cap.)
WIDE_RULE_CONFIGS = (_wide(2, 2, 4, 2), _wide(2, 4, 4, 2), _wide(2, 5, 4, 2), _wide(4, 4, 2, 2), _wide(4, 5, 2, 2))
# Every block shape also with its K split over a cluster of 2, 4 or 8 blocks (in-kernel reduction
# through distributed shared memory instead of the workspace + reduce launch), and a 64-row x 32-token block of
# 4 warps (2 x 2, 32 x 16 warp tiles, 48 KB) for narrow weights (q_a+kv_a 2112 rows: 33 row blocks) under the
# cluster's split cap of 8. The 64-row block won only q_b and drafter qkv at some T, by <= 20% (sweep only).
WIDE_CL_CS = (2, 4, 8)
WIDE_BM64 = _wide(2, 2, 2, 2)
WIDE_BT80_W4 = WIDE_RULE_CONFIGS[4]
_WIDE_SHAPES = WIDE_RULE_CONFIGS + (WIDE_BM64,)
WIDE_CONFIGS = _WIDE_SHAPES + tuple(c._replace(cs=cs) for cs in WIDE_CL_CS for c in _WIDE_SHAPES)
WIDE_FILL_TILES = 3          # cost model: a block's ring fill + epilogue, in k tiles
WIDE_TILE_US = 1.1           # cost model (H200 fit): one k tile of one wave of resident blocks, us
WIDE_REDUCE_LAUNCH_US = 2.0  # cost model: the split-K reduce launch, us
WIDE_REDUCE_BPS = 3e12       # cost model: bytes/s of the partials' write + read
WIDE_MIN_K_TILES = 4         # a split keeps >= 4 k tiles per block
WIDE_CL_TILE_FACTOR = 1.2    # cost model (H200 fit): a k tile of a cluster-split block, x the others'
WIDE_CL_MIN_K_TILES = 2      # a cluster split keeps >= 2 k tiles per block (q_b, 24 k tiles: 8 x 3 won)
# Whether choose_wide may pick a cluster split. False is the measuring baseline (the rule before the cluster
# split): `bench.step --no-wide-cluster`, `bench.kernels --variant nocl` set it to compare in one process.
WIDE_CLUSTER = True


def wide_config_for(T: int) -> WideConfig:
    """The block shape for T tokens, fitted to the H200 sweep of docs/history/2026-11-29-kernels.md "Wide rule confirmed"
    and, above 128 rows, the cluster-split sweep: one token tile of 32 / 64 / 80 (8 warps, 32-row warp tiles) up to
    T = 80, then two token tiles of the 4-warp block (64-row warp tiles: fewer ldmatrix per mma), 64 wide up
    to 128 rows and 80 wide above (T = 144-160: three 64-token tiles measured 7-52% slower than two of 80,
    6 of the 7 shapes; gemm_s8_wide160_h200.json (in git history))."""
    if T <= 32:
        return WIDE_RULE_CONFIGS[0]
    if T <= 64:
        return WIDE_RULE_CONFIGS[1]
    if T <= 80:
        return WIDE_RULE_CONFIGS[2]
    if T <= 128:
        return WIDE_RULE_CONFIGS[3]
    return WIDE_RULE_CONFIGS[4]


def wide_split(cfg: WideConfig, T: int, N: int, K: int, batch: int = 1, sm_count: int = 132,
               smem_per_sm: int = 228 * 1024) -> int:
    """Split-K factor for a wide config: with B = token tiles x row blocks x batch base blocks and
    slots = SMs x the blocks of this config that fit an SM's shared memory, the split s minimising
    ceil(B s / slots) x (ceil(kt / s) + WIDE_FILL_TILES) x WIDE_TILE_US -- waves of resident blocks times the
    k tiles each streams plus its fill -- plus, for s > 1, the reduce: its launch and the fp32 partials written
    and read (2 s T N 4 bytes at WIDE_REDUCE_BPS); over s <= kt / WIDE_MIN_K_TILES, ties -> the smaller s.
    Fitted to the H200 sweep of docs/history/2026-11-29-kernels.md "Wide rule confirmed": the fastest split of a shape
    fills the 2 x 132 slots once (224-260 blocks) unless its partials are large (T = 160: s 1-2). The first
    version counted one block per SM and split half as far (up to 40% slower). Workspaces are sized with
    ``workspace_split``."""
    k_tiles = K // BK
    cfg = cfg._replace(cs=1)
    return min(range(1, max(1, k_tiles // WIDE_MIN_K_TILES) + 1),
               key=lambda s: (_wide_cost_us(cfg, s, T, N, K, batch, sm_count, smem_per_sm), s))


def _wide_cost_us(cfg: WideConfig, s: int, T: int, N: int, K: int, batch: int, sm_count: int,
                  smem_per_sm: int) -> float:
    """The split model of ``wide_split`` for split s of block shape cfg: waves of resident blocks x (k tiles
    per block + fill) x WIDE_TILE_US, plus the reduce for a workspace split (cfg.cs == 1, s > 1); a cluster
    split (cfg.cs == s) has no reduce but its k tiles cost WIDE_CL_TILE_FACTOR x (fitted to the cluster-split
    sweep: its blocks are co-scheduled in cluster groups and end in the DSMEM exchange)."""
    k_tiles = K // BK
    blocks = math.ceil(T / cfg.bt()) * math.ceil(N / cfg.bm()) * batch
    slots = sm_count * max(1, smem_per_sm // (cfg.smem() + 1024))
    per = math.ceil(k_tiles / s) * (WIDE_CL_TILE_FACTOR if cfg.cs > 1 else 1.0)
    c = math.ceil(blocks * s / slots) * (per + WIDE_FILL_TILES) * WIDE_TILE_US
    if s > 1 and cfg.cs == 1:
        c += WIDE_REDUCE_LAUNCH_US + 2 * s * batch * T * N * 4 / WIDE_REDUCE_BPS * 1e6
    return c


def choose_wide(T: int, N: int, K: int, batch: int = 1, sm_count: int = 132,
                smem_per_sm: int = 228 * 1024):
    """(WideConfig, split) for a call, or None where the wide family does not serve it (T <= 16: the
    decode family's range). The block shape is ``wide_config_for(T)``; the K split is ``wide_split``'s
    workspace split unless (WIDE_CLUSTER) a cluster of cs in WIDE_CL_CS blocks (>= WIDE_CL_MIN_K_TILES k tiles
    each) costs less in the same model (docs/KERNELS.md "Wide kernel: K split over a thread-block cluster"): short-K weights (o_proj, dense down,
    q_b) go to the cluster, long-K narrow ones (q_a+kv_a, gate+up, router, drafter qkv: best at 14-28
    workspace splits, beyond the cluster's 8) stay on the workspace."""
    if T < WIDE_MIN_T or T > MAX_T:
        return None
    cfg = wide_config_for(T)
    best = (cfg, wide_split(cfg, T, N, K, batch, sm_count, smem_per_sm))
    if WIDE_CLUSTER:
        cands = [best] + [(cfg._replace(cs=cs), cs) for cs in WIDE_CL_CS if K // BK >= WIDE_CL_MIN_K_TILES * cs]
        best = min(cands, key=lambda c: _wide_cost_us(c[0], c[1], T, N, K, batch, sm_count, smem_per_sm))
    return best


def workspace_split(T: int, N: int, K: int, batch: int = 1, sm_count: int = 132,
                    smem_per_sm: int = 228 * 1024) -> int:
    """The largest split factor ``gemm_bf16`` may use for this shape with either kernel family (the workspace
    needs batch x this x T x N floats when it is > 1): model code sizes its shared workspace with it."""
    s = choose_split(T, N, K, batch, sm_count)
    if T < WIDE_MIN_T or T > MAX_T:
        return s
    # the workspace split of the rule's block shape, whether or not the rule takes a cluster split now (it
    # needs no workspace; WIDE_CLUSTER = False may turn it off after the models sized their workspaces)
    return max(s, wide_split(wide_config_for(T), T, N, K, batch, sm_count, smem_per_sm))


_SPLITK_NAMES = tuple(_name(nt, f) for f in (False, True) for nt in NT_CHOICES)
SPEC = register(KernelSpec(
    src="gemm_bf16.cu",
    names=_SPLITK_NAMES + tuple(c.name(f) for f in (False, True) for c in DEC_CONFIGS)
    + tuple(c.name(f) for f in (False, True) for c in WIDE_CONFIGS)
    + ("gemm_splitk_reduce<false>", "gemm_splitk_reduce<true>"),
    hot=True, pdl=True,      # every kernel waits (DDT_PDL_WAIT) before reading activations or writing
    doc="skinny bf16 GEMM, mma.sync m16n8k16 + ldmatrix + cp.async ring: decode (in-block / cluster K split) "
        "split-K and wide-token kernels"))

VARIANTS = ("auto", "splitk", "decode", "wide")
_VARIANT = ["auto"]
_FORCED_DEC = [None]
_FORCED_WIDE = [None]
# Whether "auto" sends T = 17..160 to the wide family: on since the H200 run of docs/history/2026-11-29-kernels.md
# "Wide rule confirmed"; env DDT_GEMM_WIDE=0/1 overrides, set_wide(b) too.
WIDE_DEFAULT = True
_WIDE = [None]


def _env_wide() -> bool:
    v = knobs.get().gemm_wide
    return WIDE_DEFAULT if v is None else v


def wide_enabled() -> bool:
    """Whether the rule ("auto") uses the wide family above 16 tokens: set_wide, else DDT_GEMM_WIDE, else
    WIDE_DEFAULT."""
    return _env_wide() if _WIDE[0] is None else _WIDE[0]


def set_wide(on: Optional[bool]) -> Optional[bool]:
    """Turn the wide family on/off for "auto" (None: back to DDT_GEMM_WIDE / WIDE_DEFAULT); returns the
    old setting."""
    if on is not None and not isinstance(on, bool):
        raise ValueError(f"on: True, False or None, got {on!r}")
    old, _WIDE[0] = _WIDE[0], on
    return old


def set_wide_config(cfg) -> Optional[tuple]:
    """Force (WideConfig, split) for every wide call (tests, bench), or None for ``choose_wide``. The split
    is clamped to K / 64 k tiles at the call."""
    if cfg is not None:
        if not (isinstance(cfg, tuple) and len(cfg) == 2 and cfg[0] in WIDE_CONFIGS
                and isinstance(cfg[1], int) and cfg[1] >= 1):
            raise ValueError(f"cfg: (a WideConfig of WIDE_CONFIGS, split >= 1), got {cfg!r}")
        if cfg[0].cs > 1 and cfg[1] != cfg[0].cs:
            raise ValueError(f"cfg: a cluster config splits K over its cs = {cfg[0].cs} blocks; split must be "
                             f"{cfg[0].cs}, got {cfg[1]}")
    old, _FORCED_WIDE[0] = _FORCED_WIDE[0], cfg
    return old


def set_variant(variant: str) -> str:
    """Force a kernel family for every call, or back to the rule ("auto"); returns the old setting.
    "splitk": the split-K kernel at every T; "decode": the decode family for every T <= 16 (split-K above);
    "wide": the rule at T <= 16, the wide family at T = 17..160 (whatever ``wide_enabled`` says). An explicit ``split_k`` always means the split-K kernel."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: one of {VARIANTS}, got {variant!r}")
    old, _VARIANT[0] = _VARIANT[0], variant
    return old


def set_decode_config(cfg: Optional[DecodeConfig]) -> Optional[DecodeConfig]:
    """Force one decode config (tests, bench) for every decode call, or None for ``choose_decode``; a
    config that cannot serve a call (other NT, N not a multiple of its rows) raises ValueError there."""
    if cfg is not None and cfg not in DEC_CONFIGS:
        raise ValueError(f"cfg: not a compiled decode config: {cfg!r} (see DEC_CONFIGS)")
    old, _FORCED_DEC[0] = _FORCED_DEC[0], cfg
    return old


def use_decode(T: int, N: int, K: int, batch: int = 1, sm_count: int = 132, smem_per_sm: int = 228 * 1024) -> bool:
    """Which family serves a call without an explicit split_k: the decode family for T <= 16, except a
    thin-tail grid at T > 8 (``choose_decode`` returns None: dense gate+up at T = 16 on the H200, where
    split-K measured faster); split-K for T > 16. ``set_variant`` overrides."""
    if T > DEC_MAX_T or _VARIANT[0] in ("splitk",):
        return False
    if _VARIANT[0] == "decode":
        return True
    return choose_decode(T, N, K, batch, sm_count, smem_per_sm) is not None


def use_wide(T: int, batch: int = 1) -> bool:
    """Whether a call without an explicit split_k runs the wide family: T = 17..160 and either
    ``set_variant("wide")`` or, under "auto", ``wide_enabled()`` and an unbatched weight (the batched per-head
    kv_b shapes measured 4-40% slower on the wide kernel at T = 17-64: gemm_s5_refit_h200.json (in git history))."""
    if T < WIDE_MIN_T or T > MAX_T:
        return False
    return _VARIANT[0] == "wide" or (_VARIANT[0] == "auto" and wide_enabled() and batch == 1)


_SM_COUNT = {}
_SMEM_PER_SM = {}
_WORKSPACE = {}


def _sm_count() -> int:
    import cupy
    dev = cupy.cuda.Device().id
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = cupy.cuda.Device().attributes["MultiProcessorCount"]
    return _SM_COUNT[dev]


def _smem_per_sm() -> int:
    """Shared memory per SM (H200 228 KB: 2 full-ring decode blocks, 3 light ones; sm_120 ~100 KB: 1)."""
    import cupy
    dev = cupy.cuda.Device().id
    if dev not in _SMEM_PER_SM:
        _SMEM_PER_SM[dev] = cupy.cuda.Device().attributes.get("MaxSharedMemoryPerMultiprocessor", 0) or 228 * 1024
    return _SMEM_PER_SM[dev]


def choose_split(T: int, N: int, K: int, batch: int = 1, sm_count: int = 132) -> int:
    """Split-K factor: enough blocks for ~4 per SM, but fp32 partials at most ~25% of the weight bytes."""
    k_tiles = K // BK
    col_blocks = math.ceil(N / BN) * batch
    want = math.ceil(4 * sm_count / col_blocks)
    cap = max(1, min(k_tiles, K // (8 * T)))
    split = max(1, min(want, cap))
    per = math.ceil(k_tiles / split)
    return math.ceil(k_tiles / per)       # no empty splits


def _workspace(nbytes: int, workspace):
    import cupy
    if workspace is not None:
        check_array("workspace", workspace, np.float32, (None,))
        if workspace.nbytes < nbytes:
            raise ValueError(f"workspace: needs {nbytes} bytes, got {workspace.nbytes}")
        return workspace
    dev = cupy.cuda.Device().id
    ws = _WORKSPACE.get(dev)
    if ws is None or ws.nbytes < nbytes:
        stream = cupy.cuda.get_current_stream()
        if getattr(stream, "is_capturing", lambda: False)():
            raise ValueError("workspace: the shared split-K workspace must grow, which cannot happen during "
                             "graph capture; run the same GEMM once before capturing or pass workspace=")
        ws = cupy.empty(max(nbytes // 4, 1 << 20), dtype=np.float32)
        _WORKSPACE[dev] = ws
    return ws


def gemm_bf16(x, w, out=None, *, out_dtype=np.uint16, split_k: Optional[int] = None, workspace=None):
    """y = x @ w^T. x [T, K] or [B, T, K] bf16 (uint16), w [N, K] or [B, N, K] bf16 (contiguous),
    out [T, N] / [B, T, N] uint16 (bf16) or float32 (``out_dtype``). Returns ``out``.

    Split-K partials go to ``workspace`` (float32, >= B*split*T*N) or a per-device shared buffer (one
    stream at a time; call once before graph capture so it is large enough). Where ``use_decode`` picks the
    decode kernel (never with an explicit ``split_k``), neither a workspace nor a second launch is used.
    """
    import cupy
    out_dtype = np.dtype(out_dtype)
    if out_dtype not in (np.dtype(np.uint16), np.dtype(np.float32)):
        raise ValueError(f"out_dtype: must be uint16 (bf16) or float32, got {out_dtype}")
    batched = getattr(w, "ndim", 0) == 3
    dims = {}
    if batched:
        xs = check_rows("x", x, np.uint16, ("B", "T", "K"), dims)
        check_array("w", w, np.uint16, ("B", "N", "K"), dims)
    else:
        xs = (0,) + check_rows("x", x, np.uint16, ("T", "K"), dims)
        check_array("w", w, np.uint16, ("N", "K"), dims)
    B = dims.get("B", 1)
    T, N, K = dims["T"], dims["N"], dims["K"]
    check_range("x.shape[-2] (tokens T)", T, 1, MAX_T)
    check_multiple("K (x.shape[-1])", K, BK)
    check_multiple("N (w.shape[-2])", N, 16)
    oshape = (B, T, N) if batched else (T, N)
    if out is None:
        out = cupy.empty(oshape, dtype=out_dtype)
    os_ = check_rows("out", out, out_dtype, oshape, align=out_dtype.itemsize)
    if not batched:
        os_ = (0,) + os_
    out_f32 = out_dtype == np.float32
    w_bs = N * K if batched else 0
    if split_k is None and use_decode(T, N, K, B, _sm_count(), _smem_per_sm()):
        cfg = _FORCED_DEC[0] or choose_decode(T, N, K, B, _sm_count(), _smem_per_sm()) or _dec_base(
            1 if T <= 8 else 2)                                  # forced "decode" on a split-K shape
        if cfg.nt * 8 < T or N % cfg.rows():
            raise ValueError(f"decode config {cfg} cannot serve T={T}, N={N} (forced by set_decode_config)")
        smem = cfg.smem()
        if DEC_SPREAD and cfg.cs == 1 and (N // cfg.rows()) * B <= _sm_count():
            # a grid of at most one block per SM asks for more than half an SM's shared memory, so two of its
            # blocks never share an SM: launched early under PDL while earlier kernels still hold some SMs, the
            # block scheduler otherwise packs two of them onto the free ones (H200 step 1 x 8 / 1 x 16 -1%,
            # docs/KERNELS.md "Wide-token kernel"; a no-op where one block fills an SM, as on sm_120). Not for clusters:
            # 4-block clusters of one-per-SM blocks do not all fit the GPCs at once (shared gate+up, 128 blocks:
            # 5.0 -> 7.4 us)
            smem = max(smem, _smem_per_sm() // 2 + 1024)
        kern = get_kernel(SPEC, cfg.name(out_f32), max_dynamic_smem=smem)
        kern((N // cfg.rows(), cfg.cs, B), (DEC_THREADS,),
             (x, np.int64(xs[0]), np.int32(xs[1]), w, np.int64(w_bs), out, np.int64(os_[0]), np.int32(os_[1]),
              out, np.int32(T), np.int32(N), np.int32(K), np.int32(0)), shared_mem=smem)
        return out
    if split_k is None and use_wide(T, B):
        cfg, split = _FORCED_WIDE[0] or choose_wide(T, N, K, B, _sm_count(), _smem_per_sm())
        # a cluster config splits K over its cs blocks (a block may get no k tile when K / 64 < cs: it then adds
        # zeros); otherwise at most one split per k tile
        split = cfg.cs if cfg.cs > 1 else min(split, K // BK)
        tiles = math.ceil(T / cfg.bt())
        ws = _workspace(B * split * T * N * 4, workspace) if split > 1 and cfg.cs == 1 else out
        kern = get_kernel(SPEC, cfg.name(out_f32), max_dynamic_smem=cfg.smem())
        kern((tiles * split, math.ceil(N / cfg.bm()), B), (cfg.threads(),),
             (x, np.int64(xs[0]), np.int32(xs[1]), w, np.int64(w_bs), out, np.int64(os_[0]), np.int32(os_[1]),
              ws, np.int32(T), np.int32(N), np.int32(K), np.int32(split)), shared_mem=cfg.smem())
        if split > 1 and cfg.cs == 1:
            _reduce(ws, split, T, N, B, out, os_, out_f32)
        return out
    split = choose_split(T, N, K, B, _sm_count()) if split_k is None else check_range("split_k", split_k, 1, K // BK)
    per = math.ceil(K // BK / split)
    split = math.ceil(K // BK / per)
    nt = next(c for c in NT_CHOICES if 8 * c >= T)
    ws = _workspace(B * split * T * N * 4, workspace) if split > 1 else out
    smem = smem_bytes(nt)
    kern = get_kernel(SPEC, _name(nt, out_f32), max_dynamic_smem=smem)
    kern((math.ceil(N / BN), split, B), (THREADS,),
         (x, np.int64(xs[0]), np.int32(xs[1]), w, np.int64(w_bs), out, np.int64(os_[0]), np.int32(os_[1]),
          ws, np.int32(T), np.int32(N), np.int32(K), np.int32(per)), shared_mem=smem)
    if split > 1:
        _reduce(ws, split, T, N, B, out, os_, out_f32)
    return out


DEC_SPREAD = True     # False: the measuring baseline (`bench.step --no-dec-spread`)


def _reduce(ws, split, T, N, B, out, os_, out_f32):
    """gemm_splitk_reduce: the partials [B][split][T][N] summed in split order into out."""
    red = get_kernel(SPEC, f"gemm_splitk_reduce<{'true' if out_f32 else 'false'}>")
    blocks = min(math.ceil(T * N / 256), 4 * _sm_count())
    red((blocks, B), (256,), (ws, np.int32(split), np.int32(T), np.int32(N), out, np.int64(os_[0]),
                              np.int32(os_[1])))
