#!/usr/bin/env bash
# Submit slurm/grpo_235b.sh: creates the log folder first (sbatch opens --output=logs/...
# before the job starts, so the batch script cannot create it itself).
#   bash slurm/submit.sh [sbatch flags ...] [-- key=value overrides ...]
# Without a --nodes / -N flag the job asks for the config's cluster.num_nodes (CONFIG=...,
# overrides included): grpo_235b.sh's own "#SBATCH --nodes=16" is the 16-node config's, and a
# job whose allocation differs from the config only finds out, and exits 2, once it starts.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
FLAGS=()
NODES_GIVEN=0
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case "$1" in --nodes=*|--nodes|-N|-N*) NODES_GIVEN=1;; esac
  FLAGS+=("$1"); shift
done
[ "${1:-}" = "--" ] && shift
if [ "$NODES_GIVEN" = 0 ]; then
  CONFIG=${CONFIG:-configs/qwen3_235b_a22b.yaml}
  if NODES=$("${PYTHON:-python}" - "$CONFIG" "$@" 2>/dev/null <<'PY'
import sys
from megagrpo.config.loader import load_config
from megagrpo.trainer.config import RunConfig
print(load_config(RunConfig, [sys.argv[1]], sys.argv[2:]).cluster.num_nodes)
PY
  ); then
    FLAGS=("--nodes=$NODES" "${FLAGS[@]}")
  else
    echo "submit.sh: cannot read cluster.num_nodes from $CONFIG here; submitting with" \
         "grpo_235b.sh's #SBATCH --nodes (pass --nodes=N to match the config)" >&2
  fi
fi
mkdir -p logs
exec sbatch "${FLAGS[@]}" slurm/grpo_235b.sh "$@"
