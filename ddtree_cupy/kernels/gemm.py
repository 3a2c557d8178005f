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
 * "bulk" (``gemm_bf16_kernel_bulk``, cuda_src/gemm_bulk.cu; off by default, ``set_bulk`` / env
   ``DDT_GEMM_BULK``): a producer warp streams weight and token rows through cp.async.bulk + mbarriers,
   consumer warps own 2-D tiles (MT m16 x NTW n8); split-K partials summed by ``gemm_splitk_reduce``.
Every kernel obeys the PDL rule (``pdl=True``): with ``launch.set_pdl(True)`` they launch through
cuLaunchKernelEx with programmatic dependent launch (kernels/launch.py).
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional, Tuple

import numpy as np

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
        if self.cs == 1:      # the output type last, as in every GEMM kernel (tests/_target_shim.py reads it)
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
    """The decode config for a call (docs/KERNELS.md "Session 3"), a rule fitted to the H200 run of every
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


_SPLITK_NAMES = tuple(_name(nt, f) for f in (False, True) for nt in NT_CHOICES)
SPEC = register(KernelSpec(
    src="gemm_bf16.cu",
    names=_SPLITK_NAMES + tuple(c.name(f) for f in (False, True) for c in DEC_CONFIGS)
    + ("gemm_splitk_reduce<false>", "gemm_splitk_reduce<true>"),
    hot=True, pdl=True,      # every kernel waits (DDT_PDL_WAIT) before reading activations or writing
    doc="skinny bf16 GEMM, mma.sync m16n8k16 + ldmatrix + cp.async ring: decode (in-block / cluster K split) "
        "and split-K kernels"))

VARIANTS = ("auto", "splitk", "decode")
_VARIANT = ["auto"]
_FORCED_DEC = [None]


def set_variant(variant: str) -> str:
    """Force a kernel family for every call, or back to the rule ("auto"); returns the old setting.
    "splitk": the split-K kernel at every T; "decode": the decode family for every T <= 16 (split-K above).
    An explicit ``split_k`` always means the split-K kernel."""
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
    if T > DEC_MAX_T or _VARIANT[0] == "splitk":
        return False
    if _VARIANT[0] == "decode":
        return True
    return choose_decode(T, N, K, batch, sm_count, smem_per_sm) is not None


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


# Bulk-copy streaming family (cuda_src/gemm_bulk.cu, docs/KERNELS.md "Session 4: bulk-copy kernel"): a block
# = WM x WN consumer warps (each MT m16 weight tiles x NTW n8 token tiles) + 1 producer warp; BM = 16 MT WM
# weight rows x TB = 8 NTW WN tokens x a K range; STAGES slots of (BM + TB) rows x BK k, row pitch 2 BK + 16 B.
class BulkConfig(NamedTuple):
    mt: int        # m16 weight tiles per consumer warp
    ntw: int       # n8 token tiles per consumer warp (1 or even)
    wm: int        # consumer warps along the weight rows
    wn: int        # consumer warps along the tokens
    bk: int        # k per stage
    stages: int    # ring slots

    def rows(self) -> int:
        return 16 * self.mt * self.wm

    def tokens(self) -> int:
        return 8 * self.ntw * self.wn

    def threads(self) -> int:
        return 32 * (self.wm * self.wn + 1)

    def smem(self) -> int:
        return BULK_BAR_BYTES + self.stages * (self.rows() + self.tokens()) * (2 * self.bk + 16)

    def name(self, out_f32: bool) -> str:
        return (f"gemm_bf16_kernel_bulk<{self.mt}, {self.ntw}, {self.wm}, {self.wn}, {self.bk}, {self.stages}, "
                f"{'true' if out_f32 else 'false'}>")


BULK_BAR_BYTES = 128
# One config per token band (the smallest whose token tile holds T serves the call); all <= 96 KB.
BULK_CONFIGS = (
    BulkConfig(1, 1, 4, 1, 128, 5),    # T <= 8:   64 rows, 5 x 19.1 KB, 256-byte row copies
    BulkConfig(1, 2, 4, 1, 128, 4),    # T <= 16:  64 rows, 4 x 21.3 KB
    BulkConfig(2, 2, 4, 2, 64, 4),     # T <= 32:  128 rows, 4 x 22.5 KB, 2-D warp tiles from here on
    BulkConfig(2, 4, 4, 2, 64, 3),     # T <= 64:  128 rows, 3 x 27 KB
    BulkConfig(2, 6, 4, 2, 32, 5),     # T <= 96:  128 rows, 5 x 17.5 KB, 64-byte row copies
    BulkConfig(2, 8, 4, 2, 32, 4),     # T <= 128: 4 x 20 KB
    BulkConfig(2, 10, 4, 2, 32, 4),    # T <= 160: 4 x 22.5 KB
)
# Candidates the rule never picks, compiled so one run can answer the design's open questions (docs/KERNELS.md
# "Session 4: bulk-copy"); forced by set_bulk_config / bench part 'bulkconfigs'; losers are deleted after it.
BULK_ALT_CONFIGS = (
    BulkConfig(1, 1, 4, 1, 64, 8),     # T <= 8: 128-byte copies, 8 slots (7 in flight) instead of 256 B x 5
    BulkConfig(2, 4, 4, 2, 32, 6),     # T <= 64: 64-byte copies, 6 slots instead of 128 B x 3
    BulkConfig(2, 10, 4, 2, 64, 2),    # T <= 160: 128-byte copies (half the copy requests), double-buffered
)
BULK_MIN_STAGES_PER_SPLIT = 4      # a split keeps >= 4 k stages (a ring's worth) unless K is shorter
BULK_FLOP_PER_BYTE = 140.0         # mma.sync rate / DRAM read rate (H200: ~640 TFLOP/s / ~4.5 TB/s)
BULK_REDUCE_FIXED = 4.5e6          # the reduce launch's fixed cost (~1 us), in bytes of DRAM time


def choose_bulk(T: int) -> BulkConfig:
    """The bulk config for T tokens: the first (smallest token tile) in BULK_CONFIGS that holds T."""
    check_range("T", T, 1, MAX_T)
    return next(c for c in BULK_CONFIGS if c.tokens() >= T)


def bulk_split_cost(cfg: BulkConfig, T: int, N: int, K: int, batch: int, sm_count: int, s: int,
                    smem_per_sm: int = 228 * 1024) -> float:
    """Modelled time of a bulk launch with split s, in bytes of DRAM time: the streaming/mma work
    (max(weight bytes, FLOPs / BULK_FLOP_PER_BYTE)) stretched by the busiest unit's share of the blocks
    (ceil(blocks / units) x units / blocks), plus for s > 1 the fp32 partials written and read back and the
    reduce launch. Units: SMs when the mma work binds (blocks on one SM share its tensor cores); resident
    block slots when the bytes bind (two resident blocks keep twice the bytes in flight)."""
    rows = math.ceil(N / cfg.rows()) * batch
    flops_b = 2.0 * T * N * K * batch / BULK_FLOP_PER_BYTE
    bytes_b = N * K * 2 * batch
    units = sm_count if flops_b >= bytes_b else sm_count * max(1, smem_per_sm // (cfg.smem() + 1024))
    work = max(bytes_b, flops_b)
    blocks = rows * s
    cost = work * math.ceil(blocks / units) * units / blocks
    if s > 1:
        cost += 2 * s * T * N * 4 * batch + BULK_REDUCE_FIXED
    return cost


def choose_bulk_split(cfg: BulkConfig, T: int, N: int, K: int, batch: int = 1, sm_count: int = 132,
                      smem_per_sm: int = 228 * 1024) -> int:
    """Split-K factor of a bulk launch: the s of least ``bulk_split_cost`` among those that keep
    >= BULK_MIN_STAGES_PER_SPLIT k stages in every split, the last included (ties -> the smallest s);
    returned without empty splits (as choose_split)."""
    k_stages = K // cfg.bk
    cap = max(1, k_stages // BULK_MIN_STAGES_PER_SPLIT)
    best, best_cost = 1, None
    for s in range(1, cap + 1):
        per = math.ceil(k_stages / s)
        eff = math.ceil(k_stages / per)          # the split actually launched (no empty splits)
        if eff > 1 and k_stages - (eff - 1) * per < BULK_MIN_STAGES_PER_SPLIT:
            continue                             # a short last split: its ring never fills
        cost = bulk_split_cost(cfg, T, N, K, batch, sm_count, eff, smem_per_sm)
        if best_cost is None or cost < best_cost * (1 - 1e-9):
            best, best_cost = eff, cost
    return best


BULK_MODES = ("off", "large", "all")
# "off": never (the session-3 kernels); "large": T > DEC_MAX_T (16) only; "all": every T. Flip the default
# here once the H200 run decides (docs/KERNELS.md "Session 4: bulk-copy kernel", decision rule).
BULK_DEFAULT = "off"
_ENV_BULK = {"0": "off", "1": "all", "off": "off", "all": "all", "large": "large"}


def _bulk_from_env() -> str:
    v = os.environ.get("DDT_GEMM_BULK", "")
    if v == "":
        return BULK_DEFAULT
    if v not in _ENV_BULK:
        raise ValueError(f"DDT_GEMM_BULK: one of {sorted(_ENV_BULK)}, got {v!r}")
    return _ENV_BULK[v]


_BULK = [_bulk_from_env()]


def set_bulk(mode: str) -> str:
    """Route calls without an explicit ``split_k`` to the bulk family: "off", "large" (T > 16), "all".
    Returns the old setting. (Env ``DDT_GEMM_BULK`` = 0 / 1 / off / large / all sets it at import.)"""
    if mode not in BULK_MODES:
        raise ValueError(f"mode: one of {BULK_MODES}, got {mode!r}")
    old, _BULK[0] = _BULK[0], mode
    return old


_FORCED_BULK = [None]


def set_bulk_config(cfg: Optional[BulkConfig], split: Optional[int] = None):
    """Force one bulk config (and optionally its split-K factor, clamped to K / BK) for every bulk call
    (tests, bench), or None for ``choose_bulk`` / ``choose_bulk_split``; returns the old (cfg, split) or None.
    A config whose token tile is smaller than a call's T raises ValueError there."""
    if cfg is not None and cfg not in BULK_CONFIGS + BULK_ALT_CONFIGS:
        raise ValueError(f"cfg: not a compiled bulk config: {cfg!r} (see BULK_CONFIGS, BULK_ALT_CONFIGS)")
    if split is not None:
        check_range("split", split, 1, 1 << 16)
    old, _FORCED_BULK[0] = _FORCED_BULK[0], (None if cfg is None else (cfg, split))
    return old


