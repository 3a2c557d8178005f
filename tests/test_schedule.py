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
    topological order, every item on exactly one block, counter targets = signalling items."""
    seen = sorted(i for b in sc.blocks for i in b)
    assert seen == list(range(len(sc.items))), "every item is on exactly one block"
    for b in sc.blocks:
        assert b == sorted(b), "a block's list follows the global order"
    members = {}
    for it in sc.items:
        members.setdefault(it.signal, []).append(it.id)
    for c, ids in members.items():
        assert len(ids) == sc.counter_targets[c]
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
    it = next(i for i in sc.items if i.op == "silu")
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
        assert items.dtype == np.int32 and items.shape[1] == 8 and bs.shape == (17,)
        assert bs[0] == 0 and bs[-1] == len(items) and np.all(np.diff(bs) >= 0)
        seg_items = [sc.items[i] for b in sc.segment_blocks(seg) for i in b]
        assert len(seg_items) == len(items)
        for row, it in zip(items, seg_items):
            assert row[0] == S.KIND[it.kind] and row[7] == it.signal and sc.ops[row[1]] == it.op
            assert list(row[2:2 + len(it.args)]) == list(it.args)
            own = [(c, t) for c, t in it.waits if seg_of[c] == seg]
            assert [tuple(w) for w in waits[row[5]:row[5] + row[6]]] == own
        seen += len(items)
    assert seen == len(sc.items)


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
    ref = S.build_layer(small_shape("moe", 1, 3, kv_splits=2), 1).buffers
    for nb in (2, 7, 64, 200):
        assert S.build_layer(small_shape("moe", 1, 3, kv_splits=2), nb).buffers == ref


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
        S.build_layer(small_shape(kind, 1, 8), 4, parts=("attention",))


@pytest.mark.parametrize("n_blocks", [1, 7, 132, 264, 376])
def test_tile_choices_restrict_gemm_tiles(n_blocks):
    # the two-blocks-per-SM executor build serves 16-row GEMM tiles only (kernels/persistent.TILE_ROWS)
    cfg, dcfg = _kimi()
    for shape in (S.target_shape(cfg, 8, 0, 1, 8), S.drafter_shape(dcfg, 8, 1, 16)):
        sc = S.build_layer(shape, n_blocks, parts=("mlp",), tile_choices=(16,))
        assert {it.args[1] for it in sc.items if it.kind == "gemm_tile"} == {16}
        check_static(sc)
        S.simulate(sc, seed=n_blocks)


def test_tile_choices_validated():
    for bad in ((), (8,), (16, 48)):
        with pytest.raises(ValueError, match="tile_choices"):
            S.build_layer(small_shape("dense", 1, 2), 4, tile_choices=bad)
    with pytest.raises(ValueError, match="not a multiple of any tile height"):
        S.build_layer(S.LayerShape("dense", 1, 2, H=128, nh=2, ql=64, dn=64, dv=32, F=40), 4, tile_choices=(32,))


@pytest.mark.parametrize("n_blocks", [1, 5, 264])
def test_build_gemm_alone(n_blocks):
    sc = S.build_gemm(8, 4608, 7168, n_blocks, tile_choices=(16,))
    assert sc.ops == ["gemm"] and len(sc.items) == 4608 // 16
    assert all(not it.waits for it in sc.items)                 # inputs exist before the launch
    check_static(sc)
    S.simulate(sc, seed=n_blocks)
    with pytest.raises(ValueError, match="K % 64"):
        S.build_gemm(8, 64, 100, 4)
