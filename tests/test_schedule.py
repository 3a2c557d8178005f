"""The persistent layer schedule (engine/schedule.py) on its executor model: dependencies, single writes,
coverage, deadlock freedom for every grid size, co-residency refusal, the device encoding."""
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ddtree_cupy.config import DrafterConfig, TargetConfig
from ddtree_cupy.engine import schedule as S

DATA = Path(__file__).parent / "data"


def _kimi():
    return TargetConfig.load(str(DATA / "kimi-k2.6-text.json")), DrafterConfig.load(str(DATA / "kimi-k2.5-dflash-drafter.json"))


def small_shape(kind, S_, R, nb_heads=2, kv_splits=0):
    if kind == "moe":
        return S.LayerShape("moe", S_, R, H=128, nh=nb_heads, ql=64, dn=64, dv=32, E=16, k=2, I=64, Is=64,
                            kv_splits=kv_splits)
    if kind == "dense":
        return S.LayerShape("dense", S_, R, H=128, nh=nb_heads, ql=64, dn=64, dv=32, F=96, kv_splits=kv_splits)
    return S.LayerShape("drafter", S_, R, H=128, nh=2 * nb_heads, dn=32, dv=32, F=96, nkv=nb_heads,
                        kv_splits=kv_splits)


def check_static(sc: S.Schedule):
    """Properties that need no interleaving: acyclic waits, per-block order a subsequence of the global
    topological order, every item on exactly one block, counter targets = signalling items (+ 1 for a
    stream-K group, whose last part signals again after its fixup), stream-K parts on their pinned block."""
    seen = sorted(i for b in sc.blocks for i in b)
    assert seen == list(range(len(sc.items))), "every item is on exactly one block"
    for b in sc.blocks:
        assert b == sorted(b), "a block's list follows the global order"
    members = {}
    for it in sc.items:
        members.setdefault(it.signal, []).append(it.id)
    for c, ids in members.items():
        fix = any(sc.items[i].last_writes for i in ids)
        assert all(bool(sc.items[i].last_writes) == fix for i in ids)
        assert len(ids) + fix == sc.counter_targets[c]
    where = {i: b for b, lst in enumerate(sc.blocks) for i in lst}
    for it in sc.items:
        if it.block is not None:
            assert where[it.id] == it.block
    for it in sc.items:
        for c, t in it.waits:
            assert t == sc.counter_targets[c]
            assert max(members[c]) < it.id, f"item {it.id} waits on a counter signalled at or after itself"
            assert it.signal != c


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["dense", "moe", "drafter"]), S_=st.integers(1, 3), R=st.integers(1, 5),
       n_blocks=st.integers(1, 200), kv_splits=st.integers(0, 3), allreduce=st.sampled_from(["segment", "item"]),
       seed=st.integers(0, 10 ** 6))
def test_any_interleaving_runs_the_dataflow(kind, S_, R, n_blocks, kv_splits, allreduce, seed):
    sc = S.build_layer(small_shape(kind, S_, R, kv_splits=kv_splits), n_blocks, allreduce=allreduce)
    check_static(sc)
    order = S.simulate(sc, seed=seed)
    assert sorted(order) == list(range(len(sc.items)))


@pytest.mark.parametrize("n_blocks", list(range(1, 201)))
def test_every_grid_size_1_to_200(n_blocks):
    # each SM count in 1..200 (one block per SM: the sm_120 case) for every layer kind
    for kind in ("dense", "moe", "drafter"):
        sc = S.build_layer(small_shape(kind, 2, 3), n_blocks)
        check_static(sc)
        S.simulate(sc, seed=n_blocks)


@pytest.mark.parametrize("layer,n_blocks", [(0, 132), (1, 132), (1, 188), (0, 188), (1, 1), (1, 200)])
def test_kimi_rank_layers(layer, n_blocks):
    cfg, _ = _kimi()
    sc = S.build_layer(S.target_shape(cfg, 8, layer, 1, 8), n_blocks)
    check_static(sc)
    S.simulate(sc, seed=layer)
    # the MoE layer holds one slot per possible active expert: min(E, T k)
    if layer:
        assert sum(1 for it in sc.items if it.op == "moe_plan") == 1
        assert sc.buffers["moe_act"][0] == min(384, 8 * 8) * 8


