"""``trainer.shared_prefix`` through the GRPO loop (bigram policy: no Megatron, no engine):
on by default, the metric in every row, and the same training as the rows (a bigram's logits
read one token, so the segment rows are exact by construction: any difference is in the
batching, the loss head or the metric plumbing)."""

from __future__ import annotations

import pytest
import torch
from test_trainer_loop import _context, _train


def _run(bigram_dir, tmp_path, name: str, **trainer):
    ctx = _context(
        bigram_dir,
        tmp_path,
        name,
        trainer={"max_steps": 2, "save_every": 0, **trainer},
        metrics={"progress_bar": False},
    )
    rows = _train(ctx)
    return rows, [p.detach().clone() for p in ctx.policy.lora_parameters()]


def test_loop_trains_the_same_with_the_prompt_shared(bigram_dir, tmp_path):
    shared, w_shared = _run(bigram_dir, tmp_path, "shared")
    rows, w_rows = _run(bigram_dir, tmp_path, "rows", shared_prefix="false")
    assert [r["train/shared_prefix_fraction"] for r in shared] == [1.0, 1.0]
    assert all("train/shared_prefix_fraction" not in r for r in rows)
    for a, b in zip(shared, rows):
        for key in ("loss/policy", "loss/total", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    for a, b in zip(w_shared, w_rows):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    one, _ = _run(bigram_dir, tmp_path, "one", micro_batch_size=1)  # no group fits: rows
    assert all("train/shared_prefix_fraction" not in r for r in one)
