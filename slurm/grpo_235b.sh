#!/usr/bin/env bash
# GRPO + LoRA on Qwen3-235B-A22B, multi-node H100 (8 GPUs a node), srun + torchrun.
#
#   bash slurm/submit.sh                             # mkdir -p logs, then sbatch this script
#   bash slurm/submit.sh --nodes=16 -- trainer.max_steps=500   # sbatch flags -- overrides
#   DRY_RUN=1 bash slurm/grpo_235b.sh                # print the commands the real path runs
#   PREFLIGHT=1 bash slurm/submit.sh                 # `megagrpo preflight` first, on the same
#                                                    # allocation and launcher; train if it passes
#   PREFLIGHT=only bash slurm/submit.sh              # preflight alone
#
# Node count, TP/EP/PP and the vLLM layout come from the config (cluster.num_nodes,
# cluster.gpus_per_node, parallel.*, rollout.tensor_parallel_size); the SBATCH --nodes below
# must match cluster.num_nodes (checked). Preemption / time limit: Slurm sends USR1 to this
# script five minutes before the end; it forwards USR1 to every training rank (through the
# job step and slurm/launch_node.sh), the ranks write a checkpoint and exit 0, and only then
# is the job requeued; the next start finds the newest complete checkpoint under
# {trainer.output_dir}/{trainer.name}/checkpoints and passes --resume. A TERM (scancel,
# preemption) is forwarded the same way. The log file is appended to across requeues; its
# folder (logs/) must exist before sbatch: slurm/submit.sh creates it. --mem=0: the job gets
# each node's whole memory (the trainer's offloaded state and vLLM's sleep backups are pinned
# host buffers: plan-memory's "host (pinned)" line against cluster.host_memory_gib); a site's
# default memory limit (DefMemPerNode / DefMemPerCPU) would kill it at the first offload.
#SBATCH --job-name=megagrpo-235b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

REPO=${MEGAGRPO_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
[ -n "${SLURM_SUBMIT_DIR:-}" ] && [ -f "$SLURM_SUBMIT_DIR/slurm/grpo_235b.sh" ] && REPO=$SLURM_SUBMIT_DIR
cd "$REPO"
CONFIG=${CONFIG:-configs/qwen3_235b_a22b.yaml}
HF_CONFIG=${HF_CONFIG:-configs/qwen3_235b_a22b.hf_config.json}
PYTHON=${PYTHON:-python}
DRY_RUN=${DRY_RUN:-0}
PREFLIGHT=${PREFLIGHT:-0}                      # 1: preflight, then train; only: preflight alone
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
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}       # NVLS buffers per communicator: OOM (verl, NeMo-RL)
export NCCL_CROSS_NIC=${NCCL_CROSS_NIC:-0}
export VLLM_ENABLE_V1_MULTIPROCESSING=0       # colocated engine inside each training rank
export WANDB_MODE=${WANDB_MODE:-offline}
export WANDB_DIR=${WANDB_DIR:-$RUN_DIR}
export MEGAGRPO_CACHE=${MEGAGRPO_CACHE:-$RUN_DIR/.cache}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# --- resume when a complete checkpoint exists; a requeue without one starts over ------------
# A run killed before its first checkpoint (node failure, OOM or SIGKILL in the first
# save_every steps) leaves metrics rows and perhaps a .step_*.tmp: --resume finds nothing and
# a plain start is refused. On a requeue of this job (SLURM_RESTART_COUNT > 0) that partial
# run is this job's own, so it starts over with --overwrite: megagrpo moves the partial run
# aside to RUN_DIR.old-<UTC time> (never deleted) and logs where. A first start never does.
RESUME=()
RESTARTS=${SLURM_RESTART_COUNT:-0}
if compgen -G "$RUN_DIR/checkpoints/step_*/meta.json" >/dev/null; then
  RESUME=(--resume)
elif [[ "$RESTARTS" =~ ^[0-9]+$ ]] && [ "$RESTARTS" -gt 0 ]; then
  RESUME=(--overwrite)
  echo "grpo_235b.sh: restart $RESTARTS of job $JOB_ID and no complete checkpoint under" \
       "$RUN_DIR/checkpoints: starting over (--overwrite moves the partial run aside)" >&2
fi

CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-96}
export SRUN_CPUS_PER_TASK=$CPUS_PER_TASK      # Slurm >= 22.05: srun no longer inherits it
export GPUS_PER_NODE
SRUN=(srun --kill-on-bad-exit=1 --nodes="$NUM_NODES" --ntasks-per-node=1
  --cpus-per-task="$CPUS_PER_TASK" bash slurm/launch_node.sh "$CONFIG" "${RESUME[@]}"
  "${OVERRIDES[@]}")
PRE_SRUN=(srun --kill-on-bad-exit=1 --nodes="$NUM_NODES" --ntasks-per-node=1
  --cpus-per-task="$CPUS_PER_TASK" env MEGAGRPO_COMMAND=preflight
  MEGAGRPO_PREFLIGHT_ID="$JOB_ID" bash slurm/launch_node.sh "$CONFIG" "${OVERRIDES[@]}")
PLAN=("$PYTHON" -m megagrpo.cli plan-memory "$CONFIG" "${OVERRIDES[@]}" --hf-config "$HF_CONFIG")

if [ "$DRY_RUN" = 1 ]; then
  echo "# megagrpo GRPO launch (dry run): $NUM_NODES nodes x $GPUS_PER_NODE GPUs, config $CONFIG"
  echo "# sbatch directives: $(sed -n 's/^#SBATCH //p' "${BASH_SOURCE[0]}" | tr '\n' ' ')"
  SAY=${RESUME[*]:-no checkpoint yet}
  if [ "$SAY" = --overwrite ]; then
    SAY="--overwrite (restart $RESTARTS, no complete checkpoint: the partial run moves aside)"
  fi
  echo "# run dir $RUN_DIR; resume: $SAY"
  echo "# env: MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT CUDA_DEVICE_MAX_CONNECTIONS=1" \
       "NCCL_IB_HCA=$NCCL_IB_HCA NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME" \
       "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE SRUN_CPUS_PER_TASK=$SRUN_CPUS_PER_TASK" \
       "WANDB_MODE=$WANDB_MODE"
  echo "mkdir -p $RUN_DIR"
  echo "${PLAN[*]} | tee $RUN_DIR/memory_plan.txt"
  [ "$PREFLIGHT" != 0 ] && echo "${PRE_SRUN[*]}  # preflight: must exit 0"
  [ "$PREFLIGHT" != only ] && echo "${SRUN[*]}"
  echo "# each node's task (slurm/launch_node.sh) runs:"
  for i in "${!NODES[@]}"; do
    echo "[${NODES[$i]}] $(SLURM_NODEID=$i SLURM_JOB_NUM_NODES=$NUM_NODES SLURM_JOB_ID=$JOB_ID \
      DRY_RUN=1 bash slurm/launch_node.sh "$CONFIG" "${RESUME[@]}" "${OVERRIDES[@]}")"
  done
  echo "# on USR1/TERM: scancel --signal=USR1 $JOB_ID (the step's tasks forward it to the" \
       "ranks), wait for the step, then scontrol requeue $JOB_ID"
  echo "# memory plan (megagrpo plan-memory):"
  "${PLAN[@]}"
  exit 0
fi

STOP_SIGNAL=""
on_signal() {  # USR1 before the time limit, or TERM: checkpoint first, requeue after
  STOP_SIGNAL=$1
  echo "grpo_235b.sh: caught SIG$1, asking the training ranks to checkpoint and exit" >&2
  scancel --signal=USR1 "$SLURM_JOB_ID" || true  # every job step (not this batch shell)
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

mkdir -p "$RUN_DIR"
"${PLAN[@]}" | tee "$RUN_DIR/memory_plan.txt"
if [ "$PREFLIGHT" != 0 ]; then  # the exact config on a 2-layer model, same launcher
  "${PRE_SRUN[@]}" || { echo "grpo_235b.sh: preflight failed: not training" >&2; exit 1; }
  [ "$PREFLIGHT" = only ] && exit 0
fi
"${SRUN[@]}" &
STEP=$!
rc=0
while :; do
  wait "$STEP" && rc=0 || rc=$?
  kill -0 "$STEP" 2>/dev/null || break  # a trapped signal interrupted wait: wait again
done
if [ -n "$STOP_SIGNAL" ]; then
  if [ "$rc" = 0 ]; then
    echo "grpo_235b.sh: ranks checkpointed and exited; requeueing job $SLURM_JOB_ID" >&2
    scontrol requeue "$SLURM_JOB_ID"
  else
    echo "grpo_235b.sh: training exited with $rc after SIG$STOP_SIGNAL; not requeueing" >&2
  fi
fi
exit "$rc"
