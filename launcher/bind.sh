#!/usr/bin/env bash
# Per-rank wrapper: pins this rank to the CPUs and memory of its GPU's NUMA node, then execs the command.
# mpirun starts one copy per rank:  mpirun -np 8 launcher/bind.sh python -m ddtree_cupy.run ...
#
# The local rank picks the GPU (ddtree_cupy.dist selects device local_rank % device_count) and the NUMA
# node. GPU_NUMA_NODES lists the node of each GPU in order; the default matches the target box
# (8x RTX PRO 6000: GPUs 0-3 on node 0, 4-7 on node 1). Check yours with `nvidia-smi topo -m`.
set -euo pipefail
local_rank=${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${PMI_LOCAL_RANK:-${SLURM_LOCALID:-0}}}}
read -r -a nodes <<< "${GPU_NUMA_NODES:-0 0 0 0 1 1 1 1}"
node=${nodes[$((local_rank % ${#nodes[@]}))]}
if command -v numactl >/dev/null 2>&1 && [ "${DDTREE_NO_NUMA_BIND:-0}" != 1 ]; then
  exec numactl --cpunodebind="$node" --membind="$node" "$@"
fi
[ "$local_rank" = 0 ] && echo "launcher/bind.sh: numactl not found, running without NUMA binding" >&2
exec "$@"
