"""Command line: ``python -m ddtree_cupy.run --model DIR --drafter DIR --prompt TEXT ...`` (docs/CLI.md).

Generates with DDTree (default), the DFlash chain or plain autoregressive decoding, streams the text, and
ends with a summary; ``--json`` prints one JSON object on the last line instead. Bad input (missing or
malformed model, drafter that does not fit the target, bad prompt or option) ends with a one-line
``error: ...`` on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import codecs
import json
import os
import sys
import time
from typing import List, Optional, Sequence

# The numpy backend multiplies many small matrices, where OpenBLAS's thread pool costs more than it saves
# (measured 5x slower on 2 cores for the tiny demo model). Respect a caller's own setting.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

EXIT_BAD_INPUT = 2
MAX_BUDGET = 128
DEMO_PROMPT = "The river town woke slowly on the first cold morning of the year."


class UsageError(ValueError):
    """Bad input from the command line; the message names the option or file."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ddtree_cupy.run",
                                 description="Generate text with DDTree speculative decoding (Kimi K2.6 + DFlash drafter).")
    m = ap.add_argument_group("model")
    m.add_argument("--model", metavar="DIR", help="target checkpoint directory (config.json, safetensors, tokenizer)")
    m.add_argument("--drafter", metavar="DIR", help="DFlash drafter directory (needed for --mode ddtree/chain)")
    m.add_argument("--demo", action="store_true",
                   help="use the tiny generated checkpoints (made once into $DDTREE_CUPY_CACHE or ~/.cache/ddtree_cupy) "
                        "and a default prompt when none is given")
    p = ap.add_argument_group("prompt (each --prompt / --prompt-ids / --chat is one stream)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="raw text prompt")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="IDS", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="append", default=[], metavar="TEXT", help="user message in Kimi's chat format")
    p.add_argument("--system", metavar="TEXT", help="system message for --chat")
    p.add_argument("--thinking", dest="thinking", action="store_true", default=True,
                   help="chat: open a <think> block (default)")
    p.add_argument("--no-thinking", dest="thinking", action="store_false", help="chat: empty <think></think>")
    g = ap.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    g.add_argument("--mode", default="ddtree", choices=("ddtree", "chain", "ar"))
    g.add_argument("--budget", default="auto", metavar="N|auto",
                   help=f"DDTree node budget: 'auto' (default: chosen per step and stream from a cost model, at most "
                        f"32 nodes; docs/BUDGET.md), 'auto:N' (at most N), or a fixed N in 1..{MAX_BUDGET}")
    g.add_argument("--cost-table", default=None, metavar="FILE",
                   help="--budget auto: step times per (stream bucket, verify rows) as JSON (bench/step.py "
                        "--cost-table writes one); default a model of the H200 step")
    g.add_argument("--cap-k", type=int, default=None, metavar="K", help="use only the K best tokens per depth")
    g.add_argument("--include-chain", action="store_true", help="always put the drafter's top-1 chain in the tree")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off")
    g.add_argument("--seed", type=int, default=0, metavar="S")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop on <|im_end|> / [EOS]")
    d = ap.add_argument_group("drafter options")
    d.add_argument("--draft-window", type=int, default=None, metavar="W", help="drafter sees only the last W context tokens")
    d.add_argument("--rope-amplitude", type=float, default=None, metavar="A",
                   help="drafter RoPE cos/sin amplitude (default: from its config; 1.4159 = 1 + 0.1 ln 64)")
    r = ap.add_argument_group("runtime")
    r.add_argument("--backend", default="auto", choices=("auto", "cupy", "numpy"))
    r.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="numpy backend precision")
    r.add_argument("--json", action="store_true", help="print one JSON object on the last line of stdout")
    return ap


# --------------------------------------------------------------------------------------------------

