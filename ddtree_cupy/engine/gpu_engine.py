"""``GpuEngine``: the CuPy backend behind the CLI and the server (``--backend cupy``), same interface as
``backend.NumpyEngine``: ``make_loop(mode, budget, ...) -> engine.loop.EngineLoop`` and
``generate(requests, mode, budget, cap_k, include_chain, on_tokens) -> api.GenerationResult``, making the
decisions of ``reference.loop.DecodeLoop``.

Construction loads this rank's weight shard, builds the GPU target and drafter, then sizes the paged
latent KV pool from the free GPU memory that remains (or ``kv_tokens``). The loop of ``engine/loop.py``
(admission and stop handling in ``engine/scheduler.py``, continuous batching) drives this module's executor:
chunked prefill (``step.Prefill``) and one CUDA graph per (stream bucket, mode, budget, sampled)
(``step.DecodeStep``), captured on first use and replayed every step. ``eager=True`` runs the same stage
sequence without graphs (debugging; identical results) and times the phases with CUDA events.
docs/ENGINE.md describes the step, its buffers and how to profile it.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from ..config import DrafterConfig, TargetConfig
from ..api import MAX_BUDGET, MODES
from .kv_pool import KVPool
from .loop import EngineLoop
from .profile import NullTimer, PhaseTimer, nvtx_pop, nvtx_push
from .scheduler import Scheduler, make_buckets, pack_control

PAGE = 64
ROW_BYTES = 576 * 2          # one token's latent row in one layer (bf16)


def free_device_bytes() -> int:
    """Bytes this process can still allocate: the device's free memory plus CuPy's cached free blocks, capped
    by the pool's limit when one is set (``CUPY_GPU_MEMORY_LIMIT``: the 16 GB CI emulation on a larger card)."""
    import cupy
    mp = cupy.get_default_memory_pool()
    free = cupy.cuda.runtime.memGetInfo()[0] + mp.free_bytes()
    limit = getattr(mp, "get_limit", lambda: 0)()
    if limit:
        free = min(free, limit - mp.used_bytes())
    return max(0, int(free))


