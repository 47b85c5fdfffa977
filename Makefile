# One obvious way to run things. Both targets create/refresh .venv first (scripts/setup.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
export WANDB_MODE ?= offline

.PHONY: setup demo test lint
setup:
	MEGAGRPO_VENV=$(VENV) bash scripts/setup.sh

demo: setup
	$(VENV)/bin/megagrpo train configs/demo_cpu.yaml

test: setup
	$(PY) -m pytest -q -ra --durations=15

lint: setup
	$(VENV)/bin/ruff check megagrpo tools tests
