"""GPU tests run from the source tree with nothing installed: put the repository root on sys.path.

After every GPU test the CuPy pool's footprint (``total_bytes``: every block the test made the pool hold,
close to its peak, since the pool caches freed blocks) is recorded and the cached blocks are released, so
the next test starts from an empty pool (under ``CUPY_GPU_MEMORY_LIMIT`` one test's cache never counts
against the next). ``DDT_GPU_MEM_LOG=FILE`` appends one "bytes test-id" line per test (bench/ci_gpu.sh
prints the largest)."""
import os

from ddtree_cupy import knobs
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(autouse=True)
def _gpu_pool_footprint(request):
    yield
    if "gpu" not in request.keywords:
        return
    try:
        import cupy
        pool = cupy.get_default_memory_pool()
        cupy.cuda.Device().synchronize()
        footprint = pool.total_bytes()
    except Exception:                   # no GPU: the test was skipped, nothing to record
        return
    log = knobs.get().gpu_mem_log or None
    if log:
        with open(log, "a") as f:
            f.write(f"{footprint} {request.node.nodeid}\n")
    pool.free_all_blocks()
