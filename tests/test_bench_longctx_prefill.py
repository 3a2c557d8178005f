"""CPU checks of the long-context and prefill benchmarks' arithmetic (bench/longctx.py, bench/prefill.py), the
run summary (bench/gpu_summary.py) and bench/run_gpu.sh's part handling: floors against brute-force
recounts, memory plans against the engine's own sizing, argument errors. No GPU needed."""
import copy
import json
import os
import subprocess

import numpy as np
import pytest

from bench import gpu_summary, longctx, prefill
from bench.step import load_configs
from ddtree_cupy.engine.kv_pool import KVPool
from ddtree_cupy.kernels import attention as A
from ddtree_cupy.models.weights import plan_bytes, weight_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTX_PRO_6000 = (188, 101376, 102400)


@pytest.fixture(scope="module")
def kimi():
    return load_configs(61, 32768)


# ---- prefill floor -------------------------------------------------------------------------------------
def test_unique_experts_matches_sampling_and_the_byte_model():
    rng = np.random.default_rng(5)
    for T in (1, 8, 37, 256):
        draws = [np.unique(np.concatenate([rng.choice(384, 8, replace=False) for _ in range(T)])).size
                 for _ in range(200)]
        assert prefill.expected_unique_experts(384, 8, T) == pytest.approx(np.mean(draws), rel=0.02)
    # PERFORMANCE.md's table: 8 -> ~60, 16 -> ~110, 32 -> ~188, 160 -> ~371
    for T, want in ((8, 60), (16, 110), (32, 188), (160, 371)):
        assert abs(prefill.expected_unique_experts(384, 8, T) - want) < 1.5
    assert prefill.expected_unique_experts(384, 8, 0) == 0.0


def test_chunk_plan_covers_the_prompt():
    assert prefill.chunk_plan(1000, 256) == [(0, 256), (256, 256), (512, 256), (768, 232)]
    assert prefill.chunk_plan(5, 256) == [(0, 5)]
    for P, C in ((1, 1), (8192, 512), (32768, 2048), (777, 100)):
        plan = prefill.chunk_plan(P, C)
        assert sum(n for _, n in plan) == P and all(p == j * C for j, (p, _) in enumerate(plan))
    with pytest.raises(ValueError, match="positive"):
        prefill.chunk_plan(0, 256)


def test_rank_costs_from_the_weight_plan(kimi):
    tcfg, _ = kimi
    c = prefill.rank_costs(tcfg, 8, append_bytes=10, append_params=5)
    plan, pb = weight_plan(tcfg, 8), plan_bytes(tcfg, 8)
    # every bf16 matrix of the layers, counted independently: bytes / 2 (norms and biases are not matrices)
    mats = sum(int(np.prod(s)) for n, (s, dt) in plan.items() if n.startswith("layers.") and len(s) >= 2
               and ".experts." not in n)
    assert c.dense_params == mats
    assert c.moe_layers == 60 and c.layers == 61 and c.heads == 8 and (c.E, c.k) == (384, 8)
    assert c.expert_bytes * c.E * c.moe_layers == pytest.approx(pb["experts"])
    assert c.expert_bytes == pytest.approx(3.1e6, rel=0.01)           # PERFORMANCE.md: 3.1 MB per expert shard
    assert c.expert_params == 3 * 7168 * 256                          # gate | up | down of I = 2048 / 8
    assert c.lm_head_params == 20480 * 7168 and (c.append_bytes, c.append_params) == (10, 5)


def _brute_force(c, P, C, bw, rate):
    """The same floor, recounted row by row and key by key (no closed forms)."""
    floor = 0.0
    tb_all = tf_all = 0.0
    plan = prefill.chunk_plan(P, C)
    for j, (p, n) in enumerate(plan):
        keys = sum(p + r + 1 for r in range(n))
        E, k = c.E, c.k
        uniq = E * (1 - (1 - k / E) ** n)
        b = (c.dense_bytes + c.moe_layers * uniq * c.expert_bytes + c.append_bytes
             + c.layers * 1152 * (p + 2 * n) + (c.lm_head_bytes if j == len(plan) - 1 else 0))
        f = (2 * n * (c.dense_params + k * c.moe_layers * c.expert_params + c.append_params)
             + c.layers * c.heads * keys * 2 * 1088 + (2 * c.lm_head_params if j == len(plan) - 1 else 0))
        floor += max(b / bw, f / rate)
        tb_all += b
        tf_all += f
    return floor, tb_all, tf_all


