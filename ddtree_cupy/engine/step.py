"""The decode step: stage sequence, static buffers, CUDA-graph capture/replay, eager mode; and the prefill.

One ``DecodeStep`` per (stream bucket S, mode, budget, sampled). Its stages, all on the engine's stream,
all reading per-step inputs from static device buffers (so one captured graph replays every step):

  ctrl  int32 [5, S]  uploaded by the host before each step (prefix_len, bonus, active, budget, round)
  draft    drafter.draft(bonus, start_pos = s, ctx_len = s) -> draft_out [S, D, V/tp]    (not 'ar')
  tree     per-depth top-K (vocabulary-parallel: local top-K, all-gather, merge) -> ws.top_lp/top_id;
           ddt_build_tree (budget per slot from ctrl; 'chain' = budget D over top-1 lists) or, for 'ar',
           a root-only tree; eg_tree_to_batch writes the target batch (tokens, positions, kv_pos, mask...)
  verify   target.forward(batch, kv) -> logits [S*R, V/tp], features; per-row argmax (vocabulary-parallel
           merge) or sample -> ids [S*R]; eg_post_scatter -> post [S, 129]
  accept   ddt_walk_commit -> accepted rows, out tokens, n_acc; kv_compact_latent (every layer, one
           launch); eg_after_walk -> drafter append batch (accepted rows' features at s + j) and the packed
           output [S, A + 3]; drafter.append_context
Host per step: one ctrl upload, one graph launch, one small device-to-host copy of ``packed`` (pinned).
The host is authoritative for s and the bonus (it rewrites ctrl every step from the packed output), so
streams can join and leave between any two steps without touching the graph.

Idle slots of a bucket (active = 0) run with budget 0 and n_rows 0: no KV write (kv_pos -1), no compaction
(n_acc 1), no drafter append (position -1), packed n_acc 0.
"""
from __future__ import annotations

import copy
from typing import List, Optional, Sequence

import numpy as np

from ..kernels import ddtree as ddt
from ..kernels import engine_glue as glue
from ..kernels.kv_cache import kv_compact_latent
from ..reference.ddtree import MAX_RANK, slot_seed, splitmix64  # noqa: F401 - the sampler's key
from .profile import NullTimer
from ..api import CTRL_BONUS, CTRL_BUDGET, CTRL_FIELDS, CTRL_PREFIX


def top_k_i32(top_k: int, vocab_size: int) -> int:
    """A request's top_k as the int32 the sampler reads: 0 (off) or at most the vocabulary (a larger top-k
    keeps every id, as HF does), so no value can wrap around in the cast."""
    k = int(top_k)
    if k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    return min(k, int(vocab_size))


# Programmatic dependent launch (kernels/launch.py) for captured decode steps of at most this many verify
# rows: measured on the H200 (bench/step.py, docs/ENGINE.md) 3-8% faster at 8-64 rows, where the step is
# launch-latency bound; at 80-320 rows 0-3.5% slower before the wide-token GEMMs and bulk-copy MoE GEMMs there,
# 1.5-2.1% faster with them; outputs bit-identical with and without. Larger steps: unmeasured.
PDL_MAX_ROWS = 320


def use_pdl(setting, rows: int) -> bool:
    """setting 'auto': PDL for steps of <= PDL_MAX_ROWS rows; True / False: always / never."""
    return rows <= PDL_MAX_ROWS if setting == "auto" else bool(setting)


class Models:
    """What every step and the prefill share: configs, target, drafter, latent cache, communicator, stream;
    ``pdl``: when decode-step graphs are captured with programmatic dependent launch (``use_pdl``)."""

    def __init__(self, tcfg, dcfg, target, drafter, kv, comm, stream, pdl="auto"):
        self.tcfg, self.dcfg, self.target, self.drafter, self.kv, self.comm = tcfg, dcfg, target, drafter, kv, comm
        self.stream = stream
        self.pdl = pdl
        self.tp, self.rank = comm.size, comm.rank
        self.V_local = tcfg.vocab_size // self.tp
        self.id_offset = self.rank * self.V_local
        self.depth = (dcfg.block_size - 1) if dcfg is not None else 0
        self.n_feat = len(target.feature_layers)
        self.H = tcfg.hidden_size


