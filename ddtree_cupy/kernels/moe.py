"""Fused INT4 (W4A16) routed-expert MoE for one layer (cuda_src/moe_int4.cu); docs/MOE.md explains it.

    weights = pack_moe_weights(gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale)
    ws = MoEWorkspace(t_max, top_k, weights)
    out = moe_forward(x, topk_ids, topk_weights, weights, ws, out=None, residual=None)

Three launches at small T (T*k <= FUSED_MAX_PAIRS: the routing sort runs in the gate/up kernel's prologue),
four above (a routing kernel with its L2 prefetch blocks first): gate/up, down, per-token combine.

Every step is a kernel on the current stream with sizes fixed by the shapes of the arguments (no host
synchronisation, no allocation when ``out`` is given): the call can be captured into a CUDA graph.

Also here: the numpy model of the repacked layout (``repack_numpy``, the oracle of the GPU repack and of
tests/test_moe_layout.py), the tile-configuration table (``select_tiles``) and a float64 numpy reference MoE
(``moe_reference``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import numpy as np

from .. import knobs
from .checks import check_array
from .compile import KernelSpec, get_kernel, register

GROUP = 32          # INT4 scale group along K
KSTEP = 64          # K elements per repacked block (one 16-byte word per lane)
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
# (docs/history/2026-11-29-moe.md, "Revision 4" and the integration run): 1 is the faster at T = 1 (I = 256:
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
# (docs/MOE.md, revision 4): the consumers' per-stage chain, not the bytes in flight, bounds these kernels: more
# k64 steps per warp and stage won (1 x 8 warps, 1 step, 4 stages: I = 256 T = 8 layer 95.2 us; 2 steps, 2 stages:
# 73.2); the 2 x 4 gate/up block ties it alone (73.6; 112.7 vs 119.8 at T = 16) but costs the PDL step 1 x 8
# 9.10 -> 9.74 ms (3 blocks per SM leave the down kernel no room to start early); the down's 2 stages beat 3.
BULK_GATEUP = BulkTile(wm=1, wk=8, spw=2, nst=2)
BULK_DOWN = BulkTile(wm=4, wk=1, spw=4, nst=2)
# Compiled alternatives the benchmark times against the table's (bench/moe.py --focus, "bulk_gu*" / "bulk_dn*").
BULK_GATEUP_CANDIDATES = (BulkTile(2, 4, 2, 2), BulkTile(1, 4, 4, 2)) + (
    # revision 5, docs/MOE.md "Compact token rows": the table's block with stages of 4 (2) token rows
    # instead of 8 and a third stage in the space freed (two blocks per H200 SM, one fits sm_120's 99 KB);
    # bit-identical to BULK_GATEUP. The routing chunk becomes 4 (2) tokens: an expert with more tokens has its
    # weights streamed once per chunk.
    BulkTile(1, 8, 2, 3, 4), BulkTile(1, 8, 2, 3, 2))
BULK_DOWN_CANDIDATES = (BulkTile(4, 1, 4, 3),)
# The table's gate/up at expert widths <= BULK_COMPACT_MAX_I (a TP >= 4 shard of Kimi's 2048; the TP = 8 rank's is
# 256): the compact block (docs/history/2026-11-29-moe.md "Revision 5: compact token rows -- measured"): -1.1 to -4.5% per MoE layer at
# I = 256, T = 4..32, uniform and skewed; PDL step 1 x 8 9.03 -> 8.91 ms; at I = 2048 it lost (+1%, skewed +13.6%).
BULK_GATEUP_COMPACT = BulkTile(1, 8, 2, 3, 4)
BULK_COMPACT_MAX_I = 512


# Large T (T*k > FUSED_MAX_PAIRS, revision 5; docs/MOE.md "Bulk-copy GEMMs at large T"): the same kernels fed
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


# Environment overrides for measuring (bench.step has no per-call knobs): DDT_MOE_BULK_TILES="gu=2,4,2,2;dn=4,1,4,2"
# picks compiled blocks (the table's or a candidate) for T*k <= FUSED_MAX_PAIRS, DDT_MOE_BULK_LARGE_TILES (same
# syntax) above; an optional fifth number is the token rows per stage (xr, default 8: "gu=1,8,2,3,4" is the compact
# gate/up block with 4 rows and 3 stages). BULK_WHOLE = False (`bench.step --no-bulk-whole`, a measuring
# baseline) turns off the down GEMM's whole-K stage (three copies per stage instead of one per tile and token row).
BULK_WHOLE = True


def _bulk_allowed(large: bool):
    if large:
        return {"gu": (BULK_GATEUP_LARGE,) + BULK_GATEUP_LARGE_CANDIDATES,
                "dn": (BULK_DOWN_LARGE,) + BULK_DOWN_LARGE_CANDIDATES}
    return {"gu": (BULK_GATEUP,) + BULK_GATEUP_CANDIDATES, "dn": (BULK_DOWN,) + BULK_DOWN_CANDIDATES}


def _env_bulk_tiles(large: bool = False, inter: Optional[int] = None) -> Tuple[BulkTile, BulkTile]:
    """The table's (gate/up, down) blocks -- the compact gate/up for the shared-memory sort at expert widths
    ``inter`` <= BULK_COMPACT_MAX_I -- unless the environment names compiled blocks."""
    var = "DDT_MOE_BULK_LARGE_TILES" if large else "DDT_MOE_BULK_TILES"
    allowed = _bulk_allowed(large)
    gu, dn = allowed["gu"][0], allowed["dn"][0]
    if not large and inter is not None and inter <= BULK_COMPACT_MAX_I:
        gu = BULK_GATEUP_COMPACT
    v = knobs.get().moe_bulk_large_tiles if large else knobs.get().moe_bulk_tiles     # read at every call
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


SPEC_BULK = register(KernelSpec(
    src="moe_bulk.cu",
    names=_all_bulk_names(),
    hot=True,
    pdl=True,      # gate/up waits first; down waits before its first read of h (see the .cu header)
    doc="INT4 W4A16 MoE gate/up and down GEMMs streamed by cp.async.bulk (routing sorted in the block or "
        "from moe_route)"))

# The timeline build (revision 5, docs/history/2026-11-29-moe.md "Revision 5: a timeline build"): the same source with
# -DDDT_MOE_TIMELINE, one more kernel argument (an int64 buffer) into which lane 0 of each warp of the first
# TL_BLOCKS blocks stores SM cycle stamps at fixed events (the layout: the .cu file's "Timeline build" comment,
# bench/moe_timeline.py reads it). A profiling tool, never run by the engine: only ``timeline=`` in
# moe_launch_plan / moe_forward selects it, and the production spec above is compiled without the macro (same PTX).
# Compiled: the tables' blocks (decode and large T), which is what ``bench.moe --timeline`` runs.
TL_STAGES = 128     # ring stages recorded per warp (a block's first TL_STAGES stages)
TL_UNITS = 32       # units recorded per consumer warp
TL_BLOCKS = 1024    # blocks recorded (blockIdx.x < TL_BLOCKS); the H200's bulk grids are <= 4 x 132
TL_BLOCK_HEADER = 16
TL_WARP_HEADER = 8


def timeline_words(bt: BulkTile) -> int:
    """int64 words of one block's timeline record for block ``bt`` (the .cu file's mtl::block_words)."""
    nw = bt.wm * bt.wk + 1
    return TL_BLOCK_HEADER + nw * TL_WARP_HEADER + nw * TL_STAGES * 3 + nw * TL_UNITS * 2


def _timeline_compiled():
    return {0: {"gu": (BULK_GATEUP, BULK_GATEUP_COMPACT), "dn": (BULK_DOWN,)},
            1: {"gu": (BULK_GATEUP_LARGE,), "dn": (BULK_DOWN_LARGE,)}}


def _all_timeline_names() -> Tuple[str, ...]:
    return _bulk_names(_timeline_compiled())


SPEC_BULK_TIMELINE = register(KernelSpec(
    src="moe_bulk.cu",
    names=_all_timeline_names(),
    defines=(("DDT_MOE_TIMELINE", "1"), ("DDT_MOE_TL_STAGES", str(TL_STAGES)), ("DDT_MOE_TL_UNITS", str(TL_UNITS)),
             ("DDT_MOE_TL_BLOCKS", str(TL_BLOCKS))),
    hot=False,     # a profiling build: a few more registers than production, spills still reported
    pdl=True,      # the same waits as the production kernels
    doc="moe_gemm_bulk with per-warp cycle stamps at the barrier waits, releases, copy issues and epilogues"))

# The rule: both GEMMs bulk-copy from BULK_MIN_T tokens up to FUSED_MAX_PAIRS pairs (both kernels sort the routing
# in shared memory), the register-ring GEMMs below (I = 256: T = 1 19.0 vs 20.9 us, T = 2 27.4 vs 29.6; T = 4 tied;
# T = 8 80.0 -> 73.2, T = 16 134.0 -> 119.8, T = 32 213.3 -> 189.4; MOE.md revision 4). Above FUSED_MAX_PAIRS both
# GEMMs always bulk-copy, fed by moe_route's chunk list (G = 1; docs/history/2026-11-29-moe.md "Revision 5: bulk
# GEMMs at large T -- measured": -7 to -33% per MoE layer at I = 256, T = 48..320, -1 to -4% at I = 2048).
# Environment DDT_MOE_BULK=1 / 0 (measuring) forces both / none up to FUSED_MAX_PAIRS pairs.
BULK_DEFAULT = True
BULK_MIN_T = 4
BULK_ENV: Optional[str] = knobs.get().moe_bulk


def bulk_for(T: int, top_k: int) -> bool:
    """Whether the table runs both GEMMs bulk-copy for T tokens: always above FUSED_MAX_PAIRS pairs (moe_route's
    chunk list), from BULK_MIN_T tokens up below (the kernels sort in shared memory; DDT_MOE_BULK overrides)."""
    if T * top_k > FUSED_MAX_PAIRS:
        return True
    on = BULK_DEFAULT and T >= BULK_MIN_T
    if BULK_ENV is not None:
        if BULK_ENV not in ("0", "1"):
            raise ValueError(f"DDT_MOE_BULK: must be 0 or 1, got {BULK_ENV!r}")
        on = BULK_ENV == "1"
    return on


# ------------------------------------------------------------------------------------------------------
# Layout model (numpy). Mirrors nat_k / frag_row / frag_col in the .cu file.
# ------------------------------------------------------------------------------------------------------
def nat_k(w, kappa):
    """Natural k inside a 64-block of MMA column ``kappa`` (0..15) of k16 sub-tile ``w`` (0..3)."""
    w, kappa = np.asarray(w), np.asarray(kappa)
    return 32 * (w >> 1) + 8 * ((kappa & 7) >> 1) + 4 * (w & 1) + 2 * (kappa >> 3) + (kappa & 1)


def frag_row(g, idx):
    return np.asarray(g) + 8 * ((np.asarray(idx) >> 1) & 1)


def frag_col(t, idx):
    idx = np.asarray(idx)
    return 2 * np.asarray(t) + (idx & 1) + 8 * (idx >> 2)


def layout_tables():
    """Index tables of one 16x64 block: for (lane, word w, nibble position p) the source (row, k)."""
    lane = np.arange(32)[:, None, None]
    w = np.arange(4)[None, :, None]
    p = np.arange(8)[None, None, :]
    idx = 2 * (p & 3) + (p >> 2)
    row = frag_row(lane >> 2, idx)
    k = nat_k(w, frag_col(lane & 3, idx))
    return np.broadcast_to(row, (32, 4, 8)).copy(), np.broadcast_to(k, (32, 4, 8)).copy()


def scale_tables():
    """For (g, q) of one 16x64 block's scale record: (row, group inside the block)."""
    g = np.arange(8)[:, None]
    q = np.arange(4)[None, :]
    return np.broadcast_to(g + 8 * (q & 1), (8, 4)).copy(), np.broadcast_to(q >> 1, (8, 4)).copy()


