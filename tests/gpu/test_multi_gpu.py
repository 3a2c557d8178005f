"""Tensor parallel across real GPUs: the engine under ``mpirun -np 2`` against one GPU (``bench/tp_check.py``).

Runs wherever a machine has 2+ GPUs and an MPI launcher whose world mpi4py joins; skipped otherwise (with the
reason). The comparison rules are tp_check's: identical tokens, or, where bf16 summation order parts the two
runs, every token of both accepted by the float64 reference on its own prefix (tests/_teacher_forced.py).
"""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


def _gpus() -> int:
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


def test_engine_tp2_matches_tp1(tmp_path):
    if _gpus() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {_gpus()}")
    launcher = os.environ.get("MPIRUN") or shutil.which("mpirun") or shutil.which("mpiexec")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "tp_check.py"), "--np", "2", "--mpirun", launcher,
                        "--out", str(tmp_path), "--tokens", "64", "--budget", "8"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode != 2, "the launcher did not form one MPI world of 2 ranks:\n" + out[-3000:]
    assert p.returncode == 0 and "ALL OK" in p.stdout, out[-4000:]
