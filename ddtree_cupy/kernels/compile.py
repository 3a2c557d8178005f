"""Run-time compilation of ``cuda_src/*.cu`` through CuPy/NVRTC, with CuPy's disk cache.

Every kernel family registers a ``KernelSpec`` (source file, kernel names / template instantiations,
whether it is hot). ``get_kernel`` compiles lazily for the current device; ``ddtree_cupy.build`` compiles
every registered spec for any architecture without a GPU, through NVRTC directly, with the same options.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

CUDA_SRC_DIR = Path(__file__).resolve().parents[2] / "cuda_src"

# Options on top of CuPy's own. -lineinfo lets Nsight map SASS to source. Fast math is per spec: kernels
# whose results must match the reference bit for bit (top-K, tree scores) leave it off.
BASE_OPTIONS: Tuple[str, ...] = ("-std=c++17", "-lineinfo")


@dataclass(frozen=True)
class KernelSpec:
    """One compilation unit: ``src`` under cuda_src/, the symbols the engine uses from it."""
    src: str
    names: Tuple[str, ...]                      # extern "C" names or template instantiation expressions
    defines: Tuple[Tuple[str, str], ...] = ()   # -D macros that select a variant
    hot: bool = False                           # spills in a hot kernel fail the build
    fast_math: bool = False                     # --use_fast_math (approximate exp/div/sqrt)
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
        return path.read_text()


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
            # CuPy appends -arch=sm_XX for the current device itself; pass only our options.
            mod = cupy.RawModule(code=spec.source(), options=spec.options(None),
                                 name_expressions=list(spec.names) or None)
            try:
                mod.compile()
            except cupy.cuda.compiler.CompileException as e:
                raise KernelCompileError(f"NVRTC failed to compile cuda_src/{spec.src} for {arch}:\n"
                                         f"{e.get_message() if hasattr(e, 'get_message') else e}") from None
            _MODULES[key] = mod
    return mod


def get_kernel(spec: KernelSpec, name: str, max_dynamic_smem: int = 0):
    """The kernel ``name`` (an extern "C" name or one of ``spec.names``' template expressions)."""
    fn = get_module(spec).get_function(name)
    if max_dynamic_smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = max_dynamic_smem
    return fn