def gather_keys(comm, keys):
    """All-gather uint64 top-K keys as int64 (same bits: NCCL has no unsigned 64-bit type in dist.py)."""
    import cupy
    return comm.all_gather(keys.view(cupy.int64)).view(cupy.uint64)


class VocabArgmax:
    """Per-row argmax (ties: lowest id) of vocabulary-parallel logits [T, V/tp] -> ids int32 [T], using the
    DDTree top-K kernels with k = 1 (ordered keys carry global ids, so the all-gathered shards merge with
    ``topk_merge(parts_major=True)`` exactly as the draft top-K does)."""

    def __init__(self, m: Models, T: int):
        import cupy
        self.m, self.T = m, T
        P = ddt.n_chunks(m.V_local)
        self.part_keys = cupy.empty((T, P, 1), cupy.uint64)
        self.part_ms = cupy.empty((T, P, 2), cupy.float32)
        self.keys = cupy.empty((T, 1), cupy.uint64)
        self.ms = cupy.empty((T, 2), cupy.float32)
        self.keys2 = cupy.empty((T, 1), cupy.uint64)
        self.ms2 = cupy.empty((T, 2), cupy.float32)
        self.lp = cupy.empty((T, 1), cupy.float32)
        self.keep: List = []           # all-gather outputs referenced by a captured graph

    def __call__(self, logits, ids) -> None:
        m = self.m
        ids2 = ids.reshape(self.T, 1)
        ddt.topk_partial(logits, 1, self.part_keys, self.part_ms, id_offset=m.id_offset)
        if m.tp == 1:
            ddt.topk_merge(self.part_keys, self.part_ms, 1, self.keys, self.ms, self.lp, ids2)
            return
        ddt.topk_merge(self.part_keys, self.part_ms, 1, self.keys, self.ms, self.lp, ids2)
        gk, gm = gather_keys(m.comm, self.keys), m.comm.all_gather(self.ms)
        self.keep = [gk, gm]
        ddt.topk_merge(gk, gm, 1, self.keys2, self.ms2, self.lp, ids2, parts_major=True)


class WholeRows:
    """Vocabulary-parallel logits [T, V/tp] -> whole rows [T, V] on every rank (all-gather, then one glue
    copy), for the sampler; at TP = 1 the logits are already whole. Every rank then samples the same rows
    with the same keys, so sampled decisions agree across ranks and equal TP = 1's."""

    def __init__(self, m: Models, T: int):
        import cupy
        self.m = m
        self.rows = cupy.empty((T, m.tcfg.vocab_size), cupy.float32) if m.tp > 1 else None
        self.keep: List = []           # the all-gather output a captured graph references

    def __call__(self, logits):
        if self.m.tp == 1:
            return logits
        T = logits.shape[0]
        parts = self.m.comm.all_gather(logits)
        self.keep = [parts]
        glue.vocab_rows(parts, self.rows[:T])
        return self.rows[:T]


def draft_topk(m: Models, ws, logits, merged_keys, merged_ms, keep: list) -> None:
    """Per-depth top-k of the draft logits into ws.top_lp / ws.top_id (vocabulary-parallel merge)."""
    ws.topk(logits, id_offset=m.id_offset)
    if m.tp == 1:
        return
    gk, gm = gather_keys(m.comm, ws.keys), m.comm.all_gather(ws.ms)
    keep[:] = [gk, gm]
    ddt.topk_merge(gk, gm, ws.k, merged_keys, merged_ms, ws.top_lp.reshape(ws.S * ws.D, ws.k),
                   ws.top_id.reshape(ws.S * ws.D, ws.k), parts_major=True)


def tree_k(mode: str, budget: int, vocab: int, v_local: int, cap_k: Optional[int]) -> int:
    """Top-K per depth, as ``DecodeLoop.tree_for`` chooses it (capped by the kernels' limits)."""
    if mode != "ddtree":
        return 1
    k = min(budget, vocab, MAX_RANK + 1, ddt.MAX_K, v_local)
    if cap_k is not None:
        k = min(k, int(cap_k))
    return k


