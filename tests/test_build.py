"""The build CLI without a GPU: header discovery, ptxas report parsing, compile errors naming file/line/arch,
and (slow) every registered kernel spec compiling for sm_120 and sm_90 with no spills in hot kernels."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from ddtree_cupy import build
from ddtree_cupy.kernels import compile as kc

PTXAS_SAMPLE = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'
ptxas info    : Function properties for _Z3fooPf
ptxas         .     24 bytes stack frame, 16 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 1104 bytes smem, 400 bytes cmem[0]
ptxas info    : Function properties for helper_noinline
ptxas         .     8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'bar' for 'sm_90'
ptxas info    : Function properties for bar
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers, 380 bytes cmem[0]
"""


def test_parse_ptxas_log():
    rep = build.parse_ptxas_log(PTXAS_SAMPLE)
    assert rep["_Z3fooPf"] == dict(registers=40, spill_stores=16, spill_loads=8, smem_static=1104, stack=24, cmem0=400)
    assert rep["bar"] == dict(registers=12, spill_stores=0, spill_loads=0, smem_static=0, stack=0, cmem0=380)
    assert "helper_noinline" not in rep
    # a non-inlined function's spills count against every entry of the log (a call cannot hide a spill)
    spilled = PTXAS_SAMPLE.replace("8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
                                   "8 bytes stack frame, 56 bytes spill stores, 48 bytes spill loads")
    rep = build.parse_ptxas_log(spilled)
    assert (rep["_Z3fooPf"]["spill_stores"], rep["_Z3fooPf"]["spill_loads"]) == (72, 56)
    assert (rep["bar"]["spill_stores"], rep["bar"]["spill_loads"]) == (56, 48)
    assert rep["bar"]["stack"] == 0


def test_cuda_headers_found_without_gpu():
    dirs = kc.cuda_include_dirs()
    assert dirs, "no CUDA runtime headers: pip install nvidia-cuda-runtime-cu12 (see pyproject's cuda12 extra)"


def _spec_at(tmp_path, text, **kw):
    f = tmp_path / "probe.cu"
    f.write_text(text)
    return kc.KernelSpec(src=str(f), **kw)     # an absolute src path overrides cuda_src/


def test_compile_report_and_template_names(tmp_path):
    spec = _spec_at(tmp_path, """#include "common.cuh"
template <int N> __global__ void scale(bf16_bits* p, float f) {
    __shared__ float buf[N];
    buf[threadIdx.x % N] = bf16_to_f32(p[threadIdx.x]) * f;
    __syncthreads();
    p[threadIdx.x] = f32_to_bf16(buf[(threadIdx.x + 1) % N]);
}
extern "C" __global__ void plain(uint32_t* p) { p[threadIdx.x] += 1u; }
""", names=("scale<64>", "scale<128>", "plain"), hot=True)
    for arch in ("sm_120", "sm_90"):
        r = build.compile_spec(spec, arch)
        assert r.ok, r.error
        by = {k.name: k for k in r.kernels}
        assert by["scale<64>"].smem_static == 256 and by["scale<128>"].smem_static == 512
        assert by["plain"].symbol == "plain" and by["plain"].registers > 0
        assert by["scale<64>"].symbol.startswith("_Z")
        assert not r.problems()


def test_compile_error_names_file_line_arch(tmp_path):
    spec = _spec_at(tmp_path, '#include "common.cuh"\n\nextern "C" __global__ void k(float* p) { p[0] = undefined_x; }\n',
                    names=("k",))
    r = build.compile_spec(spec, "sm_120")
    assert not r.ok
    assert "sm_120" in r.error and "probe.cu(3)" in r.error and "undefined_x" in r.error
    assert r.problems()


def test_normalize_arch():
    assert kc.normalize_arch("120") == "sm_120" and kc.normalize_arch("sm90") == "sm_90"
    assert kc.normalize_arch("compute_90a") == "sm_90a"
    with pytest.raises(ValueError, match="arch"):
        kc.normalize_arch("hopper")


@pytest.mark.slow
def test_build_every_registered_spec_sm120_sm90():
    """`python -m ddtree_cupy.build --arch sm_120 sm_90 --json`: every spec compiles, the report parses,
    every kernel has a register count, no spills in hot kernels, static smem within 99 KB."""
    p = subprocess.run([sys.executable, "-m", "ddtree_cupy.build", "--arch", "sm_120", "sm_90", "--json"],
                       capture_output=True, text=True, timeout=900)
    reports = json.loads(p.stdout)
    assert reports, "no kernel specs registered"
    failed = [f"{r['src']} [{r['arch']}]:\n{r['error']}" for r in reports if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert {r["arch"] for r in reports} == {"sm_120", "sm_90"}
    for r in reports:
        for k in r["kernels"]:
            assert k["registers"] > 0, (r["src"], k["name"])
            if r["hot"]:
                assert k["spill_stores"] == 0 and k["spill_loads"] == 0, (r["src"], r["arch"], k)
            assert k["smem_static"] <= build.SMEM_LIMIT_BYTES
    assert p.returncode == 0, p.stderr


def test_source_text_changes_with_shared_headers(tmp_path, monkeypatch):
    # CuPy's disk cache keys on the source text only: an edited .cuh must change that text, or a stale
    # cubin would be loaded for every family that includes it.
    (tmp_path / "k.cu").write_text('#include "h.cuh"\nextern "C" __global__ void k() {}\n')
    (tmp_path / "h.cuh").write_text("#define A 1\n")
    monkeypatch.setattr(kc, "CUDA_SRC_DIR", tmp_path)
    spec = kc.KernelSpec(src="k.cu", names=(), doc="test")
    first = spec.source()
    assert first == spec.source()
    (tmp_path / "h.cuh").write_text("#define A 2\n")
    second = spec.source()
    assert second != first
    assert second.endswith((tmp_path / "k.cu").read_text())


def test_build_shows_progress_as_it_goes():
    """One stderr line per spec build as it finishes ('[i/n] arch file: k kernels in s'), the report on stdout."""
    p = subprocess.run([sys.executable, "-m", "ddtree_cupy.build", "--arch", "sm_120", "sm_90", "--src", "norm.cu"],
                       capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stderr
    lines = [l for l in p.stderr.splitlines() if l.startswith("[")]
    n = len(lines)
    assert n >= 2 and [l.split("]")[0] for l in lines] == [f"[{i}/{n}" for i in range(1, n + 1)], p.stderr
    assert all("norm.cu" in l and " kernel" in l for l in lines), lines
    assert "rmsnorm_kernel" in p.stdout and "spec builds" in p.stdout
    q = subprocess.run([sys.executable, "-m", "ddtree_cupy.build", "--arch", "sm_120", "--src", "norm.cu", "--quiet"],
                       capture_output=True, text=True, timeout=170)
    assert q.returncode == 0 and not [l for l in q.stderr.splitlines() if l.startswith("[")], q.stderr
