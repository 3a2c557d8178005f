"""The INT4 MoE's tile tables and rules: which GEMM family and which compiled block run at T tokens (register ring
at decode sizes below BULK_MIN_T, bulk-copy above), the routing source (fuse_route_default), the kernel names each
table compiles and the two kernel specs (cuda_src/moe_int4.cu, cuda_src/moe_bulk.cu). docs/MOE.md explains the
choices and their measurements."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

from ..compile import KernelSpec, register

MAX_EXPERTS = 1024  # routing sort: one thread per expert in a 1024-thread block
PF_STEPS = 8        # GEMM L2 prefetch distance in k64 steps (~1.1 KB each per warp)
FUSED_MAX_PAIRS = 256   # T*k up to which the gate/up kernel sorts the routing itself (shared-memory arrays)
# SortSmem in moe_int4.cu: counts [1024] + ids/slot_pair [2 x 256] + chunks [288] int4 + scan scratch
# (rounded up to 16 B like sizeof(SortSmem), which holds int4)
SORT_SMEM = -(-(4 * MAX_EXPERTS + 2 * 4 * FUSED_MAX_PAIRS + 16 * (FUSED_MAX_PAIRS + FUSED_MAX_PAIRS // 8)
                + 8 * 33 + 4) // 16) * 16
SMEM_LIMIT = 99 * 1024      # sm_120 per-block shared memory


# ------------------------------------------------------------------------------------------------------
# Tile configurations. Block = wm x wk warps; each warp computes 32 weight rows (two m16 tiles) over 1/wk
# of K for up to nt*8 tokens of one expert chunk. u = register pipeline depth (k64 steps in flight per warp).
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tile:
    wm: int
    wk: int
    u: int              # depth of the register ring the weights stream through
    lean: int = 2       # the k loop's memory pattern: 1 or 2 (bit-identical results; moe_int4.cu)

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wk

    def smem_static(self, nt: int) -> int:
        return self.wm * self.wk * 2 * nt * 4 * 32 * 4 if self.wk > 1 else 4


@dataclass(frozen=True)
class MoETiles:
    nt: int        # token tiles of 8 per chunk (1: the routing sort cuts chunks of 8 for both GEMMs)
    gateup: Tile
    down: Tile


# The register ring runs at decode sizes only (T < BULK_MIN_T by default: the bulk-copy GEMMs take over from 4
# tokens up, and above FUSED_MAX_PAIRS pairs always), so one token tile of 8 per chunk and a 3-deep ring.
RING_NT = 1
RING_U = 3

# The k loop of the register-ring GEMMs (moe_gemm's LEAN parameter; the arithmetic and its order are the same
# in both, so outputs are bit-identical): 1 = activations one step ahead, the next unit prefetched at the unit
# start; 2 = activations U steps ahead, rolling prefetch across the unit boundary. Measured on the H200
# (docs/history/2026-11-29-moe.md, the lean k loop and the bulk-copy runs): 1 is the faster at T = 1 (I = 256:
# 19.4 us) and loses 1-17% from T = 8 up, where 2 wins (I = 256, T = 8: 82.8 us).
LEAN_T1 = 1         # the table's loop at T = 1
LEAN_T_GE_2 = 2     # ... and from T = 2 up


def lean_for(T: int) -> int:
    """The k loop the table uses for T tokens."""
    return LEAN_T1 if T <= 1 else LEAN_T_GE_2


def select_tiles(arch: str, T: int, inter: int) -> MoETiles:
    """The register ring's tile table, keyed by (architecture, expert width I) and T (the k loop).

    gate/up: K = H = 7168 is long and N = 2I short, so a block splits K over its warps (wk) and reduces in
    shared memory; down: N = H is wide, K = I short, so a narrow expert (I <= 512, K <= 8 steps) gives each
    warp its own rows over the whole K while a wide one (I = 2048) splits K four ways.
    sm_90 and sm_120 currently share the entries (all fit sm_120's 99 KB per block); the key keeps them
    separable. Measured on the H200: docs/MOE.md.
    """
    u = RING_U
    family = "sm_120" if arch.startswith("sm_12") else "sm_90"
    narrow = inter <= 512
    table = {
        # (1x16 would give T=1 twice the warps per SM but spills when built for sm_120 at 128 registers)
        ("sm_90", True): (Tile(1, 8, u), Tile(8, 1, u)),
        ("sm_90", False): (Tile(2, 4, u), Tile(2, 4, u)),
        ("sm_120", True): (Tile(1, 8, u), Tile(8, 1, u)),
        ("sm_120", False): (Tile(2, 4, u), Tile(2, 4, u)),
    }
    gu, dn = table[(family, narrow)]
    # the k loop (lean_for): the same on both architectures (all spill-free; measured on the H200 only)
    lean = lean_for(T)
    return MoETiles(RING_NT, replace(gu, lean=lean), replace(dn, lean=lean))


def with_lean(t: MoETiles, lean: int) -> MoETiles:
    """The same tiles with the register-ring k loop ``lean`` (1 or 2) in both GEMMs."""
    if lean not in (1, 2):
        raise ValueError(f"lean: the register ring's k loop is 1 or 2, got {lean}")
    return MoETiles(t.nt, replace(t.gateup, lean=lean), replace(t.down, lean=lean))


def all_table_tiles() -> Tuple[MoETiles, ...]:
    seen = []
    for arch in ("sm_90", "sm_120"):
        for inter in (256, 2048):
            t = select_tiles(arch, 1, inter)
            # both k loops of the register ring (the table's at T = 1 and from T = 2 up)
            for v in (with_lean(t, 1), with_lean(t, 2)):
                if v not in seen:
                    seen.append(v)
    return tuple(seen)


def _gemm_name(mode: int, tile: Tile, nt: int) -> str:
    return f"moe_gemm<{mode}, {tile.wm}, {tile.wk}, {nt}, {tile.u}, {tile.lean}>"


def _all_gemm_names() -> Tuple[str, ...]:
    names = []
    for t in all_table_tiles():
        for mode, tile in ((0, t.gateup), (1, t.down)):
            n = _gemm_name(mode, tile, t.nt)
            if n not in names:
                names.append(n)
    return tuple(names)


SPEC = register(KernelSpec(
    src="moe_int4.cu",
    names=_all_gemm_names() + ("moe_route", "moe_combine", "moe_repack_weights", "moe_repack_scales",
                               "moe_dequant_check"),
    hot=True,
    pdl=True,      # every kernel calls DDT_PDL_WAIT() before reading routing/activations or writing
    doc="INT4 W4A16 fused MoE: routing sort, gate/up + SiLU, down + routing weight, per-token combine"))


# ------------------------------------------------------------------------------------------------------
# Bulk-copy GEMMs (cuda_src/moe_bulk.cu; docs/MOE.md "Bulk-copy GEMMs"): block = wm x wk consumer warps + one
# producer warp that streams each stage (spw * wk k64 steps of the unit's 2*wm m16 tiles, their scales, the
# chunk's <= 8 token rows) with cp.async.bulk into an nst-deep shared-memory ring. Decode sizes only: both
# kernels sort the routing in shared memory (T*k <= FUSED_MAX_PAIRS).
# ------------------------------------------------------------------------------------------------------
BULK_META = SORT_SMEM + 4 * FUSED_MAX_PAIRS     # the sort's arrays + one routing weight per slot


@dataclass(frozen=True)
class BulkTile:
    wm: int
    wk: int
    spw: int      # k64 steps per consumer warp and stage
    nst: int      # ring stages
    xr: int = 8   # token rows per stage = the routing chunk size (8; 4 or 2: the compact gate/up blocks)

    @property
    def threads(self) -> int:
        return 32 * (self.wm * self.wk + 1)

    @property
    def steps(self) -> int:
        return self.wk * self.spw

    def stage_bytes(self) -> int:
        ss = self.steps
        return 2 * self.wm * ss * (512 + 64) + self.xr * (ss * 128 + 64)

    @property
    def smem_dynamic(self) -> int:      # with the shared-memory sort (G = 0)
        return self.smem_dyn(0)

    def smem_dyn(self, g: int) -> int:
        """Dynamic shared memory with routing source ``g`` (0: the block's own sort, BULK_META bytes of it;
        1: moe_route's global arrays, nothing)."""
        return 128 + self.nst * self.stage_bytes() + (BULK_META if g == 0 else 0)

    @property
    def smem_static(self) -> int:      # the K-split partials of the 4*xr lanes that can hold tokens, double-buffered
        return 2 * self.wm * self.wk * 2 * 4 * (4 * self.xr) * 4 if self.wk > 1 else 4


# gate/up: 1 x 8 warps: one tile pair per unit, K split eight ways with two k64 steps per warp in each 16-step
# stage, reduced at the unit's end; down: K = I is short (4 steps at I = 256), so each warp owns a tile pair over
# the whole stage (no reduction; at I <= 256 the stage is the whole K: three copies). Measured on the H200
# (docs/MOE.md "Bulk-copy GEMMs"): the consumers' per-stage chain, not the bytes in flight, bounds these kernels: more
# k64 steps per warp and stage won (1 x 8 warps, 1 step, 4 stages: I = 256 T = 8 layer 95.2 us; 2 steps, 2 stages:
# 73.2); the 2 x 4 gate/up block ties it alone (73.6; 112.7 vs 119.8 at T = 16) but costs the PDL step 1 x 8
# 9.10 -> 9.74 ms (3 blocks per SM leave the down kernel no room to start early); the down's 2 stages beat 3.
BULK_GATEUP = BulkTile(wm=1, wk=8, spw=2, nst=2)
BULK_DOWN = BulkTile(wm=4, wk=1, spw=4, nst=2)
# Compiled alternatives the benchmark times against the table's (bench/moe.py --focus, "bulk_gu*" / "bulk_dn*").
BULK_GATEUP_CANDIDATES = (BulkTile(2, 4, 2, 2), BulkTile(1, 4, 4, 2)) + (
    # docs/MOE.md "Compact token rows": the table's block with stages of 4 (2) token rows
    # instead of 8 and a third stage in the space freed (two blocks per H200 SM, one fits sm_120's 99 KB);
    # bit-identical to BULK_GATEUP. The routing chunk becomes 4 (2) tokens: an expert with more tokens has its
    # weights streamed once per chunk.
    BulkTile(1, 8, 2, 3, 4), BulkTile(1, 8, 2, 3, 2))
BULK_DOWN_CANDIDATES = (BulkTile(4, 1, 4, 3),)
# The table's gate/up at expert widths <= BULK_COMPACT_MAX_I (a TP >= 4 shard of Kimi's 2048; the TP = 8 rank's is
# 256): the compact block (docs/history/2026-11-29-moe.md, "compact token rows -- measured"): -1.1 to -4.5% per MoE layer at
# I = 256, T = 4..32, uniform and skewed; PDL step 1 x 8 9.03 -> 8.91 ms; at I = 2048 it lost (+1%, skewed +13.6%).
BULK_GATEUP_COMPACT = BulkTile(1, 8, 2, 3, 4)
BULK_COMPACT_MAX_I = 512


# Large T (T*k > FUSED_MAX_PAIRS; docs/MOE.md "Bulk-copy GEMMs at large T"): the same kernels fed
# by moe_route's global chunk list (template G = 1: no sort arrays in shared memory). Units are plentiful there
# (~300-384 experts x chunks of <= 8 tokens x 16-56 m-groups), so the table starts from the decode blocks and the
# benchmark times the candidates against them ("bulkL_gu*" / "bulkL_dn*").
BULK_GATEUP_LARGE = BulkTile(1, 8, 2, 2)
BULK_DOWN_LARGE = BulkTile(4, 1, 4, 2)
# gate/up candidates: 2 (4) tile pairs per unit share the chunk's token rows -- at large T a chunk holds ~5-8
# tokens, so the 1 x 8 block copies about as many x bytes (8 rows x K) as weight bytes per unit; 2 x 4 halves that,
# 4 x 2 (4-step stages, 3 deep) quarters it.
BULK_GATEUP_LARGE_CANDIDATES = (BulkTile(2, 4, 2, 2), BulkTile(2, 4, 2, 3), BulkTile(4, 2, 2, 3))
BULK_DOWN_LARGE_CANDIDATES = (BulkTile(4, 1, 4, 3),)


# Overrides for measuring, set by bench.step (--moe-bulk-tiles / --moe-bulk-large-tiles, its engine runs have no
# per-call arguments): "gu=2,4,2,2;dn=4,1,4,2" picks compiled blocks (the table's or a candidate) for T*k <=
# FUSED_MAX_PAIRS (BULK_TILES), above (BULK_LARGE_TILES); an optional fifth number is the token rows per stage (xr,
# default 8: "gu=1,8,2,3,4" is the compact gate/up block with 4 rows and 3 stages). Empty: the table.
BULK_TILES = ""
BULK_LARGE_TILES = ""


def _bulk_allowed(large: bool):
    if large:
        return {"gu": (BULK_GATEUP_LARGE,) + BULK_GATEUP_LARGE_CANDIDATES,
                "dn": (BULK_DOWN_LARGE,) + BULK_DOWN_LARGE_CANDIDATES}
    return {"gu": (BULK_GATEUP,) + BULK_GATEUP_CANDIDATES, "dn": (BULK_DOWN,) + BULK_DOWN_CANDIDATES}


def _bulk_tiles_for(large: bool = False, inter: Optional[int] = None) -> Tuple[BulkTile, BulkTile]:
    """The table's (gate/up, down) blocks -- the compact gate/up for the shared-memory sort at expert widths
    ``inter`` <= BULK_COMPACT_MAX_I -- unless BULK_LARGE_TILES / BULK_TILES name compiled blocks."""
    var = "BULK_LARGE_TILES" if large else "BULK_TILES"
    allowed = _bulk_allowed(large)
    gu, dn = allowed["gu"][0], allowed["dn"][0]
    if not large and inter is not None and inter <= BULK_COMPACT_MAX_I:
        gu = BULK_GATEUP_COMPACT
    v = BULK_LARGE_TILES if large else BULK_TILES     # read at every call
    for part in filter(None, v.split(";")):
        key, _, nums = part.partition("=")
        try:
            t = BulkTile(*(int(n) for n in nums.split(",")))
        except (TypeError, ValueError):
            raise ValueError(f"{var}: {part!r} is not gu=wm,wk,spw,nst[,xr] or dn=wm,wk,spw,nst[,xr]") from None
        if key not in allowed or t not in allowed[key]:
            raise ValueError(f"{var}: {part!r} is not a compiled block ({allowed.get(key)})")
        if key == "gu":
            gu = t
        else:
            dn = t
    return gu, dn


def _bulk_name(mode: int, bt: BulkTile, g: int = 0) -> str:
    # XR = 8 is the template's default: the previous names stay the same kernels
    if bt.xr != 8:
        return f"moe_gemm_bulk<{mode}, {bt.wm}, {bt.wk}, {bt.spw}, {bt.nst}, {g}, {bt.xr}>"
    return f"moe_gemm_bulk<{mode}, {bt.wm}, {bt.wk}, {bt.spw}, {bt.nst}, {g}>"


def _bulk_compiled(g: int):
    """The blocks compiled with routing source ``g``: G = 0 the decode set; G = 1 the large-T set plus the decode
    table's blocks (``bulk=True, fuse_route=False`` at T*k <= FUSED_MAX_PAIRS runs those, bit-identical to G = 0)."""
    if g == 0:
        return _bulk_allowed(False)
    big = _bulk_allowed(True)
    return {"gu": big["gu"] + tuple(t for t in (BULK_GATEUP,) if t not in big["gu"]),
            "dn": big["dn"] + tuple(t for t in (BULK_DOWN,) if t not in big["dn"])}


def _bulk_names(compiled) -> Tuple[str, ...]:
    """The kernel names of {routing source g: {"gu": blocks, "dn": blocks}}, each once, in order."""
    names = []
    for g, allowed in compiled.items():
        for mode, key in ((0, "gu"), (1, "dn")):
            for t in allowed[key]:
                if _bulk_name(mode, t, g) not in names:
                    names.append(_bulk_name(mode, t, g))
    return tuple(names)


def _all_bulk_names() -> Tuple[str, ...]:
    return _bulk_names({g: _bulk_compiled(g) for g in (0, 1)})


def _table_bulk_blocks():
    """The blocks the tables run, by routing source: the production spec compiles these alone."""
    return {0: {"gu": (BULK_GATEUP, BULK_GATEUP_COMPACT), "dn": (BULK_DOWN,)},
            1: {"gu": (BULK_GATEUP_LARGE,), "dn": (BULK_DOWN_LARGE,)}}


# Two modules of moe_bulk.cu, the same source and options (each instantiation is the same code in either): SPEC_BULK_ALL
# compiles every block (registered: the build CLI reports and checks all of them), SPEC_BULK the tables' five alone,
# which is what a production run compiles. The candidates (and the decode blocks fed by moe_route) only tests and
# benchmarks select, through SPEC_BULK_ALL, compiled the first time one of them runs.
SPEC_BULK_ALL = register(KernelSpec(
    src="moe_bulk.cu",
    names=_all_bulk_names(),
    hot=True,
    pdl=True,      # gate/up waits first; down waits before its first read of h (see the .cu header)
    doc="INT4 W4A16 MoE gate/up and down GEMMs streamed by cp.async.bulk (routing sorted in the block or "
        "from moe_route): every compiled block"))
SPEC_BULK = KernelSpec(src=SPEC_BULK_ALL.src, names=_bulk_names(_table_bulk_blocks()), hot=True, pdl=True,
                       doc="moe_gemm_bulk: the tables' blocks")


def bulk_spec(name: str) -> KernelSpec:
    """The spec that compiles bulk-copy kernel ``name``: the tables' module, else the one of every block."""
    return SPEC_BULK if name in SPEC_BULK.names else SPEC_BULK_ALL


# The rule: both GEMMs bulk-copy from BULK_MIN_T tokens up to FUSED_MAX_PAIRS pairs (both kernels sort the routing
# in shared memory), the register-ring GEMMs below (I = 256: T = 1 19.0 vs 20.9 us, T = 2 27.4 vs 29.6; T = 4 tied;
# T = 8 80.0 -> 73.2, T = 16 134.0 -> 119.8, T = 32 213.3 -> 189.4; docs/history/2026-11-29-moe.md). Above FUSED_MAX_PAIRS both
# GEMMs always bulk-copy, fed by moe_route's chunk list (G = 1; docs/history/2026-11-29-moe.md, "bulk
# GEMMs at large T -- measured": -7 to -33% per MoE layer at I = 256, T = 48..320, -1 to -4% at I = 2048).
# BULK_FORCE = True / False (measuring: bench.step --moe-bulk 1 / 0) forces both / none up to FUSED_MAX_PAIRS pairs.
BULK_DEFAULT = True
BULK_MIN_T = 4
BULK_FORCE: Optional[bool] = None


def bulk_for(T: int, top_k: int) -> bool:
    """Whether the table runs both GEMMs bulk-copy for T tokens: always above FUSED_MAX_PAIRS pairs (moe_route's
    chunk list), from BULK_MIN_T tokens up below (the kernels sort in shared memory; BULK_FORCE overrides)."""
    if T * top_k > FUSED_MAX_PAIRS:
        return True
    if BULK_FORCE is not None:
        return bool(BULK_FORCE)
    return BULK_DEFAULT and T >= BULK_MIN_T


def fuse_route_default(T: int, top_k: int) -> bool:
    """The table: the gate/up kernel sorts the routing itself whenever it fits (T*k <= FUSED_MAX_PAIRS; measured
    1.2-1.4 us faster on the H200 than the separate routing kernel at T = 1); above, the routing kernel and its L2
    prefetch blocks. docs/MOE.md."""
    return T * top_k <= FUSED_MAX_PAIRS
