"""Placement ``separate``, one step ahead, as the loop drives it: start step k+1's first round
on the engine ranks while step k trains (:func:`submit_ahead`), take it at k+1's start
(:func:`take_ahead`), keep the samplers a checkpoint of step k holds
(:func:`sampler_states`), and measure the overlap (:func:`overlap_metrics`). The engines'
side and the protocol are :mod:`megagrpo.placement.separate`'s."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from megagrpo.placement.rollouts import round_seed
from megagrpo.placement.separate import SeparateRollouts
from megagrpo.placement.staleness import overlap_seconds
from megagrpo.rollout import SamplingSpec
from megagrpo.trainer.context import Ahead
from megagrpo.types import Group

if TYPE_CHECKING:
    from megagrpo.curriculum.rounds import Rounds
    from megagrpo.trainer.context import TrainContext


def submit_ahead(ctx: TrainContext, step: int, last: bool = True) -> None:
    """Before step ``step`` trains, on separate ranks: note the step (the push after its
    update carries weights current for ``step + 1``); after the last step on a generated batch
    (``last``) with ``rollout.max_staleness`` 1, start step ``step + 1``'s rounds and send its
    first round to the engines, which generate it while this step trains (a partial round with
    ``rollout.partial``)."""
    rollouts = ctx.rollouts
    if not isinstance(rollouts, SeparateRollouts):
        return
    rollouts.training_step = step
    if not last or rollouts.max_staleness < 1 or step >= ctx.cfg.trainer.max_steps:
        return
    nxt = step + 1
    samplers = copy.deepcopy(sampler_states(ctx))  # what this step's checkpoint holds
    rounds = ctx.dynamic.start(ctx.sampler, ctx.cfg.trainer.batch_groups, nxt)
    ctx.ahead = Ahead(nxt, rounds, samplers)
    requests = rounds.next_requests()
    if requests is None:
        return
    problems, counts = [r.problem for r in requests], [r.n for r in requests]
    if ctx.partial is not None:  # its carried groups stay the trainer's until collected
        rollouts.submit_partial(ctx.partial.work(problems, counts), ctx.partial, nxt)
        return
    seed = round_seed(ctx.cfg.trainer.seed, nxt, 0)
    rollouts.submit(problems, counts, SamplingSpec(seed=seed))


def sampler_states(ctx: TrainContext) -> dict[str, Any]:
    """The samplers' state a checkpoint of the last completed step holds: as they were before
    :func:`submit_ahead` started the next step's rounds, else as they are."""
    if ctx.ahead is not None and ctx.ahead.samplers:
        return ctx.ahead.samplers
    return {"sampler": ctx.sampler.state_dict(), "dynamic": ctx.dynamic.state_dict()}


def take_ahead(ctx: TrainContext, step: int) -> tuple[Rounds, list[Group] | None] | None:
    """Step ``step``'s rounds started by :func:`submit_ahead` and its first round's groups,
    scored (None: nothing was started ahead). With partial rollouts the round's finished
    groups (its unfinished ones are carried): call after ``ctx.partial.begin_step()``."""
    ahead = ctx.ahead
    if ahead is None:
        return None
    ctx.ahead = None
    if ahead.step != step:
        raise RuntimeError(f"rounds started ahead for step {ahead.step}, collected at {step}")
    rollouts = ctx.rollouts
    assert isinstance(rollouts, SeparateRollouts)
    first = None
    if rollouts.submitted and rollouts.submitted[0].kind == "partial":
        assert ctx.partial is not None
        res = rollouts.collect_partial(ctx.partial.cfg.max_staleness)
        first = ctx.partial.absorb(rollouts, res, step)
    elif rollouts.submitted:
        first = rollouts.collect()
    return ahead.rounds, first


def overlap_metrics(ctx: TrainContext, step_s: float) -> dict[str, float]:
    """``perf/overlap_frac`` (the share of the step during which the trainer trained while
    an engine generated) and ``offpolicy/staleness_*``; {} for other placements."""
    rollouts = ctx.rollouts
    if not isinstance(rollouts, SeparateRollouts):
        return {}
    busy = rollouts.pop_engine_busy()
    train = [iv for key, iv in ctx.intervals.items() if key == "train"]
    both = overlap_seconds(busy, train)
    both = ctx.comm.broadcast_object(both)
    return {
        "perf/overlap_frac": both / step_s if step_s > 0 else 0.0,
        "perf/overlap_s": both,
        **rollouts.pop_staleness(),
    }
