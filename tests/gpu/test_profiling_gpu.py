"""The profiling API on a GPU (docs/PROFILING.md): the documentation's example as written, and a session's
step and phase times printed next to bench/step.py's for the same shape (4 layers of rank 0 of TP 8, 1 stream
x 8 rows at 4K context, uniform routing, the engine's PDL graph). Times are printed, never asserted; what is
asserted is that every piece was measured (finite, positive) and that the bookkeeping matches the step.

    PYTHONPATH=$PWD python3 -m pytest -q -s -m gpu tests/gpu/test_profiling_gpu.py
"""
from __future__ import annotations

import gc
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KIMI = os.path.join(ROOT, "tests", "data", "kimi-k2.6-text.json")
KIMI_DRAFTER = os.path.join(ROOT, "tests", "data", "kimi-k2.5-dflash-drafter.json")


def _free():
    import cupy
    gc.collect()
    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()


def _ok(t):
    return math.isfinite(t.us) and t.us > 0 and (t.floor_us is None or t.floor_us > 0)


@pytest.mark.big_gpu(gb=9)
def test_profiling_doc_example_on_gpu(monkeypatch, capsys):
    with open(os.path.join(ROOT, "docs", "PROFILING.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert blocks
    monkeypatch.chdir(ROOT)
    for code in blocks:
        ns = {}
        exec(compile(code, "docs/PROFILING.md", "exec"), ns)
        ps = ns["ps"]
        out = capsys.readouterr().out
        with capsys.disabled():
            print("\n" + out)
        assert "| layer | kind |" in out and out.count("\n| ") >= 5
        t = ps.layer_table(iters=2, reps=2)
        assert [r["layer"] for r in t.rows] == [0, 1, 2, 3]
        assert all(r["graph_us"] > 0 and r["in_step_us"] > 0 and r["floor_us"] > 0 for r in t.rows)
        ps.close()
        del ns, ps, t
        _free()


@pytest.mark.big_gpu(gb=9)
def test_session_next_to_bench_step(tmp_path, capsys):
    from ddtree_cupy.profiling import ProfileSession
    out_json = tmp_path / "step.json"
    r = subprocess.run([sys.executable, "-m", "bench.step", "--layers", "4", "--streams", "1", "--rows", "8",
                        "--ctx", "4096", "--reps", "10", "--stages", "0", "--pdl", "1", "--json", str(out_json)],
                       cwd=ROOT, capture_output=True, text=True, timeout=400,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    bench = json.loads(out_json.read_text())["results"][0]
    ps = ProfileSession.random(KIMI, KIMI_DRAFTER, tp=8, rank=0, layers=4, streams=1, rows=8, ctx=4096)
    try:
        step = ps.step(reps=10)
        phases = ps.phases()
        assert _ok(step) and all(_ok(t) for t in phases.values())
        with capsys.disabled():
            print(f"\n{ps.ceilings}")
            pdl = "-" if bench["step_pdl_ms"] is None else f"{bench['step_pdl_ms']:.3f}"
            print(f"step: session {step.us / 1e3:.3f} ms ({'PDL' if ps.decode.pdl else 'plain'} graph) | bench.step "
                  f"plain {bench['step_ms']:.3f} ms, PDL {pdl} ms | floor: session "
                  f"{step.floor_us / 1e3:.3f} ms, bench.step {bench['floor_ms']:.3f} ms")
            for k, t in phases.items():
                print(f"phase {k}: session {t.us / 1e3:.3f} ms | bench.step {bench['phases_ms'][k]:.3f} ms | "
                      f"floor {t.floor_us / 1e3:.3f} ms")
            print(f"unique experts per MoE layer: session {ps.unique_experts()} | bench.step "
                  f"{bench['unique_experts_per_layer']}")
        # the routing the floors use is what the MoE kernels read: k distinct experts per row, > k in all
        assert len(ps.unique_experts()) == 3 and all(8 <= u <= 64 for u in ps.unique_experts())
        # the real kernels of layer 1: each one alone, against its stage's floor where it is the stage's only one
        launches = ps.kernels(1)
        assert launches["layer 1 moe"] and "ddt_build_tree" in launches["tree"]
        name = next(iter(launches["layer 1 q_b_gemm"]))
        k = ps.kernel(name, layer=1)
        assert _ok(k)
        tl = ps.timeline()
        assert [e["name"] for e in tl][:3] == ["draft", "tree", "verify"] and all(e["dur_us"] >= 0 for e in tl)
        loo = ps.loo(reps=2)
        assert set(loo["marginal_us_per_layer"]) == set(ps.stage_names(1))
        with capsys.disabled():
            print(k)
            print(ps.stage_table(1))
            print("leave-one-out us per layer: " + " ".join(f"{n} {v:.1f}" for n, v in
                                                          loo["marginal_us_per_layer"].items()))
        bt = ps.block_table
        assert (bt[0, :-(-(4096 + 1 + 8) // 64)] >= 0).all() and np.array_equal(ps.eng.kv.block_table.get(), bt)
    finally:
        ps.close()
        del ps
        _free()


def test_cli_profile_on_the_demo(tmp_path):
    """``--profile --profile-trace`` on the tiny demo checkpoints: the report is in the JSON, the trace written."""
    trace = tmp_path / "trace.json"
    r = subprocess.run([sys.executable, "-m", "ddtree_cupy.run", "--demo", "--backend", "cupy", "--json",
                        "--max-new-tokens", "32", "--profile", "--profile-trace", str(trace)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    print(r.stderr[-4000:])
    prof = json.loads(r.stdout.strip().splitlines()[-1])["stats"]["profile"]
    assert prof["step"]["us"] > 0 and set(prof["phases"]) == {"draft", "tree", "verify", "accept"}
    assert len(prof["layers"]["rows"]) == prof["shape"]["layers"] and "| layer | kind |" in r.stderr
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert events and all(e["dur"] >= 0 for e in events)


def test_memory_limit_emulation():
    """Under CUPY_GPU_MEMORY_LIMIT (how bench/ci_gpu.sh --limit-gb emulates a small card): the engine's free
    memory stays within the limit, an allocation past it fails, and a big_gpu test skips with its reason."""
    env = dict(os.environ, PYTHONPATH=ROOT, CUPY_GPU_MEMORY_LIMIT=str(1 << 30))
    code = ("import cupy\nfrom ddtree_cupy.engine.gpu_engine import free_device_bytes\n"
            "assert 0 < free_device_bytes() <= 1 << 30, free_device_bytes()\n"
            "try:\n    cupy.empty(3 << 29, cupy.uint8)\nexcept cupy.cuda.memory.OutOfMemoryError:\n    print('LIMIT OK')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "LIMIT OK" in r.stdout, (r.stdout + r.stderr)[-2000:]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider",
                        "tests/gpu/test_profiling_gpu.py::test_profiling_doc_example_on_gpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "1 skipped" in r.stdout and "needs about 9 GB" in r.stdout, r.stdout[-2000:]
