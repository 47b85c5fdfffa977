"""``loss.kl_in_reward`` (ms-swift's ``--kl_in_reward``, its default for rloo and
reinforce_plus_plus) on the bigram loop of test_trainer_loop: the advantages the trainer
trains on are ms-swift's own ``compute_advantages(kl_in_reward=True)`` of the rewards and
each completion's KL, recomputed here from the policy's and the frozen base's bigram tables
at the time the batch was prepared; and the translated command trains it."""

from __future__ import annotations

import json

import pytest
import torch
from swift_source import swift_function
from test_trainer_loop import _context, _train

from megagrpo.swift.fidelity import blocking
from megagrpo.swift.translate import translate
from megagrpo.trainer import loop

KL = {"backend": "torch", "kl_coef": 0.5, "kl_in_reward": True}


def _bigram_kl(policy_w: torch.Tensor, base_w: torch.Tensor, prompt, completion) -> float:
    """sum_t log pi(x_t | x_t-1) - log pi_ref(x_t | x_t-1) over the completion's tokens."""
    ids = list(prompt) + list(completion)
    prev, nxt = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
    lp = torch.log_softmax(policy_w[prev].double(), -1).gather(1, nxt[:, None])[:, 0]
    lr = torch.log_softmax(base_w[prev].double(), -1).gather(1, nxt[:, None])[:, 0]
    return float((lp - lr)[len(prompt) - 1 :].sum())


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus"])
def test_advantages_are_ms_swifts_with_kl_in_reward(bigram_dir, tmp_path, monkeypatch, estimator):
    compute_advantages = swift_function("rl_core/advantage.py", "compute_advantages")
    ctx = _context(
        bigram_dir,
        tmp_path,
        "kl",
        loss={**KL, "advantage_estimator": estimator, "advantage_scale": "group"},
        trainer={"max_steps": 4, "mini_batches": 2, "lr": 0.3},
        dynamic={"enabled": False},
        metrics={"log_completions": True, "progress_bar": False},
    )
    seen = []
    real = loop.set_advantages

    def spy(ctx_, gb, adv):
        seen.append((gb.groups, ctx_.policy.weight().detach().clone(), [a.clone() for a in adv]))
        real(ctx_, gb, adv)

    monkeypatch.setattr(loop, "set_advantages", spy)
    rows = _train(ctx)
    base = ctx.policy.base  # pyright: ignore[reportAttributeAccessIssue]  (BigramPolicy)
    assert len(seen) == 2  # two generated batches of two optimiser steps each
    penalties = [r["reward/kl_penalty_mean"] for r in rows if "reward/kl_penalty_mean" in r]
    assert len(penalties) == 2 and penalties[1] != 0.0  # the second batch is off the base
    for groups, weight, adv in seen:
        g = groups[0].size
        rewards = torch.tensor([r for gr in groups for r in gr.rewards], dtype=torch.float64)
        kl = torch.tensor(
            [_bigram_kl(weight, base, gr.prompt_ids, c) for gr in groups for c in gr.token_ids],
            dtype=torch.float64,
        )
        want, _ = compute_advantages(
            rewards[:, None], torch.ones(1, dtype=torch.float64), g,
            advantage_estimator=estimator, scale_rewards="group", kl_in_reward=True,
            beta=0.5, kl_values=kl,
        )  # fmt: skip
        torch.testing.assert_close(torch.cat(adv).double(), want, rtol=1e-5, atol=1e-5)
    logged = [json.loads(x) for x in open(tmp_path / "kl" / "completions.jsonl")]
    for step, (_, _, adv) in zip((1, 3), seen):  # the log holds the advantages trained on
        got = [r["advantage"] for r in logged if r["step"] == step]
        assert got == pytest.approx(torch.cat(adv).tolist(), abs=1e-6)


def test_from_swift_trains_kl_in_the_reward():
    """--advantage_estimator rloo (kl_in_reward by default) is translated, not refused."""
    t = translate(
        {"rlhf_type": "grpo", "tuner_type": "lora", "max_steps": 3, "advantage_estimator": "rloo"}
    )
    assert "kl_in_reward" not in {e.flag for e in blocking(t)}
    assert t.overrides["loss.kl_in_reward"] is True and t.overrides["loss.kl_coef"] == 0.04
