"""``ProfileSession``: load one rank once, then time any piece of its decode step against that piece's floor.

    from ddtree_cupy.profiling import ProfileSession
    ps = ProfileSession.random("tests/data/kimi-k2.6-text.json", "tests/data/kimi-k2.5-dflash-drafter.json",
                               tp=8, rank=0, layers=4, streams=1, rows=8, ctx=4096)
    print(ps.step())                 # the captured step graph, replayed
    print(ps.phase("verify"))        # one phase as its own graph
    print(ps.layer(1))               # one layer; ps.stage(1, "moe"): one stage; ps.kernel("mla_attn"): one kernel
    print(ps.layer_table())          # every layer of the step, alone and in the step, against its floor

Set-up (once): the engine (``GpuEngine``: a checkpoint's shard or rank-shaped random weights, the collectives
of a rank without peers, ``RankComm``), ``streams`` streams of ``ctx`` committed tokens each admitted into a
``KVPool`` like real requests (so the block table holds real, distinct pages), the latent cache and drafter
context filled with random rows, the step's control block (every stream active, budget rows - 1) uploaded,
and the hardware ceilings measured in this process (``ceilings.measure_ceilings``).

Every measurement returns a ``Timing``: GPU seconds (CUDA events around graph replays) next to the piece's
``Floor`` (floors.py) over those ceilings. Replays never change the state a later replay reads: the host's
control block stays the same, so every step writes the same cache rows and drafter context again.
Each measurement is an NVTX range named ``profile:<piece>``; ``timeline()`` runs one step eagerly with an
NVTX range and a CUDA event per layer stage (the Nsight Systems view, and a Chrome trace via trace.py).
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

import numpy as np

from ..engine.kv_pool import KVPool
from ..engine.profile import count_launches, nvtx_pop, nvtx_push
from .ceilings import Ceilings, measure_ceilings, time_graph
from .floors import Floor, StepFloors
from .rank_comm import RankComm

PAGE = 64


@dataclass
class Timing:
    """One measured piece: GPU seconds per run, its floor and the ceilings the floor is divided by."""
    name: str
    seconds: float
    floor: Optional[Floor]
    ceilings: Ceilings
    note: str = ""

    @property
    def us(self) -> float:
        return self.seconds * 1e6

    @property
    def floor_us(self) -> Optional[float]:
        return None if self.floor is None else self.floor.seconds(self.ceilings) * 1e6

    @property
    def x_floor(self) -> Optional[float]:
        f = self.floor_us
        return None if not f else self.us / f

    def as_dict(self) -> dict:
        return dict(name=self.name, us=self.us, floor_us=self.floor_us, x_floor=self.x_floor,
                    floor_bytes=None if self.floor is None else self.floor.bytes,
                    floor_flops=None if self.floor is None else self.floor.flops,
                    bound=None if self.floor is None else self.floor.bound(self.ceilings), note=self.note)

    def __str__(self) -> str:
        if self.floor is None or not self.floor_us:
            why = self.note if self.floor is None else "it reads no weights or cache"
            return f"{self.name}: {self.us:.1f} us (no floor: {why})"
        return (f"{self.name}: {self.us:.1f} us, floor {self.floor_us:.1f} us ({self.floor.bound(self.ceilings)}: "
                f"{self.floor.bytes / 1e6:.2f} MB, {self.floor.flops / 1e9:.2f} GFLOP) -> x{self.x_floor:.2f} floor"
                + (f"; {self.note}" if self.note else ""))


@dataclass
class Table:
    """Rows of dicts with a title; ``str()`` is a markdown table, ``as_dict()`` goes to JSON."""
    title: str
    columns: List[str]
    rows: List[dict]
    notes: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        def cell(v):
            if v is None:
                return "-"
            return f"{v:.2f}" if isinstance(v, float) else str(v)
        lines = [self.title, "| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(cell(r.get(c)) for c in self.columns) + " |" for r in self.rows]
        return "\n".join(lines + self.notes)

    def as_dict(self) -> dict:
        return dict(title=self.title, columns=self.columns, rows=self.rows, notes=self.notes)


def load_configs(target, drafter=None, layers: Optional[int] = None, ctx: Optional[int] = None):
    """(TargetConfig, DrafterConfig or None) from config objects, JSON files or checkpoint directories.
    ``layers``: keep the first ``layers`` target layers (the drafter's feature layers beyond them are
    dropped; the last kept layer when none is left). ``ctx``: the drafter's window (its ring holds ctx)."""
    from ..config import DrafterConfig, TargetConfig

    def read(x, cls):
        if x is None or isinstance(x, cls):
            return x
        path = os.path.join(x, "config.json") if os.path.isdir(x) else x
        if not os.path.isfile(path):
            raise ValueError(f"profiling: no config at {x!r} (give a config JSON file or a checkpoint directory)")
        return cls.load(x)
    tcfg, dcfg = read(target, TargetConfig), read(drafter, DrafterConfig)
    if dcfg is not None:
        dcfg.check_matches(tcfg)
    if layers is not None:
        if not isinstance(layers, int) or not 1 <= layers <= tcfg.num_hidden_layers:
            raise ValueError(f"profiling: layers must be an integer in [1, {tcfg.num_hidden_layers}], got {layers!r}")
        if layers != tcfg.num_hidden_layers:
            tcfg = replace(tcfg, num_hidden_layers=layers)
            if dcfg is not None:
                keep = tuple(i for i in dcfg.target_layer_ids if i < layers) or (layers - 1,)
                dcfg = replace(dcfg, target_layer_ids=keep)
    if dcfg is not None and ctx is not None:
        dcfg = dcfg.with_options(draft_window=ctx)
    return tcfg, dcfg


