"""Several optimiser steps per generated batch (``trainer.mini_batches`` = ms-swift's
``steps_per_generation``, ``trainer.ppo_epochs`` = its ``num_iterations``) on the bigram loop
of test_trainer_loop (real config, samplers, micro-batching, loss, optimiser, checkpoints):
one row per optimiser step, ``max_steps`` counting them, old log-probs from before the
batch's first update, the LR schedule over optimiser steps, and a resume between two
mini-batches of one generated batch that continues to the same numbers."""

from __future__ import annotations

import pytest
import torch
from test_trainer_loop import BigramEngine, _context, _train

from megagrpo.errors import ConfigError
from megagrpo.metrics import read_metrics
from megagrpo.trainer.config import TrainerConfig
from megagrpo.trainer.generated import mini_batch_bounds

MULTI = {"mini_batches": 2, "ppo_epochs": 2, "max_steps": 8, "lr": 0.2}
FIXED = {"dynamic": {"enabled": False}}  # every generated batch has batch_groups groups


def _rows(bigram_dir, tmp_path, name, resume=False, **trainer):
    ctx = _context(bigram_dir, tmp_path, name, resume=resume, trainer={**MULTI, **trainer}, **FIXED)
    engine, first = ctx.rollouts.engine, ctx.step + 1
    assert isinstance(engine, BigramEngine)
    return [{"step": first + i, **r} for i, r in enumerate(_train(ctx))], engine


def test_mini_batch_bounds_are_consecutive_and_even():
    assert mini_batch_bounds(8, 2) == [(0, 4), (4, 8)]
    assert mini_batch_bounds(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert mini_batch_bounds(1, 2) == [(0, 1), (1, 1)]  # a short batch: an empty step


def test_config_rules():
    with pytest.raises(ConfigError, match="mini_batches"):
        TrainerConfig(batch_groups=6, mini_batches=4).validate()
    with pytest.raises(ConfigError, match="old_logprobs"):
        TrainerConfig(batch_groups=4, mini_batches=2, old_logprobs="rollout").validate()
    cfg = TrainerConfig(batch_groups=4, mini_batches=2, ppo_epochs=3, max_steps=12)
    assert cfg.updates_per_batch == 6 and cfg.resolved_old_logprobs() == "recompute"
    assert TrainerConfig(max_steps=12, ppo_epochs=3, warmup_ratio=0.25).num_warmup_steps == 3


def test_one_row_per_optimizer_step_and_a_batch_every_four(bigram_dir, tmp_path):
    """mini_batches 2 x ppo_epochs 2: max_steps 8 is 8 optimiser steps on 2 generated
    batches (steps 1 and 5), epoch-major (mini-batch 1, 2, 1, 2); generation metrics in the
    generating step's row only; the engines sleep once per batch and get the weights before
    each generation. The first step of a batch is on-policy (ratio exactly 1: the old
    log-probs are the weights it was generated with); every later step is off-policy against
    those same old log-probs (ratio != 1, the clip bounds it)."""
    rows, engine = _rows(bigram_dir, tmp_path, "multi")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["train/mini_batch"] for r in rows] == [1, 2, 1, 2] * 2
    assert [r["train/epoch"] for r in rows] == [1, 1, 2, 2] * 2
    generated = [r["step"] for r in rows if r["dynamic/gen_batches"] is not None]
    assert generated == [1, 5]
    assert all((r["reward/mean"] is None) == (r["step"] not in (1, 5)) for r in rows)
    assert all(r["train/optimizer_steps"] == 1.0 for r in rows)
    assert engine.calls.count("sleep") == 2
    synced = [r["step"] for r in rows if r["perf/sync_bytes"]]
    assert synced == [4, 8]  # before the next generation and at the end, never in between
    for r in rows:
        on_policy = r["step"] in (1, 5)
        assert (r["loss/ratio_min"] == r["loss/ratio_max"] == 1.0) == on_policy, r["step"]
    assert any(r["loss/clip_frac"] > 0 for r in rows)  # the clip did its job somewhere


def test_lr_schedule_runs_over_optimizer_steps(bigram_dir, tmp_path):
    """cosine with 2 warm-up steps over max_steps = 8 optimiser steps (ms-swift counts
    optimizer steps): the LR of each row is transformers' schedule at that step."""
    from transformers import get_scheduler

    rows, _ = _rows(bigram_dir, tmp_path, "lr", lr_schedule="cosine", warmup_steps=2, min_lr=0.0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.2)
    sched = get_scheduler(
        "cosine_with_min_lr", opt, 2, 8, scheduler_specific_kwargs={"min_lr": 0.0}
    )
    want = []
    for _ in range(8):
        opt.step()
        sched.step()
        want.append(opt.param_groups[0]["lr"])
    assert [r["train/lr"] for r in rows] == pytest.approx(want, rel=1e-12)


def test_resume_between_two_mini_batches_is_exact(bigram_dir, tmp_path):
    """A run killed right after its checkpoint of step 3 (the first mini-batch of the first
    batch's second epoch done, three more steps on the same generated batch to go) resumes to
    the same rows as the uninterrupted run: same old log-probs, groups, advantages, weights
    and optimiser, and the same ``sync/*`` (red team 4, N11: the resumed engines' own first
    sync reset the full-check count and the change test's reference point, so step 4's
    ``sync/full_check_tensors``, ``observed_change``, ``predicted_change`` and
    ``change_error`` differed; the checkpoint now keeps the engines' verification state)."""
    import shutil

    full, _ = _rows(bigram_dir, tmp_path, "full", save_every=3, keep_checkpoints=3)
    assert [r["sync/full_check_tensors"] for r in full if r["perf/sync_bytes"]] == [1.0, 0.0]
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "full", killed)  # as SIGKILL after step 3's checkpoint left it
    for late in ("step_000006", "step_000008"):
        shutil.rmtree(killed / "checkpoints" / late)
    state = killed / "checkpoints" / "step_000003" / "trainer.json"
    assert '"generated"' in state.read_text()
    rest, _ = _rows(bigram_dir, tmp_path, "killed", resume=True, save_every=3, keep_checkpoints=3)
    assert [r["step"] for r in rest] == [4, 5, 6, 7, 8]
    assert [r["step"] for r in read_metrics(killed / "metrics.jsonl")] == list(range(1, 9))
    for a, b in zip(full[3:], rest, strict=True):
        for key, value in a.items():
            if key.startswith("perf/") or key == "sync/engine_s":
                continue
            assert b[key] == value or (value != value and b[key] != b[key]), (a["step"], key)


def test_resume_between_mini_batches_refuses_other_settings(bigram_dir, tmp_path):
    from megagrpo.errors import CheckpointError

    _rows(bigram_dir, tmp_path, "changed", max_steps=2)
    with pytest.raises(CheckpointError, match="mini_batches=2, ppo_epochs=2"):
        _rows(bigram_dir, tmp_path, "changed", resume=True, ppo_epochs=1, max_steps=8)
