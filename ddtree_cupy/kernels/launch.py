"""Programmatic dependent launch (PDL): kernel launches through ``cuLaunchKernelEx`` with the
programmatic-stream-serialization attribute, on CuPy's current stream, eagerly or under graph capture.

A kernel launched this way may start while the previous kernel in the stream is still running; it must
call ``DDT_PDL_WAIT()`` (cuda_src/common.cuh) before reading anything an earlier kernel wrote and before
any global write. ``compile.get_kernel`` hands out a ``PdlKernel`` for specs marked ``pdl=True``; it is
called exactly like CuPy's ``RawKernel`` (``k(grid, block, args, shared_mem=...)``) and launches with
PDL only while PDL is enabled here, the device is sm_90 or newer and the driver has cuLaunchKernelEx.

Switch for launches outside the engine: ``set_pdl(True/False)`` or ``DDT_PDL=1/0`` (``knobs.get().pdl``, read
at import; default off). The engine does not depend on it: it captures every decode-step graph of <= 320
rows with PDL (``GpuEngine(pdl="auto")``), measured faster on the H200 (docs/KERNELS.md "PDL").

Arguments are marshalled as CuPy marshals them: a ``cupy.ndarray`` (or any object with
``__cuda_array_interface__``) becomes its device pointer (8 bytes), a NumPy scalar its bytes in its own
dtype. Python ``int``/``float``/``bool`` are refused: their C type would be a guess (the kernels here
always pass ``np.int32(...)`` and the like).
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Sequence

import numpy as np

from .. import knobs

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6     # cuda.h, CUlaunchAttributeID


def env_flag(name: str, default: bool) -> bool:
    """An on/off environment switch: "0" / "1", unset or empty -> ``default``; anything else raises, naming it."""
    v = os.environ.get(name)
    if v is None or v.strip() == "":
        return default
    return knobs._bit(name, v)


_enabled = knobs.get().pdl


def set_pdl(enabled: bool) -> None:
    """Launch ``pdl=True`` specs with programmatic dependent launch (True) or as ordinary launches."""
    global _enabled
    _enabled = bool(enabled)


def pdl_enabled() -> bool:
    return _enabled


# --- cuda.h structures (CUDA 12.x / 13.x driver API, unchanged since 11.8) ---

class _AttrValue(ctypes.Union):
    # CUlaunchAttributeValue is a 64-byte union; the PDL attribute uses its first unsigned int
    _fields_ = [("pad", ctypes.c_char * 64), ("u32", ctypes.c_uint)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


assert ctypes.sizeof(_Attr) == 72 and ctypes.sizeof(_LaunchConfig) == 56   # the C layout on LP64


def _dims(d, what: str):
    if isinstance(d, (int, np.integer)):
        d = (d,)
    d = tuple(int(v) for v in d)
    if not 1 <= len(d) <= 3 or min(d) < 1:
        raise ValueError(f"{what}: expected 1 to 3 positive dimensions, got {d}")
    return d + (1,) * (3 - len(d))


def marshal_args(args: Sequence) -> list:
    """One ctypes object per kernel argument, holding exactly the bytes the kernel parameter expects."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, (bool, int, float, complex)) and not isinstance(a, np.generic):
            raise TypeError(f"kernel argument {i}: Python {type(a).__name__} {a!r} has no fixed C type; "
                            f"pass a NumPy scalar (np.int32, np.int64, np.float32, np.uint64, ...)")
        if isinstance(a, np.generic):
            # the scalar's own bytes: np.int32 -> 4 bytes, np.uint64 -> 8, np.float32 -> 4, np.bool_ -> 1
            raw = np.asarray(a).tobytes()
            buf = (ctypes.c_char * len(raw)).from_buffer_copy(raw)
            out.append(buf)
            continue
        ptr = _device_pointer(a)
        if ptr is None:
            raise TypeError(f"kernel argument {i}: unsupported type {type(a).__name__} "
                            f"(expected a cupy.ndarray or a NumPy scalar)")
        out.append(ctypes.c_uint64(ptr))
    return out


def _device_pointer(a):
    data = getattr(a, "data", None)
    p = getattr(data, "ptr", None)          # cupy.ndarray: .data is a MemoryPointer (offset included)
    if isinstance(p, int):
        return p
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    return None


_lib = None
_lib_lock = threading.Lock()


def _driver():
    """libcuda's cuLaunchKernelEx, or None when this driver lacks it."""
    global _lib
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                    fn = lib.cuLaunchKernelEx
                    fn.restype = ctypes.c_int
                    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                   ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
                    err = lib.cuGetErrorString
                    err.restype = ctypes.c_int
                    err.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
                    _lib = (fn, err)
                except (OSError, AttributeError):
                    _lib = False
    return _lib or None


def launch_pdl(function_ptr: int, grid, block, args: Sequence, shared_mem: int = 0, stream_ptr=None) -> None:
    """cuLaunchKernelEx with programmatic stream serialization on ``stream_ptr`` (default: CuPy's current
    stream). ``function_ptr`` is the CUfunction (``RawKernel.kernel.ptr``)."""
    drv = _driver()
    if drv is None:
        raise RuntimeError("PDL launch: libcuda.so.1 with cuLaunchKernelEx not available")
    launch, errstr = drv
    if stream_ptr is None:
        import cupy
        stream_ptr = cupy.cuda.get_current_stream().ptr
    g, b = _dims(grid, "grid"), _dims(block, "block")
    attr = _Attr()
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.u32 = 1
    cfg = _LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], int(shared_mem), ctypes.c_void_p(stream_ptr),
                        ctypes.pointer(attr), 1)
    holders = marshal_args(args)
    params = (ctypes.c_void_p * max(1, len(holders)))(
        *[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
    rc = launch(ctypes.byref(cfg), ctypes.c_void_p(function_ptr), params, None)
    if rc != 0:
        s = ctypes.c_char_p()
        errstr(rc, ctypes.byref(s))
        raise RuntimeError(f"cuLaunchKernelEx failed: {rc} ({(s.value or b'?').decode()})")


class PdlKernel:
    """A CuPy RawKernel that launches with PDL while PDL is enabled (sm_90+), otherwise as usual."""

    __slots__ = ("raw", "_cc", "_ddt_smem")

    def __init__(self, raw, compute_capability: int):
        self.raw = raw
        self._cc = compute_capability
        self._ddt_smem = 0

    def __call__(self, grid, block, args, shared_mem: int = 0):
        if _enabled and self._cc >= 90:
            launch_pdl(self.raw.kernel.ptr, grid, block, args, shared_mem)
        else:
            self.raw(grid, block, args, shared_mem=shared_mem)

    @property
    def max_dynamic_shared_size_bytes(self):
        return self.raw.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, v):
        self.raw.max_dynamic_shared_size_bytes = v

    def __getattr__(self, name):          # num_regs, attributes, kernel, ... as on the RawKernel
        return getattr(self.raw, name)
