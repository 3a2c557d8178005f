"""The one numpy-backed stand-in for the parts of CuPy that the engine and GpuTarget touch, shared by the CPU
tests (the base layer; tests/_kernel_emul.py, its one extension, emulates the kernels on top of it): a test puts
it into ``sys.modules`` for its own duration (``patch_modules(monkeypatch)``), a subprocess for good
(``install()``) before anything imports cupy. Kernel emulations reach it through ``launcher`` /
``run_or_record`` / ``array_at``.

What it checks, so that a step that would break as a CUDA graph breaks here:
- arrays are an ndarray subclass whose ``.data.ptr`` is the real numpy buffer address, so the real kernel
  wrappers compute real pointers and emulations can decode raw launch arguments (``array_at`` maps an
  allocation's address back to its array, as a kernel dereferences a pointer table);
- launches and copies inside ``begin_capture`` / ``end_capture`` are recorded, not run, and the graph
  replays them against the same buffers (host code that depends on values, or a buffer the replay does not
  see, gives wrong results);
- allocation and host<->device copies during a capture raise (they never belong in a captured step);
- the capture stack and the current stream are per thread: the TP tests run one engine per thread;
- ``empty`` returns poison (NaN / all-ones integers), never zeros that a missing write could hide behind.
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import threading
import types
import weakref

import numpy as np

_TLS = threading.local()        # per thread: the open captures (innermost last) and the `with` streams
_ALLOCS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # buffer address -> live allocation


def _tls(name: str) -> list:
    if not hasattr(_TLS, name):
        setattr(_TLS, name, [])
    return getattr(_TLS, name)


def capturing() -> bool:
    return bool(_tls("captures"))


def run_or_record(op) -> None:
    """Execute a device operation now, or append it to this thread's innermost open capture."""
    if capturing():
        _tls("captures")[-1].append(op)
    else:
        op()


def launcher(call):
    """What an emulated ``get_kernel`` returns: each launch runs ``call(grid, args)`` through
    ``run_or_record``, with the raw launch arguments exactly as the real wrapper passed them."""
    def launch(grid, block, args, shared_mem=0):
        run_or_record(lambda: call(grid, args))
    launch.kernel = types.SimpleNamespace(ptr=id(call))     # what the occupancy query (driver, below) takes
    return launch


def array_at(ptr) -> np.ndarray:
    """The live allocation whose buffer starts at ``ptr`` (a pointer read out of a device array, e.g. the
    KV pools' pointer table); a pointer to freed or foreign memory fails loudly, as it would on the GPU."""
    a = _ALLOCS.get(int(ptr))
    if a is None:
        raise KeyError(f"no live device allocation at {int(ptr):#x}")
    return a


class _Ptr:
    def __init__(self, p):
        self.ptr = p


class _Device:
    id = 0
    compute_capability = "90"
    attributes = {"MultiProcessorCount": 132, "MaxSharedMemoryPerBlockOptin": 232448,
                  "MaxSharedMemoryPerMultiprocessor": 233472, "L2CacheSize": 50 * 2**20}

    def __init__(self, i=0):
        pass

    def use(self):
        pass

    def synchronize(self):
        pass


class DeviceArray(np.ndarray):
    @property
    def data(self):
        return _Ptr(self.__array_interface__["data"][0])

    @property
    def device(self):
        return _Device()

    def get(self, stream=None, order="C", out=None, blocking=True):
        assert not capturing(), "device-to-host copy during capture"
        if out is not None:
            out[...] = np.asarray(self)
            return out
        return np.array(self)           # np.array drops the subclass: a host array

    def set(self, arr, stream=None):
        assert not capturing(), "host-to-device copy during capture"
        self[...] = np.asarray(arr)


def _alloc(a: np.ndarray) -> DeviceArray:
    """Every fresh host array becomes a device allocation here, so this is where capture forbids it."""
    if capturing():
        raise RuntimeError("device allocation during graph capture")
    d = a.view(DeviceArray)
    _ALLOCS[d.__array_interface__["data"][0]] = d
    return d


def _empty(shape, dtype=float):
    dt = np.dtype(dtype)
    return _alloc(np.full(shape, np.nan if dt.kind == "f" else np.iinfo(dt).max, dt))


