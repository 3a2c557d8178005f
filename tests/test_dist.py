"""Communicators: single rank in-process; MPI collectives and the failure policy under mpirun."""
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ddtree_cupy.dist import SingleRank, init_communicator, launched_with_mpi

ROOT = Path(__file__).resolve().parents[1]
PROGS = Path(__file__).parent / "mpi_progs"


def mpirun(np_, prog, *args, timeout=60):
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.time()
    p = subprocess.run([exe, "-np", str(np_), sys.executable, str(PROGS / prog), *map(str, args)], env=env,
                       capture_output=True, text=True, timeout=timeout)
    return p, time.time() - t0


def test_single_rank_is_identity():
    c = init_communicator("numpy") if not launched_with_mpi() else SingleRank()
    assert isinstance(c, SingleRank) and c.rank == 0 and c.size == 1 and c.is_root
    x = np.random.default_rng(0).standard_normal(5)
    y = x.copy()
    assert c.all_reduce(y) is y and np.array_equal(y, x)
    assert np.array_equal(c.all_gather(x), x[None])
    assert c.broadcast_obj({"a": 1}) == {"a": 1}


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_mpi_collectives(n):
    p, _ = mpirun(n, "collectives.py")
    assert p.returncode == 0, p.stdout + p.stderr
    # Ranks share one stdout pipe, so lines may interleave: find the markers anywhere.
    assert sorted(re.findall(r"rank \d+/\d+ OK", p.stdout)) == [f"rank {r}/{n} OK" for r in range(n)]


@pytest.mark.mpi
def test_failure_on_one_rank_ends_all_ranks_promptly():
    p, dt = mpirun(3, "raise_on_rank.py", timeout=60)
    assert p.returncode != 0
    assert "deliberate failure on rank one" in p.stderr
    assert "rank 1/3" in p.stderr
    # The other ranks were blocked in a barrier: only the abort could end them this fast.
    assert dt < 30, f"took {dt:.1f}s"


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_tp_sharded_reference_target_equals_tp1(n, tmp_path):
    """Each rank loads only its shard; prefill, decode and tree-verify logits, features and the latent
    cache equal the whole model's (float64, rel 1e-12)."""
    p, _ = mpirun(n, "tp_target.py", tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(re.findall(r"rank \d+/\d+ OK", p.stdout)) == [f"rank {r}/{n} OK" for r in range(n)]


@pytest.mark.mpi
def test_mismatched_mpirun_is_refused():
    # A launcher of another MPI sets its world-size variable, but mpi4py's MPI starts a singleton: every
    # process would run the whole model alone. Simulated with Open MPI's variable under this MPICH install.
    pytest.importorskip("mpi4py")
    env = dict(os.environ, OMPI_COMM_WORLD_SIZE="2",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PMI_SIZE", None)
    p = subprocess.run([sys.executable, "-c", "from ddtree_cupy.dist import init_communicator; init_communicator('numpy')"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "MPI sees a world of 1" in p.stderr and "mpirun" in p.stderr, p.stderr[-800:]


@pytest.mark.mpi
def test_end_job_flushes_finalizes_and_ends_every_rank():
    p, dt = mpirun(2, "end_job.py", timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(re.findall(r"rank \d/2 before end_job", p.stdout)) == ["rank 0/2 before end_job", "rank 1/2 before end_job"]
    assert p.stdout.count("unflushed tail") == 2 and "AFTER end_job" not in p.stdout
