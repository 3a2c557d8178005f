"""The persistent executor launched with PDL, without a GPU: its spec is PDL-capable, and before its
griddepcontrol.wait it touches only what the host wrote (its list, records and op table), never the launch
count, the counters, the trace or an activation."""
from ddtree_cupy.kernels import compile as kc
from ddtree_cupy.kernels import persistent as P


def test_executor_waits_before_anything_another_kernel_writes():
    assert P.SPEC.pdl
    src = (kc.CUDA_SRC_DIR / "persistent_layer.cu").read_text()
    body = src[src.index("persistent_layer(const int* __restrict__ items"):]
    trigger, wait = body.index("DDT_PDL_LAUNCH_DEPENDENTS();"), body.index("DDT_PDL_WAIT();")
    assert body.count("DDT_PDL_WAIT();") == 1 and body.count("DDT_PDL_LAUNCH_DEPENDENTS();") == 1
    assert trigger < body.index("v = rows[q]") < wait              # the block's list and records: host-written
    assert body.index("dst[v] = src[v]") < wait                     # the op table: host-written
    for after in ("launches[blockIdx.x]", "counters + (1 - meta->set)", "trace_hdr[0] =", "meta->abort_flag = 0"):
        assert wait < body.index(after), after