def _check_options(a) -> None:
    from .budget import parse_budget
    try:
        b = parse_budget(a.budget)
    except ValueError as e:
        raise UsageError(f"--budget: {e}") from None
    n = b if isinstance(b, int) else (32 if b == "auto" else b[1])
    if not 1 <= n <= MAX_BUDGET:
        raise UsageError(f"--budget must be in [1, {MAX_BUDGET}] (or 'auto', 'auto:N'), got {a.budget}")
    if a.cost_table is not None:
        if isinstance(b, int):
            raise UsageError("--cost-table: only used with --budget auto")
        from .budget import CostTable
        try:
            CostTable.load(a.cost_table)
        except ValueError as e:
            raise UsageError(f"--cost-table: {e}") from None
    if a.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if not a.temperature >= 0.0 or a.temperature == float("inf"):
        raise UsageError(f"--temperature must be a finite number >= 0, got {a.temperature}")
    if not 0.0 < a.top_p <= 1.0:
        raise UsageError(f"--top-p must be in (0, 1], got {a.top_p}")
    if a.top_k < 0:
        raise UsageError(f"--top-k must be >= 0, got {a.top_k}")
    if a.cap_k is not None and a.cap_k < 1:
        raise UsageError(f"--cap-k must be >= 1, got {a.cap_k}")
    if a.draft_window is not None and a.draft_window < 1:
        raise UsageError(f"--draft-window must be >= 1, got {a.draft_window}")
    if a.rope_amplitude is not None and not 0.0 < a.rope_amplitude < float("inf"):
        raise UsageError(f"--rope-amplitude must be a finite number > 0, got {a.rope_amplitude}")
    if not 0 <= a.seed < 2 ** 64:
        raise UsageError(f"--seed must be in [0, 2^64), got {a.seed}")


def _parse_ids(text: str, i: int) -> List[int]:
    parts = [t.strip() for t in text.split(",")]
    if parts == [""]:
        raise UsageError(f"--prompt-ids #{i + 1}: prompt is empty")
    try:
        return [int(t) for t in parts]
    except ValueError:
        raise UsageError(f"--prompt-ids #{i + 1}: expected comma-separated integers, got {text!r}") from None


def _load_configs(a):
    from .config import DrafterConfig, TargetConfig
    if not a.model:
        raise UsageError("--model DIR is required (or --demo)")
    if not os.path.isdir(a.model):
        raise UsageError(f"--model {a.model}: directory does not exist")
    tcfg = TargetConfig.load(a.model)
    dcfg = None
    if a.mode != "ar":
        if not a.drafter:
            raise UsageError(f"--drafter DIR is required for --mode {a.mode}")
        if not os.path.isdir(a.drafter):
            raise UsageError(f"--drafter {a.drafter}: directory does not exist")
        dcfg = DrafterConfig.load(a.drafter).with_options(rope_amplitude=a.rope_amplitude,
                                                          draft_window=a.draft_window)
        dcfg.check_matches(tcfg)
        from .reference.ddtree import MAX_DEPTH
        if dcfg.block_size - 1 > MAX_DEPTH:
            raise UsageError(f"--drafter {a.drafter}: block_size {dcfg.block_size} is not supported (trees are built "
                             f"for at most {MAX_DEPTH} draft depths, block_size <= {MAX_DEPTH + 1})")
    return tcfg, dcfg


def _load_tokenizer(a, tcfg, needed: bool):
    from .tokenizer import KimiTokenizer
    if not os.path.exists(os.path.join(a.model, "tiktoken.model")):
        if needed:
            raise UsageError(f"--model {a.model}: no tiktoken.model, so --prompt/--chat cannot be tokenized "
                             f"(use --prompt-ids)")
        return None
    tok = KimiTokenizer.from_dir(a.model)
    if tok.vocab_size > tcfg.vocab_size:
        raise UsageError(f"--model {a.model}: tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                         f"{tcfg.vocab_size}")
    return tok


def _prompts(a, tok) -> List[List[int]]:
    out: List[List[int]] = []
    for i, text in enumerate(a.prompt):
        if not text:
            raise UsageError(f"--prompt #{i + 1}: prompt is empty")
        out.append(tok.encode(text))
    for i, text in enumerate(a.prompt_ids):
        out.append(_parse_ids(text, i))
    for i, text in enumerate(a.chat):
        msgs = ([("system", a.system)] if a.system else []) + [("user", text)]
        out.append(tok.encode_chat(msgs, thinking=a.thinking))
    if a.system and not a.chat:
        raise UsageError("--system only applies to --chat")
    return out


# --------------------------------------------------------------------------------------------------

class _Printer:
    """Streams each stream's text as its tokens arrive (several streams: one '[i] chunk' line per step)."""

    def __init__(self, tok, n_streams: int, out):
        self.tok, self.n, self.out = tok, n_streams, out
        self.dec = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(n_streams)]

    def chunk(self, idx: int, ids: Sequence[int], stop_ids) -> str:
        ids = [i for i in ids if i not in stop_ids]
        if self.tok is None:
            return " ".join(str(i) for i in ids) + (" " if ids else "")
        return self.dec[idx].decode(self.tok.decode_bytes(ids))

    def __call__(self, stream, ids) -> None:
        text = self.chunk(stream.index, ids, stream.request.stop_ids)
        if not text:
            return
        if self.n == 1:
            self.out.write(text)
        else:
            self.out.write(f"[{stream.index}] {text!r}\n")
        self.out.flush()


