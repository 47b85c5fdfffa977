#!/usr/bin/env bash
# One node's launcher (run by srun from slurm/grpo_235b.sh, one task per node): torchrun
# starts GPUS_PER_NODE training ranks, each hosting its colocated vLLM engine shard.
#   bash slurm/launch_node.sh CONFIG [--resume] [key=value ...]
set -euo pipefail
CONFIG=$1; shift
NODE_RANK=${SLURM_NODEID:?run me under srun}
NUM_NODES=${SLURM_JOB_NUM_NODES:?run me under srun}
exec torchrun --nnodes="$NUM_NODES" --node-rank="$NODE_RANK" \
  --nproc-per-node="${GPUS_PER_NODE:-8}" \
  --rdzv-id="megagrpo-${SLURM_JOB_ID}" --rdzv-backend=c10d \
  --rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}" \
  -m megagrpo.cli train "$CONFIG" "$@"
