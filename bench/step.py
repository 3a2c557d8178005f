"""One decode step of one TP = 8 rank of Kimi K2.6 (61 layers, random rank-shaped weights, no checkpoint)
plus its DFlash drafter shard, through the GPU engine's captured step graph.

    python -m bench.step [--streams 1 4 10] [--rows 8 16 32] [--ctx 4096] [--json bench/results/step_h200.json]

For every (streams S, tree rows R = budget + 1) at a context of ``ctx`` tokens per stream (latent cache
and drafter context filled with random rows) it reports:

* step: one graph replay (CUDA events over back-to-back replays); wall: the host's whole step (control
  upload + launch + packed-output copy + sync); host: the time the host spends issuing a step;
* phases: draft / tree / verify / accept, each captured as its own graph and timed the same way;
* launches: kernel launches of the verify phase and of one MoE layer (counted through the kernel wrappers,
  ``engine.profile.count_launches``), per kernel name;
* one MoE layer (layer 1) as its own graph, and each of its stages (``GpuTarget.layer_stages``) as its own
  graph: us per layer and per stage. Caveat: a graph of one layer (stage) replayed back to back re-reads the
  same weights, so small ones come from L2; verify / layers is the honest per-layer figure;
* with ``--pdl 1``: the step graph re-captured with programmatic dependent launch (``GpuEngine(pdl=True)``'s
  capture; the main figures use pdl=False), timed the same way (step_pdl_ms), its logits and packed output
  compared bit for bit with the plain graph's, then captured again without;
* floor: the bytes the step must read (every weight of the rank once, the routed experts the routing
  actually touched -- counted per layer from the router's outputs on this step's rows -- the latent cache
  and drafter context, the logits) over the read bandwidth measured in this run; ratio = step / floor;
* routing (``--routing``): ``uniform`` (default) makes the MoE read 8 distinct uniformly random experts per
  row and layer (``UniformRouting``), the spread of real routing (~60 unique experts per layer at 8 rows);
  ``model`` keeps the random model's router output, which collapses to ~8 experts for all rows and so
  understates the expert bytes and the MoE time of a real step;
* projection to 8x RTX PRO 6000 (``project_pro6000``): the PDL step (what the engine's graphs run; else the
  plain one) x (read ceiling here / 1.79 TB/s) + collectives per step x a per-call latency + the step's
  all-reduce bytes x 2 x 7/8 (a ring at TP 8) / a bus bandwidth; the step's real collective count and payloads
  at TP = 8. tokens/s = tau x streams / step time. Every assumption is printed and stored with the results.

Collectives (``--comm none``, the default): this process is rank 0 of 8 with no peers (``RankComm``):
all-reduces are no-ops, all-gathers copy this rank's part into every slot. The step's kernels are exactly
those of a real rank; the collectives' cost enters only through the projection. ``--comm nccl`` under
``mpirun -np N`` (``LiveRankComm``): the same rank-0 step on each of N GPUs with real NCCL collectives of TP 8's
payloads between them, and every step also captured and timed with them off: the difference is their cost
on the step's critical path (latency, rank skew and bandwidth together; docs/MULTI_GPU.md).
Prints a table, writes JSON, asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PRO6000_BW = 1.79e12          # RTX PRO 6000 Blackwell GDDR7, datasheet bytes/s

from ddtree_cupy import knobs  # noqa: E402
from ddtree_cupy.profiling.rank_comm import RankComm  # noqa: E402  (rank 0 of 8 without peers)
from ddtree_cupy.profiling.routing import UniformRouting, count_experts  # noqa: E402,F401
from ddtree_cupy.profiling.marginal import leave_one_out  # noqa: E402
from ddtree_cupy.profiling.session import fill_random, load_configs as _load_configs  # noqa: E402


class LiveRankComm(RankComm):
    """``--comm nccl`` under ``mpirun -np N`` (N GPUs): every process still builds rank 0 of TP 8 (the shapes
    and kernels of a real rank), but its collectives are real NCCL calls across the N processes, with the
    payloads of TP 8 (all-reduce: the full [T, H] buffer; all-gather: N real parts, the other 8 - N slots
    filled with this rank's own part, so the buffer has TP 8's shape). ``live = False`` makes every
    collective the no-op of ``RankComm`` again, so one process can capture the same step both ways and
    time the collectives' real cost on the critical path (latency, rank skew and all)."""
    backend = "bench-nccl"

    def __init__(self, real, rank=0, size=8):
        super().__init__(rank, size)
        if real.size > size:
            raise ValueError(f"--comm nccl: {real.size} processes, but the rank shapes are TP {size}")
        self.real, self.live = real, True

    def all_reduce(self, x):
        self.n_reduce += 1
        self.reduce_bytes += x.nbytes
        return self.real.all_reduce(x) if self.live else x

    def all_gather(self, x):
        import cupy
        if not self.live:
            return super().all_gather(x)
        self.n_gather += 1
        key = (x.shape, x.dtype.str, x.data.ptr, "live")
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = cupy.empty((self.size,) + x.shape, x.dtype)
        n = self.real.size
        self.real.all_gather_into(x, buf[:n])
        if n < self.size:
            cupy.copyto(buf[n:], x[None])
        return buf

    def barrier(self):
        self.real.barrier()


