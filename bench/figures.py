"""The "figures of record" tables of docs/, generated from the one results file kept per benchmark.

    python -m bench.figures            # print every table
    python -m bench.figures --write    # rewrite the marked blocks in docs/ (after a new results file lands)

Each document holds its table between two markers:

    <!-- figures:NAME -->
    ...generated...
    <!-- /figures:NAME -->

so a new benchmark run changes one file in bench/results/ and one command regenerates the docs. A CPU
test (tests/test_docs.py) fails when a table in docs/ differs from what this script makes of the file.
numpy-free: the results files are JSON.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
from collections import OrderedDict

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _f(x: float, nd: int = 1) -> str:
    return f"{x:.{nd}f}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def step_table() -> list[str]:
    """docs/ENGINE.md: the rank-shape step (bench/step.py) at every streams x rows shape."""
    d = _load("step_h200.json")
    a = d["assumptions"]
    rows = []
    for r in d["results"]:
        pdl = r.get("step_pdl_ms") or r["step_ms"]
        rows.append([str(r["streams"]), str(r["rows"]), _f(r["step_ms"], 2), f"**{_f(pdl, 2)}**",
                     _f(r["floor_ms"], 2), _f(pdl / r["floor_ms"], 2), _f(r["host_pct"]),
                     str(r["allreduces_per_step"]), str(round(r["pro6000_tok_s"]))])
    return [f"`bench/results/step_h200.json`: {a['device']}, read ceiling {a['read_ceiling_GBps']:.0f} GB/s in the "
            f"same run, TP = {a['tp']} rank 0, {a['layers']} layers, {a['ctx']} context, routing {a['routing'].split(':')[0]}; "
            f"RTX PRO 6000 projection at {a['pro6000_read_GBps']:.0f} GB/s, {a['allreduce_us_per_call']:.0f} us per "
            f"collective, tau = {a['tau']}.", ""] + _table(
        ["streams", "rows", "plain graph ms", "PDL graph ms (engine)", "byte floor ms", "x floor (PDL)", "host %",
         "all-reduces", "PRO 6000 tok/s"], rows)


def tree_table() -> list[str]:
    """docs/DDTREE.md: top-K, builder, walk + commit of the engine's configuration (bench/tree.py: rows named
    "engine"; files written before the top-K kinds became template parameters name it "scan-rank-cache-regs")."""
    d = _load("tree_h200.json")
    rows = []
    names = {r["variant"] for r in d["rows"]}
    name = "engine" if "engine" in names else "scan-rank-cache-regs"
    for r in d["rows"]:
        if r["variant"] != name:
            continue
        rows.append([str(r["streams"]), str(r["budget"]), r["dtype"], _f(r["topk_us"]), _f(r["topk_stage1_us"]),
                     _f(r["topk_merge_us"]), _f(r["build_us"]), _f(r["walk_commit_us"]), _f(r["total_us"]),
                     f"**{_f(r['total_pdl_us'])}**", f"{100 * r['topk_read_frac']:.0f}%",
                     "yes" if r["matches_verified"] else "NO"])
    return [f"`bench/results/tree_h200.json`: {d['device']}, the engine's configuration (`{name}`), read ceiling "
            f"{d['read_ceiling_gbs']:.0f} GB/s in the same run, us per step (CUDA-graph replay).", ""] + _table(
        ["streams", "budget", "logits", "top-K", "stage 1", "merge", "build", "walk+commit", "total", "total, PDL",
         "top-K % read ceiling", "equal to reference"], rows)


def moe_table() -> list[str]:
    """docs/MOE.md: one routed-expert MoE layer (bench/moe.py)."""
    d = _load("moe_h200.json")
    rows = []
    for r in d["rows"]:
        ring = r["variants_us"].get("ring")
        rows.append([str(r["I"]), str(r["T"]), r["routing"], str(r["experts"]), _f(r["bytes"] / 1e6),
                     f"**{_f(r['us'])}**", f"{100 * r['frac_read_ceiling']:.0f}%",
                     _f(ring) if ring is not None else "-"])
    return [f"`bench/results/moe_h200.json`: {d['device']}, read ceiling {d['read_ceiling_gbs']:.0f} GB/s in the same "
            f"run; one MoE layer (routing, gate/up, down, combine), us; 'register ring' = the T <= 2 GEMMs forced "
            f"at the same shape.", ""] + _table(
        ["I", "T", "routing", "experts", "MB read", "us", "% read ceiling", "register ring us"], rows)


def attention_table() -> list[str]:
    """docs/ATTENTION.md: MLA decode/tree attention and the drafter attention (bench/attention.py)."""
    d = _load("attention_h200.json")
    rows = [[str(r["streams"]), str(r["rows"]), str(r["ctx"]), f"**{_f(r['us'])}**", _f(r["floor_us"], 2),
             _f(r["ratio"]), r["config_key"], str(r["splits"]), _f(r["tree_over_chain"], 2)] for r in d["mla"]]
    drows = [[str(r["streams"]), str(r["ctx"]), f"**{_f(r['us'])}**", _f(r["floor_us"], 2),
              _f(r["us"] / r["floor_us"])] for r in d["drafter"]]
    return ([f"`bench/results/attention_h200.json`: {d['device']}, read ceiling {d['read_gbps']:.0f} GB/s and "
             f"mma rate {d['mma_tflops']:.0f} TFLOP/s in the same run, {d['heads']} heads per rank, us per call; "
             f"floor = bytes / read ceiling.", "", "MLA (`mla_attention`, tree mask):", ""]
            + _table(["streams", "rows", "context", "us", "floor us", "x floor", "tile", "splits", "tree / chain"], rows)
            + ["", "Drafter attention (`drafter_attention`):", ""]
            + _table(["streams", "context", "us", "floor us", "x floor"], drows))


def kernels_table() -> list[str]:
    """docs/KERNELS.md: every layer kernel at the engine's shapes (bench/kernels.py), us and % of the ceiling."""
    d = _load("kernels_h200.json")
    by = OrderedDict()
    ts = []
    for r in d["results"]:
        m = re.match(r"T=(\d+)", r["shape"])
        t = int(m.group(1)) if m else 0
        if t not in ts:
            ts.append(t)
        name = r["kernel"].replace(" [pdl]", "")
        rest = r["shape"][m.end():].strip() if m else r["shape"]
        by.setdefault((name, rest), {})[t] = r
    ts.sort()
    rows = []
    for (name, rest), cells in by.items():
        row = [name, rest]
        for t in ts:
            r = cells.get(t)
            row.append(f"{_f(r['us'])} ({100 * r['frac']:.0f}%)" if r else "-")
        rows.append(row)
    return [f"`bench/results/kernels_h200.json`: {d['device']}, read ceiling {d['read_ceiling_gbps']:.0f} GB/s, "
            f"mma rate {d['mma_bf16_tflops']:.0f} TFLOP/s in the same run, PDL launches, us per call (CUDA-graph "
            f"replay) and in brackets the fraction of the ceiling that bounds the kernel.", ""] + _table(
        ["kernel", "shape"] + [f"T = {t}" for t in ts], rows)


TABLES = {"step": ("docs/ENGINE.md", step_table), "tree": ("docs/DDTREE.md", tree_table),
          "moe": ("docs/MOE.md", moe_table), "attention": ("docs/ATTENTION.md", attention_table),
          "kernels": ("docs/KERNELS.md", kernels_table)}


def block(name: str) -> str:
    return "\n".join([f"<!-- figures:{name} -->"] + TABLES[name][1]() + [f"<!-- /figures:{name} -->"])


def doc_block(text: str, name: str) -> str | None:
    m = re.search(rf"<!-- figures:{name} -->.*?<!-- /figures:{name} -->", text, re.S)
    return m.group(0) if m else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--write", action="store_true", help="rewrite the marked blocks in docs/ in place")
    args = ap.parse_args(argv)
    for name, (doc, _) in TABLES.items():
        new = block(name)
        if not args.write:
            print(f"## {name} ({doc})\n\n{new}\n")
            continue
        p = ROOT / doc
        text = p.read_text()
        old = doc_block(text, name)
        if old is None:
            raise SystemExit(f"{doc}: no '<!-- figures:{name} -->' block to rewrite")
        p.write_text(text.replace(old, new))
        print(f"{doc}: figures:{name} {'unchanged' if old == new else 'rewritten'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
