"""Compile every registered kernel for the given architectures without a GPU and report resources.

    python -m ddtree_cupy.build --arch sm_120 sm_90 [--hot-only] [--src FILE.cu ...] [--json]

Imports every module under ``ddtree_cupy.kernels`` (each registers its ``KernelSpec``s at import), compiles
each spec with NVRTC directly (``cupy_backends.cuda.libs.nvrtc``; the options are
``compile.nvrtc_options``, i.e. what CuPy's RawModule uses on a GPU) plus ``-Xptxas=-v``, and parses
ptxas' report per kernel: registers, spill stores/loads (bytes), static shared memory, stack frame.
Exit status 1 on any compile error or on spills in a spec marked ``hot``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from ddtree_cupy.kernels import compile as kc
from ddtree_cupy.run import plural

# The per-block limit on the target (RTX PRO 6000, sm_120); the build flags kernels whose static shared
# memory alone passes it (dynamic shared memory is a launch-time choice and checked by the wrappers).
SMEM_LIMIT_BYTES = 99 * 1024


@dataclass
class KernelReport:
    name: str                  # the name the engine uses (extern "C" name or template expression)
    symbol: str                # the mangled entry symbol
    registers: int = -1
    spill_stores: int = 0
    spill_loads: int = 0
    smem_static: int = 0
    stack: int = 0
    cmem0: int = 0


@dataclass
class SpecReport:
    src: str
    arch: str
    defines: Dict[str, str]
    hot: bool
    ok: bool
    seconds: float
    error: str = ""
    kernels: List[KernelReport] = field(default_factory=list)

    def problems(self) -> List[str]:
        out = []
        if not self.ok:
            out.append(f"{self.src} [{self.arch}]: compile error")
        for k in self.kernels:
            if k.registers < 0:
                out.append(f"{self.src} [{self.arch}] {k.name}: no ptxas report found")
            if self.hot and (k.spill_stores or k.spill_loads):
                out.append(f"{self.src} [{self.arch}] {k.name}: spills {k.spill_stores} B stores / "
                           f"{k.spill_loads} B loads in a hot kernel")
            if k.smem_static > SMEM_LIMIT_BYTES:
                out.append(f"{self.src} [{self.arch}] {k.name}: {k.smem_static} B static shared memory "
                           f"> {SMEM_LIMIT_BYTES}")
        return out


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_CMEM = re.compile(r"(\d+) bytes cmem\[0\]")


def parse_ptxas_log(log: str) -> Dict[str, dict]:
    """ptxas -v output -> {entry symbol: {registers, spill_stores, spill_loads, smem_static, stack, cmem0}}.

    Entry functions are reported; the spills of a non-inlined device function (which ptxas lists on its
    own) are added to every entry of the same log, so that a call cannot hide a spill from the check."""
    out: Dict[str, dict] = {}
    callee = [0, 0]                  # spill stores / loads of non-entry functions
    entry: Optional[str] = None      # the entry whose "Used ..." line is pending
    props_for: Optional[str] = None  # whose "Function properties" block the next frame line belongs to
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            entry = m.group(1)
            out.setdefault(entry, dict(registers=-1, spill_stores=0, spill_loads=0, smem_static=0,
                                       stack=0, cmem0=0))
            continue
        m = _PROPS.search(line)
        if m:
            props_for = m.group(1)
            continue
        m = _FRAME.search(line)
        if m and props_for in out:
            out[props_for].update(stack=int(m.group(1)), spill_stores=int(out[props_for]["spill_stores"]) +
                                  int(m.group(2)), spill_loads=int(out[props_for]["spill_loads"]) + int(m.group(3)))
            continue
        if m and props_for is not None:
            callee[0] += int(m.group(2))
            callee[1] += int(m.group(3))
            continue
        m = _USED.search(line)
        if m and entry is not None:
            rec = out[entry]
            rec["registers"] = int(m.group(1))
            s = _SMEM.search(line)
            rec["smem_static"] = int(s.group(1)) if s else 0
            c = _CMEM.search(line)
            rec["cmem0"] = int(c.group(1)) if c else 0
            entry = None
    for rec in out.values():
        rec["spill_stores"] += callee[0]
        rec["spill_loads"] += callee[1]
    return out


def compile_spec(spec: kc.KernelSpec, arch: str) -> SpecReport:
    """NVRTC-compile ``spec`` for ``arch`` (no GPU needed) and collect ptxas' resource report."""
    from cupy_backends.cuda.libs import nvrtc
    arch = kc.normalize_arch(arch)
    rep = SpecReport(src=spec.src, arch=arch, defines=dict(spec.defines), hot=spec.hot, ok=False, seconds=0.0)
    t0 = time.perf_counter()
    prog = nvrtc.createProgram(spec.source(), spec.src, [], [])
    try:
        for name in spec.names:
            nvrtc.addNameExpression(prog, name)
        opts = list(kc.nvrtc_options(spec, arch)) + ["-Xptxas=-v"]
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError:
            rep.error = kc.format_compile_error(spec, arch, nvrtc.getProgramLog(prog))
            rep.seconds = time.perf_counter() - t0
            return rep
        log = nvrtc.getProgramLog(prog)
        parsed = parse_ptxas_log(log)
        for name in spec.names:
            sym = nvrtc.getLoweredName(prog, name)
            rec = parsed.get(sym, dict(registers=-1))
            rep.kernels.append(KernelReport(name=name, symbol=sym, **rec))
        rep.ok = True
    finally:
        nvrtc.destroyProgram(prog)
    rep.seconds = time.perf_counter() - t0
    return rep


