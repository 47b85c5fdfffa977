"""What advantage collapse costs a step (`megagrpo plan-memory`): dynamic sampling billed from
the simulation `megagrpo plan` runs.

Bounded dynamic sampling regenerates a whole round of ``trainer.batch_groups`` problems when
too few groups of the first one split (``dynamic.max_resample``, ``dynamic.policy``), and the
shortfall policy may train fewer groups than asked; with ``dynamic.oversample`` the first
round draws more problems and resampling rounds become rare
(:mod:`megagrpo.curriculum.oversample`). How often depends on the problems' levels
and the curriculum, which the step-time model cannot know; :func:`collapse_bill` runs the real
``CurriculumSampler`` + ``DynamicSampler`` against the Bernoulli engine
(:func:`megagrpo.plan.simulate.run_plan`, the simulation of `megagrpo plan`, same inputs:
:func:`megagrpo.plan.inputs.plan_inputs`) and returns the mean rounds, first-round problems
and trained groups per step, which the step-time model bills (:mod:`megagrpo.plan.time`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megagrpo.plan.inputs import ARTICLE_LEVELS, plan_inputs
from megagrpo.plan.simulate import PlanSetup, run_plan

PLAN_STEPS = 200
"""Simulated steps (``megagrpo plan``'s default)."""


@dataclass(frozen=True)
class CollapseBill:
    """Per step, in the mean over the simulated steps: generation rounds (the first of
    ``first_round_groups`` problems, the others of ``batch_groups``), groups trained; the raw
    ACR (first round) predicted from the levels and simulated; where the level histogram came
    from."""

    rounds_per_step: float
    trained_groups_per_step: float
    batch_groups: int
    acr_predicted: float
    acr_raw: float
    source: str
    policy: str
    max_resample: int
    first_round_groups: float = 0.0
    """Mean problems of the first round (0: ``batch_groups``)."""
    oversample: str = "off"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def collapse_bill(cfg: Any, levels: str | None = None, steps: int = PLAN_STEPS) -> CollapseBill:
    """The dynamic-sampling bill of run config ``cfg`` (its curriculum, ``dynamic``,
    ``rollout.group_size``, ``trainer.batch_groups``): the level histogram of ``levels`` (a
    ``--levels`` text) when given, else of ``curriculum.levels_file``, else, when that file is
    not on this machine (a cluster path), the article's histogram, which ``source`` then
    says. ``dynamic.enabled: false``: one round, every group trained, nothing simulated."""
    cur, dyn = cfg.curriculum, cfg.dynamic
    batch = int(cfg.trainer.batch_groups)
    if not dyn.enabled:
        off = "dynamic.enabled=false"
        return CollapseBill(1.0, float(batch), batch, 0.0, 0.0, off, dyn.policy, 0, float(batch))
    source = f"--levels {levels}" if levels else f"curriculum.levels_file {cur.levels_file}"
    if not levels and cur.levels_file and not Path(cur.levels_file).is_file():
        levels = ARTICLE_LEVELS
        source = (
            f"the article's histogram ({ARTICLE_LEVELS}): curriculum.levels_file "
            f"{cur.levels_file} is not on this machine (pass --levels)"
        )
    elif not levels and not cur.levels_file:
        levels, source = ARTICLE_LEVELS, f"the article's histogram ({ARTICLE_LEVELS}), all levels"
    key = json.dumps(
        [dataclasses.asdict(cur), dataclasses.asdict(dyn), cfg.rollout.group_size, batch],
        sort_keys=True,
        default=str,
    )
    return _simulate(key, levels, steps, source)


@functools.lru_cache(maxsize=32)
def _simulate(key: str, levels: str | None, steps: int, source: str) -> CollapseBill:
    """One simulation per (curriculum, dynamic, G, B, levels): every layout of a search shares
    it."""
    from megagrpo.curriculum.config import CurriculumConfig, DynamicSamplingConfig

    cur_d, dyn_d, group_size, batch = json.loads(key)
    cur = CurriculumConfig(**cur_d)
    dyn = dataclasses.replace(DynamicSamplingConfig(**dyn_d), preflight="off")
    inputs = plan_inputs(cur, levels, all_levels=not cur.levels_file)
    setup = PlanSetup(
        inputs.hist,
        inputs.k,
        int(group_size),
        int(batch),
        steps,
        inputs.curriculum,
        seed=inputs.curriculum.seed,
        population=inputs.population,
    )
    res = run_plan(setup, dyn).to_dict()
    return CollapseBill(
        rounds_per_step=float(res["gen_batches_per_step"]),
        trained_groups_per_step=float(res["trained_groups_per_step"]),
        batch_groups=int(batch),
        acr_predicted=float(res["acr_predicted"]),
        acr_raw=float(res["acr_raw_mean"]),
        source=source,
        policy=dyn.policy,
        max_resample=dyn.max_resample,
        first_round_groups=float(res["first_round_groups_per_step"]) or float(batch),
        oversample=str(dyn.resolved_oversample()),
    )


def billed(sc: Any, bill: CollapseBill) -> Any:
    """Scenario ``sc`` with the bill's rounds, first-round problems and trained groups per
    step."""
    return sc.with_(
        rounds_per_step=bill.rounds_per_step,
        trained_groups_per_step=bill.trained_groups_per_step,
        first_round_groups=bill.first_round_groups or None,
    )
