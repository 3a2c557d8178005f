"""Argument checks for kernel launch wrappers.

A wrapper validates every array before launching, so a wrong shape, dtype, layout or device becomes a
``ValueError`` that names the argument instead of a silent out-of-bounds read inside a kernel. The checks
are cheap attribute reads (no device synchronisation), so they also run while a CUDA graph is captured.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import numpy as np

Dim = Union[int, None, str]   # an exact size, None for "any", or a symbol that must agree across arguments


def check_array(name: str, a, dtype, shape: Sequence[Dim], dims: Optional[dict] = None,
                contiguous: bool = True, device: Optional[int] = None):
    """Validate a CuPy array and return it.

    ``shape`` entries: int (exact), None (any), or a symbol string; symbols are bound in ``dims`` on first
    use and must match afterwards, e.g. check_array("x", x, np.uint16, ("T", 7168), dims) then
    check_array("out", out, np.uint16, ("T", 2048), dims).
    """
    import cupy
    if not isinstance(a, cupy.ndarray):
        raise ValueError(f"{name}: expected a cupy.ndarray, got {type(a).__name__}")
    want = np.dtype(dtype)
    if a.dtype != want:
        hint = " (bf16 tensors are stored as uint16)" if want == np.uint16 else ""
        raise ValueError(f"{name}: expected dtype {want}, got {a.dtype}{hint}")
    if a.ndim != len(shape):
        raise ValueError(f"{name}: expected {len(shape)} dimensions {tuple(shape)}, got shape {a.shape}")
    for i, (got, exp) in enumerate(zip(a.shape, shape)):
        if exp is None:
            continue
        if isinstance(exp, str):
            if dims is None:
                raise TypeError("symbolic dimensions need a dims dict")
            if exp in dims and dims[exp] != got:
                raise ValueError(f"{name}: dimension {i} ({exp}) is {got}, but another argument fixed "
                                 f"{exp} = {dims[exp]} (shape {a.shape})")
            dims[exp] = got
        elif got != exp:
            raise ValueError(f"{name}: dimension {i} must be {exp}, got shape {a.shape}")
    if contiguous and not a.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous (shape {a.shape}, strides {a.strides})")
    if device is not None and a.device.id != device:
        raise ValueError(f"{name}: lives on device {a.device.id}, kernel runs on device {device}")
    return a


def check_range(name: str, value: int, lo: int, hi: int) -> int:
    """lo <= value <= hi, else ValueError naming ``name``."""
    if not isinstance(value, (int, np.integer)) or not lo <= int(value) <= hi:
        raise ValueError(f"{name}: must be an integer in [{lo}, {hi}], got {value!r}")
    return int(value)


def current_device() -> int:
    import cupy
    return cupy.cuda.Device().id


def check_rows(name: str, a, dtype, shape: Sequence[Dim], dims: Optional[dict] = None, align: int = 16):
    """Like ``check_array`` for a possibly strided view whose innermost dimension is contiguous.

    Kernels take explicit row strides so a column slice (``q[:, :, 128:]``, ``kv[:, :512]``) can be read
    or written in place. Every stride and the base address must be multiples of ``align`` bytes (16: the
    kernels move 16-byte vectors). Returns the element strides.
    """
    check_array(name, a, dtype, shape, {} if dims is None else dims, contiguous=False)
    item = a.dtype.itemsize
    if a.ndim and a.shape[-1] > 1 and a.strides[-1] != item:
        raise ValueError(f"{name}: the last dimension must be contiguous (strides {a.strides})")
    for i, s in enumerate(a.strides[:-1]):
        if a.shape[i] > 1 and (s % align or s < 0):
            raise ValueError(f"{name}: stride {s} B of dimension {i} must be a positive multiple of {align} B")
    if a.data.ptr % align:
        raise ValueError(f"{name}: base address must be {align}-byte aligned (a view starting mid-vector?)")
    return tuple(s // item for s in a.strides)


def check_multiple(name: str, value: int, multiple: int) -> int:
    """value % multiple == 0, else ValueError naming ``name``."""
    if int(value) % multiple:
        raise ValueError(f"{name}: must be a multiple of {multiple}, got {value}")
    return int(value)


def check_out(name: str, out, dtype, shape: Tuple[int, ...]):
    """Allocate ``out`` when None (outside graph capture); otherwise validate it. Returns the array."""
    import cupy
    if out is None:
        return cupy.empty(shape, dtype=dtype)
    return check_array(name, out, dtype, shape)
