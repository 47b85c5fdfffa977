"""`megagrpo train` with MoE routing replay (issue 16): two steps on a tiny Qwen3-MoE with the
HF engine on CPU, one process; every row logs ``train/routing_agreement`` and the
train/inference log-prob mismatch of the recomputed old log-probs."""

from __future__ import annotations

import os

import pytest
from forkrun import run_cli  # tests/forkrun.py: forked from the preloaded server

from megagrpo.metrics import read_metrics
from megagrpo.testing import tiny_run_config, write_run_config

pytestmark = pytest.mark.slow


def _train(model_dir, out, mode: str, **trainer) -> list[dict]:
    cfg = tiny_run_config(
        model_dir,
        out,
        f"replay_{mode}",
        model={"routing_replay": mode},
        dynamic={"max_resample": 1, "policy": "partial"},  # no carried (stale) groups
        trainer={"max_steps": 2, "old_logprobs": "recompute", **trainer},
    )
    path = write_run_config(out / f"{mode}.yaml", cfg)
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline")
    proc = run_cli(["train", str(path)], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_metrics(out / f"replay_{mode}" / "metrics.jsonl")


@pytest.mark.parametrize("mode, epochs", [("r3", 1), ("r2", 2)])
def test_train_with_routing_replay_logs_agreement(tiny_moe_dir, tmp_path, mode, epochs):
    """r3: the trainer replays the HF engine's experts; fp32 weights synced exactly, so the
    own router agrees everywhere and the recomputed log-probs equal the engine's. r2 (two
    PPO epochs): the second epoch replays the first forward's record; the agreement is
    measured against it. Each epoch is its own optimiser step (``trainer.ppo_epochs``): step 1
    trains the weights that made the record (agreement exactly 1), step 2 the weights one
    update later (below 1 wherever that update moved a selection; the tiny random router's
    near-ties make that likely, so only the bounds are asserted)."""
    rows = _train(tiny_moe_dir, tmp_path, mode, ppo_epochs=epochs)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/skipped_empty_batch"] == 0.0
        agreement = r["train/routing_agreement"]
        assert agreement is not None and 0.5 <= agreement <= 1.0, agreement
        assert r["train/logprob_mismatch_max"] < 1e-4  # fp32 engine vs trainer, same weights
    assert rows[0]["train/routing_agreement"] == 1.0  # r3: the engine's; r2: its own record
    if mode == "r3":
        assert rows[1]["train/routing_agreement"] == 1.0
    else:
        assert [r["train/epoch"] for r in rows] == [1.0, 2.0]
        assert rows[0]["train/grad_norm"] > 0  # the update between them moved the weights
