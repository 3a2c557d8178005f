"""The rank-shape decode step at long context: bench/step.py at 32K (1, 4 and 10 streams x 8 rows) and at 128K
(1 x 8), each with its byte floor and attention's share of the step, by the cost model and measured.

    python -m bench.longctx [--groups 32768:1,4,10 131072:1] [--rows 8] [--json PATH]

Each context group runs ``python -m bench.step --ctx C --streams ... --rows R --stages 0 --pdl 1 --loo 1`` in
its own process (its own engine, KV pool sized for that context: the GPU memory is free again after each) and
this script reads its JSON. Before a group starts, its memory plan is printed (``memory_plan``: latent KV
pool, drafter context ring, attention split workspace, weights) and the group is refused, naming the numbers,
if it cannot fit the GPU; the plan also says whether the same streams fit one RTX PRO 6000 (96 GB).

Attention's share of the step (``attention_share``):
* bytes: the latent cache's share of the step's byte floor (bench/step.py's ``step_bytes``);
* model: 61 x the attention planner's modelled call time (``kernels.attention.mla_cost_us`` for the plan the
  engine makes on this device) over the measured step;
* measured: 61 x the attention stage's marginal cost per layer (leave-one-out: the verify phase timed with the
  attention left out of every layer, ``bench.step.leave_one_out``) over the measured step.
The step is the PDL graph where measured (what the engine runs), else the plain one.
Prints a table, writes one JSON with every group's results, asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PAGE = 64
LATENT_ROW_BYTES = 576 * 2
PRO6000_BYTES = 96e9             # RTX PRO 6000 Blackwell: 96 GB GDDR7 (datasheet)
H200_ATTRS = (132, 232448, 233472)     # (SMs, shared memory per block opt-in, per SM) as CUDA reports them
STEP_RESERVE = 6e9               # step buffers, GEMM / MoE workspaces, CUDA context and graphs (measured at 4K:
                                 # 85 GB used = 76.2 GB target + 0.9 GB drafter + 3 GB KV + ~5 GB the rest)


def parse_groups(specs: Sequence[str]) -> List[Tuple[int, Tuple[int, ...]]]:
    """'32768:1,4,10' -> (32768, (1, 4, 10)); a clear SystemExit naming a bad spec."""
    out = []
    for s in specs:
        try:
            c, streams = s.split(":")
            ctx, ss = int(c), tuple(int(x) for x in streams.split(","))
        except ValueError:
            raise SystemExit(f"--groups: {s!r} is not CONTEXT:STREAMS[,STREAMS...] (e.g. 32768:1,4,10)") from None
        if ctx < 1 or not ss or min(ss) < 1:
            raise SystemExit(f"--groups: {s!r}: context and stream counts must be positive")
        out.append((ctx, ss))
    return out


def drafter_shard_bytes(dcfg, tp: int = 8) -> int:
    """Bytes of one rank's drafter weights (GpuDrafterWeights.check's shapes, bf16; norms left out)."""
    H, hd, L = dcfg.hidden_size, dcfg.head_dim, dcfg.num_hidden_layers
    hq, hkv, F = dcfg.num_attention_heads // tp, max(1, dcfg.num_key_value_heads // tp), dcfg.intermediate_size // tp
    fc = H * dcfg.num_context_features * H // tp
    # qkv, o_proj, gate_up, down, and the context K/V projections (ctx_kv, a copy of k | v)
    per_layer = (hq + 2 * hkv) * hd * H + H * hq * hd + 2 * F * H + H * F + 2 * hkv * hd * H
    return 2 * (fc + L * per_layer)


def memory_plan(tcfg, dcfg, ctx: int, streams: Sequence[int], rows: int, weights_bytes: float,
                attrs: Tuple[int, int, int] = H200_ATTRS, tp: int = 8) -> Dict[str, float]:
    """Device bytes of one bench/step.py run at this context (host only): the latent KV pool exactly as
    bench/step.py sizes it (max streams x (ctx + rows + 64) rounded up to pages, x layers x 1152 B), the
    drafter's context ring (window = ctx), the largest attention split workspace over the shapes, the weights
    and a fixed reserve for everything else."""
    from ddtree_cupy.kernels.attention import MlaWorkspace, mla_partial_bf16, plan_mla_for, resolve_policy
    S = max(streams)
    per_stream = ctx + rows + 64
    tokens = S * (-(-per_stream // PAGE)) * PAGE
    kv = tokens * tcfg.num_hidden_layers * LATENT_ROW_BYTES
    hkv = max(1, dcfg.num_key_value_heads // tp)
    drafter_ctx = S * ctx * hkv * dcfg.head_dim * 2 * 2 * dcfg.num_hidden_layers
    heads = tcfg.num_attention_heads // tp
    pb = mla_partial_bf16()
    policy = resolve_policy("auto", "sm_90" if attrs == H200_ATTRS else "sm_120")
    ws = 0
    for s in streams:
        _, k = plan_mla_for(s, rows, heads, per_stream, policy, *attrs, pb)
        ws = max(ws, MlaWorkspace.nbytes_for(k, s * rows, heads, pb) if k > 1 else 0)
    total = kv + drafter_ctx + ws + weights_bytes + STEP_RESERVE
    return dict(ctx=ctx, streams=S, kv_tokens=tokens, kv_bytes=float(kv), drafter_context_bytes=float(drafter_ctx),
                attention_workspace_bytes=float(ws), weights_bytes=float(weights_bytes), reserve_bytes=STEP_RESERVE,
                total_bytes=float(total), kv_per_token_bytes=float(tcfg.num_hidden_layers * LATENT_ROW_BYTES),
                fits_pro6000=bool(total <= PRO6000_BYTES))


def attention_model_us(S: int, R: int, heads: int, kv_len: int, attrs: Tuple[int, int, int], arch: str) -> float:
    """The attention planner's modelled time of one layer's call for the plan the engine makes (host only)."""
    from ddtree_cupy.kernels import attention as A
    pb = A.mla_partial_bf16()
    cfg, k = A.plan_mla_for(S, R, heads, kv_len, A.resolve_policy("auto", arch), *attrs, pb)
    key = next(n for n, c in A.MLA_CONFIGS.items() if c == cfg)
    return A.mla_cost_us(key, k, S, R, heads, kv_len, attrs[0], A._blocks_per_sm(cfg, attrs[2]), pb)


def attention_share(rec: dict, layers: int, model_us: Optional[float]) -> Dict[str, Optional[float]]:
    """Attention's share of one bench/step.py result: of the byte floor, by the model, by leave-one-out."""
    step_ms = rec["step_pdl_ms"] if rec.get("step_pdl_ms") is not None else rec["step_ms"]
    b = rec["bytes"]
    out = dict(step_ms=step_ms, bytes_share=b["latent_cache"] / b["total"],
               model_us_per_layer=model_us,
               model_share=None if model_us is None else layers * model_us * 1e-3 / step_ms,
               measured_us_per_layer=None, measured_share=None)
    loo = rec.get("leave_one_out")
    if loo and "attention" in loo.get("marginal_us_per_layer", {}):
        us = loo["marginal_us_per_layer"]["attention"]
        out.update(measured_us_per_layer=us, measured_share=layers * us * 1e-3 / step_ms)
    return out


