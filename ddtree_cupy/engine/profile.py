"""Step profiling: CUDA-event phase timing and NVTX ranges.

``PhaseTimer`` marks phase boundaries on the engine's stream with CUDA events (eager mode only: a graph
replay is one opaque launch, so graphs are timed as a whole) and pushes an NVTX range per phase, so an
``nsys profile`` of an eager run shows draft / tree / verify / accept per step. ``NullTimer`` does nothing
(graph capture, and runs that do not profile).

    t = PhaseTimer(stream)
    t.mark("draft"); ...; t.mark("tree"); ...; t.stop()     # enqueue only, no sync
    t.collect(totals)                                         # syncs once, adds seconds per phase
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

try:                                   # NVTX needs libnvToolsExt; profiling is optional
    from cupy.cuda import nvtx as _nvtx
except Exception:                      # pragma: no cover - depends on the CuPy build
    _nvtx = None


def nvtx_push(name: str) -> None:
    if _nvtx is not None:
        try:
            _nvtx.RangePush(name)
        except Exception:              # pragma: no cover
            pass


def nvtx_pop() -> None:
    if _nvtx is not None:
        try:
            _nvtx.RangePop()
        except Exception:              # pragma: no cover
            pass


class NullTimer:
    enabled = False

    def mark(self, name: str) -> None:
        pass

    def stop(self) -> None:
        pass

    def collect(self, totals: Dict[str, float]) -> None:
        pass


class PhaseTimer:
    """Events at phase starts; ``stop`` closes the last phase. Times are GPU times between the events."""
    enabled = True

    def __init__(self, stream=None, nvtx: bool = True):
        self.stream = stream
        self.nvtx = nvtx
        self._marks: List[Tuple[str, object]] = []
        self._open = False

    def _event(self):
        import cupy
        ev = cupy.cuda.Event()
        ev.record(self.stream)
        return ev

    def mark(self, name: str) -> None:
        if self.nvtx and self._open:
            nvtx_pop()
        self._marks.append((name, self._event()))
        if self.nvtx:
            nvtx_push(name)
            self._open = True

    def stop(self) -> None:
        if self.nvtx and self._open:
            nvtx_pop()
            self._open = False
        self._marks.append(("", self._event()))

    def collect(self, totals: Dict[str, float]) -> Dict[str, float]:
        """Wait for the last event and add each phase's milliseconds/1e3 to ``totals``; returns this step's."""
        import cupy
        step: Dict[str, float] = {}
        if len(self._marks) < 2:
            self._marks.clear()
            return step
        self._marks[-1][1].synchronize()
        for (name, a), (_, b) in zip(self._marks[:-1], self._marks[1:]):
            if name:
                s = cupy.cuda.get_elapsed_time(a, b) / 1e3
                step[name] = step.get(name, 0.0) + s
                totals[name] = totals.get(name, 0.0) + s
        self._marks.clear()
        return step


def make_timer(enabled: bool, stream=None):
    return PhaseTimer(stream) if enabled else NullTimer()


def time_graph(graph, stream, n: int = 20) -> Optional[float]:
    """Mean seconds of ``n`` back-to-back replays of ``graph`` on ``stream`` (CUDA events)."""
    import cupy
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    graph.launch(stream)                # warm
    start.record(stream)
    for _ in range(n):
        graph.launch(stream)
    end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / n


class _Counted:
    """A kernel object that counts its launches into ``counts[name]`` and forwards everything else."""
    __slots__ = ("_fn", "_name", "_counts")

    def __init__(self, fn, name, counts):
        self._fn, self._name, self._counts = fn, name, counts

    def __call__(self, *args, **kwargs):
        self._counts[self._name] += 1
        return self._fn(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._fn, attr)


class count_launches:
    """Context manager counting the kernel launches issued through the kernel wrappers while it is active
    (every wrapper fetches its kernel with ``get_kernel`` right before launching, so the wrappers' module-level
    ``get_kernel`` is swapped for one returning counting kernels). ``counts``: kernel name (template
    arguments stripped) -> launches. Collectives, memcpys and CuPy's own element-wise kernels are not counted.

        with count_launches() as c:
            target.forward(batch, kv)
        print(sum(c.counts.values()), c.counts)
    """

    def __init__(self):
        from collections import Counter
        self.counts = Counter()
        self._patched: List[Tuple[object, object]] = []

    def __enter__(self):
        import importlib
        import pkgutil
        from .. import kernels as pkg
        # every wrapper module, those of subpackages too (kernels/moe/ launches from moe.forward)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{pkg.__name__}."):
            if info.name.rsplit(".", 1)[-1] in ("compile", "launch", "checks"):
                continue
            mod = importlib.import_module(info.name)
            orig = getattr(mod, "get_kernel", None)
            if orig is None:
                continue

            def wrapped(spec, name, *a, _orig=orig, **k):
                return self._wrap(_orig(spec, name, *a, **k), name.split("<")[0])
            mod.get_kernel = wrapped
            self._patched.append((mod, orig))
        return self

    def _wrap(self, fn, name: str):
        """The kernel the wrappers get while active (subclasses choose another stand-in)."""
        return _Counted(fn, name, self.counts)

    def __exit__(self, *exc):
        for mod, orig in reversed(self._patched):
            mod.get_kernel = orig
        self._patched.clear()
        return False
