"""ddtree_cupy.knobs: one declaration per environment switch, validated, and the README's table made from it."""
from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from ddtree_cupy import knobs

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAME = r"(?:DDT|DDTREE_CUPY)_[A-Z0-9_]+"
# ways the code reads or sets an environment variable
ENV_READ = re.compile(r"(?:environ(?:\.get|\.setdefault|\.pop)?\s*\(?\s*\[?|getenv\s*\(|setenv\s*\(|delenv\s*\(|"
                      r"dict\([^)]*?)\s*[\"']?(" + NAME + r")\b")
SHELL_SET = re.compile(r"(?:^|[\s;(])(?:export\s+)?(" + NAME + r")=", re.M)


def _files(*globs):
    for g in globs:
        yield from (p for p in ROOT.glob(g) if p.is_file())


def _cuda_macros() -> set:
    """Names the CUDA sources test or define at compile time (selected by -D options, not the environment)."""
    out = set()
    for p in _files("cuda_src/*.cu", "cuda_src/*.cuh"):
        out |= set(re.findall(r"#\s*(?:if|ifdef|ifndef|elif|define)\b[^\n]*?\b(" + NAME + r")", p.read_text()))
        out |= set(re.findall(r"defined\s*\(\s*(" + NAME + r")\s*\)", p.read_text()))
    return out


def _py_sources():
    return list(_files("ddtree_cupy/**/*.py", "bench/**/*.py", "tests/**/*.py"))


def test_every_environment_switch_read_anywhere_is_declared():
    read = {}
    for p in _py_sources():
        for m in ENV_READ.finditer(p.read_text()):
            read.setdefault(m.group(1), str(p.relative_to(ROOT)))
    for p in _files("bench/*.sh", "launcher/*.sh", ".ci/run"):
        for m in SHELL_SET.finditer(p.read_text()):
            read.setdefault(m.group(1), str(p.relative_to(ROOT)))
    undeclared = {n: f for n, f in read.items() if n not in knobs.ENV_NAMES}
    assert not undeclared, f"environment switches not declared in ddtree_cupy/knobs.py: {undeclared}"
    assert "DDT_PDL" in read and "DDT_GPU_MEM_LOG" in read      # the scan does see the known reads


def test_every_ddt_name_in_python_is_a_knob_or_a_cuda_macro():
    """A quoted DDT_* string in Python is either an environment knob or a compile-time macro of cuda_src/
    (passed with -D); anything else is a switch read some way the scan above does not know."""
    macros = _cuda_macros()
    assert "DDT_PDL_WAIT" in macros
    stray = {}
    for p in _py_sources():
        for n in re.findall(r"[\"'](?:-D)?(" + NAME + r")", p.read_text()):
            if n not in knobs.ENV_NAMES and n not in macros:
                stray.setdefault(n, str(p.relative_to(ROOT)))
    assert not stray, f"DDT_* names that are neither knobs nor CUDA macros: {stray}"


def test_only_knobs_reads_the_environment_for_switches():
    """Product modules take their switches from knobs.get(), not from os.environ."""
    for p in _files("ddtree_cupy/**/*.py"):
        if p.name == "knobs.py":
            continue
        for m in ENV_READ.finditer(p.read_text()):
            pytest.fail(f"{p.relative_to(ROOT)} reads {m.group(1)} from the environment; use ddtree_cupy.knobs")


def test_defaults_and_parsing():
    k = knobs.from_env({})
    assert k == knobs.Knobs()
    assert k.pdl is False and k.mla_policy == "auto" and k.tree_topk is None and k.gemm_wide is None
    k = knobs.from_env({"DDT_PDL": "1", "DDT_TREE_TOPK": "list", "DDT_MLA_PARTIAL_BF16": "on",
                        "DDT_GEMM_WIDE": " 0 ", "DDT_ROUTER_DOWN": ""})
    assert (k.pdl, k.tree_topk, k.mla_partial_bf16, k.gemm_wide, k.router_down) \
        == (True, "list", True, False, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.pdl = False


@pytest.mark.parametrize("env,value", [("DDT_PDL", "yes"), ("DDT_MLA_POLICY", "fast"), ("DDT_TREE_TOPK", "8"),
                                       ("DDT_TREE_TOPK", "lists"), ("DDT_GEMM_WIDE", "2"),
                                       ("DDT_MLA_PARTIAL_BF16", "maybe")])
def test_bad_values_name_the_variable(env, value):
    with pytest.raises(ValueError, match=env):
        knobs.from_env({env: value})


def test_get_is_built_once_and_follows_the_environment(monkeypatch):
    monkeypatch.delenv("DDT_TREE_TOPK", raising=False)
    a = knobs.get()
    assert knobs.get() is a                                 # no rebuild while the environment is unchanged
    monkeypatch.setenv("DDT_TREE_TOPK", "scan")
    b = knobs.get()
    assert b is not a and b.tree_topk == "scan"
    monkeypatch.setenv("DDT_TREE_TOPK", "x")
    with pytest.raises(ValueError, match="DDT_TREE_TOPK"):
        knobs.get()


def test_readme_table_is_generated_from_the_knobs():
    readme = (ROOT / "README.md").read_text()
    table = knobs.readme_table()
    assert table in readme, "README.md's switch table differs from `python -m ddtree_cupy.knobs`; paste its output"
    for k in knobs.KNOBS:
        assert k.doc and k.document and (ROOT / k.document).exists(), k.env
