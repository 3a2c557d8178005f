"""Analysis of the bulk-copy MoE GEMMs' timeline build (numpy only; docs/MOE.md "Profiling build").

The timeline build of ``moe_gemm_bulk`` (cuda_src/moe_bulk.cu with -DDDT_MOE_TIMELINE, moe.SPEC_BULK_TIMELINE)
writes one record per block (blockIdx.x < moe.TL_BLOCKS) of SM cycle stamps, layout in the .cu file's "Timeline
build" comment and in ``Layout`` below. This module turns such a buffer into

* per warp role (consumer / producer) the time spent waiting on the full / empty barriers vs working;
* per stage the copy latency (producer done issuing -> the full barrier completes as the first consumer sees it),
  measured where a consumer was already waiting (otherwise only a bound);
* the split of the consumers' full-barrier waits by cause (counterfactual: how much of a wait would vanish had the
  producer armed the stage when this warp freed the slot): the producer sat in its empty wait behind slower
  consumers, the producer was still busy with earlier stages, or the copy latency itself ("in flight");
* the spread between the first and the last consumer warp to release a stage, and which K slice is last;
* unit-boundary gaps (last release of a unit -> first full wait of the next: epilogue + K-split reduction) and
  the full-barrier wait of a unit's first stage against the others;
* a coarse text timeline of one block.

Times: each block's cycle stamps are put on one ns axis with its own cycles-per-ns, from the (globaltimer, clock64)
pairs every warp stores at its start and end (``ghz`` overrides it: the globaltimer may tick coarsely).

    python -m bench.moe --timeline 256 8          # runs the kernels, prints ``report(analyse(...))``
    python -m bench.moe_timeline FILE.npz         # the analysis of a saved run again
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

MAGIC = 0x544C424B
BLOCK_HEADER, WARP_HEADER = 16, 8
# block header fields
B_MAGIC, B_SMID, B_UNITS, B_NST_UNIT, B_NCW, B_NST, B_SS, B_CHUNKS, B_SORT0 = range(9)
# B_SORT0 .. B_SORT0 + 5: thread 0's clock at the shared-memory sort's phase ends (G = 0; -1 otherwise)
SORT_PHASES = ("ids loaded", "counted", "scanned", "chunks cut", "ranked")
# warp header fields
W_GT0, W_CLK0, W_PDL, W_SORT, W_GT1, W_CLK1, W_STAGES, W_UNITS = range(8)
# stage event indices: consumer (before full wait, after it, released) / producer (before empty wait, after it,
# issued)
E_BEFORE, E_AFTER, E_DONE = 0, 1, 2
ABSENT = -1
DEFAULT_GHZ = 1.98      # H200 SM boost clock, used when a block's globaltimer span is too short to fit a rate


@dataclass(frozen=True)
class Layout:
    """One block's record: nw warps (the producer last), ``stages`` / ``units`` recorded per warp."""
    nw: int
    stages: int = 128
    units: int = 32
    blocks: int = 1024

    @property
    def block_words(self) -> int:
        return BLOCK_HEADER + self.nw * WARP_HEADER + self.nw * self.stages * 3 + self.nw * self.units * 2


@dataclass
class Record:
    layout: Layout
    bh: np.ndarray       # [B, 8] block headers
    wh: np.ndarray       # [B, nw, 8] warp headers (raw)
    se: np.ndarray       # [B, nw, S, 3] stage events (cycles, -1 = absent)
    ue: np.ndarray       # [B, nw, U, 2] unit events (cycles)
    valid: np.ndarray    # [B] bool: the block wrote its record


