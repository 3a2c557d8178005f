"""Run-time compilation of ``cuda_src/*.cu`` through CuPy/NVRTC, with CuPy's disk cache.

Every kernel family registers a ``KernelSpec`` (source file, kernel names / template instantiations,
whether it is hot). ``get_kernel`` compiles lazily for the current device; ``ddtree_cupy.build`` compiles
every registered spec for any architecture without a GPU, through NVRTC directly, with the same options
(``nvrtc_options``).

Headers: ``<cuda_bf16.h>`` comes from the CUDA runtime headers. Without a toolkit they come from the pip
wheel ``nvidia-cuda-runtime-cu12`` (``nvidia/cuda_runtime/include``) or, for CUDA 13, ``nvidia-cuda-runtime``
(``nvidia/cu13/include``); ``cuda_include_dirs`` finds them the way CuPy does (cuda-pathfinder), then
falls back to ``CUDA_PATH``/``CUDA_HOME`` and /usr/local/cuda. NVRTC has no C library headers, so sources
must not include ``<stdint.h>`` & co. (``common.cuh`` defines the fixed-width types under NVRTC).
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

CUDA_SRC_DIR = Path(__file__).resolve().parents[2] / "cuda_src"

# Options on top of CuPy's own. -lineinfo lets Nsight map SASS to source. Fast math is per spec: kernels
# whose results must match the reference bit for bit (top-K, tree scores) leave it off.
BASE_OPTIONS: Tuple[str, ...] = ("-std=c++17", "-lineinfo")

# What CuPy's RawModule adds on its own (cupy/cuda/compiler.py, CuPy 14.2): the build CLI adds the same so
# that a CPU-side build proves the GPU-side one. (CuPy also passes its own include dirs and, on NVRTC
# >= 12.8, --pch, which only affects compile time.)
CUPY_IMPLICIT_OPTIONS: Tuple[str, ...] = ("-ftz=true", "--device-as-default-execution-space")


@dataclass(frozen=True)
class KernelSpec:
    """One compilation unit: ``src`` under cuda_src/, the symbols the engine uses from it."""
    src: str
    names: Tuple[str, ...]                      # extern "C" names or template instantiation expressions
    defines: Tuple[Tuple[str, str], ...] = ()   # -D macros that select a variant
    hot: bool = False                           # spills in a hot kernel fail the build
    fast_math: bool = False                     # --use_fast_math (approximate exp/div/sqrt)
    pdl: bool = False                           # every kernel calls DDT_PDL_WAIT() before reading inputs
                                                # written by earlier kernels: may be launched with PDL
    doc: str = ""

    def options(self, arch: Optional[str] = None) -> Tuple[str, ...]:
        opts = list(BASE_OPTIONS) + [f"--include-path={CUDA_SRC_DIR}"]
        if self.fast_math:
            opts.append("--use_fast_math")
        opts += [f"-D{k}={v}" for k, v in self.defines]
        if arch is not None:
            opts.append(f"--gpu-architecture={arch}")
        return tuple(opts)

    def source(self) -> str:
        path = CUDA_SRC_DIR / self.src
        if not path.exists():
            raise FileNotFoundError(f"CUDA source {path} not found")
        # The #line directive makes NVRTC's diagnostics name cuda_src/<file> instead of CuPy's temp file.
        # CuPy's disk cache keys on this text only, not on what it #includes: the digest of the shared
        # headers makes an edited .cuh recompile every family instead of loading a stale cubin.
        return f'// cuda_src headers {_headers_digest()}\n#line 1 "{path}"\n' + path.read_text()


def _headers_digest() -> str:
    h = hashlib.sha1()
    for p in sorted(CUDA_SRC_DIR.glob("*.cuh")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def cuda_include_dirs() -> Tuple[str, ...]:
    """Directories holding the CUDA runtime headers (cuda_bf16.h), found without a GPU."""
    dirs: List[str] = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory
        d = find_nvidia_header_directory("cudart")
        if d:
            dirs.append(d)
    except Exception:          # pathfinder missing or too old: fall back to the usual places
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            dirs.append(os.path.join(os.environ[env], "include"))
    dirs.append("/usr/local/cuda/include")
    seen, out = set(), []
    for d in dirs:
        if d not in seen and os.path.isfile(os.path.join(d, "cuda_bf16.h")):
            seen.add(d)
            out.append(d)
    return tuple(out[:1])      # one tree only: mixing two CUDA versions' headers breaks


def nvrtc_options(spec: KernelSpec, arch: str) -> Tuple[str, ...]:
    """The full NVRTC option list for ``spec`` on ``arch`` (e.g. 'sm_120'), as CuPy would compile it."""
    arch = normalize_arch(arch)
    return (spec.options(None) + tuple(f"--include-path={d}" for d in cuda_include_dirs())
            + CUPY_IMPLICIT_OPTIONS + (f"--gpu-architecture={arch}",))


def normalize_arch(arch: str) -> str:
    """'sm_120', '120', 'sm120' or 'compute_120' -> 'sm_120'."""
    m = re.fullmatch(r"(?:sm_?|compute_)?(\d{2,3}a?)", str(arch).strip())
    if not m:
        raise ValueError(f"arch: expected something like 'sm_90' or 'sm_120', got {arch!r}")
    return f"sm_{m.group(1)}"


_REGISTRY: Dict[str, KernelSpec] = {}
_LOCK = threading.Lock()
_MODULES: Dict[Tuple, object] = {}


def register(spec: KernelSpec) -> KernelSpec:
    """Declare a spec at import time of its wrapper module so the build CLI can find it."""
    key = spec.src + "|" + ",".join(f"{k}={v}" for k, v in spec.defines)
    _REGISTRY[key] = spec
    return spec


def registered_specs() -> Tuple[KernelSpec, ...]:
    return tuple(_REGISTRY.values())


class KernelCompileError(RuntimeError):
    pass


def format_compile_error(spec: KernelSpec, arch: str, log: str) -> str:
    """A message naming the file, the architecture and each error's line, followed by the full log."""
    errors = [ln.strip() for ln in log.splitlines() if re.search(r"\(\d+\): (catastrophic )?error", ln)]
    head = f"NVRTC failed to compile cuda_src/{spec.src} for {arch}"
    if spec.defines:
        head += " with " + " ".join(f"-D{k}={v}" for k, v in spec.defines)
    summary = "".join(f"\n  {e}" for e in errors[:10])
    return f"{head}:{summary}\n--- NVRTC log ---\n{log.strip()}"


