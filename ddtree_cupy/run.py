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
EXIT_REFUSED = 3          # the run finished but the engine refused at least one stream
MAX_BUDGET = 128
INT32_MAX = 2 ** 31 - 1
DEMO_PROMPT = "The river town woke slowly on the first cold morning of the year."


class UsageError(ValueError):
    """Bad input from the command line; the message names the option or file."""


def plural(n: int, word: str) -> str:
    """'1 token', '2 tokens': a count and its noun, as every command line prints them."""
    return f"{n} {word}{'' if n == 1 else 's'}"


class HelpWithDefaults(argparse.HelpFormatter):
    """--help shows each option's default where it has one (not for unset options and flags, nor where the help
    already says it); every command line of the package uses it."""

    def _get_help_string(self, action):
        h = action.help or ""
        if (action.option_strings and action.nargs != 0 and "default" not in h
                and action.default is not None and action.default != [] and action.default is not argparse.SUPPRESS):
            h += " (default: %(default)s)"
        return h


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ddtree_cupy.run", formatter_class=HelpWithDefaults,
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
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate per stream")
    g.add_argument("--mode", default="ddtree", choices=("ddtree", "chain", "ar"),
                   help="ddtree: tree speculation; chain: the drafter's top-1 path; ar: no speculation")
    g.add_argument("--budget", default="auto", metavar="N|auto",
                   help=f"DDTree node budget: 'auto' (chosen per step and stream from a cost model, at most "
                        f"32 nodes; docs/BUDGET.md), 'auto:N' (at most N), or a fixed N in 1..{MAX_BUDGET}")
    g.add_argument("--cost-table", default=None, metavar="FILE",
                   help="--budget auto: step times per (stream bucket, verify rows) as JSON (bench/step.py "
                        "--cost-table writes one); default a model of the H200 step")
    g.add_argument("--cap-k", type=int, default=None, metavar="K", help="use only the K best tokens per depth")
    g.add_argument("--include-chain", action="store_true", help="always put the drafter's top-1 chain in the tree")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (needs --temperature > 0)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K likeliest tokens, 0 = off (needs --temperature > 0)")
    g.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop on <|im_end|> / [EOS]")
    d = ap.add_argument_group("drafter options")
    d.add_argument("--draft-window", type=int, default=None, metavar="W", help="drafter sees only the last W context tokens")
    d.add_argument("--rope-amplitude", type=float, default=None, metavar="A",
                   help="drafter RoPE cos/sin amplitude (default: from its config; 1.4159 = 1 + 0.1 ln 64)")
    r = ap.add_argument_group("runtime")
    r.add_argument("--backend", default="auto", choices=("auto", "cupy", "numpy"),
                   help="auto: the GPU engine where a CUDA GPU is usable, else the numpy reference")
    r.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="numpy backend precision")
    r.add_argument("--json", action="store_true", help="print one JSON object on the last line of stdout")
    r.add_argument("--profile", action="store_true",
                   help="cupy backend: after the run, time its step, phases and layers against their floors "
                        "(printed to stderr; in the JSON under stats.profile); docs/PROFILING.md")
    r.add_argument("--profile-trace", metavar="FILE", help="with --profile: the step's timeline as a Chrome trace")
    return ap


# --------------------------------------------------------------------------------------------------

def check_budget_options(a) -> None:
    """--budget (N, 'auto', 'auto:N') and --cost-table, for the CLI and the server alike."""
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


