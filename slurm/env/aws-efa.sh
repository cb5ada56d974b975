# shellcheck shell=bash
# AWS p4d/p5/p5e/p5en (A100/H100/H200, EFA network) with the Deep Learning AMI or a ParallelCluster image.
# Sourced by slurm/multinode.sbatch on the first node when CLUSTER_ENV=aws-efa; srun then passes the
# environment on to every node:
#
#   CLUSTER_ENV=aws-efa sbatch --nodes 4 slurm/multinode.sbatch
#
# Not on EFA (g5, g6, ...)? Do not use this file: NCCL then falls back to TCP sockets by itself.

# libfabric talks to the EFA devices; NCCL reaches libfabric through the aws-ofi-nccl plugin.
export FI_PROVIDER=efa
# GPUDirect RDMA: the NIC reads and writes GPU memory directly (p4d and newer).
export FI_EFA_USE_DEVICE_RDMA=1
# Huge pages off: with them on, fork() (data loader workers) can fail with "OSError: Cannot allocate memory".
# Costs a little speed.
export FI_EFA_USE_HUGE_PAGE=0
# Do not force CU_POINTER_ATTRIBUTE_SYNC_MEMOPS on every registered buffer: fewer synchronisations, faster
# FSDP collectives.
export FI_EFA_SET_CUDA_SYNC_MEMOPS=0

# Where the EFA installer and the DLAMI put libfabric and the plugin (newer images: /opt/amazon/ofi-nccl,
# older ones: /opt/aws-ofi-nccl). NCCL loads libnccl-net.so from LD_LIBRARY_PATH.
for d in /opt/amazon/efa/lib /opt/amazon/ofi-nccl/lib /opt/aws-ofi-nccl/lib; do
    if [ -d "$d" ]; then export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
done
# The DLAMI's NCCL instead of the one in the torch wheel (the AWS samples preload it). Uncomment and match
# your CUDA version if the log shows NCCL not finding the plugin ("NET/OFI" lines missing).
# export LD_PRELOAD=/usr/local/cuda-12.8/lib/libnccl.so

# NCCL's own TCP bootstrap must not pick docker bridges, veth pairs or loopback: "^" means "any interface
# except those starting with". eth is excluded too, as in the AWS samples for Ubuntu images, whose ENIs are
# en*; on Amazon Linux 2 (primary interface eth0) remove ",eth".
export NCCL_SOCKET_IFNAME=^docker,lo,veth,eth
# gloo (used by async checkpoint saves) takes one interface name: the one with the default route.
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$(ip -o -4 route show to default 2>/dev/null | awk '{print $5; exit}')}
[ -n "$GLOO_SOCKET_IFNAME" ] || unset GLOO_SOCKET_IFNAME

# Startup banner: one "NET/OFI Initializing aws-ofi-nccl" line per rank shows EFA is in use. WARN once it works.
export NCCL_DEBUG=${NCCL_DEBUG:-INFO}
export NCCL_DEBUG_SUBSYS=${NCCL_DEBUG_SUBSYS:-INIT,NET}

# Hugging Face streaming from many nodes at once: give the hub more time per metadata request (seconds).
export HF_HUB_ETAG_TIMEOUT=60
