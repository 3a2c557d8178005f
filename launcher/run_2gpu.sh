#!/usr/bin/env bash
# Serve on 2 GPU(s) of one box, one MPI rank per GPU, tensor parallel 2.
# Usage: launcher/run_2gpu.sh --model DIR --drafter DIR [run.py options...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/nccl_env.sh"
exec mpirun -np 2 ${MPIRUN_ARGS:-} "$here/bind.sh" python -m ddtree_cupy.run --backend cupy "$@"
