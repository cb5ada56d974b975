# shellcheck shell=bash
# OLCF Frontier (AMD MI250X: 8 GCDs per node, each a separate GPU to PyTorch; ROCm; Slingshot network).
# Sourced by slurm/multinode.sbatch on the first node when CLUSTER_ENV=frontier; srun passes it on:
#
#   CLUSTER_ENV=frontier VENV=$PWD/.venv sbatch -A <project> --nodes 8 --time 2:00:00 slurm/multinode.sbatch
#
# PyTorch for ROCm (pip, --index-url https://download.pytorch.org/whl/rocm6.x) sees each GCD as a "cuda"
# device, so train.py needs no change; NPROC_PER_NODE defaults to the 8 GCDs rocm-smi lists.

# Load the ROCm that matches your torch wheel (example versions; `module avail rocm`).
# module load PrgEnv-gnu rocm/6.3.1 craype-accel-amd-gfx90a

# RCCL over Slingshot needs the aws-ofi-rccl plugin (libfabric's cxi provider); build it once against the
# system libfabric and point AWS_OFI_RCCL_DIR at the install (without it RCCL falls back to slow TCP).
AWS_OFI_RCCL_DIR=${AWS_OFI_RCCL_DIR:-$HOME/aws-ofi-rccl}
if [ -d "$AWS_OFI_RCCL_DIR/lib" ]; then
    export LD_LIBRARY_PATH="$AWS_OFI_RCCL_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
    echo "frontier.sh: no $AWS_OFI_RCCL_DIR/lib: RCCL will not use the aws-ofi-rccl plugin" >&2
fi
export NCCL_NET_GDR_LEVEL=3   # GPUDirect RDMA between GCDs and NICs; remove if you see hangs or crashes
export NCCL_CROSS_NIC=1       # let rings/trees use different NICs on different nodes (helps at scale)
export NCCL_IB_TIMEOUT=31     # longer network timeouts for big jobs
# export NCCL_ALGO=TREE       # sometimes faster on Frontier; measure before keeping it

# Bootstrap and gloo on the Slingshot interface: otherwise NCCL/gloo may pick a management interface and
# runs beyond a few hundred nodes fail to connect (gloo carries async checkpoint saves).
export NCCL_SOCKET_IFNAME=hsn0
export GLOO_SOCKET_IFNAME=hsn0

# MIOpen compiles kernels and keeps a sqlite database of them, by default in $HOME; thousands of ranks
# sharing one database on the network filesystem lock each other out. Keep it per job on node-local /tmp
# (MIOpen creates the folder on each node).
export MIOPEN_USER_DB_PATH="/tmp/miopen-cache-${USER:-user}-${SLURM_JOB_ID:-0}"
export MIOPEN_CUSTOM_CACHE_DIR=$MIOPEN_USER_DB_PATH

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # 7 CPU cores per GCD; torch threads would oversubscribe them
# Fewer out-of-memory errors from fragmentation (the ROCm build reads the CUDA name too).
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# Compute nodes have no direct internet: stream datasets from a local copy (HF_HOME on Lustre), or use the
# OLCF proxy for hub downloads.
# export HF_HOME=/lustre/orion/<project>/scratch/$USER/huggingface HF_HUB_OFFLINE=1
# export all_proxy=socks://proxy.ccs.ornl.gov:3128/ http_proxy=http://proxy.ccs.ornl.gov:3128/
# export https_proxy=http://proxy.ccs.ornl.gov:3128/ no_proxy='localhost,127.0.0.0/8,*.ccs.ornl.gov'
