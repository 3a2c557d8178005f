"""The persistent executor's host side without a GPU: the op table layout the kernel's static_asserts pin,
which schedule segments this build can run, and the source digest over the .cu files it includes."""
import numpy as np
import pytest

from ddtree_cupy.engine import schedule as S
from ddtree_cupy.kernels import compile as kc
from ddtree_cupy.kernels import persistent as P


def test_op_table_layout_matches_the_kernel_struct():
    f = P.OP_DTYPE.fields
    # natural alignment, no padding: the offsets the C struct's field order gives (its size is static_asserted)
    assert P.OP_DTYPE.itemsize == 104
    off = 0
    for name in P.OP_DTYPE.names:
        dt, o = f[name][0], f[name][1]
        assert o == off and o % dt.base.itemsize == 0, name
        off += dt.itemsize
    assert off == 104
    src = (kc.CUDA_SRC_DIR / "persistent_layer.cu").read_text()
    assert "sizeof(PersistOp) == 104" in src
    struct = src[src.index("struct PersistOp {"):src.index("};", src.index("struct PersistOp {"))]
    pos = [struct.index(n) for n in ("x;", "x2;", " w;", "out;", "out2;", "x_stride", "x2_stride", "out_stride",
                                     "out2_stride", "int T", "long long aux", "float eps", "int pad;")]
    assert pos == sorted(pos), "PersistOp field order differs from OP_DTYPE"
    # the item kinds the kernel switches on are the schedule's numbers
    for name in P.SUPPORTED_KINDS:
        assert f"{S.KIND[name]} {name}" in src.replace("  ", " ").replace("  ", " ")


def _dense(T):
    return S.LayerShape("dense", 1, T, H=7168, nh=8, ql=1536, dn=128, dv=128, F=2304)


def test_supported_segments():
    sc = S.build_layer(_dense(8), 188, parts=("mlp",))
    assert P.supported_segment(sc, 0)                 # post_norm + gate_up + silu + down
    full = S.build_layer(_dense(8), 188)
    assert not P.supported_segment(full, 0)           # attention items are not built yet
    assert P.supported_segment(full, 2)               # the MLP half of the full layer
    assert not P.supported_segment(S.build_layer(_dense(32), 188, parts=("mlp",)), 0)   # T > 16
    moe = S.build_layer(S.LayerShape("moe", 1, 8, H=7168, nh=8, ql=1536, dn=128, dv=128, E=384, k=8, I=256,
                                     Is=256), 188, parts=("mlp",))
    assert not P.supported_segment(moe, 0)            # MoE items are not built yet


def test_gemm_parts_fit_the_record():
    # every GEMM item is a stream-K part of one 16-row unit, its args fit the record, K ranges in k tiles
    for nb in (1, 7, 132, 188, 200):
        sc = S.build_layer(_dense(8), nb)
        parts = [it for it in sc.items if it.kind == "gemm_part"]
        assert parts and not any(it.kind == "gemm_tile" for it in sc.items)
        assert all(len(it.args) == S.MAX_ARGS and it.args[0] % S.UNIT_ROWS == 0 for it in parts)
        enc = sc.encode(2)
        assert enc["items"].shape[1] == S.REC_INTS


def test_source_digest_covers_included_cu(tmp_path, monkeypatch):
    (tmp_path / "persistent_layer.cu").write_text('#include "gemm_bf16.cu"\n')
    (tmp_path / "gemm_bf16.cu").write_text("// v1\n")
    monkeypatch.setattr(kc, "CUDA_SRC_DIR", tmp_path)
    monkeypatch.setattr(P, "CUDA_SRC_DIR", tmp_path)
    first = P.SPEC.source()
    (tmp_path / "gemm_bf16.cu").write_text("// v2\n")
    assert P.SPEC.source() != first


def _mlp_problem(rng, T, H, F):
    d = dict(attn=rng.standard_normal((T, H)), h=rng.standard_normal((T, H)), nw=rng.standard_normal(H),
             w_gu=rng.standard_normal((2 * F, H)) / np.sqrt(H), w_dn=rng.standard_normal((H, F)) / np.sqrt(F))
    hp = d["h"] + d["attn"]
    normed = d["nw"] * hp / np.sqrt(np.mean(hp * hp, axis=1, keepdims=True) + 1e-6)
    gu = normed @ d["w_gu"].T
    act = gu[:, :F] / (1 + np.exp(-gu[:, :F])) * gu[:, F:]
    return d, hp, act @ d["w_dn"].T


@pytest.mark.parametrize("kind,T,n_blocks,allreduce", [("dense", 8, 188, "item"), ("dense", 1, 3, "segment"),
                                                       ("drafter", 16, 40, "item"), ("dense", 5, 1, "item")])
