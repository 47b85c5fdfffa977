#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh installs on a GPU machine without internet
# (only torch and Triton there) into .whl/ (git-ignored; ~40 MB: pass it along with the
# tree, e.g. as an extra path of the copy).
#
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION]     # default 3.12; e.g. 3.11
#
# Binary wheels are taken for CPython PYTHON_VERSION on manylinux x86_64; run it on any
# machine that reaches PyPI. ONLY="pkg1 pkg2" downloads just those requirement lines.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
ABI=cp${PYVER/./}
DEST=${MEGAGRPO_WHEELS:-.whl}
PY=${PYTHON:-python3}
REQ=scripts/gpu_check_requirements.txt
mkdir -p "$DEST"
set -- -r "$REQ"
if [ -n "${ONLY:-}" ]; then # just those lines, passed as requirements (no temporary file)
  set --
  for p in $ONLY; do
    line=$(grep -i "^$p==" "$REQ") || { echo "gpu_wheels: $p not in $REQ" >&2; exit 2; }
    set -- "$@" "$line"
  done
fi
"$PY" -m pip download --no-deps --only-binary :all: --dest "$DEST" \
  --python-version "$PYVER" --implementation cp --abi "$ABI" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  "$@"
echo "gpu_wheels: $(ls "$DEST" | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST (CPython $PYVER)"
