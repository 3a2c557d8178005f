# NCCL settings for one box of PCIe GPUs without NVLink (source this file before mpirun).
# Each line says why; measure before changing (bench/allreduce.py).
export NCCL_IB_DISABLE=1          # single node: never probe InfiniBand/RoCE
export NCCL_P2P_LEVEL=SYS         # allow PCIe peer-to-peer even across the CPU interconnect (GPUs 0-3 <-> 4-7)
export NCCL_NVLS_ENABLE=0         # no NVLink SHARP (multicast) on PCIe boxes; also required on the H200 test hosts
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# Decode all-reduces are small (14 KB per token): the low-latency protocol usually wins there. Left to
# NCCL's tuner by default; uncomment to force it and compare with bench/allreduce.py.
# export NCCL_PROTO=LL
