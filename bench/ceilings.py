"""The hardware ceilings and timing helpers live in the package (``ddtree_cupy.profiling.ceilings``) so the
profiling API and the benchmarks measure with the same code; this module keeps the benchmarks' import path."""
from ddtree_cupy.profiling.ceilings import (Ceilings, _median_event_ms, measure_ceilings, measure_mma_bf16_tflops,  # noqa: F401
                                            measure_read_bandwidth, time_eager, time_graph)

if __name__ == "__main__":
    print(measure_ceilings(4 << 30))
