"""The server on the GPU engine (demo checkpoint): greedy completions equal the batch CLI's tokens on the
same backend, concurrent streams (continuous batching over CUDA-graph steps) equal their solo runs, a
cancelled stream frees its pages, and tool-free chat streams with usage."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from ddtree_cupy import run  # noqa: E402

from _serve_helpers import MODEL, LocalServer, demo_state, run_threads, wait_drained  # noqa: E402

pytestmark = pytest.mark.gpu
T = 120.0
ARGS = ("--backend", "cupy", "--budget", "16", "--max-streams", "4")


@pytest.fixture(scope="module")
def server():
    srv = LocalServer(demo_state(*ARGS))
    yield srv
    srv.close()


def ask(srv, prompt, n, stream=False):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=T, max_retries=0)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    if not stream:
        return c.completions.create(**kw).model_extra["ddtree"]["token_ids"]
    ext = None
    for ch in c.completions.create(stream=True, **kw):
        ext = (ch.model_extra or {}).get("ddtree") or ext
    return ext["token_ids"]


def test_gpu_server_equals_batch_cli(server, capsys):
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    argv = ["--demo", "--json", "--backend", "cupy", "--budget", "16", "--max-new-tokens", "24", "--ignore-eos"]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    assert run.main(argv) == 0
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["streams"]
    assert [ask(server, p, 24) for p in prompts] == [s["output_ids"] for s in cli]


def test_gpu_concurrent_streams_equal_solo_and_cancel_frees_pages(server):
    jobs = [([7 + k, 3 * k + 1, 9][: 1 + k % 3], 10 + 7 * k) for k in range(6)]
    solo = [ask(server, p, n) for p, n in jobs]
    got, errors = {}, []

    def one(k):
        try:
            time.sleep(0.05 * k)
            got[k] = ask(server, *jobs[k], stream=True)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    def cancelled():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=T,
                          json={"model": MODEL, "prompt": [40, 41], "max_tokens": 400, "stream": True,
                                "temperature": 0, "ignore_eos": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 6:
                    break
    run_threads([lambda k=k: one(k) for k in range(6)] + [cancelled], 4 * T)
    assert not errors, errors
    assert [got[k] for k in range(6)] == solo
    loop = server.state.loop
    wait_drained(loop, T)
    assert loop.sched.pool.free_pages == loop.sched.pool.num_pages


def test_gpu_chat_stream_with_usage(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=T, max_retries=0)
    usage, n = None, 0
    for ch in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=20,
                                        stream=True, stream_options={"include_usage": True}):
        usage = ch.usage or usage
        n += 1
    assert usage is not None and 1 <= usage.completion_tokens <= 20 and n >= 2


@pytest.mark.mpi
def test_gpu_server_tp2_under_mpirun():
    """``mpirun -np 2 python -m ddtree_cupy.serve --backend cupy``: rank 0 serves; concurrent streams equal
    their solo runs on the same job (TP 2 may round a bf16 near-tie differently from TP 1, so the
    comparison stays within the job); SIGINT ends both ranks."""
    import os
    import shutil
    import signal
    import socket
    import subprocess
    import sys
    from pathlib import Path

    import cupy
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs")
    launcher = os.environ.get("MPIRUN") or shutil.which("mpirun") or shutil.which("mpiexec")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=str(root))
    p = subprocess.Popen([launcher, "-np", "2", str(root / "launcher" / "bind.sh"), sys.executable, "-m",
                          "ddtree_cupy.serve", "--demo", *ARGS, "--port", str(port)],
                         env=dict(env, DDTREE_NO_NUMA_BIND="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)

    class Url:
        url = f"http://127.0.0.1:{port}"
    try:
        t_end = time.monotonic() + 600
        while True:
            assert p.poll() is None, p.stdout.read()[-4000:]
            try:
                if httpx.get(Url.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < t_end, "server did not come up"
            time.sleep(1)
        jobs = [([5, 6, 7], 40), ([11, 12], 25), ([9], 33)]
        solo = [ask(Url, p_, n) for p_, n in jobs]
        got = {}
        th = [threading.Thread(target=lambda k=k: got.__setitem__(k, ask(Url, *jobs[k], stream=True)))
              for k in range(len(jobs))]
        for t in th:
            t.start()
        for t in th:
            t.join(4 * T)
        assert [got.get(k) for k in range(len(jobs))] == solo
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=120) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
