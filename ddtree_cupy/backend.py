"""Backend selection and the numpy engine behind the CLI.

``auto`` picks the GPU engine (CuPy, ``engine/gpu_engine.GpuEngine``) where a GPU is usable and the engine's
modules import, else numpy with a one-line notice. ``--backend cupy`` without a usable GPU refuses with the
reason. Every engine offers the same ``generate(requests, ...) -> GenerationResult`` (the reference decode
loop's result type), so the CLI does not care which one runs.
"""
from __future__ import annotations

import glob
import sys
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from .config import DrafterConfig, TargetConfig

BACKENDS = ("auto", "cupy", "numpy")


class BackendError(RuntimeError):
    """The requested backend cannot run here."""


def gpu_status() -> Tuple[bool, str]:
    """(usable, why): whether CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
    except Exception as e:           # not installed, or a broken CUDA install
        return False, f"cupy not importable ({type(e).__name__})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:           # no driver / no device
        return False, no_device_reason(e)
    if n < 1:
        return False, "no CUDA GPU found"
    return True, f"{n} CUDA device(s)"


def no_device_reason(e: Exception) -> str:
    """Why getDeviceCount failed, in words. Without a GPU the CUDA runtime reports a missing driver as
    cudaErrorInsufficientDriver ("driver version is insufficient"), which misleads: say there is no GPU."""
    msg = str(e).strip()
    no_nodes = not glob.glob("/dev/nvidia[0-9]*") and sys.platform.startswith("linux")
    if "cudaErrorNoDevice" in msg or no_nodes:
        return "no CUDA GPU found" + (" (no /dev/nvidia* device on this machine)" if no_nodes else "")
    if "cudaErrorInsufficientDriver" in msg:
        return ("the NVIDIA driver is older than the CUDA runtime this CuPy build needs "
                "(cudaErrorInsufficientDriver): update the driver, or install the cupy-cuda12x / cupy-cuda13x "
                "wheel that matches it")
    return f"no usable CUDA GPU ({type(e).__name__}: {msg})"


def gpu_engine_available() -> bool:
    """Whether the GPU engine's modules are present and import (they import CuPy lazily, so this is true
    on a machine without a GPU too; ``gpu_status`` says whether a device is usable)."""
    try:
        from .engine import gpu_engine  # noqa: F401
        from .models import batch, drafter, kv, target  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(name: str, notice: Callable[[str], None]) -> str:
    """Resolve ``name`` ('auto' | 'cupy' | 'numpy') to the backend that will run; ``notice`` gets one line
    when 'auto' has to fall back."""
    if name not in BACKENDS:
        raise BackendError(f"--backend: unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "numpy":
        return "numpy"
    usable, why = gpu_status()
    if name == "cupy":
        if not gpu_engine_available():
            raise BackendError("--backend cupy: the GPU engine's modules are missing from this installation; "
                               "use --backend numpy (the reference engine, for small models)")
        if not usable:
            raise BackendError(f"--backend cupy: {why}")
        return "cupy"
    if usable and gpu_engine_available():
        return "cupy"
    reason = "the GPU engine's modules are missing" if usable else why
    notice(f"note: backend auto -> numpy ({reason}); the numpy reference engine is only practical for small models")
    return "numpy"


class NumpyEngine:
    """The numpy reference target + DFlash drafter, run by ``reference.loop.DecodeLoop``."""

    name = "numpy"

    def __init__(self, tcfg: TargetConfig, model_dir: str, dcfg: Optional[DrafterConfig] = None,
                 drafter_dir: Optional[str] = None, dtype=np.float32, comm=None):
        """``comm``: a communicator (dist.py). Under mpirun each rank loads only its tensor-parallel shard."""
        from .checkpoint import load_drafter_weights, load_reference_weights
        from .reference.drafter import ReferenceDrafter
        from .reference.target import ReferenceTarget

        from .dist import SingleRank
        self.comm = comm if comm is not None else SingleRank()
        rank, size = self.comm.rank, self.comm.size
        self.dtype = np.dtype(dtype)
        self.tcfg, self.dcfg = tcfg, dcfg
        tw = load_reference_weights(model_dir, self.dtype, tp_rank=rank, tp_size=size, cfg=tcfg)
        self.target = ReferenceTarget(tcfg, tw, self.dtype, comm=self.comm)
        self.drafter = None
        if dcfg is not None:
            dw = load_drafter_weights(drafter_dir, self.dtype, tp_rank=rank, tp_size=size, cfg=dcfg)
            self.drafter = ReferenceDrafter(dcfg, dw, self.target.embed_tokens, self.target.lm_head,
                                            self.dtype, comm=self.comm)

    def generate(self, requests: Sequence, mode: str = "ddtree", budget: int = 32, cap_k: Optional[int] = None,
                 include_chain: bool = False, on_tokens: Optional[Callable] = None):
        from .reference.loop import DecodeLoop
        return DecodeLoop(self.target, self.drafter, mode, budget, cap_k, include_chain).run(requests, on_tokens)


def create_engine(backend: str, tcfg: TargetConfig, model_dir: str, dcfg: Optional[DrafterConfig],
                  drafter_dir: Optional[str], dtype=np.float32, comm=None, **gpu_options):
    """``dtype`` is the numpy engine's; the GPU engine is bf16. ``gpu_options`` go to ``GpuEngine``
    (max_streams, max_budget, kv_tokens, eager, ...); the CLI's budgets go up to 128."""
    if backend == "numpy":
        return NumpyEngine(tcfg, model_dir, dcfg, drafter_dir, dtype, comm)
    if backend == "cupy":
        if not gpu_engine_available():
            raise BackendError("backend 'cupy': the GPU engine's modules are missing from this installation")
        from .engine.gpu_engine import GpuEngine
        gpu_options.setdefault("max_budget", 128)
        return GpuEngine(tcfg, model_dir, dcfg, drafter_dir, comm=comm, **gpu_options)
    raise BackendError(f"backend {backend!r}: unknown backend (choose from {', '.join(BACKENDS)})")
