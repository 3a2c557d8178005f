"""One MoE layer on the GPU: the load-time repack (``pack_moe_weights``), the fixed-size workspace
(``MoEWorkspace``) and the launches (``moe_launch_plan`` / ``moe_forward``) of the family the tables pick
(moe.tables). docs/MOE.md."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from ..checks import check_array
from ..compile import get_kernel
from .layout import GROUP, KSTEP, _padded_k
from .tables import FUSED_MAX_PAIRS, MAX_EXPERTS, PF_STEPS, SMEM_LIMIT, SORT_SMEM, SPEC, BulkTile, MoETiles, Tile, \
    _bulk_compiled, _bulk_name, _bulk_tiles_for, _gemm_name, bulk_for, bulk_spec, select_tiles
from .timeline import SPEC_BULK_TIMELINE, _check_timeline

# BULK_WHOLE = False (`bench.step --no-bulk-whole`, a measuring baseline) turns off the bulk-copy down GEMM's whole-K
# stage (three copies per stage instead of one per tile and token row).
BULK_WHOLE = True


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


def moe_launch_plan(x, topk_ids, topk_weights, weights: MoEWeights, ws: MoEWorkspace, out, residual=None,
                    tiles: Optional[MoETiles] = None, l2_prefetch: Optional[bool] = None,
                    pf_steps: int = PF_STEPS, fuse_route: Optional[bool] = None, pf_next: bool = True,
                    bulk: Optional[bool] = None, bulk_tiles: Optional[Tuple[BulkTile, BulkTile]] = None,
                    timeline=None):
    """The launches of ``moe_forward`` as [(name, fn)] after checking every argument (the benchmark times
    prefixes of this list to attribute time to stages): [route,] gate_up, down, combine.
    ``bulk``: True: both GEMMs bulk-copy (moe_bulk.cu; both sort the routing themselves where T*k <= FUSED_MAX_PAIRS
    and ``fuse_route`` is not False, else the routing kernel runs first and both read its chunk list, with
    ``l2_prefetch``: None = from T = 64); False: both register-ring (T*k <= FUSED_MAX_PAIRS only; the gate/up sorts
    the routing in its prologue, so no ``fuse_route=False`` / ``l2_prefetch``); None: ``bulk_for``, or the register
    ring when ``tiles`` are given, the bulk-copy GEMMs when the routing kernel is asked for. The bulk kernels take
    none of ``tiles``, ``pf_steps``, ``pf_next``; ``bulk_tiles``: their (gate/up, down) blocks (None: the table's,
    BULK_* up to FUSED_MAX_PAIRS pairs, BULK_*_LARGE above).
    ``fuse_route``: False: the routing kernel sorts and the bulk-copy GEMMs read its chunk list at any T (None /
    True: the table, ``fuse_route_default``). ``l2_prefetch``: extra blocks of the routing kernel prefetch the
    touched experts' weights into L2 (up to a third of L2) while block 0 sorts (None: only for T >= 64, where it
    measured up to 5% faster); ``pf_steps``: how many k64 steps each register-ring warp prefetches into L2 ahead of
    its ring; ``pf_next``: that prefetch runs on into the warp's next unit.
    ``timeline``: None (production), or (gate/up buffer, down buffer), each a 1-D int64 cupy array of at least
    TL_BLOCKS * timeline_words(block) words or None: that bulk GEMM runs the timeline build (SPEC_BULK_TIMELINE;
    bulk=True only, the table's blocks of ``_timeline_compiled``) and writes its event record there (poison the
    buffer with -1 first: unwritten words stay -1; bench/moe_timeline.py analyses it)."""
    if pf_steps < 0 or pf_steps % 4:
        raise ValueError(f"pf_steps: must be a non-negative multiple of 4, got {pf_steps}")
    from ..compile import device_arch
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
    if bulk is None:
        bulk = False if tiles is not None else (fuse_route is False or bool(l2_prefetch) or bulk_for(T, k))
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
    if fuse_route is False or l2_prefetch:
        raise ValueError("fuse_route, l2_prefetch: the register-ring gate/up sorts the routing in its prologue "
                         "(the routing kernel feeds the bulk-copy GEMMs only)")
    if tiles is None:
        tiles = select_tiles(device_arch(), T, weights.inter)
    Ip = weights.inter_padded
    # dynamic shared memory: the gate/up's sort arrays
    dyn_gu, dyn_dn = SORT_SMEM, 0
    for tl, dyn in ((tiles.gateup, dyn_gu), (tiles.down, dyn_dn)):
        if dyn + tl.smem_static(tiles.nt) > SMEM_LIMIT:
            raise ValueError(f"tiles: {tl} needs {dyn + tl.smem_static(tiles.nt)} B of shared memory > {SMEM_LIMIT}")
    chunk = 8 * tiles.nt
    i32 = np.int32
    pairs = T * k
    chunks_max = min(pairs, min(pairs, E) + pairs // chunk)

    plan = []
    common = (topk_ids, topk_weights, i32(T), i32(k), i32(E), ws.slot_pair, ws.chunks, ws.meta)
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
    dn_args = (weights.w2, weights.s2, i32(H), i32(Ip // KSTEP), ws.h, i32(Ip)) + common + (ws.h, i32(Ip)) + tail
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
    two fit by shared memory (the compact gate/up's timeline build ran in two waves that way)."""
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
    gu_tile, dn_tile = bulk_tiles if bulk_tiles is not None else _bulk_tiles_for(large, None if glob else I)
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
        name = _bulk_name(mode, bt, g)
        fn = get_kernel(bulk_spec(name) if tl is None else SPEC_BULK_TIMELINE, name, max_dynamic_smem=dyn)
        # chunks of <= bt.xr tokens (the compact gate/up blocks cut more of them than the down's 8)
        chunks_max = min(pairs, min(pairs, E) + pairs // bt.xr)
        units = chunks_max * -(-(N // 32) // bt.wm)
        grid = max(1, min(units, _sm_count() * _blocks_per_sm(fn, bt, dyn)))
        args = (w, s, i32(N), i32(KS), act, i32(act_stride)) + common + (() if tl is None else (tl,))
        plan.append((name, lambda fn=fn, grid=grid, bt=bt, args=args, dyn=dyn:
                     fn((grid,), (bt.threads,), args, shared_mem=dyn)))
    plan.append(_combine_launch(topk_ids, weights, ws, out, residual, T))
    return plan
