"""`rollout.logprobs=sampling` (issue 12: training log-probs at the sampling temperature, as
ms-swift and TRL compute them): the engine returns log-probs of logits / T
(tests/unit/test_rollout_hf.py checks them against transformers, and that they differ from
the raw model's by > 1e-2 at T = 0.6), so the trainer's recomputed old log-probs can only
match them if the trainer divides its logits by T too."""

from __future__ import annotations

import os

import pytest
from forkrun import run_cli  # tests/forkrun.py: forked from the preloaded server

from megagrpo.metrics import read_metrics
from megagrpo.testing import tiny_run_config, write_run_config

pytestmark = pytest.mark.slow


def test_trainer_logprobs_match_the_engines_at_the_sampling_temperature(tiny_moe_dir, tmp_path):
    cfg = tiny_run_config(
        tiny_moe_dir,
        tmp_path,
        "tempered",
        rollout={"engine": "hf", "temperature": 0.6, "logprobs": "sampling"},
        dynamic={"max_resample": 1, "policy": "partial"},  # no carried (stale) groups
        trainer={"max_steps": 2, "old_logprobs": "recompute"},
    )
    path = write_run_config(tmp_path / "tempered.yaml", cfg)
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline")
    proc = run_cli(["train", str(path)], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(tmp_path / "tempered" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # fp32 engine and trainer, weights synced exactly: only summation order differs
        assert r["train/logprob_mismatch_max"] < 1e-4, r["train/logprob_mismatch_max"]
        assert r["loss/ratio_max"] is not None