class LiveCustomComm(LiveRankComm):
    """``--comm custom``: ``LiveRankComm`` over ``comm.custom.CustomComm`` (the P2P all-reduce where it is chosen,
    NCCL otherwise). It also offers the fused all-reduce + residual add + RMSNorm, so the target's layers take
    the fused path (``GpuTarget.fuses_norms``); with the collectives off, the same call is the plain
    ``rms_norm(residual=...)`` the unfused step runs, so on - off is the collectives' cost again."""
    backend = "bench-custom"

    def all_reduce_add_norm(self, x, residual, weight, eps, normed, residual_out=None):
        self.n_reduce += 1
        self.reduce_bytes += x.nbytes
        if self.live:
            return self.real.all_reduce_add_norm(x, residual, weight, eps, normed, residual_out=residual_out)
        from ddtree_cupy.kernels.layers import rms_norm
        return rms_norm(x, weight, eps, out=normed, residual=residual, residual_out=residual_out)


def _comm_label(comm) -> str:
    if isinstance(comm, LiveCustomComm):
        return "P2P all-reduce (" + comm.real.describe() + ") + NCCL all-gathers"
    return "NCCL"


CUSTOM_CAP_ROWS = 512         # rows x 7168 bf16 per P2P buffer slot: every payload of the benchmarked shapes


def make_comm(kind: str):
    """``none``: ``RankComm`` (collectives are no-ops, the single-GPU default). ``nccl``: ``LiveRankComm`` over
    the processes of an ``mpirun`` (each on GPU local_rank, NCCL bootstrapped over MPI as the engine does).
    ``custom``: ``LiveCustomComm``, the P2P all-reduce (DDT_ALLREDUCE: 'custom' by default here, 'auto' picks
    per payload from DDT_ALLREDUCE_TABLE or a start-up calibration); without P2P it says so and is NCCL."""
    if kind == "none":
        return RankComm(0, 8)
    from ddtree_cupy.dist import NcclComm, hold_until_exit, init_communicator, launched_with_mpi
    if not launched_with_mpi():
        raise SystemExit(f"--comm {kind} needs several processes: mpirun -np N launcher/bind.sh python -m bench.step "
                         f"--comm {kind} ... (N GPUs)")
    real = hold_until_exit(init_communicator("cupy"))    # outlives the step graphs (dist.end_job)
    if not isinstance(real, NcclComm):
        raise SystemExit(f"--comm {kind}: expected an NCCL communicator, got {type(real).__name__}")
    if kind == "custom":
        from ddtree_cupy.comm.custom import CustomComm, make_custom_comm
        cc = make_custom_comm(real, CUSTOM_CAP_ROWS * 7168, mode=knobs.get().allreduce or "custom")
        if isinstance(cc, CustomComm):
            return LiveCustomComm(hold_until_exit(cc))
    return LiveRankComm(real)


def project_pro6000(mem_s: float, bw: float, n_coll: int, reduce_bytes: int, latency_us: float,
                    bus_gbps: float, tp: int = 8) -> float:
    """Seconds per step on 8x RTX PRO 6000: the step measured here without collectives (memory-bound: scaled by
    read bandwidth here / 1.79 TB/s), plus each collective's latency, plus the all-reduces' bytes on the bus.
    A ring all-reduce moves 2 (tp - 1) / tp of each payload through every GPU's link, so the bus term grows with
    the rows in the step: 14 KB per row per all-reduce, 2 per layer. (The model before 2026-11-29 had the
    latency term only, which is flat in the payload; measured on 2 H200s, the per-call cost inside the step went
    from 9.5 us at 8 rows to 30-35 us at 320 over NVLink, 23 -> 82 us at 8 -> 80 rows through host memory: it
    is not.)"""
    bus_bytes = 2 * (tp - 1) / tp * reduce_bytes
    return mem_s * (bw / PRO6000_BW) + n_coll * latency_us * 1e-6 + bus_bytes / (bus_gbps * 1e9)


