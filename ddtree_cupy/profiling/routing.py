"""Routing for rank-shape profiling with random weights, and the count of experts a step really touched.

``UniformRouting`` replaces the random model's router decisions by uniformly random ones (real routing's
spread); ``count_experts`` runs one step eagerly and counts the distinct experts per MoE layer that the MoE
kernels read. Used by the profiling session and bench/step.py alike.
"""
from __future__ import annotations

import numpy as np


class UniformRouting:
    """``--routing uniform``: the MoE kernels read, per layer, a fixed table of 8 distinct experts per row drawn
    uniformly at random (PERFORMANCE.md's model of real routing), instead of the random model's router output.

    Why: with random weights the residual stream of every row is dominated by the same attention/MLP outputs,
    so all tree rows route to nearly the same experts (8.5 unique per layer at 8 rows, where uniform routing
    touches ~60): the step would read far fewer expert bytes than a real model's. The router still runs (its
    kernels and their cost stay in the step); only ``moe_forward``'s ``ids`` argument is replaced, so the
    graph has no extra node. Tables are made on the first (eager) call of each (layer, rows) -- the capture's
    warm-up -- and reused by the captured graph."""

    def __init__(self, E: int, k: int, seed: int = 7):
        from ddtree_cupy.kernels import moe as moe_mod
        self.mod, self.orig = moe_mod, moe_mod.moe_forward
        self.E, self.k, self.rng = E, k, np.random.default_rng(seed)
        self.tables = {}            # (id(experts), T) -> (device table, host copy)
        self.used = []              # host tables in call order (counted by count_experts)
        self.masked = {}            # key -> (device table with the padding rows' ids -1, table + 1)

    def __enter__(self):
        self.mod.moe_forward = self._forward
        return self

    def __exit__(self, *exc):
        self.mod.moe_forward = self.orig

    def _forward(self, x, ids, *a, **kw):
        import cupy
        experts = a[1] if len(a) > 1 else kw["experts"]
        key = (id(experts), ids.shape[0])
        tab = self.tables.get(key)
        if tab is None:
            if cupy.cuda.get_current_stream().is_capturing():
                raise RuntimeError("UniformRouting: a routing table was first needed during capture")
            host = np.stack([self.rng.choice(self.E, self.k, replace=False) for _ in range(ids.shape[0])])
            host = host.astype(ids.dtype)
            tab = self.tables[key] = (cupy.asarray(host), host)
        self.used.append(tab[1])
        # padding rows (the router gave them ids -1: no expert) stay without experts, so the MoE reads the
        # experts of the real rows only, as in the engine's step
        # (ids are -1 or an expert id: m = min(ids + 1, 1) is 1 on real rows, 0 on padding;
        # out = m * (table + 1) - 1, four ufuncs into preallocated buffers, capturable)
        if key not in self.masked:
            self.masked[key] = (cupy.empty(tab[0].shape, tab[0].dtype), cupy.asarray(tab[1] + 1))
        buf, tab1 = self.masked[key]
        cupy.add(ids, 1, out=buf)
        cupy.minimum(buf, 1, out=buf)
        cupy.multiply(buf, tab1, out=buf)
        cupy.subtract(buf, 1, out=buf)
        return self.orig(x, buf, *a, **kw)


def count_experts(step, S, R, cfg, uniform=None):
    """Unique routed experts per MoE layer over the real rows of one eager step (router outputs recorded)."""
    from ddtree_cupy.kernels import router as router_mod
    seen = []
    orig = router_mod.route_logits

    def rec(*a, **k):
        ids, w = orig(*a, **k)
        seen.append(ids.get())
        return ids, w
    router_mod.route_logits = rec
    try:
        with step.m.stream:
            step.enqueue()
        step.m.stream.synchronize()
    finally:
        router_mod.route_logits = orig
    n_rows = step.batch.n_rows.get()
    rows = np.concatenate([np.arange(s * R, s * R + int(n_rows[s])) for s in range(S)])
    if uniform is not None:         # what the MoE kernels read: the tables of the verify forward's layers
        seen = uniform.used[-len(seen):]
    return [int(np.unique(ids[rows]).size) for ids in seen], int(rows.size)
