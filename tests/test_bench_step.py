"""bench/step.py's uniform-routing override (CPU, with the numpy stand-in for CuPy): what the MoE reads."""
import numpy as np
import pytest

import _fake_cupy as fake


@pytest.fixture
def routing(monkeypatch):
    fake.patch_modules(monkeypatch)
    from ddtree_cupy.kernels import moe as moe_mod
    seen = []
    monkeypatch.setattr(moe_mod, "moe_forward", lambda x, ids, wts, experts, ws, out=None, residual=None:
                        seen.append((experts, np.asarray(ids).copy())))
    from bench.step import UniformRouting
    return UniformRouting(E=384, k=8, seed=3), moe_mod, seen


def test_uniform_tables_per_layer_and_reused(routing):
    u, moe_mod, seen = routing
    ids = fake.cp.full((8, 8), 5, np.int32)              # the router's collapsed choice: expert 5 for all
    layers = [object(), object()]
    with u:
        assert moe_mod.moe_forward is not u.orig
        for _ in range(2):                                 # warm-up, then "replay"
            for L in layers:
                moe_mod.moe_forward(None, ids, None, L, None, out=None)
    assert moe_mod.moe_forward is u.orig                 # restored
    assert len(seen) == 4 and len(u.tables) == 2
    t0, t1 = seen[0][1], seen[1][1]
    assert not np.array_equal(t0, t1)                     # one table per layer
    np.testing.assert_array_equal(seen[2][1], t0)         # reused on the next call of the same layer
    for t in (t0, t1):
        assert t.shape == (8, 8) and t.dtype == np.int32
        assert all(len(set(r)) == 8 for r in t.tolist())  # distinct experts per row, like top-8
        assert t.min() >= 0 and t.max() < 384
    # 8 rows x 8 distinct of 384: ~60 unique expected, far from the collapsed 8
    assert np.unique(t0).size > 40


def test_uniform_tables_keep_padding_rows_expert_free(routing):
    """Rows the router marked as padding (ids -1) stay without experts in the table the MoE reads."""
    u, moe_mod, seen = routing
    host = np.full((6, 8), 7, np.int32)
    host[[1, 4]] = -1
    with u:
        moe_mod.moe_forward(None, fake.cp.asarray(host), None, object(), None, out=None)
    got, table = seen[0][1], list(u.tables.values())[0][1]
    assert (got[[1, 4]] == -1).all()
    real = [0, 2, 3, 5]
    np.testing.assert_array_equal(got[real], table[real])


def test_budget_projection_from_measured_records():
    from bench.step import budget_projection, cost_tables
    recs = [dict(streams=S, rows=R, step_ms=3 + 0.3 * S * R, step_pdl_ms=None, pro6000_step_ms=4 + 0.4 * S * R,
                 phases_ms={"draft": 0.5, "tree": 0.1}) for S in (1, 4) for R in (1, 5, 9, 17)]
    here, pro = cost_tables(recs)
    assert here.draft_s(4, 36) == pytest.approx((3 + 0.3 * 36) * 1e-3)
    assert pro.root_s(1) == pytest.approx(4.4e-3 * (1 - 0.6 / 3.3))
    rows = budget_projection(pro, [1, 4], [4, 8, 16], [0.89, 0.75, 0.57, 0.49, 0.41, 0.34, 0.28], (0.5, 1.0),
                             steps=60)
    assert len(rows) == 4
    for r in rows:
        assert set(r["tok_s"]) == {"ar", "b4", "b8", "b16", "auto"} and all(v > 0 for v in r["tok_s"].values())
        assert r["tau"]["ar"] == 1.0 and r["tau"]["b16"] >= r["tau"]["b4"]
    good = [r for r in rows if r["scale"] == 1.0 and r["streams"] == 1][0]
    assert good["tok_s"]["auto"] > good["tok_s"]["ar"]


