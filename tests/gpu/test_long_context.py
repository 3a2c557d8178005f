"""GPU: long context and chunked prefill, the paths bench/longctx.py and bench/prefill.py time.

* MLA attention over a 128K-token paged cache (1 stream x 8 tree rows) and 4 streams near 32K, the plan the
  engine makes for that context, against the float64 reference; outputs poisoned first.
* The engine's chunked prefill (``engine.step.Prefill``, graphs) of prompts that cross chunk boundaries, at
  rank shape with two layers: every prompt position's latent row written in every layer (the pool poisoned
  first), nothing past the prompt; layer 0's rows (a function of token and position only) equal for every
  chunk size; the drafter context written for every position.
* bench/prefill.py and bench/longctx.py end to end at two layers: every configuration measured, finite
  figures, floors below the times."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
from ddtree_cupy.reference import attention as ra

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POISON = 0xFFFF            # a bf16 NaN
SCALE = 0.14467963


def _case(rng, prefixes, n, H=8):
    S = len(prefixes)
    need = [-(-(s + n) // 64) for s in prefixes]
    num_pages = sum(need) + 3
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.full((S, max(need) + 1), -1, np.int32)
    k = 0
    for b in range(S):
        table[b, :need[b]] = perm[k:k + need[b]]
        k += need[b]
    pool = to_bf16_bits(rng.standard_normal((num_pages, 64, 576)))
    q = to_bf16_bits(rng.standard_normal((S * n, H, 576)) * 0.5)
    mask = np.zeros((S, 129, 5), np.uint32)
    for b in range(S):
        par = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int32)
        mask[b] = ra.ancestor_mask_bits(par, 129)
    return dict(q=q, pool=pool, table=table, prefix=np.array(prefixes, np.int32), n=np.full(S, n, np.int32),
                row_start=np.arange(S, dtype=np.int32) * n, mask=mask, max_kv=max(prefixes) + n + 64)


@pytest.mark.parametrize("prefixes", [[131072], [32768 - 5, 30001, 32768, 12345]])
def test_mla_attention_long_context_against_reference(prefixes):
    import cupy
    from ddtree_cupy.kernels import attention as A
    rng = np.random.default_rng(len(prefixes))
    c = _case(rng, prefixes, 8)
    S, H = len(prefixes), 8
    _, splits = A.plan_mla(S, 8, H, c["max_kv"])
    ws = A.MlaWorkspace(splits, S * 8, H) if splits > 1 else None
    d = {k: cupy.asarray(c[k]) for k in ("q", "pool", "table", "prefix", "n", "row_start", "mask")}
    out = cupy.full((S * 8, H, 512), POISON, dtype=cupy.uint16)
    A.mla_attention(d["q"], d["pool"], d["table"], d["prefix"], d["n"], d["row_start"], mask=d["mask"],
                    softmax_scale=SCALE, max_rows=8, max_kv_len=c["max_kv"], out=out, workspace=ws)
    got = bf16_bits_to_f32(out.get()).astype(np.float64)
    want = ra.mla_attention_ref(c["q"], c["pool"], c["table"], c["prefix"], c["n"], c["row_start"], SCALE,
                                c["mask"])
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-2, f"relative error {err:.3g} over {prefixes} (splits {splits})"
    # a wrong page or a dropped split would move every row: each row must match on its own
    per_row = np.linalg.norm(got - want, axis=(1, 2)) / np.linalg.norm(want, axis=(1, 2))
    assert per_row.max() < 2e-2


@pytest.fixture(scope="module")
def small_engine():
    """Rank 0 of TP 8 at two layers (layer 0 dense, layer 1 MoE; features at layer 1), prompts up to 4K."""
    from bench.step import RankComm, load_configs
    from ddtree_cupy.engine.gpu_engine import GpuEngine
    tcfg, dcfg = load_configs(2, 4096 + 512 + 64)
    eng = GpuEngine(tcfg, None, dcfg, None, comm=RankComm(0, 8), max_streams=1, max_budget=7,
                    kv_tokens=4096 + 512 + 128, random_weights=3, prefill_chunk=512, max_context=4096 + 512 + 64,
                    buckets=(1,))
    return eng


def _prefill_state(eng, chunk, prompt):
    import cupy
    from ddtree_cupy.engine.kv_pool import KVPool
    from ddtree_cupy.engine.step import Prefill
    from ddtree_cupy.reference.loop import Request
    pool = KVPool(eng.num_pages, 64, 1, eng.max_pages_per_stream, 8)
    slot = pool.admit(0, len(prompt), 1)
    eng.kv.set_block_table(pool.block_table)
    for p in eng.kv.pools:
        p.fill(POISON)
    for a in eng.drafter.k_cache + eng.drafter.v_cache:
        a.fill(POISON)
    runner = eng.prefill_runner if chunk == eng.prefill_runner.chunk else Prefill(eng.models, chunk, graphs=True)
    warm = list(prompt[:chunk])
    runner.run(slot, warm, Request(warm), True)              # captures the graph (as the benchmark's warm-up)
    for p in eng.kv.pools:
        p.fill(POISON)
    for a in eng.drafter.k_cache + eng.drafter.v_cache:
        a.fill(POISON)
    tok = runner.run(slot, list(prompt), Request(list(prompt)), True)
    cupy.cuda.Device().synchronize()
    pages = pool.block_table[slot]
    pages = pages[pages >= 0]
    rows = [eng.kv.pools[i][cupy.asarray(pages)].reshape(-1, 576).get() for i in range(len(eng.kv.pools))]
    dk = [k[slot].get() for k in eng.drafter.k_cache]
    return tok, rows, dk


def test_chunked_prefill_writes_every_position(small_engine):
    eng = small_engine
    P = 2 * 512 + 300 + 37                       # crosses chunk boundaries of every size below
    # tokens of rank 0's vocabulary slice: their embedding rows are nonzero here (the others are zero until the
    # all-reduce, a no-op at one rank), so every position's layer-0 row differs
    prompt = np.random.default_rng(11).integers(0, eng.tcfg.vocab_size // 8, P).astype(np.int32)
    layer0 = {}
    for chunk in (512, 128, 200):
        tok, rows, dk = _prefill_state(eng, chunk, prompt)
        assert 0 <= tok < eng.tcfg.vocab_size
        for i, r in enumerate(rows):
            written = r[:P] != POISON
            assert written.all(), f"chunk {chunk}: layer {i} rows {np.where(~written.all(1))[0][:8]} not written"
            assert (r[P:] == POISON).all(), f"chunk {chunk}: layer {i} written past the prompt"
            assert np.isfinite(bf16_bits_to_f32(r[:P])).all()
        for l, k in enumerate(dk):               # drafter context ring [C, hkv, 128]: every prompt position
            assert (k[:P] != POISON).all(), f"chunk {chunk}: drafter layer {l} context not written"
        layer0[chunk] = bf16_bits_to_f32(rows[0][:P]).astype(np.float64)
    for chunk in (128, 200):
        err = np.linalg.norm(layer0[chunk] - layer0[512]) / np.linalg.norm(layer0[512])
        assert err < 1e-2, f"layer 0 latent rows with chunk {chunk} differ from chunk 512 by {err:.3g}"


def _run_bench(args, tmp_path, name):
    out = tmp_path / f"{name}.json"
    p = subprocess.run([sys.executable, "-m", f"bench.{name}", *args, "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    with open(out) as f:
        return json.load(f), p.stdout


def test_prefill_benchmark_end_to_end(tmp_path):
    d, out = _run_bench(["--layers", "2", "--lengths", "300", "2048", "--chunks", "128", "512", "--reps", "1"],
                        tmp_path, "prefill")
    assert len(d["results"]) == 4
    for r in d["results"]:
        assert "ttft_ms" in r, r
        assert r["floor_ms"] > 0 and r["ttft_ms"] > r["floor_ms"] * 0.9, r      # a floor, not a target
        assert r["chunks"] == -(-r["length"] // r["chunk"])
        assert 0 <= r["first_token"] < 163840
    assert set(d["best"]) == {"300", "2048"} and "| prompt | chunk |" in out


def test_longctx_benchmark_end_to_end(tmp_path):
    d, out = _run_bench(["--layers", "2", "--groups", "8192:1,2", "16384:1", "--reps", "2"], tmp_path, "longctx")
    assert [(r["ctx"], r["streams"]) for r in d["results"]] == [(8192, 1), (8192, 2), (16384, 1)]
    for r in d["results"]:
        s = r["attention_share"]
        assert s["step_ms"] > 0.9 * r["floor_ms"] and 0 < s["bytes_share"] < 1
        assert s["measured_us_per_layer"] is not None and s["model_us_per_layer"] > 0
    assert all(not run.get("error") for run in d["runs"]) and "| ctx | streams |" in out
