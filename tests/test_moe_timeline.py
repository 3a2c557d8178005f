"""CPU tests of the timeline analysis (bench/moe_timeline.py) on synthetic records: a small event-level model of
the bulk-copy GEMM's ring (producer: empty wait, issue, copy latency; consumers: full wait, stage work, release,
epilogue) writes buffers in the kernel's layout, and the analysis must recover the model's parameters exactly
(copy latency, release spread, epilogue, boundary gap, clock rate) and attribute the waits to the right cause in
the three regimes of docs/history/2026-11-29-moe.md ("a timeline build"): copy latency, a slow consumer holding the
producer, a long unit boundary. Corrupted records must fail the invariants."""
from __future__ import annotations

import numpy as np
import pytest

from bench import moe_timeline as mt

GHZ = 2.0     # cycles per ns of the synthetic SMs (integer ns times -> exact cycle stamps)


def simulate(layout, blocks=1, nst=2, nstu=4, n_units=3, copy=300, work=400, issue=50, epi=100, pgap=10,
             cgap=0, sort=500, t_block=1000, clk_base=10 ** 9, gt_base=10 ** 12, seed=0):
    """A buffer of ``blocks`` recorded blocks (block b starts b * t_block ns late, its SM clock at another
    offset) running the ring model; ``work``: ns per stage, one number or one per consumer warp."""
    rng = np.random.default_rng(seed)
    L = layout
    nc = L.nw - 1
    work = np.broadcast_to(np.asarray(work, dtype=np.int64), (nc,))
    buf = np.full(L.blocks * L.block_words, mt.ABSENT, dtype=np.int64)
    rec = mt.parse(buf, L)             # views into buf
    total = n_units * nstu
    for b in range(blocks):
        off = b * t_block
        c0 = clk_base + int(rng.integers(0, 10 ** 6)) * 2
        cyc = lambda t: c0 + int(round(GHZ * (t - off)))
        P = np.zeros((total, 3), dtype=np.int64)
        C = np.zeros((nc, total, 3), dtype=np.int64)
        E = np.zeros((nc, n_units, 2), dtype=np.int64)
        complete = np.zeros(total, dtype=np.int64)
        pt = off + sort
        ct = np.full(nc, off + sort, dtype=np.int64)
        for it in range(total):
            e0 = pt
            e1 = max(e0, C[:, it - nst, 2].max()) if it >= nst else e0
            P[it] = (e0, e1, e1 + issue)
            complete[it] = e1 + issue + copy
            pt = e1 + issue + pgap
            for w in range(nc):
                w0 = ct[w]
                w1 = max(w0, complete[it])
                C[w, it] = (w0, w1, w1 + work[w])
                ct[w] = w1 + work[w] + cgap
                if it % nstu == nstu - 1:
                    u = it // nstu
                    E[w, u] = (ct[w], ct[w] + epi)
                    ct[w] += epi
        bh = rec.bh[b]
        bh[:mt.B_SORT0] = (mt.MAGIC, 7 + b, n_units, nstu, nc, nst, 16, 42)
        bh[mt.B_SORT0:mt.B_SORT0 + 6] = [cyc(off + 10 * (k + 1)) for k in range(6)]   # sort phases 10 ns each
        bh[mt.B_SORT0 + 6:] = -1
        ends = list(ct) + [pt]
        for w in range(L.nw):
            h = rec.wh[b, w]
            h[mt.W_GT0], h[mt.W_CLK0] = gt_base + off, cyc(off)
            h[mt.W_PDL], h[mt.W_SORT] = cyc(off + sort // 2), cyc(off + sort)
            h[mt.W_GT1], h[mt.W_CLK1] = gt_base + ends[w] + 5, cyc(ends[w] + 5)
            h[mt.W_STAGES] = total
            if w < nc:
                h[mt.W_UNITS] = n_units
        ns, nu = min(total, L.stages), min(n_units, L.units)
        for w in range(nc):
            rec.se[b, w, :ns] = [[cyc(t) for t in e] for e in C[w, :ns]]
            rec.ue[b, w, :nu] = [[cyc(t) for t in e] for e in E[w, :nu]]
        rec.se[b, nc, :ns] = [[cyc(t) for t in e] for e in P[:ns]]
    return buf


LAY = mt.Layout(nw=9, stages=32, units=8, blocks=4)


def _analyse(buf, layout=LAY):
    rec = mt.parse(buf, layout)
    assert mt.check_invariants(rec) == []
    return mt.analyse(rec)


def test_copy_latency_regime():
    # long copies, short work: every full wait is on copies in flight and the latency is recovered exactly
    res = _analyse(simulate(LAY, blocks=3, copy=3000, work=400))
    assert res["blocks"] == 3
    assert res["ghz"]["mean"] == pytest.approx(GHZ)
    lat = res["copy_latency"]
    assert lat["n"] > 0 and lat["p50"] == pytest.approx(3000) and lat["p90"] == pytest.approx(3000)
    sp = res["full_wait_split"]
    assert sp["in_flight"] > 0.95 * sum(sp.values())
    assert res["release_spread"]["p90"] == pytest.approx(0) and res["last_release_warp"] == [0] * 8
    assert res["roles"]["consumer"]["wait"] > res["roles"]["consumer"]["work"]


def test_slow_consumer_regime():
    # one K slice 4x slower: the producer sits in its empty wait behind it, the others wait on that
    work = [400] * 7 + [1600]
    res = _analyse(simulate(LAY, copy=200, work=work))
    assert res["last_release_warp"][7] == 12 and sum(res["last_release_warp"]) == 12
    assert res["release_spread"]["n"] == 12 and res["release_spread"]["p50"] >= 1200
    sp = res["full_wait_split"]
    assert sp["producer_in_empty_wait"] > sp["in_flight"] and sp["producer_in_empty_wait"] > 0.5 * sum(sp.values())
    assert res["producer_empty_wait"]["p90"] > 1000


def test_slow_consumer_behind_a_deep_ring_is_still_the_gate():
    # 3 stages, one K slice 20% slower, copies ~ a stage: the producer's gated issue is over before the fast warps
    # start waiting, yet it is what makes them wait (issued when they freed the slot, the copies would have landed
    # in time): the split must name the gate, not the copy latency
    res = _analyse(simulate(LAY, nst=3, nstu=7, n_units=4, copy=1800, work=[1400] * 7 + [1700]))
    sp = res["full_wait_split"]
    assert sp["producer_in_empty_wait"] > 0.7 * sum(sp.values())
    # copy latency remains only at the pipeline fill: 8 warps wait on stage 0 (issue 50 + copy 1800 ns)
    assert sp["in_flight"] == pytest.approx(8 * 1850) and sp["producer_elsewhere"] == pytest.approx(0)
    assert res["copy_latency"]["p50"] == pytest.approx(1800)
    # the same ring with equal warps does not wait at all after the first stages
    res2 = _analyse(simulate(LAY, nst=3, nstu=7, n_units=4, copy=1800, work=1400))
    assert res2["full_wait_other_stages"]["p50"] == pytest.approx(0)


def test_slow_producer_regime():
    # issuing a stage takes 2 us (5x a stage's work): the producer reaches each stage long after the slot was
    # freed, so the waits are "elsewhere" (it is still busy with the earlier stages), not gate nor copies
    res = _analyse(simulate(LAY, issue=2000, copy=200, work=400))
    sp = res["full_wait_split"]
    assert sp["producer_elsewhere"] > 0.5 * sum(sp.values()) and sp["producer_in_empty_wait"] == pytest.approx(0)
    assert res["producer_issue"]["p50"] == pytest.approx(2000) and res["producer_empty_wait"]["p90"] == pytest.approx(0)


def test_unit_boundary_regime():
    res = _analyse(simulate(LAY, copy=300, work=300, epi=2000, n_units=3))
    assert res["unit_boundary_gap"]["n"] == 2 * 8 and res["unit_boundary_gap"]["p50"] == pytest.approx(2000)
    assert res["epilogue"]["mean"] == pytest.approx(2000)
    assert len(res["full_wait_by_position"]) == 4
    # after the boundary the ring is full: the unit's first nst stages do not wait, stage nst waits on a copy
    # issued only when the unit's first stage was released
    pos = res["full_wait_by_position"]
    assert pos[1] == pytest.approx(0) and pos[2] > 0
    cons = res["roles"]["consumer"]
    assert cons["epilogue"] > cons["work"]


def test_role_fractions_add_up():
    res = _analyse(simulate(LAY, blocks=2, seed=3))
    for r in res["roles"].values():
        parts = r["prologue"] + r["wait"] + r["work"] + r["epilogue"] + r["other"]
        assert parts == pytest.approx(r["life"]) and r["other"] >= -1e-6
    # the synthetic prologue is the sort time (500 ns) for every warp of both blocks
    assert res["roles"]["consumer"]["prologue"] == pytest.approx(2 * 8 * 500)
    # the sort's phase marks (10 ns apart from the block's start) come back per phase, and in the report
    sp = res["sort_phases"]
    assert list(sp) == ["start -> sort", *mt.SORT_PHASES]
    assert all(d["p50"] == pytest.approx(10, abs=1) and d["n"] == 2 for d in sp.values())
    assert "sort phases" in mt.report(res)


def test_clock_rate_and_block_offsets():
    buf = simulate(LAY, blocks=3, t_block=7000)
    tm = mt.to_ns(mt.parse(buf, LAY))
    np.testing.assert_allclose(tm.ghz[:3], GHZ)
    np.testing.assert_allclose(tm.start[:3, 0], [0, 7000, 14000])
    assert np.isnan(tm.start[3]).all()
    tm2 = mt.to_ns(mt.parse(buf, LAY), ghz=1.0)
    assert tm2.ghz[0] == 1.0 and tm2.sort[0, 0] == pytest.approx(2 * 500)


def test_caps_leave_the_rest_unrecorded():
    # 5 units x 4 stages = 20 > 8 recorded stages, 5 > 2 recorded units: the counts still say 20 / 5
    lay = mt.Layout(nw=3, stages=8, units=2, blocks=1)
    buf = simulate(lay, n_units=5)
    rec = mt.parse(buf, lay)
    assert mt.check_invariants(rec) == []
    assert rec.wh[0, 0, mt.W_STAGES] == 20 and rec.wh[0, 0, mt.W_UNITS] == 5
    assert (rec.se[0, :, :8] != mt.ABSENT).all()
    assert mt.analyse(rec)["full_wait"]["n"] == 2 * 8


@pytest.mark.parametrize("corrupt,msg", [
    (lambda r: r.se[0, 2, 5].__setitem__(1, r.se[0, 2, 5, 0] - 1), "not monotone"),
    (lambda r: r.se[0, 3, 4].__setitem__(0, mt.ABSENT), "lacks an event"),
    (lambda r: r.se[0, 8, 6].__setitem__(2, mt.ABSENT), "lacks an event"),
    (lambda r: r.se[0, 1, 20].__setitem__(0, 5), "past the"),
    (lambda r: r.wh[0, 4].__setitem__(mt.W_STAGES, 11), "stages done"),
    (lambda r: r.wh[0, 4].__setitem__(mt.W_UNITS, 2), "units done"),
    (lambda r: r.ue[0, 0, 1].__setitem__(1, r.ue[0, 0, 1, 0] - 3), "epilogue ends before"),
    (lambda r: r.wh[0, 8].__setitem__(mt.W_SORT, mt.ABSENT), "stamp missing"),
    (lambda r: r.se[0, 8, 3].__setitem__(1, r.se[0, 0, 3, 1] + 10 ** 6), "armed it"),
    (lambda r: r.se[0, 8, 4].__setitem__(1, r.se[0, 8, 4, 0]), "previous use"),
])
def test_invariants_catch_corruption(corrupt, msg):
    buf = simulate(LAY, copy=300, work=[400] * 7 + [900])
    rec = mt.parse(buf, LAY)
    corrupt(rec)
    problems = mt.check_invariants(rec)
    assert any(msg in p for p in problems), problems


def test_text_timeline():
    res = _analyse(simulate(LAY, copy=1500, work=400, epi=800))
    txt = mt.text_timeline(res["times"], 0, width=60)
    rows = txt.splitlines()
    assert len(rows) == LAY.nw + 1
    for r in rows[:-1]:
        assert len(r) == 5 + 2 + 60
    assert rows[-1].strip().startswith("0 ..")
    cons = "".join(rows[:8])
    assert "." in cons and "#" in cons and "E" in cons and "p" in cons
    assert "E" not in rows[8] and "#" in rows[8]
    full = mt.report(res)
    assert "copy latency" in full and "block 0" in full
    with pytest.raises(ValueError, match="block: 3"):
        mt.text_timeline(res["times"], 3)


def test_parse_errors():
    with pytest.raises(ValueError, match="buf: must be a 1-D int64"):
        mt.parse(np.zeros(10, np.int32), LAY)
    with pytest.raises(ValueError, match="buf: .* words <"):
        mt.parse(np.zeros(10, np.int64), LAY)
    buf = simulate(LAY)
    with pytest.raises(ValueError, match="consumer warps"):
        mt.parse(buf, mt.Layout(nw=5, stages=32, units=8, blocks=2))
    with pytest.raises(ValueError, match="no block"):
        mt.to_ns(mt.parse(np.full(LAY.blocks * LAY.block_words, -1, np.int64), LAY))


def test_layout_matches_the_wrapper_and_the_kernel_defines():
    from ddtree_cupy.kernels import moe
    for bt in (moe.BULK_GATEUP, moe.BULK_GATEUP_COMPACT, moe.BULK_DOWN):
        lay = mt.Layout(bt.wm * bt.wk + 1, moe.TL_STAGES, moe.TL_UNITS, moe.TL_BLOCKS)
        assert lay.block_words == moe.timeline_words(bt)
    d = dict(moe.SPEC_BULK_TIMELINE.defines)
    assert d == {"DDT_MOE_TIMELINE": "1", "DDT_MOE_TL_STAGES": str(moe.TL_STAGES),
                 "DDT_MOE_TL_UNITS": str(moe.TL_UNITS), "DDT_MOE_TL_BLOCKS": str(moe.TL_BLOCKS)}
    assert moe.SPEC_BULK.defines == () and moe.SPEC_BULK_TIMELINE.src == moe.SPEC_BULK.src
    # the timeline spec compiles exactly the tables' blocks, all of which the production spec has too
    assert set(moe.SPEC_BULK_TIMELINE.names) <= set(moe.SPEC_BULK.names)
    for bt in (moe.BULK_GATEUP_COMPACT, moe.BULK_DOWN):
        assert any(n == moe._bulk_name(1 if bt is moe.BULK_DOWN else 0, bt, 0) for n in moe.SPEC_BULK_TIMELINE.names)
    # the kernel's header constants (the layout comment) are what the module reads
    src = (moe.SPEC_BULK.source())
    assert "constexpr long long MAGIC = 0x%Xll" % mt.MAGIC in src
    assert "enum { W_GT0 = 0, W_CLK0, W_PDL, W_SORT, W_GT1, W_CLK1, W_STAGES, W_UNITS };" in src
    assert "enum { B_MAGIC = 0, B_SMID, B_UNITS, B_NST_UNIT, B_NCW, B_NST, B_SS, B_CHUNKS, B_SORT0 };" in src
    assert "BH = %d, WH = %d;" % (mt.BLOCK_HEADER, mt.WARP_HEADER) in src


def test_timeline_argument_errors():
    from ddtree_cupy.kernels import moe
    gu, dn = moe.BULK_GATEUP_COMPACT, moe.BULK_DOWN
    assert moe._check_timeline(None, 0, gu, dn) == (None, None)
    with pytest.raises(ValueError, match="timeline: must be None or"):
        moe._check_timeline(np.zeros(4, np.int64), 0, gu, dn)
    with pytest.raises(ValueError, match=r"timeline\[0\]: must be a 1-D int64"):
        moe._check_timeline((np.zeros(4, np.int64), None), 0, gu, dn)
    with pytest.raises(ValueError, match=r"timeline\[1\]: the timeline build has no block"):
        moe._check_timeline((None, np.zeros(4, np.int64)), 0, gu, moe.BULK_DOWN_CANDIDATES[0])
    big = np.zeros(moe.TL_BLOCKS * moe.timeline_words(gu), np.int64)
    assert moe._check_timeline((big, None), 0, gu, dn)[0] is big


def test_saved_run_is_read_back(tmp_path, capsys):
    # the .npz that bench.moe --timeline writes (buf_<kernel>, layout_<kernel>) through the module's CLI
    lay = mt.Layout(nw=5, stages=16, units=4, blocks=2)
    path = tmp_path / "tl.npz"
    np.savez_compressed(path, buf_down=simulate(lay, blocks=2, nstu=2, n_units=3),
                        layout_down=np.array([lay.nw, lay.stages, lay.units, lay.blocks]))
    assert mt.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "== down" in out and "invariants: all hold" in out and "blocks recorded 2" in out
    assert mt.main([]) == 2