def step_command(ctx: int, streams: Sequence[int], rows: int, reps: int, layers: int, loo: int, json_path: str,
                 extra: Sequence[str] = ()) -> List[str]:
    return ([sys.executable, "-m", "bench.step", "--ctx", str(ctx), "--streams", *map(str, streams),
             "--rows", str(rows), "--stages", "0", "--pdl", "1", "--loo", str(loo), "--reps", str(reps),
             "--layers", str(layers), "--json", json_path] + list(extra))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", nargs="+", default=["32768:1,4,10", "131072:1"],
                    help="CONTEXT:STREAMS,... one bench/step.py process each")
    ap.add_argument("--rows", type=int, default=8, help="verify rows per stream (budget + 1)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--loo", type=int, default=1,
                    help="1: leave-one-out of every layer stage (attention's measured share)")
    ap.add_argument("--step-arg", action="append", default=[], help="passed on to bench/step.py (repeatable)")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "longctx_h200.json"))
    a = ap.parse_args(argv)
    groups = parse_groups(a.groups)
    if a.rows < 2:
        raise SystemExit(f"--rows: a DDTree step verifies at least 2 rows (budget >= 1), got {a.rows}")

    import cupy
    from bench.step import load_configs
    from ddtree_cupy.models.weights import plan_bytes
    t_start = time.perf_counter()
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode()
    attrs = (dev.attributes["MultiProcessorCount"], dev.attributes["MaxSharedMemoryPerBlockOptin"],
             dev.attributes["MaxSharedMemoryPerMultiprocessor"])
    arch = f"sm_{dev.compute_capability}"
    total_mem = cupy.cuda.runtime.memGetInfo()[1]
    results, runs = [], []
    for ctx, streams in groups:
        tcfg, dcfg = load_configs(a.layers, ctx)
        weights = plan_bytes(tcfg, 8)["total"] + drafter_shard_bytes(dcfg, 8)
        plan = memory_plan(tcfg, dcfg, ctx, streams, a.rows, weights, attrs)
        print(f"\n== context {ctx}, streams {list(streams)} x {a.rows} rows: latent KV "
              f"{plan['kv_bytes'] / 1e9:.1f} GB ({plan['kv_tokens']} tokens x {plan['kv_per_token_bytes']:.0f} B), "
              f"drafter context {plan['drafter_context_bytes'] / 1e9:.2f} GB, attention workspace "
              f"{plan['attention_workspace_bytes'] / 1e6:.0f} MB, weights {plan['weights_bytes'] / 1e9:.1f} GB: "
              f"~{plan['total_bytes'] / 1e9:.0f} GB of {total_mem / 1e9:.0f} GB here; one RTX PRO 6000 (96 GB): "
              f"{'fits' if plan['fits_pro6000'] else 'does NOT fit'}", flush=True)
        run = dict(ctx=ctx, streams=list(streams), memory=plan)
        runs.append(run)
        if plan["total_bytes"] > total_mem:
            run["error"] = (f"refused: needs ~{plan['total_bytes'] / 1e9:.0f} GB, the GPU has "
                            f"{total_mem / 1e9:.0f} GB")
            print(run["error"], flush=True)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"step_ctx{ctx}.json")
            cmd = step_command(ctx, streams, a.rows, a.reps, a.layers, a.loo, path, a.step_arg)
            print("$ " + " ".join(cmd[1:]), flush=True)
            t0 = time.perf_counter()
            rc = subprocess.call(cmd, cwd=ROOT)
            run.update(rc=rc, wall_s=time.perf_counter() - t0)
            if rc != 0 or not os.path.exists(path):
                run["error"] = f"bench.step exited with {rc}"
                print(run["error"], flush=True)
                continue
            with open(path) as f:
                d = json.load(f)
        run["assumptions"] = d["assumptions"]
        heads = tcfg.num_attention_heads // 8
        for rec in d["results"]:
            kv_len = ctx + a.rows + 64          # what bench/step.py's engine plans for (max_context)
            model_us = attention_model_us(rec["streams"], rec["rows"], heads, kv_len, attrs, arch)
            rec["attention_share"] = attention_share(rec, tcfg.num_hidden_layers, model_us)
            # the projection assumes the streams' cache fits one PRO 6000 rank: say where it does not
            one = memory_plan(tcfg, dcfg, ctx, (rec["streams"],), a.rows, weights, attrs)
            rec["pro6000_fits"] = one["fits_pro6000"]
            results.append(rec)
    print(f"\n{name}: the step at long context (PDL graph where measured; floor = bench/step.py's byte floor over the "
          "read ceiling of the same run; attention share of the step: bytes of the floor / planner model / "
          "leave-one-out)")
    print("| ctx | streams | rows | step ms | floor ms | x floor | attention bytes % | model % | measured % "
          "| attention us/layer (model / measured) | PRO 6000 tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    pct = lambda v: "-" if v is None else f"{100 * v:.0f}"      # noqa: E731
    num = lambda v: "-" if v is None else f"{v:.1f}"            # noqa: E731
    for r in results:
        s = r["attention_share"]
        print(f"| {r['ctx']} | {r['streams']} | {r['rows']} | {s['step_ms']:.2f} | {r['floor_ms']:.2f} | "
              f"{s['step_ms'] / r['floor_ms']:.2f} | {pct(s['bytes_share'])} | {pct(s['model_share'])} | "
              f"{pct(s['measured_share'])} | {num(s['model_us_per_layer'])} / {num(s['measured_us_per_layer'])} | "
              f"{r['pro6000_tok_s']:.0f}{'' if r['pro6000_fits'] else ' (cache does not fit 96 GB)'} |")
    for run in runs:
        if run.get("error"):
            print(f"context {run['ctx']} streams {run['streams']}: {run['error']}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"device": name, "runs": runs, "results": results,
                       "runtime_s": time.perf_counter() - t_start}, f, indent=1)
        print(f"wrote {a.json} ({time.perf_counter() - t_start:.0f} s)")
    return 0 if all(not r.get("error") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
