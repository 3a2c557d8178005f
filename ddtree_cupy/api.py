"""The decode loop's public types, shared by every engine: requests, streams, results, finish reasons,
refusals and the per-step control / output layouts.

Both engines (``backend.NumpyEngine`` and ``engine.gpu_engine.GpuEngine``), the online loop
(``engine/loop.py``), the batch CLI and the HTTP server import these from here. The numpy reference
(``reference/loop.py``) uses the same types, so its ``DecodeLoop`` stays comparable token for token; it is
the specification of what a step decides, not the API.

Nothing here imports anything heavier than numpy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

MODES = ("ddtree", "chain", "ar")
MAX_BUDGET = 128                        # tree nodes; a verify step holds at most MAX_BUDGET + 1 rows (the root)
PHASES = ("prefill", "draft", "tree", "verify", "accept")

# Why a stream ended. 'stop': a stop id (kept in output_ids); 'length': max_new_tokens; 'context': the next
# verify round would pass max_position_embeddings; 'cancelled': its client went away (pages freed at the
# next step boundary); 'error': it could never be admitted (the reason is in ``stream.error``).
FINISH_REASONS = ("stop", "length", "context", "cancelled", "error")

# The per-step control block the host uploads before each decode step: int32 [CTRL_FIELDS, S], one column
# per stream slot (cuda_src/engine_glue.cu reads the same rows).
CTRL_FIELDS = 5
CTRL_PREFIX, CTRL_BONUS, CTRL_ACTIVE, CTRL_BUDGET, CTRL_STEP = range(CTRL_FIELDS)

# One slot's row of a step's packed output: accepted length, verify rows, then the accepted tokens (root =
# the old bonus first) and the new bonus at index n_acc.
OUT_NACC, OUT_NROWS, OUT_TOKENS = 0, 1, 2


# Sampling temperatures: 0 (greedy) or within [MIN, MAX]. Below MIN, logits / T overflow float32 on the GPU
# (and float64 in the reference near 1e-308); above MAX the distribution is uniform to float32 precision.
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4
TOP_K_LIMIT = 2 ** 31 - 1           # top_k travels as int32 to the GPU sampler


@dataclass
class Request:
    """One generation request. ``temperature <= 0`` is greedy; ``top_k = 0`` and ``top_p = 1`` disable those
    filters. ``sample_stream`` is the stream field of the Philox counter (distinct streams sharing a seed
    draw independent numbers)."""
    prompt_ids: Sequence[int]
    max_new_tokens: int = 128
    stop_ids: Tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    sample_stream: int = 0

    def validate(self, vocab_size: int, max_positions: int) -> None:
        ids = list(self.prompt_ids)
        if not ids:
            raise ValueError("request: prompt is empty (need at least one token)")
        bad = [i for i in ids if not isinstance(i, (int, np.integer)) or not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"request: prompt token ids {bad[:8]} outside the vocabulary [0, {vocab_size})")
        if len(ids) >= max_positions:
            raise ValueError(f"request: prompt has {len(ids)} tokens, the context limit is {max_positions} "
                             f"(max_position_embeddings) and at least one must remain for generation")
        if not isinstance(self.max_new_tokens, (int, np.integer)) or self.max_new_tokens < 1:
            raise ValueError(f"request: max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"request: top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= TOP_K_LIMIT:
            raise ValueError(f"request: top_k must be in [0, 2^31), got {self.top_k}")
        if not np.isfinite(self.temperature) or not (self.temperature <= 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"request: temperature must be <= 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
                             f"{MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 <= int(self.seed) < 2 ** 64:
            raise ValueError(f"request: seed must be in [0, 2^64), got {self.seed}")


@dataclass
class StreamState:
    """A stream in flight: its caches, committed length s, pending bonus and output so far."""
    index: int
    request: Request
    target_cache: object
    drafter_cache: object
    committed: int                      # s: tokens in the target cache (prompt + accepted)
    bonus: int                          # pending: chosen by the target, not yet in its cache
    output_ids: List[int] = field(default_factory=list)
    accept_lens: List[int] = field(default_factory=list)
    tree_sizes: List[int] = field(default_factory=list)
    steps: int = 0
    finish_reason: Optional[str] = None  # one of FINISH_REASONS
    error: Optional[str] = None          # finish_reason 'error': why

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def mean_accept_len(self) -> float:
        return float(np.mean(self.accept_lens)) if self.accept_lens else 0.0


@dataclass
class StepRecord:
    """What one step did: per active stream (index, accepted length, tree nodes, tokens emitted)."""
    step: int
    streams: List[Tuple[int, int, int, List[int]]]
    phase_s: Dict[str, float]


@dataclass
class GenerationResult:
    streams: List[StreamState]
    steps: int
    accept_lens: List[int]             # every (stream, step) accepted length, in step order
    tree_sizes: List[int]
    phase_s: Dict[str, float]          # seconds per phase, summed over the run
    elapsed_s: float                   # wall time of the whole run, prefill included
    decode_s: float                    # wall time of the decode steps (prefill excluded)
    budget_stats: Optional[dict] = None  # ``--budget auto``: the policy's statistics (budget.BudgetPolicy.stats)

    @property
    def new_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.streams)

    @property
    def mean_accept_len(self) -> float:
        return float(np.mean(self.accept_lens)) if self.accept_lens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def stats_dict(self) -> dict:
        return {"steps": self.steps, "new_tokens": self.new_tokens, "mean_accept_len": self.mean_accept_len,
                "tokens_per_s": self.tokens_per_s, "elapsed_s": self.elapsed_s, "decode_s": self.decode_s,
                "accept_lens": list(self.accept_lens), "tree_sizes": list(self.tree_sizes),
                "phase_ms": {k: 1e3 * v for k, v in self.phase_s.items()},
                **({"budget_policy": self.budget_stats} if self.budget_stats is not None else {})}


def emit_tokens(st: StreamState, toks: Sequence[int]) -> List[int]:
    """Append tokens to ``st.output_ids``, cutting at the first stop id (kept) or at max_new_tokens; sets
    ``st.finish_reason``. Returns the tokens appended. The one stop rule of both engines."""
    out: List[int] = []
    for t in toks:
        st.output_ids.append(int(t))
        out.append(int(t))
        if int(t) in st.request.stop_ids:
            st.finish_reason = "stop"
            break
        if len(st.output_ids) >= st.request.max_new_tokens:
            st.finish_reason = "length"
            break
    return out


class Refused(ValueError):
    """A request the loop will not run, decided at once when it is submitted. ``kind``:
    'invalid' (bad field), 'too_long' (its KV reservation can never fit), 'queue_full' (retry later),
    'shutdown' (the loop is stopping)."""

    KINDS = ("invalid", "too_long", "queue_full", "shutdown")

    def __init__(self, kind: str, message: str):
        if kind not in self.KINDS:
            raise ValueError(f"Refused: unknown kind {kind!r}")
        super().__init__(message)
        self.kind = kind
