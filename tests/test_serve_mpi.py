"""``mpirun -np 2 python -m ddtree_cupy.serve`` on the numpy backend: rank 0 serves HTTP and broadcasts each
step's admissions and cancellations; the tokens equal those of one process, for concurrent requests too;
Ctrl-C (SIGINT to mpirun) ends every rank within seconds."""
from __future__ import annotations

import shutil
import signal
import sys
import threading

import httpx
import pytest

from _serve_helpers import MODEL, LocalServer, demo_state, free_port, start_server, stop_process

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
ARGS = ["--demo", "--backend", "numpy", "--dtype", "float64", "--budget", "8", "--max-streams", "4"]
JOBS = [([5, 6, 7, 8, 9], 14), ([11, 12], 9), ([30, 2, 2], 11)]


def ask(url, prompt, n):
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["ddtree"]["token_ids"]


def ask_all_concurrently(url):
    out = {}
    th = [threading.Thread(target=lambda k=k: out.__setitem__(k, ask(url, *JOBS[k]))) for k in range(len(JOBS))]
    for t in th:
        t.start()
    for t in th:
        t.join(300)
    return [out.get(k) for k in range(len(JOBS))]


def test_two_ranks_serve_the_tokens_of_one_process():
    srv = LocalServer(demo_state(*ARGS[1:]))
    try:
        one = ask_all_concurrently(srv.url)
    finally:
        srv.close()
    port = free_port()
    cmd = [shutil.which("mpirun") or shutil.which("mpiexec"), "-np", "2", sys.executable, "-m", "ddtree_cupy.serve",
           *ARGS, "--port", str(port)]
    p, url = start_server(cmd, port, timeout_s=240, poll_s=0.5)
    try:
        many = ask_all_concurrently(url)
        solo = [ask(url, *j) for j in JOBS]
        assert many == one and solo == one
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=60)
        out = p.stdout.read()
        assert rc == 0, out
        assert out.count("serving 'ddtree-demo'") == 1        # rank 0 alone talks
    finally:
        stop_process(p)
