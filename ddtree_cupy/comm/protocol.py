"""The peer-to-peer all-reduce protocol of ``cuda_src/allreduce.cuh``, as an executable numpy model.

One object per rank holds what the IPC buffer holds (flags, per-block epoch counters, two parity slots of
input data, two of two-shot results). ``block_program`` is the kernel's per-block code written as a
generator: it yields wherever the kernel spins on a peer's flag, so a scheduler can interleave the blocks
of all ranks in any order (``run_interleaved``: a seeded random scheduler; ``run_threads``: one OS thread
per rank) and the tests check that every rank gets the rank-ordered sum, bit for bit, over thousands of
replays with the epoch counters wrapping. The constants and the plan (``plan_grid``) are the ones the
GPU wrapper uses, so the model and the kernel launch the same grids.
"""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence

import numpy as np

from ..bf16 import bf16_bits_to_f32, to_bf16_bits

MAX_RANKS = 8             # AR_MAX_RANKS
MAX_BLOCKS = 128          # AR_MAX_BLOCKS
THREADS = 256             # AR_THREADS
HEADER_BYTES = 16384      # AR_HEADER_BYTES
MAX_FUSED_H = 8 * 4 * THREADS   # AR_MAXV vectors of 8 per thread
PLAIN_UNIT = 2048         # elements per unit of a plain (unfused) all-reduce: T = 1 x 7168 spreads over 4 blocks

ALGOS = ("oneshot", "twoshot", "twolevel")     # template index 0, 1, 2 of p2p_allreduce_kernel


class PeerTimeout(RuntimeError):
    """A peer never published its arrival within the bounded wait."""


def buffer_bytes(cap: int) -> int:
    """Bytes of one rank's IPC allocation for ``cap`` elements per slot (allreduce.cuh's layout)."""
    return HEADER_BYTES + 2 * 2 * int(cap) * 2 + 2 * int(cap) * 4   # data, result [2][cap] bf16; isum fp32


