"""``GpuLatentCache``: the paged latent KV cache of the target on the GPU (docs/CONTRACTS.md).

Per layer a pool ``uint16 [num_pages, 64, 576]`` (bf16: normalised c_kv 512 | rotated k_pe 64), one block
table ``int32 [max_streams, max_pages_per_stream]`` shared by every layer (a stream owns the same page ids
in every layer's pool), and the device array of the pools' addresses that ``kv_compact_latent`` reads.
Everything is allocated once here; the host-side page bookkeeping lives in ``engine/kv_pool.KVPool``,
whose block table the engine copies in with ``set_block_table``.
"""
from __future__ import annotations

import numpy as np

PAGE = 64
ROW_DIM = 576


def latent_cache_bytes(num_layers: int, num_pages: int) -> int:
    """Device bytes of the pools (the block table and pointer array are negligible)."""
    return num_layers * num_pages * PAGE * ROW_DIM * 2


class GpuLatentCache:
    def __init__(self, num_layers: int, num_pages: int, max_streams: int, max_pages_per_stream: int):
        import cupy
        from ..kernels.kv_cache import pool_pointer_array
        for name, v in (("num_layers", num_layers), ("num_pages", num_pages), ("max_streams", max_streams),
                        ("max_pages_per_stream", max_pages_per_stream)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GpuLatentCache: {name} must be a positive integer, got {v!r}")
        self.num_layers, self.num_pages = int(num_layers), int(num_pages)
        self.max_streams, self.max_pages_per_stream = int(max_streams), int(max_pages_per_stream)
        # Zero-filled: a page handed out but not yet written reads as finite zeros, never NaN.
        self.pools = [cupy.zeros((num_pages, PAGE, ROW_DIM), np.uint16) for _ in range(num_layers)]
        # -1 = no page (as KVPool): a kernel reading it is a bug the bounds of real streams never reach.
        self.block_table = cupy.full((max_streams, max_pages_per_stream), -1, np.int32)
        self.pool_ptrs = pool_pointer_array(self.pools)

    @property
    def capacity_per_stream(self) -> int:
        """Cache positions one stream's block-table row can address."""
        return self.max_pages_per_stream * PAGE

    def nbytes(self) -> int:
        return latent_cache_bytes(self.num_layers, self.num_pages) + int(self.block_table.nbytes)

    def set_block_table(self, table) -> None:
        """Copy a host block table (int [max_streams, max_pages_per_stream], e.g. ``KVPool.block_table``)
        into the device one (host->device: outside graph capture)."""
        t = np.asarray(table)
        if t.shape != self.block_table.shape or not np.issubdtype(t.dtype, np.integer):
            raise ValueError(f"GpuLatentCache.set_block_table: table has {t.dtype} {t.shape}, expected int "
                             f"{self.block_table.shape}")
        bad = (t >= self.num_pages) | (t < -1)
        if bad.any():
            raise ValueError(f"GpuLatentCache.set_block_table: page ids must lie in [-1, {self.num_pages}), "
                             f"got {t[bad][:8].tolist()}")
        self.block_table.set(np.ascontiguousarray(t, dtype=np.int32))

    def assign_contiguous(self, pages_per_stream: int) -> None:
        """Tests and benchmarks: stream b gets pages [b * n, (b + 1) * n) (needs max_streams * n pages)."""
        n = int(pages_per_stream)
        if not 1 <= n <= self.max_pages_per_stream or n * self.max_streams > self.num_pages:
            raise ValueError(f"GpuLatentCache.assign_contiguous: {n} pages for each of {self.max_streams} streams "
                             f"do not fit {self.num_pages} pages / {self.max_pages_per_stream} per stream")
        t = np.full(self.block_table.shape, -1, np.int32)
        t[:, :n] = np.arange(self.max_streams * n, dtype=np.int32).reshape(self.max_streams, n)
        self.set_block_table(t)

    def read_rows(self, layer: int, stream: int, positions) -> np.ndarray:
        """Host copy (uint16 [n, 576]) of stream ``stream``'s cache rows at ``positions`` in ``layer``
        (tests and debugging: synchronises)."""
        if not 0 <= stream < self.max_streams:
            raise ValueError(f"GpuLatentCache.read_rows: stream {stream} out of range [0, {self.max_streams})")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"GpuLatentCache.read_rows: layer {layer} out of range [0, {self.num_layers})")
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if pos.size and (pos.min() < 0 or pos.max() >= self.capacity_per_stream):
            raise ValueError(f"GpuLatentCache.read_rows: positions must lie in [0, {self.capacity_per_stream})")
        table = self.block_table[stream].get()
        pages = table[pos // PAGE]
        if (pages < 0).any():
            raise ValueError(f"GpuLatentCache.read_rows: stream {stream} has no page for positions "
                             f"{pos[pages < 0][:8].tolist()}")
        import cupy
        rows = cupy.asarray((pages * PAGE + pos % PAGE).astype(np.int64))
        return self.pools[layer].reshape(-1, ROW_DIM)[rows].get()
