#!/usr/bin/env bash
# Submit slurm/grpo_235b.sh: creates the log folder first (sbatch opens --output=logs/...
# before the job starts, so the batch script cannot create it itself).
#   bash slurm/submit.sh [sbatch flags ...] [-- key=value overrides ...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
FLAGS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do FLAGS+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
mkdir -p logs
exec sbatch "${FLAGS[@]}" slurm/grpo_235b.sh "$@"
