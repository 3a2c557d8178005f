"""Time to first token of one prompt at rank shape: the engine's chunked prefill (``engine.step.Prefill``),
chunk size swept, against its own floor.

    python -m bench.prefill [--lengths 1024 8192 32768] [--chunks 256 512 1024 2048] [--json PATH]

Rank 0 of TP = 8, 61 layers, random rank-shaped weights and the drafter shard (as bench/step.py). For every
chunk size C the engine is asked for exactly what ``GpuEngine.generate`` does at admission: ``Prefill.run``
on one stream slot (causal chunks of C rows through the target, the chunk's features appended to the drafter
context, the first token from the prompt's last row), as a CUDA graph replayed per chunk. One warm-up prompt
of one chunk captures the graph first; every prompt length is then timed ``--reps`` times (host wall from the
call to the first token: what a user waits for, the host's per-chunk uploads included). tokens/s = P / TTFT.

Routing: ``uniform`` (default) makes the MoE read 8 distinct random experts per row and layer
(``bench.step.UniformRouting``); at C >= 256 rows that touches nearly all 384 experts of every layer, as a
real prompt does. (The random model's own router sends every row to the same ~8 experts.)

Floor (``prefill_floor``), per chunk of n real rows after p prompt tokens, max of two terms, summed over the
chunks: bytes = every dense weight of the rank once + the routed experts the chunk touches (expected unique
under uniform routing, x per-expert shard bytes) + the drafter's context-append weights + the latent cache
read (p + n rows x 61 layers x 1152 B) and written (n rows) + lm_head once for the last row, over the read
ceiling measured in this run; FLOPs = 2 x n x (dense + 8 experts + append parameters per row) + the
absorbed attention (per head 2 x (576 + 512) per (row, key), causal: n p + n (n + 1) / 2 keys) + one row of
lm_head, over the mma.sync bf16 rate measured in this run (``bench.ceilings.measure_mma_bf16_tflops``).
Activations and the padding rows of a partial chunk are not in the floor (the job does not need them).

Prints a table, writes JSON, asserts nothing. A configuration that raises is recorded with its error and the
sweep goes on; one whose estimated time would pass ``--budget-s`` is recorded as skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LATENT_ROW = 576             # latent cache row per token and layer (512 c_kv + 64 rope), bf16
QK_DIM, V_DIM = 576, 512     # absorbed MLA: scores over 576 dims, values over 512
MAX_CHUNK = 4096             # GpuEngine's prefill_chunk limit


def expected_unique_experts(E: int, k: int, rows: int) -> float:
    """Expected distinct experts among ``rows`` rows that each pick k distinct of E uniformly at random."""
    if rows <= 0:
        return 0.0
    return E * (1.0 - (1.0 - k / E) ** rows)


def chunk_plan(P: int, C: int) -> List[Tuple[int, int]]:
    """(prefix tokens before the chunk, real rows in it) for a P-token prompt in chunks of C rows."""
    if P < 1 or C < 1:
        raise ValueError(f"chunk_plan: prompt length and chunk must be positive, got P={P}, C={C}")
    return [(c0, min(C, P - c0)) for c0 in range(0, P, C)]


@dataclass(frozen=True)
class RankCosts:
    """One rank's per-chunk constants of the prefill floor (host only: from the config's weight plan)."""
    layers: int
    moe_layers: int
    heads: int                   # attention heads of this rank
    E: int
    k: int
    dense_bytes: int             # every non-expert weight of the layers (attention, dense MLP, router, shared, norms)
    dense_params: int            # the parameters a row multiplies by (FLOPs / 2 per row)
    expert_bytes: float          # one expert's shard, one layer (INT4 + scales)
    expert_params: int           # one expert's shard parameters (gate | up | down)
    lm_head_bytes: int
    lm_head_params: int
    append_bytes: int            # the drafter's context append (fc + the K/V projections of its layers)
    append_params: int


def rank_costs(tcfg, tp: int = 8, append_bytes: int = 0, append_params: int = 0) -> RankCosts:
    import numpy as np
    from ddtree_cupy.models.weights import local_dims, plan_bytes, weight_plan
    d = local_dims(tcfg, tp)
    plan, pb = weight_plan(tcfg, tp), plan_bytes(tcfg, tp)
    moe_layers = sum(1 for i in range(tcfg.num_hidden_layers) if tcfg.is_moe_layer(i))
    mats = ("w_qkv_a", "w_q_b", "w_uk_t", "w_uv", "w_o", "w_gate_up", "w_down", "w_router", "w_shared_gate_up",
            "w_shared_down")
    dense_params = sum(int(np.prod(s)) for n, (s, _) in plan.items() if n.startswith("layers.")
                       and n.split(".")[-1] in mats)
    E = d["E"]
    return RankCosts(
        layers=tcfg.num_hidden_layers, moe_layers=moe_layers, heads=d["nh"], E=E, k=tcfg.num_experts_per_tok,
        dense_bytes=pb["attention"] + pb["mlp"] + pb["router"] + pb["norms"],
        dense_params=dense_params,
        expert_bytes=pb["experts"] / max(1, moe_layers * E) if E else 0.0,
        expert_params=3 * d["H"] * d["I"],
        lm_head_bytes=d["V"] * d["H"] * 2, lm_head_params=d["V"] * d["H"],
        append_bytes=int(append_bytes), append_params=int(append_params))


def chunk_cost(c: RankCosts, prefix: int, n: int, last: bool) -> Dict[str, float]:
    """Bytes and FLOPs one chunk of n real rows after ``prefix`` tokens must move / compute (see module doc)."""
    uniq = expected_unique_experts(c.E, c.k, n) if c.moe_layers else 0.0
    lat = c.layers * LATENT_ROW * 2
    bytes_ = {
        "dense_weights": float(c.dense_bytes),
        "routed_experts": c.moe_layers * uniq * c.expert_bytes,
        "drafter_append": float(c.append_bytes),
        "latent_cache": float(lat * (prefix + n) + lat * n),      # read prefix + own rows, write own rows
        "lm_head": float(c.lm_head_bytes if last else 0),
    }
    keys = n * prefix + n * (n + 1) / 2          # causal (row, key) pairs
    flops = {
        "dense": 2.0 * n * c.dense_params,
        "experts": 2.0 * n * c.k * c.moe_layers * c.expert_params,
        "drafter_append": 2.0 * n * c.append_params,
        "attention": 2.0 * (QK_DIM + V_DIM) * c.heads * c.layers * keys,
        "lm_head": 2.0 * c.lm_head_params if last else 0.0,
    }
    return dict(bytes=sum(bytes_.values()), flops=sum(flops.values()), bytes_parts=bytes_, flops_parts=flops,
                unique_experts=uniq)


def prefill_floor(c: RankCosts, P: int, C: int, bw: float, flops_rate: float) -> Dict[str, object]:
    """Floor of a P-token prefill in chunks of C: per chunk max(bytes / bw, FLOPs / rate), summed. ``bw`` in
    bytes/s, ``flops_rate`` in FLOP/s (both measured in the same run)."""
    if bw <= 0 or flops_rate <= 0:
        raise ValueError(f"prefill_floor: ceilings must be positive (bw={bw}, flops_rate={flops_rate})")
    plan = chunk_plan(P, C)
    tot_b = tot_f = floor = bytes_s = flops_s = 0.0
    parts_b: Dict[str, float] = {}
    parts_f: Dict[str, float] = {}
    bound = {"bytes": 0, "flops": 0}
    for j, (p, n) in enumerate(plan):
        cc = chunk_cost(c, p, n, j == len(plan) - 1)
        tb, tf = cc["bytes"] / bw, cc["flops"] / flops_rate
        floor += max(tb, tf)
        bound["bytes" if tb >= tf else "flops"] += 1
        bytes_s += tb
        flops_s += tf
        tot_b += cc["bytes"]
        tot_f += cc["flops"]
        for k, v in cc["bytes_parts"].items():
            parts_b[k] = parts_b.get(k, 0.0) + v
        for k, v in cc["flops_parts"].items():
            parts_f[k] = parts_f.get(k, 0.0) + v
    return dict(floor_s=floor, bytes=tot_b, flops=tot_f, bytes_s=bytes_s, flops_s=flops_s, chunks=len(plan),
                chunks_bound=bound, bytes_parts=parts_b, flops_parts=parts_f,
                attention_flops_share=parts_f["attention"] / tot_f if tot_f else 0.0)


def check_args(lengths: Sequence[int], chunks: Sequence[int], reps: int) -> None:
    bad = [L for L in lengths if L < 1]
    if bad:
        raise SystemExit(f"--lengths: prompt lengths must be >= 1, got {bad}")
    bad = [C for C in chunks if not 1 <= C <= MAX_CHUNK]
    if bad:
        raise SystemExit(f"--chunks: chunk sizes must be in [1, {MAX_CHUNK}] (GpuEngine's prefill_chunk), got {bad}")
    if reps < 1:
        raise SystemExit(f"--reps: must be >= 1, got {reps}")


def skip_reason(elapsed_s: float, budget_s: float, est_s) -> str:
    """'' to run a configuration, else why it is skipped (its estimated time would pass the budget)."""
    if est_s is not None and elapsed_s + est_s > budget_s:
        return f"skipped: estimated {est_s:.0f} s would pass the {budget_s:.0f} s budget at {elapsed_s:.0f} s"
    return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768], help="prompt tokens")
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 512, 1024, 2048], help="prefill chunk sizes")
    ap.add_argument("--reps", type=int, default=2, help="timed prefills per (chunk, length) after the warm-up")
    ap.add_argument("--layers", type=int, default=61, help="fewer layers for a quick harness check")
    ap.add_argument("--routing", choices=("uniform", "model"), default="uniform")
    ap.add_argument("--drafter", type=int, default=1, help="1: append features to the drafter context (ddtree)")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="skip configurations whose estimated time would pass this many seconds of the run")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "prefill_h200.json"))
    a = ap.parse_args(argv)
    check_args(a.lengths, a.chunks, a.reps)

    import cupy
    import numpy as np
    from bench.ceilings import measure_mma_bf16_tflops, measure_read_bandwidth
    from bench.step import RankComm, UniformRouting, load_configs
    from ddtree_cupy.engine.gpu_engine import GpuEngine
    from ddtree_cupy.engine.kv_pool import KVPool
    from ddtree_cupy.engine.step import Prefill
    from ddtree_cupy.reference.loop import Request

    t_start = time.perf_counter()
    dev = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    bw = measure_read_bandwidth(2 << 30) * 1e9
    mma = measure_mma_bf16_tflops() * 1e12
    P_max, C_max = max(a.lengths), max(a.chunks)
    tcfg, dcfg = load_configs(a.layers, P_max + C_max + 64)     # drafter window: the whole context, as the engine's
    uniform = UniformRouting(tcfg.n_routed_experts, tcfg.num_experts_per_tok) if a.routing == "uniform" else None
    if uniform is not None:
        uniform.__enter__()
    rows = 8
    per_stream = P_max + C_max + 64                              # prompt + a warm-up chunk's margin + one tree
    t0 = time.perf_counter()
    eng = GpuEngine(tcfg, None, dcfg, None, comm=RankComm(0, 8), max_streams=1, max_budget=rows - 1,
                    kv_tokens=-(-per_stream // 64) * 64, random_weights=1, prefill_chunk=C_max,
                    max_context=per_stream, buckets=(1,))
    build_s = time.perf_counter() - t0
    pool = KVPool(eng.num_pages, 64, 1, eng.max_pages_per_stream, rows)
    slot = pool.admit(0, P_max, 1)
    eng.kv.set_block_table(pool.block_table)
    dw = eng.drafter.w
    append_bytes = int(dw.fc.nbytes + dw.ctx_kv.nbytes) if a.drafter else 0
    append_params = int(dw.fc.size + dw.ctx_kv.size) if a.drafter else 0
    costs = rank_costs(tcfg, 8, append_bytes, append_params)
    free, total = cupy.cuda.runtime.memGetInfo()
    print(f"{name}: read ceiling {bw / 1e9:.0f} GB/s, mma.sync bf16 {mma / 1e12:.0f} TFLOP/s; rank 0 of TP 8, "
          f"{tcfg.num_hidden_layers} layers, built in {build_s:.0f} s; KV pool {eng.kv.nbytes() / 1e9:.2f} GB; GPU "
          f"memory used {(total - free) / 1e9:.0f} of {total / 1e9:.0f} GB", flush=True)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, tcfg.vocab_size, P_max).astype(np.int32)
    results: List[dict] = []
    ratio: Dict[int, float] = {}         # chunk -> measured TTFT / floor so far (the budget's estimate)
    runners: Dict[int, object] = {}
    warm: Dict[int, object] = {}         # chunk -> warm-up seconds, or the warm-up's error
    st = eng.stream

    def runner_for(C):                   # built and captured on first use (one chunk, eager then captured)
        if C not in warm:
            r = eng.prefill_runner if C == eng.prefill_runner.chunk else Prefill(eng.models, C, graphs=True)
            try:
                t0 = time.perf_counter()
                ids = prompt[:C].tolist()
                r.run(slot, ids, Request(ids), bool(a.drafter))
                warm[C], runners[C] = time.perf_counter() - t0, r
            except Exception as e:       # recorded; the other chunk sizes still run
                warm[C] = f"warm-up: {type(e).__name__}: {e}"
                st.synchronize()
        return runners.get(C)

    # shorter prompts first over every chunk size: when the budget runs short, the longest prompts go first
    for P in a.lengths:
        for C in a.chunks:
            fl = prefill_floor(costs, P, C, bw, mma)
            rec = dict(chunk=C, length=P, chunks=fl["chunks"], floor_ms=fl["floor_s"] * 1e3,
                       floor_bytes_ms=fl["bytes_s"] * 1e3, floor_flops_ms=fl["flops_s"] * 1e3,
                       floor_chunks_bound=fl["chunks_bound"], floor_bytes=fl["bytes"], floor_flops=fl["flops"],
                       floor_bytes_parts=fl["bytes_parts"], floor_flops_parts=fl["flops_parts"],
                       attention_flops_share=fl["attention_flops_share"])
            q = ratio.get(C) or (max(ratio.values()) if ratio else None)
            why = skip_reason(time.perf_counter() - t_start, a.budget_s,
                              None if q is None else a.reps * q * fl["floor_s"])
            runner = None if why else runner_for(C)
            if runner is None and not why:
                why = str(warm[C])
            if why:
                rec["skipped" if why.startswith("skipped") else "error"] = why
                results.append(rec)
                print(f"C={C:4d} P={P:6d}: {why}", flush=True)
                continue
            rec["warmup_capture_s"] = warm[C]
            ids = prompt[:P].tolist()
            req = Request(ids)
            try:
                times, tok = [], None
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    tok = runner.run(slot, ids, req, bool(a.drafter))
                    times.append(time.perf_counter() - t0)
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {e}"
                results.append(rec)
                print(f"C={C:4d} P={P:6d}: failed: {rec['error']}", flush=True)
                st.synchronize()
                continue
            ttft = float(np.median(times))
            ratio[C] = ttft / fl["floor_s"]
            rec.update(ttft_ms=ttft * 1e3, ttft_all_ms=[t * 1e3 for t in times], tok_s=P / ttft,
                       ms_per_chunk=ttft * 1e3 / fl["chunks"], ratio_to_floor=ttft / fl["floor_s"], first_token=tok)
            results.append(rec)
            print(f"C={C:4d} P={P:6d}: TTFT {ttft * 1e3:9.1f} ms ({P / ttft:7.0f} tok/s, {rec['ms_per_chunk']:.2f} ms "
                  f"per chunk) floor {fl['floor_s'] * 1e3:8.1f} ms (bytes {fl['bytes_s'] * 1e3:.1f}, FLOPs "
                  f"{fl['flops_s'] * 1e3:.1f}; attention {100 * fl['attention_flops_share']:.0f}% of FLOPs) "
                  f"x{ttft / fl['floor_s']:.2f}", flush=True)
    if uniform is not None:
        uniform.__exit__(None, None, None)
    assumptions = {
        "device": name, "read_ceiling_GBps": bw / 1e9, "mma_bf16_TFLOPs": mma / 1e12, "tp": 8, "rank": 0,
        "layers": tcfg.num_hidden_layers, "drafter_append": bool(a.drafter),
        "weights": "random rank-shaped (GpuTargetWeights.random / GpuDrafterWeights.random)",
        "routing": ("uniform: 8 distinct random experts per row and layer" if uniform is not None
                    else "model: the random model's router output"),
        "collectives": "no-op here (one rank without peers): the prefill's all-reduces are not in the time",
        "path": "engine.step.Prefill.run (the engine's admission prefill), CUDA graph per chunk, one stream",
        "ttft": "host wall from Prefill.run to the first token id, median of reps, after a warm-up capture",
        "floor": "per chunk max(bytes / read ceiling, FLOPs / mma.sync rate), summed over chunks; bytes = dense "
                 "weights + expected unique experts x shard + drafter append weights + latent cache read/write + "
                 "lm_head (last chunk); FLOPs = 2 x rows x (dense + 8 experts + append params) + absorbed "
                 "causal attention 2 x (576 + 512) x heads x layers x (row, key) pairs + one lm_head row",
    }
    print("\nassumptions: " + "; ".join(f"{k}={v}" for k, v in assumptions.items()))
    print("\n| prompt | chunk | TTFT ms | tok/s | floor ms (bytes / FLOPs) | x floor | attention % FLOPs |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "ttft_ms" in r:
            print(f"| {r['length']} | {r['chunk']} | {r['ttft_ms']:.1f} | {r['tok_s']:.0f} | {r['floor_ms']:.1f} "
                  f"({r['floor_bytes_ms']:.1f} / {r['floor_flops_ms']:.1f}) | {r['ratio_to_floor']:.2f} | "
                  f"{100 * r['attention_flops_share']:.0f} |")
        else:
            print(f"| {r['length']} | {r['chunk']} | {r.get('skipped') or r.get('error')} | | | | |")
    best = best_per_length(results)
    for P, r in sorted(best.items()):
        print(f"best for {P} tokens: chunk {r['chunk']}, TTFT {r['ttft_ms']:.1f} ms, {r['tok_s']:.0f} tok/s")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"assumptions": assumptions, "results": results,
                       "best": {str(k): v for k, v in best.items()},
                       "runtime_s": time.perf_counter() - t_start}, f, indent=1)
        print(f"wrote {a.json} ({time.perf_counter() - t_start:.0f} s)")
    return 0


def best_per_length(results: Sequence[dict]) -> Dict[int, dict]:
    """The measured configuration with the least TTFT per prompt length."""
    best: Dict[int, dict] = {}
    for r in results:
        if "ttft_ms" in r and (r["length"] not in best or r["ttft_ms"] < best[r["length"]]["ttft_ms"]):
            best[r["length"]] = r
    return best


if __name__ == "__main__":
    sys.exit(main())