class DecodeStep:
    """Static buffers and stage sequence of one decode-step shape; eager or captured as one CUDA graph."""

    def __init__(self, m: Models, S: int, mode: str, budget: int, cap_k: Optional[int], include_chain: bool,
                 sampled: bool, split: bool = False, root_only: bool = False):
        """``split`` (``--budget auto``): two graphs, draft + top-K, then the host reads the top-K and sets
        each slot's budget (``run_split``), then build + verify + accept. ``root_only`` (mode 'ddtree'): a
        root-only step that does not draft but still appends the committed row to the drafter context
        (the policy's fall-back: 'ar''s cost, the drafter stays in sync)."""
        import cupy
        from ..models.batch import TargetBatch
        if mode not in ("ar", "chain", "ddtree"):
            raise ValueError(f"mode: unknown mode {mode!r}")
        if mode != "ar" and m.drafter is None:
            raise ValueError(f"mode {mode!r} needs a drafter")
        if (split or root_only) and mode != "ddtree":
            raise ValueError(f"split / root_only steps are mode 'ddtree' only, got {mode!r}")
        if split and root_only:
            raise ValueError("a step is split (drafting) or root_only (not drafting), not both")
        self.m, self.S, self.mode, self.sampled = m, S, mode, sampled
        self.split, self.root_only = bool(split), bool(root_only)
        D = m.depth if mode != "ar" else 1
        self.D = D
        self.R = 1 if (mode == "ar" or root_only) else (D + 1 if mode == "chain" else budget + 1)
        self.budget_dev = 0 if (mode == "ar" or root_only) else (D if mode == "chain" else budget)
        self.cap_k = 0 if (mode != "ddtree" or cap_k is None) else int(cap_k)
        self.include_chain = bool(include_chain) and mode == "ddtree"
        self.k = 1 if root_only else tree_k(mode, budget, m.tcfg.vocab_size, m.V_local, cap_k)
        self.ws = ddt.DDTreeWorkspace(S, D, m.V_local, self.k)
        self.A = self.ws.A
        T = self.T = S * self.R
        i32 = cupy.int32
        self.ctrl = cupy.zeros((CTRL_FIELDS, S), i32)
        self.ctrl_host = cupy.cuda.alloc_pinned_memory(CTRL_FIELDS * S * 4)
        self.ctrl_np = np.frombuffer(self.ctrl_host, np.int32, CTRL_FIELDS * S).reshape(CTRL_FIELDS, S)
        self.batch = TargetBatch(S, self.R, m.tcfg, m.tp, m.n_feat, tree=(mode != "ar"))
        self.ids = cupy.zeros(T, i32)
        self.post = cupy.full((S, ddt.MAX_TREE_ROWS), -1, i32)
        self.packed = cupy.zeros((S, self.A + 3), i32)
        self.packed_host = cupy.cuda.alloc_pinned_memory(S * (self.A + 3) * 4)
        self.packed_np = np.frombuffer(self.packed_host, np.int32, S * (self.A + 3)).reshape(S, self.A + 3)
        self.argmax = VocabArgmax(m, T)
        self.keep: list = []
        if mode != "ar":
            self.draft_out = cupy.zeros((S, D, m.V_local), cupy.float32)
            self.merged_keys = cupy.empty((S * D, self.k), cupy.uint64)
            self.merged_ms = cupy.empty((S * D, 2), cupy.float32)
            self.app_feats = cupy.zeros((S * self.A, m.n_feat, m.H), cupy.uint16)
            self.app_sid = cupy.zeros(S * self.A, i32)
            self.app_pos = cupy.full(S * self.A, -1, i32)
        if sampled:
            f32 = cupy.float32
            self.slot_temp, self.slot_topp = cupy.zeros(S, f32), cupy.ones(S, f32)
            self.slot_topk, self.slot_seed = cupy.zeros(S, i32), cupy.zeros(S, cupy.uint64)
            self.row_temp, self.row_topp = cupy.zeros(T, f32), cupy.ones(T, f32)
            self.row_topk, self.row_seed = cupy.zeros(T, i32), cupy.zeros(T, cupy.uint64)
            self.row_step = cupy.zeros(T, cupy.int64)
            # The sampler works on whole vocabulary rows: under TP the shards are gathered into full_rows.
            self.full_rows = WholeRows(m, T)
        self.graph = None
        self.graphs_split = None       # (draft + top-K graph, build + verify + accept graph) when split
        if split:
            self.top_lp_host = cupy.cuda.alloc_pinned_memory(self.ws.top_lp.nbytes)
            self.top_lp_np = np.frombuffer(self.top_lp_host, np.float32, self.ws.top_lp.size).reshape(
                self.ws.top_lp.shape)
        self.pdl = False               # whether the captured graph uses PDL launches (capture sets it)

    # ---- the stage sequence ---------------------------------------------------------------------------
    def phases(self):
        """[(name, fn)] of the step's phases in order (each enqueues kernels only); ``enqueue`` runs them all,
        bench/step.py captures each as its own graph to time it."""
        if self.mode == "ar" or self.root_only:
            ph = [("tree", self._root)]
        else:
            ph = [("draft", self._draft), ("tree", self._tree)]
        return ph + [("verify", self._verify), ("accept", self._accept)]

    def split_phases(self):
        """The two halves of a split step: [draft, top-K] and [build, verify, accept]."""
        return ([("draft", self._draft), ("topk", self._topk)],
                [("build", self._build), ("verify", self._verify), ("accept", self._accept)])

    def enqueue(self, timer=NullTimer()) -> None:
        """Every stage of one step, on the current stream (no allocation, no host sync)."""
        for name, fn in self.phases():
            timer.mark(name)
            fn()
        timer.stop()

    def _draft(self) -> None:
        c = self.ctrl
        self.m.drafter.draft(c[CTRL_BONUS], c[CTRL_PREFIX], c[CTRL_PREFIX], self.draft_out)

    def _tree(self) -> None:
        self._topk()
        self._build()

    def _topk(self) -> None:
        draft_topk(self.m, self.ws, self.draft_out, self.merged_keys, self.merged_ms, self.keep)

    def _build(self) -> None:
        c, ws = self.ctrl, self.ws
        ws.build(c[CTRL_BUDGET], c[CTRL_PREFIX], c[CTRL_BONUS], cap_k=self.cap_k, include_chain=self.include_chain)
        self._to_batch()

    def _root(self) -> None:
        ws = self.ws
        glue.root_tree(self.ctrl, ws.tokens, ws.parents, ws.depths, ws.positions, ws.n_rows, ws.mask)
        self._to_batch()

    def _to_batch(self) -> None:
        ws, b = self.ws, self.batch
        glue.tree_to_batch(self.ctrl, self.R, ws.tokens, ws.positions, ws.n_rows, ws.mask, b.tokens, b.positions,
                           b.kv_pos, b.stream_ids, b.prefix_len, b.n_rows, b.row_start, b.mask)

    def _verify(self) -> None:
        b = self.batch
        self.m.target.forward(b, self.m.kv)
        if self.sampled:
            from ..kernels.sample import sample
            glue.sample_params(self.ctrl, self.R, self.slot_temp, self.slot_topk, self.slot_topp, self.slot_seed,
                               self.row_temp, self.row_topk, self.row_topp, self.row_seed, self.row_step)
            sample(self.full_rows(b.logits), self.row_temp, self.row_topk, self.row_topp, self.row_seed,
                   self.row_step, out=self.ids)
        else:
            self.argmax(b.logits, self.ids)
        glue.post_scatter(self.ids, self.R, self.post)

    def _accept(self) -> None:
        m, ws, c, b = self.m, self.ws, self.ctrl, self.batch
        prefix = c[CTRL_PREFIX]
        # the compaction reads the PRE-step prefix: the host rewrites ctrl (s, bonus) before the next step
        ws.walk_commit(self.post, prefix, b.row_start)
        if self.mode != "ar":
            kv_compact_latent(m.kv.pool_ptrs, m.kv.block_table[:self.S], prefix, ws.n_acc, ws.acc_rows)
            glue.after_walk(c, ws.n_acc, ws.n_rows, ws.out_tokens, ws.feat_rows, b.features, self.app_feats,
                            self.app_sid, self.app_pos, self.packed)
            m.drafter.append_context(self.app_feats, self.app_sid, self.app_pos)
        else:
            glue.after_walk(c, ws.n_acc, ws.n_rows, ws.out_tokens, ws.feat_rows, None, None, None, None,
                            self.packed)

    # ---- capture / replay -----------------------------------------------------------------------------
    def capture(self) -> None:
        """Warm up eagerly with every slot idle (compiles kernels, allocates first-call workspaces; changes
        no stream's state), then capture the same sequence as one CUDA graph; with programmatic dependent
        launch for the kernels that allow it when ``use_pdl(m.pdl, rows)`` (recorded in the graph)."""
        from ..kernels import launch
        st = self.m.stream
        before = launch.pdl_enabled()
        self.pdl = use_pdl(self.m.pdl, self.T)
        launch.set_pdl(self.pdl)
        try:
            with st:
                self.ctrl.fill(0)
                self.enqueue()
                st.synchronize()
                if self.split:
                    graphs = []
                    for half in self.split_phases():
                        st.begin_capture()
                        try:
                            for _, fn in half:
                                fn()
                        finally:
                            graphs.append(st.end_capture())
                    self.graphs_split = tuple(graphs)
                else:
                    st.begin_capture()
                    try:
                        self.enqueue()
                    finally:
                        self.graph = st.end_capture()
                st.synchronize()
        finally:
            launch.set_pdl(before)

    def upload(self, ctrl: np.ndarray, running=None) -> None:
        """Host -> device: the control block (and, sampled, the running streams' sampling parameters)."""
        st = self.m.stream
        self.ctrl_np[...] = ctrl
        self.ctrl.set(self.ctrl_np, stream=st)
        if self.sampled and running is not None:
            t = np.zeros(self.S, np.float32)
            p = np.ones(self.S, np.float32)
            k = np.zeros(self.S, np.int32)
            sd = np.zeros(self.S, np.uint64)
            for s in running:
                r = s.request
                t[s.slot], p[s.slot], k[s.slot] = r.temperature, r.top_p, top_k_i32(r.top_k, self.m.tcfg.vocab_size)
                sd[s.slot] = slot_seed(r.seed, r.sample_stream)
            for dev, host in ((self.slot_temp, t), (self.slot_topp, p), (self.slot_topk, k), (self.slot_seed, sd)):
                dev.set(host, stream=st)

    def run(self, ctrl: np.ndarray, running=None, eager: bool = False, timer=NullTimer()) -> np.ndarray:
        """One step: upload, replay (or run eagerly), copy the packed output back. Returns a host copy
        int32 [S, A + 3] (per slot: n_acc, tree rows, out_tokens)."""
        st = self.m.stream
        self.upload(ctrl, running)
        with st:
            if eager or self.graph is None:
                self.enqueue(timer)
            else:
                self.graph.launch(st)
            self.packed.get(stream=st, out=self.packed_np)
        st.synchronize()
        return self.packed_np.copy()


    def run_split(self, ctrl: np.ndarray, choose, running=None, eager: bool = False) -> np.ndarray:
        """A split step: draft + top-K, copy the per-depth top-K log-probs [S, D, k] to the host,
        ``choose(top_lp) -> int32 [S]`` budgets (written into ctrl's budget row), then build + verify +
        accept with those budgets. Returns the packed output as ``run`` does."""
        if not self.split:
            raise ValueError("run_split: this step was not built with split=True")
        st = self.m.stream
        self.upload(ctrl, running)
        halves = self.split_phases()
        with st:
            if eager or self.graphs_split is None:
                for _, fn in halves[0]:
                    fn()
            else:
                self.graphs_split[0].launch(st)
            self.ws.top_lp.get(stream=st, out=self.top_lp_np)
        st.synchronize()
        budgets = np.asarray(choose(self.top_lp_np), np.int32)
        if budgets.shape != (self.S,) or (budgets < 0).any() or (budgets > self.budget_dev).any():
            raise ValueError(f"run_split: budgets must be int [{self.S}] in [0, {self.budget_dev}], got {budgets}")
        ctrl = np.array(ctrl, np.int32)
        ctrl[CTRL_BUDGET] = budgets
        self.ctrl_np[...] = ctrl
        with st:
            self.ctrl.set(self.ctrl_np, stream=st)
            if eager or self.graphs_split is None:
                for _, fn in halves[1]:
                    fn()
            else:
                self.graphs_split[1].launch(st)
            self.packed.get(stream=st, out=self.packed_np)
        st.synchronize()
        return self.packed_np.copy()


