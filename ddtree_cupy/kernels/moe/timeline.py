"""The timeline build of the bulk-copy MoE GEMMs: a profiling build of cuda_src/moe_bulk.cu with per-warp cycle
stamps, selected only by ``moe_forward(..., timeline=)`` (bench/moe.py --timeline; bench/moe_timeline.py reads the
record)."""
from __future__ import annotations

from typing import Tuple

import numpy as np

from ..compile import KernelSpec, register
from .tables import BulkTile, _bulk_names, _table_bulk_blocks

# The timeline build (docs/history/2026-11-29-moe.md, "a timeline build"): the same source with
# -DDDT_MOE_TIMELINE, one more kernel argument (an int64 buffer) into which lane 0 of each warp of the first
# TL_BLOCKS blocks stores SM cycle stamps at fixed events (the layout: the .cu file's "Timeline build" comment,
# bench/moe_timeline.py reads it). A profiling tool, never run by the engine: only ``timeline=`` in
# moe_launch_plan / moe_forward selects it, and the production spec (tables.SPEC_BULK) is compiled without the
# macro (same PTX).
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
    return _table_bulk_blocks()


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
