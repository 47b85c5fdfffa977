# One obvious way to run things. Every target creates/refreshes .venv first (scripts/setup.sh):
# `make demo` installs what the demo runs, the other targets everything (dev + swift extras).
VENV ?= .venv
# pytest-xdist workers for `make test` (2 on the 2-core CI machine: half the suite waits on
# subprocess start-up and imports, which the second worker overlaps)
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
export WANDB_MODE ?= offline
# Byte code: scripts/setup.sh installs without it (--no-compile) so that each module is compiled
# once, on its first import, and cached. Images that set PYTHONDONTWRITEBYTECODE (ours do)
# turn that cache off: then every Python the suite starts compiles torch, megatron-core and
# vLLM from source again (twice the CPU of importing them). The cache goes outside the source
# tree (.cache/ is ignored by git), so the variable's aim, no .pyc beside the sources, holds.
export PYTHONPYCACHEPREFIX ?= $(CURDIR)/.cache/pycache
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup setup-demo demo test test-fast check lint format
setup:
	MEGAGRPO_VENV=$(VENV) bash scripts/setup.sh dev

setup-demo:
	MEGAGRPO_VENV=$(VENV) bash scripts/setup.sh demo

demo: setup-demo
	$(VENV)/bin/megagrpo train configs/demo_cpu.yaml

# Everything that runs on CPU (unit, gloo multi-process, slow end-to-end, the upstream contract
# tier: tools/upstream_wheels.py fetches the GPU pins' wheels once per machine); what CI runs.
test: setup
	$(PY) tools/upstream_wheels.py >/dev/null
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadscope --durations=25

# Unit tests without the slow and multi-process ones: the edit-test loop (budget: docs/architecture.md).
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not distributed" tests/unit --durations=10

# Format, lint and types: CI runs this before the tests.
check: setup
	$(VENV)/bin/ruff format --check megagrpo tools tests
	$(VENV)/bin/ruff check megagrpo tools tests
	$(VENV)/bin/basedpyright

lint: check

format: setup
	$(VENV)/bin/ruff format megagrpo tools tests
	$(VENV)/bin/ruff check --fix megagrpo tools tests
