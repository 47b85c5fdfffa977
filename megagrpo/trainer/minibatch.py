"""Several optimiser steps per generated batch (ms-swift's ``steps_per_generation`` and
``num_iterations``, the GRPO paper's mu; PPO's mini-batches and epochs).

A generated batch of ``trainer.batch_groups`` groups is split into ``trainer.mini_batches``
mini-batches of consecutive groups; each is one optimiser step, and the pass over all of
them repeats ``trainer.ppo_epochs`` times (epoch-major: mini-batch 1, 2, ..., then 1, 2, ...
again, as ms-swift serves its buffered inputs). Advantages are computed once over the whole
generated batch; the behaviour (old) and reference log-probs of every mini-batch are
computed before the batch's first update, so from the second step on the ratio departs from
1 and the clip bounds the move, as in ms-swift (which computes them while it generates).
Each optimiser step is one loop step: ``trainer.max_steps`` counts them, the learning-rate
schedule runs over them and every step has its metrics row.

A checkpoint between two steps of one generated batch holds it: the groups and advantages
in ``trainer.json`` (plain data), this rank's recomputed old / reference log-probs (and r2's
recorded routing) in its rank file, the engine's routing in rank 0's. A resume rebuilds the
micro-batches from the groups (deterministic) and continues with the next mini-batch, to the
same numbers as the uninterrupted run; under the layout that wrote it only (the log-probs
are this rank's share).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from megagrpo.checkpoint.values import GENERATED_VERSION
from megagrpo.errors import CheckpointError
from megagrpo.model.routing import Routing
from megagrpo.trainer.batch import has_rollout_logprobs
from megagrpo.trainer.context import TrainContext
from megagrpo.trainer.generated import Generated, Update
from megagrpo.trainer.optimize import (
    behaviour_logprobs,
    logprob_mismatch,
    optimizer_step,
    prepare_update,
    reuses_training_forward,
)
from megagrpo.types import Group, Problem

STATE_VERSION = GENERATED_VERSION


def new_batch(ctx: TrainContext, step: int, groups: list[Group], adv: list[torch.Tensor]):
    """The :class:`Generated` batch of step ``step`` (``trainer.mini_batches`` x
    ``ppo_epochs`` steps on it)."""
    tcfg = ctx.cfg.trainer
    return Generated(step, groups, list(adv), tcfg.mini_batches, tcfg.ppo_epochs)


def _prepare_updates(ctx: TrainContext, gb: Generated) -> list[Update]:
    """Every mini-batch's micro-batches (collective), without log-probs."""
    reuse = reuses_training_forward(ctx.cfg)
    return [prepare_update(ctx, gb.groups[lo:hi], gb.adv[lo:hi], reuse) for lo, hi in gb.bounds()]


def prepare(ctx: TrainContext, gb: Generated) -> None:
    """Micro-batches and behaviour / reference log-probs of every mini-batch, under the
    weights the batch was generated with (before its first update). Collective."""
    gb.updates = _prepare_updates(ctx, gb)
    for (lo, hi), u in zip(gb.bounds(), gb.updates):
        behaviour_logprobs(ctx, u, has_rollout_logprobs(gb.groups[lo:hi]))


def train_next(ctx: TrainContext, gb: Generated) -> dict[str, float]:
    """One optimiser step on the next mini-batch (preparing the batch first, at its first
    update); its metrics row entries (:func:`~megagrpo.trainer.optimize.optimizer_step`)."""
    if gb.updates is None:
        prepare(ctx, gb)
    assert gb.updates is not None
    return optimizer_step(ctx, gb.updates[gb.index]) | gb.position()


# ----------------------------------------------------------------------------- checkpoint


def _layout(ctx: TrainContext) -> dict[str, Any]:
    return {"world_size": ctx.comm.world_size, **dataclasses.asdict(ctx.cfg.parallel)}


def state_dict(ctx: TrainContext, gb: Generated) -> dict[str, Any]:
    """``trainer.json``'s part: the groups (routing aside), advantages and progress."""
    return {
        "version": STATE_VERSION,
        "step": gb.step,
        "groups": [dataclasses.asdict(dataclasses.replace(g, routing=[])) for g in gb.groups],
        "adv": [a.tolist() for a in gb.adv],
        "mini_batches": gb.mini_batches,
        "epochs": gb.epochs,
        "done": gb.done,
        "prepared": gb.updates is not None,
        "layout": _layout(ctx),
    }


