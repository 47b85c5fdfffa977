"""Save and restore of a :class:`TrainContext` in the checkpoint format
(:mod:`megagrpo.checkpoint.format`): which tensors each rank writes (layout-free LoRA pieces
where the policy has them), the samplers' and the loop's state, and how a resume puts them
back (resharding, changed optimiser settings, carried groups of another group size).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Any

from megagrpo.checkpoint.checks import TRAINER_KEYS, check_trainer_state
from megagrpo.checkpoint.format import (
    LAYOUT_FREE,
    ResumePoint,
    load,
    load_resharded,
    reshardable,
    save,
)
from megagrpo.checkpoint.plain import set_rng_state
from megagrpo.config.loader import written
from megagrpo.errors import CheckpointError
from megagrpo.trainer import minibatch
from megagrpo.trainer.ahead import sampler_states
from megagrpo.trainer.config import RunConfig
from megagrpo.trainer.context import TrainContext
from megagrpo.trainer.resume_check import apply_optimizer_settings, drop_foreign_carry

log = logging.getLogger(__name__)


def checkpoint_meta(cfg: RunConfig) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed (layout, model, LoRA shape)."""
    return {
        "parallel": dataclasses.asdict(cfg.parallel),
        "model": written(cfg)["model"]["hf_path"],  # as written: no environment values
        "lora": dataclasses.asdict(cfg.model.lora),
    }


def problem_set(ids: list[str], dropped: list[str], truncated: list[str]) -> dict[str, Any]:
    """The manifest's record of the training problems (ids in order, as the sampler sees
    them) and of what the prompt-length policy removed or cut."""
    digest = hashlib.sha256("\0".join(ids).encode()).hexdigest()
    return {"count": len(ids), "sha256": digest, "dropped": dropped, "truncated": truncated}