@pytest.mark.parametrize("S_,n_blocks", [(1, 132), (10, 188)])
def test_kimi_drafter_layer(S_, n_blocks):
    _, dcfg = _kimi()
    sc = S.build_layer(S.drafter_shape(dcfg, 8, S_, 8), n_blocks)
    check_static(sc)
    S.simulate(sc, seed=3)


def test_waits_are_not_trusted_by_the_model():
    # drop one wait: some interleaving then reads before the write, and the model says so
    sc = S.build_layer(small_shape("dense", 1, 2), 8)
    victim = next(it for it in sc.items if it.op == "q_b")
    victim.waits = ()
    caught = False
    for seed in range(200):
        try:
            S.simulate(sc, seed=seed)
        except S.ScheduleError as e:
            assert "before it is written" in str(e)
            caught = True
            break
    assert caught


def test_double_write_and_missing_write_detected():
    sc = S.build_layer(small_shape("dense", 1, 2), 4)
    it = next(i for i in sc.items if i.op == "o_proj")
    it.writes = it.writes + it.writes
    with pytest.raises(S.ScheduleError, match="second time"):
        S.simulate(sc, seed=0)
    sc = S.build_layer(small_shape("dense", 1, 2), 4)
    it = next(i for i in sc.items if i.op == "input_norm")
    w = it.writes[0]
    it.writes = (dataclasses.replace(w, c1=w.c1 - 1),)
    with pytest.raises(S.ScheduleError):
        S.simulate(sc, seed=0)


def test_non_coresident_grid_deadlocks_in_the_model_and_is_refused():
    # a grid built for 64 blocks on a device holding 4 at once: blocks wait on blocks that never start
    sc = S.build_layer(small_shape("moe", 2, 4), 64)
    with pytest.raises(S.Deadlock, match="not resident"):
        for seed in range(20):
            S.simulate(sc, seed=seed, resident=4)
    with pytest.raises(ValueError, match="cannot be co-resident"):
        S.check_coresident(64, sm_count=4, blocks_per_sm=1)
    with pytest.raises(ValueError, match="cannot be resident at all"):
        S.check_coresident(1, sm_count=4, blocks_per_sm=0)
    # the fallback: the schedule rebuilt for the grid that fits completes
    n = S.fit_grid(64, sm_count=4, blocks_per_sm=1)
    assert n == 4
    S.check_coresident(n, 4, 1)
    S.simulate(S.build_layer(small_shape("moe", 2, 4), n), seed=1, resident=n)
    assert S.fit_grid(200, sm_count=188, blocks_per_sm=1, available_sms=100) == 100


def test_encode_matches_the_schedule():
    sc = S.build_layer(small_shape("moe", 1, 4), 16)
    seen = 0
    seg_of = {x.signal: x.segment for x in sc.items}
    for seg in range(sc.n_segments):
        enc = sc.encode(seg)
        items, waits, bs = enc["items"], enc["waits"], enc["block_start"]
        assert items.dtype == np.int32 and items.shape[1] == S.REC_INTS == 16 and bs.shape == (17,)
        assert bs[0] == 0 and bs[-1] == len(items) and np.all(np.diff(bs) >= 0)
        seg_items = [sc.items[i] for b in sc.segment_blocks(seg) for i in b]
        assert len(seg_items) == len(items)
        for row, it in zip(items, seg_items):
            assert row[0] == S.KIND[it.kind] and row[11] == it.signal and sc.ops[row[1]] == it.op
            assert list(row[2:2 + len(it.args)]) == list(it.args) and not row[2 + len(it.args):9].any()
            assert not row[15:].any()
            own = [(c, t) for c, t in it.waits if seg_of[c] == seg]
            assert [tuple(w) for w in waits[row[9]:row[9] + row[10]]] == own
        seen += len(items)
        check_runs(enc)
    assert seen == len(sc.items)


def check_runs(enc):
    """The executor's steps: walking each block's records by run length visits every record once; a run is
    consecutive gemm_part records of one stage (<= RUN_MAX) with the union of their waits."""
    items, bs = enc["items"], enc["block_start"]
    for b in range(len(bs) - 1):
        i = bs[b]
        while i < bs[b + 1]:
            row = items[i]
            m = int(row[12]) if row[0] == S.KIND["gemm_part"] else 1
            assert 1 <= m <= S.RUN_MAX and i + m <= bs[b + 1]
            if row[0] == S.KIND["gemm_part"]:
                run = items[i:i + m]
                assert (run[:, 0] == row[0]).all() and (run[:, 1] == row[1]).all()
                assert row[13] == row[9] and row[13] + row[14] == run[-1, 9] + run[-1, 10]
                if i + m < bs[b + 1] and m < S.RUN_MAX:       # a run ends at another stage or kind
                    nxt = items[i + m]
                    assert nxt[0] != row[0] or nxt[1] != row[1]
            i += m
        assert i == bs[b + 1]


