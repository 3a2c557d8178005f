#!/usr/bin/env bash
# The GPU suite of a CI machine with one 16 GB card (RTX 5070 Ti, sm_120): the kernels built for the card's own
# architecture, every GPU test (those marked big_gpu skip with the reason where the card has less memory than
# they need), the engine tests and demo, and short benchmarks sized for 16 GB; then a summary table (parts,
# return codes, seconds, the largest per-test CuPy pool footprints) in OUT/summary.md.
#
#   bash bench/ci_gpu.sh [OUT] [--limit-gb G] [PARTS...]
#     OUT          log directory (default bench/results/ci_<UTC timestamp>)
#     --limit-gb G emulate a smaller card: CUPY_GPU_MEMORY_LIMIT = G GiB for every part (CuPy's pool only; the
#                  CUDA context and library workspaces come on top). A 16 GB card leaves CuPy about 15.5 GiB.
#     PARTS        default: build tests engine demo step16 kernels16 moe16 attention16 tree (bench/run_gpu.sh);
#                  parts run in separate calls with the same OUT add up in one summary.
cd "$(dirname "$0")/.."
OUT="bench/results/ci_$(date -u +%Y%m%dT%H%M%SZ)"
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then OUT=$1; shift; fi
if [ "${1:-}" = "--limit-gb" ]; then
  [ -n "${2:-}" ] || { echo "--limit-gb needs a size in GiB" >&2; exit 2; }
  CUPY_GPU_MEMORY_LIMIT=$(python3 -c "import sys; print(int(float(sys.argv[1]) * 2**30))" "$2") || exit 2
  export CUPY_GPU_MEMORY_LIMIT; shift 2
fi
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(build tests engine demo step16 kernels16 moe16 attention16 tree)
mkdir -p "$OUT"
export DDT_GPU_MEM_LOG="$(cd "$OUT" && pwd)/gpu_mem.txt"     # the tests run from other directories too
t0=$SECONDS
bash bench/run_gpu.sh "$OUT" "${parts[@]}"; rc=$?
echo "$((SECONDS - t0)) ${parts[*]}" >> "$OUT/durations.txt"
python3 - "$OUT" <<'PY'
import os, sys
out = sys.argv[1]
lim = os.environ.get("CUPY_GPU_MEMORY_LIMIT")
gpu = open(os.path.join(out, "gpu.txt")).read().strip().splitlines()[-1] if os.path.exists(os.path.join(out, "gpu.txt")) else "?"
lines = [f"# GPU suite: {gpu}", "",
         f"CuPy memory limit: {int(lim) / 2**30:.2f} GiB" if lim else "CuPy memory limit: none (the whole card)", "",
         "| part | rc | seconds | result |", "|---|---|---|---|"]
total = 0
tsv = os.path.join(out, "parts.tsv")
for row in (open(tsv) if os.path.exists(tsv) else []):
    name, rc, sec, res = (row.rstrip("\n").split("\t") + [""] * 4)[:4]
    total += int(sec)
    lines.append(f"| {name} | {rc} | {sec} | {res.replace('|', '/')} |")
lines += ["", f"total: {total} s ({total / 60:.1f} min)"]
mem = os.path.join(out, "gpu_mem.txt")
if os.path.exists(mem):
    rows = sorted((int(l.split(" ", 1)[0]), l.split(" ", 1)[1].strip()) for l in open(mem) if l.strip())
    lines += ["", f"largest CuPy pool footprints of {len(rows)} GPU tests:", "", "| GB | test |", "|---|---|"]
    lines += [f"| {b / 1e9:.2f} | {t} |" for b, t in rows[::-1][:10]]
open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
exit $rc
