"""The profiling API's bookkeeping on the CPU (docs/PROFILING.md): CuPy is the numpy stand-in of
tests/_fake_cupy.py, the target and drafter are the engine tests' toy models (tests/_engine_toys.py) (the target given the real layer
stage sequence, each stage one emulated kernel launch), the ceilings a fixed pair (no kernels to measure
with). Checked: the block table and control block the session sets up, the stream its graphs run on, the
floor arithmetic against sums written out by hand, kernel selection, the timeline / Chrome trace, errors
naming the problem, the CLI's --profile, and docs/PROFILING.md's example run as written."""
from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest

import _engine_toys as emu
import _kernel_emul
from _engine_toys import fake_gpu  # noqa: F401  (the fixture)

from ddtree_cupy.profiling.ceilings import Ceilings
from ddtree_cupy.profiling.floors import Floor, StepFloors, expected_unique_experts
from ddtree_cupy.reference.loop import DecodeLoop, Request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIMI = os.path.join(ROOT, "tests", "data", "kimi-k2.6-text.json")
KIMI_DRAFTER = os.path.join(ROOT, "tests", "data", "kimi-k2.5-dflash-drafter.json")
CEIL = Ceilings(4000.0, 600.0, "emulated")


def _kimi(layers=4):
    from ddtree_cupy.profiling.session import load_configs
    return load_configs(KIMI, KIMI_DRAFTER, layers, 4096)


# ---------------------------------------------------------------------------------------------------
# floors: hand sums
# ---------------------------------------------------------------------------------------------------
def test_expected_unique_experts():
    assert expected_unique_experts(384, 8, 0) == 0
    assert expected_unique_experts(384, 8, 1) == pytest.approx(8)
    rng = np.random.default_rng(0)
    for rows in (8, 40):
        sim = np.mean([np.unique(np.concatenate([rng.choice(384, 8, replace=False) for _ in range(rows)])).size
                       for _ in range(300)])
        assert expected_unique_experts(384, 8, rows) == pytest.approx(sim, rel=0.02)
    with pytest.raises(ValueError, match="0 < k <= E"):
        expected_unique_experts(8, 9, 1)