def plan_grid(N: int, unit: int) -> int:
    """Blocks of one call: one per unit up to MAX_BLOCKS (grid-stride beyond). Depends only on the payload,
    so every rank runs the same grid and the per-block epoch counters stay equal across ranks."""
    if N <= 0 or unit <= 0 or N % 8 or unit % 8:
        raise ValueError(f"all-reduce plan: N = {N} and unit = {unit} must be positive multiples of 8")
    return int(min(MAX_BLOCKS, -(-N // unit)))


def _ahead_or_equal(flag: int, e: int, bits: int) -> bool:
    """(int)(flag - e) >= 0 in ``bits``-bit arithmetic (the kernel: 32)."""
    d = (flag - e) % (1 << bits)
    return d < (1 << (bits - 1))


class RankBuffers:
    """What one rank's IPC allocation holds; peers read and write it directly (the model's 'peer memory')."""

    def __init__(self, cap: int, epoch_bits: int = 32):
        self.cap, self.bits = int(cap), int(epoch_bits)
        self.flags1 = np.zeros((MAX_BLOCKS, MAX_RANKS), np.int64)
        self.flags2 = np.zeros((MAX_BLOCKS, MAX_RANKS), np.int64)
        self.epoch1 = np.zeros(MAX_BLOCKS, np.int64)
        self.epoch2 = np.zeros(MAX_BLOCKS, np.int64)
        self.data = np.zeros((2, self.cap), np.uint16)
        self.result = np.zeros((2, self.cap), np.uint16)
        self.isum = np.zeros((2, self.cap), np.float32)

    def next_epoch(self, v: int) -> int:
        return (int(v) + 1) % (1 << self.bits)


@dataclass
class Call:
    """One all-reduce call of one rank (the kernel's arguments)."""
    x: np.ndarray                      # [N] uint16, this rank's partial sum
    out: np.ndarray                    # [N] uint16 (may be x)
    unit: int
    algo: str = "oneshot"
    residual: Optional[np.ndarray] = None     # fused: [N / unit, unit] uint16, updated in place
    weight: Optional[np.ndarray] = None       # fused: [unit] uint16
    normed: Optional[np.ndarray] = None       # fused: [N / unit, unit] uint16
    eps: float = 1e-6
    island: int = 0                           # two-level: ranks per island (rank ranges of this size)


def _sum_rank_order(parts: Sequence[np.ndarray]) -> np.ndarray:
    """fp32 sum in rank order 0..n-1 of bf16 vectors, rounded once to bf16 (ar_sum8 + ar_round8)."""
    acc = np.zeros(parts[0].shape, np.float32)
    for p in parts:
        acc = acc + bf16_bits_to_f32(p)
    return to_bf16_bits(acc)


def add_norm_rows(sums: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float):
    """(h, normed) of the fused tail for bf16 rows: h = bf16(sum + residual), normed = bf16(w * h * rstd),
    rstd in float64 (a reference: the kernel's rsqrtf differs in the last bits of rstd only)."""
    h = to_bf16_bits(bf16_bits_to_f32(sums) + bf16_bits_to_f32(residual))
    hf = bf16_bits_to_f32(h).astype(np.float64)
    rstd = 1.0 / np.sqrt((hf * hf).mean(axis=-1, keepdims=True) + eps)
    normed = to_bf16_bits((bf16_bits_to_f32(weight).astype(np.float64) * (hf * rstd)).astype(np.float32))
    return h, normed


def _sum_f32(parts: Sequence[np.ndarray]) -> np.ndarray:
    """fp32 sum in the given order of bf16 vectors, not rounded (a two-level island sum)."""
    acc = np.zeros(parts[0].shape, np.float32)
    for p in parts:
        acc = acc + bf16_bits_to_f32(p)
    return acc


def block_program(bufs: Sequence[RankBuffers], rank: int, blk: int, nblk: int, call: Call,
                  max_spins: int = 100000) -> Iterator[None]:
    """Block ``blk`` of rank ``rank`` running one call (ar_allreduce_item). Yields while it waits."""
    n = len(bufs)
    me = bufs[rank]
    x, N, unit = call.x.reshape(-1), call.x.size, call.unit
    algo = call.algo
    if algo not in ALGOS:
        raise ValueError(f"algo: {algo!r}")
    phase2 = algo != "oneshot"
    m = call.island if algo == "twolevel" else n
    if algo == "twolevel" and not (2 <= m < n and n % m == 0):
        raise ValueError(f"two-level: island size {m} must divide n = {n} into >= 2 islands")
    k, i0 = n // m, (rank // m) * m
    wait1 = range(i0, i0 + m) if algo == "twolevel" else range(n)
    wait2 = [j * m + rank % m for j in range(k)] if algo == "twolevel" else range(n)
    e1 = me.next_epoch(me.epoch1[blk])
    e2 = me.next_epoch(me.epoch2[blk]) if phase2 else 0
    slot, rslot = e1 & 1, e2 & 1
    units = range(blk, -(-N // unit), nblk)

    def span(u):
        return slice(u * unit, min((u + 1) * unit, N))

    for u in units:                                   # phase 1: publish the input in this rank's slot
        me.data[slot, span(u)] = x[span(u)]
        yield

    def barrier(which: int, e: int, wait):
        for s in range(n):                             # publish e into every peer's word for (blk, me)
            (bufs[s].flags1 if which == 1 else bufs[s].flags2)[blk, rank] = e
        mine = me.flags1 if which == 1 else me.flags2
        for s in wait:
            spins = 0
            while not _ahead_or_equal(int(mine[blk, s]), e, me.bits):
                spins += 1
                if spins > max_spins:
                    raise PeerTimeout(f"p2p all-reduce: rank {rank} block {blk} waited for rank {s} at epoch {e} "
                                      f"(phase {which}); it never arrived")
                yield

    yield from barrier(1, e1, wait1)
    if phase2:
        for u in units:
            if algo == "twoshot" and u % n == rank:
                me.result[rslot, span(u)] = _sum_rank_order([b.data[slot, span(u)] for b in bufs])
            elif algo == "twolevel":
                me.isum[rslot, span(u)] = _sum_f32([bufs[s].data[slot, span(u)] for s in range(i0, i0 + m)])
            yield
        yield from barrier(2, e2, wait2)
    fused = call.residual is not None
    out = call.out.reshape(-1)
    for u in units:
        if algo == "twoshot":
            s = bufs[u % n].result[rslot, span(u)].copy()
        elif algo == "twolevel":
            acc = np.zeros(span(u).stop - span(u).start, np.float32)
            for j in wait2:                            # island order
                acc = acc + bufs[j].isum[rslot, span(u)]
            s = to_bf16_bits(acc)
        else:
            s = _sum_rank_order([b.data[slot, span(u)] for b in bufs])
        if fused:
            h, nrm = add_norm_rows(s, call.residual[u], call.weight, call.eps)
            call.residual[u] = h
            call.normed[u] = nrm
        else:
            out[span(u)] = s
        yield
    me.epoch1[blk] = e1
    if phase2:
        me.epoch2[blk] = e2


def run_interleaved(bufs: Sequence[RankBuffers], calls: Sequence[Call], rng: random.Random,
                    max_spins: int = 100000, absent: Sequence[int] = ()) -> None:
    """Run one collective (calls[r] on rank r) with every (rank, block) program interleaved at random.
    ``absent``: ranks that never start (a peer that died): the others end with PeerTimeout."""
    progs = []
    for r, c in enumerate(calls):
        if r in absent:
            continue
        G = plan_grid(c.x.size, c.unit)
        progs += [block_program(bufs, r, b, G, c, max_spins) for b in range(G)]
    while progs:
        i = rng.randrange(len(progs))
        try:
            next(progs[i])
        except StopIteration:
            progs.pop(i)


def run_threads(bufs: Sequence[RankBuffers], calls_per_rank: Callable[[int, int], Call], replays: int,
                seed: int = 0, max_spins: int = 10 ** 7) -> List[Optional[BaseException]]:
    """Every rank on its own OS thread replaying ``replays`` calls back to back (``calls_per_rank(rank, i)``),
    each rank's blocks interleaved at random; no host barrier between calls. Returns each rank's error."""
    n = len(bufs)
    errors: List[Optional[BaseException]] = [None] * n

    def rank_main(r: int):
        rng = random.Random(seed * 1000 + r)
        try:
            for i in range(replays):
                c = calls_per_rank(r, i)
                G = plan_grid(c.x.size, c.unit)
                progs = [block_program(bufs, r, b, G, c, max_spins) for b in range(G)]
                while progs:
                    k = rng.randrange(len(progs))
                    try:
                        next(progs[k])
                    except StopIteration:
                        progs.pop(k)
                    if rng.random() < 0.02:
                        threading.Event().wait(0)      # let another rank's thread run
        except BaseException as e:     # noqa: BLE001 - reported to the test
            errors[r] = e
    ts = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return errors


def reference_sum(parts: Sequence[np.ndarray], island: int = 0) -> np.ndarray:
    """What every rank must hold: the rank-ordered fp32 sum of the bf16 parts, rounded to bf16; with
    ``island`` (two-level) the fp32 sum of the islands' fp32 sums (each in rank order), in island order."""
    flat = [np.asarray(p).reshape(-1) for p in parts]
    if not island:
        return _sum_rank_order(flat).reshape(np.asarray(parts[0]).shape)
    acc = np.zeros(flat[0].shape, np.float32)
    for j in range(0, len(flat), island):
        acc = acc + _sum_f32(flat[j:j + island])
    return to_bf16_bits(acc).reshape(np.asarray(parts[0]).shape)

