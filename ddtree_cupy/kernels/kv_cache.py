"""Launch wrappers for cuda_src/kv_cache.cu: latent KV writes, latent compaction after acceptance, and the
drafter context cache append. Layouts: docs/CONTRACTS.md ("Paged latent KV cache") and docs/ATTENTION.md.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .checks import check_array, current_device
from .compile import KernelSpec, get_kernel, register

LATENT_DIM = 512
ROPE_DIM = 64
ROW_DIM = LATENT_DIM + ROPE_DIM
PAGE_SIZE = 64
DRAFTER_HEAD_DIM = 128

KV_SPEC = register(KernelSpec(
    src="kv_cache.cu",
    names=("kv_write_latent", "kv_compact_latent", "drafter_kv_append"),
    pdl=True,   # every kernel waits (DDT_PDL_WAIT) before reading its inputs or writing the cache
    doc="latent KV row writes, accepted-row compaction, drafter context append"))


def _rows_view(name: str, a, width: int, dev: int, dims: dict, sym: str):
    """A [T, width] uint16 array whose rows may be strided (a column slice of a wider buffer) but whose
    values are contiguous within a row and 16-byte aligned, as the kernel copies 16-byte chunks."""
    check_array(name, a, np.uint16, (sym, width), dims, contiguous=False, device=dev)
    if a.strides[1] != 2:
        raise ValueError(f"{name}: values within a row must be contiguous (strides {a.strides})")
    if a.strides[0] % 16 or a.data.ptr % 16:
        raise ValueError(f"{name}: rows must start on 16-byte boundaries (row stride {a.strides[0]} B, "
                         f"address {a.data.ptr:#x})")
    return a.strides[0] // 2


def kv_write_latent(pool, block_table, stream_ids, positions, latent, rope=None, stream=None):
    """Write T rows into this layer's pool: row i goes to stream ``stream_ids[i]``, cache position
    ``positions[i]`` (page block_table[stream, pos // 64], row pos % 64); positions < 0 are skipped.

    latent: uint16 [T, 576] (c_kv | k_pe) when ``rope`` is None, else [T, 512] with rope uint16 [T, 64].
    """
    import cupy
    dims: dict = {}
    dev = current_device()
    check_array("pool", pool, np.uint16, (None, PAGE_SIZE, ROW_DIM), dims, device=dev)
    check_array("block_table", block_table, np.int32, ("S", None), dims, device=dev)
    check_array("stream_ids", stream_ids, np.int32, ("T",), dims, device=dev)
    check_array("positions", positions, np.int32, ("T",), dims, device=dev)
    if rope is None:
        lat_stride = _rows_view("latent", latent, ROW_DIM, dev, dims, "T")
        rope_ptr, rope_stride = latent.data.ptr + 2 * LATENT_DIM, lat_stride
    else:
        lat_stride = _rows_view("latent", latent, LATENT_DIM, dev, dims, "T")
        rope_stride = _rows_view("rope", rope, ROPE_DIM, dev, dims, "T")
        rope_ptr = rope.data.ptr
    T = dims["T"]
    if T == 0:
        return pool
    fn = get_kernel(KV_SPEC, "kv_write_latent")
    st = stream if stream is not None else cupy.cuda.get_current_stream()
    with st:
        fn((T,), (96,), (np.uintp(latent.data.ptr), np.int64(lat_stride), np.uintp(rope_ptr), np.int64(rope_stride), stream_ids,
                         positions, pool, block_table, np.int32(block_table.shape[1])))
    return pool


def pool_pointer_array(pools: Sequence):
    """Device uint64 array of the layers' pool addresses for kv_compact_latent. Build it once (outside
    graph capture: it copies from the host) and reuse it."""
    import cupy
    dev = current_device()
    shape = None
    for i, p in enumerate(pools):
        check_array(f"pools[{i}]", p, np.uint16, (None, PAGE_SIZE, ROW_DIM), device=dev)
        if shape is not None and p.shape != shape:
            raise ValueError(f"pools[{i}]: shape {p.shape} differs from pools[0] {shape}")
        shape = p.shape
    if shape is None:
        raise ValueError("pools: empty")
    return cupy.asarray(np.array([p.data.ptr for p in pools], dtype=np.uint64))


def kv_compact_latent(pool_ptrs, block_table, prefix_len, n_accept, acc_rows, stream=None):
    """Commit accepted tree rows in every layer: per stream b, slot s + acc_rows[b, j] moves to s + j for
    j = 1 .. n_accept[b] - 1 (s = prefix_len[b], the committed length BEFORE this step; acc_rows[b, 0] is
    the root, row 0). acc_rows must be strictly increasing along each stream's accepted path.

    pool_ptrs: a uint64 device array from ``pool_pointer_array`` (or a list of pools, converted here).
    """
    import cupy
    dims: dict = {}
    dev = current_device()
    if isinstance(pool_ptrs, (list, tuple)):
        pool_ptrs = pool_pointer_array(pool_ptrs)
    check_array("pool_ptrs", pool_ptrs, np.uint64, ("L",), dims, device=dev)
    check_array("block_table", block_table, np.int32, ("S", None), dims, device=dev)
    check_array("prefix_len", prefix_len, np.int32, ("S",), dims, device=dev)
    check_array("n_accept", n_accept, np.int32, ("S",), dims, device=dev)
    check_array("acc_rows", acc_rows, np.int32, ("S", None), dims, device=dev)
    fn = get_kernel(KV_SPEC, "kv_compact_latent")
    st = stream if stream is not None else cupy.cuda.get_current_stream()
    with st:
        fn((dims["S"], dims["L"]), (128,), (pool_ptrs, block_table, np.int32(block_table.shape[1]), prefix_len,
                                            n_accept, acc_rows, np.int32(acc_rows.shape[1])))


def drafter_kv_append(k_cache, v_cache, k, v, stream_ids, positions, stream=None):
    """Append drafter context K/V rows: row i (k, v uint16 [T, Hkv, 128]) goes to stream stream_ids[i],
    position positions[i], slot positions[i] % C of k_cache / v_cache uint16 [S, C, Hkv, 128].
    Positions < 0 are skipped."""
    import cupy
    dims: dict = {}
    dev = current_device()
    check_array("k_cache", k_cache, np.uint16, ("S", "C", "Hkv", DRAFTER_HEAD_DIM), dims, device=dev)
    check_array("v_cache", v_cache, np.uint16, ("S", "C", "Hkv", DRAFTER_HEAD_DIM), dims, device=dev)
    check_array("k", k, np.uint16, ("T", "Hkv", DRAFTER_HEAD_DIM), dims, device=dev)
    check_array("v", v, np.uint16, ("T", "Hkv", DRAFTER_HEAD_DIM), dims, device=dev)
    check_array("stream_ids", stream_ids, np.int32, ("T",), dims, device=dev)
    check_array("positions", positions, np.int32, ("T",), dims, device=dev)
    if dims["T"] == 0:
        return
    fn = get_kernel(KV_SPEC, "drafter_kv_append")
    st = stream if stream is not None else cupy.cuda.get_current_stream()
    with st:
        fn((dims["T"],), (128,), (k, v, stream_ids, positions, k_cache, v_cache, np.int32(dims["C"]),
                                  np.int32(dims["Hkv"])))
