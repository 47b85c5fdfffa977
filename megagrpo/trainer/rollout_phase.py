"""Phase 1-2 of a step: draw problems, generate G answers each, score them, fill the batch.

Runs on rank 0 (which holds the engine and the samplers); the filled batch is broadcast to
every rank. Every generation round of the dynamic sampler goes through :func:`make_generate_fn`,
which scores the groups with the composite reward and counts generated tokens.
"""

from __future__ import annotations

import logging
import zlib

from megagrpo.curriculum.dynamic import FilledBatch
from megagrpo.rollout.base import SamplingSpec
from megagrpo.trainer.context import TrainContext
from megagrpo.types import Group, Problem

log = logging.getLogger(__name__)


def round_seed(base: int, step: int, round_idx: int) -> int:
    """A deterministic sampling seed per (run seed, step, generation round): a resumed run
    draws exactly the rollouts the uninterrupted one drew."""
    return zlib.crc32(f"{base}:{step}:{round_idx}".encode()) & 0x7FFFFFFF


def score_groups(ctx: TrainContext, groups: list[Group]) -> None:
    """Fill ``rewards`` and ``reward_parts`` of each group with the composite reward."""
    for g in groups:
        total, parts = ctx.reward_fn(g.completions, g.problem, lengths=g.lengths,
                                     token_ids=g.token_ids)
        g.rewards, g.reward_parts = list(total), dict(parts)


def make_generate_fn(ctx: TrainContext, step: int, counters: dict[str, float]):
    """``problems -> scored groups`` for DynamicSampler.fill; counts rounds and tokens."""
    num_g = ctx.cfg.rollout.group_size

    def generate(problems: list[Problem]) -> list[Group]:
        seed = round_seed(ctx.cfg.trainer.seed, step, int(counters["rounds"]))
        groups = ctx.engine.generate(problems, num_g, SamplingSpec(seed=seed))
        score_groups(ctx, groups)
        if counters["rounds"] == 0:  # the raw (pre-filter) round
            raw = [r for g in groups for r in g.rewards]
            counters["raw_reward_mean"] = sum(raw) / max(len(raw), 1)
        counters["rounds"] += 1
        counters["gen_tokens"] += sum(sum(g.lengths) for g in groups)
        counters["gen_seqs"] += sum(g.size for g in groups)
        counters["clipped"] += sum(1 for g in groups for r in g.finish_reasons if r == "length")
        return groups

    return generate


def collect_batch(ctx: TrainContext, step: int) -> tuple[FilledBatch, dict[str, float]]:
    """Rank 0: fill one batch (bounded dynamic sampling); every rank: receive it.

    Returns (the batch to train on, generation counters: gen_tokens, gen_seqs, clipped,
    raw_reward_mean).
    """
    out = None
    if ctx.comm.is_main:
        counters = {"rounds": 0.0, "gen_tokens": 0.0, "gen_seqs": 0.0, "clipped": 0.0,
                    "raw_reward_mean": 0.0}
        batch = ctx.dynamic.fill(ctx.sampler, make_generate_fn(ctx, step, counters),
                                 ctx.cfg.trainer.batch_groups, step)
        out = (batch, counters)
    return ctx.comm.broadcast_object(out)
