"""A checkpoint whose LoRA is still untrained resumes (real tiny dense model, HF engine): the
engine holds the base weights, so the resume sync is judged against the base's probe, not
against "no previous sync"."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from forkrun import run_cli  # tests/forkrun.py: forked from the preloaded server

from megagrpo.metrics import read_metrics
from megagrpo.testing import tiny_run_config, write_run_config

pytestmark = pytest.mark.slow


def _train(config: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONHASHSEED="0")
    return run_cli(["train", str(config), *extra], env=env, timeout=900)


def test_a_checkpoint_of_steps_that_trained_nothing_resumes(tiny_dense_dir, tmp_path):
    """Step 1 runs at learning rate 0 (the first step of a linear warm-up): its checkpoint
    holds the initial LoRA (B = 0), and --resume continues from it to step 2."""

    def config(max_steps: int) -> Path:
        cfg = tiny_run_config(
            tiny_dense_dir,
            tmp_path,
            "w",
            trainer={"max_steps": max_steps, "warmup_steps": 4, "save_every": 1},
        )
        return write_run_config(tmp_path / f"w{max_steps}.yaml", cfg)

    first = _train(config(1))
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = tmp_path / "w" / "checkpoints" / "step_000001"
    state = torch.load(ckpt / "rank00000.pt", weights_only=True)
    b = [p["param"] for p in state["pieces"] if p["factor"] == "B"]
    assert b and all(not t.any() for t in b)  # untrained: every B still zero
    resumed = _train(config(2), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "w" / "metrics.jsonl")] == [1, 2]
    manifest = json.loads(
        (tmp_path / "w" / "checkpoints" / "step_000002" / "meta.json").read_text()
    )
    assert manifest["step"] == 2
