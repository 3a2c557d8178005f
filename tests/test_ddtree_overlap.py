"""CPU checks of variant 11's stage 1 -> merge overlap (cuda_src/ddtree.cu DDT_OVERLAP, kernels/ddtree.py
OVERLAP_VARIANTS; docs/history/2026-11-29-ddtree.md "Stage 1 -> merge overlap"): stage 1 counts its finished chunks per row,
the merge waits for its own row's count (then resets it) instead of the whole stage-1 grid.

1. The wrappers on the numpy CuPy stand-in (tests/_fake_cupy.py), with the kernels' counter protocol emulated
   from the raw launch arguments: the counters are zero before every stage-1 launch and after every merge,
   only variant 11 with PDL on passes them (eager and graph replay), stand-alone launches and every other
   variant pass none, and bad combinations raise naming ``row_cnt``.
2. A discrete-event model of programmatic dependent launch (slots, dispatch in grid order, a dependent grid
   scheduled once every primary block has triggered or exited, grid-complete waits), run with random
   interleavings and slot counts: the protocol as written never deadlocks and never lets a merge read a row
   before its chunks are written, while three broken protocols are caught (no counter wait, no reset,
   dependents scheduled before every primary block has started).
3. The kernel still contains the statements the models mirror.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import _fake_cupy as fake

SRC = (Path(__file__).resolve().parents[1] / "cuda_src" / "ddtree.cu").read_text()


# ---------------------------------------------------------------------------------------------------
# 1. wrappers + emulated counter protocol
# ---------------------------------------------------------------------------------------------------
@pytest.fixture()
def wrappers(monkeypatch):
    for name, mod in fake.MODULES.items():
        monkeypatch.setitem(sys.modules, name, mod)
    from ddtree_cupy.kernels import ddtree as ddt
    from ddtree_cupy.kernels import launch
    calls = []

    def stage1(variant, grid, args):
        assert len(args) == (9 if variant in ddt.OVERLAP_VARIANTS else 8), (variant, len(args))
        cnt = args[8] if len(args) == 9 else None
        P, rows = grid
        if isinstance(cnt, np.ndarray):
            assert cnt.shape == (rows,)
            assert (cnt == 0).all(), "a stage-1 launch found counts left by an earlier one"
            cnt += np.uint32(P)          # every block of the row adds 1
        calls.append(("stage1", variant, cnt))

    def merge(variant, grid, args):
        assert len(args) == (11 if variant in ddt.OVERLAP_VARIANTS else 10), (variant, len(args))
        cnt = args[10] if len(args) == 11 else None
        P = int(args[3])
        if isinstance(cnt, np.ndarray):
            assert (cnt == P).all(), "a merge would wait for counts that never come (or read early)"
            cnt[...] = 0                 # the merge block's reset
        calls.append(("merge", variant, cnt))

    def get_kernel(spec, name, max_dynamic_smem=0):
        variant = int(dict(spec.defines)["DDT_FAST"])
        impl = stage1 if name.startswith("ddt_topk_partial") else (merge if name == "ddt_topk_merge" else None)
        assert impl is not None, name
        return fake.launcher(lambda grid, args: impl(variant, grid, args))

    monkeypatch.setattr(ddt, "get_kernel", get_kernel)
    was = launch.pdl_enabled()
    yield ddt, launch, calls
    launch.set_pdl(was)


def _logits(S, D, V):
    return fake.cp.asarray(np.random.default_rng(0).standard_normal((S, D, V)).astype(np.float32))


def test_workspace_passes_counters_only_with_pdl(wrappers):
    ddt, launch, calls = wrappers
    S, D, V, K = 10, 7, 40960, 64
    ws = ddt.DDTreeWorkspace(S, D, V, K, fast=11)
    assert ws.row_cnt.dtype == np.uint32 and ws.row_cnt.shape == (S * D,) and (ws.row_cnt == 0).all()
    assert "row_cnt" not in ws.outputs()          # tests poison outputs: the counters must stay zero
    x = _logits(S, D, V)
    launch.set_pdl(False)
    ws.topk(x)
    assert [(c[0], c[2]) for c in calls] == [("stage1", np.uint64(0)), ("merge", np.uint64(0))]   # null
    calls.clear()
    launch.set_pdl(True)
    for _ in range(3):
        ws.topk(x)
    assert len(calls) == 6 and all(c[2] is ws.row_cnt for c in calls), calls
    assert (ws.row_cnt == 0).all()
    calls.clear()
    stream = fake.cp.cuda.Stream()
    with stream:                                   # captured with PDL on: the replays count and reset
        stream.begin_capture()
        ws.topk(x)
        ws.topk(x)
        graph = stream.end_capture()
    assert not calls
    for _ in range(3):
        graph.launch(stream)
        assert (ws.row_cnt == 0).all()
    assert len(calls) == 12 and all(c[2] is ws.row_cnt for c in calls)


def test_standalone_launches_and_other_variants_pass_no_counters(wrappers):
    ddt, launch, calls = wrappers
    launch.set_pdl(True)
    S, D, V, K = 2, 7, 16384, 16
    for v in (8, 7, 3, 0):
        ws = ddt.DDTreeWorkspace(S, D, V, K, fast=v)
        assert ws.row_cnt is None
        ws.topk(_logits(S, D, V))
    assert all(c[2] is None for c in calls) and len(calls) == 8
    calls.clear()
    small = ddt.DDTreeWorkspace(1, 7, V, 8, fast=11)     # <= 7 rows, k <= 8: variant 3's list top-K
    assert small.topk_fast == 3 and small.row_cnt is None
    ws = ddt.DDTreeWorkspace(S, D, V, K, fast=11)
    flat = _logits(S, D, V).reshape(S * D, V)
    ddt.topk_partial(flat, K, ws.part_keys, ws.part_ms, fast=11)
    ddt.topk_merge(ws.part_keys, ws.part_ms, K, ws.keys, ws.ms, ws.top_lp.reshape(S * D, K),
                   ws.top_id.reshape(S * D, K), fast=11)
    assert [c[2] for c in calls] == [np.uint64(0), np.uint64(0)] and (ws.row_cnt == 0).all()


def test_bad_counter_arguments_raise(wrappers):
    ddt, launch, calls = wrappers
    S, D, V, K = 2, 7, 16384, 16
    ws8 = ddt.DDTreeWorkspace(S, D, V, K, fast=8)
    ws = ddt.DDTreeWorkspace(S, D, V, K, fast=11)
    flat = _logits(S, D, V).reshape(S * D, V)
    with pytest.raises(ValueError, match="row_cnt"):
        ddt.topk_partial(flat, K, ws8.part_keys, ws8.part_ms, fast=8, row_cnt=ws.row_cnt)
    with pytest.raises(ValueError, match="row_cnt"):
        ddt.topk_partial(flat, K, ws.part_keys, ws.part_ms, fast=11, row_cnt=fake.cp.zeros(S * D, np.int32))
    with pytest.raises(ValueError, match="row_cnt"):
        ddt.topk_partial(flat, K, ws.part_keys, ws.part_ms, fast=11, row_cnt=fake.cp.zeros(S * D + 1, np.uint32))
    keys = fake.cp.zeros((2, S * D, K), np.uint64)
    ms = fake.cp.zeros((2, S * D, 2), np.float32)
    with pytest.raises(ValueError, match="row_cnt"):
        ddt.topk_merge(keys, ms, K, ws.keys, ws.ms, ws.top_lp.reshape(S * D, K), ws.top_id.reshape(S * D, K),
                       parts_major=True, fast=11, row_cnt=ws.row_cnt)
    assert not calls


# ---------------------------------------------------------------------------------------------------
# 2. discrete-event model of PDL scheduling with the counter protocol
# ---------------------------------------------------------------------------------------------------
class _Block:
    def __init__(self, kernel, idx, prog):
        self.kernel, self.idx, self.prog, self.pc = kernel, idx, prog, 0
        self.triggered = False


class _Kernel:
    def __init__(self, name, rnd, n, make):
        self.name, self.rnd = name, rnd
        self.blocks = [_Block(self, i, make(i)) for i in range(n)]
        self.next_dispatch = 0
        self.launched = False

    def done(self):
        return all(b.pc is None for b in self.blocks)

    def all_started(self):
        return self.next_dispatch == len(self.blocks) and all(b.triggered or b.pc is None for b in self.blocks)


def simulate(rng, slots, rows=4, P=3, rounds=3, broken=None):
    """Rounds of (stage 1: rows x P blocks, merge: rows blocks, builder: 1 block), every block one slot.
    Returns 'ok', 'deadlock' or 'early read'. ``broken``: None (the protocol as written), 'nowait' (the
    merge does not wait for its row's count), 'noreset' (it does not reset the count), 'early_sched' (a
    dependent grid is scheduled once ANY primary block has triggered)."""
    cnt = [0] * rows
    data = [[-1] * P for _ in range(rows)]
    out = [-1] * rows
    kernels = []
    st = {"bad": False}

    def need_done(k):        # griddepcontrol.wait: the previous grid in the stream has completed
        return lambda: k is None or k.done()

    def stage1_prog(k_prev, rnd):
        def make(i):
            row, c = divmod(i, P)

            def write():
                data[row][c] = rnd

            def arrive():
                cnt[row] += 1
            return [("wait", need_done(k_prev)), ("trigger",), ("work",), ("do", write), ("do", arrive)]
        return make

    def merge_prog(rnd):
        def make(row):
            def read():
                if any(v != rnd for v in data[row]):
                    st["bad"] = True
                out[row] = rnd

            def reset():
                cnt[row] = 0
            prog = [("trigger",)]
            if broken != "nowait":
                prog.append(("wait", lambda: cnt[row] >= P))
            prog.append(("do", read))
            if broken != "noreset":
                prog.append(("do", reset))
            return prog
        return make

    def build_prog(k_merge, rnd):
        def make(i):
            def read():
                if any(v != rnd for v in out):
                    st["bad"] = True
            return [("wait", need_done(k_merge)), ("trigger",), ("do", read)]
        return make

    prev = None
    for rnd in range(rounds):
        k1 = _Kernel("stage1", rnd, rows * P, stage1_prog(prev, rnd))
        km = _Kernel("merge", rnd, rows, merge_prog(rnd))
        kb = _Kernel("build", rnd, 1, build_prog(km, rnd))
        kernels += [k1, km, kb]
        prev = kb
    kernels[0].launched = True
    running = []
    for _ in range(100000):
        for a, b in zip(kernels[:-1], kernels[1:]):   # PDL: the dependent grid's launch
            if a.launched and not b.launched:
                if broken == "early_sched":
                    b.launched = any(x.triggered for x in a.blocks)
                else:
                    b.launched = a.all_started() or a.done()
        while len(running) < slots:                  # dispatch, grid order within a kernel
            ready = [k for k in kernels if k.launched and k.next_dispatch < len(k.blocks)]
            if not ready:
                break
            k = ready[int(rng.integers(len(ready)))]
            running.append(k.blocks[k.next_dispatch])
            k.next_dispatch += 1
        movable = [b for b in running if b.prog[b.pc][0] != "wait" or b.prog[b.pc][1]()]
        if not movable:
            return "ok" if all(k.done() for k in kernels) else "deadlock"
        b = movable[int(rng.integers(len(movable)))]
        op = b.prog[b.pc]
        if op[0] == "trigger":
            b.triggered = True
        elif op[0] == "do":
            op[1]()
        b.pc += 1
        if b.pc == len(b.prog):
            b.pc = None
            running.remove(b)
        if st["bad"]:
            return "early read"
    raise AssertionError("simulation did not finish")


@pytest.mark.parametrize("slots", [1, 2, 3, 5, 8, 64])
def test_protocol_never_deadlocks_or_reads_early(slots):
    rng = np.random.default_rng(slots)
    for _ in range(150):
        assert simulate(rng, slots) == "ok"


@pytest.mark.parametrize("broken,outcome", [("nowait", "early read"), ("noreset", "early read"),
                                            ("early_sched", "deadlock")])
def test_model_catches_broken_protocols(broken, outcome):
    rng = np.random.default_rng(7)
    seen = {simulate(rng, slots, broken=broken) for slots in (2, 3, 5, 8) for _ in range(60)}
    assert outcome in seen, seen


# ---------------------------------------------------------------------------------------------------
# 3. the kernel statements the models mirror
# ---------------------------------------------------------------------------------------------------
def test_kernel_has_the_modelled_protocol():
    assert "#define DDT_OVERLAP (DDT_FAST == 11)" in SRC
    s1 = SRC[SRC.index("__device__ __forceinline__ void topk_partial("):SRC.index("ddt_topk_partial_f32(")]
    wait, trig = s1.index("DDT_PDL_WAIT();"), s1.index("if (row_cnt) DDT_PDL_LAUNCH_DEPENDENTS();")
    assert wait < trig                                   # trigger after the wait: everything earlier has finished
    assert s1.count("if (row_cnt) row_arrive(row_cnt, r, tid);") == 2   # k == 1 and the scan path
    arrive = SRC[SRC.index("void row_arrive("):SRC.index("void row_wait(")]
    assert arrive.index("__syncthreads();") < arrive.index("__threadfence();") < arrive.index("atomicAdd(row_cnt + r, 1u);")
    rw = SRC[SRC.index("void row_wait("):SRC.index("#endif", SRC.index("void row_wait("))]
    for stmt in ('ld.acquire.gpu.global.u32', "if (c >= (unsigned)P) break;", "row_cnt[r] = 0u;", "__trap();",
                 "__syncthreads();"):
        assert stmt in rw, stmt
    mk = SRC[SRC.index("ddt_topk_merge(const u64*"):]
    assert mk.index("DDT_PDL_LAUNCH_DEPENDENTS();") < mk.index("row_wait(row_cnt, r, P, tid);") < mk.index("merge_scan_regs(")
    # stage-1 data and the logits' re-read go through L2 in the overlap variant
    assert "return __ldcg(p);" in SRC and SRC.count("v.load_l2(xrow + base[t], t);") == 2
    for stmt in ("gk[j] = j < P ? ld_s1(&row[", "msv = ld_s1(&in_ms[", "const u64 h0 = ld_s1(row), h1 = ld_s1(row + 1);"):
        assert stmt in SRC, stmt