def test_uniform_table_refused_during_capture(routing):
    u, moe_mod, _ = routing
    st, ids = fake.cp.cuda.Stream(), fake.cp.full((4, 8), 1, np.int32)
    with u, st:
        st.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="first needed during capture"):
                moe_mod.moe_forward(None, ids, None, object(), None)
        finally:
            st.end_capture()


class _FakeNccl:
    """Stands in for ``dist.NcclComm`` of N ranks: all-reduce doubles (as if a peer held the same values),
    all-gather writes rank r's part as x + r."""

    def __init__(self, size):
        self.size, self.rank, self.calls = size, 0, []

    def all_reduce(self, x):
        self.calls.append("reduce")
        x *= 2
        return x

    def all_gather_into(self, x, out):
        self.calls.append("gather")
        assert out.shape == (self.size,) + x.shape
        for r in range(self.size):
            out[r] = x + r
        return out


def test_live_rank_comm_real_and_noop(monkeypatch):
    fake.patch_modules(monkeypatch)
    from bench.step import LiveRankComm
    real = _FakeNccl(2)
    c = LiveRankComm(real)
    assert (c.rank, c.size) == (0, 8)                     # shapes of rank 0 of TP 8
    x = fake.cp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3) + 1)
    np.testing.assert_array_equal(c.all_reduce(x), 2 * (np.arange(6).reshape(2, 3) + 1))
    g = c.all_gather(x)
    assert g.shape == (8, 2, 3)
    np.testing.assert_array_equal(g[1], x + 1)            # a peer's part, from the real gather
    for r in (0, 2, 7):                                   # this rank's part, and the absent ranks' slots
        np.testing.assert_array_equal(g[r], x)
    assert c.all_gather(x) is g                           # the same buffer on every call (graph-safe)
    c.live = False                                        # off: no-ops, still counted
    before = x.copy()
    c.all_reduce(x)
    np.testing.assert_array_equal(x, before)
    assert real.calls == ["reduce", "gather", "gather"] and (c.n_reduce, c.n_gather) == (2, 2)
    with pytest.raises(ValueError, match="rank shapes are TP 8"):
        LiveRankComm(_FakeNccl(9))


def test_projection_terms():
    from bench.step import PRO6000_BW, project_pro6000
    # memory-bound part scales with bandwidth; latency per collective; ring bus bytes 2 (tp-1)/tp
    assert project_pro6000(1e-3, PRO6000_BW, 0, 0, 24.0, 40.0) == pytest.approx(1e-3)
    assert project_pro6000(1e-3, 2 * PRO6000_BW, 0, 0, 24.0, 40.0) == pytest.approx(2e-3)
    assert project_pro6000(0.0, PRO6000_BW, 100, 0, 24.0, 40.0) == pytest.approx(2.4e-3)
    # 137 all-reduces of 8 rows x 7168 bf16: 7/4 x 15.7 MB over 40 GB/s on top of the latency
    b = 137 * 8 * 7168 * 2
    assert project_pro6000(0.0, PRO6000_BW, 137, b, 24.0, 40.0) == pytest.approx(137 * 24e-6 + 1.75 * b / 40e9)


def test_allreduce_fit_recovers_latency_and_bandwidth(tmp_path):
    import json
    from bench.allreduce import H, fit_latency_bandwidth
    from bench.step import load_allreduce_fit
    lat, gbps, n = 21.0, 35.0, 8
    rows = [{"tokens": T, "bytes": T * H * 2} for T in (1, 8, 32, 160)]
    for r in rows:                                   # exact model: the fit must give the constants back
        r["graph_us"] = lat + 2 * (n - 1) / n * r["bytes"] / (gbps * 1e3)
    fit = fit_latency_bandwidth(rows, n)
    assert fit["latency_us"] == pytest.approx(lat) and fit["bus_GBps"] == pytest.approx(gbps)
    assert fit_latency_bandwidth(rows, 1)["bus_GBps"] is None      # one rank: no bus term
    p = tmp_path / "ar.json"
    p.write_text(json.dumps({"ranks": n, "device": "X", "rows": rows, "fit": fit}))
    us, bw, note = load_allreduce_fit(str(p), 40.0)
    assert us == pytest.approx(lat) and bw == pytest.approx(gbps) and "8 rank(s)" in note
    p.write_text(json.dumps({"ranks": n, "rows": rows}))
    with pytest.raises(SystemExit, match="no 'fit'"):
        load_allreduce_fit(str(p), 40.0)