@pytest.mark.parametrize("P,C", [(1024, 256), (1000, 300), (8192, 2048), (4096, 4096)])
def test_prefill_floor_equals_a_recount(kimi, P, C):
    c = prefill.rank_costs(kimi[0], 8, append_bytes=99_090_432, append_params=49_545_216)
    bw, rate = 4.4e12, 640e12
    fl = prefill.prefill_floor(c, P, C, bw, rate)
    floor, tb, tf = _brute_force(c, P, C, bw, rate)
    assert fl["floor_s"] == pytest.approx(floor, rel=1e-12)
    assert fl["bytes"] == pytest.approx(tb, rel=1e-12) and fl["flops"] == pytest.approx(tf, rel=1e-12)
    assert fl["chunks"] == -(-P // C) and sum(fl["chunks_bound"].values()) == fl["chunks"]
    assert sum(fl["bytes_parts"].values()) == pytest.approx(fl["bytes"])
    assert max(fl["bytes_s"], fl["flops_s"]) <= fl["floor_s"] <= fl["bytes_s"] + fl["flops_s"]


def test_prefill_floor_trends(kimi):
    c = prefill.rank_costs(kimi[0], 8)
    bw, rate = 4.4e12, 640e12
    # the job's FLOPs do not depend on the chunking; the weight bytes fall as chunks grow
    f = [prefill.prefill_floor(c, 8192, C, bw, rate) for C in (256, 512, 1024, 2048)]
    assert all(x["flops"] == pytest.approx(f[0]["flops"]) for x in f)
    assert all(f[i]["bytes"] > f[i + 1]["bytes"] for i in range(3))
    # small chunks at a short prompt are weight-read bound; huge chunks of a long prompt FLOP bound
    assert prefill.prefill_floor(c, 1024, 256, bw, rate)["chunks_bound"] == {"bytes": 4, "flops": 0}
    assert prefill.prefill_floor(c, 32768, 2048, bw, rate)["chunks_bound"]["flops"] == 16
    # attention's FLOP share grows with the prompt (causal: quadratic)
    s = [prefill.prefill_floor(c, P, 1024, bw, rate)["attention_flops_share"] for P in (1024, 8192, 32768)]
    assert s[0] < s[1] < s[2] and s[2] > 0.5
    with pytest.raises(ValueError, match="ceilings must be positive"):
        prefill.prefill_floor(c, 1024, 256, 0.0, rate)


def test_prefill_arguments_and_budget():
    prefill.check_args([1024, 8192], [256, 4096], 1)
    with pytest.raises(SystemExit, match="--chunks"):
        prefill.check_args([1024], [8192], 1)
    with pytest.raises(SystemExit, match="--lengths"):
        prefill.check_args([0], [256], 1)
    with pytest.raises(SystemExit, match="--reps"):
        prefill.check_args([1024], [256], 0)
    assert prefill.skip_reason(10.0, 100.0, None) == ""            # nothing measured yet: run it
    assert prefill.skip_reason(10.0, 100.0, 80.0) == ""
    assert prefill.skip_reason(10.0, 100.0, 95.0).startswith("skipped: estimated 95 s")
    res = [dict(length=1024, chunk=256, ttft_ms=50.0), dict(length=1024, chunk=512, ttft_ms=40.0),
           dict(length=8192, chunk=256, skipped="x"), dict(length=8192, chunk=512, ttft_ms=300.0)]
    best = prefill.best_per_length(res)
    assert best[1024]["chunk"] == 512 and best[8192]["chunk"] == 512 and set(best) == {1024, 8192}


# ---- long context ----------------------------------------------------------------------------------------
def test_parse_groups():
    assert longctx.parse_groups(["32768:1,4,10", "131072:1"]) == [(32768, (1, 4, 10)), (131072, (1,))]
    for bad in ("32768", "a:1", "32768:", "0:1", "4096:0"):
        with pytest.raises(SystemExit, match="--groups"):
            longctx.parse_groups([bad])


def test_memory_plan_matches_the_engine_sizing(kimi):
    tcfg, dcfg = kimi
    w = plan_bytes(tcfg, 8)["total"] + longctx.drafter_shard_bytes(dcfg, 8)
    p = longctx.memory_plan(tcfg, dcfg, 32768, (1, 4, 10), 8, w)
    # bench/step.py: kv_tokens = S_max x pages of (ctx + R_max + 64); GpuEngine: 61 x 64 x 1152 B per page
    pages = -(-(32768 + 8 + 64) // 64)
    assert p["kv_tokens"] == 10 * pages * 64
    assert p["kv_bytes"] == 10 * pages * 61 * 64 * 1152
    assert p["kv_bytes"] == pytest.approx(23.1e9, rel=0.01)
    assert p["drafter_context_bytes"] == 10 * 32768 * 1 * 128 * 2 * 2 * 6
    # the 4K step measured 85 GB in use on the H200: the plan's total for that run must be close
    p4 = longctx.memory_plan(tcfg, dcfg, 4096, (1, 4, 10), 8, w)
    assert 80e9 < p4["total_bytes"] < 92e9
    # 10 x 32K fits the H200 (139 GiB) but not one RTX PRO 6000 (96 GB); 1 x 128K fits both
    assert p["total_bytes"] < 139 * 2**30 and not p["fits_pro6000"]
    p128 = longctx.memory_plan(tcfg, dcfg, 131072, (1,), 8, w)
    assert p128["kv_bytes"] == pytest.approx(131072 * 61 * 1152, rel=0.001) and p128["fits_pro6000"]
    # the drafter shard: GpuDrafterWeights' shapes at TP 8, bf16
    assert longctx.drafter_shard_bytes(dcfg, 8) == pytest.approx(0.89e9, rel=0.01)


@pytest.mark.parametrize("attrs,arch", [(longctx.H200_ATTRS, "sm_90"), (RTX_PRO_6000, "sm_120")])
def test_128k_through_pool_and_planner(kimi, attrs, arch):
    tcfg, _ = kimi
    ctx, R = 131072, 8
    per_stream = ctx + R + 64
    pages = -(-per_stream // 64)
    pool = KVPool(pages, 64, 1, pages, R)
    slot = pool.admit("long", ctx, 1)
    row = pool.block_table[slot]
    assert (row[:-(-(ctx + 1 + R) // 64)] >= 0).all() and len(set(row[row >= 0].tolist())) == (row >= 0).sum()
    pool.check_invariants()
    # every page's element offset of the pool fits the kernels' size_t arithmetic, and the per-layer pool
    # index (page x 64 + row) x 576 of a whole-memory pool stays below 2^63 trivially; the int32 page id holds
    assert pages < 2**31
    heads = tcfg.num_attention_heads // 8
    for S in (1, 4, 10):
        cfg, k = A.plan_mla_for(S, R, heads, per_stream, A.resolve_policy("auto", arch), *attrs,
                                A.mla_partial_bf16())
        assert 1 <= k <= A.MAX_SPLITS and cfg.smem <= attrs[1]
        assert A.MlaWorkspace.nbytes_for(k, S * R, heads, A.mla_partial_bf16()) <= A.MLA_MAX_WORKSPACE
        us = longctx.attention_model_us(S, R, heads, per_stream, attrs, arch)
        assert us > longctx.attention_model_us(S, R, heads, 4096 + R + 64, attrs, arch)


def _rec(step_ms=10.0, pdl=8.0, latent=2e9, total=8e9, att_us=None):
    r = dict(streams=1, rows=8, ctx=32768, step_ms=step_ms, step_pdl_ms=pdl, floor_ms=4.0, pro6000_tok_s=100.0,
             pro6000_step_ms=20.0, bytes=dict(latent_cache=latent, total=total), leave_one_out=None)
    if att_us is not None:
        r["leave_one_out"] = dict(marginal_us_per_layer={"attention": att_us, "moe": 50.0})
    return r


def test_attention_share():
    s = longctx.attention_share(_rec(att_us=40.0), 61, 30.0)
    assert s["step_ms"] == 8.0                                    # the PDL step, as the engine runs it
    assert s["bytes_share"] == 0.25
    assert s["model_share"] == pytest.approx(61 * 30.0e-3 / 8.0)
    assert s["measured_share"] == pytest.approx(61 * 40.0e-3 / 8.0) and s["measured_us_per_layer"] == 40.0
    s = longctx.attention_share(_rec(pdl=None), 61, None)           # no PDL step, no loo, no model
    assert s["step_ms"] == 10.0 and s["measured_share"] is None and s["model_share"] is None


def test_step_command():
    cmd = longctx.step_command(131072, (1,), 8, 5, 61, 1, "/tmp/x.json", ["--routing", "model"])
    args = cmd[cmd.index("bench.step") + 1:]
    assert args[args.index("--ctx") + 1] == "131072" and args[args.index("--loo") + 1] == "1"
    assert args[args.index("--json") + 1] == "/tmp/x.json" and args[-2:] == ["--routing", "model"]
    assert args[args.index("--streams") + 1:args.index("--rows")] == ["1"]


# ---- summary and the run script ---------------------------------------------------------------------------
def test_summary_reads_parts_and_figures(tmp_path):
    with open(os.path.join(ROOT, "bench", "results", "step_h200.json")) as f:
        step = json.load(f)
    (tmp_path / "step_h200.json").write_text(json.dumps(step))
    lc = dict(device="X", runs=[dict(ctx=131072, streams=[1], error="refused: needs ~200 GB")],
              results=[dict(_rec(att_us=40.0), attention_share=longctx.attention_share(_rec(att_us=40.0), 61, 30.0))])
    (tmp_path / "longctx_h200.json").write_text(json.dumps(lc))
    best = dict(length=1024, chunk=512, ttft_ms=123.0, tok_s=8325.0, floor_ms=30.0, ratio_to_floor=4.1)
    pf = dict(assumptions=dict(read_ceiling_GBps=4400.0, mma_bf16_TFLOPs=640.0),
              results=[best, dict(length=32768, chunk=256, skipped="skipped: estimated 900 s")], best={"1024": best})
    (tmp_path / "prefill_h200.json").write_text(json.dumps(pf))
    (tmp_path / "parts.tsv").write_text("tests\t0\t212\t1089 passed in 200.1s\nprefill\tskip\t0\tskipped: budget\n")
    out = gpu_summary.summarize(str(tmp_path), "bench/results")
    assert "| tests | 0 | 212 | 1089 passed in 200.1s |" in out and "| prefill | skip |" in out
    r1 = next(r for r in step["results"] if (r["streams"], r["rows"]) == (1, 8))
    assert f"step 1 x 8 @ 4096: {r1['step_pdl_ms']:.2f} ms" in out and f"{r1['pro6000_tok_s']:.0f} tok/s" in out
    assert "step 10 x 8 @ 4096" in out and "step 4 x 8" not in out
    assert "attention 30% measured, 23% model, 25% of the floor's bytes" in out
    assert "refused: needs ~200 GB" in out
    assert "prefill 1024 tokens: TTFT 123 ms at chunk 512" in out and "1 configurations not measured" in out
    assert "step_h200.json" in out.splitlines()[-1] and "prefill_h200.json" in out.splitlines()[-1]
    (tmp_path / "longctx_h200.json").write_text("{not json")
    assert "longctx_h200.json: unreadable" in gpu_summary.summarize(str(tmp_path))
    bad = copy.deepcopy(pf)
    del bad["assumptions"]
    (tmp_path / "prefill_h200.json").write_text(json.dumps(bad))
    assert "prefill_h200.json: not summarized (KeyError" in gpu_summary.summarize(str(tmp_path))


def test_run_gpu_script_budget_and_unknown_part(tmp_path):
    script = os.path.join(ROOT, "bench", "run_gpu.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    log = tmp_path / "log"
    env = dict(os.environ, BUDGET_S="5")
    p = subprocess.run(["bash", script, str(log), "step", "nosuchpart"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    parts = (log / "parts.tsv").read_text().splitlines()
    assert parts[0].startswith("step\tskip\t0\tskipped: expects 120 s") and parts[1] == "nosuchpart\t2\t0\tunknown part"
    assert "| step | skip |" in p.stdout and "| nosuchpart | 2 |" in p.stdout


def test_run_gpu_groups_expand(tmp_path):
    """call1 / call2 name the parts of the two 9-minute runs; their expected durations fit the budget."""
    text = open(os.path.join(ROOT, "bench", "run_gpu.sh")).read()
    expect = dict(kv.split("]=") for kv in text.split("declare -A EXPECT=(")[1].split(")")[0].replace("[", "")
                  .split())
    groups = {g: text.split(f"    {g}) expanded+=(")[1].split(")")[0].split()
              for g in ("call1", "call2", "call3", "call4", "call5")}
    budget = int(text.split("then BUDGET_S=${BUDGET_S:-")[1].split("}")[0])
    assert budget <= 540
    for g, parts in groups.items():
        assert sum(int(expect[p]) for p in parts) <= budget, g
    every = {"build", "tests", "engine", "demo", "step", "longctx", "prefill", "kernels", "moe", "attention", "tree",
             "allreduce"}
    assert set(sum((v for g, v in groups.items() if g != "call5"), [])) == every
    assert groups["call5"] == ["persistent", "edges", "pattn"]          # the executor's parts, not in the default


# ---- the benchmarks' main loops, with the GPU parts replaced (control flow, records, refusals) -------------
@pytest.fixture
def fake_gpu(monkeypatch):
    import _fake_cupy as fake
    fake.patch_modules(monkeypatch)
    monkeypatch.setattr(fake.runtime, "getDeviceProperties", lambda i: {"name": b"Fake H200"}, raising=False)
    monkeypatch.setattr(fake.runtime, "memGetInfo", lambda: (100 << 30, 141 * 10**9))
    import bench.ceilings
    import bench.step
    monkeypatch.setattr(bench.ceilings, "measure_read_bandwidth", lambda *a, **k: 4400.0)
    monkeypatch.setattr(bench.ceilings, "measure_mma_bf16_tflops", lambda *a, **k: 640.0)
    monkeypatch.setattr(bench.step, "fill_random", lambda *a, **k: None)
    return fake


class _FakePrefill:
    calls = []
    fail_chunk = None

    def __init__(self, models, chunk, graphs=True):
        self.chunk, self.graphs = int(chunk), graphs

    def run(self, slot, prompt, request, use_drafter):
        _FakePrefill.calls.append((self.chunk, len(prompt), use_drafter, list(request.prompt_ids) == list(prompt)))
        if self.chunk == _FakePrefill.fail_chunk:
            raise RuntimeError("out of shared memory")
        return len(prompt) % 1000


class _FakeEngine:
    made = []

    def __init__(self, tcfg, model_dir, dcfg, drafter_dir, **kw):
        import types
        self.kw, self.tcfg = kw, tcfg
        self.num_pages = -(-kw["kv_tokens"] // 64)
        self.max_pages_per_stream = -(-kw["max_context"] // 64)
        self.prefill_runner = _FakePrefill(None, kw["prefill_chunk"])
        self.models, self.stream = object(), types.SimpleNamespace(synchronize=lambda: None)
        w = types.SimpleNamespace(fc=np.zeros((16, 8), np.uint16), ctx_kv=np.zeros((2, 4, 8), np.uint16))
        self.drafter = types.SimpleNamespace(w=w, k_cache=[], v_cache=[])
        self.kv = types.SimpleNamespace(set_block_table=lambda t: setattr(self, "table", t.copy()),
                                        nbytes=lambda: self.num_pages * 61 * 64 * 1152)
        _FakeEngine.made.append(self)


@pytest.fixture
def fake_prefill_main(fake_gpu, monkeypatch):
    import ddtree_cupy.engine.gpu_engine as ge
    import ddtree_cupy.engine.step as es
    monkeypatch.setattr(ge, "GpuEngine", _FakeEngine)
    monkeypatch.setattr(es, "Prefill", _FakePrefill)
    _FakePrefill.calls, _FakePrefill.fail_chunk, _FakeEngine.made = [], None, []
    return prefill.main


def test_prefill_main_records_every_configuration(fake_prefill_main, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert fake_prefill_main(["--lengths", "300", "1024", "--chunks", "128", "512", "--reps", "2", "--layers", "3",
                              "--routing", "model", "--json", str(out)]) == 0
    eng = _FakeEngine.made[0]
    # the engine holds the largest chunk and the longest prompt + a chunk + a tree; one slot's pages in the table
    assert eng.kw["prefill_chunk"] == 512 and eng.kw["max_context"] == 1024 + 512 + 64 and eng.kw["max_streams"] == 1
    assert (eng.table[0] >= 0).sum() == -(-(1024 + 1 + 8) // 64)
    d = json.loads(out.read_text())
    assert [(r["length"], r["chunk"]) for r in d["results"]] == [(300, 128), (300, 512), (1024, 128), (1024, 512)]
    # per chunk one warm-up of one chunk, then reps timed runs of the whole prompt, the drafter appended
    warm = [c for c in _FakePrefill.calls if c[1] == c[0]]
    assert sorted(c[0] for c in warm) == [128, 512] and all(c[2] and c[3] for c in _FakePrefill.calls)
    assert sum(1 for c in _FakePrefill.calls if c[1] == 1024) == 4
    for r in d["results"]:
        assert r["first_token"] == r["length"] % 1000 and len(r["ttft_all_ms"]) == 2
        fl = prefill.prefill_floor(prefill.rank_costs(load_configs(3, 4096)[0], 8, 16 * 8 * 2 + 64 * 2, 16 * 8 + 64),
                                   r["length"], r["chunk"], 4400e9, 640e12)
        assert r["floor_ms"] == pytest.approx(fl["floor_s"] * 1e3)
    a = d["assumptions"]
    assert a["read_ceiling_GBps"] == 4400.0 and a["mma_bf16_TFLOPs"] == 640.0 and a["layers"] == 3
    assert set(d["best"]) == {"300", "1024"} and "| prompt | chunk | TTFT ms" in capsys.readouterr().out


def test_prefill_main_failure_and_budget(fake_prefill_main, tmp_path):
    out = tmp_path / "p.json"
    _FakePrefill.fail_chunk = 128
    fake_prefill_main(["--lengths", "300", "--chunks", "128", "256", "--reps", "1", "--layers", "3", "--routing",
                       "model", "--json", str(out)])
    d = json.loads(out.read_text())
    r128, r256 = d["results"]
    assert r128["error"].startswith("warm-up: RuntimeError: out of shared memory") and "ttft_ms" in r256
    _FakePrefill.fail_chunk = None
    fake_prefill_main(["--lengths", "300", "4096", "--chunks", "128", "--reps", "1", "--layers", "3", "--routing",
                       "model", "--budget-s", "0", "--json", str(out)])
    d = json.loads(out.read_text())
    assert "ttft_ms" in d["results"][0]                              # nothing measured yet: the first one runs
    assert d["results"][1]["skipped"].startswith("skipped: estimated")


def test_longctx_main_runs_groups_and_refuses_what_does_not_fit(fake_gpu, monkeypatch, tmp_path):
    with open(os.path.join(ROOT, "bench", "results", "step_h200.json")) as f:
        rec = json.load(f)
    calls = []

    def fake_call(cmd, cwd=None):
        args = cmd[cmd.index("bench.step") + 1:]
        ctx = int(args[args.index("--ctx") + 1])
        streams = [int(s) for s in args[args.index("--streams") + 1:args.index("--rows")]]
        calls.append((ctx, streams))
        res = []
        for S in streams:
            r = copy.deepcopy(next(x for x in rec["results"] if (x["streams"], x["rows"]) == (S if S != 2 else 1, 8)))
            r.update(ctx=ctx, streams=S, leave_one_out=dict(marginal_us_per_layer={"attention": 100.0}))
            res.append(r)
        with open(args[args.index("--json") + 1], "w") as f:
            json.dump({"assumptions": dict(rec["assumptions"], ctx=ctx), "results": res}, f)
        return 0
    monkeypatch.setattr(subprocess, "call", fake_call)
    out = tmp_path / "l.json"
    # 10 x 512K needs ~400 GB: refused with its numbers, the other groups run
    rc = longctx.main(["--groups", "32768:1,4,10", "524288:10", "131072:1", "--json", str(out)])
    assert rc == 1 and calls == [(32768, [1, 4, 10]), (131072, [1])]
    d = json.loads(out.read_text())
    assert [(r["ctx"], r["streams"]) for r in d["results"]] == [(32768, 1), (32768, 4), (32768, 10), (131072, 1)]
    bad = d["runs"][1]
    assert bad["ctx"] == 524288 and bad["error"].startswith("refused: needs ~") and "the GPU has 141 GB" in bad["error"]
    for r in d["results"]:
        s = r["attention_share"]
        step = r["step_pdl_ms"]
        assert s["measured_share"] == pytest.approx(61 * 0.1 / step)
        assert s["model_us_per_layer"] == pytest.approx(longctx.attention_model_us(
            r["streams"], 8, 8, r["ctx"] + 72, longctx.H200_ATTRS, "sm_90"))
    assert d["runs"][0]["memory"]["kv_tokens"] == 10 * (-(-(32768 + 72) // 64)) * 64
    assert [r["pro6000_fits"] for r in d["results"]] == [True, True, False, True]     # 10 x 32K: 23 GB of cache
    with pytest.raises(SystemExit, match="--rows"):
        longctx.main(["--rows", "1"])
