"""The persistent layer executor (cuda_src/persistent_layer.cu; design in docs/PERSISTENT.md).

``PersistentSegment`` uploads one launch's worth of a ``engine.schedule.Schedule`` (``Schedule.encode``),
binds every stage of it to device buffers through an op table (``PersistOpArgs`` per stage), and launches
the executor with one block per scheduled list. The grid is checked against the driver's occupancy
calculator before the first launch (``schedule.check_coresident``): a grid that cannot be co-resident is
refused with the largest one that can (``schedule.fit_grid``), never launched to deadlock. A wait that
passes its bound sets the error word instead of hanging; ``check`` raises it naming the item and stage.

Item bodies this build runs: ``norm_row``, ``gemm_part`` (a stream-K part of a 16-row unit, T <= 16; a block's
consecutive parts of one GEMM run as one step through one ring; the group's last part sums the partials,
with SwiGLU for a gate|up pair), ``boundary`` (TP = 1: the all-reduce stand-in copy), ``row_post`` (the MLA
qkv_a epilogue of one row: the two latent norms, RoPE of k_pe, the cache write) and ``head_gemm`` (a piece of
one head's W_UK (+ RoPE of q_pe) or W_UV product: 64 or 16 output columns, ``HEAD_PIECE``); ``supported_segment`` says whether a segment
uses only those (the dense / drafter MLP half of a layer does, and a target layer's attention half around
its attention kernels, built with ``attention="segment"``; the attention and MoE items are not built yet,
see docs/PERSISTENT.md). A segment owns the fp32 workspace of its GEMMs' partial slots.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence

import numpy as np

from ..engine import schedule as sched_mod
from .compile import CUDA_SRC_DIR, KernelSpec, get_kernel, register

THREADS = 256
RING_BYTES = 96 * 1024                 # the decode GEMM body's rings (kernels/gemm.py dec_smem_bytes), at offset 0
META_BYTES = 576                       # struct PersistMeta after the rings (cuda_src/persistent_layer.cu)
SMEM_LIMIT = 99 * 1024                 # sm_120's per-block limit: the op table copy must fit beside the rings
SUPPORTED_KINDS = frozenset({"norm_row", "gemm_part", "boundary", "row_post", "head_gemm"})
MAX_T = 16                             # the decode GEMM body's token limit (NT <= 2)
LATENT, ROPE, ROW, PAGE = 512, 64, 576, 64     # the MLA latent cache row (kernels/fused.py)
QL_MAX = 8 * 2 * 256                   # the row body's q_lora limit (FL_QMAXV vectors of 8 per thread)
# the head_gemm body's piece width per K (persistent_layer.cu head_gemm_item<KS, NJ>): W_UK, W_UV
HEAD_PIECE = {128: sched_mod.HEAD_COLS, 512: sched_mod.HEAD_COLS_UV}
DEFAULT_SPIN_LIMIT = 1 << 21           # polls of one wait before the launch gives up (~2 s: 1 us back-off)
ERR_REASON = {1: "a dependency wait timed out", 2: "an item kind this build does not run",
              3: "an item whose shape the body does not serve (GEMM T > 16, head product K not 128 / 512, "
                 "q_lora > 4096, no argument block)"}

# The .cu files the executor #includes besides the .cuh headers (compile.KernelSpec.source covers those):
# their text goes into the source's digest line so an edit recompiles instead of loading a stale cubin.
_INCLUDED_CU = ("gemm_bf16.cu",)


@dataclass(frozen=True)
class _PersistentSpec(KernelSpec):
    def source(self) -> str:
        h = hashlib.sha1()
        for name in _INCLUDED_CU:
            h.update((CUDA_SRC_DIR / name).read_bytes())
        return f"// included .cu digest {h.hexdigest()[:16]}\n" + super().source()


# The executor is built for two resident blocks per SM where the device holds them (the H200: two 96 KB rings
# per SM; sm_120's 100 KB holds one) under a 128-register budget, which admits the 16-row GEMM unit
# (schedule.UNIT_ROWS) beside the norm body.
BLOCKS_PER_SM = 2

SPEC = register(_PersistentSpec("persistent_layer.cu", ("persistent_layer",), hot=True, pdl=True,
                                doc="persistent layer executor: a precomputed work-item schedule per block, "
                                    "counter waits in global memory"))

# struct PersistOp (cuda_src/persistent_layer.cu): 5 pointers, 4 int64 strides, T N K flags, the aux offset, eps, pad
OP_DTYPE = np.dtype([("x", np.uint64), ("x2", np.uint64), ("w", np.uint64), ("out", np.uint64), ("out2", np.uint64),
                     ("x_stride", np.int64), ("x2_stride", np.int64), ("out_stride", np.int64),
                     ("out2_stride", np.int64), ("T", np.int32), ("N", np.int32), ("K", np.int32),
                     ("flags", np.int32), ("aux", np.int64), ("eps", np.float32), ("pad", np.int32)])
assert OP_DTYPE.itemsize == 104       # static_asserts in persistent_layer.cu pin the same layout
# struct PersistAux: the row_post / head_gemm stages' extra arguments, after the op records in the same table
AUX_DTYPE = np.dtype([("w2", np.uint64), ("positions", np.uint64), ("inv_freq", np.uint64), ("stream_ids", np.uint64),
                      ("kv_pos", np.uint64), ("pool", np.uint64), ("block_table", np.uint64), ("pe", np.uint64),
                      ("pe_out", np.uint64), ("x_head", np.int64), ("out_head", np.int64), ("pe_row", np.int64),
                      ("pe_head", np.int64), ("pe_out_row", np.int64), ("pe_out_head", np.int64),
                      ("max_pages", np.int32), ("half", np.int32), ("amplitude", np.float32), ("pad", np.int32)])
assert AUX_DTYPE.itemsize == 136
AUX_KINDS = frozenset({"row_post", "head_gemm"})
TABLE_BYTES = (SMEM_LIMIT - RING_BYTES - META_BYTES) // 16 * 16     # the op table's room beside the rings
MAX_OPS = TABLE_BYTES // OP_DTYPE.itemsize     # 24 stages per schedule (fewer with argument blocks)


def table_bytes(n_ops: int, n_aux: int = 0) -> int:
    """The op table of ``n_ops`` stages, ``n_aux`` of them with an argument block (8-byte words)."""
    return n_ops * OP_DTYPE.itemsize + n_aux * AUX_DTYPE.itemsize


def smem_bytes(n_ops: int, n_aux: int = 0) -> int:
    """Dynamic shared memory of a launch: the rings, the executor's words, the block's copy of the op table."""
    return RING_BYTES + META_BYTES + -(-table_bytes(n_ops, n_aux) // 16) * 16


SMEM_BYTES = RING_BYTES + META_BYTES + TABLE_BYTES       # the occupancy question's size: the largest launch


def device_rows(enc: Mapping[str, np.ndarray]):
    """The encoded items re-laid for the kernel: block b's rows start at b * stride, a header row (count, 0..)
    then its records in order, plus RUN_MAX + 1 padding rows at the end (a step reads RUN_MAX records at
    once). Returns (rows [n_blocks * stride + RUN_MAX + 1, REC_INTS] int32, stride, device row -> encoded
    row)."""
    bs = enc["block_start"]
    counts = np.diff(bs)
    stride = int(counts.max(initial=0)) + 1
    n_blocks = len(counts)
    pad = sched_mod.RUN_MAX + 1
    rows = np.zeros((n_blocks * stride + pad, sched_mod.REC_INTS), np.int32)
    dev_to_enc = np.full(n_blocks * stride + pad, -1, np.int64)
    for b in range(n_blocks):
        base, c = b * stride, int(counts[b])
        rows[base, 0] = c
        rows[base + 1:base + 1 + c] = enc["items"][bs[b]:bs[b] + c]
        dev_to_enc[base + 1:base + 1 + c] = np.arange(bs[b], bs[b] + c)
    return rows, stride, dev_to_enc


@dataclass
class PersistOpArgs:
    """One stage's buffers. norm_row: x (+ residual x2 -> out2), w = norm weight, out = normed, N = H.
    gemm_part: x [T, K], w [N, K], out [T, N] bf16, or with ``swiglu`` out = act [T, N / 2] = silu(x w_gate^T)
    * (x w_up^T) for w = [gate; up] (the segment adds the partials' workspace). boundary: out = x, N = width.
    row_post (kernels/fused.mla_qkv_a_post's contract): x = qkv_a [T, ql + 576], w = the q_a norm [ql], w2 =
    the kv_a norm [512], out = c_q [T, ql], K = ql, eps; positions / stream_ids / kv_pos int32 [T], inv_freq
    float32 [32], amplitude, pool [pages, 64, 576], block_table int32 [streams, max_pages].
    head_gemm (kernels/fused.mla_head_gemm's): x [T, nh, K] and out [T, nh, N] strided views, w [nh, N, K]
    (K 128 or 512, N a multiple of that K's piece, ``HEAD_PIECE``); optionally pe / pe_out [T, nh, 2 half] with
    positions, inv_freq, amplitude."""
    x: object
    out: object
    w: object = None
    x2: object = None
    out2: object = None
    N: int = 0
    K: int = 0
    eps: float = 0.0
    swiglu: bool = False
    w2: object = None
    positions: object = None
    inv_freq: object = None
    amplitude: float = 1.0
    stream_ids: object = None
    kv_pos: object = None
    pool: object = None
    block_table: object = None
    pe: object = None
    pe_out: object = None


def _rows_stride(name: str, a, T: int) -> int:
    if a.ndim != 2 or a.shape[0] < T:
        raise ValueError(f"{name}: expected a 2-D array of >= {T} rows, got shape {a.shape}")
    if a.strides[1] != a.itemsize or a.strides[0] % 16 or a.data.ptr % 16:
        raise ValueError(f"{name}: rows must be contiguous and 16-byte aligned (strides {a.strides})")
    return a.strides[0] // a.itemsize


def _view3(name: str, a, T: int, dims: Sequence[Optional[int]], align: int):
    """(row stride, head stride) in elements of a [T, nh, width] uint16 view with a contiguous last dimension,
    its pointer and strides multiples of ``align`` bytes."""
    if a is None or a.ndim != 3 or a.shape[0] < T or a.dtype != np.uint16:
        raise ValueError(f"{name}: expected a uint16 [>= {T}, nh, width] view, got "
                         f"{None if a is None else (a.shape, a.dtype)}")
    for i, d in enumerate(dims):
        if d is not None and a.shape[1 + i] != d:
            raise ValueError(f"{name}: dimension {1 + i} is {a.shape[1 + i]}, expected {d}")
    if a.strides[2] != 2 or a.strides[0] % align or a.strides[1] % align or a.data.ptr % align:
        raise ValueError(f"{name}: the last dimension must be contiguous and the rows / heads {align}-byte aligned "
                         f"(strides {a.strides})")
    return a.strides[0] // 2, a.strides[1] // 2


def _vec(name: str, a, dtype, n: Optional[int] = None):
    if a is None or a.ndim != 1 or a.dtype != dtype or (n is not None and a.shape[0] < n):
        raise ValueError(f"{name}: expected {np.dtype(dtype).name} [{'>= ' + str(n) if n else 'n'}], got "
                         f"{None if a is None else (a.shape, a.dtype)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: must be contiguous")


def supported_segment(s: sched_mod.Schedule, seg: int) -> bool:
    return set(s.segment_kinds(seg)) <= SUPPORTED_KINDS and s.shape.T <= MAX_T


class PersistentSegment:
    """Launch ``seg`` of schedule ``s`` with the stages bound by ``ops`` ({stage name: PersistOpArgs})."""

    def __init__(self, s: sched_mod.Schedule, seg: int, ops: Mapping[str, PersistOpArgs],
                 spin_limit: int = DEFAULT_SPIN_LIMIT, trace: bool = False):
        import cupy
        if not 0 <= seg < s.n_segments:
            raise ValueError(f"seg: {seg} not in [0, {s.n_segments})")
        bad = sorted(set(s.segment_kinds(seg)) - SUPPORTED_KINDS)
        if bad:
            raise ValueError(f"persistent segment {seg} has item kinds {bad} that this build does not run "
                             f"(runs {sorted(SUPPORTED_KINDS)})")
        T = s.shape.T
        if T > MAX_T:
            raise ValueError(f"persistent segment: T = {T} rows > {MAX_T} (the decode GEMM body's limit)")
        need = s.segment_ops(seg)
        missing = [o for o in need if o not in ops]
        if missing:
            raise ValueError(f"ops: no buffers bound for stages {missing}")
        kinds = {it.op: it.kind for it in s.items if it.segment == seg}
        with_aux = [n for n in need if kinds[n] in AUX_KINDS]
        if table_bytes(len(s.ops), len(with_aux)) > TABLE_BYTES:
            raise ValueError(f"persistent segment: {len(s.ops)} stages ({len(with_aux)} with argument blocks) take "
                             f"{table_bytes(len(s.ops), len(with_aux))} bytes of op table; the executor's "
                             f"shared-memory copy holds {TABLE_BYTES}")
        for it in s.items:
            if it.segment == seg and it.kind == "head_gemm":
                K = int(ops[it.op].w.shape[2]) if ops[it.op].w is not None and ops[it.op].w.ndim == 3 else None
                if HEAD_PIECE.get(K) != it.args[2]:
                    raise ValueError(f"stage {it.op}: items of {it.args[2]} columns, the head body runs "
                                     f"{HEAD_PIECE} (columns per K)")
        self.s, self.seg, self.T = s, seg, T
        enc = s.encode(seg)
        table = np.zeros(len(s.ops), OP_DTYPE)
        aux = np.zeros(len(with_aux), AUX_DTYPE)
        self.workspaces = {}                 # GEMM stage -> fp32 block sums [part slot][T][16]
        for name in need:
            i = s.ops.index(name)
            table[i] = self._op_record(name, kinds[name], ops[name], T)
            if kinds[name] in AUX_KINDS:
                j = with_aux.index(name)
                aux[j] = self._aux_record(name, kinds[name], ops[name], T)
                table[i]["aux"] = len(s.ops) * OP_DTYPE.itemsize + j * AUX_DTYPE.itemsize
            if kinds[name] == "gemm_part":
                rows_ws, cols_ws = s.buffers[f"{name}:ws"]      # [slots * T, 16] in the model
                self.workspaces[name] = cupy.full((rows_ws, cols_ws), np.nan, np.float32)
                table[i]["out2"] = self.workspaces[name].data.ptr
        self.ops = dict(ops)                                 # keep the bound arrays alive
        rows, self.stride, self._dev_to_enc = device_rows(enc)
        self.items = cupy.asarray(rows)
        self.n_ops = len(s.ops)
        self.waits = cupy.asarray(enc["waits"] if len(enc["waits"]) else np.zeros((1, 2), np.int32))
        blob = np.concatenate([table.view(np.uint8), aux.view(np.uint8)])
        self.op_table = cupy.asarray(blob)
        self.table_words = blob.size // 8
        self.smem = smem_bytes(self.n_ops, len(with_aux))
        self.n_counters = int(enc["n_counters"])
        # two counter sets, launches alternating between them by each block's own launch count (the kernel
        # zeroes the set it does not use, so a graph replays the launch with no memset and no reset at its end)
        self.counters = cupy.zeros(2 * max(1, self.n_counters), np.int32)
        self.launches = cupy.zeros(s.n_blocks, np.int32)
        self.err = cupy.zeros(2, np.int32)
        self.spin_limit = int(spin_limit)
        self.n_items = int(enc["items"].shape[0])
        self.trace = cupy.zeros((rows.shape[0], 4), np.int64) if trace else None
        self._enc = enc
        self.kernel = get_kernel(SPEC, "persistent_layer", SMEM_BYTES)
        dev = cupy.cuda.Device()
        self.sm_count = int(dev.attributes["MultiProcessorCount"])
        fn = getattr(self.kernel, "kernel", self.kernel)
        self.blocks_per_sm = int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, THREADS,
                                                                                             SMEM_BYTES))
        sched_mod.check_coresident(s.n_blocks, self.sm_count, self.blocks_per_sm)

    @staticmethod
    def _op_record(name: str, kind: str, a: PersistOpArgs, T: int):
        rec = np.zeros((), OP_DTYPE)
        ptr = lambda v: 0 if v is None else int(v.data.ptr)      # noqa: E731
        for f in ("x", "out"):
            if getattr(a, f) is None:
                raise ValueError(f"stage {name}: {f} is required")
        rec["x"], rec["x2"], rec["w"], rec["out"], rec["out2"] = ptr(a.x), ptr(a.x2), ptr(a.w), ptr(a.out), ptr(a.out2)
        if kind == "head_gemm":
            return PersistentSegment._head_gemm_record(name, a, T, rec)
        rec["x_stride"] = _rows_stride(f"{name}.x", a.x, T)
        rec["out_stride"] = _rows_stride(f"{name}.out", a.out, T)
        if a.x2 is not None:
            rec["x2_stride"] = _rows_stride(f"{name}.x2", a.x2, T)
            rec["out2_stride"] = _rows_stride(f"{name}.out2", a.out2 if a.out2 is not None else a.x2, T)
            if a.out2 is None:
                rec["out2"] = ptr(a.x2)                          # in place, as rms_norm(residual=...)
        rec["T"], rec["N"], rec["K"] = T, int(a.N), int(a.K)
        rec["eps"] = float(a.eps)
        rec["flags"] = 2 if a.swiglu else 0
        if kind == "gemm_part":
            if a.w is None or tuple(a.w.shape) != (a.N, a.K) or a.w.dtype != np.uint16:
                raise ValueError(f"stage {name}: w must be uint16 [{a.N}, {a.K}], got "
                                 f"{None if a.w is None else (a.w.shape, a.w.dtype)}")
            width = a.N // 2 if a.swiglu else a.N
            if a.K % 64 or a.x.shape[1] < a.K or a.out.shape[1] < width or a.out.dtype != np.uint16:
                raise ValueError(f"stage {name}: K = {a.K} must be a multiple of 64 and fit x {a.x.shape}; out must be "
                                 f"uint16 holding {width} columns, got {a.out.shape} {a.out.dtype}")
        elif kind == "norm_row":
            if a.w is None or a.w.shape != (a.N,) or a.N % 8 or a.N > 8 * 4 * 256:
                raise ValueError(f"stage {name}: norm weight must be [{a.N}] with N % 8 == 0, N <= 8192")
        elif kind == "boundary":
            if a.N % 8 or a.x.shape[1] < a.N or a.out.shape[1] < a.N:
                raise ValueError(f"stage {name}: N = {a.N} must be a multiple of 8 and fit x and out")
        elif kind == "row_post":
            ql = int(a.K)
            if ql < 8 or ql % 8 or ql > QL_MAX:
                raise ValueError(f"stage {name}: K = q_lora = {ql} must be a positive multiple of 8, <= {QL_MAX}")
            if a.x.dtype != np.uint16 or a.x.shape[1] < ql + ROW or a.out.dtype != np.uint16 or a.out.shape[1] < ql:
                raise ValueError(f"stage {name}: x must be uint16 [T, {ql} + {ROW}] and out uint16 [T, {ql}], got "
                                 f"{a.x.shape} {a.x.dtype} / {a.out.shape} {a.out.dtype}")
            _vec(f"{name}.w", a.w, np.uint16, ql)
            rec["N"] = ql + ROW
            if not (a.eps > 0):
                raise ValueError(f"stage {name}: eps must be positive, got {a.eps}")
        return rec

    @staticmethod
    def _head_gemm_record(name: str, a: PersistOpArgs, T: int, rec):
        if a.w is None or a.w.ndim != 3 or a.w.dtype != np.uint16 or not a.w.flags.c_contiguous:
            raise ValueError(f"stage {name}: w must be a contiguous uint16 [nh, N, K], got "
                             f"{None if a.w is None else (a.w.shape, a.w.dtype)}")
        nh, N, K = (int(v) for v in a.w.shape)
        if K not in HEAD_PIECE or N % HEAD_PIECE[K]:
            raise ValueError(f"stage {name}: w [nh, N, K] needs K in {sorted(HEAD_PIECE)} and N a multiple of the "
                             f"piece ({HEAD_PIECE}), got {a.w.shape}")
        rec["x_stride"] = _view3(f"{name}.x", a.x, T, (nh, K), 4)[0]
        rec["out_stride"] = _view3(f"{name}.out", a.out, T, (nh, N), 2)[0]
        rec["T"], rec["N"], rec["K"] = T, N, K
        return rec

    @staticmethod
    def _aux_record(name: str, kind: str, a: PersistOpArgs, T: int):
        """The stage's PersistAux (row_post, head_gemm), checked."""
        rec = np.zeros((), AUX_DTYPE)
        ptr = lambda v: 0 if v is None else int(v.data.ptr)      # noqa: E731
        rec["amplitude"] = float(a.amplitude)
        if kind == "row_post":
            _vec(f"{name}.w2", a.w2, np.uint16, LATENT)
            for f in ("positions", "stream_ids", "kv_pos"):
                _vec(f"{name}.{f}", getattr(a, f), np.int32, T)
            _vec(f"{name}.inv_freq", a.inv_freq, np.float32, ROPE // 2)
            if a.pool is None or a.pool.ndim != 3 or tuple(a.pool.shape[1:]) != (PAGE, ROW) or a.pool.dtype != np.uint16:
                raise ValueError(f"stage {name}: pool must be uint16 [pages, {PAGE}, {ROW}], got "
                                 f"{None if a.pool is None else (a.pool.shape, a.pool.dtype)}")
            bt = a.block_table
            if bt is None or bt.ndim != 2 or bt.dtype != np.int32 or not bt.flags.c_contiguous:
                raise ValueError(f"stage {name}: block_table must be a contiguous int32 [streams, max_pages]")
            for f in ("w2", "positions", "inv_freq", "stream_ids", "kv_pos", "pool", "block_table"):
                rec[f] = ptr(getattr(a, f))
            rec["max_pages"] = int(bt.shape[1])
            return rec
        nh = int(a.w.shape[0])
        rec["x_head"] = _view3(f"{name}.x", a.x, T, (nh, None), 4)[1]
        rec["out_head"] = _view3(f"{name}.out", a.out, T, (nh, None), 2)[1]
        if a.pe is not None:
            rec["pe_row"], rec["pe_head"] = _view3(f"{name}.pe", a.pe, T, (nh, None), 2)
            half2 = int(a.pe.shape[2])
            if half2 % 2 or a.pe_out is None:
                raise ValueError(f"stage {name}: pe needs an even rotary width and pe_out")
            rec["pe_out_row"], rec["pe_out_head"] = _view3(f"{name}.pe_out", a.pe_out, T, (nh, half2), 2)
            _vec(f"{name}.positions", a.positions, np.int32, T)
            _vec(f"{name}.inv_freq", a.inv_freq, np.float32, half2 // 2)
            rec["pe"], rec["pe_out"] = ptr(a.pe), ptr(a.pe_out)
            rec["positions"], rec["inv_freq"] = ptr(a.positions), ptr(a.inv_freq)
            rec["half"] = half2 // 2
        elif a.pe_out is not None or a.positions is not None:
            raise ValueError(f"stage {name}: pe_out / positions given without pe")
        return rec

    def launch(self) -> None:
        """Enqueue the segment on the current stream (graph-capturable: static buffers, counters zeroed by
        the kernel itself a launch ahead)."""
        i32 = np.int32
        self.kernel((self.s.n_blocks,), (THREADS,),
                    (self.items, i32(self.stride), self.waits, self.op_table, i32(self.table_words), self.counters,
                     i32(self.n_counters), self.launches, self.err, np.int32(self.spin_limit),
                     self.trace if self.trace is not None else np.uint64(0)),
                    shared_mem=self.smem)

    def check(self) -> None:
        """Raise if a launch recorded an error (synchronises); resets the counters after one."""
        e = self.err.get()
        if e[0]:
            enc_row = int(self._dev_to_enc[int(e[0]) - 1])
            kind, op = int(self._enc["items"][enc_row, 0]), self.s.ops[int(self._enc["items"][enc_row, 1])]
            self.err[...] = 0
            self.counters[...] = 0
            self.launches[...] = 0
            raise RuntimeError(f"persistent segment {self.seg}: item {enc_row} (stage {op}, kind "
                               f"{sched_mod.KIND_NAME.get(kind, kind)}) failed: {ERR_REASON.get(int(e[1]), e[1])}")

    def timeline(self):
        """[(block, item row, stage, start_ns, end_ns)] of the last launch (trace=True; globaltimer)."""
        if self.trace is None:
            raise ValueError("timeline: construct the segment with trace=True")
        tr = self.trace.get()
        return [(int(tr[d, 0]), int(i), self.s.ops[int(self._enc["items"][i, 1])], int(tr[d, 1]), int(tr[d, 2]))
                for d, i in enumerate(self._dev_to_enc) if i >= 0]

    def block_times(self) -> np.ndarray:
        """[n_blocks, 4] int64 of the last launch (trace=True): each block's start, the end of its set-up (header,
        first records and op table read) and its end (globaltimer ns), and the SM it ran on (%smid)."""
        if self.trace is None:
            raise ValueError("block_times: construct the segment with trace=True")
        tr = self.trace.get()
        return tr[np.arange(self.s.n_blocks) * self.stride].copy()


def bind_dense_mlp(s: sched_mod.Schedule, *, attn, h, post_norm_w, eps: float, w_gate_up, w_down, normed,
                   act, out, final=None) -> Dict[str, PersistOpArgs]:
    """The op table of a dense MLP half (``build_layer(..., parts=("mlp",))`` of a dense or drafter layer):
    h += attn; normed = rms_norm(h); act = silu(normed @ w_gate^T) * (normed @ w_up^T) (the gate|up parts'
    fixup); out = act @ w_down^T (this rank's partial). With allreduce="item" the boundary copies out into ``final``
    (TP = 1; a fused all-reduce replaces that body). Buffers are [>= T, width] uint16 device arrays."""
    H = int(s.shape.H)
    F = int(w_down.shape[1])
    if tuple(w_gate_up.shape) != (2 * F, H) or tuple(w_down.shape) != (H, F):
        raise ValueError(f"bind_dense_mlp: w_gate_up {w_gate_up.shape} / w_down {w_down.shape} do not match "
                         f"H = {H}, F = {F}")
    if F != s.shape.F:
        raise ValueError(f"bind_dense_mlp: the schedule was built for F = {s.shape.F}, weights have F = {F}")
    ops = {"post_norm": PersistOpArgs(x=attn, x2=h, out=normed, w=post_norm_w, N=H, eps=float(eps)),
           "gate_up": PersistOpArgs(x=normed, w=w_gate_up, out=act, N=2 * F, K=H, swiglu=True),
           "down": PersistOpArgs(x=act, w=w_down, out=out, N=H, K=F)}
    if "allreduce_mlp" in s.ops:
        if s.allreduce == "item":
            if final is None:
                raise ValueError("bind_dense_mlp: allreduce='item' needs the final output buffer")
            ops["allreduce_mlp"] = PersistOpArgs(x=out, out=final, N=H)
    return ops


def bind_attention_half(s: sched_mod.Schedule, *, w_qkv_a, q_a_norm, kv_a_norm, latent_eps: float, w_q_b, w_uk_t,
                        w_uv, w_o, positions, inv_freq, amplitude: float, stream_ids, kv_pos, pool, block_table,
                        normed, qkv, c_q, q, q_full, o_lat, o, attn_part, h=None, input_norm_w=None,
                        eps: float = 0.0, mlp_prev=None, h1=None, final=None) -> Dict[str, PersistOpArgs]:
    """The op table of a target layer's attention half around its attention kernels (``build_layer(...,
    parts=("attention",), attention="segment")``): segment 0 = normed = rms_norm(h) (an MoE layer: h1 = h +
    mlp_prev first), qkv = normed @ w_qkv_a^T, the qkv_a epilogue (c_q, the latent row into ``pool`` at
    kv_pos), q = c_q @ w_q_b^T, q_full = (q_nope @ W_UK per head | rope(q_pe)); then the caller's attention
    (o_lat from q_full and the pool); segment 2 = o = o_lat @ W_UV^T per head, attn_part = o @ w_o^T. The
    same contracts as GpuTarget's stages (models/target.py): w_uk_t [nh, 512, dn], w_uv [nh, dv, 512];
    rows [>= T, width] uint16 device arrays (q [T, nh (dn + 64)], q_full [T, nh 576], o_lat [T, nh 512],
    o [T, nh dv]). A schedule built with input_norm=False reads ``normed`` as given (h, input_norm_w, eps,
    mlp_prev, h1 unused)."""
    sh = s.shape
    T, H, nh, dn, dv, ql = sh.T, int(sh.H), int(sh.nh), int(sh.dn), int(sh.dv), int(sh.ql)
    want = {"w_qkv_a": (w_qkv_a, (ql + ROW, H)), "w_q_b": (w_q_b, (nh * (dn + ROPE), ql)),
            "w_uk_t": (w_uk_t, (nh, LATENT, dn)), "w_uv": (w_uv, (nh, dv, LATENT)), "w_o": (w_o, (H, nh * dv))}
    for name, (a, shape) in want.items():
        if tuple(a.shape) != shape:
            raise ValueError(f"bind_attention_half: {name} {tuple(a.shape)}, the schedule needs {shape}")
    q3 = q[:T].reshape(T, nh, dn + ROPE)
    qf3 = q_full[:T].reshape(T, nh, ROW)
    rows = dict(positions=positions, inv_freq=inv_freq, amplitude=float(amplitude))
    ops = {}
    if "input_norm" in s.ops:
        if h is None or input_norm_w is None or not eps > 0:
            raise ValueError("bind_attention_half: the input norm needs h, input_norm_w and eps > 0")
        if sh.kind == "dense":
            ops["input_norm"] = PersistOpArgs(x=h, out=normed, w=input_norm_w, N=H, eps=float(eps))
        else:
            if mlp_prev is None or h1 is None:
                raise ValueError("bind_attention_half: an MoE layer's input norm adds mlp_prev to h into h1")
            ops["input_norm"] = PersistOpArgs(x=mlp_prev, x2=h, out2=h1, out=normed, w=input_norm_w, N=H,
                                              eps=float(eps))
    ops |= {"qkv_a": PersistOpArgs(x=normed, w=w_qkv_a, out=qkv, N=ql + ROW, K=H),
           "qkv_a_post": PersistOpArgs(x=qkv, w=q_a_norm, w2=kv_a_norm, out=c_q, K=ql, eps=float(latent_eps),
                                       stream_ids=stream_ids, kv_pos=kv_pos, pool=pool, block_table=block_table,
                                       **rows),
           "q_b": PersistOpArgs(x=c_q, w=w_q_b, out=q, N=nh * (dn + ROPE), K=ql),
           "w_uk_rope": PersistOpArgs(x=q3[:, :, :dn], w=w_uk_t, out=qf3[:, :, :LATENT], pe=q3[:, :, dn:],
                                      pe_out=qf3[:, :, LATENT:], **rows),
           "w_uv": PersistOpArgs(x=o_lat[:T].reshape(T, nh, LATENT), w=w_uv, out=o[:T].reshape(T, nh, dv)),
           "o_proj": PersistOpArgs(x=o, w=w_o, out=attn_part, N=H, K=nh * dv)}
    if s.allreduce == "item":
        if final is None:
            raise ValueError("bind_attention_half: allreduce='item' needs the final output buffer")
        ops["allreduce_attn"] = PersistOpArgs(x=attn_part, out=final, N=H)
    return ops


def bind_chain(s: sched_mod.Schedule, xs: Sequence, weights: Sequence, eps: float = 1e-6) -> Dict[str, PersistOpArgs]:
    """The op table of a dependency chain (``schedule.build_chain``): stage j reads xs[j] and writes xs[j + 1]
    (so len(xs) = stages + 1, each [>= T, width]) with weights[j]: the norm weight [width] of an RMSNorm stage,
    or [width, width] of a GEMM stage."""
    ops = list(s.ops)
    if len(xs) != len(ops) + 1 or len(weights) != len(ops):
        raise ValueError(f"bind_chain: {len(ops)} stages need {len(ops) + 1} row buffers and {len(ops)} weights, "
                         f"got {len(xs)} and {len(weights)}")
    W = int(s.shape.H)
    out = {}
    for j, name in enumerate(ops):
        if name.startswith("norm"):
            out[name] = PersistOpArgs(x=xs[j], w=weights[j], out=xs[j + 1], N=W, eps=float(eps))
        else:
            if tuple(weights[j].shape) != (W, W):
                raise ValueError(f"bind_chain: {name} weight {weights[j].shape}, expected ({W}, {W})")
            out[name] = PersistOpArgs(x=xs[j], w=weights[j], out=xs[j + 1], N=W, K=W)
    return out


# ---- the engine's selection -------------------------------------------------------------------------------
# GpuTarget runs a dense layer's MLP half (post-attention norm .. down projection) as one persistent launch
# when this is on and the step has <= MAX_T rows; off (the default) keeps today's kernels. Today's path stays
# the default until a GPU run (bench/persistent.py, bench/step.py) measures the persistent one faster. (The
# attention half's two launches are not selectable: measured slower than today's PDL chain, docs/PERSISTENT.md.)
from .. import knobs as _knobs

_MLP = [_knobs.get().persistent_mlp]


def mlp_enabled() -> bool:
    return _MLP[0]


def set_mlp(on: bool) -> bool:
    """Select the persistent dense MLP half (True) or today's kernels (False); returns the old setting.
    Takes effect for stage lists built afterwards (a captured graph keeps what it captured)."""
    if not isinstance(on, bool):
        raise ValueError(f"set_mlp: expected a bool, got {on!r}")
    old, _MLP[0] = _MLP[0], on
    return old


def default_grid() -> int:
    """The persistent grid of the current device: up to BLOCKS_PER_SM blocks per SM, as many as the driver's
    occupancy calculator says are resident (the GEMM rings take 96 KB each: 2 on the H200, 1 on sm_120),
    refused when the compiled kernel cannot be resident at all."""
    import cupy
    k = get_kernel(SPEC, "persistent_layer", SMEM_BYTES)
    fn = getattr(k, "kernel", k)
    sm = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
    occ = int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, THREADS, SMEM_BYTES))
    return sched_mod.fit_grid(sm * BLOCKS_PER_SM, sm, occ)


def dense_mlp_segment(T: int, *, attn, h, post_norm_w, eps: float, w_gate_up, w_down, normed, act,
                      out, n_blocks: Optional[int] = None) -> PersistentSegment:
    """A PersistentSegment running one dense MLP half at T rows on these buffers (views of >= T rows):
    h += attn; normed = norm(h); out = down(silu(gate) * up) (this rank's partial sum; the caller
    all-reduces it, as today)."""
    H, F = int(w_down.shape[0]), int(w_down.shape[1])
    shape = sched_mod.LayerShape("dense", 1, int(T), H=H, nh=1, ql=1, F=F)
    grid = n_blocks or default_grid()
    s = sched_mod.build_layer(shape, grid, allreduce="segment", parts=("mlp",), bytes_per_us_per_block=4.0e6 / grid)
    ops = bind_dense_mlp(s, attn=attn, h=h, post_norm_w=post_norm_w, eps=eps, w_gate_up=w_gate_up, w_down=w_down,
                         normed=normed, act=act, out=out)
    return PersistentSegment(s, 0, ops)


# ---- a numpy twin of the executor's contract --------------------------------------------------------------

def _rope_pairs(x, positions, inv_freq, amplitude: float):
    """RoPE of adjacent pairs (2i, 2i + 1) of x [..., 2 half] at positions [...] (float64)."""
    half = x.shape[-1] // 2
    ang = np.asarray(positions, np.float64)[..., None] * np.asarray(inv_freq[:half], np.float64)
    c, sn = np.cos(ang) * amplitude, np.sin(ang) * amplitude
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty(x.shape, np.float64)
    out[..., 0::2], out[..., 1::2] = a * c - b * sn, b * c + a * sn
    return out


def _emulate_row_post(op: "PersistOpArgs", t: int) -> None:
    """mla_qkv_a_post's row t in float64: c_q, and the latent row into the paged cache at kv_pos[t]."""
    ql = int(op.K)
    x = np.asarray(op.x[t], np.float64)
    q, kv, pe = x[:ql], x[ql:ql + LATENT], x[ql + LATENT:ql + ROW]
    op.out[t, :ql] = op.w * q / np.sqrt(np.mean(q * q) + op.eps)
    p = int(op.kv_pos[t])
    if p >= 0:
        page = int(op.block_table[int(op.stream_ids[t]), p // PAGE])
        op.pool[page, p % PAGE, :LATENT] = op.w2 * kv / np.sqrt(np.mean(kv * kv) + op.eps)
        op.pool[page, p % PAGE, LATENT:] = _rope_pairs(pe, op.positions[t], op.inv_freq, op.amplitude)


def emulate_segment(s: sched_mod.Schedule, seg: int, ops: Mapping[str, PersistOpArgs], seed: int = 0) -> int:
    """Run segment ``seg`` from its *encoded* form (the arrays the kernel reads) on numpy arrays: blocks
    interleave at random, an item runs only when its encoded waits are met by the counters, the bodies are
    numpy versions of the kernel's (float64 math; bf16 rounding is the caller's reference's business), and
    the counters must end at their targets. A GEMM part writes its slot; the part that brings its group's
    counter to the group's size sums the slots in slot order (SwiGLU for a gate|up pair) and counts once
    more, as the kernel's fixup. Checks the encoding and the op binding without a GPU; returns the number
    of items run. ``ops`` hold numpy float arrays in place of device buffers."""
    import random
    enc = s.encode(seg)
    items, waits, bs = enc["items"], enc["waits"], enc["block_start"]
    counters = np.zeros(int(enc["n_counters"]), np.int64)
    pc = [int(bs[b]) for b in range(s.n_blocks)]
    end = [int(bs[b + 1]) for b in range(s.n_blocks)]
    rng = random.Random(seed)
    names = s.ops
    T = s.shape.T
    ws = {n: np.full((s.buffers[f"{n}:ws"][0] // T, T, sched_mod.UNIT_ROWS), np.nan)
          for n in names if f"{n}:ws" in s.buffers}
    ran = 0
    while True:
        live = [b for b in range(s.n_blocks) if pc[b] < end[b]]
        if not live:
            break
        ready = [b for b in live if all(counters[c] >= t for c, t in
                                        waits[items[pc[b], 9]:items[pc[b], 9] + items[pc[b], 10]])]
        if not ready:
            raise sched_mod.Deadlock(f"emulate_segment: no block can progress ({len(live)} live)")
        b = rng.choice(ready)
        kind, opi, a0, a1, a2, a3, a4, a5, a6, _wb, _nw, sig = (int(v) for v in items[pc[b]][:12])
        op = ops[names[opi]]
        counted = False
        if kind == sched_mod.KIND["norm_row"]:
            x = op.x[a0].astype(np.float64)
            if op.x2 is not None:
                x = x + op.x2[a0]
                (op.out2 if op.out2 is not None else op.x2)[a0] = x
            op.out[a0] = op.w * x / np.sqrt(np.mean(x * x) + op.eps)
        elif kind == sched_mod.KIND["gemm_part"]:
            k0, k1 = 64 * a1, min(op.K, 64 * (a1 + a2))
            U = sched_mod.UNIT_ROWS
            ws[names[opi]][a3] = op.x[:T, k0:k1] @ op.w[a0:a0 + U, k0:k1].T
            counters[sig] += 1
            counted = True
            if counters[sig] == a6:                     # the last part of its group: the fixup
                parts = ws[names[opi]][a4:a4 + a6]
                if op.swiglu:
                    g, u = parts[:a5].sum(0), parts[a5:].sum(0)
                    c0 = a0 % (op.N // 2)
                    op.out[:T, c0:c0 + U] = g / (1 + np.exp(-g)) * u
                else:
                    op.out[:T, a0:a0 + U] = parts.sum(0)
                counters[sig] += 1
        elif kind == sched_mod.KIND["boundary"]:
            op.out[:T, :op.N] = op.x[:T, :op.N]
        elif kind == sched_mod.KIND["row_post"]:
            _emulate_row_post(op, a0)
        elif kind == sched_mod.KIND["head_gemm"]:
            cols = slice(a2 * a1, a2 * (a1 + 1))
            op.out[:T, a0, cols] = op.x[:T, a0, :] @ op.w[a0, cols, :].T
            if op.pe is not None and a1 == 0:
                op.pe_out[:T, a0] = _rope_pairs(op.pe[:T, a0], op.positions[:T], op.inv_freq, op.amplitude)
        else:
            raise ValueError(f"emulate_segment: kind {sched_mod.KIND_NAME.get(kind, kind)} is not run by this build")
        if not counted:
            counters[sig] += 1
        pc[b] += 1
        ran += 1
    seg_groups = {it.signal for it in s.items if it.segment == seg}
    for c in seg_groups:
        if counters[c] != s.counter_targets[c]:
            raise AssertionError(f"counter {s.counters[c]} ended at {counters[c]}, target {s.counter_targets[c]}")
    return ran