def _text(tok, ids: Sequence[int], stop_ids) -> str:
    if tok is None:
        return ""
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    return tok.decode(ids)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:       # argparse already printed usage + the reason
        return int(e.code or 0)
    from .dist import guarded, init_communicator
    # Under mpirun every rank runs this same function on its own tensor-parallel shard; rank 0 alone
    # talks to the user. Outside mpirun the communicator is a group of one.
    comm = init_communicator(_comm_backend(a.backend))
    if comm.size == 1:
        return _main(a, comm)
    return guarded(lambda: _main(a, comm), comm)


def _comm_backend(backend: str) -> str:
    """Which communicator the ranks need: NCCL for the GPU engine, MPI (numpy arrays) otherwise.
    Decided before anything else so every rank picks the same one; the backend itself is validated
    (with a clear error) in _prepare."""
    if backend == "numpy":
        return "numpy"
    if backend == "cupy":
        return "cupy"
    from .backend import gpu_engine_available, gpu_status
    return "cupy" if gpu_status()[0] and gpu_engine_available() else "numpy"


def _main(a, comm) -> int:
    err = sys.stderr
    from .backend import BackendError
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .tokenizer import TokenizerError
    bad_input = (UsageError, ConfigError, CheckpointError, TokenizerError, BackendError, ValueError)
    quiet = _Quiet() if not comm.is_root else err      # only rank 0 speaks to the user
    problem, job = None, None
    try:
        # everything that depends on the user's input: options, files, prompts, weights
        job = _prepare(a, quiet, comm)
    except KeyboardInterrupt:
        print("interrupted", file=err)
        return 130
    except bad_input as e:
        problem = f"error: {e}"
    # Every rank learns whether any rank failed, so all exit together and the error is reported once
    # (by rank 0 when it saw it too, else by the first rank that did) instead of a hang in a collective.
    problems = comm.all_gather_obj(problem)
    if any(problems):
        first = next(i for i, p in enumerate(problems) if p)
        if comm.rank == (0 if problems[0] else first):
            print(problems[first] if first == 0 else f"{problems[first]} (on rank {first})", file=err)
        return EXIT_BAD_INPUT
    try:
        # from here on an exception is a bug in the engine: let its traceback show
        return _generate(a, quiet, *job, root=comm.is_root)
    except KeyboardInterrupt:
        print("interrupted", file=err)
        return 130


class _Quiet:
    """A sink for the messages non-root ranks would otherwise print a second time."""

    def write(self, s):
        return len(s)

    def flush(self):
        pass


