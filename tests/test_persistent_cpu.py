"""The persistent executor's host side without a GPU: the op table layout the kernel's static_asserts pin,
which schedule segments this build can run, and the source digest over the .cu files it includes."""
import numpy as np

from ddtree_cupy.engine import schedule as S
from ddtree_cupy.kernels import compile as kc
from ddtree_cupy.kernels import persistent as P


def test_op_table_layout_matches_the_kernel_struct():
    f = P.OP_DTYPE.fields
    # the same offsets as the static_asserts in cuda_src/persistent_layer.cu
    assert P.OP_DTYPE.itemsize == 104
    assert f["x_stride"][1] == 40 and f["T"][1] == 72 and f["eps"][1] == 88
    src = (kc.CUDA_SRC_DIR / "persistent_layer.cu").read_text()
    assert "sizeof(PersistOp) == 104" in src and "__builtin_offsetof(PersistOp, x_stride) == 40" in src
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


def test_gemm_tiles_fit_the_body():
    # every GEMM tile the builder emits is one the kernel's gemm_rows serves (16 / 32 / 64 rows)
    for nb in (1, 7, 132, 188, 200):
        sc = S.build_layer(_dense(8), nb)
        rows = {it.args[1] for it in sc.items if it.kind == "gemm_tile"}
        assert rows <= {16, 32, 64}


def test_source_digest_covers_included_cu(tmp_path, monkeypatch):
    (tmp_path / "persistent_layer.cu").write_text('#include "gemm_bf16.cu"\n')
    (tmp_path / "gemm_bf16.cu").write_text("// v1\n")
    monkeypatch.setattr(kc, "CUDA_SRC_DIR", tmp_path)
    monkeypatch.setattr(P, "CUDA_SRC_DIR", tmp_path)
    first = P.SPEC.source()
    (tmp_path / "gemm_bf16.cu").write_text("// v2\n")
    assert P.SPEC.source() != first
