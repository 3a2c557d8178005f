"""Step timelines as Chrome trace JSON (chrome://tracing, https://ui.perfetto.dev) or plain JSON.

A timeline is a list of ``{name, cat, start_us, dur_us, ...}`` (``ProfileSession.timeline``, or the per-step
phase events of an engine run with ``GpuEngine(profile=True)``). The Chrome format is the "trace event"
JSON: one complete event (``ph: "X"``) per entry, microsecond timestamps, one row (tid) per category.
"""
from __future__ import annotations

import json
from typing import Dict, Iterable, List


def chrome_trace(events: Iterable[dict], process: str = "ddtree_cupy step") -> dict:
    """The trace-event object of ``events``: every entry becomes a complete event on the row of its ``cat``."""
    rows: Dict[str, int] = {}
    out: List[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": process}}]
    for e in events:
        for k in ("name", "start_us", "dur_us"):
            if k not in e:
                raise ValueError(f"chrome_trace: event {e!r} has no {k!r}")
        if e["dur_us"] < 0:
            raise ValueError(f"chrome_trace: event {e['name']!r} has a negative duration {e['dur_us']}")
        cat = str(e.get("cat") or "step")
        if cat not in rows:
            rows[cat] = len(rows) + 1
            out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rows[cat], "args": {"name": cat}})
        args = {k: v for k, v in e.items() if k not in ("name", "cat", "start_us", "dur_us")}
        out.append({"name": str(e["name"]), "cat": cat, "ph": "X", "pid": 0, "tid": rows[cat],
                    "ts": float(e["start_us"]), "dur": float(e["dur_us"]), "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, events: Iterable[dict], extra: dict = None) -> None:
    """Write ``events`` as a Chrome trace to ``path``; ``extra`` (tables, ceilings) goes in as metadata."""
    obj = chrome_trace(events)
    if extra:
        obj["otherData"] = extra
    with open(path, "w") as f:
        json.dump(obj, f)
