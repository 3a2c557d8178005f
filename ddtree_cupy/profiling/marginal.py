"""Marginal cost of each layer stage on the real critical path (leave one out), for the profiling session
and bench/step.py ``--loo``."""
from __future__ import annotations


def leave_one_out(eng, step, st, moe_layer: int, use_pdl: bool = True, reps: int = 3) -> dict:
    """The verify phase (all layers) captured as one graph, PDL launches as the engine's graph when ``use_pdl``,
    timed whole and once per layer stage with that stage dropped from EVERY layer. The drop of stage s gives
    its marginal cost: the time it adds to the real critical path, overlap with its neighbours and its
    weights' real DRAM traffic included -- which per-stage graphs (each replayed alone, small weights in L2)
    cannot show. Buffers keep their previous values when a producer is dropped, so the kernels still read
    valid memory; the numbers are timings only."""
    from ..kernels import launch
    from .ceilings import time_graph
    cls = type(eng.target)
    orig = cls.layer_stages
    verify = dict(step.phases())["verify"]
    names = [n for n, _ in orig(eng.target, moe_layer, step.batch, eng.kv)]
    n_layers = eng.target.cfg.num_hidden_layers
    before = launch.pdl_enabled()
    launch.set_pdl(use_pdl)
    try:
        with st:
            full = time_graph(verify, iters=1, reps=reps)
            marginal = {}
            for drop in names:
                def stages(self, i, batch, kv, _drop=drop):
                    return [(n, fn) for n, fn in orig(self, i, batch, kv) if n != _drop]
                cls.layer_stages = stages
                try:
                    t = time_graph(verify, iters=1, reps=reps)
                finally:
                    cls.layer_stages = orig
                marginal[drop] = (full - t) / n_layers
    finally:
        launch.set_pdl(before)
    return dict(verify_us=full, pdl=use_pdl, marginal_us_per_layer=marginal,
                sum_marginal_us=sum(marginal.values()), verify_us_per_layer=full / n_layers)