def _prepare(a, err, comm):
    import numpy as np

    from .backend import create_engine, select_backend
    from .reference.loop import Request

    _check_options(a)
    if a.demo:
        from .tinymodel import default_cache_dir, ensure_tiny_checkpoints
        if not a.model:
            t0 = time.perf_counter()
            a.model, demo_drafter = ensure_tiny_checkpoints(default_cache_dir())
            a.drafter = a.drafter or demo_drafter
            if not a.json:
                print(f"demo checkpoints: {os.path.dirname(a.model)} ({time.perf_counter() - t0:.1f} s)", file=err)
        if not (a.prompt or a.prompt_ids or a.chat):
            a.prompt = [DEMO_PROMPT]
    if not (a.prompt or a.prompt_ids or a.chat):
        raise UsageError("no prompt: give --prompt TEXT, --prompt-ids IDS or --chat TEXT (or --demo)")
    tcfg, dcfg = _load_configs(a)
    tok = _load_tokenizer(a, tcfg, needed=bool(a.prompt or a.chat))
    prompts = _prompts(a, tok)
    if a.ignore_eos:
        stop = ()
    elif tok is not None:
        stop = tok.stop_ids
    else:
        stop = () if tcfg.eos_token_id is None else (int(tcfg.eos_token_id),)
    reqs = [Request(p, a.max_new_tokens, stop, a.temperature, a.top_p, a.top_k, a.seed, sample_stream=i)
            for i, p in enumerate(prompts)]
    for i, r in enumerate(reqs):          # every input error before the (slow) weight load
        try:
            r.validate(tcfg.vocab_size, tcfg.max_position_embeddings)
        except ValueError as e:
            raise UsageError(f"stream {i}: {e}") from None

    backend = select_backend(a.backend, lambda line: print(line, file=err))
    if comm.size > 1:
        tcfg.validate_tp(comm.size)
        if dcfg is not None:
            dcfg.validate_tp(comm.size)
        # Rank 0 owns the requests: the others run exactly what it parsed and tokenized.
        reqs = comm.broadcast_obj(reqs if comm.is_root else None)
    from .checkpoint import bytes_read_total
    b0, t0 = bytes_read_total(), time.perf_counter()
    engine = create_engine(backend, tcfg, a.model, dcfg, a.drafter, np.dtype(a.dtype), comm)
    load_s = time.perf_counter() - t0
    # Every rank read only its own slices: report what all of them read together, once.
    loads = comm.all_gather_obj((bytes_read_total() - b0, load_s))
    total = sum(b for b, _ in loads)
    wall = max(t for _, t in loads)
    if not a.json:
        print(f"weights: {total / 1e9:.3f} GB read by {comm.size} rank(s) in {wall:.2f} s "
              f"({total / wall / 1e9 if wall > 0 else 0:.2f} GB/s aggregate)", file=err)
    return engine, reqs, tok, backend, load_s


def _budget_arg(a):
    """What the engines take as ``budget``: a fixed int, or a ``BudgetPolicy`` (mode ddtree, --budget auto)."""
    from .budget import BudgetPolicy, CostTable, DEFAULT_MAX_NODES, parse_budget
    b = parse_budget(a.budget)
    if isinstance(b, int) or a.mode != "ddtree":
        return b if isinstance(b, int) else DEFAULT_MAX_NODES
    costs = CostTable.load(a.cost_table) if a.cost_table else None
    return BudgetPolicy(DEFAULT_MAX_NODES if b == "auto" else b[1], costs=costs)


def _generate(a, err, engine, reqs, tok, backend, load_s, root: bool = True) -> int:
    from .budget import parse_budget
    out = sys.stdout if root else _Quiet()
    printer = None if (a.json or not root) else _Printer(tok, len(reqs), out)
    if printer is not None:
        print(f"loaded in {load_s:.1f} s ({backend}, {a.dtype}); mode {a.mode}"
              + (f", budget {a.budget}" if a.mode == "ddtree" else ""), file=err)
    res = engine.generate(reqs, a.mode, _budget_arg(a), a.cap_k, a.include_chain, on_tokens=printer)

    stats = res.stats_dict()
    b = parse_budget(a.budget)
    stats.update({"mode": a.mode, "budget": (b if isinstance(b, int) else str(a.budget)) if a.mode == "ddtree" else None,
                  "backend": backend,
                  "dtype": a.dtype, "load_s": load_s, "tp": engine.comm.size})
    streams = [{"prompt_ids": [int(t) for t in s.request.prompt_ids], "output_ids": [int(t) for t in s.output_ids],
                "text": _text(tok, s.output_ids, s.request.stop_ids), "finish_reason": s.finish_reason}
               for s in res.streams]
    if a.json:
        out.write(json.dumps({"streams": streams, "stats": stats}) + "\n")
        out.flush()
        return 0
    if len(reqs) == 1:
        out.write("\n")
    else:
        for i, s in enumerate(streams):
            out.write(f"--- stream {i} ({s['finish_reason']}): {s['text']!r}\n")
    ph = ", ".join(f"{k} {v:.0f} ms" for k, v in stats["phase_ms"].items())
    out.write(f"--- {stats['new_tokens']} tokens in {stats['elapsed_s']:.2f} s ({stats['tokens_per_s']:.1f} tok/s), "
              f"{stats['steps']} steps, mean acceptance length {stats['mean_accept_len']:.2f}; {ph}\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
