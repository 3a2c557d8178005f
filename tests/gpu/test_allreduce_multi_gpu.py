"""The P2P all-reduce across real GPUs (>= 2; skipped otherwise): tests/mpi_progs/p2p_allreduce.py under
mpirun (NCCL agreement, identical bits, fused add + norm, 10^4 graph replays), a rank that hangs mid-job
ending the job with a clear error within seconds, and the engine's TP = 2 tokens with the custom path on
(bench/tp_check.py with DDT_ALLREDUCE=custom)."""
import os
import subprocess
import sys
import time

import pytest

from _multi_gpu import ROOT, gpu_count, mpi_setup, run_tp_check

PROG = os.path.join(ROOT, "tests", "mpi_progs", "p2p_allreduce.py")
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


def _np():
    return min(8, gpu_count())


def test_p2p_allreduce_across_gpus():
    launcher, env = mpi_setup()
    n = _np()
    p = subprocess.run([launcher, "-np", str(n), os.path.join(ROOT, "launcher", "bind.sh"), sys.executable, PROG],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    if "NO P2P" in out:
        pytest.skip("no P2P between these GPUs: " + out[-300:])
    assert p.returncode == 0 and f"P2P ALLREDUCE OK ({n} ranks;" in out, out[-4000:]


def test_dead_peer_ends_the_job():
    launcher, env = mpi_setup()
    env["DDT_AR_TIMEOUT_S"] = "3"
    t0 = time.time()
    p = subprocess.run([launcher, "-np", "2", os.path.join(ROOT, "launcher", "bind.sh"), sys.executable, PROG,
                        "--dead"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    if "NO P2P" in out:
        pytest.skip("no P2P between these GPUs")
    assert "STILL RUNNING" not in out, out[-3000:]
    assert "waited 3.0 s for rank 1" in out and "never arrived" in out, out[-3000:]
    assert p.returncode != 0 and time.time() - t0 < 100, out[-3000:]


def test_engine_tp2_custom_allreduce_tokens(tmp_path):
    launcher, env = mpi_setup()
    env["DDT_ALLREDUCE"] = "custom"
    run_tp_check(tmp_path, launcher, env)
