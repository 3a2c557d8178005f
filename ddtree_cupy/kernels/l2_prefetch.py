"""L2 prefetch of what a later kernel of the step will read (cuda_src/l2_prefetch.cu; docs/KERNELS.md
"L2 prefetch"): up to four contiguous device arrays (weights) and, optionally, one layer's latent-cache
pages of every stream. A hint only: the kernel writes nothing, so results are unchanged bit for bit.

    l2_prefetch([w_qkv_a, w_q_b], kv=(pool, block_table, lengths), evict_last=True)

Launched with PDL in the engine's graphs (it lets its dependent launch at once and waits for its
predecessor before it exits, so stream order holds through it).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from .checks import check_array, current_device
from .compile import KernelSpec, get_kernel, register

RANGES = 4
PAGE_ROWS, ROW_DIM = 64, 576
SPEC = register(KernelSpec("l2_prefetch.cu", ("l2_prefetch_kernel",), pdl=True,
                           doc="L2 prefetch of weights / latent-cache pages (a hint; writes nothing)"))
_SM = {}


def _sm_count(dev: int) -> int:
    if dev not in _SM:
        import cupy
        _SM[dev] = cupy.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"]
    return _SM[dev]


def l2_prefetch(arrays: Sequence, kv: Optional[Tuple] = None, evict_last: bool = False, blocks: Optional[int] = None):
    """Prefetch ``arrays`` (<= 4 C-contiguous device arrays, 16-byte aligned, sizes multiples of 16 bytes) and,
    with ``kv = (pool uint16 [pages, 64, 576], block_table int32 [S, max_pages], lengths int32 [S])``, the
    pages holding positions 0 .. lengths[b] of every stream b into L2. ``evict_last`` marks the lines with
    the evict_last priority. Nothing is written; the call only enqueues the kernel."""
    import cupy
    dev = current_device()
    arrays = list(arrays)
    if len(arrays) > RANGES:
        raise ValueError(f"arrays: at most {RANGES} arrays per launch, got {len(arrays)}")
    ptrs, sizes = [], []
    for i, a in enumerate(arrays):
        if not isinstance(a, cupy.ndarray):
            raise ValueError(f"arrays[{i}]: expected a cupy.ndarray, got {type(a).__name__}")
        if not a.flags.c_contiguous or a.data.ptr % 16 or a.nbytes % 16:
            raise ValueError(f"arrays[{i}]: must be C-contiguous, 16-byte aligned, a multiple of 16 bytes "
                             f"(shape {a.shape}, {a.nbytes} B, address {a.data.ptr:#x})")
        if a.device.id != dev:
            raise ValueError(f"arrays[{i}]: lives on device {a.device.id}, kernel runs on device {dev}")
        ptrs.append(a)
        sizes.append(a.nbytes)
    while len(ptrs) < RANGES:
        ptrs.append(np.uint64(0))
        sizes.append(0)
    pool = bt = lens = np.uint64(0)
    S = max_pages = num_pages = 0
    if kv is not None:
        pool, bt, lens = kv
        dims: dict = {}
        check_array("kv pool", pool, np.uint16, ("P", PAGE_ROWS, ROW_DIM), dims, device=dev)
        check_array("kv block_table", bt, np.int32, ("S", "M"), dims, device=dev)
        check_array("kv lengths", lens, np.int32, ("S",), dims, device=dev)
        S, max_pages, num_pages = dims["S"], dims["M"], dims["P"]
    n_items = sum(-(-n // 16384) for n in sizes) + 4 * S * max_pages
    if n_items == 0:
        return
    if blocks is None:
        # one warp per block, about 4 prefetches per thread: the copy engine of an SM serves its prefetches
        # one after the other, so the bytes must spread over the SMs (l2_prefetch.cu)
        blocks = max(1, min(4 * _sm_count(dev), -(-n_items // 128)))
    args = []
    for p, n in zip(ptrs, sizes):
        args += [p, np.int64(n)]
    args += [pool, np.int64(PAGE_ROWS * ROW_DIM * 2), np.int32(num_pages), bt, lens, np.int32(S),
             np.int32(max_pages), np.int32(1 if evict_last else 0)]
    get_kernel(SPEC, "l2_prefetch_kernel")((int(blocks),), (32,), tuple(args))