def _rank_state(ctx: TrainContext) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's tensors, and the manifest entries saying how to read them: layout-free
    pieces where the policy has them (:meth:`MegatronPolicy.lora_pieces`), else its own
    state dicts (same layout only). Rank 0's file also holds the carried groups' MoE routing
    (replicated state: one copy)."""
    scheduler = ctx.scheduler.state_dict() if ctx.scheduler else None
    routing = ctx.dynamic.carry_routing() if ctx.comm.is_main else {}
    pieces = ctx.policy.lora_pieces(ctx.optimizer)
    if pieces is None:
        state = {
            "lora": ctx.policy.lora_state_dict(),
            "optimizer": ctx.optimizer.state_dict(),
            "scheduler": scheduler,
            "carry_routing": routing,
        }
        return state, {}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in ctx.optimizer.param_groups]
    state = {
        "pieces": pieces,
        "optimizer_groups": groups,
        "scheduler": scheduler,
        "carry_routing": routing,
    }
    return state, {"lora_layout": LAYOUT_FREE}


def save_checkpoint(ctx: TrainContext, step: int) -> Path:
    """Adapters, optimiser, scheduler and RNGs of every rank; samplers (collective)."""
    rank_state, layout = _rank_state(ctx)
    trainer_state = {
        **sampler_states(ctx),  # (one step ahead: as before the next step's rounds started)
        "loop": {"nonfinite_streak": ctx.nonfinite_streak},
    }
    if ctx.partial is not None:
        trainer_state["partial"] = ctx.partial.state_dict()
    verifiers = ctx.rollouts.verifier_states() if ctx.comm.is_main else None
    if verifiers is not None:  # the next sync after a resume is judged as this run's
        trainer_state["sync"] = {"verifiers": verifiers}
    if ctx.generated is not None:  # saved between two mini-batches of a generated batch
        trainer_state["generated"] = minibatch.state_dict(ctx, ctx.generated)
        rank_state["generated"] = minibatch.rank_state(ctx, ctx.generated)
    path = save(
        ctx.ckpt_root,
        step,
        rank=ctx.comm.rank,
        world_size=ctx.comm.world_size,
        rank_state=rank_state,
        trainer_state=trainer_state,
        meta=checkpoint_meta(ctx.cfg),
        extra={
            "config": written(ctx.cfg),
            "problems": ctx.problem_set,
            "base": ctx.base_fingerprint,
            **layout,
        },
        keep=ctx.cfg.trainer.keep_checkpoints,
        comm=ctx.comm,
    )
    ctx.saved_step = step
    return path


def _restore_tensors(ctx: TrainContext, point: ResumePoint) -> tuple[dict, dict, dict | None, dict]:
    """Policy, optimiser and scheduler state of ``point``; returns ``(rng state of this rank
    or {}, trainer_state, the carried groups' routing or None when only rank 0's file holds
    it, this rank's part of a generated batch saved between two of its mini-batches)``."""
    meta = checkpoint_meta(ctx.cfg)
    if not reshardable(point.manifest):
        rank_state, trainer_state = load(
            point.path, rank=ctx.comm.rank, world_size=ctx.comm.world_size, meta=meta
        )
        ctx.policy.load_lora_state_dict(rank_state["lora"])
        ctx.optimizer.load_state_dict(rank_state["optimizer"])
        if ctx.scheduler is not None and rank_state.get("scheduler"):
            ctx.scheduler.load_state_dict(rank_state["scheduler"])
        routing = rank_state.get("carry_routing") if ctx.comm.is_main else None
        return rank_state["rng"], trainer_state, routing, rank_state.get("generated") or {}
    states, trainer_state = load_resharded(point.path, rank=ctx.comm.rank, meta=meta)
    ctx.policy.load_lora_pieces([p for st in states for p in st["pieces"]], ctx.optimizer)
    for group, saved in zip(ctx.optimizer.param_groups, states[0].get("optimizer_groups") or []):
        group.update({k: v for k, v in saved.items() if k != "params"})
    if ctx.scheduler is not None and states[0].get("scheduler"):
        ctx.scheduler.load_state_dict(states[0]["scheduler"])
    same = len(states) == ctx.comm.world_size
    if not same:
        log.warning(
            "resharding %s: written by %d processes (%s), resumed by %d (%s); LoRA and "
            "optimiser state are copied exactly, RNG streams of ranks >= %d restart from "
            "their seeds",
            point.path,
            len(states),
            point.manifest.get("parallel"),
            ctx.comm.world_size,
            dataclasses.asdict(ctx.cfg.parallel),
            len(states),
        )
    mine = states[ctx.comm.rank] if ctx.comm.rank < len(states) else {}
    generated = dict(mine.get("generated") or {})
    generated["routing"] = (states[0].get("generated") or {}).get("routing") or {}
    return mine.get("rng") or {}, trainer_state, states[0].get("carry_routing") or {}, generated


def _restore_generated(ctx: TrainContext, point: ResumePoint, state: dict, ranks: dict) -> None:
    """The generated batch a checkpoint between two of its mini-batches holds (its engine
    routing is in rank 0's file only)."""
    routing = ranks.get("routing")
    if routing is None:
        rank0, _ = load(
            point.path, rank=0, world_size=ctx.comm.world_size, meta=checkpoint_meta(ctx.cfg)
        )
        routing = (rank0.get("generated") or {}).get("routing") or {}
    ctx.generated = minibatch.restore(ctx, state, ranks, routing, str(point.path))


def _carry_routing_of_rank0(path: Path, world_size: int, cfg: RunConfig) -> dict[str, Any]:
    """The carried groups' routing, kept once in rank 0's file (every rank holds the groups)."""
    state, _ = load(path, rank=0, world_size=world_size, meta=checkpoint_meta(cfg))
    return state.get("carry_routing") or {}


def restore_checkpoint(ctx: TrainContext, point: ResumePoint) -> int:
    """Load ``point`` (from :func:`find_resume_checkpoint`) into ``ctx``; returns its step.
    A layout-free checkpoint loads under any layout / world size (:func:`reshardable`).
    Carried groups of another ``rollout.group_size`` are dropped, and a changed
    ``trainer.lr`` / ``weight_decay`` / ``adam_betas`` is applied to the restored optimiser
    (its state would silently bring the old values back). The engines are synced by the
    caller."""
    rng, trainer_state, routing, generated = _restore_tensors(ctx, point)
    why = check_trainer_state(trainer_state, point.step, str(point.path), TRAINER_KEYS)
    if why:
        raise CheckpointError(why)
    apply_optimizer_settings(ctx.optimizer, ctx.scheduler, ctx.cfg.trainer)
    ctx.sampler.load_state_dict(trainer_state["sampler"])
    if routing is None:
        routing = {}
        if trainer_state["dynamic"].get("carry"):
            routing = _carry_routing_of_rank0(point.path, ctx.comm.world_size, ctx.cfg)
    ctx.dynamic.load_state_dict(trainer_state["dynamic"], routing)
    drop_foreign_carry(ctx.dynamic, ctx.cfg.rollout.group_size)
    if ctx.partial is not None:
        ctx.partial.load_state_dict(trainer_state.get("partial") or {})
    if trainer_state.get("generated"):
        _restore_generated(ctx, point, trainer_state["generated"], generated)
    if rng:
        set_rng_state(rng)
    ctx.step = ctx.saved_step = int(trainer_state["step"])
    ctx.nonfinite_streak = int((trainer_state.get("loop") or {}).get("nonfinite_streak", 0))
    ctx.resumed_verifiers = (trainer_state.get("sync") or {}).get("verifiers")
    log.info("resumed from %s (step %d)", point.path, ctx.step)
    return ctx.step
