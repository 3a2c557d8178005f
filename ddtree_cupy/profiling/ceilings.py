"""Hardware ceilings measured in the same run as the kernel being judged, plus two timing helpers (the
benchmarks import them through ``bench/ceilings.py``; the profiling API uses them directly).

    from ddtree_cupy.profiling.ceilings import measure_ceilings, time_graph, time_eager

* ``measure_read_bandwidth(nbytes)``: a read-only streaming kernel (16-byte loads, grid-stride, every
  loaded word feeds an XOR reduction that is written out so the compiler cannot drop the loads), median
  of CUDA-event timings, in GB/s (1e9 bytes / s).
* ``measure_mma_bf16_tflops()``: a loop of independent ``mma.sync.m16n8k16`` bf16 -> fp32 on every SM
  (register operands only, so it measures the tensor-core issue rate, not memory), in TFLOP/s.
* ``measure_ceilings()``: both, with the device name, as a ``Ceilings`` (what floors are divided by).
* ``time_graph(fn, iters)``: capture ``fn()`` (a sequence of kernel launches on the current stream) into
  a CUDA graph, replay it, median microseconds per call measured with events.
* ``time_eager(fn)``: the same without a graph (includes Python launch overhead when it dominates).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

_READ_SRC = r"""
extern "C" __global__ void read_stream(const uint4* __restrict__ p, unsigned long long n16,
                                       unsigned int* __restrict__ sink) {
    unsigned int acc = 0;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    // Four independent loads in flight per thread per iteration keep enough bytes outstanding.
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride),
              d = __ldg(p + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) {
        uint4 a = __ldg(p + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    // The XOR is data-dependent and stored (only when it has one impossible value, so the store itself
    // costs nothing): the compiler must keep every load.
    if (acc == 0x9E3779B9u) sink[0] = acc;
}
"""

_MMA_SRC = r"""
extern "C" __global__ void mma_loop(int iters, float* __restrict__ sink) {
    // Operands come from the thread index so they are not compile-time constants.
    unsigned int a0 = threadIdx.x * 0x00010001u, a1 = a0 ^ 0x3c003c00u, a2 = a0 + 1u, a3 = a0 + 2u;
    unsigned int b0 = a0 ^ 0x3f803f80u, b1 = a1 + 3u;
    // Eight independent accumulator chains hide the mma latency.
    float c[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) { c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f; }
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        }
    }
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    if (s == 1234.5678f) sink[0] = s;
}
"""

_mods = {}


def _kernel(src: str, name: str):
    import cupy
    key = (name, cupy.cuda.Device().id)
    if key not in _mods:
        _mods[key] = cupy.RawModule(code=src, options=("-std=c++17",)).get_function(name)
    return _mods[key]


def _median_event_ms(launch: Callable[[], None], reps: int, warmup: int = 2) -> float:
    import cupy
    for _ in range(warmup):
        launch()
    times = []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(reps):
        start.record()
        launch()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def _sm_count() -> int:
    import cupy
    return cupy.cuda.Device().attributes["MultiProcessorCount"]


def measure_read_bandwidth(nbytes: int = 4 << 30, reps: int = 15) -> float:
    """Read-only streaming bandwidth in GB/s over a buffer of ``nbytes`` (well past L2)."""
    import cupy
    n16 = max(nbytes // 16, 1)
    buf = cupy.empty(n16 * 4, dtype=cupy.uint32)
    buf[:] = cupy.arange(buf.size, dtype=cupy.uint32)   # real data: never read an untouched page
    sink = cupy.zeros(1, dtype=cupy.uint32)
    k = _kernel(_READ_SRC, "read_stream")
    blocks = _sm_count() * 8
    ms = _median_event_ms(lambda: k((blocks,), (512,), (buf, cupy.uint64(n16), sink)), reps)
    del buf
    return n16 * 16 / (ms * 1e-3) / 1e9


def measure_mma_bf16_tflops(iters: int = 4096, reps: int = 7) -> float:
    """mma.sync m16n8k16 bf16 -> fp32 issue rate with every SM busy, in TFLOP/s."""
    import cupy
    sink = cupy.zeros(1, dtype=cupy.float32)
    k = _kernel(_MMA_SRC, "mma_loop")
    blocks, threads = _sm_count() * 4, 256
    ms = _median_event_ms(lambda: k((blocks,), (threads,), (cupy.int32(iters), sink)), reps)
    warps = blocks * threads // 32
    flops = warps * iters * 8 * (2 * 16 * 8 * 16)
    return flops / (ms * 1e-3) / 1e12


def time_graph(fn: Callable[[], None], iters: int = 50, reps: int = 7) -> float:
    """Median microseconds per ``fn()`` call, replaying a CUDA graph of ``iters`` back-to-back calls.

    ``fn`` must only launch kernels on the current stream (no host sync, no allocation that is freed
    afterwards: preallocate its buffers). It is called once eagerly first, which also compiles kernels.
    """
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        for _ in range(iters):
            fn()
        graph = stream.end_capture()
        graph.upload(stream)
        times = []
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        graph.launch(stream)
        for _ in range(reps):
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times) * 1e3 / iters


def time_eager(fn: Callable[[], None], iters: int = 20, reps: int = 7) -> float:
    """Median microseconds per ``fn()`` call, launched eagerly ``iters`` times between two events."""
    import cupy

    def many():
        for _ in range(iters):
            fn()
    return _median_event_ms(many, reps) * 1e3 / iters


@dataclass(frozen=True)
class Ceilings:
    """What this device sustains, measured in this process: streaming read GB/s, mma.sync bf16 TFLOP/s."""
    read_GBps: float
    mma_TFLOPs: float
    device: str = ""

    def __post_init__(self):
        if not (self.read_GBps > 0 and self.mma_TFLOPs > 0):
            raise ValueError(f"Ceilings: read_GBps and mma_TFLOPs must be positive, got {self.read_GBps}, "
                             f"{self.mma_TFLOPs}")

    def __str__(self) -> str:
        return (f"{self.device or 'device'}: read {self.read_GBps:.0f} GB/s, mma.sync bf16 "
                f"{self.mma_TFLOPs:.0f} TFLOP/s (measured in this run)")


def measure_ceilings(read_bytes: int = 2 << 30) -> Ceilings:
    """Both ceilings on the current device. ``read_bytes``: the streamed buffer (several times the L2)."""
    import cupy
    dev = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return Ceilings(measure_read_bandwidth(read_bytes), measure_mma_bf16_tflops(), name)


if __name__ == "__main__":
    print(measure_ceilings(4 << 30))
