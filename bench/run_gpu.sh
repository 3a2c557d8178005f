#!/usr/bin/env bash
# Every GPU check from the source tree, each part under its own time limit, logs and one results JSON per
# benchmark into one directory, and a short summary table at the end (bench/gpu_summary.py).
#   bench/run_gpu.sh [LOGDIR] [PARTS...]     default LOGDIR: bench/results/<UTC timestamp>
# PARTS (default: all single-GPU parts, in this order):
#   build tests engine demo step longctx prefill kernels moe attention tree allreduce
# Groups, each sized for one run of <= 9 minutes on one H200 (expected durations below):
#   call1 = build tests engine demo               call2 = step longctx allreduce prefill
#   call3 = kernels moe tree, call4 = attention   (the kernel-level tables; not needed for the step's figures)
#   call5 = persistent edges pattn                (the persistent executor's benchmarks)
# Persistent executor parts, not in the default: persistent (bench/persistent.py against today's chain, the
# timeline, each GEMM alone, lateness over 10 launches), edges (bench/persistent_edges.py: a dependency edge
# in the executor against a kernel boundary, with and without PDL), pattn (the attention half's two launches around
# today's attention kernels: their GPU tests, then bench/persistent_attention.py) and patches (bench.ab --waiting: every patch waiting in
# bench/patches against the tree, its GPU tests first; ~8 minutes for one patch: a call of its own; PATCHES="a b"
# picks some by name).
# Multi-GPU parts, never in the default: tp (bench/tp_check.py) and allreduce_tp (NCCL across TP_NP GPUs).
# BUDGET_S (default 530 s when a group is named, else none): the whole run's wall-clock budget; a part whose
# expected duration no longer fits is skipped (said so in the summary; exit status 3 unless a part failed: 1),
# and every part's limit is cut to the time left. Results JSON are named as the figures of record
# (<bench>_<gpu>.json, e.g. step_h200.json); the summary lists them: each replaces bench/results' file of that name.
# Parts sized for a 16 GB card (bench/ci_gpu.sh runs them): step16 (bench.step, STEP_LAYERS layers, default 6),
# kernels16, moe16 (the TP8 expert width only), attention16 (the quick grid).
# Every part appends "name<TAB>rc<TAB>seconds<TAB>result" to LOGDIR/parts.tsv.
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG="${1:-bench/results/$(date -u +%Y%m%dT%H%M%SZ)}"; shift || true
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(build tests engine demo step longctx prefill kernels moe attention tree allreduce)
expanded=(); grouped=0
for p in "${parts[@]}"; do
  case $p in call[1-5]) grouped=1 ;; esac
  case $p in
    call1) expanded+=(build tests engine demo) ;;
    call2) expanded+=(step longctx allreduce prefill) ;;
    call3) expanded+=(kernels moe tree) ;;
    call4) expanded+=(attention) ;;
    call5) expanded+=(persistent edges pattn) ;;
    *) expanded+=("$p") ;;
  esac
done
parts=("${expanded[@]}")
mkdir -p "$LOG"
if [ $grouped -eq 1 ]; then BUDGET_S=${BUDGET_S:-530}; else BUDGET_S=${BUDGET_S:-86400}; fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,memory.total --format=csv > "$LOG/gpu.txt" 2>&1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z' 'a-z')
case $gpu in
  *h200*) TAG=h200 ;; *"rtx pro 6000"*) TAG=pro6000 ;; *h100*) TAG=h100 ;;
  *) TAG=$(echo "${gpu:-gpu}" | tr -c 'a-z0-9\n' '_' | cut -c1-24) ;;
esac
# Expected seconds per part on one H200. Recorded before: the engine tests 31 s, 85 GPU tests in 29 s with
# xdist (bench/results/layer_e_gpu_tests_h200.log), the step benchmark's own 21 s at 9 shapes (step_h200.json's
# runtime_s, without start-up, kernel compilation and leave-one-out). The rest are estimates until a run records
# them (parts.tsv has every part's seconds): the whole GPU suite ~4 min with 12 workers, long context 2 step
# processes of ~1 min; the prefill sweep takes what is left of the budget, at least 120 s, and skips the
# configurations that would not fit in it.
declare -A EXPECT=([build]=120 [tests]=240 [engine]=60 [demo]=40 [step]=120 [longctx]=150 [prefill]=120
                   [kernels]=200 [moe]=150 [attention]=150 [tree]=60 [allreduce]=30 [tp]=300 [allreduce_tp]=60
                   [persistent]=150 [edges]=120 [pattn]=150 [patches]=480)