def fill_random(arrays, std: float = 0.5, seed: int = 0) -> None:
    """Finite random bf16 values in every array (one generated block per shape, copied to its twins)."""
    import cupy
    from ..models.drafter import f32_to_bf16_bits_gpu
    rs = cupy.random.RandomState(seed)
    by_shape = {}
    for a in arrays:
        blk = by_shape.get(a.shape)
        if blk is None:
            blk = by_shape[a.shape] = f32_to_bf16_bits_gpu(rs.standard_normal(a.shape, dtype=cupy.float32) * std)
        a[...] = blk


def step_rows(mode: str, rows: int, depth: int) -> int:
    """The budget the step is built with for ``rows`` verify rows per stream (ar: 1 row, chain: depth + 1)."""
    if mode == "ddtree":
        return rows - 1
    want = 1 if mode == "ar" else depth + 1
    if rows != want:
        raise ValueError(f"ProfileSession: mode {mode!r} verifies {want} rows per stream, got rows={rows}")
    return 1


def _require_gpu(who: str) -> None:
    """A session measures a GPU: without one, say so (CuPy's own error on a machine without a GPU speaks of an
    insufficient driver)."""
    from ..backend import BackendError, gpu_status
    usable, why = gpu_status()
    if not usable:
        raise BackendError(f"{who} needs a CUDA GPU: {why}")