def parse(buf, layout: Layout) -> Record:
    """Split a timeline buffer (1-D int64, >= blocks x block_words) into its parts."""
    a = np.asarray(buf)
    if a.dtype != np.int64 or a.ndim != 1:
        raise ValueError(f"buf: must be a 1-D int64 array, got {a.dtype} {a.shape}")
    L, B = layout, layout.blocks
    if a.size < B * L.block_words:
        raise ValueError(f"buf: {a.size} words < {B} blocks x {L.block_words}")
    a = a[:B * L.block_words].reshape(B, L.block_words)
    o = BLOCK_HEADER
    bh = a[:, :o]
    wh = a[:, o:o + L.nw * WARP_HEADER].reshape(B, L.nw, WARP_HEADER)
    o += L.nw * WARP_HEADER
    se = a[:, o:o + L.nw * L.stages * 3].reshape(B, L.nw, L.stages, 3)
    o += L.nw * L.stages * 3
    ue = a[:, o:o + L.nw * L.units * 2].reshape(B, L.nw, L.units, 2)
    valid = bh[:, B_MAGIC] == MAGIC
    bad = valid & (bh[:, B_NCW] != L.nw - 1)
    if bad.any():
        raise ValueError(f"buf: block {int(np.argmax(bad))} has {int(bh[bad][0, B_NCW])} consumer warps, "
                         f"the layout {L.nw - 1}")
    return Record(L, bh, wh, se, ue, valid)


def check_invariants(rec: Record) -> List[str]:
    """What a correct record must satisfy (empty list = all hold): every valid block's warps have start <= sort <=
    end; each recorded stage has all three events, in order, and stages follow each other; the counts match the
    block header; unit events sit between their units' stages; the producer's empty wait ends after every
    consumer released the stage's previous use, and no consumer passes a full wait before the producer armed it."""
    L, out = rec.layout, []
    for b in np.nonzero(rec.valid)[0]:
        bh, wh = rec.bh[b], rec.wh[b]
        n_units, nstu, nst = int(bh[B_UNITS]), int(bh[B_NST_UNIT]), int(bh[B_NST])
        n_stages = n_units * nstu
        ns = min(n_stages, L.stages)
        for w in range(L.nw):
            role = "producer" if w == L.nw - 1 else f"consumer {w}"
            where = f"block {b} {role}"
            h = wh[w]
            if (h[[W_GT0, W_CLK0, W_SORT, W_GT1, W_CLK1]] == ABSENT).any():
                out.append(f"{where}: start / sort / end stamp missing")
                continue
            if not h[W_CLK0] <= h[W_SORT] <= h[W_CLK1] or h[W_GT1] < h[W_GT0]:
                out.append(f"{where}: start {h[W_CLK0]} sort {h[W_SORT]} end {h[W_CLK1]} not in order")
            if h[W_PDL] != ABSENT and not h[W_CLK0] <= h[W_PDL] <= h[W_CLK1]:
                out.append(f"{where}: PDL stamp {h[W_PDL]} outside the warp's life")
            if h[W_STAGES] != n_stages:
                out.append(f"{where}: {h[W_STAGES]} stages done, header says {n_units} x {nstu}")
            ev = rec.se[b, w]
            rec_ev, rest = ev[:ns], ev[ns:]
            if (rec_ev == ABSENT).any():
                out.append(f"{where}: a recorded stage lacks an event (stage {int(np.argmax((rec_ev == ABSENT).any(1)))})")
                continue
            if (rest != ABSENT).any():
                out.append(f"{where}: events past the {ns} recorded stages")
            seq = rec_ev.reshape(-1)
            if (np.diff(seq) < 0).any():
                out.append(f"{where}: stage events not monotone (first at stage {int(np.argmax(np.diff(seq) < 0)) // 3})")
            if ns and not (h[W_SORT] <= seq[0] and seq[-1] <= h[W_CLK1]):
                out.append(f"{where}: stage events outside sort .. end")
            if w == L.nw - 1:
                continue
            if h[W_UNITS] != n_units:
                out.append(f"{where}: {h[W_UNITS]} units done, header says {n_units}")
            nu = min(n_units, L.units)
            ue = rec.ue[b, w]
            if (ue[:nu] == ABSENT).any() or (ue[nu:] != ABSENT).any():
                out.append(f"{where}: unit events missing or past the {nu} recorded units")
                continue
            for u in range(nu):
                s_last, s_next = (u + 1) * nstu - 1, (u + 1) * nstu
                if not ue[u, 0] <= ue[u, 1]:
                    out.append(f"{where}: unit {u} epilogue ends before it starts")
                if s_last < ns and ue[u, 0] < ev[s_last, E_DONE]:
                    out.append(f"{where}: unit {u} epilogue starts before its last stage is released")
                if s_next < ns and ue[u, 1] > ev[s_next, E_BEFORE]:
                    out.append(f"{where}: unit {u} epilogue ends after the next unit's first wait")
        # cross-warp causality (one SM clock for the whole block)
        cons, prod = rec.se[b, :L.nw - 1, :ns], rec.se[b, L.nw - 1, :ns]
        if ns and (cons != ABSENT).all() and (prod != ABSENT).all():
            early = np.nonzero(cons[:, :, E_AFTER].min(0) < prod[:, E_AFTER])[0]
            if early.size:
                out.append(f"block {b}: a consumer passed the full wait of stage {int(early[0])} before the "
                           "producer armed it")
            if ns > nst:
                rel = cons[:, :ns - nst, E_DONE].max(0)
                late = np.nonzero(prod[nst:, E_AFTER] < rel)[0]
                if late.size:
                    out.append(f"block {b}: the producer passed the empty wait of stage {int(late[0]) + nst} before "
                               "the last consumer released its previous use")
    return out


