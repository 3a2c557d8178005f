"""Shared set-up of the GPU tests that run under an MPI launcher on several GPUs of one host."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gpu_count() -> int:
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


def mpi_setup(n=2):
    """(launcher, environment) for an ``n``-rank job on this host's GPUs; skips where there are fewer than ``n``.
    The environment puts the repository on PYTHONPATH and keeps NCCL's NVLink multicast off."""
    if gpu_count() < n:
        pytest.skip(f"needs {n} GPUs, this machine has {gpu_count()}")
    launcher = os.environ.get("MPIRUN") or shutil.which("mpirun") or shutil.which("mpiexec")
    return launcher, dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=ROOT)


def run_tp_check(tmp_path, launcher, env):
    """``bench/tp_check.py --np 2`` (the engine at TP = 2 against TP = 1: ar, chain, ddtree, 64 tokens, budget 8)
    must form one MPI world of 2 ranks and end with ALL OK."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "tp_check.py"), "--np", "2", "--mpirun", launcher,
                        "--out", str(tmp_path), "--tokens", "64", "--budget", "8"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode != 2, "the launcher did not form one MPI world of 2 ranks:\n" + out[-3000:]
    assert p.returncode == 0 and "ALL OK" in p.stdout, out[-4000:]
