"""The GRPO loop: one readable step function, every phase one call.

    sample problems -> generate G answers each + rewards, bounded dynamic sampling (rank 0;
    generation on every rank with sharded rollouts, megagrpo.trainer.sharding)
    -> group advantages -> engine.sleep -> Megatron fwd/bwd, fused loss, micro-batches
    -> optimiser step on LoRA -> engine.wake_up + verified weight sync -> metrics
    -> evaluation / checkpoint

What it deliberately drops: value baselines, routing replay (no engine exposes expert
choices; see megagrpo.trainer.optimize), asynchronous (off-policy) generation.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from megagrpo.algo.advantages import group_advantages
from megagrpo.metrics.names import CORE_METRICS
from megagrpo.trainer import checkpoint
from megagrpo.trainer.context import TrainContext
from megagrpo.trainer.evaluate import evaluate
from megagrpo.trainer.optimize import LOSS_METRICS, train_on_batch
from megagrpo.trainer.rollout_phase import collect_batch
from megagrpo.trainer.sync import sync_weights
from megagrpo.types import Group

log = logging.getLogger(__name__)


def compute_advantages(ctx: TrainContext, groups: list[Group]) -> torch.Tensor:
    """[N, G] group-normalised advantages of the batch (zeros for an empty batch)."""
    if not groups:
        return torch.zeros((0, ctx.cfg.rollout.group_size))
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
    return group_advantages(rewards, scale=ctx.cfg.loss.resolved_advantage_scale())


def batch_metrics(
    ctx: TrainContext, groups: list[Group], gen: dict[str, float]
) -> dict[str, float]:
    """``reward/*`` and ``length/*`` of the trained batch."""
    out: dict[str, float] = {}
    if groups:
        out["reward/mean"] = float(np.mean([r for g in groups for r in g.rewards]))
        out["reward/std"] = float(np.std([r for g in groups for r in g.rewards]))
        for name in ctx.reward_fn.names:
            out[f"reward/{name}/mean"] = float(
                np.mean([v for g in groups for v in g.reward_parts.get(name, [])] or [0.0])
            )
        out["length/mean"] = float(np.mean([n for g in groups for n in g.lengths]))
        out["length/max"] = float(max(n for g in groups for n in g.lengths))
    out["reward/mean_raw"] = gen["raw_reward_mean"]  # first generation, before filtering
    out["length/clip_ratio"] = gen["clipped"] / max(gen["gen_seqs"], 1.0)
    out["length/gen_mean"] = gen["gen_tokens"] / max(gen["gen_seqs"], 1.0)
    return out


def grpo_step(ctx: TrainContext, step: int) -> dict[str, float]:
    """Run GRPO step ``step`` (1-based) and return its metrics row."""
    ctx.timings = {}
    t0 = time.perf_counter()
    with ctx.timed("gen"):  # 1-2: problems -> rollouts -> rewards, dynamic sampling
        batch, gen = collect_batch(ctx, step)
    adv = compute_advantages(ctx, batch.groups)  # 3
    if ctx.engine is not None:
        ctx.engine.sleep()  # 4: free the engine's memory for training
    trained = len(batch.groups) > 0
    with ctx.timed("train"):  # 5: fwd/bwd over micro-batches + LoRA optimiser step
        losses = train_on_batch(ctx, batch.groups, adv) if trained else {}
    with ctx.timed("sync"):  # 6: engine.wake_up + verified weight sync
        sync = sync_weights(ctx) if trained else _wake_only(ctx)
    ctx.step = step
    step_s = time.perf_counter() - t0
    metrics = {**batch.stats, **batch_metrics(ctx, batch.groups, gen), **losses, **sync}
    metrics.update(_perf(ctx, gen, step_s))
    if ctx.sampler is not None:
        metrics.update(ctx.sampler.metrics())
    metrics.update(ctx.reward_fn.pop_metrics())
    metrics["train/skipped_empty_batch"] = float(not trained)
    if _due(step, ctx.cfg.trainer.eval_every, ctx.cfg.trainer.max_steps):  # 7: evaluation
        metrics.update(evaluate(ctx, step))
    row = complete_row(ctx, metrics)
    ctx.logger.log(step, row)  # 8: metrics (rank 0; others log nothing)
    if _due(
        step, ctx.cfg.trainer.save_every or ctx.cfg.trainer.max_steps, ctx.cfg.trainer.max_steps
    ):  # 9: checkpoint (always at the last step)
        save_checkpoint(ctx, step)
    return row


def _wake_only(ctx: TrainContext) -> dict[str, float]:
    if ctx.engine is not None:
        ctx.engine.wake_up()
    return {"perf/sync_bytes": 0.0}


def _perf(ctx: TrainContext, gen: dict[str, float], step_s: float) -> dict[str, float]:
    t = ctx.timings
    return {
        "perf/step_s": step_s,
        "perf/gen_s": t.get("gen", 0.0),
        "perf/train_s": t.get("train", 0.0),
        "perf/sync_s": t.get("sync", 0.0),
        "perf/tokens_per_s": gen["gen_tokens"] / max(step_s, 1e-9),
        "perf/gen_tokens_per_s": gen["gen_tokens"] / max(t.get("gen", 0.0), 1e-9),
        "perf/gen_tokens": gen["gen_tokens"],
    }


def _due(step: int, every: int, last: int) -> bool:
    """Every ``every`` steps and at the last step; never when ``every`` is 0."""
    return every > 0 and (step % every == 0 or step == last)


def complete_row(ctx: TrainContext, metrics: dict[str, float]) -> dict[str, float | None]:
    """The step's row holding every DESIGN.md metric name (None where not measured)."""
    names = list(CORE_METRICS) + [f"reward/{n}/mean" for n in ctx.reward_fn.names]
    row: dict[str, float | None] = {name: None for name in names}
    row.update(metrics)
    for name in LOSS_METRICS:
        row.setdefault(name, None)
    return row


def save_checkpoint(ctx: TrainContext, step: int) -> None:
    """Adapters, optimiser, sampler + dynamic-sampler state and RNGs of every rank."""
    rank_state = {
        "lora": ctx.policy.lora_state_dict(),
        "optimizer": ctx.optimizer.state_dict(),
        "scheduler": ctx.scheduler.state_dict() if ctx.scheduler else None,
    }
    trainer_state = None
    if ctx.comm.is_main:
        trainer_state = {
            "sampler": ctx.sampler.state_dict(),
            "dynamic": ctx.dynamic.state_dict(),
            "engine": getattr(ctx.engine, "state_dict", dict)(),
        }
    checkpoint.save(
        ctx.ckpt_root,
        step,
        rank=ctx.comm.rank,
        world_size=ctx.comm.world_size,
        rank_state=rank_state,
        trainer_state=trainer_state,
        meta=checkpoint_meta(ctx),
        keep=ctx.cfg.trainer.keep_checkpoints,
        comm=ctx.comm,
    )


def checkpoint_meta(ctx: TrainContext) -> dict:
    """What a checkpoint must agree with to be resumed (layout, model, LoRA shape)."""
    from dataclasses import asdict

    return {
        "parallel": asdict(ctx.cfg.parallel),
        "model": ctx.cfg.model.hf_path,
        "lora": asdict(ctx.cfg.model.lora),
    }


def restore_checkpoint(ctx: TrainContext, path) -> int:
    """Load a checkpoint into the context; returns its step. The engine is re-synced after."""
    rank_state, trainer_state = checkpoint.load(
        path, rank=ctx.comm.rank, world_size=ctx.comm.world_size, meta=checkpoint_meta(ctx)
    )
    ctx.policy.load_lora_state_dict(rank_state["lora"])
    ctx.optimizer.load_state_dict(rank_state["optimizer"])
    if ctx.scheduler is not None and rank_state.get("scheduler"):
        ctx.scheduler.load_state_dict(rank_state["scheduler"])
    if ctx.comm.is_main:
        ctx.sampler.load_state_dict(trainer_state["sampler"])
        ctx.dynamic.load_state_dict(trainer_state["dynamic"])
    if (
        ctx.engine is not None
        and trainer_state.get("engine")
        and hasattr(ctx.engine, "load_state_dict")
    ):
        ctx.engine.load_state_dict(trainer_state["engine"])
    checkpoint.set_rng_state(rank_state["rng"])
    ctx.step = int(trainer_state["step"])
    log.info("resumed from %s (step %d)", path, ctx.step)
    return ctx.step


def train(ctx: TrainContext) -> list[dict]:
    """Run steps ``ctx.step + 1 .. max_steps``; returns the rows logged by this process."""
    rows = []
    try:
        for step in range(ctx.step + 1, ctx.cfg.trainer.max_steps + 1):
            rows.append(grpo_step(ctx, step))
    finally:
        ctx.logger.close()
    return rows