@dataclass
class Times:
    """A record's stamps in ns on one axis (0 = the earliest recorded warp start); NaN = absent."""
    rec: Record
    start: np.ndarray    # [B, nw]
    pdl: np.ndarray
    sort: np.ndarray
    end: np.ndarray
    se: np.ndarray       # [B, nw, S, 3]
    ue: np.ndarray       # [B, nw, U, 2]
    ghz: np.ndarray      # [B] cycles per ns used


def to_ns(rec: Record, ghz: Optional[float] = None, min_span_ns: float = 2000.0) -> Times:
    """Cycles -> ns per block: anchored at the block's earliest warp start (globaltimer, clock64), the rate from
    that start to the latest warp end, unless ``ghz`` is given or the globaltimer span is < ``min_span_ns``
    (then ``DEFAULT_GHZ``)."""
    B, nw = rec.wh.shape[:2]
    f = lambda shape: np.full(shape, np.nan)
    start, pdl, sort, end = f((B, nw)), f((B, nw)), f((B, nw)), f((B, nw))
    se, ue, rate = f(rec.se.shape), f(rec.ue.shape), f(B)
    anchors = []
    for b in np.nonzero(rec.valid)[0]:
        h = rec.wh[b]
        i0, i1 = int(np.argmin(h[:, W_CLK0])), int(np.argmax(h[:, W_CLK1]))
        span_gt = float(h[i1, W_GT1] - h[i0, W_GT0])
        span_clk = float(h[i1, W_CLK1] - h[i0, W_CLK0])
        r = ghz if ghz is not None else (span_clk / span_gt if span_gt >= min_span_ns else DEFAULT_GHZ)
        rate[b] = r
        anchors.append((b, int(h[i0, W_GT0]), int(h[i0, W_CLK0])))
    if not anchors:
        raise ValueError("rec: no block wrote its record")
    t0 = min(a[1] for a in anchors)

    def conv(x, gt, c0, r):
        x = x.astype(np.float64)
        return np.where(x == ABSENT, np.nan, (gt - t0) + (x - c0) / r)
    for b, gt, c0 in anchors:
        r, h = rate[b], rec.wh[b]
        start[b], pdl[b], sort[b], end[b] = (conv(h[:, i], gt, c0, r) for i in (W_CLK0, W_PDL, W_SORT, W_CLK1))
        se[b], ue[b] = conv(rec.se[b], gt, c0, r), conv(rec.ue[b], gt, c0, r)
    return Times(rec, start, pdl, sort, end, se, ue, rate)


def _pct(x, q=(50, 90)):
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return dict(n=0, mean=float("nan"), **{f"p{p}": float("nan") for p in q})
    return dict(n=int(x.size), mean=float(x.mean()), **{f"p{p}": float(np.percentile(x, p)) for p in q})


