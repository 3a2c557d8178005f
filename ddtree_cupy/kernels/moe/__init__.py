"""Fused INT4 (W4A16) routed-expert MoE for one layer (cuda_src/moe_int4.cu, cuda_src/moe_bulk.cu); docs/MOE.md
explains it.

    weights = pack_moe_weights(gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale)
    ws = MoEWorkspace(t_max, top_k, weights)
    out = moe_forward(x, topk_ids, topk_weights, weights, ws, out=None, residual=None)

Three launches at small T (T*k <= FUSED_MAX_PAIRS: the routing sort runs in the gate/up kernel's prologue),
four above (a routing kernel with its L2 prefetch blocks first): gate/up, down, per-token combine.

Every step is a kernel on the current stream with sizes fixed by the shapes of the arguments (no host
synchronisation, no allocation when ``out`` is given): the call can be captured into a CUDA graph.

Modules, by concern:
  layout    the numpy model of the repacked layout (``repack_numpy``, the oracle of the GPU repack and of
            tests/test_moe_layout.py), the routing-sort model and a float64 reference MoE (``moe_reference``)
  tables    the tile tables and rules (``select_tiles``, the bulk-copy blocks, ``bulk_for``,
            ``fuse_route_default``), the compiled kernel names and the kernel specs
  timeline  the bulk GEMMs' profiling build (``moe_forward(..., timeline=)``)
  forward   weights, workspace and launches (``pack_moe_weights``, ``MoEWorkspace``, ``moe_launch_plan``,
            ``moe_forward``)
The names below are importable from this package; module switches (``tables.BULK_FORCE`` / ``BULK_TILES``, ``forward.BULK_WHOLE``:
bench.step's measuring arguments) are set where they live.
"""
from __future__ import annotations

from . import forward, layout, tables, timeline
from .forward import MoEWeights, MoEWorkspace, dequant_packed, moe_forward, moe_launch_plan, pack_moe_weights
from .layout import (GROUP, KSTEP, dequant_numpy, frag_col, frag_row, fused_sort_numpy, layout_tables,
                     moe_reference, nat_k, repack_numpy, scale_tables, unpack_nibbles)
from .tables import (BULK_COMPACT_MAX_I, BULK_DEFAULT, BULK_DOWN, BULK_DOWN_CANDIDATES, BULK_DOWN_LARGE,
                     BULK_DOWN_LARGE_CANDIDATES, BULK_GATEUP, BULK_GATEUP_CANDIDATES, BULK_GATEUP_COMPACT,
                     BULK_GATEUP_LARGE, BULK_GATEUP_LARGE_CANDIDATES, BULK_META, BULK_MIN_T, FUSED_MAX_PAIRS,
                     LEAN_T1, LEAN_T_GE_2, MAX_EXPERTS, PF_STEPS, SMEM_LIMIT, SORT_SMEM, SPEC, SPEC_BULK,
                     SPEC_BULK_ALL, BulkTile, MoETiles, Tile, _all_bulk_names, _all_gemm_names, _bulk_compiled,
                     _bulk_name, _bulk_tiles_for, _gemm_name, all_table_tiles, bulk_for, bulk_spec, fuse_route_default,
                     lean_for, select_tiles, with_lean)
from .timeline import SPEC_BULK_TIMELINE, TL_BLOCKS, TL_STAGES, TL_UNITS, _check_timeline, timeline_words

__all__ = [n for n in dir() if not n.startswith("__")]
