"""Strict device mode around real train steps (issue 11, items 1-2): on CPU the compute device
is emulated as ``cuda:0``, so a host tensor handed to a collective (NCCL's rule) or to the loss
(the Triton launch's rule) raises DeviceError, as it would on a GPU. One step with a weight
sync (merged export, probe) and evaluation must pass under it, for a dense model with sequence
lengths that need no padding and for the MoE model.

Before the trainer kept its reductions and loss inputs on ``ParallelGroups.device`` this failed
at the first `sum_over` of the micro-batch totals (a host float64 tensor all-reduced)."""

from __future__ import annotations

import pytest
import torch

from megagrpo.config import load_config
from megagrpo.parallel.strict import DeviceError, check_on_device, strict_devices
from megagrpo.testing import DEMO_EVAL, tiny_run_config, write_run_config
from megagrpo.trainer.config import RunConfig


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_train_step_and_sync_under_strict_devices(kind, tiny_dense_dir, tiny_moe_dir, tmp_path):
    from megagrpo.commands.train import host_modules
    from megagrpo.trainer.loop import train
    from megagrpo.trainer.setup import build_context, shutdown

    model_dir = tiny_dense_dir if kind == "dense" else tiny_moe_dir
    cfg = tiny_run_config(
        model_dir,
        tmp_path,
        kind,
        data={
            "train": tiny_run_config(model_dir, tmp_path, kind)["data"]["train"],
            "eval": [str(DEMO_EVAL)],
        },
        dynamic={"enabled": False},
        loss={"kl_coef": 0.01},
        trainer={
            "max_steps": 1,
            "old_logprobs": "recompute",
            "eval_every": 1,
            "eval_max_problems": 2,
            "export_adapter": False,
        },
    )
    run = load_config(RunConfig, [write_run_config(tmp_path / f"{kind}.yaml", cfg)])
    ctx = build_context(run)
    try:
        with strict_devices(ctx.pgs, host_modules=host_modules(ctx.rollouts.engine)) as dev:
            assert dev.type == "cuda"  # emulated: host tensors are now "elsewhere"
            rows = train(ctx)
    finally:
        shutdown(ctx)
    assert rows[0]["train/skipped_empty_batch"] == 0.0 and rows[0]["perf/sync_bytes"] > 0
    assert rows[0]["eval/num_problems"] == 2.0


def test_strict_mode_catches_a_host_tensor_in_the_loss(tiny_dense_dir):
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    pgs = init_parallel(ParallelConfig())
    try:
        with strict_devices(pgs), pytest.raises(DeviceError, match="target_ids"):
            logits = torch.zeros(2, 3, device=pgs.device)
            check_on_device("loss", logits=logits, target_ids=torch.zeros(2, dtype=torch.long))
    finally:
        destroy_parallel()
