"""The short summary that bench/run_gpu.sh prints last: one line per part (exit status, seconds, its last
result line) and the figures of record found in the run's results JSON, each with the ceiling it was
measured against; then the copies that replace bench/results' figures of record with this run's files.

    python bench/gpu_summary.py LOGDIR [--records bench/results]

Reads ``LOGDIR/parts.tsv`` (name, rc, seconds, line; written by run_gpu.sh) and the JSON files it finds
there: ``step_*.json`` (bench/step.py), ``longctx_*.json`` (bench/longctx.py), ``prefill_*.json``
(bench/prefill.py). Host only; a missing or unreadable file is named in the output, never fatal.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Dict, List, Optional


def read_parts(path: str) -> List[Dict[str, str]]:
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            name, rc, secs, text = (line.split("\t", 3) + ["", "", ""])[:4]
            rows.append(dict(name=name, rc=rc, seconds=secs, line=text))
    return rows


def _load(log: str, prefix: str):
    """(path, data) of the one ``prefix_*.json`` in log, (None, None) if absent, (path, error text) if bad."""
    paths = sorted(glob.glob(os.path.join(log, prefix + "_*.json")))
    if not paths:
        return None, None
    try:
        with open(paths[0]) as f:
            return paths[0], json.load(f)
    except (OSError, ValueError) as e:
        return paths[0], f"unreadable: {e}"


def step_lines(d: dict) -> List[str]:
    """Concurrency 1 and 10 at 8 rows (every shape is in the step's own table and JSON)."""
    a = d["assumptions"]
    out = []
    for r in d["results"]:
        if r["rows"] != 8 or r["streams"] not in (1, 10):
            continue
        eng = r["step_pdl_ms"] if r.get("step_pdl_ms") is not None else r["step_ms"]
        out.append(f"step {r['streams']} x {r['rows']} @ {r['ctx']}: {eng:.2f} ms (floor {r['floor_ms']:.2f}, "
                   f"x{eng / r['floor_ms']:.2f}; read ceiling {a['read_ceiling_GBps']:.0f} GB/s) -> RTX PRO 6000 "
                   f"{r['pro6000_step_ms']:.1f} ms, {r['pro6000_tok_s']:.0f} tok/s (tau {a['tau']}, "
                   f"{a['allreduce_us_per_call']} us + {a['allreduce_bus_GBps']} GB/s per all-reduce, "
                   f"{a['pro6000_read_GBps']:.0f} GB/s)")
    return out


def longctx_lines(d: dict) -> List[str]:
    out = []
    for r in d["results"]:
        s = r["attention_share"]
        m = "-" if s.get("measured_share") is None else f"{100 * s['measured_share']:.0f}%"
        mo = "-" if s.get("model_share") is None else f"{100 * s['model_share']:.0f}%"
        out.append(f"long ctx {r['streams']} x {r['rows']} @ {r['ctx']}: {s['step_ms']:.2f} ms (floor "
                   f"{r['floor_ms']:.2f}, x{s['step_ms'] / r['floor_ms']:.2f}); attention {m} measured, {mo} model, "
                   f"{100 * s['bytes_share']:.0f}% of the floor's bytes; PRO 6000 {r['pro6000_tok_s']:.0f} tok/s"
                   + ("" if r.get("pro6000_fits", True) else " (its cache does not fit a 96 GB rank)"))
    for run in d.get("runs", []):
        if run.get("error"):
            out.append(f"long ctx {run['ctx']} streams {run['streams']}: {run['error']}")
    return out


def prefill_lines(d: dict) -> List[str]:
    a = d["assumptions"]
    out = []
    for P, r in sorted(d.get("best", {}).items(), key=lambda kv: int(kv[0])):
        out.append(f"prefill {P} tokens: TTFT {r['ttft_ms']:.0f} ms at chunk {r['chunk']} ({r['tok_s']:.0f} tok/s; "
                   f"floor {r['floor_ms']:.0f} ms, x{r['ratio_to_floor']:.2f}; read ceiling "
                   f"{a['read_ceiling_GBps']:.0f} GB/s, mma.sync {a['mma_bf16_TFLOPs']:.0f} TFLOP/s)")
    bad = [r for r in d["results"] if "ttft_ms" not in r]
    if bad:
        out.append(f"prefill: {len(bad)} configurations not measured (first: chunk {bad[0]['chunk']}, "
                   f"{bad[0]['length']} tokens: {bad[0].get('skipped') or bad[0].get('error')})")
    return out


FIGURES = (("step", step_lines), ("longctx", longctx_lines), ("prefill", prefill_lines))


def summarize(log: str, records: Optional[str] = None) -> str:
    lines = [f"summary of {log}", "| part | rc | s | last result line |", "|---|---|---|---|"]
    for p in read_parts(os.path.join(log, "parts.tsv")):
        lines.append(f"| {p['name']} | {p['rc']} | {p['seconds']} | {p['line']} |")
    lines.append("")
    for prefix, fn in FIGURES:
        path, d = _load(log, prefix)
        if path is None:
            continue
        if isinstance(d, str):
            lines.append(f"{os.path.basename(path)}: {d}")
            continue
        try:
            lines += fn(d)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            lines.append(f"{os.path.basename(path)}: not summarized ({type(e).__name__}: {e})")
    if records:
        made = sorted(os.path.basename(p) for p in glob.glob(os.path.join(log, "*.json")))
        if made:
            lines.append("")
            lines.append(f"figures of record of this run (each replaces the file of the same name in {records}/): "
                         + " ".join(made))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log")
    ap.add_argument("--records", default="bench/results", help="where the figures of record live ('' : no copy line)")
    a = ap.parse_args(argv)
    if not os.path.isdir(a.log):
        raise SystemExit(f"gpu_summary: {a.log} is not a directory")
    print(summarize(a.log, a.records or None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