@pytest.mark.parametrize("n_blocks", [1, 3, 132, 264])
def test_gemm_runs_of_the_mlp_half(n_blocks):
    cfg, _ = _kimi()
    sc = S.build_layer(S.target_shape(cfg, 8, 0, 1, 8), n_blocks, parts=("mlp",))
    enc = sc.encode(0)
    check_runs(enc)
    runs = enc["items"][(enc["items"][:, 0] == S.KIND["gemm_part"]) & (enc["items"][:, 12] > 0)]
    assert len(runs) and runs[:, 12].max() <= S.RUN_MAX


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="kind"):
        S.build_layer(dataclasses.replace(small_shape("dense", 1, 1), kind="x"), 4)
    with pytest.raises(ValueError, match="n_blocks"):
        S.build_layer(small_shape("dense", 1, 1), 0)
    with pytest.raises(ValueError, match="allreduce"):
        S.build_layer(small_shape("dense", 1, 1), 4, allreduce="nccl")
    with pytest.raises(ValueError, match="multiple of 16"):
        S.build_layer(dataclasses.replace(small_shape("dense", 1, 1), H=100), 4)


def test_grid_size_changes_tiles_not_results():
    # more blocks never lose a tile: the produced buffers are the same set at every grid size (fixed KV
    # splits: the automatic count follows the grid and with it the split workspace)
    # and the stream-K partial workspaces, whose slot count is the parts')
    def bufs(nb):
        return {k: v for k, v in S.build_layer(small_shape("moe", 1, 3, kv_splits=2), nb).buffers.items()
                if not k.endswith(":ws")}
    ref = bufs(1)
    for nb in (2, 7, 64, 200):
        assert bufs(nb) == ref


@pytest.mark.parametrize("kind", ["dense", "moe", "drafter"])
@pytest.mark.parametrize("allreduce", ["segment", "item"])
def test_mlp_half(kind, allreduce):
    for nb in (1, 5, 64):
        sc = S.build_layer(small_shape(kind, 1, 8), nb, allreduce=allreduce, parts=("mlp",))
        check_static(sc)
        S.simulate(sc, seed=nb)
        assert sc.ops[0] == "post_norm" and "attention" not in sc.ops
        assert sc.n_segments == (2 if allreduce == "segment" else 1)
    with pytest.raises(ValueError, match="parts"):
        S.build_layer(small_shape(kind, 1, 8), 4, parts=("mlp", "attention"))


@pytest.mark.parametrize("kind", ["dense", "moe", "drafter"])
def test_attention_as_a_segment(kind):
    # today's attention kernels between two launches: the attention items in a segment of their own, every
    # static property and the model's dataflow still hold, the items the same as with attention inside
    for nb in (1, 5, 64, 200):
        for parts in (("attention",), ("attention", "mlp")):
            sc = S.build_layer(small_shape(kind, 2, 4), nb, parts=parts, attention="segment")
            check_static(sc)
            S.simulate(sc, seed=nb)
            att = {it.segment for it in sc.items if it.kind in ("attn_split", "attn_combine")}
            assert len(att) == 1 and all(it.kind in ("attn_split", "attn_combine")
                                         for it in sc.items if it.segment in att)
            inside = S.build_layer(small_shape(kind, 2, 4), nb, parts=parts)
            assert sorted((it.kind, it.op, it.args) for it in sc.items) == \
                sorted((it.kind, it.op, it.args) for it in inside.items)


def _parts(sc, op):
    return [it for it in sc.items if it.op == op and it.kind == "gemm_part"]


