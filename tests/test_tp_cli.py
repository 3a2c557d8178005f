"""Tensor parallelism through the command line on the numpy backend: `mpirun -np N python -m
ddtree_cupy.run` gives exactly the tokens of the single-process run (every rank holds only its shard),
prints one result, and a bad input is reported once with every rank exiting."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.mpi


def run_cli(args, n=None, cache=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if cache is not None:
        env["DDTREE_CUPY_CACHE"] = str(cache)
    cmd = [sys.executable, "-m", "ddtree_cupy.run", *args]
    if n is not None:
        cmd = [shutil.which("mpirun") or shutil.which("mpiexec"), "-np", str(n), *cmd]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def last_json(p):
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    lines = [l for l in p.stdout.splitlines() if l.strip()]
    objs = [l for l in lines if l.startswith("{")]
    assert len(objs) == 1, f"expected one JSON object (rank 0 only), got {len(objs)}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tpcache")


COMMON = ["--demo", "--json", "--backend", "numpy", "--dtype", "float64", "--max-new-tokens", "24",
          "--prompt-ids", "5,6,7,8,9", "--prompt-ids", "11,12"]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("mode, extra", [("ar", []), ("ddtree", ["--budget", "16"]),
                                         ("ddtree", ["--budget", "8", "--temperature", "0.8", "--seed", "3"])])
def test_tp_tokens_equal_single_process(n, mode, extra, cache):
    args = COMMON + ["--mode", mode] + extra
    one = last_json(run_cli(args, cache=cache))
    many = last_json(run_cli(args, n=n, cache=cache))
    assert [s["output_ids"] for s in many["streams"]] == [s["output_ids"] for s in one["streams"]]
    assert many["stats"]["tp"] == n and one["stats"]["tp"] == 1
    assert all(len(s["output_ids"]) == 24 for s in one["streams"])


def test_tp_bad_input_reported_once(cache, tmp_path):
    p = run_cli(["--model", str(tmp_path / "missing"), "--prompt-ids", "1,2"], n=2, cache=cache, timeout=60)
    assert p.returncode == 2
    assert p.stderr.count("error:") == 1 and "does not exist" in p.stderr, p.stderr