def kv_pages_for_memory(free_bytes: int, num_layers: int, reserve_bytes: int, fraction: float = 0.9) -> int:
    """Pages of 64 tokens x all layers that fit in ``fraction`` of (free - reserve) bytes."""
    usable = max(0, int(free_bytes) - int(reserve_bytes)) * fraction
    return int(usable // (num_layers * PAGE * ROW_BYTES))


class GpuEngine:
    name = "cupy"

    def __init__(self, tcfg: TargetConfig, model_dir: Optional[str], dcfg: Optional[DrafterConfig] = None,
                 drafter_dir: Optional[str] = None, comm=None, max_streams: int = 10, max_budget: int = 64,
                 kv_tokens: Optional[int] = None, eager: bool = False, prefill_chunk: int = 256,
                 profile: bool = False, reserve_bytes: Optional[int] = None, random_weights: Optional[int] = None,
                 progress: bool = False, buckets: Optional[Sequence[int]] = None,
                 max_context: Optional[int] = None, pdl="auto"):
        """``random_weights``: a seed: random rank-shaped weights instead of a checkpoint (benchmarks).
        ``kv_tokens``: latent-cache tokens for all streams together (default: from free memory).
        ``profile``: time phases with CUDA events (forces eager steps: a replayed graph is one launch).
        ``max_context``: cache tokens one stream may use (prompt + output + one step's tree rows); default
        the position limit + the largest tree. Smaller values size the attention's split plan and the
        drafter ring for shorter contexts (longer requests are refused at admission).
        ``pdl``: 'auto' (decode-step graphs of <= step.PDL_MAX_ROWS verify rows are captured with programmatic
        dependent launch, where it measured faster), True (every step graph) or False (none)."""
        import cupy
        from ..dist import SingleRank
        from ..models.drafter import GpuDrafter, GpuDrafterWeights
        from ..models.kv import GpuLatentCache
        from ..models.target import GpuTarget, GpuTargetWeights
        from .step import Models, Prefill

        self.comm = comm if comm is not None else SingleRank()
        rank, size = self.comm.rank, self.comm.size
        for nm, v, lo, hi in (("max_streams", max_streams, 1, 1 << 12), ("max_budget", max_budget, 1, MAX_BUDGET),
                              ("prefill_chunk", prefill_chunk, 1, 4096)):
            if not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
                raise ValueError(f"GpuEngine: {nm} must be an integer in [{lo}, {hi}], got {v!r}")
        if pdl not in ("auto", True, False):
            raise ValueError(f"GpuEngine: pdl must be 'auto', True or False, got {pdl!r}")
        if kv_tokens is not None and (not isinstance(kv_tokens, (int, np.integer)) or kv_tokens < 1):
            raise ValueError(f"GpuEngine: kv_tokens must be a positive integer, got {kv_tokens!r}")
        self.tcfg, self.dcfg = tcfg, dcfg
        self.max_streams, self.max_budget = int(max_streams), int(max_budget)
        self.eager, self.profile = bool(eager or profile), bool(profile)
        self.buckets = tuple(buckets) if buckets else make_buckets(self.max_streams)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        t0 = time.perf_counter()
        if random_weights is not None:
            tw = GpuTargetWeights.random(tcfg, rank, size, seed=int(random_weights))
            dw = GpuDrafterWeights.random(dcfg, rank, size, seed=int(random_weights)) if dcfg is not None else None
        else:
            tw = GpuTargetWeights.from_checkpoint(model_dir, tcfg, rank, size, progress=progress)
            dw = (GpuDrafterWeights.from_checkpoint(drafter_dir, dcfg, rank, size, progress=progress)
                  if dcfg is not None else None)
        self.load_s = time.perf_counter() - t0
        depth = dcfg.block_size - 1 if dcfg is not None else 0
        max_rows = max(self.max_budget + 1, depth + 1, 1)
        self.max_tree_rows = max_rows
        max_tokens = max(self.max_streams * max_rows, int(prefill_chunk))
        feats = tuple(dcfg.target_layer_ids) if dcfg is not None else ()
        if size > 1 and getattr(self.comm, "backend", "") == "nccl":
            # the P2P all-reduce where every GPU pair has P2P and it measures faster (DDT_ALLREDUCE, comm/custom.py)
            from ..comm.custom import make_custom_comm
            self.comm = make_custom_comm(self.comm, cap=max_tokens * tcfg.hidden_size, H=tcfg.hidden_size)
        self.target = GpuTarget(tcfg, tw, self.comm, max_tokens=max_tokens, feature_layers=feats)
        # Largest context a stream can reach: the position limit plus one verify step's rows.
        max_ctx_tokens = tcfg.max_position_embeddings + max_rows
        if max_context is not None:
            if not isinstance(max_context, (int, np.integer)) or max_context < max_rows + 1:
                raise ValueError(f"GpuEngine: max_context must be an integer > {max_rows} (one tree), got "
                                 f"{max_context!r}")
            max_ctx_tokens = min(max_ctx_tokens, int(max_context))
        self.drafter = None
        if dcfg is not None:
            C = dcfg.draft_window if dcfg.draft_window else max_ctx_tokens
            self.drafter = GpuDrafter(dcfg, dw, self.target, self.comm, max_streams=self.max_streams, max_ctx=int(C),
                                      max_append=max(int(prefill_chunk), self.max_streams * (depth + 1)))
        cupy.cuda.Device().synchronize()
        # ---- the latent KV pool: what is left after weights and workspaces, minus a reserve for the
        # per-shape step buffers (TargetBatch logits dominate: T x V/tp x 4 B per shape) --------------
        L = tcfg.num_hidden_layers
        per_page = L * PAGE * ROW_BYTES
        self.max_pages_per_stream = -(-max_ctx_tokens // PAGE)
        if kv_tokens is not None:
            num_pages = -(-int(kv_tokens) // PAGE)
        else:
            free = free_device_bytes()
            if reserve_bytes is None:
                step_bytes = max_tokens * (tcfg.vocab_size // size) * 4 * 2 + max_tokens * len(feats) * tcfg.hidden_size * 2
                # step shapes (one per bucket) plus their attention split workspaces come after the pool
                reserve_bytes = max(2 << 30, 10 * step_bytes)
            # never more than every slot at its longest context: the rest would sit unused
            num_pages = min(kv_pages_for_memory(free, L, reserve_bytes),
                            self.max_streams * self.max_pages_per_stream)
        if num_pages < 1:
            raise MemoryError(f"GpuEngine: no GPU memory left for the KV cache after weights and workspaces "
                              f"({per_page} bytes per 64-token page needed)")
        self.max_pages_per_stream = min(self.max_pages_per_stream, num_pages)
        self.num_pages = num_pages
        self.kv = GpuLatentCache(L, num_pages, self.max_streams, self.max_pages_per_stream)
        self.models = Models(tcfg, dcfg, self.target, self.drafter, self.kv, self.comm, self.stream, pdl=pdl)
        self.prefill_runner = Prefill(self.models, prefill_chunk, graphs=not self.eager)
        self.steps: Dict[Tuple, object] = {}
        self.last_pool: Optional[KVPool] = None
        self.last_phase_s: Dict[str, float] = {}
        cupy.cuda.Device().synchronize()

    # ---- info ---------------------------------------------------------------------------------------
    @property
    def kv_tokens(self) -> int:
        return self.num_pages * PAGE

    def describe(self) -> str:
        return (f"GpuEngine: tp {self.comm.size}, {self.max_streams} stream slots (buckets {self.buckets}), "
                f"KV pool {self.num_pages} pages = {self.kv_tokens} tokens "
                f"({self.kv.nbytes() / 2**30:.2f} GiB), up to {self.max_pages_per_stream * PAGE} per stream, "
                f"{'eager' if self.eager else 'graphs'}")

    # ---- steps --------------------------------------------------------------------------------------
    def get_step(self, S: int, mode: str, budget: int, cap_k, include_chain: bool, sampled: bool,
                 split: bool = False, root_only: bool = False):
        """The DecodeStep of this shape (built, and captured unless eager, on first use); ``split`` /
        ``root_only``: the two kinds of step of ``--budget auto`` (step.DecodeStep)."""
        from .step import DecodeStep
        key = (S, mode, budget if (mode == "ddtree" and not root_only) else 0, cap_k if mode == "ddtree" else None,
               bool(include_chain) and mode == "ddtree", sampled, bool(split), bool(root_only))
        st = self.steps.get(key)
        if st is None:
            st = DecodeStep(self.models, S, mode, budget, cap_k, include_chain, sampled, split=split,
                            root_only=root_only)
            self.steps[key] = st
        if not (self.eager or self.profile) and st.graph is None:
            st.capture()
        return st

    def make_loop(self, mode: str = "ddtree", budget=32, cap_k: Optional[int] = None,
                  include_chain: bool = False, max_queue: Optional[int] = None, keep_history: bool = False,
                  observer=None) -> EngineLoop:
        """An online loop over this engine's stream slots and KV pool (one loop at a time). ``budget``: a fixed
        node count, or 'auto' / ('auto', N) / a ``budget.BudgetPolicy`` (mode 'ddtree': per-step, per-stream
        budgets, docs/BUDGET.md; the policy's statistics: ``last_executor.policy.stats()``)."""
        from ..budget import make_policy
        if mode not in MODES:
            raise ValueError(f"mode: unknown mode {mode!r} (choose from {', '.join(MODES)})")
        if mode != "ar" and self.drafter is None:
            raise ValueError(f"mode {mode!r} needs a drafter")
        policy = make_policy(budget, mode, include_chain) if mode == "ddtree" else None
        if policy is not None:
            budget = policy.max_nodes
        elif not isinstance(budget, (int, np.integer)):
            budget = 1                      # 'chain' / 'ar' build no tree of a chosen size
        if not isinstance(budget, (int, np.integer)) or not 1 <= budget <= self.max_budget:
            raise ValueError(f"budget: must be an integer in [1, {self.max_budget}] (the engine's max_budget), "
                             f"got {budget!r}")
        if cap_k is not None and cap_k < 1:
            raise ValueError(f"cap_k: must be >= 1, got {cap_k}")
        depth = 0 if mode == "ar" else self.models.depth
        rows = 1 if mode == "ar" else (depth + 1 if mode == "chain" else int(budget) + 1)
        pool = KVPool(self.num_pages, PAGE, self.max_streams, self.max_pages_per_stream, rows)
        self.last_pool = pool
        sched = Scheduler(pool, self.tcfg.vocab_size, self.tcfg.max_position_embeddings, depth,
                          keep_history=keep_history)
        self.last_executor = _Executor(self, mode, int(budget), cap_k, include_chain, policy)
        return EngineLoop(self.last_executor, sched, self.buckets, self.comm, max_queue, observer)

    def generate(self, requests: Sequence, mode: str = "ddtree", budget=32, cap_k: Optional[int] = None,
                 include_chain: bool = False, on_tokens: Optional[Callable] = None):
        res = self.make_loop(mode, budget, cap_k, include_chain, keep_history=True).generate(requests, on_tokens)
        self.last_phase_s = dict(self.last_executor.phase_s)
        if self.last_executor.policy is not None:
            res.budget_stats = self.last_executor.policy.stats()
        return res


class _Executor:
    """The engine seen by ``engine.loop.EngineLoop``: block table upload, prefill, one step."""

    def __init__(self, eng: GpuEngine, mode: str, budget: int, cap_k, include_chain: bool, policy=None):
        self.eng, self.mode, self.budget, self.cap_k, self.include_chain = eng, mode, budget, cap_k, include_chain
        self.policy = policy
        self.phase_s: Dict[str, float] = {}
        self.dev_budget = 0 if mode == "ar" else (eng.models.depth if mode == "chain" else budget)

    def write_block_table(self, table: np.ndarray) -> None:
        self.eng.stream.synchronize()          # no step in flight reads the table while it changes
        with self.eng.stream:
            self.eng.kv.set_block_table(table)

    def prefill(self, st) -> int:
        nvtx_push("prefill")
        self.eng.prefill_runner.graphs = not (self.eng.eager or self.eng.profile)
        try:
            return self.eng.prefill_runner.run(st.slot, st.request.prompt_ids, st.request, self.mode != "ar")
        finally:
            nvtx_pop()

    def step(self, running, bucket: int, budgets) -> np.ndarray:
        # with a budget policy the executor chooses each stream's budget itself, from this step's draft
        # (the loop's per-stream budgets are the fixed-budget path's)
        if self.policy is not None:
            return self._step_auto(running, bucket)
        eng = self.eng
        sampled = any(s.request.temperature > 0 for s in running)
        step = eng.get_step(bucket, self.mode, self.budget, self.cap_k, self.include_chain, sampled)
        ctrl = pack_control(running, bucket, budgets)
        timer = PhaseTimer(eng.stream) if eng.profile else NullTimer()
        nvtx_push("step")
        t0 = time.perf_counter()
        try:
            out = step.run(ctrl, running, eager=eng.eager or eng.profile, timer=timer)
        finally:
            nvtx_pop()
        if eng.profile:
            timer.collect(self.phase_s)
        else:
            key = "step_eager" if (eng.eager or eng.profile) else "step_graph"
            self.phase_s[key] = self.phase_s.get(key, 0.0) + time.perf_counter() - t0
        return out

    def _step_auto(self, running, bucket: int) -> np.ndarray:
        """One ``--budget auto`` step: the policy's decisions of reference.loop.DecodeLoop._step_auto. If no
        running stream drafts: the root-only step without the drafter. Else the split step: draft + top-K,
        the policy's budgets from the GPU's top-K log-probs (``budget.path_values``), build + verify +
        accept; the policy then observes each stream's accepted length."""
        from ..budget import path_values
        from ..api import OUT_NACC
        eng, pol = self.eng, self.policy
        sampled = any(s.request.temperature > 0 for s in running)
        keys = [s.index for s in running]
        want = set(pol.drafting(keys))
        ctrl = pack_control(running, bucket, 0)
        raw = {}
        nvtx_push("step")
        t0 = time.perf_counter()
        try:
            if not want:
                plan = pol.plan(bucket, keys, {})
                step = eng.get_step(bucket, "ddtree", self.budget, self.cap_k, False, sampled, root_only=True)
                out = step.run(ctrl, running, eager=eng.eager or eng.profile)
                kind = "step_root"
            else:
                step = eng.get_step(bucket, "ddtree", self.budget, self.cap_k, False, sampled, split=True)
                plan_box = {}

                def choose(top_lp):
                    vals = path_values(top_lp, self.budget, self.cap_k)
                    for s in running:
                        if s.index in want:
                            raw[s.index] = vals[s.slot]
                    plan_box["p"] = pol.plan(bucket, keys, raw)
                    b = np.zeros(bucket, np.int32)
                    for s in running:
                        b[s.slot] = plan_box["p"].budgets[s.index]
                    return b
                out = step.run_split(ctrl, choose, running, eager=eng.eager or eng.profile)
                plan = plan_box["p"]
                kind = "step_split"
        finally:
            nvtx_pop()
        self.phase_s[kind] = self.phase_s.get(kind, 0.0) + time.perf_counter() - t0
        for s in running:
            n_acc = int(out[s.slot][OUT_NACC])
            b = plan.budgets[s.index]
            if b > 0:
                pol.observe(s.index, raw[s.index][:b], n_acc)
            else:
                pol.note_root_only(s.index, n_acc)
        return out
