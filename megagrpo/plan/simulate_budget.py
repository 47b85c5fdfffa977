"""Planner for rollout budgets: the real CurriculumSampler + BudgetPlanner on Bernoulli rollouts.

Same population model as :mod:`megagrpo.plan.simulate` (each problem's p drawn from
its level's beta-binomial posterior; reward = correctness, 0/1; no length penalty; no
learning unless ``drift``). The round loop below applies dynamic sampling's rules to
budgeted rounds: at most 1 + R rounds per step, stop once B groups are finished; ``partial``
trains on what it has, ``carry`` keeps surplus finished groups (and split problems still
short of the trained size) for the next step, within ``carry_max_staleness``.

The figure of merit is the **effective ratio**: generated completions that end up with a
non-zero advantage in a trained group, over all generated completions, at a fixed trained
group size (every trained group holds exactly ``trained_size`` completions, G = 8 by
default; surplus answers are subsampled keeping both outcomes). Uniform G runs go through
:func:`megagrpo.plan.simulate.run_plan` (the real DynamicSampler).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from megagrpo.algo.advantages import flat_group_advantages
from megagrpo.curriculum.budget_rounds import BudgetPlanner, Request, pool_baselines
from megagrpo.curriculum.config import (
    BudgetConfig,
    DynamicSamplingConfig,
    SamplingPolicy,
)
from megagrpo.curriculum.levels import predict_acr
from megagrpo.curriculum.sampler import CurriculumSampler
from megagrpo.curriculum.stats import collapse_stats
from megagrpo.errors import ConfigError
from megagrpo.plan.simulate import (
    CORRECTNESS_KEY,
    BernoulliEngine,
    PlanSetup,
    Simulation,
    run_plan,
    synthetic_population,
)
from megagrpo.types import Group


def generate_mixed(engine: BernoulliEngine, requests: Sequence[Request]) -> list[Group]:
    """One group per request, ``request.n`` Bernoulli completions each (one mixed-n call).

    Requests that all ask for the same n go through ``engine.generate`` unchanged (so a
    uniform run draws exactly the random numbers :func:`run_plan` draws)."""
    if not requests:
        return []
    sizes = [r.n for r in requests]
    if len(set(sizes)) == 1:
        return engine.generate([r.problem for r in requests], sizes[0])
    draws = engine.rng.random(sum(sizes))
    engine.num_generated += len(draws)
    out, start = [], 0
    for r in requests:
        p = engine.p[engine.index[r.problem.id]]
        row = (draws[start : start + r.n] < p).astype(np.float64).tolist()
        start += r.n
        out.append(
            Group(
                problem=r.problem,
                completions=["x" if h else "wrong" for h in row],
                token_ids=[],
                logprobs=[],
                lengths=[1] * r.n,
                rewards=row,
                reward_parts={CORRECTNESS_KEY: row},
            )
        )
    return out


def trained_advantages(groups: Sequence[Group], scale: str, baseline: str) -> torch.Tensor:
    """[S] advantages of the trained groups (``baseline``: group | pool, see BudgetConfig)."""
    if not groups:
        return torch.zeros(0)
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64)
    sizes = [g.size for g in groups]
    if baseline == "pool":
        mean, std = (torch.from_numpy(x) for x in pool_baselines(groups))
        return flat_group_advantages(rewards, sizes, scale, baseline_mean=mean, baseline_std=std)
    return flat_group_advantages(rewards, sizes, scale)


@dataclass
class BudgetLoop:
    """Dynamic sampling's round rules around a :class:`BudgetPlanner` (what the trainer's
    ``Rounds`` does; kept here so the planner runs without it)."""

    planner: BudgetPlanner
    dynamic: DynamicSamplingConfig
    carry: list[Group] = field(default_factory=list)

    def step(self, sampler: CurriculumSampler, engine: BernoulliEngine, step: int):
        """One step: ``(trained groups, metrics)``."""
        cfg, b = self.dynamic, self.planner.batch_groups
        if cfg.policy == "original":
            raise ConfigError("dynamic.policy 'original' applies to budget.mode uniform only")
        fresh = [
            g for g in self.carry if step - int(g.meta.get("step", step)) <= cfg.carry_max_staleness
        ]
        valid, self.carry = list(fresh), []
        carried_ids = {id(g) for g in fresh}
        bstep = self.planner.start(sampler, step, keep_pending=cfg.policy == "carry")
        max_rounds = 1 + cfg.max_resample if cfg.enabled else 1
        rounds = 0
        while rounds < max_rounds and len(valid) < b:
            requests = bstep.plan_round()
            if not requests:
                break
            valid += bstep.merge(generate_mixed(engine, requests))
            rounds += 1
        stats = bstep.close()
        trained = valid[:b]
        if cfg.policy == "carry":
            self.carry = valid[b : b + (cfg.carry_max_groups or b)]
        raw = collapse_stats([g.rewards for g in bstep.raw_groups], tau=cfg.tau)
        stats.update(
            {
                "collapse/acr_raw": raw["acr"],
                "dynamic/success": float(len(valid) >= b),
                "dynamic/rounds": float(rounds),
                "dynamic/valid_groups": float(len(trained)),
                "dynamic/valid_groups_carried": float(
                    sum(1 for g in trained if id(g) in carried_ids)
                ),
                "dynamic/valid_groups_discarded": float(max(len(valid) - b, 0) - len(self.carry)),
            }
        )
        return trained, stats


@dataclass
class BudgetPlanResult:
    """Per-step rows of a budgeted run and its summary (``to_dict``)."""

    config: dict[str, Any]
    steps: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0

    def mean(self, key: str) -> float:
        return float(np.mean([s[key] for s in self.steps])) if self.steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        gen = sum(s["budget/completions"] for s in self.steps)
        eff = sum(s["budget/effective_completions"] for s in self.steps)
        trained = sum(s["budget/trained_completions"] for s in self.steps)
        groups = sum(s["dynamic/valid_groups"] for s in self.steps)
        return {
            **self.config,
            "generated_completions_per_step": self.mean("budget/completions"),
            "acr_raw_mean": self.mean("collapse/acr_raw"),
            "valid_groups_per_step": self.mean("dynamic/valid_groups"),
            "effective_completions_per_step": self.mean("budget/effective_completions"),
            "effective_ratio": eff / gen if gen else 0.0,
            "trained_group_size_mean": trained / groups if groups else 0.0,
            "ds_success_rate": self.mean("dynamic/success"),
            "rounds_per_step": self.mean("dynamic/rounds"),
            "problems_per_step": self.mean("budget/problems"),
            "first_request_mean_n": (
                sum(s["budget/new_problem_completions"] for s in self.steps)
                / max(sum(s["budget/problems"] for s in self.steps), 1.0)
            ),
            "topup_completions_per_step": self.mean("budget/topups"),
            "continued_completions_per_step": self.mean("budget/continued"),
            "valid_groups_carried_per_step": self.mean("dynamic/valid_groups_carried"),
            "price_mean": self.mean("budget/price"),
            "seconds": self.seconds,
        }


def run_budget_plan(
    setup: PlanSetup,
    dynamic: DynamicSamplingConfig,
    budget: BudgetConfig,
    advantage_scale: str = "group",
) -> BudgetPlanResult:
    """Simulate ``setup.steps`` budgeted steps (same population and sampler as
    :func:`run_plan`)."""
    t0 = time.perf_counter()
    sim = Simulation.start(setup)
    keep, sampler, engine = sim.keep, sim.sampler, sim.engine
    group_size, batch_groups, drift = setup.group_size, setup.batch_groups, setup.drift
    planner = BudgetPlanner(
        budget,
        group_size,
        batch_groups,
        CORRECTNESS_KEY,
        tau=dynamic.tau,
        max_staleness=dynamic.carry_max_staleness,
    )
    loop = BudgetLoop(planner, dynamic)
    result = BudgetPlanResult(
        config={
            "budget": budget.mode,
            "policy": dynamic.policy,
            "group_size": group_size,
            "trained_size": planner.trained_size,
            "batch_groups": batch_groups,
            "steps": setup.steps,
            "max_resample": dynamic.max_resample,
            "min_samples": budget.min_samples,
            "max_samples": budget.max_samples,
            "keep_levels": list(keep),
            "drift": drift,
        }
    )
    for step in range(setup.steps):
        trained, row = loop.step(sampler, engine, step)
        adv = trained_advantages(trained, advantage_scale, budget.advantage_baseline)
        row["budget/effective_completions"] = float((adv != 0).sum())
        row["budget/trained_completions"] = float(adv.numel())
        engine.learn(trained, drift)
        row.update(sampler.metrics())
        result.steps.append(row)
    result.seconds = time.perf_counter() - t0
    return result


def uniform_summary(plan: dict[str, Any]) -> dict[str, Any]:
    """The comparison figures of a :func:`run_plan` summary (uniform G): every valid group
    trains G completions with non-zero advantages (0/1 rewards), every problem generated costs
    G (a resampling round B * G, an oversampled first round more: ``dynamic.oversample``)."""
    g, b = plan["group_size"], plan["batch_groups"]
    generated = plan.get("generated_groups_per_step") or plan["gen_batches_per_step"] * b
    generated *= g
    effective = plan["valid_groups_per_step"] * g
    return {
        **plan,
        "budget": "uniform",
        "trained_size": g,
        "generated_completions_per_step": generated,
        "effective_completions_per_step": effective,
        "effective_ratio": effective / generated if generated else 0.0,
        "trained_group_size_mean": float(g),
        "first_request_mean_n": float(g),
    }


def compare_budgets(
    setup: PlanSetup,
    max_resample: int,
    budgets: Mapping[str, BudgetConfig],
    uniform_policies: Sequence[SamplingPolicy] = ("original", "partial", "carry"),
    budget_policies: Sequence[SamplingPolicy] = ("carry",),
) -> dict[str, dict[str, Any]]:
    """``{"uniform/<policy>": summary, "<label>/<policy>": summary}`` on one population,
    ``budgets`` being ``{label: BudgetConfig}``.

    Every run has the same round budget (B * G completions) and round cap (1 + R)."""
    if setup.population is None:
        hist, k, cur = setup.hist, setup.k, setup.curriculum
        keep = cur.keep_levels if cur.keep_levels else sorted(hist)
        prior = predict_acr(hist, k, setup.group_size, keep).prior
        setup = replace(setup, population=synthetic_population(hist, k, setup.seed, prior))

    def dynamic(policy: SamplingPolicy) -> DynamicSamplingConfig:
        return DynamicSamplingConfig(max_resample=max_resample, policy=policy, preflight="off")

    out: dict[str, dict[str, Any]] = {}
    for policy in uniform_policies:
        plan = run_plan(setup, dynamic(policy))
        out[f"uniform/{policy}"] = uniform_summary(plan.to_dict())
    for label, cfg in budgets.items():
        for policy in budget_policies:
            out[f"{label}/{policy}"] = run_budget_plan(setup, dynamic(policy), cfg).to_dict()
    return out