: > "$LOG/parts.tsv"
rc=0
run_part() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET_S - SECONDS)) exp=${EXPECT[$name]:-60}
  if [ "$exp" -gt "$left" ]; then
    printf '%s\t%s\t%s\t%s\n' "$name" skip 0 "skipped: expects ${exp} s, ${left} s of BUDGET_S left" >> "$LOG/parts.tsv"
    [ $rc -eq 0 ] && rc=3     # the run is not complete: exit 3 unless something failed
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1; local r=$?
  [ $r -ne 0 ] && rc=1
  local line
  line=$(grep -E 'passed|failed|error|spec builds|wrote ' "$LOG/$name.log" | tail -1 | cut -c1-100)
  [ $r -eq 124 ] && line="timed out after ${limit} s; $line"
  printf '%s\t%s\t%s\t%s\n' "$name" "$r" "$((SECONDS - t0))" "$line" >> "$LOG/parts.tsv"
}
arch="sm_$(python3 -c 'import cupy; print(cupy.cuda.Device().compute_capability)')"
xdist=()
python3 -c 'import xdist' 2>/dev/null && xdist=(-n "${TEST_WORKERS:-12}")
for p in "${parts[@]}"; do
  case $p in
    build)     run_part build 300 python3 -m ddtree_cupy.build --arch "$arch" ;;
    tests)     run_part tests 400 python3 -m pytest -q "${xdist[@]}" -m gpu tests/gpu --ignore=tests/gpu/test_engine.py ;;
    engine)    run_part engine 300 python3 -m pytest -q -m gpu tests/gpu/test_engine.py tests/test_teacher_forced.py ;;
    demo)      run_part demo 120 python3 -m ddtree_cupy.run --demo --backend cupy --json --max-new-tokens 64 ;;
    step)      run_part step 300 python3 -m bench.step --stages 0 --reps 5 --pdl 1 --loo 1 --json "$LOG/step_$TAG.json" ;;
    longctx)   run_part longctx 300 python3 -m bench.longctx --json "$LOG/longctx_$TAG.json" ;;
    prefill)   pb=$((BUDGET_S - SECONDS - 30)); [ "$pb" -gt "${PREFILL_BUDGET_S:-300}" ] && pb=${PREFILL_BUDGET_S:-300}
               run_part prefill 360 python3 -m bench.prefill --budget-s "$pb" --json "$LOG/prefill_$TAG.json" ;;
    kernels)   run_part kernels 300 python3 -m bench.kernels --json "$LOG/kernels_$TAG.json" ;;
    moe)       run_part moe 300 python3 -m bench.moe --out "$LOG/moe_$TAG.json" ;;
    attention) run_part attention 300 python3 bench/attention.py --out "$LOG/attention_$TAG.json" ;;
    tree)      run_part tree 200 python3 bench/tree.py --json "$LOG/tree_$TAG.json" ;;
    persistent) run_part persistent 300 python3 -m bench.persistent --timeline --gemm --repeat 10 \
                 --json "$LOG/persistent_$TAG.json" ;;
    edges)     run_part edges 240 python3 -m bench.persistent_edges --json "$LOG/persistent_edges_$TAG.json" ;;
    pattn)     run_part pattn 300 bash -c "python3 -m pytest -q -m gpu tests/gpu/test_persistent_attention.py && \
                 python3 -m bench.persistent_attention --timeline --json $LOG/persistent_attention_$TAG.json" ;;
    patches)   run_part patches 560 python3 -m bench.ab --waiting ${PATCHES:+--only $PATCHES} --rounds 2 --timeout 170 \
                 --out "$LOG/ab" ;;
    allreduce) run_part allreduce 60 python3 bench/allreduce.py --json "$LOG/allreduce_$TAG.json" ;;
    step16)    run_part step16 300 python3 -m bench.step --layers "${STEP_LAYERS:-6}" --reps 5 --stages 0 \
                 --json "$LOG/step16.json" ;;
    kernels16) run_part kernels16 300 python3 -m bench.kernels --quick --json "$LOG/kernels16.json" ;;
    moe16)     run_part moe16 300 python3 -m bench.moe --quick --widths 256 --out "$LOG/moe16.json" ;;
    attention16) run_part attention16 300 python3 bench/attention.py --quick --out "$LOG/attention16.json" ;;
    # several GPUs (TP_NP of them, default 2) and an MPI launcher (MPIRUN, default mpirun) on PATH:
    tp)        run_part tp 600 python3 bench/tp_check.py --np "${TP_NP:-2}" --mpirun "${MPIRUN:-mpirun}" --out "$LOG/tp" ;;
    allreduce_tp) run_part allreduce_tp 120 "${MPIRUN:-mpirun}" -np "${TP_NP:-2}" launcher/bind.sh \
                    python3 bench/allreduce.py --json "$LOG/allreduce_tp${TP_NP:-2}_$TAG.json" ;;
    *) echo "unknown part $p" >&2; printf '%s\t%s\t%s\t%s\n' "$p" 2 0 "unknown part" >> "$LOG/parts.tsv"; rc=2 ;;
  esac
done
echo "logs in $LOG"
python3 bench/gpu_summary.py "$LOG" || rc=1
exit $rc