def load_allreduce_fit(path: str, default_gbps: float, which: str = "nccl"):
    """(latency us, bus GB/s, a note) from a ``bench/allreduce.py --json`` file: its ``fit`` (NCCL) or, with
    ``which='best'``, its ``fit_best`` (the fastest of NCCL and the P2P kernels per payload: what the engine's
    DDT_ALLREDUCE=auto pays); a fit without a bandwidth (one rank) keeps ``default_gbps``. A file without the
    fit is refused, naming the file."""
    with open(path) as f:
        d = json.load(f)
    key = "fit_best" if which == "best" else "fit"
    fit = d.get(key)
    if not fit or fit.get("latency_us") is None:
        raise SystemExit(f"--allreduce-fit {path}: no '{key}' in it (write it with bench/allreduce.py --json"
                         f"{'' if key == 'fit' else ' on GPUs with P2P'})")
    gbps = fit.get("bus_GBps") or default_gbps
    return (float(fit["latency_us"]), float(gbps),
            f"fitted ({'fastest algorithm' if key == 'fit_best' else 'NCCL'}) by bench/allreduce.py on "
            f"{d.get('ranks')} rank(s) of {d.get('device')} ({path})")


def load_configs(layers: int, ctx: int):
    """Kimi K2.6 and its DFlash drafter (tests/data), the first ``layers`` layers, drafter window ``ctx``."""
    data = os.path.join(ROOT, "tests", "data")
    return _load_configs(os.path.join(data, "kimi-k2.6-text.json"), os.path.join(data, "kimi-k2.5-dflash-drafter.json"),
                         layers, ctx)


def step_bytes(eng, cfg, dcfg, uniq, S, R, ctx):
    from ddtree_cupy.models.weights import plan_bytes
    tp = eng.comm.size
    pb = plan_bytes(cfg, tp)
    H, V_local = cfg.hidden_size, cfg.vocab_size // tp
    lm_head = V_local * H * 2
    E = cfg.n_routed_experts
    expert_bytes = pb["experts"] / max(1, sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)))
    per_expert = expert_bytes / E
    dw = eng.drafter.w.nbytes
    D = dcfg.block_size - 1
    W = min(ctx, dcfg.draft_window or ctx)
    hkv = dcfg.num_key_value_heads // tp
    parts = {
        "target_dense_weights": pb["attention"] + pb["mlp"] + pb["router"] + pb["norms"] + lm_head,
        "routed_experts_touched": per_expert * sum(uniq),
        "drafter_weights": dw + lm_head,
        "latent_cache": S * ctx * 576 * 2 * cfg.num_hidden_layers,
        "drafter_context": S * W * hkv * 128 * 2 * 2 * dcfg.num_hidden_layers,
        "logits_rw": 2 * 4 * V_local * (S * R + S * D),
    }
    parts["total"] = sum(parts.values())
    return parts, per_expert


def apply_baselines(a) -> None:
    """The --no-* measuring switches: module attributes the kernels read when the engine captures its graphs."""
    from ddtree_cupy.kernels import gemm, moe
    if a.no_wide_cluster:
        gemm.WIDE_CLUSTER = False
    if a.no_dec_spread:
        gemm.DEC_SPREAD = False
    if a.no_bulk_whole:
        moe.forward.BULK_WHOLE = False
    if a.moe_bulk is not None:
        moe.tables.BULK_FORCE = a.moe_bulk == 1
    for spec, attr, large in ((a.moe_bulk_tiles, "BULK_TILES", False), (a.moe_bulk_large_tiles, "BULK_LARGE_TILES", True)):
        if spec:
            setattr(moe.tables, attr, spec)
            moe.tables._bulk_tiles_for(large)        # a block that is not compiled stops here, not in the capture


def cost_tables(results):
    """(H200 table, PRO 6000 projected table) from the measured records: a drafting step of S streams x R
    rows costs its step time at S * R real rows (the PDL step where measured, as the engine runs it); the
    root-only step without the drafter is estimated as the smallest-R step of S minus its draft and tree
    phases (stated in the output)."""
    from ddtree_cupy.budget import CostTable
    here, pro, root_h, root_p = {}, {}, {}, {}
    for r in results:
        S, R = r["streams"], r["rows"]
        t = (r["step_pdl_ms"] or r["step_ms"]) * 1e-3
        here.setdefault(S, {})[S * R] = t
        pro.setdefault(S, {})[S * R] = r["pro6000_step_ms"] * 1e-3
        if S not in root_h or R < root_h[S][0]:
            f = 1.0 - (r["phases_ms"].get("draft", 0.0) + r["phases_ms"].get("tree", 0.0)) / r["step_ms"]
            root_h[S] = (R, t * f)
            root_p[S] = r["pro6000_step_ms"] * 1e-3 * f
    return (CostTable(here, {S: v for S, (_, v) in root_h.items()}, source="bench/step.py measured"),
            CostTable(pro, root_p, source="bench/step.py PRO 6000 projection"))