def device_arch() -> str:
    import cupy
    dev = cupy.cuda.Device()
    return f"sm_{dev.compute_capability}"


def get_module(spec: KernelSpec):
    """Compile (or fetch from the in-process and on-disk caches) ``spec`` for the current device."""
    import cupy
    arch = device_arch()
    key = (spec, arch, cupy.cuda.Device().id)
    mod = _MODULES.get(key)
    if mod is not None:
        return mod
    with _LOCK:
        mod = _MODULES.get(key)
        if mod is None:
            # CuPy appends -arch=sm_XX for the current device and its own include dirs; ours are harmless
            # duplicates where CuPy found the same headers.
            opts = spec.options(None) + tuple(f"--include-path={d}" for d in cuda_include_dirs())
            mod = cupy.RawModule(code=spec.source(), options=opts,
                                 name_expressions=list(spec.names) or None)
            try:
                mod.compile()
            except cupy.cuda.compiler.CompileException as e:
                log = e.get_message() if hasattr(e, "get_message") else str(e)
                raise KernelCompileError(format_compile_error(spec, arch, log)) from None
            _MODULES[key] = mod
    return mod


_FN_CACHE: Dict[Tuple, object] = {}


def get_kernel(spec: KernelSpec, name: str, max_dynamic_smem: int = 0):
    """The kernel ``name`` (an extern "C" name or one of ``spec.names``' template expressions).

    Specs with ``pdl=True`` get a ``launch.PdlKernel`` (called the same way), which launches through
    cuLaunchKernelEx with programmatic dependent launch while ``launch.set_pdl(True)``.
    ``max_dynamic_smem``: the most dynamic shared memory any launch will ask for; the per-function limit is
    raised to it (sm_120 allows up to 99 KB per block, H200 227 KB). The default limit is 48 KB minus the
    kernel's static shared memory, so a kernel with static arrays needs the raise below 48 KB of dynamic too.
    """
    import cupy
    key = (spec, name, cupy.cuda.Device().id)
    fn = _FN_CACHE.get(key)
    if fn is None:
        fn = get_module(spec).get_function(name)
        if spec.pdl:     # same call signature; launches with PDL while launch.set_pdl(True) (sm_90+)
            from .launch import PdlKernel
            fn = PdlKernel(fn, int(cupy.cuda.Device().compute_capability))
        _FN_CACHE[key] = fn
    if max_dynamic_smem > 0 and getattr(fn, "_ddt_smem", 0) < max_dynamic_smem:
        fn.max_dynamic_shared_size_bytes = max_dynamic_smem
        try:
            fn._ddt_smem = max_dynamic_smem
        except AttributeError:     # a cython object without __dict__: set the attribute every time
            pass
    return fn