def check_stream_k(sc, op, N, K, swiglu=False):
    """The parts of GEMM ``op`` cover every (16-row unit, k tile) exactly once, each block holds one
    contiguous run of the unit sequence, a group's slots are contiguous with the gate parts first, and the
    group's fixup writes its 16 output columns."""
    KT = -(-K // 64)
    parts = _parts(sc, op)
    cover = np.zeros((N // 16, KT), np.int32)
    for it in parts:
        n0, kt0, nkt, slot, slot0, n_gate, n = it.args
        assert n0 % 16 == 0 and nkt >= 1 and slot0 <= slot < slot0 + n
        cover[n0 // 16, kt0:kt0 + nkt] += 1
        assert it.reads == (S.Region(it.reads[0].buf, 0, sc.shape.T, kt0 * 64, min(K, (kt0 + nkt) * 64)),)
        (lw,) = it.last_writes
        col0 = n0 % (N // 2) if swiglu else n0
        assert (lw.c0, lw.c1) == (col0, col0 + 16)
    assert (cover == 1).all(), "every unit x k tile in exactly one part"
    groups = {}
    for it in parts:
        groups.setdefault(it.group, []).append(it)
    for g, its in groups.items():
        slots = sorted(it.args[3] for it in its)
        assert slots == list(range(its[0].args[4], its[0].args[4] + its[0].args[6]))
        assert all(it.args[4:] == its[0].args[4:] for it in its)
        if swiglu:
            gate = [it for it in its if it.args[0] < N // 2]
            assert sorted(it.args[3] for it in gate) == slots[:its[0].args[5]]
    return parts


@pytest.mark.parametrize("n_blocks", [1, 7, 132, 188, 264])
def test_stream_k_parts_cover_and_balance(n_blocks):
    cfg, dcfg = _kimi()
    for shape in (S.target_shape(cfg, 8, 0, 1, 8), S.drafter_shape(dcfg, 8, 1, 16)):
        sc = S.build_layer(shape, n_blocks, parts=("mlp",))
        check_static(sc)
        S.simulate(sc, seed=n_blocks)
        H, F = shape.H, shape.F
        check_stream_k(sc, "gate_up", 2 * F, H, swiglu=True)
        down = check_stream_k(sc, "down", H, F)
        # the down GEMM starts on an even grid: every block's share within one k tile of the mean, or, where
        # whole 16-row units cost at most ALIGN_SLACK over that, whole units within one unit of each other
        kt = np.zeros(n_blocks)
        for it in down:
            kt[it.block] += it.args[2]
        units, KT = H // 16, F // 64
        n_use = min(n_blocks, units * KT // S.MIN_PART_KT)
        used = kt[kt > 0]
        whole = units >= n_use and -(-units // n_use) * n_use <= S.ALIGN_SLACK * units
        if whole:
            assert (used % KT == 0).all() and used.max() - used.min() <= KT
            assert all(it.args[6] == 1 for it in down)               # every group is one part
        else:
            assert len(used) == n_use and used.max() - used.min() <= 1


def test_whole_units_where_the_imbalance_is_small():
    # down 7168 x 2304 (448 units of 36 k tiles): 264 blocks take 1 or 2 whole units (2 / 1.70 <= 1.25
    # is false for 188 blocks: 3 / 2.38, so those split); gate|up (288 pair-sequence units on 264
    # blocks: 2 / 1.09) always splits, its pairs sharing a fixup
    for nb, whole in ((264, True), (132, True), (188, False)):
        parts = _parts(S.build_gemm(8, 7168, 2304, nb), "gemm")
        assert all(p.args[6] == 1 for p in parts) == whole, nb
        if whole:
            assert all(p.args[1] == 0 and p.args[2] == 36 for p in parts)
    cfg, _ = _kimi()
    sc = S.build_layer(S.target_shape(cfg, 8, 0, 1, 8), 264, parts=("mlp",))
    assert any(p.args[6] > 1 for p in _parts(sc, "gate_up"))


def test_stream_k_blocks_still_busy_get_less(monkeypatch):
    # blocks the cost model has busy until 10 us (of a ~40 us GEMM) get ranges shorter by 10 us of
    # streaming, so every block is predicted to finish at the same time; the ranges tile the stream
    free = [0.0] * 6 + [10.0] * 4
    monkeypatch.setattr(S, "_model_free", lambda items, n, rate, seg, x: (free, 0.0))
    b = S._Builder(S.LayerShape("dense", 1, 8, H=1024, nh=1, ql=1, F=64), 10, "segment", 1000.0)
    ranges = b._stream_ranges(4000, 100.0, "x")
    assert ranges[0][0] == 0 and ranges[-1][1] == 4000
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(9))
    n = [hi - lo for lo, hi in ranges]
    finish = [free[i] + n[i] * 100.0 / 1000.0 for i in range(10)]
    assert max(finish) - min(finish) <= 0.1 + 1e-9           # within one unit's time
    assert min(n[:6]) > max(n[6:])


def test_small_gemms_use_fewer_blocks_with_longer_parts():
    sc = S.build_gemm(1, 64, 128, 200)              # 4 units x 2 k tiles: no 200-way split
    parts = _parts(sc, "gemm")
    assert len({it.block for it in parts}) == 1 and sum(it.args[2] for it in parts) == 8
    check_static(sc)
    S.simulate(sc)
    with pytest.raises(ValueError, match="16-row unit"):
        S.build_gemm(1, 40, 128, 4)


def test_fixup_reads_every_slot_of_its_group():
    # a part that claims a slot outside its group: the model catches the fixup reading an unwritten slot
    sc = S.build_gemm(8, 4608, 7168, 264)
    parts = _parts(sc, "gemm")
    it = next(p for p in parts if p.args[6] == 2)
    r = it.last_reads[0]
    it.last_reads = (dataclasses.replace(r, r1=r.r1 + 8),)
    with pytest.raises(S.ScheduleError, match="fixup reads"):
        for seed in range(40):
            S.simulate(sc, seed=seed)


@pytest.mark.parametrize("n_blocks", [1, 5, 264])
def test_build_gemm_alone(n_blocks):
    sc = S.build_gemm(8, 4608, 7168, n_blocks)
    assert sc.ops == ["gemm"]
    assert all(not it.waits for it in sc.items)                 # inputs exist before the launch
    check_static(sc)
    check_stream_k(sc, "gemm", 4608, 7168)
    S.simulate(sc, seed=n_blocks)
    # one contiguous range per block: at most one part per unit it touches
    assert max(len(b) for b in sc.blocks) <= -(-4608 // 16 * 112 // n_blocks // 112) + 2
    with pytest.raises(ValueError, match="K % 64"):
        S.build_gemm(8, 64, 100, 4)


@pytest.mark.parametrize("kind", ["norm", "gemm"])
def test_dependency_chain_schedules(kind):
    # the edge benchmark's chains: stage j reads only x{j}; every grid from 1 to 200 blocks runs them on the
    # model (waits met in any interleaving, every element written once before it is read)
    for nb in range(1, 201, 7):
        sc = S.build_chain(kind, 3, 256, 4, nb)
        assert sc.ops == [f"{kind}{j}" for j in range(4)] and sc.n_segments == 1
        S.simulate(sc, seed=nb)
    if kind == "gemm":      # the whole-unit bound: every group a single part on its own block, width / 16 blocks
        for nb in (1, 7, 16, 200):
            sc = S.build_chain(kind, 3, 256, 4, nb, whole_units=True)
            parts = [it for it in sc.items if it.kind == "gemm_part"]
            assert all(it.args[6] == 1 and it.args[1] == 0 and it.args[2] == 4 for it in parts)
            assert len({it.block for it in parts if it.op == "gemm0"}) == min(nb, 16)
            S.simulate(sc, seed=nb)
    with pytest.raises(ValueError, match="kind must be"):
        S.build_chain("attention", 3, 256, 4, 8)
    with pytest.raises(ValueError, match="multiple of 64"):
        S.build_chain(kind, 3, 200, 4, 8)


def test_head_products_are_cut_per_column_pieces():
    # W_UK (+ RoPE) per (head, 64 of its 512 latent columns), the first piece also rotating the head's q_pe;
    # W_UV per (head, 16 of its dv columns): every column of q_full and o written by exactly one item, each
    # item's record naming its piece width
    cfg, _ = _kimi()
    sh = S.target_shape(cfg, 8, 0, 1, 8)
    sc = S.build_layer(sh, 132)
    for op, buf, width, piece in (("w_uk_rope", "q_full", 576, S.HEAD_COLS), ("w_uv", "o", sh.dv, S.HEAD_COLS_UV)):
        items = [it for it in sc.items if it.op == op]
        assert len(items) == sh.nh * -(-(512 if op == "w_uk_rope" else sh.dv) // piece)
        assert all(it.args[2] == piece for it in items)
        cols = sorted(c for it in items for w in it.writes if w.buf == buf for c in range(w.c0, w.c1))
        assert cols == list(range(sh.nh * width))
        assert all(w.c1 - w.c0 <= piece for it in items for w in it.writes if w.buf == buf and w.c0 % 576 < 512)