def budget_projection(costs, streams, budgets, accept, scales=(0.5, 0.75, 1.0), steps=300, seed=0):
    """Tokens/s per (streams, acceptance scale): 'ar', each fixed budget and the policy (budget.py), from
    synthetic steps whose drafter has per-depth (cumulative) acceptance ``accept`` with every conditional
    rate times the scale (ddtree_cupy/budget_sim.py; trees catch what the top-1 chain misses through the
    drafter's other candidates). Returns rows of dicts."""
    from ddtree_cupy import budget_sim as bs
    cond = np.asarray(accept, np.float64) / np.concatenate([[1.0], np.asarray(accept[:-1], np.float64)])
    rows = []
    for S in streams:
        for f in scales:
            cum = np.cumprod(np.clip(cond * f, 1e-6, 1.0))
            r = bs.run([bs.curve_drafter(cum)] * S, costs, steps, budgets=budgets, D=len(accept),
                       max_nodes=max(budgets), seed=seed)
            rows.append(dict(streams=S, scale=f, accept=[round(x, 4) for x in cum],
                             tok_s={k: r.rate(k) for k in r.tokens},
                             tau={k: r.tokens[k] / (steps * S) for k in r.tokens},
                             best_fixed=r.best_fixed(), auto_mean_budget=float(np.mean(r.budgets))))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 10])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32], help="verify rows per stream (budget + 1)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=61, help="fewer layers for a quick harness check")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--allreduce-us", type=float, default=24.0,
                    help="per-collective latency on the target box (the projection's fixed term; assumed NCCL on "
                         "PCIe. Published for 8x RTX PRO 6000: NCCL ~26-56 us at 14 KB, a one-stage P2P kernel "
                         "~12 us: pass --allreduce-us 12 to project the P2P path until it is measured there)")
    ap.add_argument("--allreduce-gbps", type=float, default=40.0,
                    help="all-reduce bus bandwidth per GPU on the target box, GB/s (PCIe 5.0 x16 ring; the "
                         "projection's payload term)")
    ap.add_argument("--tau", type=float, default=4.5, help="mean accepted length per step for the projection")
    ap.add_argument("--accept", type=float, nargs="+", default=[0.89, 0.75, 0.57, 0.49, 0.41, 0.34, 0.28],
                    help="per-depth (cumulative) acceptance of the drafter for the budget projection (default: the "
                         "published block-8 DFlash curve)")
    ap.add_argument("--accept-scales", type=float, nargs="+", default=[0.5, 0.75, 1.0],
                    help="budget projection: each conditional acceptance rate times these")
    ap.add_argument("--cost-table", default=None, metavar="FILE",
                    help="write the measured step times as a --budget auto cost table (JSON)")
    ap.add_argument("--pdl", type=int, default=1, help="1: also time the step captured with PDL launches")
    ap.add_argument("--persistent", type=int, default=1,
                    help="1: also time the step with the dense MLP halves as persistent launches (<= 16 rows)")
    ap.add_argument("--stages", type=int, default=1, help="1: time layer 1 and each of its stages as graphs")
    ap.add_argument("--loo", type=int, default=0,
                    help="1: the verify phase (every layer, PDL launches as the engine's graph) timed with each layer "
                         "stage left out of every layer: the stage's marginal cost on the real critical path")
    ap.add_argument("--routing", choices=("uniform", "model"), default="uniform",
                    help="uniform: the MoE reads 8 distinct uniformly random experts per row and layer (real "
                         "routing's spread); model: the random model's own router output (collapses to ~8 experts)")
    ap.add_argument("--allreduce-fit", default=None,
                    help="a bench/allreduce.py JSON from the target box: its fitted latency and bus bandwidth "
                         "replace --allreduce-us / --allreduce-gbps")
    ap.add_argument("--allreduce-fit-algo", choices=("nccl", "best"), default="nccl",
                    help="which fit of --allreduce-fit: NCCL's, or the fastest algorithm's per payload (P2P included)")
    ap.add_argument("--comm", choices=("none", "nccl", "custom"), default="none",
                    help="none: collectives are no-ops (one GPU); nccl: under mpirun -np N, real NCCL collectives "
                         "across N GPUs with TP 8 payloads, and each step also timed with them off (their real cost); "
                         "custom: the same with the P2P all-reduce fused with the residual add + RMSNorm")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "step_h200.json"))
    m = ap.add_argument_group("measuring baselines (each turns one default off, to time it against the default)")
    m.add_argument("--no-wide-cluster", action="store_true",
                   help="wide GEMMs without thread-block-cluster K splits (gemm.WIDE_CLUSTER = False)")
    m.add_argument("--no-dec-spread", action="store_true",
                   help="decode GEMM grids of <= one block per SM may share SMs (gemm.DEC_SPREAD = False)")
    m.add_argument("--no-bulk-whole", action="store_true",
                   help="the bulk-copy MoE down GEMM copies per tile and token row (moe.forward.BULK_WHOLE = False)")
    m.add_argument("--moe-bulk", type=int, choices=(0, 1), default=None,
                   help="the INT4 MoE GEMMs at T*k <= 256: 0 the register-ring ones, 1 the bulk-copy ones at every T "
                        "(moe.tables.BULK_FORCE; unset: the table, bulk-copy from 4 tokens up)")
    m.add_argument("--moe-bulk-tiles", default="", metavar="gu=w,k,s,n[,xr];dn=...",
                   help="another compiled block of the bulk-copy MoE GEMMs at T*k <= 256 (moe.tables.BULK_TILES)")
    m.add_argument("--moe-bulk-large-tiles", default="", metavar="gu=w,k,s,n[,xr];dn=...",
                   help="another compiled block of the bulk-copy MoE GEMMs above T*k = 256 (moe.tables.BULK_LARGE_TILES)")
    a = ap.parse_args(argv)
    apply_baselines(a)
    collectives_source = "assumed (command line / defaults)"
    if a.allreduce_fit:
        a.allreduce_us, a.allreduce_gbps, collectives_source = load_allreduce_fit(a.allreduce_fit, a.allreduce_gbps,
                                                                                  a.allreduce_fit_algo)
    comm = make_comm(a.comm)            # first: under mpirun it picks this process's GPU
    live = isinstance(comm, LiveRankComm)
    if live and comm.real.rank != 0:    # every rank runs the same sequence; rank 0 alone reports
        sys.stdout = open(os.devnull, "w")
        a.json = None

    import cupy
    from bench.ceilings import measure_read_bandwidth, time_graph
    from ddtree_cupy.engine.gpu_engine import GpuEngine
    from ddtree_cupy.engine.profile import count_launches
    from ddtree_cupy.engine.kv_pool import KVPool
    from ddtree_cupy.kernels import engine_glue as g

    t_start = time.perf_counter()
    dev = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    bw = measure_read_bandwidth(2 << 30) * 1e9
    tcfg, dcfg = load_configs(a.layers, a.ctx)
    S_max, R_max = max(a.streams), max(a.rows)
    uniform = UniformRouting(tcfg.n_routed_experts, tcfg.num_experts_per_tok) if a.routing == "uniform" else None
    if uniform is not None:
        uniform.__enter__()         # for the whole run: every captured step reads the tables
    t0 = time.perf_counter()
    per_stream = a.ctx + R_max + 64
    eng = GpuEngine(tcfg, None, dcfg, None, comm=comm, max_streams=S_max, max_budget=R_max - 1,
                    kv_tokens=S_max * (-(-per_stream // 64)) * 64, random_weights=1, prefill_chunk=64,
                    max_context=per_stream, pdl=False,
                    buckets=tuple(sorted(set(a.streams) | {S_max})))
    build_s = time.perf_counter() - t0
    fill_random(eng.kv.pools, seed=1)
    fill_random(eng.drafter.k_cache + eng.drafter.v_cache, seed=2)
    pool = KVPool(eng.num_pages, 64, S_max, eng.max_pages_per_stream, R_max)
    for s in range(S_max):
        pool.admit(s, a.ctx, 1)
    eng.kv.set_block_table(pool.block_table)
    dev.synchronize()
    free, total = cupy.cuda.runtime.memGetInfo()
    print(f"{name}: read ceiling {bw / 1e9:.0f} GB/s; rank 0 of TP 8, {tcfg.num_hidden_layers} layers, weights "
          f"{eng.target.w.nbytes() / 1e9:.1f} GB target + {eng.drafter.w.nbytes / 1e9:.2f} GB drafter, built in "
          f"{build_s:.0f} s; KV pool {eng.kv.nbytes() / 1e9:.2f} GB; GPU memory used "
          f"{(total - free) / 1e9:.0f} of {total / 1e9:.0f} GB")
    if live:
        print(f"collectives: real {_comm_label(comm)} across {comm.real.size} GPUs (TP 8 payloads; every process is rank 0's "
              f"shapes); NCCL_PROTO={os.environ.get('NCCL_PROTO', 'default')} "
              f"NCCL_ALGO={os.environ.get('NCCL_ALGO', 'default')} NCCL_P2P_DISABLE="
              f"{os.environ.get('NCCL_P2P_DISABLE', '0')}", flush=True)
    rng = np.random.default_rng(0)
    results = []
    for S in a.streams:
        for R in a.rows:
            budget = R - 1
            step = eng.get_step(S, "ddtree", budget, None, False, False)     # built and captured
            ctrl = np.zeros((g.CTRL_FIELDS, S), np.int32)
            ctrl[g.CTRL_PREFIX] = a.ctx
            ctrl[g.CTRL_BONUS] = rng.integers(0, tcfg.vocab_size, S)
            ctrl[g.CTRL_ACTIVE] = 1
            ctrl[g.CTRL_BUDGET] = budget
            ctrl[g.CTRL_STEP] = 1
            step.upload(ctrl)
            st = eng.stream
            # collectives issued by one step (eager run, counted)
            r0, g0, b0 = comm.n_reduce, comm.n_gather, comm.reduce_bytes
            uniq, n_real = count_experts(step, S, R, tcfg, uniform)
            n_reduce, n_gather, reduce_bytes = comm.n_reduce - r0, comm.n_gather - g0, comm.reduce_bytes - b0
            def replay_s():             # seconds per step graph, a.reps replays back to back after a warm one
                ev0, ev1 = cupy.cuda.Event(), cupy.cuda.Event()
                step.graph.launch(st)
                ev0.record(st)
                for _ in range(a.reps):
                    step.graph.launch(st)
                ev1.record(st)
                ev1.synchronize()
                return cupy.cuda.get_elapsed_time(ev0, ev1) / 1e3 / a.reps
            step_s = replay_s()
            # the host's whole step, and its issue time alone
            walls, issues = [], []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                step.upload(ctrl)
                step.graph.launch(st)
                t1 = time.perf_counter()
                step.packed.get(stream=st, out=step.packed_np)
                st.synchronize()
                walls.append(time.perf_counter() - t0)
                issues.append(t1 - t0)
            wall_s, host_s = float(np.median(walls)), float(np.median(issues))
            phases = {}
            with st:
                for pname, fn in step.phases():
                    phases[pname] = time_graph(fn, iters=2, reps=3) * 1e-6
            # launches: the verify phase, and one MoE layer's stages (eager, counted by the wrappers)
            tgt, moe_layer = eng.target, next(i for i, L in enumerate(eng.target.w.layers) if L.is_moe)
            with count_launches() as lc_verify, st:
                dict(step.phases())["verify"]()
            stages = tgt.layer_stages(moe_layer, step.batch, eng.kv)
            with count_launches() as lc_layer, st:
                for _, fn in stages:
                    fn()
            st.synchronize()
            layer_us, stage_us = None, {}
            if a.stages:
                with st:
                    layer_us = time_graph(lambda: [fn() for _, fn in stages], iters=10, reps=3)
                    for sname, fn in stages:
                        stage_us[sname] = time_graph(fn, iters=10, reps=3)
            loo = leave_one_out(eng, step, st, moe_layer, use_pdl=bool(a.pdl)) if a.loo else None
            step_pdl_s, pdl_check = None, None
            if a.pdl:
                # replays with the same ctrl are a pure function of the unchanged state (the cache prefix and
                # the drafter context below s are never written), so the outputs must repeat bit for bit;
                # the PDL graph must give the same bits as the plain one
                def outputs():
                    step.graph.launch(st)
                    st.synchronize()
                    return step.batch.logits.get(), step.packed.get()
                base1, base2 = outputs(), outputs()
                eng.models.pdl = True           # the same step graph captured with PDL launches
                try:
                    step.capture()
                    step.upload(ctrl)
                    step_pdl_s = replay_s()
                    pdl_out = outputs()
                    same = lambda x, y: all(np.array_equal(u.view(np.uint8), v.view(np.uint8)) for u, v in zip(x, y))  # noqa: E731,E501
                    pdl_check = dict(plain_repeats=same(base1, base2), pdl_equals_plain=same(base1, pdl_out))
                except Exception as e:          # report and go on: the PDL path is optional
                    print(f"    PDL capture/replay failed: {type(e).__name__}: {e}", flush=True)
                finally:
                    eng.models.pdl = False
                st.synchronize()
                step.capture()
                step.upload(ctrl)
            step_persist_s, persist_check = None, None
            if a.persistent:
                from ddtree_cupy.kernels import persistent as pk
                if S * R <= pk.MAX_T:
                    # the same step with the dense layers' MLP halves as persistent launches (kernels/
                    # persistent.py; today's kernels elsewhere): timed the same way, logits compared with the
                    # plain graph's (the GEMM tiles sum in another order: close, not bitwise)
                    def logits():
                        step.graph.launch(st)
                        st.synchronize()
                        return step.batch.logits.get()
                    base = logits()
                    old = pk.set_mlp(True)
                    try:
                        with st:
                            dict(step.phases())["verify"]()      # eager first: uploads the segments' schedules
                        st.synchronize()
                        step.capture()
                        step.upload(ctrl)
                        step_persist_s = replay_s()
                        got = logits()
                        persist_check = dict(
                            logits_rel_err=float(np.linalg.norm(got - base) / max(float(np.linalg.norm(base)), 1e-30)),
                            argmax_equal=float(np.mean(got.argmax(-1) == base.argmax(-1))))
                    except Exception as e:          # report and go on: the persistent path is optional
                        print(f"    persistent capture/replay failed: {type(e).__name__}: {e}", flush=True)
                    finally:
                        pk.set_mlp(old)
                    st.synchronize()
                    step.capture()
                    step.upload(ctrl)
            noop_s = noop_pdl_s = None
            if live:
                # the same graphs captured with the collectives off: the difference is what they cost here
                comm.live = False
                try:
                    step.capture()
                    step.upload(ctrl)
                    noop_s = replay_s()
                    if step_pdl_s is not None:
                        eng.models.pdl = True
                        try:
                            step.capture()
                            step.upload(ctrl)
                            noop_pdl_s = replay_s()
                        finally:
                            eng.models.pdl = False
                finally:
                    comm.live = True
                st.synchronize()
                step.capture()
                step.upload(ctrl)
            parts, per_expert = step_bytes(eng, tcfg, dcfg, uniq, S, R, a.ctx)
            floor_s = parts["total"] / bw
            # projection: the memory-bound part scales with bandwidth, collectives add their latency; from the
            # step the engine runs (its graphs launch with PDL where the device has it), else the plain step
            eng_s = step_pdl_s if step_pdl_s is not None else step_s
            if live:        # the memory-bound part is the step without collectives; theirs is added below
                eng_s = noop_pdl_s if noop_pdl_s is not None else noop_s
            pro_s = project_pro6000(eng_s, bw, n_reduce + n_gather, reduce_bytes, a.allreduce_us, a.allreduce_gbps)
            coll = None
            if live:
                with_c = step_pdl_s if noop_pdl_s is not None else step_s
                coll = dict(ranks=comm.real.size, step_noop_ms=noop_s * 1e3,
                            step_pdl_noop_ms=None if noop_pdl_s is None else noop_pdl_s * 1e3,
                            collectives_ms=(with_c - eng_s) * 1e3,
                            us_per_collective=(with_c - eng_s) * 1e6 / max(1, n_reduce + n_gather))
            rec = dict(streams=S, rows=R, budget=budget, ctx=a.ctx, step_ms=step_s * 1e3, wall_ms=wall_s * 1e3,
                       host_issue_us=host_s * 1e6, host_pct=100 * host_s / wall_s,
                       phases_ms={k: v * 1e3 for k, v in phases.items()}, real_rows=n_real,
                       unique_experts_per_layer=uniq, mean_unique_experts=float(np.mean(uniq)) if uniq else 0.0,
                       bytes=parts, floor_ms=floor_s * 1e3, ratio_to_floor=step_s / floor_s,
                       allreduces_per_step=n_reduce, allgathers_per_step=n_gather, allreduce_bytes=reduce_bytes,
                       pro6000_step_ms=pro_s * 1e3, pro6000_tok_s=a.tau * S / pro_s,
                       verify_launches=sum(lc_verify.counts.values()), verify_launch_counts=dict(lc_verify.counts),
                       layer_launches=sum(lc_layer.counts.values()), layer_launch_counts=dict(lc_layer.counts),
                       verify_us_per_layer=phases.get("verify", 0) * 1e6 / tcfg.num_hidden_layers,
                       layer_graph_us=layer_us, stage_us=stage_us,
                       step_pdl_ms=None if step_pdl_s is None else step_pdl_s * 1e3, pdl_check=pdl_check,
                       step_persistent_ms=None if step_persist_s is None else step_persist_s * 1e3,
                       persistent_ratio_to_floor=None if step_persist_s is None else step_persist_s / floor_s,
                       persistent_check=persist_check,
                       leave_one_out=loo, collectives=coll)
            results.append(rec)
            print(f"S={S:2d} R={R:2d}: step {step_s * 1e3:7.2f} ms (floor {floor_s * 1e3:6.2f} ms, x{step_s / floor_s:4.2f})"
                  f" wall {wall_s * 1e3:7.2f} ms host {host_s * 1e6:5.0f} us; experts/layer "
                  f"{rec['mean_unique_experts']:5.1f}; phases " + " ".join(f"{k} {v * 1e3:.2f}" for k, v in phases.items())
                  + f"; PRO 6000 {pro_s * 1e3:.1f} ms -> {a.tau * S / pro_s:.0f} tok/s", flush=True)
            print(f"    launches: verify {rec['verify_launches']}, MoE layer {rec['layer_launches']} "
                  + str(dict(sorted(lc_layer.counts.items()))) + (f"; step with PDL {step_pdl_s * 1e3:.2f} ms "
                                                                  f"{pdl_check}" if step_pdl_s else ""), flush=True)
            if step_persist_s is not None:
                print(f"    step with persistent dense MLP {step_persist_s * 1e3:.2f} ms (x{step_persist_s / floor_s:4.2f} "
                      f"floor; plain {step_s * 1e3:.2f}) {persist_check}", flush=True)
            if coll:
                print(f"    collectives on ({coll['ranks']} GPUs) {with_c * 1e3:.2f} ms, off {eng_s * 1e3:.2f} ms: "
                      f"{coll['collectives_ms']:.2f} ms for {n_reduce} all-reduces + {n_gather} all-gathers = "
                      f"{coll['us_per_collective']:.1f} us each on the step's critical path", flush=True)
            if loo:
                print(f"    verify {loo['verify_us']:.0f} us; marginal us per layer (verify without the stage in every "
                      "layer): " + " ".join(f"{k} {v:.1f}" for k, v in loo["marginal_us_per_layer"].items()), flush=True)
            if stage_us:
                print(f"    MoE layer graph {layer_us:.1f} us (verify/layer {rec['verify_us_per_layer']:.1f} us); "
                      "stages us: " + " ".join(f"{k} {v:.1f}" for k, v in stage_us.items()), flush=True)
    assumptions = {
        "device": name, "read_ceiling_GBps": bw / 1e9, "pro6000_read_GBps": PRO6000_BW / 1e9,
        "allreduce_us_per_call": a.allreduce_us, "allreduce_bus_GBps": a.allreduce_gbps,
        "allreduce_constants": collectives_source, "tau": a.tau, "tp": 8, "rank": 0, "layers": tcfg.num_hidden_layers,
        "ctx": a.ctx, "weights": "random rank-shaped (GpuTargetWeights.random / GpuDrafterWeights.random)",
        "routing": ("uniform: 8 distinct random experts per row and layer (fixed tables; the router still runs)"
                    if uniform is not None else "model: the random model's router output"),
        "collectives": (f"real {_comm_label(comm)} across {comm.real.size} GPUs (TP 8 payloads), timed on and off; projection from "
                        "the step without them, adds the collectives model (see projection)" if live else
                        "no-op here (one rank without peers); projection adds the collectives model"),
        "projection": "step (the PDL step where measured, as the engine runs it, else step_ms; without collectives) x "
                      "(read ceiling here / 1.79 TB/s) + (all-reduces + all-gathers) x latency + all-reduce bytes x "
                      "2 x 7/8 / bus bandwidth; tok/s = tau x streams / that",
        "floor": "all rank weights once (embedding excluded: a lookup), routed experts actually touched x per-expert "
                 "shard bytes, lm_head twice (target + drafter), latent cache and drafter context, logits written "
                 "and read, over the read ceiling measured here",
    }
    print("\nassumptions: " + "; ".join(f"{k}={v}" for k, v in assumptions.items()))
    if live:
        print(f"\nreal collectives across {comm.real.size} GPUs: | streams | rows | step ms (on) | step ms (off) | "
              "collectives ms | us per collective |")
        for r in results:
            c, on = r["collectives"], (r["step_pdl_ms"] if r["collectives"]["step_pdl_noop_ms"] is not None
                                       else r["step_ms"])
            off = c["step_pdl_noop_ms"] if c["step_pdl_noop_ms"] is not None else c["step_noop_ms"]
            print(f"| {r['streams']} | {r['rows']} | {on:.2f} | {off:.2f} | {c['collectives_ms']:.2f} | "
                  f"{c['us_per_collective']:.1f} |")
    print(f"\n| streams | rows | step ms | floor ms | x floor | host % | draft | tree | verify | accept | experts/layer"
          f" | PRO 6000 tok/s (tau {a.tau}) | launches/MoE layer | verify us/layer | step ms PDL |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        p = r["phases_ms"]
        print(f"| {r['streams']} | {r['rows']} | {r['step_ms']:.2f} | {r['floor_ms']:.2f} | {r['ratio_to_floor']:.2f} | "
              f"{r['host_pct']:.1f} | {p.get('draft', 0):.2f} | {p.get('tree', 0):.2f} | {p.get('verify', 0):.2f} | "
              f"{p.get('accept', 0):.2f} | {r['mean_unique_experts']:.0f} | {r['pro6000_tok_s']:.0f} | "
              f"{r['layer_launches']} | {r['verify_us_per_layer']:.0f} | "
              + (f"{r['step_pdl_ms']:.2f}" if r["step_pdl_ms"] is not None else "-") + " |")
    proj = []
    if results:
        here, pro = cost_tables(results)
        if a.cost_table:
            here.save(a.cost_table)
            print(f"wrote the cost table {a.cost_table}")
        budgets = sorted({r["rows"] - 1 for r in results if r["rows"] > 1})
        proj = budget_projection(pro, sorted({r["streams"] for r in results}), budgets, a.accept, a.accept_scales)
        print("\nbudget projection on 8x RTX PRO 6000 (tok/s; drafter acceptance curve x scale, synthetic steps, "
              "root-only step = smallest step minus its draft + tree phases):")
        names = ["ar"] + [f"b{b}" for b in budgets] + ["auto"]
        print("| streams | scale | " + " | ".join(names) + " | best fixed | auto mean budget |")
        print("|---|---|" + "---|" * (len(names) + 2))
        for p in proj:
            print(f"| {p['streams']} | {p['scale']} | " + " | ".join(f"{p['tok_s'][n]:.0f}" for n in names)
                  + f" | {p['best_fixed']} | {p['auto_mean_budget']:.1f} |")
    if a.json:
        os.makedirs(os.path.dirname(a.json), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"assumptions": assumptions, "results": results, "budget_projection": proj,
                       "runtime_s": time.perf_counter() - t_start}, f, indent=1)
        print(f"wrote {a.json} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    from ddtree_cupy.dist import end_job
    end_job(main())