def analyse(rec: Record, ghz: Optional[float] = None, wait_eps_ns: float = 20.0) -> Dict:
    """The figures listed in the module docstring (ns), as a dict (``report`` prints it). ``wait_eps_ns``: a
    full wait shorter than this counts as "did not wait" (the consumer found the stage complete)."""
    tm = to_ns(rec, ghz)
    L = rec.layout
    nc = L.nw - 1
    roles = {k: dict(life=0.0, prologue=0.0, wait=0.0, work=0.0, epilogue=0.0, other=0.0)
             for k in ("consumer", "producer")}
    copy_lat, copy_bound, spread, last_kw = [], [], [], []
    full_wait, first_wait, later_wait = [], [], []
    by_pos: Dict[int, List[float]] = {}
    split = dict(producer_in_empty_wait=0.0, producer_elsewhere=0.0, in_flight=0.0)
    boundary, epi = [], []
    prod_empty, prod_issue = [], []
    blocks = np.nonzero(rec.valid)[0]
    for b in blocks:
        nstu, n_units, nst = int(rec.bh[b, B_NST_UNIT]), int(rec.bh[b, B_UNITS]), int(rec.bh[b, B_NST])
        ns = min(n_units * nstu, L.stages)
        nu = min(n_units, L.units)
        se = tm.se[b, :, :ns]
        c, p = se[:nc], se[nc]
        for w in range(L.nw):
            r = roles["producer" if w == nc else "consumer"]
            r["life"] += tm.end[b, w] - tm.start[b, w]
            r["prologue"] += tm.sort[b, w] - tm.start[b, w]
            ev = se[w]
            r["wait"] += np.nansum(ev[:, E_AFTER] - ev[:, E_BEFORE])
            r["work"] += np.nansum(ev[:, E_DONE] - ev[:, E_AFTER])
            if w < nc:
                r["epilogue"] += np.nansum(tm.ue[b, w, :nu, 1] - tm.ue[b, w, :nu, 0])
        if ns == 0:
            continue
        prod_empty.extend(p[:, E_AFTER] - p[:, E_BEFORE])
        prod_issue.extend(p[:, E_DONE] - p[:, E_AFTER])
        # copy latency: producer done issuing -> the first consumer through the full wait; exact where that
        # consumer was waiting when it completed, else an upper bound
        first = np.nanargmin(c[:, :, E_AFTER], axis=0)
        w1 = c[first, np.arange(ns), E_AFTER]
        waited = (w1 - c[first, np.arange(ns), E_BEFORE]) > wait_eps_ns
        lat = w1 - p[:, E_DONE]
        copy_lat.extend(lat[waited])
        copy_bound.extend(lat[~waited])
        rel = c[:, :, E_DONE]
        spr = np.nanmax(rel, 0) - np.nanmin(rel, 0)
        spread.extend(spr)
        last_kw.extend(np.nanargmax(rel, 0)[spr > wait_eps_ns])     # (ties name no warp)
        # the consumers' full waits, split by what the producer was doing meanwhile
        for w in range(nc):
            a0, a1 = c[w, :, E_BEFORE], c[w, :, E_AFTER]
            full_wait.extend(a1 - a0)
            pos = np.arange(ns) % nstu
            first_wait.extend((a1 - a0)[pos == 0])
            later_wait.extend((a1 - a0)[pos != 0])
            for q in range(min(nstu, ns)):
                by_pos.setdefault(q, []).extend((a1 - a0)[pos == q])
            # Counterfactual split of the wait W = a1 - a0. r = when this warp freed the slot (its release of the
            # stage's previous use, it - nst; the first nst stages: a0). Had the producer armed the stage at r, the
            # copies would have had a0 - r more time. Its lateness e1 - r is "in the empty wait" for the part
            # after max(e0, r) (behind slower consumers of the previous use) and "elsewhere" before (still busy
            # with earlier stages); the wait is explained by the empty-wait part first, then by the other, and
            # the rest is copy latency the ring did not cover ("in flight"). (Measuring what the producer did
            # *during* the wait instead would call a gated-late issue "in flight" whenever the gating ended
            # before this warp started waiting.)
            e0, e1 = p[:, E_BEFORE], p[:, E_AFTER]
            idx = np.arange(ns)
            r = np.where(idx >= nst, c[w, np.maximum(idx - nst, 0), E_DONE], a0)
            e0r = np.maximum(e0, r)
            gate = np.clip(e1 - e0r, 0, None)
            late = np.clip(e0r - r, 0, None)
            W = np.clip(a1 - a0, 0, None)
            g = np.minimum(W, gate)
            e = np.minimum(W - g, late)
            split["producer_in_empty_wait"] += np.nansum(g)
            split["producer_elsewhere"] += np.nansum(e)
            split["in_flight"] += np.nansum(W - g - e)
            # unit boundary: last release of unit u -> first full wait of unit u + 1 (epilogue, reduction, loop)
            for u in range(nu):
                s_last, s_next = (u + 1) * nstu - 1, (u + 1) * nstu
                if s_next < ns:
                    boundary.append(c[w, s_next, E_BEFORE] - c[w, s_last, E_DONE])
                epi.append(tm.ue[b, w, u, 1] - tm.ue[b, w, u, 0])
    for r in roles.values():
        r["other"] = r["life"] - r["prologue"] - r["wait"] - r["work"] - r["epilogue"]
    kw_hist = np.bincount(np.asarray(last_kw, dtype=np.int64), minlength=nc).tolist() if last_kw else [0] * nc
    # the sort's phases (G = 0): kernel start -> sort entry, then each phase, ns per block
    sort_phases = {}
    marks = rec.bh[blocks, B_SORT0:B_SORT0 + 6].astype(np.float64)
    if blocks.size and (marks >= 0).all():
        clk0 = np.array([np.nanmin(rec.wh[b, :, W_CLK0]) for b in blocks], dtype=np.float64)
        rate = tm.ghz[blocks]
        sort_phases["start -> sort"] = _pct((marks[:, 0] - clk0) / rate)
        for k, name in enumerate(SORT_PHASES):
            sort_phases[name] = _pct((marks[:, k + 1] - marks[:, k]) / rate)
    return dict(blocks=int(blocks.size), ghz=_pct(tm.ghz[blocks]), roles=roles, sort_phases=sort_phases,
                copy_latency=_pct(copy_lat), copy_latency_bound=_pct(copy_bound),
                release_spread=_pct(spread), last_release_warp=kw_hist,
                full_wait=_pct(full_wait), full_wait_unit_first_stage=_pct(first_wait),
                full_wait_other_stages=_pct(later_wait), full_wait_split=split,
                full_wait_by_position=[float(np.nanmean(by_pos[q])) for q in sorted(by_pos)],
                producer_empty_wait=_pct(prod_empty), producer_issue=_pct(prod_issue),
                unit_boundary_gap=_pct(boundary), epilogue=_pct(epi),
                kernel_span_ns=float(np.nanmax(tm.end[blocks]) - np.nanmin(tm.start[blocks])),
                times=tm)


