"""Backend selection and the numpy engine behind the CLI.

``auto`` picks the GPU engine (CuPy, ``engine/gpu_engine.GpuEngine``) where a GPU is usable and the engine's
modules import, else numpy with a one-line notice. ``--backend cupy`` without a usable GPU refuses with the
reason. Every engine offers the same ``make_loop(mode, budget, ...) -> engine.loop.EngineLoop`` (the online
loop the server drives) and ``generate(requests, ...) -> api.GenerationResult`` (the batch CLI: a thin client
of that loop), so neither the CLI nor the server cares which one runs.
"""
from __future__ import annotations

import glob
import sys
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from .config import DrafterConfig, TargetConfig

BACKENDS = ("auto", "cupy", "numpy")


class BackendError(RuntimeError):
    """The requested backend cannot run here."""


def gpu_status() -> Tuple[bool, str]:
    """(usable, why): whether CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
    except Exception as e:           # not installed, or a broken CUDA install
        return False, f"cupy not importable ({type(e).__name__})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:           # no driver / no device
        return False, no_device_reason(e)
    if n < 1:
        return False, "no CUDA GPU found"
    return True, f"{n} CUDA device(s)"


def no_device_reason(e: Exception) -> str:
    """Why getDeviceCount failed, in words. Without a GPU the CUDA runtime reports a missing driver as
    cudaErrorInsufficientDriver ("driver version is insufficient"), which misleads: say there is no GPU."""
    msg = str(e).strip()
    no_nodes = not glob.glob("/dev/nvidia[0-9]*") and sys.platform.startswith("linux")
    if "cudaErrorNoDevice" in msg or no_nodes:
        return "no CUDA GPU found" + (" (no /dev/nvidia* device on this machine)" if no_nodes else "")
    if "cudaErrorInsufficientDriver" in msg:
        return ("the NVIDIA driver is older than the CUDA runtime this CuPy build needs "
                "(cudaErrorInsufficientDriver): update the driver, or install the cupy-cuda12x / cupy-cuda13x "
                "wheel that matches it")
    return f"no usable CUDA GPU ({type(e).__name__}: {msg})"


def gpu_engine_available() -> bool:
    """Whether the GPU engine's modules are present and import (they import CuPy lazily, so this is true
    on a machine without a GPU too; ``gpu_status`` says whether a device is usable)."""
    try:
        from .engine import gpu_engine  # noqa: F401
        from .models import batch, drafter, kv, target  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(name: str, notice: Callable[[str], None]) -> str:
    """Resolve ``name`` ('auto' | 'cupy' | 'numpy') to the backend that will run; ``notice`` gets one line
    when 'auto' has to fall back."""
    if name not in BACKENDS:
        raise BackendError(f"--backend: unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "numpy":
        return "numpy"
    usable, why = gpu_status()
    if name == "cupy":
        if not gpu_engine_available():
            raise BackendError("--backend cupy: the GPU engine's modules are missing from this installation; "
                               "use --backend numpy (the reference engine, for small models)")
        if not usable:
            raise BackendError(f"--backend cupy: {why}")
        return "cupy"
    if usable and gpu_engine_available():
        return "cupy"
    reason = "the GPU engine's modules are missing" if usable else why
    notice(f"note: backend auto -> numpy ({reason}); the numpy reference engine is only practical for small models")
    return "numpy"


class NumpyEngine:
    """The numpy reference target + DFlash drafter, run by the online loop over ``NumpyExecutor``."""

    name = "numpy"

    def __init__(self, tcfg: TargetConfig, model_dir: str, dcfg: Optional[DrafterConfig] = None,
                 drafter_dir: Optional[str] = None, dtype=np.float32, comm=None):
        """``comm``: a communicator (dist.py). Under mpirun each rank loads only its tensor-parallel shard."""
        from .checkpoint import load_drafter_weights, load_reference_weights
        from .reference.drafter import ReferenceDrafter
        from .reference.target import ReferenceTarget

        from .dist import SingleRank
        self.comm = comm if comm is not None else SingleRank()
        rank, size = self.comm.rank, self.comm.size
        self.dtype = np.dtype(dtype)
        self.tcfg, self.dcfg = tcfg, dcfg
        tw = load_reference_weights(model_dir, self.dtype, tp_rank=rank, tp_size=size, cfg=tcfg)
        self.target = ReferenceTarget(tcfg, tw, self.dtype, comm=self.comm)
        self.drafter = None
        if dcfg is not None:
            dw = load_drafter_weights(drafter_dir, self.dtype, tp_rank=rank, tp_size=size, cfg=dcfg)
            self.drafter = ReferenceDrafter(dcfg, dw, self.target.embed_tokens, self.target.lm_head,
                                            self.dtype, comm=self.comm)

    def make_loop(self, mode: str = "ddtree", budget: int = 32, cap_k: Optional[int] = None,
                  include_chain: bool = False, max_streams: Optional[int] = None, max_queue: Optional[int] = None,
                  kv_tokens: Optional[int] = None, keep_history: bool = False, observer=None):
        """An online loop over this engine. The numpy caches grow with their streams, so the KV pool here is
        bookkeeping that bounds them the way the GPU's pages do: ``kv_tokens`` cache tokens over all
        streams (default: every slot at its longest context), pages of 64 tokens."""
        from .engine.kv_pool import KVPool
        from .engine.loop import EngineLoop
        from .engine.scheduler import Scheduler, make_buckets
        max_streams = 8 if max_streams is None else int(max_streams)
        ex = NumpyExecutor(self.target, self.drafter, mode, budget, cap_k, include_chain, max_streams)
        rows = ex.dev_budget + 1
        per_stream = -(-(self.tcfg.max_position_embeddings + rows) // PAGE)
        num_pages = max_streams * per_stream if kv_tokens is None else -(-int(kv_tokens) // PAGE)
        if num_pages < 1:
            raise ValueError(f"kv_tokens: must be >= 1, got {kv_tokens!r}")
        pool = KVPool(num_pages, PAGE, max_streams, min(per_stream, num_pages), rows)
        sched = Scheduler(pool, self.tcfg.vocab_size, self.tcfg.max_position_embeddings, ex.loop.depth,
                          keep_history=keep_history, on_release=ex.release)
        return EngineLoop(ex, sched, make_buckets(max_streams), self.comm, max_queue, observer)

    def generate(self, requests: Sequence, mode: str = "ddtree", budget: int = 32, cap_k: Optional[int] = None,
                 include_chain: bool = False, on_tokens: Optional[Callable] = None):
        """Every request at once (one slot each, as many as there are requests), run to completion."""
        loop = self.make_loop(mode, budget, cap_k, include_chain, max_streams=max(1, len(requests)),
                              keep_history=True)
        res = loop.generate(requests, on_tokens)
        if loop.executor.policy is not None:
            res.budget_stats = loop.executor.policy.stats()
        return res


PAGE = 64


class NumpyExecutor:
    """One decode round per running stream in numpy, returning the packed rows the GPU step returns
    (``api.OUT_*``): the reference ``DecodeLoop``'s decisions (its tree rule and target choice) over caches
    kept per slot, created at prefill and dropped when the stream leaves its slot."""

    def __init__(self, target, drafter, mode: str, budget: int, cap_k=None, include_chain: bool = False,
                 max_streams: int = 8):
        from .reference.loop import DecodeLoop
        self.loop = DecodeLoop(target, drafter if mode != "ar" else None, mode, budget, cap_k, include_chain)
        self.target, self.drafter, self.mode = target, drafter, mode
        self.policy = self.loop.policy          # --budget auto: per-step, per-stream budgets (budget.py)
        self.dev_budget = 0 if mode == "ar" else (self.loop.depth if mode == "chain" else self.loop.budget)
        self.tc: list = [None] * max_streams
        self.dc: list = [None] * max_streams
        self.phase_s: dict = {}
        self.A = self.loop.depth + 1

    def write_block_table(self, table) -> None:
        pass                        # the numpy caches are per slot, not paged

    def release(self, st) -> None:
        self.tc[st.slot] = self.dc[st.slot] = None
        if self.policy is not None:
            self.policy.forget(st.index)

    def prefill(self, st) -> int:
        prompt = np.asarray(list(st.request.prompt_ids), np.int64)
        P = len(prompt)
        self.tc[st.slot] = self.target.new_cache()
        logits, feats = self.target.forward(prompt, np.arange(P), self.tc[st.slot], capture_layers=self.loop.capture)
        if self.mode != "ar":
            self.dc[st.slot] = self.drafter.new_cache()
            self.drafter.append_context(self.dc[st.slot], feats, np.arange(P), prompt)
        return int(self.loop.choose(logits[-1:], st.request, 0)[0])

    def _add(self, phase: str, t0: float) -> float:
        import time
        t = time.perf_counter()
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + t - t0
        return t

    def step(self, running, bucket: int, budgets) -> np.ndarray:
        import time

        from .api import OUT_NACC, OUT_NROWS, OUT_TOKENS
        from .reference.ddtree import commit_plan, flatten, greedy_walk
        out = np.full((bucket, OUT_TOKENS + self.A + 1), -1, np.int32)
        out[:, OUT_NACC] = 0
        trees, raw = {}, {}
        if self.policy is not None:
            # the reference loop's auto step (DecodeLoop._step_auto): draft the streams the policy asks for,
            # build each tree at the largest budget, let the policy cut each to its budget (first b nodes)
            from .budget import path_values, truncate_tree
            from .reference.ddtree import build_tree
            pol, keys = self.policy, [st.index for st in running]
            want = set(pol.drafting(keys))
            for st in running:
                if st.index in want:
                    t = time.perf_counter()
                    dl = self.drafter.draft(self.dc[st.slot], st.bonus, st.committed)
                    t = self._add("draft", t)
                    lp, ids = self.loop.tree_topk(dl)
                    trees[st.index] = build_tree(lp, ids, self.loop.budget, cap_k=self.loop.cap_k)
                    raw[st.index] = path_values(lp, self.loop.budget, self.loop.cap_k)
                    self._add("tree", t)
            plan = pol.plan(len(running), keys, raw)
            budgets = [plan.budgets[st.index] for st in running]
        for st, budget in zip(running, budgets):
            k, s, bonus = st.slot, st.committed, st.bonus
            t = time.perf_counter()
            if self.mode == "ar" or (self.policy is not None and budget == 0):
                tokens, parents, depths = np.array([bonus]), np.array([-1]), np.array([0])
                positions, visible = np.array([s]), None
            elif self.policy is not None:
                flat = flatten(truncate_tree(trees[st.index], budget), bonus, s)
                tokens, parents, depths = flat.tokens, flat.parents, flat.depths
                positions, visible = flat.positions.astype(np.int64), flat.mask
            else:
                dl = self.drafter.draft(self.dc[k], bonus, s)
                t = self._add("draft", t)
                flat = flatten(self.loop.tree_for(dl, budget), bonus, s)
                tokens, parents, depths = flat.tokens, flat.parents, flat.depths
                positions, visible = flat.positions.astype(np.int64), flat.mask
            t = self._add("tree", t)
            logits, feats = self.target.forward(tokens.astype(np.int64), positions, self.tc[k], visible=visible,
                                                capture_layers=self.loop.capture)
            t = self._add("verify", t)
            post = self.loop.choose(logits, st.request, st.steps + 1)
            rows, nb = greedy_walk(tokens, parents, post)
            plan = commit_plan(rows, depths, s)
            self.tc[k].commit(s, plan.src_slots)
            if self.mode != "ar":
                self.drafter.append_context(self.dc[k], feats[plan.feature_rows], np.arange(s, plan.new_len),
                                            tokens[plan.feature_rows])
            out[k, OUT_NACC], out[k, OUT_NROWS] = len(rows), len(tokens)
            toks = [int(tokens[r]) for r in rows] + [nb]
            out[k, OUT_TOKENS:OUT_TOKENS + len(toks)] = toks
            if self.policy is not None:
                if budget > 0:
                    self.policy.observe(st.index, raw[st.index][:len(tokens) - 1], len(rows))
                else:
                    self.policy.note_root_only(st.index, len(rows))
            self._add("accept", t)
        return out


def create_engine(backend: str, tcfg: TargetConfig, model_dir: str, dcfg: Optional[DrafterConfig],
                  drafter_dir: Optional[str], dtype=np.float32, comm=None, **gpu_options):
    """``dtype`` is the numpy engine's; the GPU engine is bf16. ``gpu_options`` go to ``GpuEngine``
    (max_streams, max_budget, kv_tokens, eager, ...); the CLI's budgets go up to 128."""
    if backend == "numpy":
        return NumpyEngine(tcfg, model_dir, dcfg, drafter_dir, dtype, comm)
    if backend == "cupy":
        if not gpu_engine_available():
            raise BackendError("backend 'cupy': the GPU engine's modules are missing from this installation")
        from .engine.gpu_engine import GpuEngine
        gpu_options.setdefault("max_budget", 128)
        return GpuEngine(tcfg, model_dir, dcfg, drafter_dir, comm=comm, **gpu_options)
    raise BackendError(f"backend {backend!r}: unknown backend (choose from {', '.join(BACKENDS)})")
