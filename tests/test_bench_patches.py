"""The measurement patches in bench/patches (variants built and CPU-tested, waiting for a GPU run) still apply
to the tree, their kernels still build for sm_120 and sm_90 with no spills, and the CPU tests they carry pass
with them applied: a patch that no longer applies, builds or passes would be a variant nobody can measure."""
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATCHES = sorted((ROOT / "bench" / "patches").glob("*.patch"))
needs_git = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                               reason="needs a git checkout")


def touched(patch: pathlib.Path):
    """The repository paths a patch changes (its '+++ b/...' lines)."""
    return sorted({m.group(1) for m in re.finditer(r"^\+\+\+ b/(\S+)", patch.read_text(), re.M)})


def patched_copy(patch: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """The tree's sources and tests (no git data, caches or results) at ``dst`` with ``patch`` applied."""
    skip = {".git", "__pycache__", ".pytest_cache", "results", ".hypothesis"}
    shutil.copytree(ROOT, dst, ignore=lambda d, names: [n for n in names if n in skip])
    r = subprocess.run(["git", "apply", str(patch)], cwd=dst, capture_output=True, text=True)
    assert r.returncode == 0, f"{patch.name} does not apply: {r.stderr}"
    return dst


@needs_git
@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_patch_applies(patch):
    r = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"{patch.name} no longer applies: {r.stderr}"


@needs_git
@pytest.mark.slow
@pytest.mark.parametrize("patch", [p for p in PATCHES if any(t.startswith("cuda_src/") for t in touched(p))],
                         ids=lambda p: p.name)
@pytest.mark.parametrize("arch", ["sm_120", "sm_90"])
def test_patched_kernels_build(patch, arch, tmp_path, monkeypatch):
    # every registered spec compiling a .cu file the patch changes (every spec, where it changes a header),
    # built from the patched sources: compiles, no spills
    from ddtree_cupy import build
    from ddtree_cupy.kernels import compile as kc
    src = patched_copy(patch, tmp_path / "tree") / "cuda_src"
    monkeypatch.setattr(kc, "CUDA_SRC_DIR", src)
    changed = {t.split("/", 1)[1] for t in touched(patch) if t.startswith("cuda_src/")}
    build.import_kernel_modules()
    specs = [s for s in kc.registered_specs()
             if s.src in changed or any(not c.endswith(".cu") for c in changed)]
    assert specs, f"{patch.name}: no registered spec builds {sorted(changed)}"
    for spec in specs:
        rep = build.compile_spec(spec, arch)
        assert rep.ok, rep.error
        for k in rep.kernels:
            assert k.spill_stores == 0 and k.spill_loads == 0, f"{patch.name}: {k.name} spills on {arch}"


@needs_git
@pytest.mark.slow
@pytest.mark.parametrize("patch", [p for p in PATCHES if any(t.startswith("tests/test_") for t in touched(p))],
                         ids=lambda p: p.name)
def test_patch_carried_cpu_tests_pass(patch, tmp_path):
    # the CPU test files the patch changes, run in a patched copy of the tree (its own package first on the path)
    tree = patched_copy(patch, tmp_path / "tree")
    tests = [t for t in touched(patch) if t.startswith("tests/test_")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tree)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], cwd=tree,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{patch.name}: its CPU tests fail with it applied:\n{r.stdout[-3000:]}"
