"""The CLI's ``--profile`` / ``--profile-trace FILE``: after the run, the same engine is timed at the run's
shape (its stream bucket, verify rows and mean context) by a ``ProfileSession`` around it: the step graph,
each phase as its own graph, one eager step's timeline and the per-layer table, all against floors over
ceilings measured in the same process. The run itself is not slowed or changed (it ran with its graphs);
the session only admits its own streams into a fresh pool after the run has released its own.

Every rank runs the same profiling sequence (the collectives of a TP run pair up); only the root prints.
"""
from __future__ import annotations

import json
from typing import Optional


def run_shape(engine, res, mode: str, budget):
    """(streams, rows, ctx) of the run: its smallest covering bucket, its verify rows, and the mean context
    its streams reached (capped to what one stream's cache and the pool hold). ``budget``: the CLI's value; a
    per-step budget ('auto', 'auto:N') is profiled at its largest tree, the rows its graphs are built for."""
    from ..budget import DEFAULT_MAX_NODES, parse_budget
    from .session import PAGE
    b = parse_budget(budget) if isinstance(budget, str) else budget
    budget = b if isinstance(b, int) else (DEFAULT_MAX_NODES if b == "auto" else b[1])
    n = max(1, len(res.streams))
    S = next((b for b in engine.buckets if b >= n), engine.max_streams)
    S = min(S, engine.max_streams)
    depth = engine.models.depth
    R = 1 if mode == "ar" else (depth + 1 if mode == "chain" else int(budget) + 1)
    lens = [len(s.request.prompt_ids) + len(s.output_ids) for s in res.streams] or [1]
    ctx = max(1, int(sum(lens) / len(lens)))
    ctx = min(ctx, engine.max_pages_per_stream * PAGE - 1 - R)
    while S > 1 and S * -(-(ctx + 1 + R) // PAGE) > engine.num_pages:
        S -= 1
    return S, R, ctx


def profile_run(a, engine, res, err, root: bool = True) -> Optional[dict]:
    """``--profile``: print the step / phase / layer report to ``err`` (root only) and return it as a dict for
    the JSON output; ``a.profile_trace``: also write the eager step's timeline there as a Chrome trace."""
    from ..engine.gpu_engine import GpuEngine
    if not isinstance(engine, GpuEngine):
        if root:
            print(f"--profile: GPU times need the cupy backend (this run used {getattr(engine, 'name', '?')}); "
                  "nothing profiled", file=err)
        return None
    from .session import ProfileSession
    from .trace import write_chrome_trace
    S, R, ctx = run_shape(engine, res, a.mode, a.budget)
    ps = ProfileSession(engine, streams=S, rows=R, ctx=ctx, mode=a.mode, fill=False)
    rep = ps.report()
    if a.profile_trace:
        write_chrome_trace(a.profile_trace, rep["timeline"], extra={k: v for k, v in rep.items() if k != "timeline"})
    if root:
        run_ph = res.phase_s
        print(f"profile ({ps.ceilings}): {S} stream(s) x {R} rows at ctx {ctx}", file=err)
        if run_ph:
            print("  the run's own times: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in run_ph.items()), file=err)
        print(f"  step graph {rep['step']['us']:.1f} us (floor {rep['step']['floor_us']:.1f} us, "
              f"x{rep['step']['x_floor']:.2f})", file=err)
        for k, v in rep["phases"].items():
            fl = "" if v["x_floor"] is None else f" (floor {v['floor_us']:.1f} us, x{v['x_floor']:.2f})"
            print(f"  phase {k}: {v['us']:.1f} us{fl}", file=err)
        from .session import Table
        print(str(Table(**rep["layers"])), file=err)
        if a.profile_trace:
            print(f"  step timeline ({len(rep['timeline'])} events) written to {a.profile_trace} "
                  "(chrome://tracing or ui.perfetto.dev)", file=err)
    return json.loads(json.dumps(rep))         # plain JSON types for the --json output
