"""Which all-reduce algorithm serves which payload: a table of measured in-graph times per algorithm.

The table comes from ``bench/allreduce.py --json`` (rows with ``bytes`` and ``nccl_graph_us`` /
``oneshot_graph_us`` / ``twoshot_graph_us`` / ``twolevel_graph_us``; a file written before the custom path existed has NCCL's
``graph_us`` only) or from the start-up calibration of ``comm.custom`` (same row format). ``choose(nbytes)``
interpolates every algorithm's time linearly in the payload between measured sizes and picks the fastest;
outside the measured range it keeps the nearest measured choice, and a custom algorithm is never chosen
for a payload above the buffer capacity. Every rank must choose identically (the custom kernels'
counters advance per call), so the table is rank 0's, broadcast.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

CUSTOM_ALGOS = ("oneshot", "twoshot", "twolevel")
ALL_ALGOS = ("nccl",) + CUSTOM_ALGOS


@dataclass
class CalibrationTable:
    ranks: int
    sizes: List[int]                                  # payload bytes, ascending
    times: Dict[str, List[Optional[float]]]           # algo -> us per size (None: not measured)
    source: str = ""
    cap_bytes: Optional[int] = None                   # the custom buffers' capacity when the table was made
    _cache: Dict[int, str] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.ranks < 1:
            raise ValueError(f"calibration table: ranks must be >= 1, got {self.ranks}")
        if not self.sizes:
            raise ValueError("calibration table: no measured payload sizes")
        if list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"calibration table: sizes must be distinct and ascending, got {self.sizes}")
        for a, t in self.times.items():
            if a not in ALL_ALGOS:
                raise ValueError(f"calibration table: unknown algorithm {a!r} (known: {ALL_ALGOS})")
            if len(t) != len(self.sizes):
                raise ValueError(f"calibration table: {a} has {len(t)} times for {len(self.sizes)} sizes")
            bad = [v for v in t if v is not None and not (np.isfinite(v) and v > 0)]
            if bad:
                raise ValueError(f"calibration table: {a} has non-positive or non-finite times {bad}")
        if not any(v is not None for t in self.times.values() for v in t):
            raise ValueError("calibration table: no algorithm has a measured time")

    def time_us(self, algo: str, nbytes: int) -> Optional[float]:
        """The interpolated time of ``algo`` at ``nbytes`` (clamped to the measured range), None if unknown."""
        t = self.times.get(algo)
        if t is None:
            return None
        pts = [(s, v) for s, v in zip(self.sizes, t) if v is not None]
        if not pts:
            return None
        xs = np.array([p[0] for p in pts], np.float64)
        ys = np.array([p[1] for p in pts], np.float64)
        return float(np.interp(float(nbytes), xs, ys))

    def choose(self, nbytes: int, cap_bytes: Optional[int] = None, allowed: Sequence[str] = ALL_ALGOS) -> str:
        """The fastest allowed algorithm for a payload of ``nbytes``; ties go to NCCL, then one-shot.
        A custom algorithm needs ``nbytes <= cap_bytes`` and a measured time within the range it was measured
        in (a custom time extrapolated beyond its largest measured payload is not trusted)."""
        key = (int(nbytes), cap_bytes, tuple(allowed))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        best, best_t = None, None
        for a in ALL_ALGOS:
            if a not in allowed:
                continue
            if a != "nccl":
                if cap_bytes is not None and nbytes > cap_bytes:
                    continue
                measured = [s for s, v in zip(self.sizes, self.times.get(a, [])) if v is not None]
                if not measured or nbytes > measured[-1]:
                    continue
            t = self.time_us(a, nbytes)
            if t is not None and (best_t is None or t < best_t):
                best, best_t = a, t
        if best is None:
            best = "nccl"
        self._cache[key] = best
        return best

    def crossovers(self) -> List[dict]:
        """Where the choice changes over the measured sizes: [{bytes, algo}] (the first entry: the smallest)."""
        out: List[dict] = []
        for s in self.sizes:
            a = self.choose(s)
            if not out or out[-1]["algo"] != a:
                out.append({"bytes": int(s), "algo": a})
        return out

    def to_json(self) -> dict:
        rows = []
        for i, s in enumerate(self.sizes):
            r = {"bytes": int(s)}
            for a, t in self.times.items():
                if t[i] is not None:
                    r[f"{a}_graph_us"] = float(t[i])
            rows.append(r)
        return {"ranks": self.ranks, "rows": rows, "source": self.source, "cap_bytes": self.cap_bytes}


def table_from_json(obj: dict, source: str = "") -> CalibrationTable:
    """A table from ``bench/allreduce.py --json`` output (or ``CalibrationTable.to_json``)."""
    if not isinstance(obj, dict) or "rows" not in obj or "ranks" not in obj:
        raise ValueError(f"calibration {source or 'table'}: expected a JSON object with 'ranks' and 'rows'")
    rows = sorted(obj["rows"], key=lambda r: r["bytes"])
    sizes = [int(r["bytes"]) for r in rows]
    times: Dict[str, List[Optional[float]]] = {}
    for a in ALL_ALGOS:
        col = [r.get(f"{a}_graph_us") for r in rows]
        if a == "nccl" and all(v is None for v in col):
            col = [r.get("graph_us") for r in rows]          # an NCCL-only file
        if any(v is not None for v in col):
            times[a] = [None if v is None else float(v) for v in col]
    return CalibrationTable(int(obj["ranks"]), sizes, times, source=source or str(obj.get("source", "")),
                            cap_bytes=obj.get("cap_bytes"))


def load_table(path: str) -> CalibrationTable:
    with open(path) as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"calibration file {path}: not JSON ({e})") from None
    return table_from_json(obj, source=path)
