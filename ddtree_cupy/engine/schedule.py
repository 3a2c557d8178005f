"""Static tile-level work-item schedules for the persistent layer executor (docs/PERSISTENT.md).

A layer (target dense layer 0, a target MoE layer, a drafter layer) is decomposed into *work items*: GEMM
tiles, per-row norms, per-head products, attention splits and their combine, the MoE routing / expert
tiles / combine, and the all-reduce boundaries. Every item declares what it reads and writes (``Region``s
of named, versioned buffers: a buffer that the real layer updates in place, such as the residual stream,
gets a new name per version) and signals one *counter* when it finishes. Its waits are derived from the
dataflow: for each region it reads, every counter group whose items write an overlapping region, with the
group's full item count as the target. Nothing here depends on how the waits are derived being right: the
executor model (``simulate``) checks every read against what has actually been written.

The items are listed in one global topological order (op by op, in dataflow order) and dealt to the
persistent grid's blocks by list scheduling on an estimated cost. Each block runs its list in order, so
every block's list is a subsequence of the global order, which makes the schedule deadlock-free when all
blocks are co-resident: the first unfinished item in the global order has all its producers earlier in
that order (finished) and all earlier items of its own block finished, so its block can run it. The grid
must therefore be co-resident: ``check_coresident`` refuses a grid that is not, ``fit_grid`` gives the
largest one that is (build the schedule for that count instead).

An all-reduce boundary is either a segment boundary (``allreduce="segment"``: the launch ends there and
the collective runs between two persistent launches, today's NCCL call) or one more item
(``allreduce="item"``: a fused in-kernel all-reduce + add + norm can replace its body later; at TP = 1 it
is a copy).

Host only, no GPU: the CPU tests build schedules for every SM count and check them on the model.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

# Item kinds (the device executor's switch uses the same numbers: cuda_src/persistent_layer.cu).
KIND = {
    "norm_row": 1,        # RMSNorm of one row (optionally with the residual add)
    "boundary": 3,        # all-reduce boundary (TP = 1: copy)
    "row_post": 4,        # per-row epilogue (qkv_a post: q_a / kv_a norms + rope + cache write)
    "head_gemm": 5,       # one head's small product (W_UK + rope, W_UV)
    "attn_split": 6,      # one (stream, head group, KV split) of MLA / GQA attention
    "attn_combine": 7,    # merge the splits of one (stream, head group)
    "route_row": 8,       # router top-k of one row + shared-expert SwiGLU
    "moe_plan": 9,        # active-expert slot table from all rows' top-k
    "moe_up": 10,         # one expert slot's gate|up tile + SwiGLU
    "moe_down": 11,       # one expert slot's down tile (column tile v)
    "moe_combine": 12,    # weighted sum over slots + shared expert for column tile v
    "qk_norm_rope_row": 14,  # drafter: q / k norms + rope of one row
    "gemm_part": 15,      # a K range of one 16-row GEMM unit (stream-K): fp32 partial; the group's last part
                          # sums the group's partials in slot order (+ SwiGLU for a gate|up pair)
}
REC_INTS = 16              # device record: kind, op, 7 args, wait_begin, n_waits, signal, run, run waits, 0
RUN_MAX = 4                # a block's consecutive parts of one GEMM run as one executor step, at most this many
MAX_ARGS = 7
UNIT_ROWS = 16             # a stream-K GEMM unit: 16 weight rows (the decode GEMM body's row tile)
KIND_NAME = {v: k for k, v in KIND.items()}

MIN_PART_KT = 8            # a stream-K range holds at least this many k tiles (small GEMMs use fewer blocks)
ALIGN_SLACK = 1.25         # whole-unit ranges when the longest is at most this much over an even split
HEAD_COLS = 64             # a W_UK (+ RoPE) item: 64 of one head's 512 latent columns (8 items per head)
HEAD_COLS_UV = 16          # a W_UV item: 16 of one head's dv columns (K = 512: the executor's register budget
                           # holds that piece's weight fragments; 8 items per head at dv = 128, 16 KB each)
L2 = 0.25                  # cost model: activation bytes (just written, L2-resident) at a quarter of a weight byte
MOE_UP_TILE = 64           # rows of the expert's 2I gate|up weight per item (gate and up halves together)
MOE_DOWN_TILE = 512        # output columns (H) per expert down item
COMBINE_TILE = 512


@dataclass(frozen=True)
class Region:
    """buf[r0:r1, c0:c1] of a 2-D logical buffer (3-D buffers are flattened by the builder)."""
    buf: str
    r0: int
    r1: int
    c0: int
    c1: int

    def overlaps(self, o: "Region") -> bool:
        return self.buf == o.buf and self.r0 < o.r1 and o.r0 < self.r1 and self.c0 < o.c1 and o.c0 < self.c1


@dataclass
class Item:
    id: int
    kind: str
    op: str                       # the stage this item belongs to ("qkv_a", "moe_up", ...)
    args: Tuple[int, ...]         # kind-specific (tile start, row, slot, ...)
    reads: Tuple[Region, ...]
    writes: Tuple[Region, ...]
    group: str                    # the counter this item signals
    cost: float                   # estimated bytes moved (weights + activations)
    segment: int = 0              # launch index within the layer (allreduce="segment" splits launches)
    waits: Tuple[Tuple[int, int], ...] = ()   # (counter id, target)
    signal: int = -1
    block: Optional[int] = None   # pinned block (stream-K parts), else dealt by list scheduling
    # Written (read) by whichever item of the group arrives last, after every other item of the group has
    # finished (the stream-K fixup). Such a group's counter target is its item count + 1: the last item
    # signals a second time once it has written these.
    last_reads: Tuple[Region, ...] = ()
    last_writes: Tuple[Region, ...] = ()


@dataclass(frozen=True)
class LayerShape:
    """One TP rank's shapes of a layer at T = S * R rows (local_dims of models/weights.py for the target)."""
    kind: str                      # "dense" | "moe" | "drafter"
    S: int                         # streams
    R: int                         # rows per stream
    H: int
    nh: int                        # query heads on this rank
    ql: int = 0                    # target: q_lora_rank
    dn: int = 128                  # target: qk_nope_head_dim; drafter: head_dim
    dv: int = 128
    F: int = 0                     # dense / drafter FFN width on this rank
    E: int = 0                     # routed experts
    k: int = 0                     # experts per token
    I: int = 0                     # expert width on this rank
    Is: int = 0                    # shared expert width on this rank
    nkv: int = 0                   # drafter: kv heads on this rank
    kv_splits: int = 0             # attention KV splits per (stream, head group); 0: about one item per block
    kv_len: int = 4096             # cache tokens per stream the attention items read (cost model only)
    head_group: int = 0            # heads per attention item (0: all heads of the rank)
    tp: int = 1

    @property
    def T(self) -> int:
        return self.S * self.R

    def validate(self) -> None:
        if self.kind not in ("dense", "moe", "drafter"):
            raise ValueError(f"LayerShape.kind: expected 'dense', 'moe' or 'drafter', got {self.kind!r}")
        for name in ("S", "R", "H", "nh", "dn", "dv", "tp", "kv_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"LayerShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.H % 16:
            raise ValueError(f"LayerShape.H = {self.H} must be a multiple of 16 (GEMM tiles)")
        if self.kind == "moe" and (self.E < 1 or not 1 <= self.k <= self.E or self.I < 1):
            raise ValueError(f"LayerShape: an MoE layer needs E >= 1, 1 <= k <= E, I >= 1 (E={self.E}, k={self.k}, "
                             f"I={self.I})")
        if self.kind in ("dense", "drafter") and self.F < 1:
            raise ValueError(f"LayerShape: a {self.kind} layer needs F >= 1, got {self.F}")
        if self.kind == "drafter" and (self.nkv < 1 or self.nh % self.nkv):
            raise ValueError(f"LayerShape: drafter heads nh={self.nh} must be a multiple of nkv={self.nkv} >= 1")
        if self.kind != "drafter" and self.ql < 1:
            raise ValueError(f"LayerShape: a target layer needs ql >= 1, got {self.ql}")
        if self.kv_splits < 0:
            raise ValueError(f"LayerShape.kv_splits must be >= 0 (0: automatic), got {self.kv_splits}")
        hg = self.head_group or self.nh
        if self.nh % hg:
            raise ValueError(f"LayerShape.head_group = {hg} must divide nh = {self.nh}")


def target_shape(cfg, tp: int, layer: int, S: int, R: int, kv_splits: int = 0, head_group: int = 0,
                 kv_len: int = 4096) -> LayerShape:
    """The LayerShape of target layer ``layer`` (dense or MoE by the config) on one of ``tp`` ranks."""
    from ..models.weights import local_dims
    d = local_dims(cfg, tp)
    moe = cfg.is_moe_layer(layer)
    return LayerShape(kind="moe" if moe else "dense", S=S, R=R, H=d["H"], nh=d["nh"], ql=d["ql"], dn=d["dn"],
                      dv=d["dv"], F=0 if moe else d["F"], E=d["E"] if moe else 0,
                      k=cfg.num_experts_per_tok if moe else 0, I=d["I"] if moe else 0, Is=d["Is"] if moe else 0,
                      kv_splits=kv_splits, head_group=head_group, tp=tp, kv_len=kv_len)


def drafter_shape(dcfg, tp: int, S: int, R: int, kv_splits: int = 0, kv_len: int = 4096) -> LayerShape:
    if dcfg.num_attention_heads % tp or dcfg.num_key_value_heads % tp or dcfg.intermediate_size % tp:
        raise ValueError(f"drafter_shape: heads / kv heads / FFN width not divisible by tp = {tp}")
    return LayerShape(kind="drafter", S=S, R=R, H=dcfg.hidden_size, nh=dcfg.num_attention_heads // tp,
                      dn=dcfg.head_dim, dv=dcfg.head_dim, F=dcfg.intermediate_size // tp,
                      nkv=dcfg.num_key_value_heads // tp, kv_splits=kv_splits, head_group=0, tp=tp, kv_len=kv_len)


# ---- building ---------------------------------------------------------------------------------------------

class _Builder:
    def __init__(self, shape: LayerShape, n_blocks: int, allreduce: str, rate: float, attention: str = "item"):
        self.s, self.n_blocks, self.allreduce, self.rate = shape, n_blocks, allreduce, rate
        self.attention = attention
        self.whole_units = False        # GEMMs as whole 16-row units only (build_chain's bound on the part ends)
        self.items: List[Item] = []
        self.buffers: Dict[str, Tuple[int, int]] = {}     # produced buffers: name -> (rows, cols)
        self.inputs: Dict[str, Tuple[int, int]] = {}      # buffers that exist before the layer
        self.segment = 0

    def inp(self, name: str, rows: int, cols: int) -> None:
        self.inputs[name] = (rows, cols)

    def buf(self, name: str, rows: int, cols: int) -> None:
        if name in self.buffers or name in self.inputs:
            raise AssertionError(f"buffer {name} declared twice")
        self.buffers[name] = (rows, cols)

    def full(self, name: str) -> Region:
        r, c = self.buffers.get(name) or self.inputs[name]
        return Region(name, 0, r, 0, c)

    def add(self, kind: str, op: str, args, reads, writes, cost: float, group: Optional[str] = None, **kw) -> None:
        self.items.append(Item(len(self.items), kind, op, tuple(int(a) for a in args), tuple(reads), tuple(writes),
                               group or op, float(cost), self.segment, **kw))

    def gemm(self, op: str, x: str, out: str, N: int, K: int, weight_bytes: float = 2.0,
             swiglu: bool = False) -> None:
        """out = x @ w^T as stream-K parts: the GEMM's 16-row units times its k tiles (64 columns of K) form
        one sequence, cut into one contiguous range per block, sized so that every block finishes at the
        same predicted time (blocks still busy with earlier items get less; a small GEMM uses fewer blocks,
        at least MIN_PART_KT k tiles each). A range becomes one item per unit it touches (a part: arg K range,
        fp32 partial in its workspace slot). The parts of one group (a unit; with ``swiglu`` the pair of the
        gate unit j and the up unit F/16 + j, so out = act [T, F]) are summed in slot order by whichever of
        them finishes last, which writes the group's 16 output columns (SwiGLU of the two sums: today's
        silu_mul on the bf16 gate and up)."""
        T = self.s.T
        if N % UNIT_ROWS:
            raise ValueError(f"GEMM {op}: output width {N} is not a multiple of the {UNIT_ROWS}-row unit")
        if swiglu and N % (2 * UNIT_ROWS):
            raise ValueError(f"GEMM {op}: gate|up width {N} must be a multiple of {2 * UNIT_ROWS}")
        KT = -(-K // 64)
        n_units = N // UNIT_ROWS
        width = N // 2 if swiglu else N
        self.buf(out, T, width)
        # the weight unit at sequence position u: for gate|up, gate unit j then up unit j (a pair's parts are
        # adjacent in the sequence); else the units in order
        half = n_units // 2
        weight_unit = (lambda u: (u % 2) * half + u // 2) if swiglu else (lambda u: u)
        kt_cost = UNIT_ROWS * 64 * weight_bytes + L2 * T * 64 * 2
        ranges = self._stream_ranges(n_units * KT, kt_cost, x, align=1 if swiglu else KT)
        pieces = []                                   # (sequence unit, block, kt0, nkt)
        for b, (lo, hi) in enumerate(ranges):
            u = lo // KT
            while lo < hi:
                end = min(hi, (u + 1) * KT)
                pieces.append((u, b, lo - u * KT, end - lo))
                lo, u = end, u + 1
        pieces.sort()                                 # sequence order: a group's parts get contiguous slots
        ws = f"{op}:ws"
        self.buf(ws, len(pieces) * T, UNIT_ROWS)
        per_group: Dict[int, List[int]] = {}
        for idx, (u, *_r) in enumerate(pieces):
            per_group.setdefault(u // 2 if swiglu else u, []).append(idx)
        for g, idxs in sorted(per_group.items()):
            slot0, n = idxs[0], len(idxs)
            n_gate = sum(1 for i in idxs if pieces[i][0] % 2 == 0) if swiglu else 0
            col0 = g * UNIT_ROWS
            for i in idxs:
                u, b, kt0, nkt = pieces[i]
                wu = weight_unit(u)
                c0, c1 = kt0 * 64, min(K, (kt0 + nkt) * 64)
                self.add("gemm_part", op, (wu * UNIT_ROWS, kt0, nkt, i, slot0, n_gate, n),
                         [Region(x, 0, T, c0, c1)], [Region(ws, i * T, (i + 1) * T, 0, UNIT_ROWS)],
                         nkt * kt_cost, group=f"{op}:{g}", block=b,
                         last_reads=(Region(ws, slot0 * T, (slot0 + n) * T, 0, UNIT_ROWS),),
                         last_writes=(Region(out, 0, T, col0, col0 + UNIT_ROWS),))

    def _stream_ranges(self, total: int, unit_cost: float, x: str, align: int = 1) -> List[Tuple[int, int]]:
        """Per block, its contiguous range [lo, hi) of a stream of ``total`` equal units (each costing
        ``unit_cost`` bytes) that starts once buffer ``x`` exists: shares proportional to the time each
        block has left before a common finish (the cost model's free times of the items so far).

        ``align`` (a GEMM's k tiles per 16-row unit): the range ends are rounded to whole units when every
        used block can have one and the longest share grows by at most ALIGN_SLACK over an even split. A
        whole unit is a group of one part, which needs no arrival round trip and no other block's partial
        (measured: the cross-block part end costs more than the imbalance, docs/PERSISTENT.md)."""
        free, ready = _model_free(self.items, self.n_blocks, self.rate, self.segment, x)
        start = [max(f, ready) for f in free]
        n_use = max(1, min(self.n_blocks, total // MIN_PART_KT))
        forced = self.whole_units and align > 1 and total % align == 0
        if forced:                                    # one block per unit at most: every group one part
            n_use = max(1, min(self.n_blocks, total // align))
        use = sorted(range(self.n_blocks), key=lambda b: (start[b], b))[:n_use]
        work = total * unit_cost / self.rate          # us of streaming over all blocks
        # common finish E: sum over used blocks of (E - start_b)+ = work
        st = sorted(start[b] for b in use)
        E, acc = st[0], 0.0
        for i, t in enumerate(st):
            nxt = st[i + 1] if i + 1 < len(st) else math.inf
            # with the first i + 1 blocks active, E rises at 1 / (i + 1) per us of work
            if acc + (i + 1) * (nxt - t) >= work:
                E = t + (work - acc) / (i + 1)
                break
            acc += (i + 1) * (nxt - t)
        share = {b: max(0.0, E - start[b]) for b in use}
        tot = sum(share.values()) or 1.0
        n_whole = total // align
        q = align if forced or (align > 1 and total % align == 0 and n_whole >= len(use)
                                and -(-n_whole // len(use)) * len(use) <= ALIGN_SLACK * n_whole) else 1
        out = [(0, 0)] * self.n_blocks
        lo, cum = 0, 0.0
        for b in sorted(use):
            cum += share[b]
            hi = total if b == max(use) else min(total, int(round(cum / tot * (total // q))) * q)
            out[b] = (lo, max(lo, hi))
            lo = max(lo, hi)
        return out

    def norm_rows(self, op: str, x: str, out: str, res_in: Optional[str], res_out: Optional[str]) -> None:
        T, H = self.s.T, self.s.H
        self.buf(out, T, H)
        if res_out:
            self.buf(res_out, T, H)
        for t in range(T):
            reads = [Region(x, t, t + 1, 0, H)] + ([Region(res_in, t, t + 1, 0, H)] if res_in else [])
            writes = [Region(out, t, t + 1, 0, H)] + ([Region(res_out, t, t + 1, 0, H)] if res_out else [])
            self.add("norm_row", op, (t,), reads, writes, H * 2 * (len(reads) + len(writes)))

    def boundary(self, op: str, x: str, out: str) -> None:
        T, H = self.s.T, self.s.H
        self.buf(out, T, H)
        if self.allreduce == "segment":
            # The collective runs between launches: the item stands for it in the model (its own segment);
            # the device runs nothing for it.
            self.segment += 1
            self.add("boundary", op, (0,), [self.full(x)], [self.full(out)], 0.0)
            self.segment += 1
        else:   # priced as the TP = 1 copy; a fused all-reduce brings its own cost
            self.add("boundary", op, (0,), [self.full(x)], [self.full(out)], T * H * 2 * 2)

    def attention_target(self) -> None:
        s = self.s
        T, H, nh, ql, dn, dv = s.T, s.H, s.nh, s.ql, s.dn, s.dv
        ROW, LAT = 576, 512
        self.gemm("qkv_a", "normed", "qkv_a", ql + ROW, H)
        self.buf("c_q", T, ql)
        self.buf("kv_new", T, ROW)
        for t in range(T):
            self.add("row_post", "qkv_a_post", (t,), [Region("qkv_a", t, t + 1, 0, ql + ROW)],
                     [Region("c_q", t, t + 1, 0, ql), Region("kv_new", t, t + 1, 0, ROW)], (ql + ROW) * 4)
        self.gemm("q_b", "c_q", "q", nh * (dn + 64), ql)
        self.buf("q_full", T, nh * ROW)
        # per (head, HEAD_COLS output columns): one item per head would stream the head's whole W_UK (LAT x dn,
        # 128 KB at Kimi's widths) through one block; piece 0 also writes the head's rotated q_pe
        for hd in range(nh):
            for c in range(LAT // HEAD_COLS):
                c0 = hd * ROW + c * HEAD_COLS
                writes = [Region("q_full", 0, T, c0, c0 + HEAD_COLS)]
                if c == 0:
                    writes.append(Region("q_full", 0, T, hd * ROW + LAT, (hd + 1) * ROW))
                self.add("head_gemm", "w_uk_rope", (hd, c, HEAD_COLS),
                         [Region("q", 0, T, hd * (dn + 64), (hd + 1) * (dn + 64))],
                         writes, HEAD_COLS * dn * 2 + T * (dn + 64 + HEAD_COLS + (64 if c == 0 else 0)) * 2,
                         group=f"w_uk_rope:{hd}")
        self._attention("q_full", ROW, "kv_new", ROW, "o_lat", LAT, per_head_groups=True)
        self.buf("o", T, nh * dv)
        for hd in range(nh):
            for c in range(-(-dv // HEAD_COLS_UV)):
                c0, c1 = hd * dv + c * HEAD_COLS_UV, hd * dv + min(dv, (c + 1) * HEAD_COLS_UV)
                self.add("head_gemm", "w_uv", (hd, c, HEAD_COLS_UV), [Region("o_lat", 0, T, hd * LAT, (hd + 1) * LAT)],
                         [Region("o", 0, T, c0, c1)], (c1 - c0) * LAT * 2 + T * (LAT + c1 - c0) * 2)
        self.gemm("o_proj", "o", "attn_part", H, nh * dv)

    def _attention(self, q: str, qw: int, kv: str, kvw: int, out: str, ow: int, per_head_groups: bool,
                   q_group: str = "") -> None:
        """Items of attention over this step's rows (``kv`` holds the new rows; the cache prefix is an input).
        q: [T, nh * qw]; out: [T, nh * ow]. A (stream, head group) has kv_splits split items and, when
        kv_splits > 1, one combine item."""
        s = self.s
        T, nh, R = s.T, s.nh, s.R
        hg = s.head_group or nh
        # automatic: enough splits that the attention items cover the grid (the cache prefix dominates)
        nsp = s.kv_splits or max(1, min(64, self.n_blocks // (s.S * (nh // hg))))
        if self.attention == "segment":
            # today's attention kernels run between two persistent launches: the items stand for them in the
            # model (their own segment), the device runs nothing for them
            self.segment += 1
        self.buf(out, T, nh * ow)
        if nsp > 1:
            self.buf(out + "_part", s.S * nsp, nh * (ow + 1))
        for st in range(s.S):
            r0, r1 = st * R, (st + 1) * R
            for g0 in range(0, nh, hg):
                qreg = Region(q, r0, r1, g0 * qw, (g0 + hg) * qw)
                kvreg = Region(kv, r0, r1, 0, self.buffers[kv][1])
                for sp in range(nsp):
                    w = (Region(out + "_part", st * nsp + sp, st * nsp + sp + 1, g0 * (ow + 1), (g0 + hg) * (ow + 1))
                         if nsp > 1 else Region(out, r0, r1, g0 * ow, (g0 + hg) * ow))
                    self.add("attn_split", "attention", (st, g0, sp), [qreg, kvreg, Region("kv_cache", st, st + 1, 0, 1)],
                             [w], R * hg * (qw + ow) * 2 + s.kv_len * kvw * 2 / nsp,
                             group=f"attention:{st}:{g0}" if nsp > 1 else f"attention:{st}")
                if nsp > 1:         # one merge item per head: the splits' partials of that head only
                    for hh in range(g0, g0 + hg):
                        self.add("attn_combine", "attn_combine", (st, hh),
                                 [Region(out + "_part", st * nsp, (st + 1) * nsp, hh * (ow + 1), (hh + 1) * (ow + 1))],
                                 [Region(out, r0, r1, hh * ow, (hh + 1) * ow)], nsp * (ow + 1) * 4,
                                 group=f"attn_combine:{st}")
        if self.attention == "segment":
            self.segment += 1

    def dense_mlp(self, x: str, out: str) -> None:
        s = self.s
        # gate|up with SwiGLU in the parts' fixup: act = silu(gate) * up, no separate SwiGLU items
        self.gemm("gate_up", x, "act", 2 * s.F, s.H, swiglu=True)
        self.gemm("down", "act", out, s.H, s.F)

    def moe_mlp(self, x: str, out: str) -> None:
        s = self.s
        T, H, E, k, I, Is = s.T, s.H, s.E, s.k, s.I, s.Is
        slots = min(E, T * k)
        self.gemm("router_gate_up", x, "rg", E + 2 * Is, H, weight_bytes=2.0)
        self.buf("topk", T, 2 * k)
        if Is:
            self.buf("shared_act", T, Is)
        for t in range(T):
            w = [Region("topk", t, t + 1, 0, 2 * k)] + ([Region("shared_act", t, t + 1, 0, Is)] if Is else [])
            self.add("route_row", "route", (t,), [Region("rg", t, t + 1, 0, E + 2 * Is)], w, (E + 2 * Is) * 4)
        self.buf("slots", 1, 2 * slots + 1)            # [count | expert ids | row offsets]
        self.add("moe_plan", "moe_plan", (slots,), [self.full("topk")], [self.full("slots")], T * k * 8)
        if Is:
            self.gemm("shared_down", "shared_act", "shared_out", H, Is)
        # Expert slot j: the j-th active expert of the plan (static count: unused slots run empty).
        up_t = min(MOE_UP_TILE, I)
        rows_per_slot = T * k / slots          # cost model: the rows an active expert serves on average
        half = max(1, up_t // 2)             # act columns per item (its gate and up halves: 2 half rows)
        if I % half:
            raise ValueError(f"MoE width I = {I} is not a multiple of the up tile's {half} act columns")
        self.buf("moe_act", slots * T, I)
        for j in range(slots):
            for u0 in range(0, I, half):
                self.add("moe_up", "moe_up", (j, u0, half),
                         [Region("slots", 0, 1, 0, 2 * slots + 1), self.full(x)],
                         [Region("moe_act", j * T, (j + 1) * T, u0, u0 + half)],
                         2 * half * H * 0.5 + 2 * half * H / 32 * 2 + L2 * rows_per_slot * H * 2,
                         group=f"moe_up:{j}")
        dn_t = min(MOE_DOWN_TILE, H)
        self.buf("moe_part", slots * T, H)
        for v0 in range(0, H, dn_t):
            v1 = min(H, v0 + dn_t)
            for j in range(slots):
                self.add("moe_down", "moe_down", (j, v0, v1 - v0),
                         [Region("slots", 0, 1, 0, 2 * slots + 1), Region("moe_act", j * T, (j + 1) * T, 0, I)],
                         [Region("moe_part", j * T, (j + 1) * T, v0, v1)],
                         (v1 - v0) * I * 0.5 + (v1 - v0) * I / 32 * 2 + L2 * rows_per_slot * I * 2,
                         group=f"moe_down:{v0}")
        self.buf(out, T, H)
        ct = min(COMBINE_TILE, H)
        for v0 in range(0, H, ct):
            v1 = min(H, v0 + ct)
            reads = [Region("moe_part", 0, slots * T, v0, v1), self.full("topk"), Region("slots", 0, 1, 0, 2 * slots + 1)]
            if Is:
                reads.append(Region("shared_out", 0, T, v0, v1))
            self.add("moe_combine", "moe_combine", (v0, v1 - v0), reads, [Region(out, 0, T, v0, v1)],
                     T * k * (v1 - v0) * 4)

    def attention_drafter(self) -> None:
        s = self.s
        T, H, nh, nkv, hd = s.T, s.H, s.nh, s.nkv, s.dn
        self.gemm("qkv", "normed", "qkv", (nh + 2 * nkv) * hd, H)
        self.buf("q_r", T, nh * hd)
        self.buf("kv_new", T, 2 * nkv * hd)
        for t in range(T):
            self.add("qk_norm_rope_row", "qk_norm_rope", (t,), [Region("qkv", t, t + 1, 0, (nh + 2 * nkv) * hd)],
                     [Region("q_r", t, t + 1, 0, nh * hd), Region("kv_new", t, t + 1, 0, 2 * nkv * hd)],
                     (nh + 2 * nkv) * hd * 4)
        self._attention("q_r", hd, "kv_new", 2 * nkv * hd, "o", hd, per_head_groups=True)
        self.gemm("o_proj", "o", "attn_part", H, nh * hd)


def _derive_waits(items: List[Item]) -> Tuple[List[str], Dict[str, int]]:
    """Give each item its signal counter and its waits (counter groups of every producer of what it reads).
    Returns the groups and each group's counter target: its item count, + 1 for a group whose last item
    writes ``last_writes`` (the stream-K fixup signals a second time)."""
    groups: List[str] = []
    gid: Dict[str, int] = {}
    target: Dict[str, int] = {}
    for it in items:
        if it.group not in gid:
            gid[it.group] = len(groups)
            groups.append(it.group)
            target[it.group] = 1 if it.last_writes else 0
        target[it.group] += 1
        it.signal = gid[it.group]
    # index the writers per buffer as arrays for a vectorised overlap test
    by_buf: Dict[str, List[Tuple[Region, Item]]] = {}
    for it in items:
        for w in it.writes + it.last_writes:
            by_buf.setdefault(w.buf, []).append((w, it))
    arr = {b: (np.array([[w.r0, w.r1, w.c0, w.c1] for w, _ in lst], np.int64), [i for _, i in lst])
           for b, lst in by_buf.items()}
    for it in items:
        need: Dict[int, int] = {}
        for r in it.reads:
            if r.buf not in arr:
                continue                      # a layer input
            a, prod = arr[r.buf]
            hit = np.nonzero((a[:, 0] < r.r1) & (r.r0 < a[:, 1]) & (a[:, 2] < r.c1) & (r.c0 < a[:, 3]))[0]
            for h in hit:
                p = prod[h]
                if p.id >= it.id:
                    raise AssertionError(f"item {it.id} ({it.op}) reads {r.buf} written by later item {p.id}")
                need[p.signal] = target[p.group]
        it.waits = tuple(sorted(need.items()))
    return groups, target


@dataclass
class Schedule:
    shape: LayerShape
    n_blocks: int
    allreduce: str
    items: List[Item]
    blocks: List[List[int]]            # item ids per block, in run order
    counters: List[str]                # counter id -> group name
    counter_targets: List[int]         # counter id -> items that signal it
    inputs: Dict[str, Tuple[int, int]]
    buffers: Dict[str, Tuple[int, int]]
    predicted_us: float = 0.0          # list-scheduling makespan at the cost model's rate
    floor_us: float = 0.0              # total bytes / (all blocks at the cost model's rate)
    n_segments: int = 1

    @property
    def ops(self) -> List[str]:
        """Stage names in first-appearance order (the device op table's order)."""
        return list(dict.fromkeys(it.op for it in self.items))

    def segment_ops(self, seg: int) -> List[str]:
        return list(dict.fromkeys(it.op for it in self.items if it.segment == seg))

    def segment_kinds(self, seg: int) -> List[str]:
        return sorted({it.kind for it in self.items if it.segment == seg})

    def segment_blocks(self, seg: int) -> List[List[int]]:
        return [[i for i in b if self.items[i].segment == seg] for b in self.blocks]

    def encode(self, seg: int = 0) -> Dict[str, np.ndarray]:
        """The device form of segment ``seg``: int32 ``items`` [n, REC_INTS] = (kind, op, 7 args, wait_begin,
        n_waits, signal, run, run wait_begin, run n_waits, 0) with op an index into ``ops``, ``waits`` [m, 2] =
        (counter, target), ``block_start`` [n_blocks + 1] (block b runs items block_start[b] ..
        block_start[b + 1] - 1 in order), plus ``n_counters``. A block's consecutive gemm_part items of one
        stage are cut into runs of at most RUN_MAX (the executor runs a run as one step): the first record of
        a run holds its length and the union of its parts' waits (contiguous in ``waits``)."""
        # waits on counters of earlier segments are met by the launch boundary (and every launch starts on a
        # zeroed counter set): only the segment's own counters are waited on.
        seg_of = {it.signal: it.segment for it in self.items}
        op_index = {o: i for i, o in enumerate(self.ops)}
        rows, waits, starts = [], [], [0]
        for b in self.segment_blocks(seg):
            for i in b:
                it = self.items[i]
                own = [(c, t) for c, t in it.waits if seg_of[c] == seg]
                if len(it.args) > MAX_ARGS:
                    raise AssertionError(f"item {it.id} ({it.op}) has {len(it.args)} args; the record holds "
                                         f"{MAX_ARGS}")
                a = list(it.args) + [0] * (MAX_ARGS - len(it.args))
                rows.append([KIND[it.kind], op_index[it.op]] + a + [len(waits), len(own), it.signal, 0, 0, 0, 0])
                waits.extend([c, t] for c, t in own)
            i = starts[-1]
            while i < len(rows):                      # this block's runs
                m = 1
                if rows[i][0] == KIND["gemm_part"]:
                    while (m < RUN_MAX and i + m < len(rows) and rows[i + m][0] == KIND["gemm_part"]
                           and rows[i + m][1] == rows[i][1]):
                        m += 1
                    last = rows[i + m - 1]
                    rows[i][12:15] = [m, rows[i][9], last[9] + last[10] - rows[i][9]]
                i += m
            starts.append(len(rows))
        return {"items": np.array(rows, np.int32).reshape(-1, REC_INTS),
                "waits": np.array(waits, np.int32).reshape(-1, 2),
                "block_start": np.array(starts, np.int32), "n_counters": np.int32(len(self.counters))}


def _finish(b: "_Builder") -> Schedule:
    """The builder's items as a Schedule: waits derived from the dataflow, the per-block lists dealt by the
    cost model (stream-K parts stay on their blocks), the floor over the items' bytes (boundaries not
    counted)."""
    groups, target = _derive_waits(b.items)
    blocks, free, _ = _assign(b.items, b.n_blocks, b.rate)
    total = sum(it.cost for it in b.items if it.kind != "boundary")
    return Schedule(b.s, b.n_blocks, b.allreduce, b.items, blocks, groups, [target[g] for g in groups], b.inputs,
                    b.buffers, predicted_us=max(free), floor_us=total / (b.n_blocks * b.rate),
                    n_segments=max(it.segment for it in b.items) + 1)


def build_layer(shape: LayerShape, n_blocks: int, allreduce: str = "segment",
                bytes_per_us_per_block: float = 4.0e6 / 132, parts: Sequence[str] = ("attention", "mlp"),
                attention: str = "item", input_norm: bool = True) -> Schedule:
    """The static schedule of one layer for a persistent grid of ``n_blocks`` co-resident blocks.

    ``parts``: ("attention", "mlp") the whole layer; ("mlp",) its second half only (post-attention norm,
    MLP, boundary), whose inputs are ``attn`` (the reduced attention output) and the residual (``h`` for a
    dense layer, ``h1`` otherwise); ("attention",) its first half only (input norm .. o_proj, boundary).

    ``attention``: "item" (the attention splits and their combine are work items of the launch) or
    "segment" (they are a segment of their own, today's attention kernels between two launches: a target
    layer's attention half is then [input_norm, qkv_a, qkv_a_post, q_b, w_uk_rope], the attention, [w_uv,
    o_proj], the boundary).

    ``input_norm``: False (only with parts=("attention",)) leaves the input norm out: ``normed`` is an input,
    as in the engine, whose all-reduce before the layer adds and norms (and an MoE layer's residual add).

    ``bytes_per_us_per_block``: the cost model's streaming rate of one block (default: an H200's ~4 TB/s
    read ceiling over its 132 SMs); the assignment, the stream-K ranges and the predicted times depend on
    it."""
    shape.validate()
    if not isinstance(n_blocks, (int, np.integer)) or n_blocks < 1:
        raise ValueError(f"build_layer: n_blocks must be a positive integer, got {n_blocks!r}")
    if allreduce not in ("segment", "item"):
        raise ValueError(f"build_layer: allreduce must be 'segment' or 'item', got {allreduce!r}")
    if attention not in ("segment", "item"):
        raise ValueError(f"build_layer: attention must be 'segment' or 'item', got {attention!r}")
    parts = tuple(parts)
    if parts not in (("attention", "mlp"), ("mlp",), ("attention",)):
        raise ValueError(f"build_layer: parts must be ('attention', 'mlp'), ('mlp',) or ('attention',), got {parts!r}")
    if not input_norm and parts != ("attention",):
        raise ValueError(f"build_layer: input_norm=False needs parts=('attention',), got {parts!r}")
    b = _Builder(shape, int(n_blocks), allreduce, float(bytes_per_us_per_block), attention)
    T, H = shape.T, shape.H
    b.inp("h", T, H)
    res = "h" if shape.kind == "dense" else "h1"
    if "attention" in parts:
        b.inp("kv_cache", shape.S, 1)
        if not input_norm:
            b.inp("normed", T, H)
        elif shape.kind == "dense":
            b.norm_rows("input_norm", "h", "normed", None, None)
        else:
            b.inp("mlp_prev", T, H)
            b.norm_rows("input_norm", "mlp_prev", "normed", "h", "h1")
        if shape.kind == "drafter":
            b.attention_drafter()
        else:
            b.attention_target()
        b.boundary("allreduce_attn", "attn_part", "attn")
        if "mlp" not in parts:
            return _finish(b)
    else:
        b.inp("attn", T, H)
        if res != "h":
            b.inp(res, T, H)
    b.norm_rows("post_norm", "attn", "normed2", res, "h2")
    if shape.kind == "moe":
        b.moe_mlp("normed2", "mlp_part")
    else:
        b.dense_mlp("normed2", "mlp_part")
    b.boundary("allreduce_mlp", "mlp_part", "mlp_out")
    return _finish(b)


def build_gemm(T: int, N: int, K: int, n_blocks: int, bytes_per_us_per_block: float = 4.0e6 / 132) -> Schedule:
    """The schedule of one GEMM alone (stage ``gemm``: out [T, N] = x [T, K] @ w [N, K]^T, inputs that exist
    before the launch): the executor's stream-K parts measured against a plain launch (bench/persistent.py
    --gemm), with nothing else in the launch."""
    if T < 1 or N < 1 or K < 1 or K % 64:
        raise ValueError(f"build_gemm: T, N, K must be positive with K % 64 == 0, got {T}, {N}, {K}")
    shape = LayerShape("dense", 1, int(T), H=int(K), nh=1, ql=1, F=int(N))
    b = _Builder(shape, int(n_blocks), "segment", float(bytes_per_us_per_block))
    b.inp("x", T, K)
    b.gemm("gemm", "x", "out", int(N), int(K))
    return _finish(b)


def build_chain(kind: str, T: int, width: int, stages: int, n_blocks: int,
                bytes_per_us_per_block: float = 4.0e6 / 132, whole_units: bool = False) -> Schedule:
    """A chain of ``stages`` dependent stages on [T, width] rows, each reading only what the one before it
    wrote (x0 -> x1 -> ... -> x{stages}; x0 exists before the launch): what one dependency edge costs the
    executor against a kernel boundary (bench/persistent_edges.py). ``kind`` "norm": stage j (op
    ``norm{j}``) is an RMSNorm of each row of x{j}, one item per row; "gemm": x{j+1} = x{j} @ w{j}^T
    (op ``gemm{j}``, width x width, stream-K parts; ``whole_units``: one whole 16-row unit per block, no
    cross-block part ends, on width / 16 blocks)."""
    if kind not in ("norm", "gemm"):
        raise ValueError(f"build_chain: kind must be 'norm' or 'gemm', got {kind!r}")
    if T < 1 or stages < 1 or width < 64 or width % 64:
        raise ValueError(f"build_chain: T and stages must be positive and width a multiple of 64 (>= 64), got "
                         f"T {T}, width {width}, stages {stages}")
    shape = LayerShape("dense", 1, int(T), H=int(width), nh=1, ql=1, F=int(width))
    b = _Builder(shape, int(n_blocks), "segment", float(bytes_per_us_per_block))
    b.whole_units = bool(whole_units)
    b.inp("x0", T, width)
    for j in range(stages):
        if kind == "norm":
            b.norm_rows(f"norm{j}", f"x{j}", f"x{j + 1}", None, None)
        else:
            b.gemm(f"gemm{j}", f"x{j}", f"x{j + 1}", int(width), int(width))
    return _finish(b)


ITEM_OVERHEAD_US = 0.5       # cost model: a wait + signal round trip and the first tile's latency


def _assign(items: List[Item], n_blocks: int, rate: float):
    """List scheduling in the global (creation) order: each item goes to the block where it can start
    earliest (its producers' groups finished, the block free); ties to the lowest block; a pinned item
    (``Item.block``: a stream-K part) to its block. Boundary items of a segment-split layer go to block 0
    (they stand for the collective between launches). Returns (per-block lists, free times, the finish time
    per counter)."""
    free = [0.0] * n_blocks
    done_at: Dict[int, float] = {}             # counter -> latest finish among its items so far
    blocks: List[List[int]] = [[] for _ in range(n_blocks)]
    seg_start = 0.0
    cur_seg = 0
    for it in items:
        if it.segment != cur_seg:           # a new launch: every block starts after the previous one ended
            seg_start = max(free)
            free = [seg_start] * n_blocks
            cur_seg = it.segment
        ready = max([done_at.get(c, seg_start) for c, _ in it.waits] + [seg_start])
        dur = it.cost / rate + ITEM_OVERHEAD_US
        if it.block is not None:
            best, best_t = it.block, max(free[it.block], ready)
        else:
            # the block that can start earliest: among blocks free by `ready`, the lowest; else the earliest-free
            best, best_t = -1, math.inf
            for bi in range(n_blocks):
                t = max(free[bi], ready)
                if t < best_t:
                    best, best_t = bi, t
                    if t == ready:
                        break
        free[best] = best_t + dur
        blocks[best].append(it.id)
        done_at[it.signal] = max(done_at.get(it.signal, 0.0), free[best])
    return blocks, free, done_at


def _model_free(items: List[Item], n_blocks: int, rate: float, segment: int, x: str) -> Tuple[List[float], float]:
    """The cost model's per-block free times after ``items`` (a prefix of the layer's list) and the time
    buffer ``x`` is complete, for an item of launch ``segment`` about to be added."""
    if not items:
        return [0.0] * n_blocks, 0.0
    _derive_waits(items)
    _, free, done_at = _assign(items, n_blocks, rate)
    if items[-1].segment != segment:
        free = [max(free)] * n_blocks
    ready = max([done_at[it.signal] for it in items if any(w.buf == x for w in it.writes + it.last_writes)],
                default=0.0)
    return free, ready


# ---- co-residency -----------------------------------------------------------------------------------------

def check_coresident(n_blocks: int, sm_count: int, blocks_per_sm: int) -> None:
    """Refuse a persistent grid that the device cannot hold at once (its blocks would wait on blocks that
    never start)."""
    if blocks_per_sm < 1:
        raise ValueError(f"persistent grid: the kernel cannot be resident at all (occupancy {blocks_per_sm} "
                         f"blocks per SM: too much shared memory or too many registers per block)")
    cap = sm_count * blocks_per_sm
    if n_blocks > cap:
        raise ValueError(f"persistent grid of {n_blocks} blocks cannot be co-resident: the device holds "
                         f"{sm_count} SMs x {blocks_per_sm} blocks = {cap}; build the schedule for "
                         f"fit_grid(...) = {cap} blocks or fewer")


def fit_grid(requested: int, sm_count: int, blocks_per_sm: int, available_sms: Optional[int] = None) -> int:
    """The largest grid <= ``requested`` that is co-resident on ``available_sms`` (default: all) SMs."""
    if blocks_per_sm < 1:
        check_coresident(1, sm_count, blocks_per_sm)
    sms = sm_count if available_sms is None else min(sm_count, available_sms)
    return max(1, min(int(requested), sms * blocks_per_sm))


# ---- the executor model -----------------------------------------------------------------------------------

class Deadlock(RuntimeError):
    pass


class ScheduleError(AssertionError):
    pass


def simulate(sched: Schedule, seed: int = 0, resident: Optional[int] = None, max_steps: Optional[int] = None):
    """Run the schedule on a model of the device: every block walks its list in order; at each step one
    block whose current item's waits are met (chosen at random: any interleaving) runs that item.

    Only ``resident`` blocks (default: all) run at once; a queued block starts when a resident one has
    finished its list, as the hardware would launch it. Checks, per item: every element it reads was
    written earlier (or is a layer input), nothing is written twice, and at the end every produced buffer
    is written completely. Raises ``Deadlock`` when no block can make progress, ``ScheduleError`` on a
    dataflow violation. Returns the order in which items ran."""
    rng = random.Random(seed)
    written = {n: np.zeros(s, np.int8) for n, s in sched.buffers.items()}
    counters = [0] * len(sched.counters)
    order: List[int] = []
    n_seg = sched.n_segments
    for seg in range(n_seg):
        lists = sched.segment_blocks(seg)
        pc = [0] * len(lists)
        queued = [b for b in range(len(lists)) if lists[b]]
        cap = len(queued) if resident is None else max(1, resident)
        running = queued[:cap]
        queued = queued[cap:]
        while running:
            ok = [b for b in running
                  if all(counters[c] >= t for c, t in sched.items[lists[b][pc[b]]].waits)]
            if not ok:
                waiting = {b: sched.items[lists[b][pc[b]]] for b in running}
                desc = ", ".join(f"block {b} at item {it.id} ({it.op})" for b, it in list(waiting.items())[:4])
                raise Deadlock(f"segment {seg}: no resident block can progress ({desc}; {len(queued)} blocks "
                               f"not resident)")
            b = rng.choice(ok)
            it = sched.items[lists[b][pc[b]]]
            for r in it.reads:
                if r.buf in written and not written[r.buf][r.r0:r.r1, r.c0:r.c1].all():
                    raise ScheduleError(f"item {it.id} ({it.op} {it.args}) reads {r} before it is written")
            def write(regions):
                for w in regions:
                    sub = written[w.buf][w.r0:w.r1, w.c0:w.c1]
                    if sub.any():
                        raise ScheduleError(f"item {it.id} ({it.op} {it.args}) writes {w} a second time")
                    sub[...] = 1
            write(it.writes)
            counters[it.signal] += 1
            if it.last_writes and counters[it.signal] == sched.counter_targets[it.signal] - 1:
                # the group's last item to arrive: every part has written its slot; the fixup reads them all
                for r in it.last_reads:
                    if not written[r.buf][r.r0:r.r1, r.c0:r.c1].all():
                        raise ScheduleError(f"item {it.id} ({it.op} {it.args}) fixup reads {r} before it is written")
                write(it.last_writes)
                counters[it.signal] += 1
            order.append(it.id)
            pc[b] += 1
            if pc[b] == len(lists[b]):
                running.remove(b)
                if queued:
                    running.append(queued.pop(0))
    for n, m in written.items():
        if not m.all():
            raise ScheduleError(f"buffer {n} is not written completely ({int(m.size - m.sum())} elements missing)")
    for c, (v, t) in enumerate(zip(counters, sched.counter_targets)):
        if v != t:
            raise ScheduleError(f"counter {sched.counters[c]} ended at {v}, target {t}")
    return order


def timeline(sched: Schedule, rate: Optional[float] = None) -> List[Tuple[int, int, float, float]]:
    """(block, item, start_us, end_us) of the cost model's run (the assignment's own prediction)."""
    rate = rate or (4.0e6 / 132)
    free = [0.0] * sched.n_blocks
    done: Dict[int, float] = {}
    out = []
    # replay in global order (each block's list is a subsequence of it)
    where = {i: b for b, lst in enumerate(sched.blocks) for i in lst}
    seg_end, cur = 0.0, 0
    for it in sched.items:
        if it.segment != cur:
            seg_end = max(free)
            free = [seg_end] * sched.n_blocks
            cur = it.segment
        b = where[it.id]
        st = max([free[b], seg_end] + [done.get(c, 0.0) for c, _ in it.waits])
        en = st + it.cost / rate + ITEM_OVERHEAD_US
        free[b] = en
        done[it.signal] = max(done.get(it.signal, 0.0), en)
        out.append((b, it.id, st, en))
    return out


def summary(sched: Schedule) -> Dict[str, float]:
    kinds: Dict[str, int] = {}
    for it in sched.items:
        kinds[it.op] = kinds.get(it.op, 0) + 1
    return {"items": len(sched.items), "counters": len(sched.counters), "segments": sched.n_segments,
            "predicted_us": sched.predicted_us, "floor_us": sched.floor_us,
            "ratio": sched.predicted_us / max(sched.floor_us, 1e-9), **{f"n_{k}": v for k, v in kinds.items()}}