def text_timeline(tm: Times, block: int, width: int = 100) -> str:
    """One block, one row per warp: '.' waiting on a barrier (full: consumers, empty: producer), '#' working (a
    consumer's stage arithmetic, the producer's issue), 'E' epilogue, 'p' prologue (start -> routing ready), '-'
    anything else in the warp's life; one column = the block's span / width."""
    rec, L = tm.rec, tm.rec.layout
    if not rec.valid[block]:
        raise ValueError(f"block: {block} wrote no record")
    t_lo, t_hi = np.nanmin(tm.start[block]), np.nanmax(tm.end[block])
    dt = max((t_hi - t_lo) / width, 1e-9)
    rows = []
    for w in range(L.nw):
        cover = {ch: np.zeros(width) for ch in "-p.#E"}

        def add(ch, a, z):
            if not (np.isfinite(a) and np.isfinite(z)) or z <= a:
                return
            i0, i1 = (a - t_lo) / dt, (z - t_lo) / dt
            for i in range(max(int(i0), 0), min(int(np.ceil(i1)), width)):
                cover[ch][i] += min(i1, i + 1) - max(i0, i)
        add("-", tm.start[block, w], tm.end[block, w])
        add("p", tm.start[block, w], tm.sort[block, w])
        for e in tm.se[block, w]:
            add(".", e[E_BEFORE], e[E_AFTER])
            add("#", e[E_AFTER], e[E_DONE])
        if w < L.nw - 1:
            for e in tm.ue[block, w]:
                add("E", e[0], e[1])
        # the '-' background minus what the specific events cover
        cover["-"] -= cover["p"] + cover["."] + cover["#"] + cover["E"]
        line = []
        for i in range(width):
            best = max("-p.#E", key=lambda ch: cover[ch][i])
            line.append(best if cover[best][i] > 0.05 else " ")
        name = "prod" if w == L.nw - 1 else f"c{w:<3d}"
        rows.append(f"{name} |{''.join(line)}|")
    rows.append(f"      0 .. {t_hi - t_lo:.0f} ns from {t_lo:.0f} ns, {dt:.0f} ns per column")
    return "\n".join(rows)