def test_floor_arithmetic_kimi_tp8():
    tcfg, dcfg = _kimi(4)
    S, R, ctx = 2, 8, 1000
    f = StepFloors(tcfg, 8, S, R, ctx, dcfg, drafter_weight_bytes=123456)
    T, H = S * R, 7168
    # one rank's expert shard: INT4 gate|up [2I, H] and down [H, I] plus one bf16 scale per 32 weights
    I = 2048 // 8
    assert f.expert_bytes(1) == 3 * H * I // 2 + 3 * H * I // 32 * 2
    assert f.stage(1, "qkv_a_gemm") == Floor((1536 + 576) * H * 2.0, 2.0 * T * (1536 + 576) * H)
    assert f.stage(0, "gate_up_gemm").bytes == 2 * (18432 // 8) * H * 2
    nh = 64 // 8
    att = f.stage(2, "attention")
    assert att.bytes == S * (ctx + R) * 1152
    assert att.flops == 2.0 * T * nh * (ctx + R) * (512 + 64 + 512)
    moe = f.stage(1, "moe", unique_experts=50)
    assert moe.bytes == 50 * f.expert_bytes(1) and moe.flops == 2.0 * T * 8 * 3 * H * I
    assert f.stage(1, "moe").bytes == pytest.approx(expected_unique_experts(384, 8, T) * f.expert_bytes(1))
    # a layer is the sum of its stages; the verify phase adds lm_head (weights + fp32 logits) and the argmax read
    names = f.stage_names(1)
    assert names[:9] == ["input_norm", "qkv_a_gemm", "qkv_a_post", "q_b_gemm", "w_uk_rope", "attention", "w_uv",
                         "o_proj", "post_norm"] and names[-1] == "moe"
    assert f.stage_names(0)[-3:] == ["gate_up_gemm", "silu", "down_gemm"]
    layers = [f.layer(i) for i in range(4)]
    for i in range(4):
        assert layers[i].bytes == pytest.approx(sum(f.stage(i, n).bytes for n in f.stage_names(i)))
    V = 163840 // 8
    lm = Floor(V * H * 2.0 + T * V * 4, 2.0 * T * V * H)
    assert f.lm_head(T) == lm
    v = f.verify()
    assert v.bytes == pytest.approx(sum(x.bytes for x in layers) + lm.bytes + T * V * 4)
    # draft: drafter weights, its context (window = ctx, 1 kv head per rank, k and v, 6 layers), lm_head x 7 rows
    d = f.draft()
    assert d.bytes == pytest.approx(123456 + S * ctx * 1 * 128 * 2 * 2 * 6 + V * H * 2 + S * 7 * V * 4)
    assert f.tree().bytes == S * 7 * V * 4
    assert f.step().bytes == pytest.approx(sum(p.bytes for p in f.phases().values()))
    # floor time: the larger of the two ceilings' times
    g = Floor(4e9, 6e12)
    assert g.seconds(CEIL) == pytest.approx(10e-3) and g.bound(CEIL) == "compute"
    assert Floor(8e9, 1.0).seconds(CEIL) == pytest.approx(2e-3) and Floor(8e9, 1.0).bound(CEIL) == "memory"
    with pytest.raises(ValueError, match="unknown stage"):
        f.stage(1, "qkv_gemm")
    with pytest.raises(ValueError, match="dense"):
        f.stage(0, "moe")
    with pytest.raises(ValueError, match="2 unique-expert counts for 3 MoE layers"):
        f.verify([1, 2])
    with pytest.raises(ValueError, match="positive"):
        Ceilings(0.0, 1.0)


# ---------------------------------------------------------------------------------------------------
# the session through the emulator
# ---------------------------------------------------------------------------------------------------
def _stage_kernel(name):
    return "fake_" + name


class StagedTarget(emu.FakeGpuTarget):
    """The toy target with GpuTarget's layer stage sequence: each stage one emulated launch (through the
    engine-glue wrapper module, so launch counting and kernel selection see it), logged when it runs."""
    log: list = []

    def layer_stages(self, i, batch, kv):
        from ddtree_cupy.kernels import engine_glue as kg
        f = StepFloors(self.cfg, getattr(self.comm, "size", 1), batch.S, batch.R, 1)
        out = []
        for n in f.stage_names(i, shared_down_fused=True):
            def fn(n=n):
                kg.get_kernel(None, _stage_kernel(n))((1,), (32,), (i,))
            out.append((n, fn))
        return out

    def forward(self, batch, kv):
        for i in range(self.cfg.num_hidden_layers):
            for _, fn in self.layer_stages(i, batch, kv):
                fn()
        super().forward(batch, kv)


class FilledDrafter(emu.FakeGpuDrafter):
    """The toy drafter with a context already holding ctx tokens (the session fills the real one's cache)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.ctx[:] = 0


@pytest.fixture()
def emulated(fake_gpu, monkeypatch):  # noqa: F811
    from ddtree_cupy.models import drafter as md
    from ddtree_cupy.models import target as mt
    from ddtree_cupy.profiling import session
    monkeypatch.setattr(mt, "GpuTarget", StagedTarget)
    monkeypatch.setattr(md, "GpuDrafter", FilledDrafter)
    monkeypatch.setattr(session, "measure_ceilings", lambda *a, **k: CEIL)
    ran = []
    for n in ("input_norm", "qkv_a_gemm", "qkv_a_post", "q_b_gemm", "w_uk_rope", "attention", "w_uv", "o_proj",
              "post_norm", "gate_up_gemm", "silu", "down_gemm", "router_gate_up_gemm", "route_silu_down", "moe"):
        monkeypatch.setitem(_kernel_emul.ENGINE_KERNELS, _stage_kernel(n), lambda layer, n=n: ran.append((int(layer), n)))
    yield ran


def _session(**kw):
    from ddtree_cupy.profiling import ProfileSession
    args = dict(tp=8, rank=0, layers=3, streams=3, rows=5, ctx=200)
    args.update(kw)
    return ProfileSession.random(KIMI, KIMI_DRAFTER, **args)


def test_session_setup_block_table_and_control(emulated):
    from ddtree_cupy.kernels import engine_glue as g
    ps = _session()
    eng = ps.eng
    assert eng.comm.size == 8 and eng.comm.rank == 0 and eng.tcfg.num_hidden_layers == 3
    # block table: streams 0..2 each hold ceil((200 + 1 + 5) / 64) = 4 distinct pages, the device copy matches
    bt = ps.block_table
    assert np.array_equal(np.asarray(eng.kv.block_table), bt)
    used = bt[:3, :4]
    assert (used >= 0).all() and len(set(used.ravel().tolist())) == 12 and (bt[:3, 4:] == -1).all()
    assert (bt[3:] == -1).all()
    # the cache was filled with random (non-zero, finite) bf16 rows
    assert all(np.asarray(p).any() for p in eng.kv.pools)
    # the control block: every stream active at ctx with budget rows - 1, round 1
    c = np.asarray(ps.decode.ctrl)
    assert (c[g.CTRL_PREFIX] == 200).all() and (c[g.CTRL_ACTIVE] == 1).all() and (c[g.CTRL_BUDGET] == 4).all()
    assert (c[g.CTRL_STEP] == 1).all()
    # one stream object for engine, step and session; the step was captured on it
    assert ps.stream is eng.stream is eng.models.stream and ps.decode.graph is not None
    assert ps.decode.S == 3 and ps.decode.R == 5
    assert ps.phase_names() == ["draft", "tree", "verify", "accept"]
    assert ps.stage_names(0)[-1] == "down_gemm" and ps.stage_names(1)[-1] == "moe" and ps.moe_layer() == 1
    ps.close()


def test_session_timings_and_floors(emulated):
    ran = emulated
    ps = _session()
    t = ps.step(reps=4)
    # emulated events: every elapsed time is 0.01 ms; the step time is that over the back-to-back replays
    assert t.seconds == pytest.approx(0.01e-3 / 4)
    want = ps.floors.step(None)                 # the toy router records nothing: the uniform expectation
    assert t.floor == want and t.x_floor == pytest.approx(t.us / (want.seconds(CEIL) * 1e6))
    ph = ps.phases()
    assert list(ph) == ["draft", "tree", "verify", "accept"]
    assert ph["verify"].floor == ps.floors.verify() and ph["draft"].floor == ps.floors.draft()
    lt = ps.layer(1)
    assert lt.floor == ps.floors.layer(1, None, ps.stage_names(1))
    st = ps.stage(1, "attention")
    assert st.floor == ps.floors.stage(1, "attention")
    # the layer graph replays exactly that layer's stages
    ran.clear()
    ps.layer(2, iters=1, reps=1)
    assert {x[0] for x in ran} == {2} and [n for _, n in ran[:len(ps.stage_names(2))]] == ps.stage_names(2)
    # one kernel: only its launches are in the graph
    ran.clear()
    k = ps.kernel("fake_attention", layer=2, iters=1, reps=1)
    n = len(ps.stage_names(2))          # kernel() first counts the launches of every stage once, eagerly
    assert [x[1] for x in ran[:n]] == ps.stage_names(2)
    assert len(ran) > n and set(ran[n:]) == {(2, "attention")}
    assert k.floor == ps.floors.stage(2, "attention") and "1 launch" in k.note
    kt = ps.kernel("ddt_build_tree", iters=1, reps=1)
    assert kt.floor is None and "in tree" in kt.note
    launches = ps.kernels(1)
    assert launches["layer 1 moe"] == {"fake_moe": 1} and "ddt_build_tree" in launches["tree"]
    # a stage without weights or cache has no floor, and says so
    assert "no floor: it reads no weights or cache" in str(ps.stage(0, "silu"))
    # the same engine profiled autoregressively (root-only trees, no draft phase)
    from ddtree_cupy.profiling import ProfileSession
    ar = ProfileSession(ps.eng, streams=2, rows=1, ctx=100, mode="ar")
    assert ar.phase_names() == ["tree", "verify", "accept"] and ar.decode.R == 1
    pa = ar.phases()
    assert "no floor" in str(pa["tree"]) and pa["verify"].floor == ar.floors.verify()
    assert ar.block_table[:2, :2].min() >= 0 and (ar.block_table[:2, 2:] == -1).all()
    # the state a replay reads is restored after every measurement
    from ddtree_cupy.kernels import engine_glue as g
    ps2 = _session()
    assert (np.asarray(ps2.decode.ctrl)[g.CTRL_PREFIX] == 200).all()
    ps2.kernel("fake_moe", iters=1, reps=1)
    ps2.timeline()
    assert (np.asarray(ps2.decode.ctrl)[g.CTRL_PREFIX] == 200).all()
    ps.close()
    ps2.close()


def test_timeline_table_and_trace(emulated, tmp_path):
    from ddtree_cupy.profiling.trace import chrome_trace, write_chrome_trace
    ps = _session(layers=2, streams=1, rows=3, ctx=70)
    tl = ps.timeline()
    names = [e["name"] for e in tl]
    stages = [f"L{i}.{n}" for i in range(2) for n in ps.stage_names(i)]
    assert names == ["draft", "tree", "verify"] + stages + ["verify.tail", "accept"]
    assert all(e["dur_us"] == pytest.approx(10.0) for e in tl)
    tab = ps.layer_table(iters=1, reps=1, timeline=tl)
    assert [r["layer"] for r in tab.rows] == [0, 1] and [r["kind"] for r in tab.rows] == ["dense", "MoE"]
    assert tab.rows[1]["in_step_us"] == pytest.approx(10.0 * len(ps.stage_names(1)))
    text = str(tab)
    assert "| layer | kind | graph_us |" in text and "verify phase as one graph" in text
    tr = chrome_trace(tl)
    ev = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in ev] == names and {e["tid"] for e in ev} == {1, 2}
    p = tmp_path / "t.json"
    write_chrome_trace(str(p), tl, extra={"k": 1})
    back = json.loads(p.read_text())
    assert back["otherData"] == {"k": 1} and len(back["traceEvents"]) == len(tr["traceEvents"])
    with pytest.raises(ValueError, match="negative duration"):
        chrome_trace([dict(name="x", start_us=0, dur_us=-1)])
    ps.close()


def test_session_errors_name_the_problem(emulated):
    from ddtree_cupy.profiling import ProfileSession
    ps = _session(layers=2, streams=1, rows=3, ctx=70)
    with pytest.raises(ValueError, match="layer must be in 0..1"):
        ps.layer(2)
    with pytest.raises(ValueError, match="unknown phase 'verfy'"):
        ps.phase("verfy")
    with pytest.raises(ValueError, match="has no stage 'moe'"):
        ps.stage(0, "moe")
    with pytest.raises(ValueError, match="no kernel 'nope'"):
        ps.kernel("nope")
    with pytest.raises(ValueError, match="names several kernels"):
        ps.kernel("fake_", layer=1)
    with pytest.raises(ValueError, match="max_streams"):
        ProfileSession(ps.eng, streams=2, rows=3, ctx=70)
    with pytest.raises(ValueError, match="cache capacity"):
        ProfileSession(ps.eng, streams=1, rows=3, ctx=10_000)
    with pytest.raises(ValueError, match="verifies 1 rows"):
        ProfileSession(ps.eng, streams=1, rows=3, ctx=70, mode="ar")
    with pytest.raises(ValueError, match="layers must be an integer"):
        _session(layers=0)
    with pytest.raises(ValueError, match="no config at"):
        ProfileSession.random("no/such/config.json")
    ps.close()


def test_cli_profile_through_cupy_backend(emulated, monkeypatch, tmp_path, capsys):
    from types import SimpleNamespace

    from ddtree_cupy.models import drafter as md
    from ddtree_cupy.models import weights as mw
    from ddtree_cupy.run import main
    from ddtree_cupy.tinymodel import ensure_tiny_checkpoints
    tdir, ddir = ensure_tiny_checkpoints(str(tmp_path), spec=emu.SPEC)
    monkeypatch.setattr(mw.GpuTargetWeights, "from_checkpoint", staticmethod(lambda *a, **k: SimpleNamespace()))
    monkeypatch.setattr(md.GpuDrafterWeights, "from_checkpoint", staticmethod(lambda *a, **k: SimpleNamespace()))
    from ddtree_cupy.profiling import cli
    monkeypatch.setattr(cli, "ProfileSession", None, raising=False)      # the hook imports its own
    trace = tmp_path / "trace.json"
    rc = main(["--model", tdir, "--drafter", ddir, "--prompt-ids", "5,6,7", "--prompt-ids", "9,10",
               "--max-new-tokens", "12", "--backend", "cupy", "--json", "--ignore-eos", "--budget", "6",
               "--profile", "--profile-trace", str(trace)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    js = json.loads(out.out.strip().splitlines()[-1])
    prof = js["stats"]["profile"]
    assert prof["shape"]["streams"] == 2 and prof["shape"]["rows"] == 7 and prof["shape"]["layers"] == 4
    assert prof["shape"]["ctx"] == (3 + 12 + 2 + 12) // 2
    assert set(prof["phases"]) == {"draft", "tree", "verify", "accept"} and len(prof["layers"]["rows"]) == 4
    assert "step graph" in out.err and "| layer | kind |" in out.err
    tr = json.loads(trace.read_text())
    assert any(e.get("name") == "L3.moe" for e in tr["traceEvents"])
    # the run's tokens are those of a run without --profile
    want = DecodeLoop(*emu.make()[1:], "ddtree", 6).run([Request([5, 6, 7], 12), Request([9, 10], 12)])
    assert [s["output_ids"] for s in js["streams"]] == [s.output_ids for s in want.streams]


def test_cli_profile_on_numpy_backend_says_so(capsys):
    from ddtree_cupy.run import main
    rc = main(["--demo", "--backend", "numpy", "--max-new-tokens", "2", "--profile"])
    assert rc == 0
    assert "--profile: GPU times need the cupy backend" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# the documentation's examples, as written
# ---------------------------------------------------------------------------------------------------
def doc_examples(path):
    with open(path) as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_profiling_doc_example_runs_as_written(emulated, monkeypatch, capsys):
    blocks = doc_examples(os.path.join(ROOT, "docs", "PROFILING.md"))
    assert blocks, "docs/PROFILING.md has no python example"
    monkeypatch.chdir(ROOT)
    for code in blocks:
        ns = {}
        exec(compile(code, "docs/PROFILING.md", "exec"), ns)
        out = capsys.readouterr().out
        assert "x" in out and "floor" in out and "| layer | kind |" in out
        ns["ps"].close()


def test_engine_doc_points_to_profiling_doc():
    with open(os.path.join(ROOT, "docs", "ENGINE.md")) as f:
        text = f.read()
    assert "PROFILING.md" in text
    assert "tdir" not in text.split("## Profiling")[-1].split("##")[0]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_session_without_a_gpu_says_there_is_none(monkeypatch):
    """Without a usable GPU a session is refused with the reason in words (CuPy's own error on a machine
    without a GPU would speak of an insufficient driver)."""
    from ddtree_cupy import backend
    from ddtree_cupy.profiling import ProfileSession
    monkeypatch.setattr(backend, "gpu_status", lambda: (False, "no CUDA GPU found"))
    with pytest.raises(backend.BackendError, match="ProfileSession.random needs a CUDA GPU: no CUDA GPU found"):
        ProfileSession.random(KIMI, KIMI_DRAFTER, layers=1)
    from ddtree_cupy.tinymodel import ensure_tiny_checkpoints
    tdir, ddir = ensure_tiny_checkpoints()
    with pytest.raises(backend.BackendError, match="ProfileSession.from_checkpoint needs a CUDA GPU"):
        ProfileSession.from_checkpoint(tdir, ddir)
