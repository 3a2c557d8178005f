"""Every ``DDT_*`` / ``DDTREE_CUPY_*`` environment switch of the package, in one frozen, validated object.

``get()`` returns the ``Knobs`` built from the environment: built once and reused while the environment's
values of these variables stay the same (a test or a benchmark that changes one gets a new, validated
object on its next call). A bad value raises ``ValueError`` naming the variable and the accepted values.

The defaults are what measured fastest on the H200 (each knob's document says where). Knobs marked
"measuring" exist to time an alternative against the default; the engine never needs them. Baselines that
only a benchmark turns off are arguments of the bench scripts instead (e.g. `bench.step --no-wide-cluster`).
The README's table of switches is generated from ``KNOBS`` (``python -m ddtree_cupy.knobs``) and a CPU test
(tests/test_knobs.py) checks that it matches and that every ``DDT_*`` name read anywhere is declared here.
This module imports nothing of the package: every floor may read it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Mapping, Optional

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def _bit(env: str, v: str) -> bool:
    """A strict on/off switch: "0" or "1"."""
    s = v.strip()
    if s in ("0", "1"):
        return s == "1"
    raise ValueError(f"{env}: must be 0 or 1, got {v!r}")


def _flag(env: str, v: str) -> bool:
    """An on/off switch that also takes false/true, off/on, no/yes."""
    s = v.strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError(f"{env}: expected 0 or 1, got {v!r}")


def _choice(*allowed: str) -> Callable[[str, str], str]:
    def parse(env: str, v: str) -> str:
        s = v.strip()
        if s not in allowed:
            raise ValueError(f"{env}: expected one of {', '.join(allowed)}, got {v!r}")
        return s
    return parse


def _int_in(lo: int, hi: Optional[int] = None) -> Callable[[str, str], int]:
    def parse(env: str, v: str) -> int:
        try:
            n = int(v.strip())
        except ValueError:
            raise ValueError(f"{env}: expected an integer, got {v!r}") from None
        if n < lo or (hi is not None and n > hi):
            raise ValueError(f"{env}: expected {lo}..{hi if hi is not None else ''}, got {n}")
        return n
    return parse


def _seconds(env: str, v: str) -> float:
    try:
        x = float(v.strip())
    except ValueError:
        raise ValueError(f"{env}: expected a number of seconds, got {v!r}") from None
    if not 0.0 < x < 3600.0:
        raise ValueError(f"{env}: expected seconds in (0, 3600), got {v!r}")
    return x


def _text(env: str, v: str) -> str:
    return v.strip()


@dataclasses.dataclass(frozen=True)
class Knob:
    """One switch: its variable, the field of ``Knobs`` it fills, parser, default (None = the module's rule
    decides), accepted values as shown to users, one line of documentation, and where the design is."""
    env: str
    field: str
    parse: Callable[[str, str], object]
    default: object
    values: str
    doc: str
    document: str
    measuring: bool = False


KNOBS: tuple = (
    Knob("DDT_PDL", "pdl", _bit, False, "0/1",
         "programmatic dependent launch for kernels launched outside the engine's graphs (the engine decides per "
         "step graph: PDL for every captured step of <= 320 rows)", "docs/KERNELS.md"),
    Knob("DDT_MLA_POLICY", "mla_policy", _choice("auto", "measured", "model"), "auto", "auto/measured/model",
         "how the MLA planner picks tile and split count", "docs/ATTENTION.md"),
    Knob("DDT_MLA_PARTIAL_BF16", "mla_partial_bf16", _flag, None, "0/1",
         "MLA split-KV partials in fp32 (default) / bf16 (0.86-0.99x the attention time; opt-in until its accuracy "
         "is settled on a real checkpoint)", "docs/ATTENTION.md"),
    Knob("DDT_TREE_TOPK", "tree_topk", _choice("scan", "list"), None, "scan/list",
         "the DDTree top-K kind for every shape (unset: list for <= 7 rows and k <= 8, else scan)",
         "docs/DDTREE.md"),
    Knob("DDT_GEMM_WIDE", "gemm_wide", _bit, None, "0/1",
         "bf16 GEMMs of 17-160 rows: split-K kernel / wide-token kernel (unset: wide)", "docs/KERNELS.md"),
    Knob("DDT_ROUTER_DOWN", "router_down", _bit, None, "0/1",
         "the shared expert's down projection inside the route launch: never / wherever shapes allow "
         "(unset: up to 32 rows)", "docs/MODELS.md"),
    Knob("DDT_ALLREDUCE", "allreduce", _choice("auto", "custom", "nccl"), None, "auto/custom/nccl",
         "TP all-reduces on GPUs: the peer-to-peer kernels picked per payload from a calibration / always / never "
         "(unset: nccl until a multi-GPU run measures the peer-to-peer path)", "docs/MULTI_GPU.md"),
    Knob("DDT_ALLREDUCE_TABLE", "allreduce_table", _text, "", "FILE",
         "with DDT_ALLREDUCE=auto: the calibration table (bench/allreduce.py --json output; unset: measured at start-up)",
         "docs/MULTI_GPU.md"),
    Knob("DDT_AR_TIMEOUT_S", "ar_timeout_s", _seconds, None, "S",
         "seconds a peer-to-peer all-reduce block waits for a peer before it reports the peer missing and the job "
         "is aborted (unset: 30)", "docs/MULTI_GPU.md"),
    Knob("DDT_PERSISTENT_MLP", "persistent_mlp", _bit, False, "0/1",
         "a dense layer's MLP half (post-attention norm .. down projection) and the drafter's MLP as one persistent "
         "launch at <= 16 rows (opt-in until a GPU run measures it faster)", "docs/PERSISTENT.md"),
    Knob("DDT_GPU_MEM_LOG", "gpu_mem_log", _text, "", "FILE",
         "the GPU test suite appends each test's CuPy pool footprint to FILE (bench/ci_gpu.sh sets it)",
         "docs/PROFILING.md", measuring=True),
    Knob("DDTREE_CUPY_CACHE", "cache_dir", _text, "", "DIR",
         "where the tiny demo checkpoints are generated (unset: ~/.cache/ddtree_cupy)", "docs/CHECKPOINTS.md"),
    Knob("DDTREE_CUPY_FAULT_GRACE_S", "fault_grace_s", _seconds, None, "S",
         "seconds a rank waits at a phase's agreement point after another rank reported a fault, before it aborts "
         "the job (unset: 3)", "launcher/README.md"),
    Knob("DDTREE_CUPY_TRACEBACK", "traceback", _bit, False, "0/1",
         "1: a rank's fatal error prints its full traceback before the job is aborted", "launcher/README.md"),
)


@dataclasses.dataclass(frozen=True)
class Knobs:
    pdl: bool = False
    mla_policy: str = "auto"
    mla_partial_bf16: Optional[bool] = None
    tree_topk: Optional[str] = None
    gemm_wide: Optional[bool] = None
    router_down: Optional[bool] = None
    allreduce: Optional[str] = None
    allreduce_table: str = ""
    ar_timeout_s: Optional[float] = None
    persistent_mlp: bool = False
    gpu_mem_log: str = ""
    cache_dir: str = ""
    fault_grace_s: Optional[float] = None
    traceback: bool = False


assert [k.field for k in KNOBS] == [f.name for f in dataclasses.fields(Knobs)], "KNOBS and Knobs disagree"
ENV_NAMES = tuple(k.env for k in KNOBS)


def from_env(environ: Optional[Mapping[str, str]] = None) -> Knobs:
    """Knobs from ``environ`` (default ``os.environ``): unset or empty -> the default; else parsed, or a
    ValueError naming the variable."""
    env = os.environ if environ is None else environ
    vals = {}
    for k in KNOBS:
        v = env.get(k.env)
        vals[k.field] = k.default if v is None or v.strip() == "" else k.parse(k.env, v)
    return Knobs(**vals)


_cache: list = [None, None]       # (the environment's values of ENV_NAMES, the Knobs built from them)


def get() -> Knobs:
    """The process's knobs, built from the environment once and again only when one of its variables changed."""
    key = tuple(os.environ.get(n) for n in ENV_NAMES)
    if _cache[0] != key:
        _cache[1] = from_env()
        _cache[0] = key
    return _cache[1]


def readme_table() -> str:
    """The README's table of switches (tests/test_knobs.py checks the README carries exactly this)."""
    rows = ["| variable | values | effect | document |", "|---|---|---|---|"]
    for k in KNOBS:
        rows.append(f"| `{k.env}` | `{k.values}` | {'(measuring) ' if k.measuring else ''}{k.doc} | {k.document} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(readme_table())
