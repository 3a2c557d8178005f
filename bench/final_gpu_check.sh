#!/usr/bin/env bash
# One device call: the engine's GPU tests, the demo on the GPU engine, the rank-shape step benchmark, the
# all-reduce harness and the other GPU tests, each under its own time limit; logs into $1 (default $OUT).
out=${1:-${OUT:-/tmp/ddtree_gpu_out}}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$out/gpu.txt" 2>&1
summary=()
step() {  # name, limit, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1; local rc=$?
  summary+=("$(printf '%-14s rc=%-4s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(grep -E 'passed|failed|error' "$out/$name.log" | tail -1 | cut -c1-90)")")
}
step engine_tests 170 python3 -m pytest -q -m gpu tests/gpu/test_engine.py
step demo_cupy 60 python3 -m ddtree_cupy.run --demo --backend cupy --json --max-new-tokens 64
step step_bench 150 python3 -m bench.step --reps 5 --json "$out/step_h200.json"
step allreduce 25 python3 bench/allreduce.py --tokens 1 8 16 64 160 --json "$out/allreduce_1rank.json"
step gpu_suite 150 python3 -m pytest -q -m gpu tests/gpu --ignore=tests/gpu/test_engine.py
echo; tail -25 "$out/step_bench.log"; echo; tail -3 "$out/demo_cupy.log" | cut -c1-400; echo
printf '%s\n' "${summary[@]}"
