#!/usr/bin/env bash
# Run the kernel GPU tests and benchmarks from the source tree, logging to a directory.
#   bench/run_gpu.sh [LOGDIR]        (default: bench/results/<UTC timestamp>)
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="${1:-bench/results/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$LOG"
rc=0
python -m ddtree_cupy.build --arch "sm_$(python -c 'import cupy; print(cupy.cuda.Device().compute_capability)')" \
    > "$LOG/build.txt" 2>&1 || rc=1
tail -1 "$LOG/build.txt"
python -m pytest -q -m gpu tests/gpu/test_gemm.py tests/gpu/test_layer_kernels.py 2>&1 | tee "$LOG/tests.txt" | tail -15 || rc=1
python -m bench.kernels ${BENCH_ARGS:-} --json "$LOG/kernels.json" 2>&1 | tee "$LOG/kernels.txt" || rc=1
echo "logs in $LOG (rc=$rc)"
exit $rc
