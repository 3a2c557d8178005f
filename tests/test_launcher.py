"""launcher/: the scripts parse, and bind.sh maps each local rank to its GPU's NUMA node."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).resolve().parents[1] / "launcher"


@pytest.mark.parametrize("script", sorted(p.name for p in LAUNCHER.glob("*.sh")))
def test_scripts_parse(script):
    p = subprocess.run(["bash", "-n", str(LAUNCHER / script)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def run_bind(env_extra, fake_numactl_dir):
    env = {k: v for k, v in os.environ.items() if "RANK" not in k and "LOCALID" not in k}
    env.update(env_extra)
    env["PATH"] = f"{fake_numactl_dir}{os.pathsep}{env['PATH']}"
    return subprocess.run([str(LAUNCHER / "bind.sh"), "echo", "ran"], env=env, capture_output=True, text=True)


@pytest.fixture
def fake_numactl(tmp_path):
    # a stand-in that prints its binding and runs the command, so the mapping is visible without NUMA
    f = tmp_path / "numactl"
    f.write_text('#!/usr/bin/env bash\necho "numactl $1 $2"\nshift 2\nexec "$@"\n')
    f.chmod(0o755)
    return tmp_path


@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID"])
@pytest.mark.parametrize("rank, node", [(0, 0), (3, 0), (4, 1), (7, 1)])
def test_bind_maps_local_rank_to_numa_node(var, rank, node, fake_numactl):
    p = run_bind({var: str(rank)}, fake_numactl)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:2] == [f"numactl --cpunodebind={node} --membind={node}", "ran"]


def test_bind_custom_map_and_opt_out(fake_numactl):
    p = run_bind({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "GPU_NUMA_NODES": "0 2"}, fake_numactl)
    assert p.stdout.startswith("numactl --cpunodebind=2 --membind=2")
    p = run_bind({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "DDTREE_NO_NUMA_BIND": "1"}, fake_numactl)
    assert p.stdout == "ran\n"