def import_kernel_modules() -> List[str]:
    """Import every module under ddtree_cupy.kernels so that each registers its specs."""
    import ddtree_cupy.kernels as pkg
    names = []
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = f"ddtree_cupy.kernels.{info.name}"
        importlib.import_module(mod)
        names.append(mod)
    return names


def build(archs: Sequence[str], hot_only: bool = False, srcs: Optional[Sequence[str]] = None,
          progress: Optional[Callable[[int, int, SpecReport], None]] = None) -> List[SpecReport]:
    """Compile every selected spec for every arch; ``progress(i, n, report)`` after each (a full build takes
    minutes on a small machine, so the command line shows each spec as it finishes)."""
    import_kernel_modules()
    specs = [s for s in kc.registered_specs() if (s.hot or not hot_only) and (not srcs or s.src in srcs)]
    if srcs:
        unknown = sorted(set(srcs) - {s.src for s in kc.registered_specs()})
        if unknown:
            raise SystemExit(f"--src: no registered spec compiles {', '.join(unknown)}")
    jobs = [(s, a) for a in archs for s in specs]
    out = []
    for i, (s, a) in enumerate(jobs, 1):
        out.append(compile_spec(s, a))
        if progress is not None:
            progress(i, len(jobs), out[-1])
    return out


def _print_progress(i: int, n: int, r: SpecReport) -> None:
    defs = ",".join(f"{k}={v}" for k, v in sorted(r.defines.items()))
    print(f"[{i}/{n}] {r.arch} {r.src}{' ' + defs if defs else ''}: "
          f"{plural(len(r.kernels), 'kernel') if r.ok else 'COMPILE ERROR'} in {r.seconds:.1f} s",
          file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .run import HelpWithDefaults
    ap = argparse.ArgumentParser(prog="python -m ddtree_cupy.build", description=__doc__.splitlines()[0],
                                 formatter_class=HelpWithDefaults)
    ap.add_argument("--arch", nargs="+", default=["sm_120", "sm_90"], help="e.g. sm_120 sm_90")
    ap.add_argument("--hot-only", action="store_true", help="only the specs marked hot")
    ap.add_argument("--src", nargs="+", metavar="FILE.cu",
                    help="only the specs of these cuda_src files (a quick check of one kernel family)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--quiet", action="store_true", help="no per-spec progress lines on stderr")
    args = ap.parse_args(argv)
    if not kc.cuda_include_dirs():
        print("warning: no CUDA runtime headers found (pip install nvidia-cuda-runtime-cu12, or set "
              "CUDA_PATH); kernels including <cuda_bf16.h> will fail", file=sys.stderr)
    reports = build(args.arch, args.hot_only, args.src, progress=None if args.quiet else _print_progress)
    problems = [p for r in reports for p in r.problems()]
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=1))
    else:
        print(f"{'arch':7} {'source':18} {'kernel':64} {'regs':>4} {'spill':>7} {'smem':>6} {'stack':>5}")
        for r in reports:
            if not r.ok:
                print(f"{r.arch:7} {r.src:18} COMPILE ERROR\n{r.error}")
                continue
            for k in r.kernels:
                name = k.name if len(k.name) <= 64 else k.name[:61] + "..."
                spill = f"{k.spill_stores}/{k.spill_loads}"
                print(f"{r.arch:7} {r.src:18} {name:64} {k.registers:4d} {spill:>7} {k.smem_static:6d} "
                      f"{k.stack:5d}{'  HOT' if r.hot else ''}")
        n_k = sum(len(r.kernels) for r in reports)
        print(f"{plural(len(reports), 'spec build')}, {plural(n_k, 'kernel')}, {sum(r.seconds for r in reports):.1f} s")
    for p in problems:
        print("ERROR:", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