def report(res: Dict, block: Optional[int] = None, width: int = 100) -> str:
    """The analysis as text (and the timeline of ``block``: None = the recorded block with the most stages)."""
    f = lambda d: (f"n={d['n']} mean {d['mean']:.0f} p50 {d['p50']:.0f} p90 {d['p90']:.0f} ns" if d["n"]
                   else "n=0")
    out = [f"blocks recorded {res['blocks']}, kernel span {res['kernel_span_ns']:.0f} ns, "
           f"clock {res['ghz']['mean']:.3f} GHz (cycles per ns)"]
    for role, r in res["roles"].items():
        life = r["life"] if r["life"] > 0 else float("nan")
        wait = "full" if role == "consumer" else "empty"
        out.append(f"{role:8s}: of its life, prologue {100 * r['prologue'] / life:4.1f}%, {wait}-barrier wait "
                   f"{100 * r['wait'] / life:4.1f}%, work {100 * r['work'] / life:4.1f}%, epilogue "
                   f"{100 * r['epilogue'] / life:4.1f}%, other {100 * r['other'] / life:4.1f}%")
    sp = res["full_wait_split"]
    tot = sum(sp.values()) or float("nan")
    out += [f"consumer full wait per stage: {f(res['full_wait'])}",
            f"   a unit's first stage: {f(res['full_wait_unit_first_stage'])}",
            f"   its other stages:     {f(res['full_wait_other_stages'])}",
            "   mean by stage position in the unit: " + " ".join(f"{v:.0f}" for v in res["full_wait_by_position"]),
            f"   explained by the producer arming the stage after this warp freed its slot: while in its empty "
            f"wait (behind slower consumers) {100 * sp['producer_in_empty_wait'] / tot:.0f}%, while elsewhere "
            f"(earlier stages) {100 * sp['producer_elsewhere'] / tot:.0f}%; the rest, copy latency the ring did not "
            f"cover, {100 * sp['in_flight'] / tot:.0f}%",
            f"copy latency (issued -> first consumer through, it was waiting): {f(res['copy_latency'])}",
            f"   (upper bounds, no consumer waiting: {f(res['copy_latency_bound'])})",
            f"producer empty wait per stage: {f(res['producer_empty_wait'])}; issue: {f(res['producer_issue'])}",
            f"release spread (first -> last consumer warp of a stage): {f(res['release_spread'])}; last to release "
            f"(stages with a spread), by consumer warp: {res['last_release_warp']}",
            f"unit boundary (last release -> next unit's first wait): {f(res['unit_boundary_gap'])}; epilogue "
            f"{f(res['epilogue'])}"]
    if res.get("sort_phases"):
        out.append("sort phases, p50 / p90 ns per block: " + ", ".join(
            f"{k} {d['p50']:.0f} / {d['p90']:.0f}" for k, d in res["sort_phases"].items()))
    tm = res["times"]
    if block is None:
        blocks = np.nonzero(tm.rec.valid)[0]
        if blocks.size:
            block = int(blocks[np.argmax(tm.rec.bh[blocks, B_UNITS])])
    if block is not None:
        out.append(f"block {block} (SM {int(tm.rec.bh[block, B_SMID])}, {int(tm.rec.bh[block, B_UNITS])} units x "
                   f"{int(tm.rec.bh[block, B_NST_UNIT])} stages; '.' barrier wait, '#' work, 'E' epilogue, "
                   f"'p' prologue):")
        out.append(text_timeline(tm, block, width))
    return "\n".join(out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m bench.moe_timeline FILE.npz  (written by python -m bench.moe --timeline)")
        return 2
    z = np.load(argv[0])
    for key in [k for k in z.files if k.startswith("buf_")]:
        name = key[4:]
        nw, s, u, bl = (int(v) for v in z[f"layout_{name}"])
        rec = parse(z[key], Layout(nw, s, u, bl))
        print(f"== {name}")
        print(report(analyse(rec)))
        bad = check_invariants(rec)
        print(f"invariants: {'all hold' if not bad else '; '.join(bad[:5])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