def test_encoded_segment_on_numpy_equals_the_dense_mlp(kind, T, n_blocks, allreduce):
    # the kernel's contract (encoded items, waits, block lists, op binding of bind_dense_mlp) run on numpy:
    # outputs start as NaN, so an element read before it is written or never written shows up
    H, F = 256, 192
    rng = np.random.default_rng(T * 7 + n_blocks)
    shape = (S.LayerShape("dense", 1, T, H=H, nh=2, ql=64, dn=64, dv=32, F=F) if kind == "dense" else
             S.LayerShape("drafter", 1, T, H=H, nh=2, dn=64, dv=64, F=F, nkv=1))
    sc = S.build_layer(shape, n_blocks, allreduce=allreduce, parts=("mlp",))
    d, hp, ref = _mlp_problem(rng, T, H, F)
    nan = lambda *s: np.full(s, np.nan)                  # noqa: E731
    h = d["h"].copy()
    bufs = dict(normed=nan(T, H), act=nan(T, F), out=nan(T, H), final=nan(T, H))
    ops = P.bind_dense_mlp(sc, attn=d["attn"], h=h, post_norm_w=d["nw"], eps=1e-6, w_gate_up=d["w_gu"],
                           w_down=d["w_dn"], **bufs)
    for seed in range(3):
        h[...] = d["h"]
        for b in bufs.values():
            b.fill(np.nan)
        n = P.emulate_segment(sc, 0, ops, seed=seed)
        assert n == sum(1 for it in sc.items if it.segment == 0)
        np.testing.assert_allclose(h, hp, rtol=1e-13, atol=1e-13)
        got = bufs["final"] if allreduce == "item" else bufs["out"]
        assert np.all(np.isfinite(got))
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-12


def test_emulation_catches_a_dropped_wait():
    H, F, T = 256, 192, 4
    sc = S.build_layer(S.LayerShape("dense", 1, T, H=H, nh=2, ql=64, dn=64, dv=32, F=F), 16, allreduce="item",
                       parts=("mlp",))
    for it in sc.items:
        if it.op == "down":
            it.waits = ()
    d, _, _ = _mlp_problem(np.random.default_rng(0), T, H, F)
    bufs = {k: np.full(s, np.nan) for k, s in dict(normed=(T, H), act=(T, F), out=(T, H), final=(T, H)).items()}
    ops = P.bind_dense_mlp(sc, attn=d["attn"], h=d["h"].copy(), post_norm_w=d["nw"], eps=1e-6,
                           w_gate_up=d["w_gu"], w_down=d["w_dn"], **bufs)
    bad = False
    for seed in range(20):
        for b in bufs.values():
            b.fill(np.nan)
        P.emulate_segment(sc, 0, ops, seed=seed)
        bad |= not np.all(np.isfinite(bufs["final"]))
    assert bad, "a down tile that runs before its input exists must show up as NaN"


@pytest.mark.parametrize("n_blocks", [1, 3, 132, 200])
def test_device_rows_hold_every_block_list_in_order(n_blocks):
    # the kernel reads block b's header at row b * stride and its records after it; the map back names the
    # encoded row (errors and the trace report encoded rows)
    sc = S.build_layer(_dense(8), n_blocks, parts=("mlp",))
    enc = sc.encode(0)
    rows, stride, dev_to_enc = P.device_rows(enc)
    bs = enc["block_start"]
    assert rows.shape == (n_blocks * stride + S.RUN_MAX + 1, S.REC_INTS) and rows.dtype == np.int32
    assert stride == int(np.diff(bs).max()) + 1
    seen = []
    for b in range(n_blocks):
        c = int(rows[b * stride, 0])
        assert c == bs[b + 1] - bs[b] and not rows[b * stride, 1:].any()
        np.testing.assert_array_equal(rows[b * stride + 1:b * stride + 1 + c], enc["items"][bs[b]:bs[b + 1]])
        seen += list(dev_to_enc[b * stride + 1:b * stride + 1 + c])
    assert seen == list(range(len(enc["items"])))
    assert (dev_to_enc >= 0).sum() == len(enc["items"])
    assert not rows[-(S.RUN_MAX + 1):].any()           # the padding rows after the last block


def test_shared_memory_layout_fits_sm120():
    # rings at the dynamic base, the executor's words, the largest op table: within sm_120's 99 KB per block
    assert P.smem_bytes(P.MAX_OPS) <= 99 * 1024 < P.smem_bytes(P.MAX_OPS + 1)
    assert P.SMEM_BYTES == P.smem_bytes(P.MAX_OPS) and P.smem_bytes(5) % 16 == 0
    src = (kc.CUDA_SRC_DIR / "persistent_layer.cu").read_text()
    assert f"sizeof(PersistMeta) == {P.META_BYTES}" in src
    assert f"PERSIST_RING_BYTES ({P.RING_BYTES // 1024} * 1024)" in src


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_120", "sm_90"])
def test_executor_has_no_static_shared_memory(arch):
    # static shared memory would push the dynamic GEMM rings off a 128-byte boundary, and cp.async into a
    # misaligned ring moves every 16-byte chunk as two sectors (measured: the executor ran 2x slower)
    from ddtree_cupy import build
    rep = build.compile_spec(P.SPEC, arch)
    assert rep.ok, rep.error
    (k,) = rep.kernels
    assert k.smem_static == 0, f"persistent_layer declares {k.smem_static} B of static shared memory"
    assert k.spill_stores == 0 and k.spill_loads == 0
    # two blocks per SM where shared memory holds two rings (sm_90): the 128-register budget; sm_120 holds
    # one block per SM whatever the registers
    assert 0 < k.registers <= (255 if arch == "sm_120" else 128)