class Prefill:
    """Chunked prompt prefill of one stream: causal chunks of ``chunk`` rows through the target, features
    appended to the drafter's context, the first token (argmax or sample) from the prompt's last row.

    With ``graphs`` one CUDA graph per variant (with / without the drafter append) replays every chunk of
    every stream: the chunk's inputs are written into the static batch before the launch, and the stream's
    block-table row is copied into a one-row table the graph's cache view reads (batch slot 0 = that
    stream: the attention indexes the table by batch slot, the KV write by stream_ids = 0). The per-row
    argmax of the whole chunk is part of the graph; the host picks the last real row's."""

    def __init__(self, m: Models, chunk: int = 256, graphs: bool = True):
        import cupy
        from ..models.batch import TargetBatch
        self.m, self.chunk, self.graphs = m, int(chunk), bool(graphs)
        self.batch = TargetBatch(1, self.chunk, m.tcfg, m.tp, m.n_feat, tree=False)
        self.table = cupy.full((1, m.kv.max_pages_per_stream), -1, cupy.int32)
        self.kv = copy.copy(m.kv)
        self.kv.block_table = self.table
        self.argmax = VocabArgmax(m, self.chunk)
        self.ids = cupy.zeros(self.chunk, cupy.int32)
        self.sid = cupy.zeros(self.chunk, cupy.int32)
        self.pos = cupy.full(self.chunk, -1, cupy.int32)
        self.one = cupy.zeros(1, cupy.int32)
        self.full_rows = WholeRows(m, 1)
        self.graph = {}                  # use_drafter -> graph

    def _ops(self, use_drafter: bool) -> None:
        b = self.batch
        self.m.target.forward(b, self.kv)
        if use_drafter:
            self.m.drafter.append_context(b.features, self.sid, self.pos)
        self.argmax(b.logits, self.ids)

    def run(self, slot: int, prompt: Sequence[int], request, use_drafter: bool) -> int:
        import cupy
        m, b, C, st = self.m, self.batch, self.chunk, self.m.stream
        use_drafter = bool(use_drafter and m.drafter is not None)
        prompt = np.asarray(list(prompt), np.int32)
        P = len(prompt)
        last = 0
        with st:
            cupy.copyto(self.table, m.kv.block_table[slot:slot + 1])
            self.sid.fill(slot)
            for c0 in range(0, P, C):
                n = min(C, P - c0)
                toks = np.zeros(C, np.int32)
                toks[:n] = prompt[c0:c0 + n]
                pos = c0 + np.arange(C, dtype=np.int32)
                kvp = np.where(np.arange(C) < n, pos, -1).astype(np.int32)
                b.tokens.set(toks, stream=st)
                b.positions.set(pos, stream=st)
                b.kv_pos.set(kvp, stream=st)
                b.prefix_len.set(np.array([c0], np.int32), stream=st)
                b.n_rows.set(np.array([n], np.int32), stream=st)
                self.pos.set(kvp, stream=st)
                g = self.graph.get(use_drafter) if self.graphs else None
                if g is not None:
                    g.launch(st)
                else:
                    self._ops(use_drafter)       # eager (also the first chunk before a capture)
                    if self.graphs:
                        st.synchronize()
                        st.begin_capture()
                        try:
                            self._ops(use_drafter)
                        finally:
                            self.graph[use_drafter] = st.end_capture()
                last = n - 1
            if request.temperature > 0:
                from ..kernels.sample import sample
                f = lambda v, dt: cupy.asarray(np.array([v], dt))   # noqa: E731
                sample(self.full_rows(b.logits[last:last + 1]), f(request.temperature, np.float32),
                       f(top_k_i32(request.top_k, self.m.tcfg.vocab_size), np.int32),
                       f(request.top_p, np.float32), f(slot_seed(request.seed, request.sample_stream), np.uint64),
                       f(0, np.int64), out=self.one)
                out = int(self.one.get(stream=st)[0])
            else:
                out = int(self.ids[last:last + 1].get(stream=st)[0])
        st.synchronize()
        return out
