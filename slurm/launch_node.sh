#!/usr/bin/env bash
# One node's launcher (run by srun from slurm/grpo_235b.sh, one task per node): torchrun
# starts GPUS_PER_NODE training ranks, each hosting its colocated vLLM engine shard.
#   bash slurm/launch_node.sh CONFIG [--resume] [key=value ...]
#   MEGAGRPO_COMMAND=preflight bash slurm/launch_node.sh CONFIG [key=value ...]  # preflight
#   DRY_RUN=1 SLURM_NODEID=0 SLURM_JOB_NUM_NODES=16 ... bash slurm/launch_node.sh ...  # print
#
# Signals: USR1 or TERM are forwarded to the training ranks (torchrun's children), which
# checkpoint and exit 0 (the trainer's contract); torchrun then exits 0 and so does this
# script. torchrun itself is not signalled: its agent would tear the ranks down with SIGTERM
# and a short grace period, before a 235B checkpoint is written.
set -euo pipefail
CONFIG=$1; shift
NODE_RANK=${SLURM_NODEID:?run me under srun}
NUM_NODES=${SLURM_JOB_NUM_NODES:?run me under srun}
CMD=(torchrun --nnodes="$NUM_NODES" --node-rank="$NODE_RANK"
  --nproc-per-node="${GPUS_PER_NODE:-8}"
  --rdzv-id="megagrpo-${SLURM_JOB_ID:-local}" --rdzv-backend=c10d
  --rdzv-endpoint="${MASTER_ADDR:?}:${MASTER_PORT:?}"
  -m megagrpo.cli "${MEGAGRPO_COMMAND:-train}" "$CONFIG" "$@")

if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "${CMD[*]}"
  exit 0
fi

"${CMD[@]}" &
TORCHRUN=$!
forward() {  # forward() SIGNAL: to the ranks (children of torchrun), by parent pid
  echo "launch_node.sh[$NODE_RANK]: forwarding SIG$1 to the training ranks" >&2
  pkill "-$1" -P "$TORCHRUN" || true
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
rc=0
while :; do
  wait "$TORCHRUN" && rc=0 || rc=$?
  kill -0 "$TORCHRUN" 2>/dev/null || break  # a trapped signal interrupted wait: wait again
done
exit "$rc"
