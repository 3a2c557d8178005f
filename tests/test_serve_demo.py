"""The server on the numpy backend over the demo checkpoint, through the official ``openai`` client:
greedy completions equal the batch CLI's tokens, streamed chat equals non-streamed, ``stop`` strings,
usage counts, and continuous batching (8 clients starting at different times with different lengths
give exactly their solo tokens; one cancelled mid-stream frees its pages and changes nothing else).
Loopback only; every client call has a timeout."""
from __future__ import annotations

import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from ddtree_cupy import run  # noqa: E402

from _serve_helpers import (MODEL, LocalServer, demo_state, free_port, run_threads, start_server,  # noqa: E402
                            stop_process, wait_drained)

pytestmark = pytest.mark.slow
T = 120.0
BUDGET = "8"


@pytest.fixture(scope="module")
def server():
    srv = LocalServer(demo_state("--budget", BUDGET, "--max-streams", "8"))
    yield srv
    srv.close()


def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=T, max_retries=0)


def ids_of(resp):
    return resp.model_extra["ddtree"]["token_ids"]


def test_greedy_completions_equal_batch_cli(server, capsys):
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    argv = ["--demo", "--json", "--backend", "numpy", "--budget", BUDGET, "--max-new-tokens", "12"]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    assert run.main(argv) == 0
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["streams"]
    c = client(server)
    for p, ref in zip(prompts, cli):
        r = c.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                 extra_body={"return_token_ids": True})
        assert ids_of(r) == ref["output_ids"]
        assert r.choices[0].text == ref["text"]
        assert r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == len(ref["output_ids"])
        assert r.choices[0].finish_reason == ("length" if ref["finish_reason"] == "length" else "stop")
        assert r.model_extra["ddtree"]["mean_accept_len"] >= 1.0


def test_text_prompt_equals_token_prompt(server):
    c = client(server)
    a = c.completions.create(model=MODEL, prompt="The river town", max_tokens=6, temperature=0,
                             extra_body={"return_token_ids": True})
    pid = a.model_extra["ddtree"]["prompt_token_ids"]
    b = c.completions.create(model=MODEL, prompt=pid, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    assert ids_of(a) == ids_of(b) and a.choices[0].text == b.choices[0].text


def _stream_chat(c, **kw):
    text, reasoning, fin, usage, ext = "", "", None, None, None
    for ch in c.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = ch.usage
        if (ch.model_extra or {}).get("ddtree"):
            ext = ch.model_extra["ddtree"]
        for choice in ch.choices:
            text += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            fin = choice.finish_reason or fin
    return text, reasoning, fin, usage, ext


def test_streamed_chat_equals_non_streamed_with_usage(server):
    c = client(server)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about rivers."}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                  extra_body={"return_token_ids": True})
    text, reasoning, fin, usage, ext = _stream_chat(c, messages=msgs, max_tokens=10, temperature=0,
                                                    extra_body={"return_token_ids": True})
    m = r.choices[0].message
    assert (text, reasoning) == (m.content or "", m.model_extra.get("reasoning_content") or "")
    assert ext["token_ids"] == ids_of(r) and fin == r.choices[0].finish_reason
    assert usage.completion_tokens == r.usage.completion_tokens == len(ids_of(r))
    assert usage.prompt_tokens == r.usage.prompt_tokens == len(ext["prompt_token_ids"])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(server, stream):
    c = client(server)
    base = c.completions.create(model=MODEL, prompt=[3, 4, 5, 6], max_tokens=16, temperature=0)
    full = base.choices[0].text
    assert len(full) > 12
    stop = full[6:10]
    want = full[:full.index(stop)]
    if stream:
        got, fin = "", None
        for ch in c.completions.create(model=MODEL, prompt=[3, 4, 5, 6], max_tokens=16, temperature=0, stop=[stop],
                                       stream=True):
            got += ch.choices[0].text
            fin = ch.choices[0].finish_reason or fin
    else:
        r = c.completions.create(model=MODEL, prompt=[3, 4, 5, 6], max_tokens=16, temperature=0, stop=stop)
        got, fin = r.choices[0].text, r.choices[0].finish_reason
    assert got == want and fin == "stop"


def test_continuous_batching_equals_solo_and_cancel_frees_pages(server):
    """8 clients that start at different times with different lengths run concurrently: each gets exactly
    its solo tokens; a 9th, cancelled mid-stream by closing its connection, leaves them identical and the
    KV pool returns to empty."""
    c = client(server)
    jobs = [([7 + k, 20 + 3 * k, 9, 31 - k][: 2 + k % 3], 4 + 2 * k) for k in range(8)]
    solo = []
    for p, n in jobs:
        r = c.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                 extra_body={"return_token_ids": True, "ignore_eos": True})
        solo.append(ids_of(r))
        assert len(solo[-1]) == n
    got, errors = {}, []

    def run_one(k):
        try:
            time.sleep(0.15 * k)
            p, n = jobs[k]
            ext = None
            for ch in client(server).completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                                         stream=True, extra_body={"return_token_ids": True,
                                                                                  "ignore_eos": True}):
                ext = (ch.model_extra or {}).get("ddtree") or ext
            got[k] = ext["token_ids"]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    def cancelled():
        time.sleep(0.2)
        with httpx.stream("POST", server.url + "/v1/completions", timeout=T,
                          json={"model": MODEL, "prompt": [40, 41, 42], "max_tokens": 200, "stream": True,
                                "temperature": 0, "ignore_eos": True}) as r:
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data: ")
                if n >= 3:
                    break
    run_threads([lambda k=k: run_one(k) for k in range(8)] + [cancelled], 4 * T)
    assert not errors, errors
    assert [got[k] for k in range(8)] == solo
    loop = server.state.loop
    pool = loop.sched.pool
    wait_drained(loop, T)
    assert pool.free_pages == pool.num_pages and loop.running == 0 and loop.queued == 0
    pool.check_invariants()
    m = httpx.get(server.url + "/metrics", timeout=T).text
    assert 'ddtree_requests_total{outcome="cancelled"} 1.0' in m


def test_command_line_server_start_talk_stop(tmp_path):
    """What a new user does: start ``python -m ddtree_cupy.serve --demo``, talk to it, Ctrl-C."""
    import signal
    import sys
    port = free_port()
    p, url = start_server([sys.executable, "-m", "ddtree_cupy.serve", "--demo", "--backend", "numpy", "--port",
                           str(port), "--budget", "8"], port, timeout_s=120, poll_s=0.3)
    try:
        r = httpx.post(url + "/v1/chat/completions", timeout=T,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=30) == 0
    finally:
        stop_process(p)


def test_bad_option_is_one_line_error(capsys):
    assert run.main(["serve", "--demo", "--backend", "numpy", "--budget", "0"]) == 2
    err = capsys.readouterr().err
    assert "error: --budget must be in [1, 128]" in err and "Traceback" not in err