def rank_state(ctx: TrainContext, gb: Generated) -> dict[str, Any]:
    """This rank's file's part: old / reference log-probs per mini-batch and micro-batch
    (host tensors), r2's recorded routing, and on rank 0 the engine's routing of the groups."""

    def host(xs: list | None) -> list | None:
        return None if xs is None else [None if x is None else x.detach().cpu() for x in xs]

    out: dict[str, Any] = {}
    if gb.updates is not None:
        out["old"] = [host(u.old) if not u.reused else None for u in gb.updates]
        out["ref"] = [host(u.ref) for u in gb.updates]
        out["r2"] = [_recorded(u) for u in gb.updates]
    if ctx.comm.is_main:
        out["routing"] = {
            f"{i}.{j}": r for i, g in enumerate(gb.groups) for j, r in enumerate(g.routing)
        }
    return out


def _recorded(u: Update) -> list | None:
    if u.plan is None or u.plan.mode != "r2":
        return None
    return [
        None if (r := u.plan.recorded.get(i)) is None or r.indices is None else r.indices.cpu()
        for i in range(len(u.mbs))
    ]


def restore(
    ctx: TrainContext,
    state: Mapping[str, Any],
    ranks: Mapping[str, Any],
    routing: Mapping[str, Any],
    where: str,
) -> Generated:
    """The batch :func:`state_dict` / :func:`rank_state` saved (``routing``: rank 0's engine
    routing); CheckpointError naming ``where`` when it cannot continue exactly."""
    tcfg = ctx.cfg.trainer
    saved = (state.get("mini_batches"), state.get("epochs"))
    if saved != (tcfg.mini_batches, tcfg.ppo_epochs):
        raise CheckpointError(
            f"{where}: saved between two optimiser steps of a generated batch made with "
            f"trainer.mini_batches={saved[0]}, ppo_epochs={saved[1]}; this run has "
            f"{tcfg.mini_batches}, {tcfg.ppo_epochs}: resume with the saved values"
        )
    if state.get("layout") != _layout(ctx):
        raise CheckpointError(
            f"{where}: saved between two optimiser steps of a generated batch under "
            f"{state.get('layout')}; its old log-probs are per rank, so it resumes under that "
            f"layout only (this run: {_layout(ctx)}); or resume from a checkpoint at a "
            "generation boundary"
        )
    groups = []
    for i, d in enumerate(state["groups"]):
        d = dict(d)
        problem = Problem(**d.pop("problem"))
        keys = [f"{i}.{j}" for j in range(len(d.get("token_ids", [])))]
        d["routing"] = [routing[k] for k in keys if k in routing]
        groups.append(Group(problem=problem, **d))
    adv = [torch.tensor(a, dtype=torch.float32) for a in state["adv"]]
    gb = Generated(
        int(state["step"]), groups, adv, tcfg.mini_batches, tcfg.ppo_epochs, int(state["done"])
    )
    if state.get("prepared"):
        for key in ("old", "ref", "r2"):
            saved = ranks.get(key)
            if not isinstance(saved, list) or len(saved) != gb.mini_batches:
                raise CheckpointError(
                    f"{where}: this rank's file holds no '{key}' entry per mini-batch "
                    f"({gb.mini_batches}), yet trainer.json says the batch was prepared"
                )
        _restore_updates(ctx, gb, ranks)
    return gb


def _restore_updates(ctx: TrainContext, gb: Generated, ranks: Mapping[str, Any]) -> None:
    """Rebuild the micro-batches and put the saved log-probs (and r2 records) back."""
    device = ctx.pgs.device
    gb.updates = _prepare_updates(ctx, gb)

    def dev(xs: list | None) -> list | None:
        return None if xs is None else [None if x is None else x.to(device) for x in xs]

    for k, ((lo, hi), u) in enumerate(zip(gb.bounds(), gb.updates)):
        if u.source == "rollout":
            u.old = [mb.rollout_logprobs for mb in u.mbs]
        elif u.source == "recompute" and not u.reused:
            u.old = dev(ranks["old"][k])
            if has_rollout_logprobs(gb.groups[lo:hi]):
                u.extra = logprob_mismatch(ctx, u.old or [], u.mbs)
        u.ref = dev(ranks["ref"][k])
        records = ranks["r2"][k]
        if u.plan is not None and records is not None:
            for i, indices in enumerate(records):
                valid = u.mbs[i].routing_valid
                u.plan.recorded[i] = Routing(
                    None if indices is None else indices.to(device), valid, action="record"
                )
                u.plan.seen.add(i)