def _padded_k(K: int) -> int:
    return -(-K // KSTEP) * KSTEP


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """int32 [..., K/8] -> uint8 nibbles [..., K] (k-th value = nibble k % 8 of word k // 8)."""
    u = np.ascontiguousarray(packed).view(np.uint32)
    sh = (4 * np.arange(8, dtype=np.uint32))
    return ((u[..., None] >> sh) & np.uint32(0xF)).astype(np.uint8).reshape(*u.shape[:-1], u.shape[-1] * 8)


def repack_numpy(packed: np.ndarray, scale: np.ndarray, packed2: Optional[np.ndarray] = None,
                 scale2: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Numpy model of the GPU repack. packed int32 [E, N, K/8], scale uint16 [E, N, K/32] (and a second
    linear interleaved by 16-row tiles when given) -> (wp uint32 [E, Nf/16, Kp/64, 32, 4],
    sp uint16 [E, Nf/16, Kp/64, 8, 4])."""
    nib = unpack_nibbles(packed)
    sc = np.ascontiguousarray(scale)
    if packed2 is not None:
        nib2, sc2 = unpack_nibbles(packed2), np.ascontiguousarray(scale2)
        E, N, K = nib.shape
        nib = np.stack([nib.reshape(E, N // 16, 16, K), nib2.reshape(E, N // 16, 16, K)], axis=2).reshape(E, 2 * N, K)
        G = sc.shape[-1]
        sc = np.stack([sc.reshape(E, N // 16, 16, G), sc2.reshape(E, N // 16, 16, G)], axis=2).reshape(E, 2 * N, G)
    E, N, K = nib.shape
    Kp = _padded_k(K)
    KS = Kp // KSTEP
    nibp = np.full((E, N, Kp), 8, np.uint8)
    nibp[:, :, :K] = nib
    scp = np.zeros((E, N, Kp // GROUP), np.uint16)
    scp[:, :, :K // GROUP] = sc
    row, k = layout_tables()
    blocks = nibp.reshape(E, N // 16, 16, KS, KSTEP).transpose(0, 1, 3, 2, 4)     # [E, NT, KS, 16, 64]
    sel = blocks[:, :, :, row, k].astype(np.uint32)                               # [E, NT, KS, 32, 4, 8]
    wp = np.bitwise_or.reduce(sel << (4 * np.arange(8, dtype=np.uint32)), axis=-1)
    srow, sgrp = scale_tables()
    sblk = scp.reshape(E, N // 16, 16, KS, 2).transpose(0, 1, 3, 2, 4)            # [E, NT, KS, 16, 2]
    sp = sblk[:, :, :, srow, sgrp]                                                # [E, NT, KS, 8, 4]
    return np.ascontiguousarray(wp, dtype=np.uint32), np.ascontiguousarray(sp, dtype=np.uint16)


def fused_sort_numpy(ids: np.ndarray, n_experts: int, chunk: int):
    """Model of the gate/up prologue's shared-memory sort (sort_pairs_block): slots in expert order, inside an
    expert in pair order (the deterministic rank), unpadded. -> (chunks int32 [n, 4] (expert, first slot,
    tokens, 0), slot_pair int32 [valid pairs], bad)."""
    flat = np.asarray(ids).reshape(-1)
    valid = (flat >= 0) & (flat < n_experts)
    order = np.nonzero(valid)[0]
    slot_pair = order[np.argsort(flat[order], kind="stable")].astype(np.int32)
    counts = np.bincount(flat[valid], minlength=n_experts)
    chunks, off = [], 0
    for e in range(n_experts):
        for j in range(0, counts[e], chunk):
            chunks.append((e, off + j, min(chunk, counts[e] - j), 0))
        off += counts[e]
    return np.array(chunks, np.int32).reshape(-1, 4), slot_pair, int((~valid).sum())


def dequant_numpy(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """compressed-tensors int32 [..., N, K/8] + bf16 bits [..., N, K/32] -> float32 q * scale (exact)."""
    q = unpack_nibbles(packed).astype(np.float32) - 8.0
    s = (scale.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return q * np.repeat(s, GROUP, axis=-1)


def moe_reference(x, ids, wts, gate, up, down, residual=None) -> np.ndarray:
    """float64 reference: out[t] = sum_j w[t,j] * down_e(silu(gate_e x) * up_e x) (+ residual).
    x [T, H]; ids/wts [T, k]; gate/up [E, I, H], down [E, H, I] dense (dequantised) weights."""
    x = np.asarray(x, np.float64)
    T, H = x.shape
    out = np.zeros((T, H), np.float64) if residual is None else np.array(residual, np.float64)
    ids = np.asarray(ids)
    for e in np.unique(ids):
        tok, j = np.nonzero(ids == e)
        xe = x[tok]
        g = xe @ np.asarray(gate[e], np.float64).T
        u = xe @ np.asarray(up[e], np.float64).T
        h = g / (1.0 + np.exp(-g)) * u
        y = h @ np.asarray(down[e], np.float64).T
        np.add.at(out, tok, np.asarray(wts, np.float64)[tok, j][:, None] * y)
    return out


# ------------------------------------------------------------------------------------------------------
# GPU side
# ------------------------------------------------------------------------------------------------------
@dataclass
class MoEWeights:
    """One layer's routed experts in the kernel layout (see docs/MOE.md)."""
    w13: object   # uint32 [E, 2I/16, H/64, 32, 4]   gate/up interleaved by 16-row tiles
    s13: object   # uint16 [E, 2I/16, H/64, 8, 4]
    w2: object    # uint32 [E, H/16, Ip/64, 32, 4]   down, K = I padded to Ip = ceil64(I)
    s2: object    # uint16 [E, H/16, Ip/64, 8, 4]
    n_experts: int
    hidden: int
    inter: int

    @property
    def inter_padded(self) -> int:
        return _padded_k(self.inter)

    def expert_bytes(self) -> int:
        """Bytes one expert's weights + scales occupy in this layout (what a touched expert streams)."""
        return sum(a.nbytes for a in (self.w13, self.s13, self.w2, self.s2)) // self.n_experts


def _launch_1d(n: int, threads: int = 256) -> Tuple[Tuple[int], Tuple[int]]:
    return (max(1, min(-(-n // threads), 65535 * 8)),), (threads,)


def _repack(p0, s0, p1, s1, E, Nsrc, K):
    import cupy
    fused = p1 is not None
    KS = _padded_k(K) // KSTEP
    Nf = 2 * Nsrc if fused else Nsrc
    wp = cupy.empty((E, Nf // 16, KS, 32, 4), dtype=cupy.uint32)
    sp = cupy.empty((E, Nf // 16, KS, 8, 4), dtype=cupy.uint16)
    kw = get_kernel(SPEC, "moe_repack_weights")
    ks = get_kernel(SPEC, "moe_repack_scales")
    i32 = np.int32
    g, b = _launch_1d(wp.size)
    kw(g, b, (p0, p1 if fused else p0, i32(E), i32(Nsrc), i32(K), i32(KS), i32(fused), wp))
    g, b = _launch_1d(sp.size)
    ks(g, b, (s0, s1 if fused else s0, i32(E), i32(Nsrc), i32(K), i32(KS), i32(fused), sp))
    return wp, sp


def pack_moe_weights(gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale) -> MoEWeights:
    """Load-time repack on the GPU of one layer's stacked experts (whole or a TP shard).

    gate/up: weight_packed int32 [E, I, H/8], weight_scale uint16 (bf16) [E, I, H/32];
    down: int32 [E, H, I/8], uint16 [E, H, I/32]. H % 64 == 0, I % 32 == 0."""
    d = {}
    check_array("gate_packed", gate_packed, np.int32, ("E", "I", "H8"), d)
    check_array("gate_scale", gate_scale, np.uint16, ("E", "I", "H32"), d)
    check_array("up_packed", up_packed, np.int32, ("E", "I", "H8"), d)
    check_array("up_scale", up_scale, np.uint16, ("E", "I", "H32"), d)
    E, I, H = d["E"], d["I"], d["H8"] * 8
    if d["H32"] * 32 != H:
        raise ValueError(f"gate_scale: last dimension {d['H32']} != H/32 = {H // 32}")
    if H % KSTEP:
        raise ValueError(f"gate_packed: hidden size H = {H} must be a multiple of {KSTEP}")
    if I % GROUP:
        raise ValueError(f"gate_packed: expert width I = {I} must be a multiple of {GROUP}")
    if E > MAX_EXPERTS:
        raise ValueError(f"gate_packed: {E} experts > {MAX_EXPERTS} supported by the routing sort")
    check_array("down_packed", down_packed, np.int32, (E, H, I // 8))
    check_array("down_scale", down_scale, np.uint16, (E, H, I // GROUP))
    w13, s13 = _repack(gate_packed, gate_scale, up_packed, up_scale, E, I, H)
    w2, s2 = _repack(down_packed, down_scale, None, None, E, H, I)
    return MoEWeights(w13, s13, w2, s2, E, H, I)


def dequant_packed(wp, sp, n_rows: int):
    """GPU self-check path: decode repacked wp/sp through the GEMM's dequantiser -> float32 [E, N, Kp]."""
    import cupy
    E, nt, KS = wp.shape[:3]
    if nt * 16 != n_rows:
        raise ValueError(f"wp: {nt} row tiles do not match n_rows = {n_rows}")
    out = cupy.empty((E, n_rows, KS * KSTEP), dtype=cupy.float32)
    g, b = _launch_1d(E * nt * KS * 32)
    get_kernel(SPEC, "moe_dequant_check")(g, b, (wp, sp, np.int32(E), np.int32(n_rows), np.int32(KS), out))
    return out


class MoEWorkspace:
    """Fixed-size scratch for up to ``t_max`` tokens (allocate once, before graph capture)."""

    def __init__(self, t_max: int, top_k: int, weights: MoEWeights):
        import cupy
        if t_max < 1 or top_k < 1 or top_k > weights.n_experts:
            raise ValueError(f"MoEWorkspace: need t_max >= 1 and 1 <= top_k <= {weights.n_experts}, "
                             f"got t_max={t_max}, top_k={top_k}")
        self.t_max, self.top_k = t_max, top_k
        self.n_experts, self.hidden, self.inter = weights.n_experts, weights.hidden, weights.inter
        pairs = t_max * top_k
        # Routing-kernel path: every expert's run of slots is padded to a multiple of 8.
        self.slot_cap = pairs + 7 * min(weights.n_experts, pairs)
        # h rows are Ip wide; the padding columns [I, Ip) stay zero forever (the down GEMM reads them as
        # activations against q = 0, scale = 0 weights, so they must be finite).
        self.h = cupy.zeros((self.slot_cap, weights.inter_padded), dtype=cupy.uint16)
        self.y = cupy.empty((pairs, weights.hidden), dtype=cupy.float32)        # row = pair t*k + j
        self.slot_pair = cupy.zeros(self.slot_cap, dtype=cupy.int32)
        self.rank = cupy.empty(pairs, dtype=cupy.int32)
        self.chunks = cupy.zeros((pairs + weights.n_experts, 4), dtype=cupy.int32)
        self.meta = cupy.zeros(4, dtype=cupy.int32)

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.h, self.y, self.slot_pair, self.rank, self.chunks, self.meta))

    def bad_ids(self) -> int:
        """Number of out-of-range expert ids seen by the last call (host sync: tests/debug only)."""
        return int(self.meta[1].get())


_SM = {}


def _sm_count() -> int:
    import cupy
    dev = cupy.cuda.Device().id
    if dev not in _SM:
        _SM[dev] = cupy.cuda.Device().attributes["MultiProcessorCount"]
    return _SM[dev]


def _l2_budget() -> int:
    """Bytes the routing kernel may prefetch: a third of L2 (H200 50 MB -> 16 MB; RTX PRO 6000 128 MB)."""
    import cupy
    dev = cupy.cuda.Device().id
    key = ("l2", dev)
    if key not in _SM:
        _SM[key] = int(cupy.cuda.Device().attributes["L2CacheSize"]) // 3
    return _SM[key]


def _grid(units_max: int, tile: Tile) -> int:
    per_sm = max(1, 512 // tile.threads)   # ~128-195 registers: 512 threads per SM at most
    return max(1, min(units_max, _sm_count() * per_sm))


def moe_forward(x, topk_ids, topk_weights, weights: MoEWeights, ws: MoEWorkspace, out=None, residual=None,
                tiles: Optional[MoETiles] = None, l2_prefetch: Optional[bool] = None, pf_steps: int = PF_STEPS,
                fuse_route: Optional[bool] = None, pf_next: bool = True, bulk: Optional[bool] = None,
                bulk_tiles: Optional[Tuple[BulkTile, BulkTile]] = None, timeline=None):
    """out[t] = sum_j topk_weights[t,j] * expert_{topk_ids[t,j]}(x[t]) (+ residual[t]), bf16 [T, H].

    x uint16 (bf16) [T, H]; topk_ids int32 [T, k]; topk_weights float32 [T, k]; residual uint16 [T, H] or
    None. Out-of-range ids are skipped (counted in ws.meta[1]). Graph-capturable when ``out`` is given."""
    import cupy
    if out is None:
        d = {}
        check_array("x", x, np.uint16, ("T", weights.hidden), d)
        out = cupy.empty((d["T"], weights.hidden), dtype=cupy.uint16)
    for _, launch in moe_launch_plan(x, topk_ids, topk_weights, weights, ws, out, residual, tiles, l2_prefetch,
                                     pf_steps, fuse_route, pf_next, bulk, bulk_tiles, timeline):
        launch()
    return out


def fuse_route_default(T: int, top_k: int) -> bool:
    """The table: the gate/up kernel sorts the routing itself whenever it fits (T*k <= FUSED_MAX_PAIRS; measured
    1.2-1.4 us faster on the H200 than the separate routing kernel at T = 1); above, the routing kernel and its L2
    prefetch blocks. docs/MOE.md."""
    return T * top_k <= FUSED_MAX_PAIRS


def moe_launch_plan(x, topk_ids, topk_weights, weights: MoEWeights, ws: MoEWorkspace, out, residual=None,
                    tiles: Optional[MoETiles] = None, l2_prefetch: Optional[bool] = None,
                    pf_steps: int = PF_STEPS, fuse_route: Optional[bool] = None, pf_next: bool = True,
                    bulk: Optional[bool] = None, bulk_tiles: Optional[Tuple[BulkTile, BulkTile]] = None,
                    timeline=None):
    """The launches of ``moe_forward`` as [(name, fn)] after checking every argument (the benchmark times
    prefixes of this list to attribute time to stages): [route,] gate_up, down, combine.
    ``bulk``: True: both GEMMs bulk-copy (moe_bulk.cu; both sort the routing themselves where T*k <= FUSED_MAX_PAIRS
    and ``fuse_route`` is not False, else the routing kernel runs first and both read its chunk list, with
    ``l2_prefetch`` as for the register ring: None = from T = 64); False: both register-ring (T*k <=
    FUSED_MAX_PAIRS only); None: ``bulk_for`` when no register-ring option is given. The bulk
    kernels take none of ``tiles``, ``pf_steps``, ``pf_next``; ``bulk_tiles``: their (gate/up, down) blocks
    (None: the table's, BULK_* up to FUSED_MAX_PAIRS pairs, BULK_*_LARGE above).
    ``fuse_route``: the gate/up kernel sorts the routing in its prologue (T*k <= FUSED_MAX_PAIRS), no route
    kernel (None: the table, ``fuse_route_default``). ``l2_prefetch``: extra blocks of the routing
    kernel prefetch the touched experts' weights into L2 (up to a third of L2) while block 0 sorts (None:
    only for T >= 64, where it measured up to 5% faster); ``pf_steps``: how many k64 steps each GEMM warp
    prefetches into L2 ahead of its register ring; ``pf_next``: that prefetch runs on into the warp's next
    unit.
    ``timeline``: None (production), or (gate/up buffer, down buffer), each a 1-D int64 cupy array of at least
    TL_BLOCKS * timeline_words(block) words or None: that bulk GEMM runs the timeline build (SPEC_BULK_TIMELINE;
    bulk=True only, the table's blocks of ``_timeline_compiled``) and writes its event record there (poison the
    buffer with -1 first: unwritten words stay -1; bench/moe_timeline.py analyses it)."""
    if pf_steps < 0 or pf_steps % 4:
        raise ValueError(f"pf_steps: must be a non-negative multiple of 4, got {pf_steps}")
    from .compile import device_arch
    d = {}
    check_array("x", x, np.uint16, ("T", weights.hidden), d)
    check_array("topk_ids", topk_ids, np.int32, ("T", ws.top_k), d)
    check_array("topk_weights", topk_weights, np.float32, ("T", ws.top_k), d)
    T = d["T"]
    if T < 1 or T > ws.t_max:
        raise ValueError(f"x: {T} tokens outside 1..t_max = {ws.t_max} of the workspace")
    if x.data.ptr % 16:
        raise ValueError("x: base address must be 16-byte aligned (the kernel loads 16-byte vectors)")
    if (ws.n_experts, ws.hidden, ws.inter) != (weights.n_experts, weights.hidden, weights.inter):
        raise ValueError("ws: workspace was built for different weights "
                         f"(E, H, I) = {(ws.n_experts, ws.hidden, ws.inter)}")
    if residual is not None:
        check_array("residual", residual, np.uint16, (T, weights.hidden))
    check_array("out", out, np.uint16, (T, weights.hidden))
    H, I, E, k = weights.hidden, weights.inter, weights.n_experts, ws.top_k
    ring_options = tiles is not None or l2_prefetch or fuse_route is False
    if bulk is None:
        bulk = False if ring_options else bulk_for(T, k)
    if bulk not in (True, False):
        raise ValueError(f"bulk: must be True or False, got {bulk!r}")
    if bulk is True:
        if tiles is not None:
            raise ValueError("bulk: the bulk-copy GEMMs take no tiles (bulk_tiles picks their blocks)")
        # routing source: the blocks' own shared-memory sort where it fits, unless fuse_route=False; moe_route's
        # global arrays above FUSED_MAX_PAIRS (or when asked)
        glob = T * k > FUSED_MAX_PAIRS or fuse_route is False
        if glob and fuse_route:
            raise ValueError(f"fuse_route: T*k = {T * k} pairs > {FUSED_MAX_PAIRS} sorted in shared memory")
        if l2_prefetch and not glob:
            raise ValueError("l2_prefetch: needs the routing kernel (fuse_route=False)")
        return _bulk_plan(x, topk_ids, topk_weights, weights, ws, out, residual, T, bulk_tiles, glob, l2_prefetch,
                          timeline)
    if timeline is not None:
        raise ValueError("timeline: only the bulk-copy GEMMs have a timeline build (bulk=True)")
    if T * k > FUSED_MAX_PAIRS:
        raise ValueError(f"bulk: the register-ring GEMMs run at T*k <= {FUSED_MAX_PAIRS} pairs, got {T * k} "
                         "(above, the bulk-copy GEMMs)")
    if tiles is None:
        tiles = select_tiles(device_arch(), T, weights.inter)
    Ip = weights.inter_padded
    fuse_route = fuse_route_default(T, k) if fuse_route is None else bool(fuse_route)
    # dynamic shared memory: the gate/up's fused sort arrays
    dyn_gu = SORT_SMEM if fuse_route else 0
    dyn_dn = 0
    for tl, dyn in ((tiles.gateup, dyn_gu), (tiles.down, dyn_dn)):
        if dyn + tl.smem_static(tiles.nt) > SMEM_LIMIT:
            raise ValueError(f"tiles: {tl} needs {dyn + tl.smem_static(tiles.nt)} B of shared memory > {SMEM_LIMIT}")
    if l2_prefetch is None:
        l2_prefetch = T >= 64 and not fuse_route
    if fuse_route and l2_prefetch:
        raise ValueError("l2_prefetch: needs the routing kernel (fuse_route=False)")
    chunk = 8 * tiles.nt
    i32, i64 = np.int32, np.int64
    pairs = T * k
    chunks_max = min(pairs, min(pairs, E) + pairs // chunk)

    plan = []
    if not fuse_route:
        k_route = get_kernel(SPEC, "moe_route")
        eb = [a.nbytes // E for a in (weights.w13, weights.s13, weights.w2, weights.s2)]
        route_args = (topk_ids, i32(T), i32(k), i32(E), i32(chunk), ws.slot_pair, ws.rank, ws.chunks, ws.meta,
                      weights.w13, weights.s13, weights.w2, weights.s2, *(i64(b) for b in eb),
                      i64(_l2_budget() if l2_prefetch else 0))
        route_grid = 1 + (_sm_count() if l2_prefetch else 0)
        plan.append(("route", lambda: k_route((route_grid,), (1024,), route_args)))
    common = (topk_ids, topk_weights, i32(T), i32(k), i32(E), i32(fuse_route), ws.slot_pair, ws.chunks, ws.meta)
    tail = (ws.y, i32(pf_steps), i32(pf_next))
    # gate/up: N = 2I fused rows, K = H
    tg = tiles.gateup
    k_gu = get_kernel(SPEC, _gemm_name(0, tg, tiles.nt), max_dynamic_smem=dyn_gu)
    grid_gu = _grid(chunks_max * -(-(2 * I // 32) // tg.wm), tg)
    gu_args = (weights.w13, weights.s13, i32(2 * I), i32(H // KSTEP), x, i32(H)) + common + (ws.h, i32(Ip)) + tail
    plan.append(("gate_up", lambda: k_gu((grid_gu,), (tg.threads,), gu_args, shared_mem=dyn_gu)))
    # down: N = H, K = Ip
    td = tiles.down
    k_dn = get_kernel(SPEC, _gemm_name(1, td, tiles.nt))
    grid_dn = _grid(chunks_max * -(-(H // 32) // td.wm), td)
    dn_args = (weights.w2, weights.s2, i32(H), i32(Ip // KSTEP), ws.h, i32(Ip)) + common[:5] + (i32(0),) + \
        common[6:] + (ws.h, i32(Ip)) + tail
    plan.append(("down", lambda: k_dn((grid_dn,), (td.threads,), dn_args)))
    plan.append(_combine_launch(topk_ids, weights, ws, out, residual, T))
    return plan


def _combine_launch(topk_ids, weights: MoEWeights, ws: MoEWorkspace, out, residual, T: int):
    i32 = np.int32
    H = weights.hidden
    # no None pointers in kernel arguments (PDL launches marshal device pointers only): ``out`` stands in
    # for an absent residual, with has_res = 0
    res_arg, has_res = (residual, i32(1)) if residual is not None else (out, i32(0))
    k_cb = get_kernel(SPEC, "moe_combine")
    cb_args = (ws.y, topk_ids, i32(ws.top_k), i32(weights.n_experts), i32(H), res_arg, has_res, out)
    return ("combine", lambda: k_cb((-(-H // 1024), T), (256,), cb_args))


def _blocks_per_sm(fn, bt: BulkTile, dyn: int) -> int:
    """Blocks of the compiled bulk kernel ``fn`` resident per SM, from the driver's occupancy calculator (its
    registers, static and dynamic shared memory and threads). Counting shared memory alone is not enough: the
    register file is allocated per SM quadrant, so a 9-warp block of 99 registers fits once per H200 SM although
    two fit by shared memory (revision 6: the compact gate/up's timeline build ran in two waves that way)."""
    import cupy
    key = ("occ", fn.kernel.ptr, bt.threads, dyn, cupy.cuda.Device().id)
    if key not in _SM:
        _SM[key] = int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, bt.threads, dyn))
    return max(1, _SM[key])


def _bulk_plan(x, topk_ids, topk_weights, weights: MoEWeights, ws: MoEWorkspace, out, residual, T: int,
               bulk_tiles: Optional[Tuple[BulkTile, BulkTile]] = None, glob: bool = False,
               l2_prefetch: Optional[bool] = None, timeline=None):
    """[route,] gate/up and down through the bulk-copy GEMMs, then the combine (see moe_launch_plan). ``glob``:
    the routing kernel runs first (chunks of <= 8 tokens) and both GEMMs read its arrays (G = 1); else both sort
    in shared memory (G = 0, T*k <= FUSED_MAX_PAIRS)."""
    H, I, E, k = weights.hidden, weights.inter, weights.n_experts, ws.top_k
    g = 1 if glob else 0
    large = T * k > FUSED_MAX_PAIRS
    allowed = _bulk_compiled(g)
    # the table by size (the decode blocks up to FUSED_MAX_PAIRS pairs, also when fed by moe_route there)
    gu_tile, dn_tile = bulk_tiles if bulk_tiles is not None else _env_bulk_tiles(large, None if glob else I)
    if gu_tile not in allowed["gu"] or dn_tile not in allowed["dn"]:
        raise ValueError(f"bulk_tiles: {(gu_tile, dn_tile)} are not compiled with routing source G = {g} "
                         f"({allowed})")
    if not glob and T * k > FUSED_MAX_PAIRS:
        raise ValueError(f"bulk: T*k = {T * k} pairs > {FUSED_MAX_PAIRS} sorted in shared memory")
    for bt in (gu_tile, dn_tile):
        if bt.smem_dyn(g) + bt.smem_static > SMEM_LIMIT:
            raise ValueError(f"bulk: {bt} needs {bt.smem_dyn(g) + bt.smem_static} B of shared memory > {SMEM_LIMIT}")
    tl_bufs = _check_timeline(timeline, g, gu_tile, dn_tile)
    Ip = weights.inter_padded
    i32, i64 = np.int32, np.int64
    pairs = T * k
    plan = []
    if glob:
        # the register ring's routing kernel with chunks of 8 (the bulk kernels' token tile) and its L2 prefetch
        # blocks by the same rule (from T = 64 unless told)
        if l2_prefetch is None:
            l2_prefetch = T >= 64
        k_route = get_kernel(SPEC, "moe_route")
        eb = [a.nbytes // E for a in (weights.w13, weights.s13, weights.w2, weights.s2)]
        route_args = (topk_ids, i32(T), i32(k), i32(E), i32(8), ws.slot_pair, ws.rank, ws.chunks, ws.meta,
                      weights.w13, weights.s13, weights.w2, weights.s2, *(i64(b) for b in eb),
                      i64(_l2_budget() if l2_prefetch else 0))
        route_grid = 1 + (_sm_count() if l2_prefetch else 0)
        plan.append(("route", lambda: k_route((route_grid,), (1024,), route_args)))
    common = (topk_ids, topk_weights, i32(T), i32(k), i32(E), ws.slot_pair, ws.chunks, ws.meta, ws.h, i32(Ip), ws.y,
              i32(BULK_WHOLE))
    for name, mode, bt, w, s, N, KS, act, act_stride, tl in (
            ("gate_up", 0, gu_tile, weights.w13, weights.s13, 2 * I, H // KSTEP, x, H, tl_bufs[0]),
            ("down", 1, dn_tile, weights.w2, weights.s2, H, Ip // KSTEP, ws.h, Ip, tl_bufs[1])):
        dyn = bt.smem_dyn(g)
        fn = get_kernel(SPEC_BULK if tl is None else SPEC_BULK_TIMELINE, _bulk_name(mode, bt, g), max_dynamic_smem=dyn)
        # chunks of <= bt.xr tokens (the compact gate/up blocks cut more of them than the down's 8)
        chunks_max = min(pairs, min(pairs, E) + pairs // bt.xr)
        units = chunks_max * -(-(N // 32) // bt.wm)
        grid = max(1, min(units, _sm_count() * _blocks_per_sm(fn, bt, dyn)))
        args = (w, s, i32(N), i32(KS), act, i32(act_stride)) + common + (() if tl is None else (tl,))
        plan.append((name, lambda fn=fn, grid=grid, bt=bt, args=args, dyn=dyn:
                     fn((grid,), (bt.threads,), args, shared_mem=dyn)))
    plan.append(_combine_launch(topk_ids, weights, ws, out, residual, T))
    return plan


def _check_timeline(timeline, g: int, gu_tile: BulkTile, dn_tile: BulkTile):
    """(gate/up buffer or None, down buffer or None) from ``timeline`` (see moe_launch_plan), checked."""
    if timeline is None:
        return None, None
    if not isinstance(timeline, (tuple, list)) or len(timeline) != 2:
        raise ValueError("timeline: must be None or (gate/up buffer, down buffer), each an int64 array or None")
    comp = _timeline_compiled()[g]
    for i, (key, bt, buf) in enumerate((("gu", gu_tile, timeline[0]), ("dn", dn_tile, timeline[1]))):
        if buf is None:
            continue
        if bt not in comp[key]:
            raise ValueError(f"timeline[{i}]: the timeline build has no block {bt} with routing source G = {g} "
                             f"(compiled: {comp[key]})")
        need = TL_BLOCKS * timeline_words(bt)
        if getattr(buf, "dtype", None) != np.int64 or getattr(buf, "ndim", 0) != 1 or buf.size < need:
            raise ValueError(f"timeline[{i}]: must be a 1-D int64 array of >= {need} words, got "
                             f"{getattr(buf, 'dtype', type(buf))} {getattr(buf, 'shape', '')}")
        if not getattr(buf, "flags", None) or not buf.flags.c_contiguous:
            raise ValueError(f"timeline[{i}]: must be contiguous")
    return timeline[0], timeline[1]
