"""Benchmarks: ceilings (read bandwidth, mma.sync rate), per-kernel timings. They print, never assert."""