def use_bulk(T: int) -> bool:
    """Whether a call of T tokens without an explicit split_k goes to the bulk family (``set_bulk``)."""
    return _BULK[0] == "all" or (_BULK[0] == "large" and T > DEC_MAX_T)


def bulk_plan(T: int, N: int, K: int, batch: int = 1, sm_count: int = 132,
              smem_per_sm: int = 228 * 1024) -> Optional[Tuple[BulkConfig, int]]:
    """(config, split) of a bulk launch for a call without an explicit split_k, or None for the session-3
    kernels: the mode (``set_bulk``) excludes T, or K is not a multiple of the config's BK (the engine's K
    are all multiples of 128; the contract only asks K % 64). A forced config (``set_bulk_config``) wins
    and raises ValueError when it cannot serve the call."""
    if not use_bulk(T):
        return None
    if _FORCED_BULK[0] is not None:
        cfg, split = _FORCED_BULK[0]
        if cfg.tokens() < T or K % cfg.bk:
            raise ValueError(f"bulk config {cfg} cannot serve T={T}, K={K} (forced by set_bulk_config)")
        if split is not None:
            return cfg, min(split, K // cfg.bk)
        return cfg, choose_bulk_split(cfg, T, N, K, batch, sm_count, smem_per_sm)
    cfg = choose_bulk(T)
    if K % cfg.bk:
        return None
    return cfg, choose_bulk_split(cfg, T, N, K, batch, sm_count, smem_per_sm)


BULK_SPEC = register(KernelSpec(
    src="gemm_bulk.cu",
    names=tuple(c.name(f) for f in (False, True) for c in BULK_CONFIGS + BULK_ALT_CONFIGS),
    hot=True, pdl=True,      # weights before DDT_PDL_WAIT only; tokens, ws and out after it
    doc="skinny bf16 GEMM, bulk-copy (cp.async.bulk + mbarrier) producer warp, 2-D consumer warp tiles"))


def _launch_bulk(x, xs, w, w_bs, out, os_, T, N, K, B, out_f32, cfg: BulkConfig, split: int, workspace):
    k_stages = K // cfg.bk
    if split > 1 and workspace is not None and workspace.nbytes < B * split * T * N * 4:
        # a caller's workspace sized for the split-K kernel (models/ size theirs with choose_split): use the
        # largest split it holds rather than fail; partial_elems() gives the size this call would want
        split = max(1, int(workspace.nbytes) // (B * T * N * 4))
    per = math.ceil(k_stages / split)
    split = math.ceil(k_stages / per)
    ws = _workspace(B * split * T * N * 4, workspace) if split > 1 else out
    kern = get_kernel(BULK_SPEC, cfg.name(out_f32), max_dynamic_smem=cfg.smem())
    kern((math.ceil(N / cfg.rows()), split, B), (cfg.threads(),),
         (x, np.int64(xs[0]), np.int32(xs[1]), w, np.int64(w_bs), out, np.int64(os_[0]), np.int32(os_[1]),
          ws, np.int32(T), np.int32(N), np.int32(K), np.int32(per)), shared_mem=cfg.smem())
    if split > 1:
        _reduce(ws, split, T, N, B, out, os_, out_f32)


def partial_elems(T: int, N: int, K: int, batch: int = 1, sm_count: int = 132,
                  smem_per_sm: int = 228 * 1024) -> int:
    """float32 elements of split-K partials a ``gemm_bf16`` call without ``split_k`` writes to its workspace
    under the current switches (0: none), for callers that preallocate ``workspace=``: the bulk kernel's
    split when ``bulk_plan`` takes the call, else ``choose_split``'s (an upper bound: the decode family
    needs none). A workspace smaller than the bulk split wants makes the bulk call use a smaller split."""
    plan = bulk_plan(T, N, K, batch, sm_count, smem_per_sm)
    if plan is not None:
        split = plan[1]
    else:
        split = choose_split(T, N, K, batch, sm_count)
    return batch * split * T * N if split > 1 else 0


def _reduce(ws, split, T, N, B, out, os_, out_f32):
    red = get_kernel(SPEC, f"gemm_splitk_reduce<{'true' if out_f32 else 'false'}>")
    blocks = min(math.ceil(T * N / 256), 4 * _sm_count())
    red((blocks, B), (256,), (ws, np.int32(split), np.int32(T), np.int32(N), out, np.int64(os_[0]),
                              np.int32(os_[1])))


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
    plan = bulk_plan(T, N, K, B, _sm_count(), _smem_per_sm()) if split_k is None else None
    if plan is not None:
        _launch_bulk(x, xs, w, w_bs, out, os_, T, N, K, B, out_f32, plan[0], plan[1], workspace)
        return out
    if split_k is None and use_decode(T, N, K, B, _sm_count(), _smem_per_sm()):
        cfg = _FORCED_DEC[0] or choose_decode(T, N, K, B, _sm_count(), _smem_per_sm()) or _dec_base(
            1 if T <= 8 else 2)                                  # forced "decode" on a split-K shape
        if cfg.nt * 8 < T or N % cfg.rows():
            raise ValueError(f"decode config {cfg} cannot serve T={T}, N={N} (forced by set_decode_config)")
        kern = get_kernel(SPEC, cfg.name(out_f32), max_dynamic_smem=cfg.smem())
        kern((N // cfg.rows(), cfg.cs, B), (DEC_THREADS,),
             (x, np.int64(xs[0]), np.int32(xs[1]), w, np.int64(w_bs), out, np.int64(os_[0]), np.int32(os_[1]),
              out, np.int32(T), np.int32(N), np.int32(K), np.int32(0)), shared_mem=cfg.smem())
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