@pytest.mark.parametrize("stages", [3, 4])
def test_part_end_parks_partials_in_a_free_ring_slot(stages):
    # The GEMM run's loop, per warp, as the kernel runs it: the prologue loads stages 0 .. STAGES - 2, stage s
    # loads stage s + STAGES - 1 into slot (s + STAGES - 1) % STAGES and then consumes slot s % STAGES; a part
    # end parks the warp's partial in slot (consumed + STAGES - 1) % STAGES. That slot must hold no stage the
    # warp has yet to consume, and no load may land in it before the part end's barriers (its next load is
    # issued by the next stage). Runs over random part slices, empty ones included.
    src = (kc.CUDA_SRC_DIR / "persistent_layer.cu").read_text()
    assert "((done_st + STAGES - 1) % STAGES) * WST" in src
    rng = np.random.default_rng(7)
    for _ in range(300):
        slices = list(rng.integers(0, 7, size=int(rng.integers(1, S.RUN_MAX + 1))))
        total = sum(slices)
        held = {}                                      # slot -> the stage loaded into it
        for s in range(min(stages - 1, total)):
            held[s] = s

        def part_end(done):
            slot = (done + stages - 1) % stages
            assert held.get(slot, -1) < done, (slices, done, slot, held)

        part, left, done = 0, slices[0], 0

        def retire():
            nonlocal part, left
            while part < len(slices) and left == 0:
                part_end(done)
                part += 1
                if part < len(slices):
                    left = slices[part]

        retire()
        for s in range(total):
            if s + stages - 1 < total:
                held[(s + stages - 1) % stages] = s + stages - 1
            assert held[s % stages] == s               # the stage consumed is the one its slot holds
            done += 1
            left -= 1
            retire()
        assert part == len(slices)


def test_launches_alternate_counter_sets_by_launch_count():
    # Each block counts its launches in its own word; in launch g (0-based) every block reads g, uses set g & 1
    # and zeroes its share of the other one. Model: every launch, in any block order, starts on a zeroed set.
    src = (kc.CUDA_SRC_DIR / "persistent_layer.cu").read_text()
    assert "const int g = launches[blockIdx.x];" in src and "meta->set = g & 1;" in src
    rng = np.random.default_rng(3)
    G, n = 5, 7
    sets = np.zeros((2, n), np.int64)
    count = np.zeros(G, np.int64)
    for g in range(40):
        mine = []
        for b in rng.permutation(G):                   # blocks start in any order, each zeroes its share
            st = int(count[b]) & 1
            count[b] += 1
            mine.append(st)
            sets[1 - st, b::G] = 0
        assert len(set(mine)) == 1 and mine[0] == g & 1
        assert not sets[g & 1].any(), g                # this launch's set was zeroed by the one before it
        sets[g & 1] += rng.integers(1, 9, size=n)      # the launch's arrivals leave counts behind


@pytest.mark.parametrize("kind", ["norm", "gemm"])
def test_dependency_chain_emulates_the_stages_in_order(kind):
    # the encoded chain on the numpy twin equals the stages applied one after another in float64
    rng = np.random.default_rng(11)
    T, W, n = 3, 256, 4
    sc = S.build_chain(kind, T, W, n, 37)
    x0 = rng.standard_normal((T, W))
    ws = [rng.standard_normal(W) if kind == "norm" else rng.standard_normal((W, W)) / 16 for _ in range(n)]
    ref = x0
    for w in ws:
        ref = w * ref / np.sqrt(np.mean(ref * ref, axis=1, keepdims=True) + 1e-6) if kind == "norm" else ref @ w.T
    scs = [sc] + ([S.build_chain(kind, T, W, n, 37, whole_units=True)] if kind == "gemm" else [])
    for sc_, seed in ((c, sd) for c in scs for sd in range(3)):
        xs = [x0.copy()] + [np.full((T, W), np.nan) for _ in range(n)]
        P.emulate_segment(sc_, 0, P.bind_chain(sc_, xs, ws), seed=seed)
        assert np.linalg.norm(xs[-1] - ref) / np.linalg.norm(ref) < 1e-12
    with pytest.raises(ValueError, match="row buffers"):
        P.bind_chain(sc, xs[:-1], ws)
