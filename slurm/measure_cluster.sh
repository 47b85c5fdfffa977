#!/usr/bin/env bash
# Calibrate the planner on this cluster before the long job (issue 40): two nodes, a few
# minutes. tools/measure_cluster.py times the engine's collectives at the config's decode and
# prefill message sizes, the trainer's MoE all-to-all, an all-gather inside a node, HBM, pinned
# host copies and the training GEMMs, and writes the JSON that
#   megagrpo plan-memory CONFIG --hf-config HF --hw-file cluster.json
# plans with (and `megagrpo report RUN_DIR --hw-file cluster.json` shows beside the plan).
#
#   sbatch slurm/measure_cluster.sh                    # CONFIG=..., OUT=cluster.json
#   OVERWRITE=1 sbatch slurm/measure_cluster.sh        # replace an existing $OUT (else refused)
#   DRY_RUN=1 bash slurm/measure_cluster.sh            # print the per-node commands
#SBATCH --job-name=megagrpo-measure
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=00:20:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

REPO=${MEGAGRPO_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
[ -n "${SLURM_SUBMIT_DIR:-}" ] && [ -f "$SLURM_SUBMIT_DIR/slurm/measure_cluster.sh" ] && REPO=$SLURM_SUBMIT_DIR
cd "$REPO"
CONFIG=${CONFIG:-configs/qwen3_235b_a22b.yaml}
HF_CONFIG=${HF_CONFIG:-configs/qwen3_235b_a22b.hf_config.json}
OUT=${OUT:-cluster.json}
PYTHON=${PYTHON:-python}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-2}
DRY_RUN=${DRY_RUN:-0}
OVERWRITE=${OVERWRITE:-0}
if [ -e "$OUT" ] && [ "$OVERWRITE" != 1 ]; then  # an earlier measurement: never replaced silently
  echo "measure_cluster.sh: $OUT exists (an earlier measurement): set OUT=another.json, or" \
    "OVERWRITE=1 to replace it" >&2
  exit 2
fi

if [ "$DRY_RUN" = 1 ]; then
  NODES=()
  for i in $(seq 1 "$NUM_NODES"); do NODES+=("$(printf 'h100-node%03d' "$i")"); done
  JOB_ID=DRYRUN
else
  mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  JOB_ID=$SLURM_JOB_ID
  NUM_NODES=${#NODES[@]}
fi
MASTER_ADDR=${NODES[0]}
MASTER_PORT=${MASTER_PORT:-29511}
# the NCCL settings of the training job (slurm/grpo_235b.sh): measure what it will run on
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker0}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export NCCL_CROSS_NIC=${NCCL_CROSS_NIC:-0}

node_cmd() {  # node_cmd NODE_RANK: that node's torchrun line
  CMD=("$PYTHON" -m torch.distributed.run --nnodes="$NUM_NODES" --node-rank="$1"
    --nproc-per-node="$GPUS_PER_NODE" --rdzv-id="megagrpo-measure-$JOB_ID" --rdzv-backend=c10d
    --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" tools/measure_cluster.py "$CONFIG"
    --hf-config "$HF_CONFIG" --out "$OUT")
  [ "$OVERWRITE" = 1 ] && CMD+=(--overwrite)
  return 0
}

if [ "${MEASURE_NODE:-0}" = 1 ]; then  # one srun task: this node's ranks (rank 0 writes $OUT)
  node_cmd "${SLURM_NODEID:?run me under srun}"
  exec "${CMD[@]}"
fi
if [ "$DRY_RUN" = 1 ]; then
  for i in $(seq 0 $((NUM_NODES - 1))); do node_cmd "$i"; echo "[${NODES[$i]}] ${CMD[*]}"; done
  exit 0
fi
srun --nodes="$NUM_NODES" --ntasks-per-node=1 env MEASURE_NODE=1 bash slurm/measure_cluster.sh
echo "measure_cluster.sh: wrote $OUT; plan with: megagrpo plan-memory $CONFIG --hf-config $HF_CONFIG --hw-file $OUT"