class ProfileSession:
    """A decode step of one engine, set up for timing. Build it with ``random`` (rank-shaped random weights),
    ``from_checkpoint`` or around an existing ``GpuEngine`` (``ProfileSession(engine, ...)``: the CLI's
    ``--profile`` does this after its run)."""

    def __init__(self, engine, streams: int = 1, rows: int = 8, ctx: int = 4096, mode: str = "ddtree",
                 ceilings: Optional[Ceilings] = None, fill: bool = True, seed: int = 0, routing=None):
        import cupy
        from ..kernels import engine_glue as g
        for nm, v, lo in (("streams", streams, 1), ("rows", rows, 1), ("ctx", ctx, 1)):
            if not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"ProfileSession: {nm} must be an integer >= {lo}, got {v!r}")
        if mode not in ("ddtree", "chain", "ar"):
            raise ValueError(f"ProfileSession: unknown mode {mode!r} (ddtree, chain or ar)")
        eng = engine
        self.eng, self.S, self.R, self.ctx, self.mode = eng, int(streams), int(rows), int(ctx), mode
        self.routing = routing
        depth = eng.models.depth
        self.budget = step_rows(mode, self.R, depth)
        if mode != "ar" and eng.drafter is None:
            raise ValueError(f"ProfileSession: mode {mode!r} needs a drafter (give one, or mode='ar', rows=1)")
        if self.S > eng.max_streams:
            raise ValueError(f"ProfileSession: streams={self.S} > the engine's max_streams={eng.max_streams}")
        if mode == "ddtree" and self.budget > eng.max_budget:
            raise ValueError(f"ProfileSession: rows={self.R} needs budget {self.budget} > the engine's max_budget "
                             f"{eng.max_budget}")
        cap = eng.max_pages_per_stream * PAGE
        if self.ctx + 1 + self.R > cap:
            raise ValueError(f"ProfileSession: ctx={self.ctx} + {self.R} rows exceeds one stream's cache capacity "
                             f"({cap} tokens)")
        if self.S * -(-(self.ctx + 1 + self.R) // PAGE) > eng.num_pages:
            raise ValueError(f"ProfileSession: {self.S} streams of {self.ctx} tokens need more than the pool's "
                             f"{eng.num_pages} pages")
        self.stream = eng.stream
        if fill:
            fill_random(eng.kv.pools, seed=seed + 1)
            if eng.drafter is not None:
                fill_random(list(eng.drafter.k_cache) + list(eng.drafter.v_cache), seed=seed + 2)
        # the streams are admitted as requests of ctx prompt tokens: real, distinct pages per stream
        self.pool = KVPool(eng.num_pages, PAGE, eng.max_streams, eng.max_pages_per_stream, self.R)
        self.slots = [self.pool.admit(("profile", s), self.ctx, 1) for s in range(self.S)]
        if self.slots != list(range(self.S)):
            raise RuntimeError(f"ProfileSession: the pool gave slots {self.slots}, the step's batch needs 0..S-1")
        self.stream.synchronize()
        with self.stream:
            eng.kv.set_block_table(self.pool.block_table)
        rng = np.random.default_rng(seed)
        ctrl = np.zeros((g.CTRL_FIELDS, self.S), np.int32)
        ctrl[g.CTRL_PREFIX] = self.ctx
        ctrl[g.CTRL_BONUS] = rng.integers(0, eng.tcfg.vocab_size, self.S)
        ctrl[g.CTRL_ACTIVE] = 1
        ctrl[g.CTRL_BUDGET] = 0 if mode == "ar" else (depth if mode == "chain" else self.budget)
        ctrl[g.CTRL_STEP] = 1
        self.ctrl = ctrl
        self.decode = eng.get_step(self.S, mode, self.budget, None, False, False)   # built (and captured)
        self.decode.upload(ctrl)
        self.stream.synchronize()
        self.ceilings = ceilings if ceilings is not None else measure_ceilings(self._ceiling_bytes())
        dw = getattr(eng.drafter, "w", None) if eng.drafter is not None else None
        self.floors = StepFloors(eng.tcfg, eng.comm.size, self.S, self.R, self.ctx, eng.dcfg if mode != "ar" else None,
                                 drafter_weight_bytes=int(getattr(dw, "nbytes", 0) or 0))
        self._unique: Optional[List[int]] = None

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def random(cls, target, drafter=None, tp: int = 8, rank: int = 0, layers: Optional[int] = None,
               streams: int = 1, rows: int = 8, ctx: int = 4096, mode: str = "ddtree", seed: int = 1,
               routing: str = "uniform", pdl="auto", ceilings: Optional[Ceilings] = None, **engine_kw):
        """Rank ``rank`` of TP ``tp`` with random rank-shaped weights (no checkpoint). ``target`` / ``drafter``:
        configs, config JSON files or checkpoint directories; ``layers``: the first N target layers.
        ``routing``: 'uniform' (every MoE layer reads k distinct uniformly random experts per row, as real
        routing spreads; bench/step.py's default) or 'model' (the random router's own, collapsed choice)."""
        from ..engine.gpu_engine import GpuEngine
        if routing not in ("uniform", "model"):
            raise ValueError(f"ProfileSession.random: routing must be 'uniform' or 'model', got {routing!r}")
        tcfg, dcfg = load_configs(target, drafter, layers, ctx)
        _require_gpu("ProfileSession.random")
        if ceilings is None:        # before the weights take the memory the streaming buffer needs
            ceilings = measure_ceilings()
        router = None
        if routing == "uniform" and tcfg.n_routed_experts:
            from .routing import UniformRouting
            router = UniformRouting(tcfg.n_routed_experts, tcfg.num_experts_per_tok)
            router.__enter__()      # for the session's life: every captured graph reads its tables
        eng = GpuEngine(tcfg, None, dcfg, None, **cls._engine_options(tcfg, dcfg, tp, rank, streams, rows, ctx, mode,
                                                                      pdl, engine_kw), random_weights=int(seed))
        return cls(eng, streams, rows, ctx, mode, ceilings=ceilings, fill=True, seed=seed, routing=router)

    @classmethod
    def from_checkpoint(cls, model_dir: str, drafter_dir: Optional[str] = None, tp: int = 1, rank: int = 0,
                        streams: int = 1, rows: int = 8, ctx: int = 4096, mode: str = "ddtree", pdl="auto",
                        ceilings: Optional[Ceilings] = None, progress: bool = False, **engine_kw):
        """Rank ``rank`` of TP ``tp`` of a checkpoint (that rank's shard only; collectives without peers)."""
        from ..engine.gpu_engine import GpuEngine
        tcfg, dcfg = load_configs(model_dir, drafter_dir, None, None)
        _require_gpu("ProfileSession.from_checkpoint")
        if ceilings is None:
            ceilings = measure_ceilings()
        eng = GpuEngine(tcfg, model_dir, dcfg, drafter_dir, progress=progress,
                        **cls._engine_options(tcfg, dcfg, tp, rank, streams, rows, ctx, mode, pdl, engine_kw))
        return cls(eng, streams, rows, ctx, mode, ceilings=ceilings, fill=True)

    @staticmethod
    def _engine_options(tcfg, dcfg, tp, rank, streams, rows, ctx, mode, pdl, extra) -> dict:
        per_stream = -(-(ctx + rows + PAGE) // PAGE) * PAGE
        depth = dcfg.block_size - 1 if dcfg is not None else 0
        opts = dict(comm=RankComm(rank, tp), max_streams=streams,
                    max_budget=max(1, rows - 1 if mode == "ddtree" else depth),
                    kv_tokens=streams * per_stream, prefill_chunk=PAGE, max_context=per_stream, pdl=pdl,
                    buckets=(streams,))
        opts.update(extra)
        return opts

    def _ceiling_bytes(self) -> int:
        from ..engine.gpu_engine import free_device_bytes
        return int(max(256 << 20, min(2 << 30, free_device_bytes() // 4)))

    # ---- what the step is made of ------------------------------------------------------------------
    @property
    def block_table(self) -> np.ndarray:
        """The block table the step's cache view reads (host copy of the pool's: row s = stream s's pages)."""
        return self.pool.block_table.copy()

    @property
    def target(self):
        return self.eng.target

    def phase_names(self) -> List[str]:
        return [n for n, _ in self.decode.phases()]

    def stage_names(self, layer: int) -> List[str]:
        self._check_layer(layer)
        return [n for n, _ in self.target.layer_stages(layer, self.decode.batch, self.eng.kv)]

    def moe_layer(self) -> int:
        """The first MoE layer (the default layer of ``kernel`` and ``loo``); 0 when every layer is dense."""
        cfg = self.eng.tcfg
        return next((i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)), 0)

    def _check_layer(self, layer: int) -> None:
        L = self.eng.tcfg.num_hidden_layers
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < L:
            raise ValueError(f"ProfileSession: layer must be in 0..{L - 1}, got {layer!r}")

    def _stages(self, layer: int):
        return self.target.layer_stages(layer, self.decode.batch, self.eng.kv)

    def unique_experts(self) -> List[int]:
        """Distinct routed experts per MoE layer that one step's real rows make the MoE read (one eager step,
        router outputs or the uniform tables recorded; cached)."""
        if self._unique is None:
            from .routing import count_experts
            self._unique, _ = count_experts(self.decode, self.S, self.R, self.eng.tcfg, self.routing)
            self.decode.upload(self.ctrl)
        return list(self._unique)

    def _moe_unique(self, layer: int) -> Optional[float]:
        cfg = self.eng.tcfg
        if not cfg.is_moe_layer(layer):
            return None
        moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        u = self.unique_experts()
        return float(u[moe_layers.index(layer)]) if len(u) == len(moe_layers) else None

    # ---- timing ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _range(self, name: str):
        nvtx_push("profile:" + name)
        try:
            yield
        finally:
            nvtx_pop()

    def _graph_us(self, fn, iters: int, reps: int) -> float:
        with self.stream:
            return time_graph(fn, iters=iters, reps=reps)

    def step(self, reps: int = 10) -> Timing:
        """The engine's captured step graph (PDL as the engine captures it), ``reps`` replays back to back
        after a warm one: mean seconds per replay, as bench/step.py's step figure."""
        import cupy
        d, st = self.decode, self.stream
        if d.graph is None:                 # an eager engine: capture the same sequence once
            d.capture()
            d.upload(self.ctrl)
        with self._range("step"):
            ev0, ev1 = cupy.cuda.Event(), cupy.cuda.Event()
            d.graph.launch(st)
            ev0.record(st)
            for _ in range(reps):
                d.graph.launch(st)
            ev1.record(st)
            ev1.synchronize()
        s = cupy.cuda.get_elapsed_time(ev0, ev1) / 1e3 / reps
        return Timing("step", s, self.floors.step(self._unique_or_none()), self.ceilings,
                      note=f"{self.S} x {self.R} rows at {self.ctx} tokens, graph" + (" with PDL" if d.pdl else ""))

    def _unique_or_none(self):
        u = self.unique_experts()
        cfg = self.eng.tcfg
        return u if len(u) == sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)) else None

    def phase(self, name: str, iters: int = 2, reps: int = 3) -> Timing:
        """One phase (draft / tree / verify / accept) captured as its own graph, median us per run."""
        phases = dict(self.decode.phases())
        if name not in phases:
            raise ValueError(f"ProfileSession.phase: unknown phase {name!r} (this step has {', '.join(phases)})")
        with self._range("phase:" + name):
            us = self._graph_us(phases[name], iters, reps)
        floors = self.floors.phases(self._unique_or_none())
        return Timing(name, us * 1e-6, floors.get(name), self.ceilings)

    def phases(self, iters: int = 2, reps: int = 3) -> Dict[str, Timing]:
        return {n: self.phase(n, iters, reps) for n in self.phase_names()}

    def layer(self, layer: int, iters: int = 10, reps: int = 3) -> Timing:
        """Layer ``layer`` (all its stages) as one graph of ``iters`` back-to-back runs. Replayed alone its
        small weights and the layer's cache stay in L2: the in-step figure is ``layer_table``'s 'in step'."""
        self._check_layer(layer)
        stages = self._stages(layer)
        with self._range(f"layer:{layer}"):
            us = self._graph_us(lambda: [fn() for _, fn in stages], iters, reps)
        names = [n for n, _ in stages]
        return Timing(f"layer {layer}", us * 1e-6, self.floors.layer(layer, self._moe_unique(layer), names),
                      self.ceilings)

    def stage(self, layer: int, name: str, iters: int = 10, reps: int = 3) -> Timing:
        """One stage of one layer (``stage_names(layer)``) as its own graph."""
        self._check_layer(layer)
        stages = dict(self._stages(layer))
        if name not in stages:
            raise ValueError(f"ProfileSession.stage: layer {layer} has no stage {name!r} "
                             f"(it has {', '.join(stages)})")
        with self._range(f"stage:{layer}.{name}"):
            us = self._graph_us(stages[name], iters, reps)
        return Timing(f"layer {layer} {name}", us * 1e-6,
                      self.floors.stage(layer, name, self._moe_unique(layer) if name == "moe" else None),
                      self.ceilings)

    def kernels(self, layer: Optional[int] = None) -> Dict[str, Dict[str, int]]:
        """Kernel launches per piece: {stage or phase: {kernel name: launches}} for ``layer``'s stages
        (default the first MoE layer) and the step's non-verify phases."""
        layer = self.moe_layer() if layer is None else layer
        self._check_layer(layer)
        out = {}
        with self.stream:
            for n, fn in self._stages(layer):
                with count_launches() as c:
                    fn()
                out[f"layer {layer} {n}"] = dict(c.counts)
            for n, fn in self.decode.phases():
                if n != "verify":
                    with count_launches() as c:
                        fn()
                    out[n] = dict(c.counts)
        self.stream.synchronize()
        self.decode.upload(self.ctrl)
        return out

    def kernel(self, name: str, layer: Optional[int] = None, iters: int = 10, reps: int = 3) -> Timing:
        """One kernel by name (its name up to the template arguments, or a unique prefix of it): the first
        stage of ``layer`` (default: the first MoE layer) or non-verify phase that launches it is captured with
        every other kernel launch left out, so the graph holds this kernel's launches only (copies and
        collectives of that piece stay). The floor is the stage's when the stage launches nothing else."""
        found = self.kernels(layer)
        hits = sorted({k for c in found.values() for k in c if k == name or k.startswith(name)})
        if not hits:
            known = sorted({k for c in found.values() for k in c})
            raise ValueError(f"ProfileSession.kernel: no kernel {name!r} in layer "
                             f"{self.moe_layer() if layer is None else layer} or the phases (known: {', '.join(known)})")
        if len(hits) > 1 and name not in hits:
            raise ValueError(f"ProfileSession.kernel: {name!r} names several kernels: {', '.join(hits)}")
        kname = name if name in hits else hits[0]
        piece = next(p for p, c in found.items() if kname in c)
        layer = self.moe_layer() if layer is None else layer
        if piece.startswith("layer "):
            sname = piece.split(" ", 2)[2]
            fn = dict(self._stages(layer))[sname]
            floor = (self.floors.stage(layer, sname, self._moe_unique(layer) if sname == "moe" else None)
                     if set(found[piece]) == {kname} else None)
        else:
            fn, floor = dict(self.decode.phases())[piece], None
        with self._range(f"kernel:{kname}"), only_kernel(kname):
            us = self._graph_us(fn, iters, reps)
        self.decode.upload(self.ctrl)
        note = (f"in {piece}, {found[piece][kname]} launch(es)" + ("" if floor is not None else
                "; the piece launches other kernels too, so no floor of its own"))
        return Timing(kname, us * 1e-6, floor, self.ceilings, note=note)

    def loo(self, layer: Optional[int] = None, reps: int = 3) -> dict:
        """bench/step.py ``--loo``: each stage's marginal us per layer on the real critical path (the verify
        phase with that stage dropped from every layer; its stage names are ``layer``'s)."""
        from .marginal import leave_one_out
        with self._range("loo"):
            out = leave_one_out(self.eng, self.decode, self.stream, self.moe_layer() if layer is None else layer,
                                use_pdl=self.decode.pdl, reps=reps)
        self.decode.upload(self.ctrl)
        return out

    def timeline(self) -> List[dict]:
        """One eager step with a CUDA event before every phase and every layer stage of the verify (and an
        NVTX range around each): [{name, cat, layer, start_us, dur_us}] in launch order, times from the
        step's first event. Eager, so host launch gaps show where the GPU waited for the host."""
        import cupy
        st, tgt = self.stream, self.target
        cls = type(tgt)
        orig = cls.layer_stages
        marks: List[tuple] = []
        open_range = [False]

        def mark(name, cat, layer):
            if open_range[0]:
                nvtx_pop()
                open_range[0] = False
            ev = cupy.cuda.Event()
            ev.record(st)
            marks.append((name, cat, layer, ev))
            if name is not None:
                nvtx_push(name)
                open_range[0] = True

        def stages(self_, i, batch, kv):
            def wrap(n, fn):
                def run():
                    mark(f"L{i}.{n}", "stage", i)
                    fn()
                return run
            return [(n, wrap(n, fn)) for n, fn in orig(self_, i, batch, kv)]

        cls.layer_stages = stages
        try:
            with st:
                for pname, fn in self.decode.phases():
                    mark(pname, "phase", None)
                    fn()
                    if pname == "verify":
                        mark("verify.tail", "phase", None)      # final norm, vocabulary projection, argmax
                mark(None, None, None)
            st.synchronize()
        finally:
            cls.layer_stages = orig
            if open_range[0]:
                nvtx_pop()
        self.decode.upload(self.ctrl)
        t0 = marks[0][3]
        out = []
        for (name, cat, layer, a), (_, _, _, b) in zip(marks[:-1], marks[1:]):
            start = cupy.cuda.get_elapsed_time(t0, a) * 1e3 if a is not t0 else 0.0
            out.append(dict(name=name, cat=cat, layer=layer, start_us=start,
                            dur_us=cupy.cuda.get_elapsed_time(a, b) * 1e3))
        return out

    def layer_table(self, iters: int = 3, reps: int = 3, timeline: Optional[List[dict]] = None) -> Table:
        """Per layer of the step: the layer alone as a graph ('graph us'), the layer inside one eager step
        ('in step us', from ``timeline``), its floor and both against it."""
        tl = self.timeline() if timeline is None else timeline
        in_step: Dict[int, float] = {}
        for e in tl:
            if e["cat"] == "stage":
                in_step[e["layer"]] = in_step.get(e["layer"], 0.0) + e["dur_us"]
        rows = []
        cfg = self.eng.tcfg
        for i in range(cfg.num_hidden_layers):
            t = self.layer(i, iters, reps)
            rows.append(dict(layer=i, kind="MoE" if cfg.is_moe_layer(i) else "dense", graph_us=t.us,
                             in_step_us=in_step.get(i), floor_us=t.floor_us, x_floor=t.x_floor,
                             in_step_x_floor=(in_step[i] / t.floor_us) if (i in in_step and t.floor_us) else None,
                             bound=t.floor.bound(self.ceilings)))
        verify = self.phase("verify")
        total = sum(r["graph_us"] for r in rows)
        notes = [f"sum of layers alone {total:.1f} us; verify phase as one graph {verify.us:.1f} us "
                 f"(floor {verify.floor_us:.1f} us). A layer replayed alone keeps its small weights in L2; "
                 "'in step' is one eager step (host launch gaps included).", str(self.ceilings)]
        return Table(f"layers of one step ({self.S} streams x {self.R} rows, ctx {self.ctx}, TP {self.eng.comm.size} "
                     f"rank {self.eng.comm.rank})",
                     ["layer", "kind", "graph_us", "in_step_us", "floor_us", "x_floor", "in_step_x_floor", "bound"],
                     rows, notes)

    def stage_table(self, layer: Optional[int] = None, iters: int = 10, reps: int = 3) -> Table:
        layer = self.moe_layer() if layer is None else layer
        rows = []
        for n in self.stage_names(layer):
            t = self.stage(layer, n, iters, reps)
            rows.append(dict(stage=n, us=t.us, floor_us=t.floor_us, x_floor=t.x_floor,
                             bound=t.floor.bound(self.ceilings)))
        return Table(f"stages of layer {layer}", ["stage", "us", "floor_us", "x_floor", "bound"], rows,
                     [str(self.ceilings)])

    def report(self, reps: int = 10) -> dict:
        """Step, phases and the layer table in one JSON-ready dict (what ``--profile`` prints)."""
        t0 = time.perf_counter()
        step = self.step(reps)
        phases = self.phases()
        tl = self.timeline()
        table = self.layer_table(timeline=tl)
        return dict(ceilings=dict(read_GBps=self.ceilings.read_GBps, mma_TFLOPs=self.ceilings.mma_TFLOPs,
                                  device=self.ceilings.device),
                    shape=dict(streams=self.S, rows=self.R, ctx=self.ctx, mode=self.mode, tp=self.eng.comm.size,
                               rank=self.eng.comm.rank, layers=self.eng.tcfg.num_hidden_layers),
                    step=step.as_dict(), phases={k: v.as_dict() for k, v in phases.items()},
                    layers=table.as_dict(), timeline=tl, profile_s=time.perf_counter() - t0)

    def close(self) -> None:
        """Undo the session's global changes (the uniform routing tables)."""
        if self.routing is not None:
            self.routing.__exit__(None, None, None)
            self.routing = None


class _Skipped:
    """Stands in for a kernel that ``only_kernel`` leaves out: launches nothing; attributes (occupancy
    queries, shared-memory limits) still come from the real kernel, so the wrappers plan as usual."""
    __slots__ = ("_fn",)

    def __init__(self, fn):
        self._fn = fn

    def __call__(self, *a, **k):
        return None

    def __getattr__(self, attr):
        return getattr(self._fn, attr)


class only_kernel(count_launches):
    """While active, kernel wrappers launch only kernels named ``name`` (template arguments stripped); every
    other launch through them is skipped, so a captured graph holds that kernel's launches alone."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def _wrap(self, fn, name: str):
        return fn if name == self.name else _Skipped(fn)
