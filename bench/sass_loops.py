"""The inner loops of a kernel's machine code, counted without a GPU: how many instructions a loop that holds
mma instructions runs, and of which kinds (docs/PERSISTENT.md uses it to compare the executor's GEMM stage
loop with the plain decode kernel's).

    PYTHONPATH=$PWD python3 -m bench.sass_loops --src persistent_layer.cu [--arch sm_90] [--kernel NAME]

The spec's source goes through NVRTC to PTX (the product's compile options, the architecture's virtual
target), then through ptxas and nvdisasm, which must be on PATH or named by --ptxas / --nvdisasm (the CUDA
toolkit's bin/, or the nvidia-cuda-nvdisasm wheel's). For each kernel and each loop (a backward branch) whose
body holds HMMA instructions it prints the instruction count from the loop's head to its last HMMA (the
stage's path when no branch inside is taken), the count of the whole body, and the loads, copies, shared
loads, barriers and branches among them. A count is static: it says what a loop issues per trip, not how
long the trip takes.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

KINDS = ("HMMA", "LDGSTS", "LDSM", "LDS", "LDG", "STG", "BAR", "BRA")


def ptx_of(src: str, arch: str) -> str:
    """The PTX of the registered spec that compiles cuda_src/``src`` (its first, for a file with several)."""
    from cupy_backends.cuda.libs import nvrtc
    from ddtree_cupy import build
    from ddtree_cupy.kernels import compile as kc
    build.import_kernel_modules()
    spec = next((s for s in kc.registered_specs() if s.src == src), None)
    if spec is None:
        raise SystemExit(f"--src {src}: no registered spec compiles it")
    arch = kc.normalize_arch(arch)
    opts = [o.replace(f"--gpu-architecture={arch}", "--gpu-architecture=compute_" + arch.split("_", 1)[1])
            for o in kc.nvrtc_options(spec, arch)]
    prog = nvrtc.createProgram(spec.source(), spec.src, [], [])
    try:
        for n in spec.names:
            nvrtc.addNameExpression(prog, n)
        nvrtc.compileProgram(prog, opts)
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    if isinstance(ptx, bytes):
        ptx = ptx.decode()
    return ptx.rstrip("\x00")


def _tool(name: str, given: str) -> str:
    path = given or shutil.which(name) or next((p for p in (f"/usr/local/cuda/bin/{name}",) if os.path.exists(p)), "")
    if not path:
        raise SystemExit(f"{name} not found: put the CUDA toolkit's bin/ on PATH or pass --{name} PATH")
    return path


def sass_of(ptx: str, arch: str, ptxas: str, nvdisasm: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        p, c = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(p, "w") as f:
            f.write(ptx)
        subprocess.run([ptxas, f"-arch={arch}", "-o", c, p], check=True, capture_output=True)
        return subprocess.run([nvdisasm, "-c", c], check=True, capture_output=True, text=True).stdout


def functions(sass: str) -> Dict[str, Tuple[List[str], Dict[str, int]]]:
    """{function: (instructions, label -> index of the instruction after it)} of nvdisasm -c output."""
    out, cur = {}, None
    for ln in sass.splitlines():
        m = re.match(r"\s*\.section\s+\.text\.([^,\s]+)", ln)
        if m:
            cur = m.group(1)
            out[cur] = ([], {})
            continue
        if cur is None:
            continue
        ins, labels = out[cur]
        m = re.match(r"^\s*(\.L\w+):", ln)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", ln)
        if m:
            ins.append(m.group(1))
    return out


def _op(ins: str) -> str:
    parts = ins.split()
    return (parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]).split(".")[0]


def mma_loops(ins: List[str], labels: Dict[str, int]):
    """(head..last HMMA count, body count, kind counts) of every loop whose body holds an HMMA."""
    loops = []
    for i, x in enumerate(ins):
        m = re.search(r"BRA\s+`?\(?(\.L\w+)", x)
        if not m or m.group(1) not in labels or labels[m.group(1)] > i:
            continue
        head = labels[m.group(1)]
        body = ins[head:i + 1]
        mm = [j for j, b in enumerate(body) if _op(b) == "HMMA"]
        if not mm:
            continue
        kinds = collections.Counter(_op(b) for b in body[:mm[-1] + 1])
        loops.append((mm[-1] + 1, len(body), {k: kinds.get(k, 0) for k in KINDS}))
    return sorted(loops)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sass_loops", description=__doc__.splitlines()[0])
    ap.add_argument("--src", required=True, help="a cuda_src file, e.g. persistent_layer.cu or gemm_bf16.cu")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--kernel", action="append", default=[],
                    help="only functions whose mangled name holds this (repeatable)")
    ap.add_argument("--ptxas", default="")
    ap.add_argument("--nvdisasm", default="")
    a = ap.parse_args(argv)
    ptx = ptx_of(a.src, a.arch)
    sass = sass_of(ptx, a.arch, _tool("ptxas", a.ptxas), _tool("nvdisasm", a.nvdisasm))
    print(f"{a.src} {a.arch}: loops holding HMMA (instructions from the head to the last HMMA / in the body)")
    for fn, (ins, labels) in functions(sass).items():
        if a.kernel and not any(k in fn for k in a.kernel):
            continue
        loops = mma_loops(ins, labels)
        if not loops:
            continue
        print(f"  {fn[:96]} ({len(ins)} instructions)")
        for to_mma, body, kinds in loops[:4]:
            print(f"    {to_mma:5d} / {body:5d}  " + " ".join(f"{k} {v}" for k, v in kinds.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
