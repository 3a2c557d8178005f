#!/usr/bin/env bash
# Every GPU check from the source tree, each part under its own time limit, logs into one directory and a
# one-line summary per part at the end (what a machine with a GPU runs).
#   bench/run_gpu.sh [LOGDIR] [PARTS...]     default LOGDIR: bench/results/<UTC timestamp>
# PARTS (default: all, in this order): build tests engine demo step kernels moe attention tree allreduce
# Multi-GPU parts, never in the default: tp (bench/tp_check.py) and allreduce_tp (NCCL across TP_NP GPUs).
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG="${1:-bench/results/$(date -u +%Y%m%dT%H%M%SZ)}"; shift || true
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(build tests engine demo step kernels moe attention tree allreduce)
mkdir -p "$LOG"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$LOG/gpu.txt" 2>&1
summary=(); rc=0
run_part() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1; local r=$?
  [ $r -ne 0 ] && rc=1
  summary+=("$(printf '%-10s rc=%-4s %4ss  %s' "$name" "$r" "$((SECONDS - t0))" \
    "$(grep -E 'passed|failed|error|spec builds' "$LOG/$name.log" | tail -1 | cut -c1-90)")")
}
arch="sm_$(python3 -c 'import cupy; print(cupy.cuda.Device().compute_capability)')"
for p in "${parts[@]}"; do
  case $p in
    build)     run_part build 300 python3 -m ddtree_cupy.build --arch "$arch" ;;
    tests)     run_part tests 400 python3 -m pytest -q -m gpu tests/gpu --ignore=tests/gpu/test_engine.py ;;
    engine)    run_part engine 300 python3 -m pytest -q -m gpu tests/gpu/test_engine.py tests/test_teacher_forced.py ;;
    demo)      run_part demo 120 python3 -m ddtree_cupy.run --demo --backend cupy --json --max-new-tokens 64 ;;
    step)      run_part step 300 python3 -m bench.step --reps 5 --json "$LOG/step.json" ;;
    kernels)   run_part kernels 300 python3 -m bench.kernels --json "$LOG/kernels.json" ;;
    moe)       run_part moe 300 python3 -m bench.moe --out "$LOG/moe.json" ;;
    attention) run_part attention 300 python3 bench/attention.py --out "$LOG/attention.json" ;;
    tree)      run_part tree 200 python3 bench/tree.py --json "$LOG/tree.json" ;;
    allreduce) run_part allreduce 60 python3 bench/allreduce.py --json "$LOG/allreduce.json" ;;
    # several GPUs (TP_NP of them, default 2) and an MPI launcher (MPIRUN, default mpirun) on PATH:
    tp)        run_part tp 600 python3 bench/tp_check.py --np "${TP_NP:-2}" --mpirun "${MPIRUN:-mpirun}" --out "$LOG/tp" ;;
    allreduce_tp) run_part allreduce_tp 120 "${MPIRUN:-mpirun}" -np "${TP_NP:-2}" launcher/bind.sh \
                    python3 bench/allreduce.py --json "$LOG/allreduce_tp.json" ;;
    *) echo "unknown part $p" >&2; rc=2 ;;
  esac
done
echo "logs in $LOG"
printf '%s\n' "${summary[@]}"
exit $rc