def test_measuring_baselines_are_bench_arguments(monkeypatch):
    """The baselines only a benchmark turns off are bench.step arguments that set the kernels' module switches
    (not environment knobs of the product)."""
    import argparse

    from bench import step as bench_step
    from ddtree_cupy.kernels import gemm, moe
    for mod, attr in ((gemm, "WIDE_CLUSTER"), (gemm, "DEC_SPREAD"), (moe.forward, "BULK_WHOLE")):
        monkeypatch.setattr(mod, attr, True)
    moe_off = dict(moe_bulk=None, moe_bulk_tiles="", moe_bulk_large_tiles="")
    bench_step.apply_baselines(argparse.Namespace(no_wide_cluster=False, no_dec_spread=True, no_bulk_whole=False,
                                                  **moe_off))
    assert (gemm.WIDE_CLUSTER, gemm.DEC_SPREAD, moe.forward.BULK_WHOLE) == (True, False, True)
    bench_step.apply_baselines(argparse.Namespace(no_wide_cluster=True, no_dec_spread=True, no_bulk_whole=True,
                                                  **moe_off))
    assert (gemm.WIDE_CLUSTER, gemm.DEC_SPREAD, moe.forward.BULK_WHOLE) == (False, False, False)


def test_moe_measuring_choices_are_bench_arguments(monkeypatch):
    """--moe-bulk / --moe-bulk-tiles / --moe-bulk-large-tiles set the MoE tables' module switches (no product
    environment knob measures them); a block that is not compiled is refused when the arguments are applied."""
    import argparse

    from bench import step as bench_step
    from ddtree_cupy.kernels import moe
    for attr, v in (("BULK_FORCE", None), ("BULK_TILES", ""), ("BULK_LARGE_TILES", "")):
        monkeypatch.setattr(moe.tables, attr, v)
    base = dict(no_wide_cluster=False, no_dec_spread=False, no_bulk_whole=False)
    bench_step.apply_baselines(argparse.Namespace(**base, moe_bulk=None, moe_bulk_tiles="", moe_bulk_large_tiles=""))
    assert (moe.tables.BULK_FORCE, moe.tables.BULK_TILES, moe.tables.BULK_LARGE_TILES) == (None, "", "")
    bench_step.apply_baselines(argparse.Namespace(**base, moe_bulk=0, moe_bulk_tiles="gu=1,8,2,3,2",
                                                  moe_bulk_large_tiles="gu=2,4,2,3"))
    assert moe.tables.BULK_FORCE is False and moe.bulk_for(8, 8) is False
    assert moe._bulk_tiles_for(False, 256) == (moe.BulkTile(1, 8, 2, 3, 2), moe.BULK_DOWN)
    assert moe._bulk_tiles_for(True) == (moe.BulkTile(2, 4, 2, 3), moe.BULK_DOWN_LARGE)
    bench_step.apply_baselines(argparse.Namespace(**base, moe_bulk=1, moe_bulk_tiles="", moe_bulk_large_tiles=""))
    assert moe.tables.BULK_FORCE is True and moe.bulk_for(1, 8) is True
    with pytest.raises(ValueError, match="BULK_TILES.*compiled"):
        bench_step.apply_baselines(argparse.Namespace(**base, moe_bulk=None, moe_bulk_tiles="gu=3,3,3,3",
                                                      moe_bulk_large_tiles=""))
