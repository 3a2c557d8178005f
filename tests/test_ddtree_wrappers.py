"""CPU checks of the DDTree wrapper's layout helpers (kernels/ddtree.py) against cuda_src/ddtree.cu: the
per-chunk candidate-list width must be the same function of k on both sides, and the merge's shared memory
must fit the target GPU for the engine's shapes (Kimi K2.6: V = 163840, TP 1..8, k <= 128)."""
import re
from pathlib import Path

import pytest

from ddtree_cupy.kernels import ddtree as ddt

SRC = (Path(__file__).resolve().parents[1] / "cuda_src" / "ddtree.cu").read_text()


def _cu_ternary(name):
    """`__device__ ... int name(int k) { return <c ? a : b chains>; }` from the .cu as a Python function of k
    (the C conditional operator rewritten as Python's, innermost parentheses first)."""
    m = re.search(r"int " + name + r"\(int k\) \{ return ([^;]+); \}", SRC)
    assert m, f"{name} not found in cuda_src/ddtree.cu"
    expr = m.group(1).replace("cand_cap(k)", "cc(k)")

    def py(e):   # "c ? a : b" without parentheses inside the branches -> "(a if c else b)"
        c, rest = e.split("?", 1)
        a, b = rest.split(":", 1)
        return f"({a.strip()} if {c.strip()} else {b.strip()})"
    while "?" in expr:
        inner = re.search(r"\(([^()]*\?[^()]*)\)", expr)
        if inner:
            expr = expr[:inner.start()] + py(inner.group(1)) + expr[inner.end():]
        else:
            expr = py(expr)
    consts = {n: int(re.search(r"#define " + n + r" (\d+)", SRC).group(1)) for n in ("DDT_SCAN_HDR", "DDT_TOPK_THREADS")}
    return eval("lambda k: " + expr, {"cc": ddt.cand_cap, **consts})


@pytest.mark.parametrize("k", list(range(1, ddt.MAX_K + 1)))
def test_candidate_layout_matches_the_kernel(k):
    assert _cu_ternary("cand_cap")(k) == ddt.cand_cap(k)
    assert _cu_ternary("part_width")(k) == ddt.part_width(k)
    assert _cu_ternary("scan_width")(k) == ddt.scan_width(k)
    assert ddt.stage1_width(k, "scan") == ddt.scan_width(k)
    assert ddt.stage1_width(k, "list") == ddt.part_width(k)
    assert ddt.cand_cap(k) >= max(k, 2) and ddt.cand_cap(k) <= 256   # s_cand holds DDT_SORT_CAP keys


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("k", [1, 8, 64, 128])
def test_merge_shared_memory_fits_engine_shapes(tp, k):
    V_local = 163840 // tp
    P = ddt.n_chunks(V_local)
    for kind in ddt.TOPK_KINDS:
        assert ddt.merge_smem(P, k, parts_major=False, kind=kind) <= ddt.MAX_MERGE_SMEM
        assert ddt.merge_smem(tp, k, parts_major=True, kind=kind) <= ddt.MAX_MERGE_SMEM
    # the limit leaves room for the merge's static shared memory under sm_120's 99 KB per block
    assert ddt.MAX_MERGE_SMEM + 4 * 1024 <= 99 * 1024


def test_chunk_constants_match_the_kernel():
    threads = int(re.search(r"#define DDT_TOPK_THREADS (\d+)", SRC).group(1))
    vecs = int(re.search(r"#define DDT_TOPK_VECS (\d+)", SRC).group(1))
    assert ddt.TOPK_THREADS == threads
    assert ddt.MAX_CHUNK == threads * 8 * vecs
    assert ddt.DEFAULT_CHUNK % (threads * 8) == 0 and ddt.DEFAULT_CHUNK <= ddt.MAX_CHUNK


def test_topk_kind_rule():
    """A workspace launches the list top-K only where it measured faster (1 stream, k 8)."""
    assert ddt.topk_kind(7, 8) == "list" and ddt.topk_kind(7, 1) == "list"
    assert ddt.topk_kind(7, 16) == "scan" and ddt.topk_kind(8, 8) == "scan" and ddt.topk_kind(70, 64) == "scan"


def test_kind_is_checked():
    """``kind`` is one of TOPK_KINDS; anything else is refused by name."""
    assert ddt._kind("scan") == "scan" and ddt._kind("list") == "list"
    for bad in (True, 3, 8, "v3", "Scan", None):
        with pytest.raises(ValueError, match="kind"):
            ddt._kind(bad)
    with pytest.raises(ValueError, match="kind"):
        ddt.stage1_width(8, "lists")


def test_kernel_names_and_constants_match_the_kernel():
    """The wrapper's copies of the kernel's limits for the sorted-cache builder and the register merge, and
    its kernel names (the extern "C" kernels and the top-K templates of ddtree.cu, each instantiation once)."""
    assert ddt.MERGE_REGS_MAX_P == int(re.search(r"#define DDT_MREG (\d+)", SRC).group(1))
    assert ddt.CACHE_MAX_BUDGET == int(re.search(r"#define DDT_CACHE_BUDGET (\d+)", SRC).group(1))
    assert ddt.n_chunks(163840) <= ddt.MERGE_REGS_MAX_P   # Kimi K2's vocabulary takes the register merge
    assert {n.split("<")[0] for n in ddt._NAMES} == set(re.findall(r"^(ddt_\w+)\(", SRC, re.M))
    assert len(set(ddt._NAMES)) == len(ddt._NAMES) == 8
    assert set(ddt._MERGE) == set(ddt.TOPK_KINDS) and {k for k, _ in ddt._PARTIAL} == set(ddt.TOPK_KINDS)
