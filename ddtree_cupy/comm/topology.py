"""The GPU interconnect read from ``nvidia-smi topo -m``: links between GPU pairs, NUMA affinity, islands.

``parse_topo_matrix(text)`` turns the matrix into a ``Topology``: per GPU pair the link word (X, NV#, PIX,
PXB, PHB, NODE, SYS), per GPU its NUMA node. ``islands()`` groups GPUs that reach each other without
crossing the inter-socket link (SYS) -- on a two-socket PCIe box, 4 + 4 GPUs. The all-reduce uses it to
decide whether a flat exchange crosses the socket link n - 1 times per GPU (one-shot) or whether a
two-level exchange (inside each island, then one exchange across) moves fewer bytes over it.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

# Link words of nvidia-smi's legend, best first. NV<k> is k bonded NVLinks.
PCIE_LINKS = ("PIX", "PXB", "PHB", "NODE", "SYS")
_ALL = ("X",) + PCIE_LINKS


@dataclass(frozen=True)
class Topology:
    gpus: Tuple[str, ...]                          # "GPU0", "GPU1", ...
    links: Tuple[Tuple[str, ...], ...]             # links[i][j]: the matrix word between GPU i and j
    numa: Tuple[Optional[int], ...]                # NUMA node of each GPU (None when not reported)

    @property
    def n(self) -> int:
        return len(self.gpus)

    def link(self, i: int, j: int) -> str:
        return self.links[i][j]

    def nvlink(self, i: int, j: int) -> bool:
        return self.links[i][j].startswith("NV")

    def crosses_sockets(self, i: int, j: int) -> bool:
        """The pair's traffic crosses the inter-socket interconnect (QPI / UPI / Infinity Fabric)."""
        return self.links[i][j] == "SYS"

    def islands(self, ranks: Optional[Sequence[int]] = None) -> List[List[int]]:
        """Groups of GPUs (of ``ranks``, default all) that reach each other without a SYS hop, each sorted,
        in the order of their lowest GPU. A box where every pair is NVLink or under one socket is one island."""
        ranks = list(range(self.n)) if ranks is None else list(ranks)
        out: List[List[int]] = []
        for g in ranks:
            for isl in out:
                if all(not self.crosses_sockets(g, h) for h in isl):
                    isl.append(g)
                    break
            else:
                out.append([g])
        return [sorted(i) for i in out]

    def two_level(self, ranks: Optional[Sequence[int]] = None) -> bool:
        """A two-level exchange pays: more than one island, all of the same size, each of >= 2 GPUs."""
        isl = self.islands(ranks)
        return len(isl) > 1 and len({len(i) for i in isl}) == 1 and len(isl[0]) >= 2

    def describe(self) -> str:
        isl = self.islands()
        kinds = sorted({self.links[i][j] for i in range(self.n) for j in range(self.n) if i != j})
        return f"{self.n} GPUs, links {'/'.join(kinds)}, islands {isl}"


_GPU_ROW = re.compile(r"^\s*(GPU\d+)\s+(.*)$")


def parse_topo_matrix(text: str) -> Topology:
    """Parse ``nvidia-smi topo -m`` output (GPU rows only; NIC rows and the legend are ignored)."""
    lines = [ln.replace("\t", " ") for ln in text.splitlines()]
    cols = next((ln.split() for ln in lines if ln.split()[:1] == ["GPU0"]), None)
    if cols is None:
        raise ValueError("nvidia-smi topo -m: no header line starting with GPU0 found")
    ngpu = 0
    while ngpu < len(cols) and re.fullmatch(r"GPU\d+", cols[ngpu]):
        ngpu += 1
    numa_col = "NUMA" in cols
    rows: Dict[int, Tuple[List[str], Optional[int]]] = {}
    for ln in lines:
        m = _GPU_ROW.match(ln)
        if not m:
            continue
        if ln.split() == cols:                               # the header itself
            continue
        name, rest = m.group(1), m.group(2).split()
        idx = int(name[3:])
        words = rest[:ngpu]
        if len(words) < ngpu:
            raise ValueError(f"nvidia-smi topo -m: row {name} has {len(words)} link words, expected {ngpu}")
        for w in words:
            if w not in _ALL and not re.fullmatch(r"NV\d+", w):
                raise ValueError(f"nvidia-smi topo -m: row {name}: unknown link word {w!r}")
        numa = None
        extra = [t for t in rest[ngpu:] if not re.fullmatch(r"NV\d+|X|PIX|PXB|PHB|NODE|SYS", t)]
        if numa_col and len(extra) >= 2 and re.fullmatch(r"\d+", extra[1]):
            numa = int(extra[1])
        rows[idx] = (words, numa)
    if sorted(rows) != list(range(ngpu)):
        raise ValueError(f"nvidia-smi topo -m: GPU rows {sorted(rows)} do not match {ngpu} GPU columns")
    links = tuple(tuple(rows[i][0]) for i in range(ngpu))
    for i in range(ngpu):
        if links[i][i] != "X":
            raise ValueError(f"nvidia-smi topo -m: GPU{i}'s own entry is {links[i][i]!r}, expected X")
        for j in range(ngpu):
            if links[i][j] != links[j][i]:
                raise ValueError(f"nvidia-smi topo -m: GPU{i}-GPU{j} is {links[i][j]} one way and "
                                 f"{links[j][i]} the other")
    return Topology(tuple(f"GPU{i}" for i in range(ngpu)), links, tuple(rows[i][1] for i in range(ngpu)))


def read_topology(timeout_s: float = 10.0) -> Optional[Topology]:
    """This machine's topology, or None where nvidia-smi is missing or fails (the caller then assumes one
    island and says so)."""
    try:
        p = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    try:
        return parse_topo_matrix(p.stdout)
    except ValueError:
        return None


def normalize_bus_id(bus: str) -> str:
    """'00000000:17:00.0' (nvidia-smi) and '0000:17:00.0' (CUDA) -> '0000:17:00.0'."""
    m = re.fullmatch(r"\s*([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])\s*", bus)
    if not m:
        raise ValueError(f"PCI bus id: cannot parse {bus!r}")
    return f"{int(m.group(1), 16):04x}:{m.group(2).lower()}:{m.group(3).lower()}.{m.group(4)}"


def island_size_of_ranks(topo: Topology, gpu_of_rank: Sequence[int]) -> int:
    """Ranks per island when the ranks' GPUs form >= 2 islands of equal size >= 2 that are contiguous rank
    ranges ([0, m), [m, 2m), ...: the two-level kernel's layout); else 0 (no two-level exchange)."""
    islands = topo.islands(list(gpu_of_rank))
    if not topo.two_level(list(gpu_of_rank)):
        return 0
    m = len(islands[0])
    rank_of = {g: r for r, g in enumerate(gpu_of_rank)}
    for isl in islands:
        ranks = sorted(rank_of[g] for g in isl)
        if ranks != list(range(ranks[0], ranks[0] + m)) or ranks[0] % m:
            return 0
    return m


def smi_bus_ids(timeout_s: float = 10.0) -> Optional[List[str]]:
    """nvidia-smi's GPU index -> normalised PCI bus id (the index space of ``topo -m``), or None."""
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    out: Dict[int, str] = {}
    try:
        for ln in p.stdout.strip().splitlines():
            i, bus = ln.split(",", 1)
            out[int(i)] = normalize_bus_id(bus)
    except ValueError:
        return None
    return [out[i] for i in sorted(out)] if sorted(out) == list(range(len(out))) else None
