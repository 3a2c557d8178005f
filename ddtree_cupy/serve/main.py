"""``python -m ddtree_cupy.serve`` (also ``ddtree-cupy serve``): the OpenAI-compatible server (docs/SERVING.md).

One process, or every rank of an ``mpirun`` job (launcher/): each rank loads its tensor-parallel shard and
runs the engine loop on its main thread; rank 0 also serves HTTP (uvicorn, on a second thread) and
broadcasts each step's admissions, cancellations and stop to the others, so all ranks take the same
decisions. An exception on any rank ends the whole job (``dist.guarded``); a client disconnect ends only
its stream. SIGINT / SIGTERM stop the loop after the current step and end every rank.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Optional, Sequence

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")      # as the batch CLI: small numpy products

EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    from ..api import MAX_BUDGET, MODES
    from ..run import HelpWithDefaults
    ap = argparse.ArgumentParser(prog="python -m ddtree_cupy.serve",
                                 description="OpenAI-compatible server: Kimi K2.6 with DDTree speculative decoding.",
                                 formatter_class=HelpWithDefaults)
    m = ap.add_argument_group("model")
    m.add_argument("--model", metavar="DIR", help="target checkpoint directory (config.json, safetensors, tokenizer)")
    m.add_argument("--drafter", metavar="DIR", help="DFlash drafter directory (needed for --mode ddtree/chain)")
    m.add_argument("--demo", action="store_true", help="serve the tiny generated checkpoints (made once into the cache)")
    m.add_argument("--served-model-name", metavar="NAME", default=None,
                   help="the model id clients send (default: the --model directory's name, 'ddtree-demo' with --demo)")
    h = ap.add_argument_group("http")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    h.add_argument("--port", type=int, default=8000, help="TCP port")
    h.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (default: open)")
    g = ap.add_argument_group("engine")
    g.add_argument("--backend", default="auto", choices=("auto", "cupy", "numpy"),
                   help="auto: the GPU engine where a CUDA GPU is usable, else the numpy reference")
    g.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="numpy backend precision")
    g.add_argument("--mode", default="ddtree", choices=MODES,
                   help="ddtree: tree speculation; chain: the drafter's top-1 path; ar: no speculation")
    g.add_argument("--budget", default="auto", metavar="N|auto",
                   help=f"DDTree node budget: 'auto' (chosen per step and stream from a cost model, docs/BUDGET.md), "
                        f"'auto:N' (at most N nodes), or a fixed N in 1..{MAX_BUDGET}")
    g.add_argument("--cost-table", default=None, metavar="FILE",
                   help="--budget auto: step times per (stream bucket, verify rows) as JSON (bench/step.py --cost-table)")
    g.add_argument("--max-streams", type=int, default=8, help="streams decoded together (continuous batching)")
    g.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a stream slot; "
                                                             "more are refused with 429")
    g.add_argument("--max-tokens-default", type=int, default=4096,
                   help="max_tokens of a request that gives none (capped by the context left)")
    g.add_argument("--kv-tokens", type=int, default=None,
                   help="KV cache tokens over all streams (default: GPU: from free memory; numpy: every slot full)")
    return ap


class UsageError(ValueError):
    pass


def _check(a) -> None:
    from ..run import UsageError as RunUsageError, check_budget_options
    try:
        check_budget_options(a)
    except RunUsageError as e:
        raise UsageError(str(e)) from None
    if not 1 <= a.max_streams <= 4096:
        raise UsageError(f"--max-streams must be in [1, 4096], got {a.max_streams}")
    if a.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {a.max_queue}")
    if not 0 <= a.port < 65536:
        raise UsageError(f"--port must be in [0, 65535], got {a.port}")
    if a.max_tokens_default < 1:
        raise UsageError(f"--max-tokens-default must be >= 1, got {a.max_tokens_default}")
    if a.kv_tokens is not None and a.kv_tokens < 1:
        raise UsageError(f"--kv-tokens must be >= 1, got {a.kv_tokens}")


def build_state(a, comm, log=print):
    """Load configs, tokenizer and engine for ``a``; returns the server state (its loop not yet running)."""
    import numpy as np

    from ..backend import create_engine, select_backend
    from ..run import UsageError as RunUsageError, _budget_arg, _load_configs, _load_tokenizer
    from .app import ServerState
    from .metrics import ServerMetrics

    _check(a)
    if a.demo and not a.model:
        from ..tinymodel import default_cache_dir, ensure_tiny_checkpoints
        a.model, demo_drafter = ensure_tiny_checkpoints(default_cache_dir())
        a.drafter = a.drafter or demo_drafter
    a.rope_amplitude = getattr(a, "rope_amplitude", None)
    a.draft_window = getattr(a, "draft_window", None)
    try:
        tcfg, dcfg = _load_configs(a)
        tok = _load_tokenizer(a, tcfg, needed=True)
    except RunUsageError as e:
        raise UsageError(str(e)) from None
    backend = select_backend(a.backend, log)
    if comm.size > 1:
        tcfg.validate_tp(comm.size)
        if dcfg is not None:
            dcfg.validate_tp(comm.size)
    t0 = time.perf_counter()
    gpu = {"max_streams": a.max_streams, "kv_tokens": a.kv_tokens} if backend == "cupy" else {}
    engine = create_engine(backend, tcfg, a.model, dcfg, a.drafter, np.dtype(a.dtype), comm, **gpu)
    metrics = ServerMetrics()
    if backend == "cupy":
        loop = engine.make_loop(a.mode, _budget_arg(a), max_queue=a.max_queue, observer=metrics)
    else:
        loop = engine.make_loop(a.mode, _budget_arg(a), max_streams=a.max_streams, max_queue=a.max_queue,
                                kv_tokens=a.kv_tokens, observer=metrics)
    metrics.pool = loop.sched.pool
    name = a.served_model_name or ("ddtree-demo" if a.demo else os.path.basename(os.path.abspath(a.model)))
    log(f"engine: {backend}, mode {a.mode}" + (f", budget {a.budget}" if a.mode == "ddtree" else "")
        + f", {loop.max_streams} streams, KV pool {loop.sched.pool.num_pages} pages; loaded in "
          f"{time.perf_counter() - t0:.1f} s")
    return ServerState(loop, tok, tcfg.vocab_size, tcfg.max_position_embeddings, name, metrics, a.api_key,
                       a.max_tokens_default, backend, a.mode)


class HttpThread:
    """uvicorn serving ``app`` on a thread of its own (the engine loop keeps the main thread)."""

    def __init__(self, app, host: str, port: int):
        import uvicorn
        cfg = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                             timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, name="http", daemon=True)

    def start(self, timeout: float = 30.0) -> int:
        """Start and wait until listening; returns the bound port (``port`` 0 picks a free one)."""
        self.thread.start()
        t_end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError("the HTTP server did not start (port in use?)")
            time.sleep(0.02)
        return self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class LocalServer:
    """Engine loop + HTTP on background threads in this process (tests, notebooks): ``url``, ``close()``."""

    def __init__(self, state, host: str = "127.0.0.1", port: int = 0):
        from .app import create_app
        self.state = state
        self.loop_thread = threading.Thread(target=self._run_loop, name="engine-loop", daemon=True)
        self.loop_thread.start()
        self.http = HttpThread(create_app(state), host, port)
        self.port = self.http.start()
        self.url = f"http://{host}:{self.port}"

    def _run_loop(self):
        try:
            self.state.loop.run()
        except BaseException:  # noqa: BLE001 - recorded in loop.error, reported by /health
            pass

    def close(self) -> None:
        self.http.stop()
        self.state.loop.stop()
        self.loop_thread.join(timeout=30)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    from ..dist import guarded, init_communicator
    from ..run import _comm_backend
    comm = init_communicator(_comm_backend(a.backend))
    if comm.size == 1:
        return _main(a, comm)
    return guarded(lambda: _main(a, comm), comm)


def _main(a, comm) -> int:
    from ..backend import BackendError
    from ..checkpoint import CheckpointError
    from ..config import ConfigError
    from ..tokenizer import TokenizerError
    err = sys.stderr
    say = (lambda line: print(line, file=err, flush=True)) if comm.rank == 0 else (lambda line: None)
    problem, state = None, None
    try:
        state = build_state(a, comm, say)
    except (UsageError, ConfigError, CheckpointError, TokenizerError, BackendError, ValueError) as e:
        problem = f"error: {e}"
    problems = comm.all_gather_obj(problem)
    if any(problems):
        first = next(i for i, p in enumerate(problems) if p)
        if comm.rank == (0 if problems[0] else first):
            print(problems[first] if first == 0 else f"{problems[first]} (on rank {first})", file=err)
        return EXIT_BAD_INPUT
    http = None
    if comm.rank == 0:
        from .app import create_app
        http = HttpThread(create_app(state), a.host, a.port)
        try:
            port = http.start()
        except RuntimeError as e:
            state.loop.stop()           # the other ranks learn it at the first exchange
            state.loop.iterate(until_idle=True)
            print(f"error: --port {a.port}: {e}", file=err)
            return EXIT_BAD_INPUT
        say(f"serving {state.model_name!r} on http://{a.host}:{port}/v1 (tp {comm.size}; Ctrl-C stops)")

        def stop(signum, frame):
            state.loop.stop()
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
    else:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # mpirun forwards Ctrl-C: rank 0 broadcasts the stop
    try:
        state.loop.run()                # every rank: until rank 0 broadcasts stop
    finally:
        if http is not None:
            http.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
