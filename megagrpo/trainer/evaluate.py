"""Periodic evaluation on the held-out set, with the official IgakuQA scoring rule.

Rank 0 generates one answer per held-out problem through the rollout engine (the
configured sampling; seeded per evaluation step), extracts the answer with
:func:`megagrpo.rewards.extract_answer` and scores the predictions with
:func:`megagrpo.rewards.igakuqa.score` (exact set match of the comma-joined letters; the
116A71 / 112B30 exceptions apply to IgakuQA ids). With sharded rollouts every engine
replica generates its share of the held-out problems (same seeds), rank 0 scores. Logged as ``eval/accuracy`` (and
``eval/score_frac``: points scored / points total).
"""

from __future__ import annotations

import logging

from megagrpo.rewards import extract_answer
from megagrpo.rewards.igakuqa import GoldItem, score
from megagrpo.rollout.base import SamplingSpec
from megagrpo.trainer.context import TrainContext
from megagrpo.trainer.rollout_phase import round_seed
from megagrpo.trainer.sharding import sharded_generate

log = logging.getLogger(__name__)


def _problems(ctx: TrainContext) -> list:
    problems = ctx.eval_problems
    if ctx.cfg.trainer.eval_max_problems:
        problems = problems[: ctx.cfg.trainer.eval_max_problems]
    return problems


def evaluate(ctx: TrainContext, step: int) -> dict[str, float]:
    """``eval/accuracy`` and friends on ``ctx.eval_problems`` (rank 0; {} elsewhere)."""
    if ctx.sharded:  # every rank generates its share; rank 0 scores
        problems = ctx.comm.broadcast_object(_problems(ctx) if ctx.comm.is_main else None)
        if not problems:
            return {}
        seed = round_seed(ctx.cfg.trainer.seed + 1, step, 0)
        groups = sharded_generate(ctx, problems, 1, SamplingSpec(seed=seed))
        if not ctx.comm.is_main:
            return {}
    else:
        if not ctx.comm.is_main or not ctx.eval_problems:
            return {}
        seed = round_seed(ctx.cfg.trainer.seed + 1, step, 0)
        groups = ctx.engine.generate(_problems(ctx), 1, SamplingSpec(seed=seed))
    gold, preds = {}, {}
    for g in groups:
        p = g.problem
        gold[p.id] = GoldItem(
            problem_id=p.id,
            answer=list(p.answer),
            points=int(p.meta.get("points", 1) or 1),
            year=str(p.meta.get("year", "") or ""),
            source=str(p.meta.get("source", "")),
        )
        letters = extract_answer(g.completions[0], p)
        preds[p.id] = ",".join(letters) if letters else ""
    report = score(gold, preds).as_dict()
    log.info(
        "eval step %d: accuracy %.3f (%d/%d)",
        step,
        report["accuracy"],
        report["correct"],
        report["total"],
    )
    points = report["points_total"] or 1
    return {
        "eval/accuracy": float(report["accuracy"]),
        "eval/score_frac": report["score"] / points,
        "eval/num_problems": float(report["total"]),
    }
