# shellcheck shell=bash
# NVIDIA GB200 NVL72 (Grace aarch64 CPUs, 4 Blackwell GPUs per node, multi-node NVLink inside a rack,
# InfiniBand between racks), e.g. Crusoe Cloud's Slurm. Sourced by slurm/multinode.sbatch on the first node
# when CLUSTER_ENV=gb200; srun passes it on:
#
#   CLUSTER_ENV=gb200 VENV=$PWD/.venv sbatch --nodes 9 slurm/multinode.sbatch   # NPROC_PER_NODE: the 4 GPUs
#
# Keep all nodes of a job inside one IMEX domain (one NVL72 rack) when you can: NVLink then spans the nodes.

# Use the system's NCCL (built for this aarch64 platform, with multi-node NVLink support) instead of the one
# bundled with the torch wheel, and let the loader find the system CUDA libraries.
export LD_PRELOAD=/usr/lib/aarch64-linux-gnu/libnccl.so.2
export LD_LIBRARY_PATH="/usr/lib/aarch64-linux-gnu:/usr/local/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# Interfaces for NCCL's TCP bootstrap (prefixes; the data itself goes over NVLink / InfiniBand).
export NCCL_SOCKET_IFNAME=eth0,en,eth,em,bond
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-eth0}
export NCCL_BUFFSIZE=2097152            # 2 MiB NCCL buffers, as used on these clusters
# export NCCL_MNNVL_ENABLE=1            # insist on multi-node NVLink (default: use it when the IMEX domain allows)
# export NCCL_IB_HCA=mlx5               # restrict NCCL to the InfiniBand HCAs if other NICs get picked

export CUDA_LAUNCH_BLOCKING=0           # asynchronous kernel launches (make sure nothing turned this on)
export PYTHONFAULTHANDLER=1             # a Python traceback on every rank when a rank crashes or hangs
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}   # INFO prints topology (NVLink/NVLS/IB) at startup: use it once

# DCGM profiling holds the GPUs' performance counters; pause it if you profile with torch.profiler/Nsight:
#   srun --ntasks-per-node=1 dcgmi profile --pause      (and --resume afterwards)
