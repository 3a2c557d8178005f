"""Tensor parallel across real GPUs: the engine under ``mpirun -np 2`` against one GPU (``bench/tp_check.py``).

Runs wherever a machine has 2+ GPUs and an MPI launcher whose world mpi4py joins; skipped otherwise (with the
reason). The comparison rules are tp_check's: identical tokens, or, where bf16 summation order parts the two
runs, every token of both accepted by the float64 reference on its own prefix (tests/_teacher_forced.py).
"""
import pytest

from _multi_gpu import mpi_setup, run_tp_check

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


def test_engine_tp2_matches_tp1(tmp_path):
    launcher, env = mpi_setup(2)
    run_tp_check(tmp_path, launcher, env)