class _Graph:
    def __init__(self, ops):
        self.ops = ops

    def launch(self, stream=None):
        for op in self.ops:
            op()

    def upload(self, stream=None):
        pass


class _Stream:
    def __init__(self, non_blocking=False):
        self.ptr = id(self)

    def __enter__(self):
        _tls("streams").append(self)
        return self

    def __exit__(self, *exc):
        _tls("streams").pop()
        return False

    def synchronize(self):
        pass

    def is_capturing(self):
        return capturing()

    def begin_capture(self):
        _tls("captures").append([])

    def end_capture(self):
        return _Graph(_tls("captures").pop())


_Stream.null = _Stream()     # cupy.cuda.Stream.null: the legacy default stream (tests synchronize it)


class _Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


def _memcpy2d(dst, dpitch, src, spitch, width, height, kind, stream):
    def op():
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
    run_or_record(op)


class _RandomState:
    def __init__(self, seed):
        self.r = np.random.default_rng(seed)

    def standard_normal(self, size=None, dtype=float):
        return _alloc(self.r.standard_normal(size).astype(dtype))

    def randint(self, lo, hi=None, size=None, dtype=int):
        return _alloc(self.r.integers(lo, hi, size).astype(dtype))

    def uniform(self, lo=0.0, hi=1.0, size=None, dtype=float):
        return _alloc(self.r.uniform(lo, hi, size).astype(dtype))


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)     # importlib.util.find_spec("cupy") finds it
    m.__dict__.update(attrs)
    return m


_DEFAULT_STREAM = _Stream()
runtime = _module("cupy.cuda.runtime", memcpyDeviceToDevice=3, memcpy2DAsync=_memcpy2d,
                  getDeviceCount=lambda: 1, memGetInfo=lambda: (8 << 30, 16 << 30))
# the MoE wrapper sizes its bulk grids from the driver's occupancy calculator: two blocks per SM, the H200's
# figure for the decode blocks
driver = _module("cupy.cuda.driver", occupancyMaxActiveBlocksPerMultiprocessor=lambda func, threads, smem: 2)
cuda = _module("cupy.cuda", Device=_Device, Stream=_Stream, Event=_Event, runtime=runtime, driver=driver,
               get_current_stream=lambda: (_tls("streams") or [_DEFAULT_STREAM])[-1],
               get_elapsed_time=lambda a, b: 0.01, alloc_pinned_memory=bytearray)
random = _module("cupy.random", RandomState=_RandomState)
cp = _module(
    "cupy", ndarray=DeviceArray, cuda=cuda, random=random, empty=_empty,
    zeros=lambda shape, dtype=float: _alloc(np.zeros(shape, dtype)),
    ones=lambda shape, dtype=float: _alloc(np.ones(shape, dtype)),
    full=lambda shape, v, dtype=None: _alloc(np.full(shape, v, dtype)),
    full_like=lambda a, v: _alloc(np.full_like(np.asarray(a), v)),
    arange=lambda *a, **k: _alloc(np.arange(*a, **k)),
    asarray=lambda a, dtype=None: _alloc(np.array(a, dtype=dtype, copy=True)),
    ascontiguousarray=lambda a, dtype=None: _alloc(np.array(np.asarray(a), dtype=dtype, order="C", copy=True)),
    copyto=lambda d, s: run_or_record(lambda: np.copyto(d, s)),
    array_equal=lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
    get_default_memory_pool=lambda: types.SimpleNamespace(free_bytes=lambda: 0, used_bytes=lambda: 0),
    # binary ufuncs into a preallocated out (recorded during capture like a kernel launch)
    **{n: (lambda f: lambda a, b, out: run_or_record(lambda: f(a, b, out=out)))(getattr(np, n))
       for n in ("add", "subtract", "multiply", "minimum")},
    **{n: getattr(np, n) for n in ("uint8", "uint16", "uint32", "uint64", "int32", "int64", "float32", "float64")})
MODULES = {"cupy": cp, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime, "cupy.cuda.driver": driver,
           "cupy.random": random}


def install():
    """For a whole process (the subprocess tests): every later ``import cupy`` gets this stand-in."""
    import sys
    sys.modules.update(MODULES)


def patch_modules(monkeypatch):
    """For one test: ``import cupy`` gets this stand-in until the test ends."""
    import sys
    for name, mod in MODULES.items():
        monkeypatch.setitem(sys.modules, name, mod)
