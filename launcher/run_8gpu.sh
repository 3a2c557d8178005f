#!/usr/bin/env bash
# Serve on 8 GPU(s) of one box, one MPI rank per GPU, tensor parallel 8.
# Usage: launcher/run_8gpu.sh --model DIR --drafter DIR [run.py options...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/nccl_env.sh"
exec mpirun -np 8 ${MPIRUN_ARGS:-} "$here/bind.sh" python -m ddtree_cupy.run --backend cupy "$@"
