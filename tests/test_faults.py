"""The multi-rank fault model (launcher/README.md, "Fault model"), under ``mpirun -np 2`` on the numpy
backend: any failure, signal or early exit on ONE rank ends every rank within seconds, non-zero, with one
message naming the rank and the cause. Every run is bounded by a timeout: a hang fails the test."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddtree_cupy.tinymodel import ensure_tiny_checkpoints

ROOT = Path(__file__).resolve().parents[1]
PROGS = Path(__file__).parent / "mpi_progs"
pytestmark = pytest.mark.mpi
HANG_S = 60          # a run still alive after this long is a hang
PROMPT_S = 10        # "within seconds": the bound asserted after the fault


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _mpirun():
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        pytest.skip("mpirun not found")
    return exe


def _descendants(root: int):
    """Pids of every process below ``root`` (from /proc's parent links)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier and p not in out}
        out |= frontier
    return out


def _rank_pids(root: int, marker: bytes):
    """{MPI rank: pid} of the processes below ``root`` whose command line holds ``marker``."""
    out = {}
    for d in map(str, _descendants(root)):
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read()
            env = open(f"/proc/{d}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if marker not in cmd or b"mpirun" in cmd or b"mpiexec" in cmd or b"hydra" in cmd:
            continue
        for e in env:
            for var in (b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK="):
                if e.startswith(var):
                    out[int(e[len(var):])] = int(d)
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return ensure_tiny_checkpoints(str(tmp_path_factory.mktemp("faults_ckpt")))


def _signal_rank(proc, pid: int, sig) -> tuple:
    """Send ``sig`` to one rank's process and wait for the job to end: (its stderr, seconds it took)."""
    t0 = time.time()
    os.kill(pid, sig)
    _, err = proc.communicate(timeout=HANG_S)
    return err, time.time() - t0


def _kill_if_running(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def _prog(case, timeout=HANG_S):
    t0 = time.time()
    p = subprocess.run([_mpirun(), "-np", "2", sys.executable, str(PROGS / "fault_guard.py"), case], env=_env(),
                       capture_output=True, text=True, timeout=timeout)
    return p, time.time() - t0


def test_failure_while_another_rank_is_blocked_in_a_collective():
    p, dt = _prog("stuck")
    assert p.returncode == 2, p.stderr
    assert "deliberate failure in the load phase (on rank 1 of 2)" in p.stderr and dt < PROMPT_S, (dt, p.stderr)
    assert "Traceback" not in p.stderr


def test_failure_reported_once_at_the_agreement_point():
    p, dt = _prog("agree")
    assert p.returncode == 2 and dt < PROMPT_S
    assert p.stderr.count("deliberate failure") == 1 and "(on rank 1 of 2)" in p.stderr, p.stderr


def test_early_sys_exit_on_one_rank_aborts_the_job():
    p, dt = _prog("exit")
    assert p.returncode != 0 and dt < PROMPT_S
    assert "error on rank 1/2: exited early" in p.stderr, p.stderr


def test_sigterm_to_one_rank_blocked_in_a_collective():
    proc = subprocess.Popen([_mpirun(), "-np", "2", sys.executable, str(PROGS / "fault_guard.py"), "signal"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = {}
        for line in proc.stdout:            # the two ranks' lines may interleave
            for r, pid in re.findall(r"pid (\d+) (\d+)", line):
                pids[int(r)] = int(pid)
            if len(pids) == 2:
                break
        time.sleep(0.5)
        err, dt = _signal_rank(proc, pids[1], signal.SIGTERM)
    finally:
        _kill_if_running(proc)
    assert proc.returncode == 143 and dt < PROMPT_S, (proc.returncode, dt, err)
    assert "error on rank 1/2: interrupted by SIGTERM" in err


def _cli(ckpt, model, extra=()):
    t, d = ckpt
    return [sys.executable, "-m", "ddtree_cupy.run", "--backend", "numpy", "--model", model, "--drafter", d,
            "--prompt-ids", "1,2,3", "--max-new-tokens", "4", *extra]


def test_mpmd_load_failure_on_one_rank(ckpt, tmp_path):
    """One rank's shard is truncated: it fails while loading, the healthy rank finishes loading; both end."""
    t, _ = ckpt
    bad = tmp_path / "truncated"
    shutil.copytree(t, bad)
    shard = sorted(bad.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    t0 = time.time()
    p = subprocess.run([_mpirun(), "-np", "1", *_cli(ckpt, t), ":", "-np", "1", *_cli(ckpt, str(bad))],
                       env=_env(), capture_output=True, text=True, timeout=HANG_S)
    dt = time.time() - t0
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.count("error:") == 1 and "(on rank 1 of 2)" in p.stderr and "truncated" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and dt < 30


def test_sigint_to_one_rank_mid_generation(ckpt):
    t, _ = ckpt
    proc = subprocess.Popen([_mpirun(), "-np", "2", *_cli(ckpt, t, ["--max-new-tokens", "100000", "--ignore-eos"])],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:                  # rank 0 says so once generation starts
            if line.startswith("loaded in"):
                break
        time.sleep(1.0)
        pids = _rank_pids(proc.pid, b"ddtree_cupy.run")
        assert set(pids) == {0, 1}, pids
        err, dt = _signal_rank(proc, pids[1], signal.SIGINT)
    finally:
        _kill_if_running(proc)
    assert proc.returncode == 130 and dt < PROMPT_S, (proc.returncode, dt, err[-2000:])
    assert "error on rank 1/2: interrupted by SIGINT" in err
