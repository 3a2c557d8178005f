"""Shared pytest setup: GPU tests skip cleanly where CuPy cannot reach a GPU, oracle tests where the
test-only oracles are absent (CI installs them, so there they always run)."""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil

# The numpy references run many tiny matrix products, for which OpenBLAS's thread pool costs more than it
# saves (2-3x slower on the 2-core CI machines). One BLAS thread unless the caller chose otherwise; this
# must happen before numpy is first imported, which is why it sits here.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest


@functools.lru_cache(maxsize=None)
def gpu_skip_reason() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed"
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device
        from ddtree_cupy.backend import no_device_reason
        return no_device_reason(e)
    if n < 1:
        return "no CUDA GPU found"
    return None


@functools.lru_cache(maxsize=None)
def oracle_skip_reason() -> str | None:
    missing = [m for m in ("torch", "transformers", "compressed_tensors") if importlib.util.find_spec(m) is None]
    if missing:
        return "test-only oracles not installed: " + ", ".join(missing) + " (pip install -e '.[dev]')"
    return None


@functools.lru_cache(maxsize=None)
def mpi_skip_reason() -> str | None:
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install -e '.[mpi]')"
    if shutil.which("mpirun") is None and shutil.which("mpiexec") is None:
        return "no mpirun/mpiexec on PATH"
    return None


@functools.lru_cache(maxsize=None)
def gpu_memory_budget() -> float:
    """Bytes of device memory the tests may use: the device's total, or CuPy's pool limit when set
    (``CUPY_GPU_MEMORY_LIMIT``, how a large card emulates the 16 GB CI card)."""
    import cupy
    total = cupy.cuda.runtime.memGetInfo()[1]
    limit = cupy.get_default_memory_pool().get_limit()
    return float(min(total, limit) if limit else total)


def big_gpu_skip_reason(item) -> str | None:
    """``@pytest.mark.big_gpu(gb=N)``: the test needs about N GB of device memory (estimated from its shapes)."""
    m = item.get_closest_marker("big_gpu")
    if m is None or gpu_skip_reason():
        return None
    need = float(m.kwargs.get("gb", m.args[0] if m.args else 0))
    have = gpu_memory_budget() / 1e9
    if have < need:
        return f"needs about {need:.0f} GB of GPU memory; this device (or CUPY_GPU_MEMORY_LIMIT) gives {have:.1f} GB"
    return None


def pytest_collection_modifyitems(config, items):
    in_ci = os.environ.get("CI") == "true"
    for item in items:
        if "gpu" in item.keywords and gpu_skip_reason():
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {gpu_skip_reason()}"))
        elif "big_gpu" in item.keywords and big_gpu_skip_reason(item):
            item.add_marker(pytest.mark.skip(reason=big_gpu_skip_reason(item)))
        if "oracle" in item.keywords and oracle_skip_reason():
            # CI installs the dev extra: there a missing oracle must fail the test, never skip it.
            if not in_ci:
                item.add_marker(pytest.mark.skip(reason=oracle_skip_reason()))
        if "mpi" in item.keywords and mpi_skip_reason():
            item.add_marker(pytest.mark.skip(reason=mpi_skip_reason()))
