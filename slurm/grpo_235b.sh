#!/usr/bin/env bash
# GRPO + LoRA on Qwen3-235B-A22B, multi-node H100 (8 GPUs a node), srun + torchrun.
#
#   sbatch slurm/grpo_235b.sh                        # CONFIG=configs/qwen3_235b_a22b.yaml
#   sbatch --nodes=16 slurm/grpo_235b.sh trainer.max_steps=500   # extra args: overrides
#   DRY_RUN=1 bash slurm/grpo_235b.sh                # print per-node commands + memory plan
#
# Node count, TP/EP/PP and the vLLM layout come from the config (cluster.num_nodes,
# parallel.*, rollout.tensor_parallel_size); the SBATCH --nodes below must match
# cluster.num_nodes (checked). Preemption / time limit: Slurm sends USR1 five minutes
# before the end, the job requeues itself, and the next start finds the newest complete
# checkpoint under {trainer.output_dir}/{trainer.name}/checkpoints and passes --resume.
#SBATCH --job-name=megagrpo-235b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

REPO=${MEGAGRPO_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
[ -n "${SLURM_SUBMIT_DIR:-}" ] && [ -f "$SLURM_SUBMIT_DIR/slurm/grpo_235b.sh" ] && REPO=$SLURM_SUBMIT_DIR
cd "$REPO"
CONFIG=${CONFIG:-configs/qwen3_235b_a22b.yaml}
HF_CONFIG=${HF_CONFIG:-configs/qwen3_235b_a22b.hf_config.json}
PYTHON=${PYTHON:-python}
DRY_RUN=${DRY_RUN:-0}
OVERRIDES=("$@")

# --- what the config asks for -------------------------------------------------------------
read -r NUM_NODES GPUS_PER_NODE RUN_DIR < <("$PYTHON" - "$CONFIG" "${OVERRIDES[@]}" <<'PY'
import sys
from megagrpo.config.loader import load_config
from megagrpo.trainer.config import RunConfig
c = load_config(RunConfig, [sys.argv[1]], sys.argv[2:])
print(c.cluster.num_nodes, c.cluster.gpus_per_node, f"{c.trainer.output_dir}/{c.trainer.name}")
PY
)

if [ "$DRY_RUN" = 1 ]; then
  NODES=()
  for i in $(seq 1 "$NUM_NODES"); do NODES+=("$(printf 'h100-node%03d' "$i")"); done
  JOB_ID=DRYRUN
else
  mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  JOB_ID=$SLURM_JOB_ID
  if [ "${#NODES[@]}" -ne "$NUM_NODES" ]; then
    echo "grpo_235b.sh: allocation has ${#NODES[@]} nodes, config cluster.num_nodes=$NUM_NODES" >&2
    exit 2
  fi
fi
MASTER_ADDR=${NODES[0]}
MASTER_PORT=${MASTER_PORT:-29500}

# --- environment for NCCL, Megatron, vLLM, W&B ---------------------------------------------
export MASTER_ADDR MASTER_PORT
export CUDA_DEVICE_MAX_CONNECTIONS=1          # Megatron TP/SP comm-compute overlap ordering
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1      # fail fast instead of hanging on a dead rank
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}       # InfiniBand HCAs (site-specific)
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker0}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-1}
export NCCL_CROSS_NIC=${NCCL_CROSS_NIC:-0}
export VLLM_ENABLE_V1_MULTIPROCESSING=0       # colocated engine inside each training rank
export WANDB_MODE=${WANDB_MODE:-offline}
export WANDB_DIR=${WANDB_DIR:-$RUN_DIR}
export MEGAGRPO_CACHE=${MEGAGRPO_CACHE:-$RUN_DIR/.cache}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# --- resume when a complete checkpoint exists ----------------------------------------------
RESUME=()
if compgen -G "$RUN_DIR/checkpoints/step_*/meta.json" >/dev/null; then RESUME=(--resume); fi

node_cmd() {  # node_cmd RANK -> the command one node runs
  echo "torchrun --nnodes=$NUM_NODES --node-rank=$1 --nproc-per-node=$GPUS_PER_NODE" \
       "--rdzv-id=megagrpo-$JOB_ID --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT" \
       "-m megagrpo.cli train $CONFIG ${RESUME[*]} ${OVERRIDES[*]}"
}

if [ "$DRY_RUN" = 1 ]; then
  echo "# megagrpo GRPO launch (dry run): $NUM_NODES nodes x $GPUS_PER_NODE GPUs, config $CONFIG"
  echo "# run dir $RUN_DIR; resume: ${RESUME[*]:-no checkpoint yet}"
  echo "# env: MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT CUDA_DEVICE_MAX_CONNECTIONS=1" \
       "NCCL_IB_HCA=$NCCL_IB_HCA NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME WANDB_MODE=$WANDB_MODE"
  for i in "${!NODES[@]}"; do
    echo "[${NODES[$i]}] srun --nodes=1 --ntasks=1 -w ${NODES[$i]} $(node_cmd "$i")"
  done
  echo "# memory plan (megagrpo plan-memory):"
  "$PYTHON" -m megagrpo.cli plan-memory "$CONFIG" "${OVERRIDES[@]}" --hf-config "$HF_CONFIG"
  exit 0
fi

requeue() {  # USR1 before the time limit, or preemption: requeue; the next start resumes
  echo "grpo_235b.sh: caught signal, requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
}
trap requeue USR1 TERM

mkdir -p logs "$RUN_DIR"
"$PYTHON" -m megagrpo.cli plan-memory "$CONFIG" "${OVERRIDES[@]}" --hf-config "$HF_CONFIG" \
  | tee "$RUN_DIR/memory_plan.txt"
srun --kill-on-bad-exit=1 --nodes="$NUM_NODES" --ntasks-per-node=1 \
  bash slurm/launch_node.sh "$CONFIG" "${RESUME[@]}" "${OVERRIDES[@]}" &
wait $!