def _check_options(a) -> None:
    from .api import MAX_TEMPERATURE, MIN_TEMPERATURE
    check_budget_options(a)
    if a.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.max_new_tokens > INT32_MAX:
        raise UsageError(f"--max-new-tokens must be < 2^31, got {a.max_new_tokens}")
    if not (a.temperature == 0.0 or MIN_TEMPERATURE <= a.temperature <= MAX_TEMPERATURE):
        raise UsageError(f"--temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                         f"got {a.temperature}")
    if not 0.0 < a.top_p <= 1.0:
        raise UsageError(f"--top-p must be in (0, 1], got {a.top_p}")
    if not 0 <= a.top_k <= INT32_MAX:
        raise UsageError(f"--top-k must be in [0, 2^31), got {a.top_k}")
    if a.temperature == 0.0 and (a.top_p != 1.0 or a.top_k != 0):
        # greedy decoding ignores both; refusing beats a silently greedy run the user thought was sampled
        raise UsageError("--top-p / --top-k filter sampling, but --temperature is 0 (greedy, the default): "
                         "add --temperature T > 0 to sample, or drop them")
    if a.cap_k is not None and not 1 <= a.cap_k <= INT32_MAX:
        raise UsageError(f"--cap-k must be in [1, 2^31), got {a.cap_k}")
    if a.draft_window is not None and not 1 <= a.draft_window <= INT32_MAX:
        raise UsageError(f"--draft-window must be in [1, 2^31), got {a.draft_window}")
    if a.rope_amplitude is not None and not 0.0 < a.rope_amplitude < float("inf"):
        raise UsageError(f"--rope-amplitude must be a finite number > 0, got {a.rope_amplitude}")
    if not 0 <= a.seed < 2 ** 64:
        raise UsageError(f"--seed must be in [0, 2^64), got {a.seed}")


def _check_limits(a, tcfg, dcfg, reqs, tp: int = 1) -> None:
    """Limits that depend on the model, checked before any weight is read."""
    if a.draft_window is not None and a.draft_window > tcfg.max_position_embeddings:
        raise UsageError(f"--draft-window {a.draft_window} exceeds the context limit {tcfg.max_position_embeddings} "
                         f"(max_position_embeddings of {tcfg.source}): the drafter never sees more than the context")
    if a.backend != "numpy":
        _check_gpu_memory(a, tcfg, dcfg, reqs, tp)


def _context_needed(reqs, tcfg) -> int:
    """Cache tokens the longest request can reach: prompt + new tokens, capped at the position limit, plus
    one verify step's tree rows."""
    from .reference.ddtree import MAX_TREE_ROWS
    longest = max(len(r.prompt_ids) + int(r.max_new_tokens) for r in reqs)
    return min(longest, tcfg.max_position_embeddings) + MAX_TREE_ROWS


def context_fits(kv_tokens_needed: int, num_layers: int, weight_bytes_per_rank: int, device_bytes: int) -> bool:
    """Whether this rank's weight shard plus the latent cache of ``kv_tokens_needed`` tokens (all layers,
    bf16 576-value rows) fit in the device's memory at all (a necessary condition, not a plan)."""
    return weight_bytes_per_rank + kv_tokens_needed * num_layers * 576 * 2 <= device_bytes


def _check_gpu_memory(a, tcfg, dcfg, reqs, tp: int) -> None:
    """Refuse, before minutes of loading, requests whose contexts cannot fit next to the weights."""
    try:
        import cupy
        total = int(cupy.cuda.runtime.memGetInfo()[1])
    except Exception:        # noqa: BLE001 - no usable GPU: select_backend reports that clearly
        return
    wbytes = sum(_dir_weight_bytes(d) for d in (a.model, a.drafter if dcfg is not None else None) if d) // tp
    need = _context_needed(reqs, tcfg)
    if not context_fits(need, tcfg.num_hidden_layers, wbytes, total):
        raise UsageError(f"a context of {need} tokens ({plural(len(reqs), 'stream')}) does not fit in the GPU's "
                         f"{total / 2**30:.1f} GiB next to {wbytes / 2**30:.1f} GiB of weights per rank; "
                         f"shorten the prompt or --max-new-tokens, or use more GPUs")


def _dir_weight_bytes(d: str) -> int:
    try:
        return sum(e.stat().st_size for e in os.scandir(d) if e.name.endswith(".safetensors"))
    except OSError:
        return 0


def _parse_ids(text: str, stream: int) -> List[int]:
    parts = [t.strip() for t in text.split(",")]
    if parts == [""]:
        raise UsageError(f"stream {stream} (--prompt-ids): prompt is empty")
    try:
        return [int(t) for t in parts]
    except ValueError:
        raise UsageError(f"stream {stream} (--prompt-ids): expected comma-separated integers, got {text!r}") from None


def _check_dir(option: str, path: str) -> None:
    if os.path.isfile(path):
        raise UsageError(f"{option} {path}: is a file, not a directory (give the checkpoint's directory)")
    if not os.path.isdir(path):
        raise UsageError(f"{option} {path}: directory does not exist")


def _load_configs(a):
    from .config import DrafterConfig, TargetConfig
    if not a.model:
        raise UsageError("--model DIR is required (or --demo)")
    _check_dir("--model", a.model)
    tcfg = TargetConfig.load(a.model)
    dcfg = None
    if a.mode != "ar":
        if not a.drafter:
            raise UsageError(f"--drafter DIR is required for --mode {a.mode}")
        _check_dir("--drafter", a.drafter)
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
    """One prompt per stream, numbered from 0: every --prompt, then every --prompt-ids, then every --chat
    (the numbers of the output's '[i]' / '--- stream i' lines and of every message)."""
    out: List[List[int]] = []
    for text in a.prompt:
        if not text:
            raise UsageError(f"stream {len(out)} (--prompt): prompt is empty")
        out.append(tok.encode(text))
    for text in a.prompt_ids:
        out.append(_parse_ids(text, len(out)))
    for text in a.chat:
        if not text:
            raise UsageError(f"stream {len(out)} (--chat): message is empty")
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
    argv = list(sys.argv[1:] if argv is None else argv)
    # ``ddtree-cupy serve ...``: the HTTP server (docs/SERVING.md); the launcher scripts put
    # ``--backend cupy`` first, so ``launcher/run_8gpu.sh serve ...`` lands here too.
    for at in (0, 2):
        if argv[at:at + 1] == ["serve"] and (at == 0 or argv[0] == "--backend"):
            from .serve.main import main as serve_main
            return serve_main(argv[:at] + argv[at + 1:])
    ap = build_parser()
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:       # argparse already printed usage + the reason
        return int(e.code or 0)
    from .dist import init_communicator
    # Under mpirun every rank runs this same function on its own tensor-parallel shard; rank 0 alone
    # talks to the user. Outside mpirun the communicator is a group of one.
    try:
        comm = init_communicator(_comm_backend(a.backend))
    except (RuntimeError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if comm.size == 1:
        return _main_single(a, comm)
    return _main_ranks(a, comm)


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


# --------------------------------------------------------------------------------------------------
# control path: phases, failures, exit codes (launcher/README.md, "Fault model")

def _bad_input_types():
    from .backend import BackendError
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .tokenizer import TokenizerError
    return (UsageError, ConfigError, CheckpointError, TokenizerError, BackendError, ValueError)


def _classify(e: BaseException):
    """(exit code, one-line message) for a failure inside a phase."""
    if isinstance(e, _bad_input_types()):
        return EXIT_BAD_INPUT, f"error: {e}"
    if isinstance(e, KeyboardInterrupt):
        return 130, "interrupted"
    if isinstance(e, SystemExit):
        return (e.code if isinstance(e.code, int) and e.code else 1), f"error: exited early (sys.exit({e.code!r}))"
    if isinstance(e, MemoryError):
        return 1, f"error: out of memory: {e}"
    return 1, f"error: {type(e).__name__}: {e}"


def _main_single(a, comm) -> int:
    err = sys.stderr
    try:
        job = _prepare(a, err)
        engine, load_s, stats = _load(a, job, comm)
        _report_load(a, err, [stats], 1)
    except KeyboardInterrupt:
        print("interrupted", file=err)
        return 130
    except _bad_input_types() as e:
        print(f"error: {e}", file=err)
        return EXIT_BAD_INPUT
    try:
        # from here on an exception is a bug in the engine: let its traceback show
        return _generate(a, err, engine, job.reqs, job.tok, job.backend, load_s, root=True)
    except KeyboardInterrupt:
        print("interrupted", file=err)
        return 130


def _main_ranks(a, comm) -> int:
    """Several ranks: each phase ends at one agreement point (faults.FaultGuard.agree); a failure on any
    rank ends every rank with one message naming the rank and the cause."""
    from .dist import guarded
    from .faults import FaultGuard, JobFailed, run_phase
    quiet = _Quiet() if not comm.is_root else sys.stderr      # only rank 0 speaks to the user
    guard = FaultGuard(comm)
    try:
        # everything that depends on the user's input: options, files, prompts; no collective inside
        job, problem = run_phase(lambda: _prepare(a, quiet, comm.size), _classify)
        # Rank 0 owns the requests: the others run exactly what it parsed and tokenized.
        reqs = guard.agree("prepare", problem, job.reqs if comm.is_root and job is not None else None)[0]
        job.reqs = reqs
        # this rank's shard of every weight
        loaded, problem = run_phase(lambda: _load(a, job, comm), _classify)
        loads = guard.agree("load", problem, None if loaded is None else loaded[2])
        engine, load_s, _ = loaded
        _report_load(a, quiet, loads, comm.size)
        # Generation has collectives in every step and no agreement point: a failure aborts the job.
        rc = guarded(lambda: _generate(a, quiet, engine, job.reqs, job.tok, job.backend, load_s,
                                       root=comm.is_root), comm)
        return max(guard.agree("end", None, rc))
    except JobFailed as f:
        if comm.is_root:
            print(f.report(), file=sys.stderr, flush=True)
        return f.code
    except BaseException as e:  # noqa: BLE001 - a bug between agreement points must not leave ranks waiting
        guard.abort(f"error on rank {comm.rank}/{comm.size}: {type(e).__name__}: {e}", 1)
        raise
    finally:
        guard.close()


class _Quiet:
    """A sink for the messages non-root ranks would otherwise print a second time."""

    def write(self, s):
        return len(s)

    def flush(self):
        pass


class _Job:
    """What the prepare phase decided: configs, tokenizer, requests, backend."""

    def __init__(self, tcfg, dcfg, tok, reqs, backend):
        self.tcfg, self.dcfg, self.tok, self.reqs, self.backend = tcfg, dcfg, tok, reqs, backend


def _prepare(a, err, tp: int = 1) -> _Job:
    """Every check of the user's input, before any weight is read and without any collective."""
    from .backend import select_backend
    from .api import Request

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
        stop = tcfg.eos_token_ids
    reqs = [Request(p, a.max_new_tokens, stop, a.temperature, a.top_p, a.top_k, a.seed, sample_stream=i)
            for i, p in enumerate(prompts)]
    for i, r in enumerate(reqs):          # every input error before the (slow) weight load
        try:
            r.validate(tcfg.vocab_size, tcfg.max_position_embeddings)
        except ValueError as e:
            raise UsageError(f"stream {i}: {e}") from None
    _check_limits(a, tcfg, dcfg, reqs, tp)
    backend = select_backend(a.backend, lambda line: print(line, file=err))
    if tp > 1:
        tcfg.validate_tp(tp)
        if dcfg is not None:
            dcfg.validate_tp(tp)
    return _Job(tcfg, dcfg, tok, reqs, backend)


def _load(a, job: _Job, comm):
    """This rank's engine (its shard of every weight): (engine, seconds, (bytes read, seconds))."""
    import numpy as np

    from .backend import create_engine
    from .checkpoint import bytes_read_total
    b0, t0 = bytes_read_total(), time.perf_counter()
    opts = {}
    if job.backend == "cupy":
        # size the GPU's per-stream buffers for what these requests can reach, not the position limit
        opts["max_context"] = _context_needed(job.reqs, job.tcfg)
    engine = create_engine(job.backend, job.tcfg, a.model, job.dcfg, a.drafter, np.dtype(a.dtype), comm, **opts)
    load_s = time.perf_counter() - t0
    return engine, load_s, (bytes_read_total() - b0, load_s)


def _report_load(a, err, loads, ranks: int) -> None:
    """Every rank read only its own slices: report what all of them read together, once."""
    total = sum(b for b, _ in loads)
    wall = max(t for _, t in loads)
    if not a.json:
        print(f"weights: {total / 1e9:.3f} GB read by {plural(ranks, 'rank')} in {wall:.2f} s "
              f"({total / wall / 1e9 if wall > 0 else 0:.2f} GB/s aggregate)", file=err)


def _report_refusals(streams, err) -> int:
    """A stream the engine refused (finish_reason 'error') prints its reason; any refusal fails the run."""
    refused = [s for s in streams if s.finish_reason == "error"]
    for s in refused:
        print(f"error: stream {s.index} refused: {getattr(s, 'error', None) or 'no reason given'}", file=err)
    return EXIT_REFUSED if refused else 0


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
    if a.profile or a.profile_trace:
        from .profiling.cli import profile_run
        stats["profile"] = profile_run(a, engine, res, sys.stderr if root else _Quiet(), root)
    streams = [{"prompt_ids": [int(t) for t in s.request.prompt_ids], "output_ids": [int(t) for t in s.output_ids],
                "text": _text(tok, s.output_ids, s.request.stop_ids), "finish_reason": s.finish_reason,
                **({"error": getattr(s, "error", None) or "refused"} if s.finish_reason == "error" else {})}
               for s in res.streams]
    rc = _report_refusals(res.streams, err)
    if a.json:
        out.write(json.dumps({"streams": streams, "stats": stats}) + "\n")
        out.flush()
        return rc
    if len(reqs) == 1:
        out.write("\n")
    else:
        for i, s in enumerate(streams):
            out.write(f"--- stream {i} ({s['finish_reason']}): {s['text']!r}\n")
    ph = ", ".join(f"{k} {v:.0f} ms" for k, v in stats["phase_ms"].items())
    out.write(f"--- {plural(stats['new_tokens'], 'token')} in {stats['elapsed_s']:.2f} s ({stats['tokens_per_s']:.1f} tok/s), "
              f"{plural(stats['steps'], 'step')}, mean acceptance length {stats['mean_accept_len']:.2f}; {ph}\n")
    out.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
