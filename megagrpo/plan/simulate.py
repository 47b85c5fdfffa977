"""Planner: the real CurriculumSampler + DynamicSampler against a simulated rollout engine.

Each problem gets a per-sample success probability p drawn from its posterior under the
beta-binomial prior fitted to the level histogram (:mod:`megagrpo.curriculum.levels`), so
the simulated ACR matches the predicted one in expectation. A rollout of G samples is G
Bernoulli(p) draws; reward = correctness (no length penalty). Optionally, ``drift`` moves a
trained problem's p towards 1 (``p += drift * (1 - p)`` per trained valid group): a crude
stand-in for learning, which shows how pre-training levels go stale.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megagrpo.curriculum.config import CurriculumConfig, DynamicSamplingConfig
from megagrpo.curriculum.dynamic import DynamicSampler, UniformRounds, checked_rounds
from megagrpo.curriculum.levels import (
    BetaPrior,
    CollapsePrediction,
    correct_from_level,
    fill_success_prob,
    predict_acr,
)
from megagrpo.curriculum.sampler import CurriculumSampler
from megagrpo.types import Group, Problem

log = logging.getLogger(__name__)

CORRECTNESS_KEY = "correct"


class BernoulliEngine:
    """A RolloutEngine whose completions are right with probability p per problem.

    ``generate`` returns groups whose completions are the gold answer (``",".join(answer)``)
    or ``"wrong"``; with ``fill_rewards`` it also fills ``rewards`` and
    ``reward_parts['correct']`` (the planner), otherwise a reward function scores the text
    (the profiler's tests).
    """

    def __init__(
        self, p_by_id: Mapping[str, float], seed: int = 0, fill_rewards: bool = True
    ) -> None:
        self.ids = list(p_by_id)
        self.index = {pid: i for i, pid in enumerate(self.ids)}
        self.p = np.asarray([p_by_id[i] for i in self.ids], dtype=np.float64)
        self.rng = np.random.default_rng(seed)
        self.fill_rewards = fill_rewards
        self.num_generated = 0

    def learn(self, groups: Sequence[Group], drift: float) -> None:
        """Simulated learning: ``p += drift * (1 - p)`` for the problem of each trained group."""
        for g in groups if drift > 0 else ():
            i = self.index[g.problem.id]
            self.p[i] += drift * (1.0 - self.p[i])

    def generate(
        self, problems: Sequence[Problem], n: int, sampling: Any | None = None
    ) -> list[Group]:
        """``len(problems)`` groups of ``n`` completions each."""
        idx = np.fromiter((self.index[p.id] for p in problems), dtype=np.int64, count=len(problems))
        hits = (self.rng.random((len(problems), n)) < self.p[idx, None]).astype(np.float64)
        self.num_generated += len(problems) * n
        out = []
        for prob, row in zip(problems, hits.tolist()):
            gold = ",".join(prob.answer)
            group = Group(
                problem=prob,
                completions=[gold if h else "wrong" for h in row],
                token_ids=[],
                logprobs=[],
                lengths=[1] * n,
            )
            if self.fill_rewards:
                group.rewards = row
                group.reward_parts = {CORRECTNESS_KEY: row}
            out.append(group)
        return out

    weights_dropped = False  # its sleep keeps the (imaginary) weights

    def sleep(self) -> None:
        """No-op (protocol)."""

    def wake_up(self) -> None:
        """No-op (protocol)."""

    def update_weights(self, named_tensors: Any) -> None:
        """No-op (protocol)."""


def synthetic_population(
    hist: Mapping[int, int], k: int, seed: int = 0, prior: BetaPrior | None = None
) -> tuple[list[Problem], dict[str, int], dict[str, float]]:
    """Problems, ``{id: level}`` and ``{id: p}`` for a level histogram.

    Each problem's p is drawn from its level's posterior Beta(a + c, b + k - c).
    """
    prior = prior or BetaPrior.fit_histogram(hist, k)
    rng = np.random.default_rng([seed, 104729])
    problems, levels, ps = [], {}, {}
    for level in sorted(hist):
        count = int(hist[level])
        a, b = prior.posterior(correct_from_level(level, k), k)
        draws = rng.beta(a, b, size=count) if count else []
        for j, p in enumerate(draws):
            pid = f"L{level}-{j:06d}"
            problems.append(Problem(id=pid, messages=[], answer=["a"]))
            levels[pid] = level
            ps[pid] = float(p)
    return problems, levels, ps


def population_from_records(
    records: Sequence[Mapping[str, Any]], k: int, seed: int = 0, prior: BetaPrior | None = None
) -> tuple[list[Problem], dict[str, int], dict[str, float]]:
    """Like :func:`synthetic_population` but with the ids and counts of a levels file."""
    from megagrpo.curriculum.levels import histogram

    hist = histogram((int(r["level"]) for r in records), k + 1)
    prior = prior or BetaPrior.fit_histogram(hist, k)
    rng = np.random.default_rng([seed, 104729])
    problems, levels, ps = [], {}, {}
    for r in records:
        a, b = prior.posterior(int(r["correct"]), k)
        pid = str(r["id"])
        problems.append(Problem(id=pid, messages=[], answer=["a"]))
        levels[pid] = int(r["level"])
        ps[pid] = float(rng.beta(a, b))
    return problems, levels, ps


@dataclass
class PlanResult:
    """Planner summary (``to_dict`` is the ``--json`` output)."""

    config: dict[str, Any]
    acr_predicted: float
    acr_by_level_predicted: dict[int, float]
    ds_fill_condition: bool
    ds_success_prob: float
    steps: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0

    def mean(self, key: str) -> float:
        return float(np.mean([s[key] for s in self.steps])) if self.steps else 0.0

    def window_mean(self, key: str, last: bool) -> float:
        """Mean of ``key`` over the first (or last) 10% of the steps."""
        w = max(1, len(self.steps) // 10)
        rows = self.steps[-w:] if last else self.steps[:w]
        return float(np.mean([s[key] for s in rows])) if rows else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.config,
            "acr_predicted": self.acr_predicted,
            "acr_by_level_predicted": {f"L{k}": v for k, v in self.acr_by_level_predicted.items()},
            "ds_fill_condition": self.ds_fill_condition,
            "ds_success_prob_predicted": self.ds_success_prob,
            "acr_raw_mean": self.mean("collapse/acr_raw"),
            "acr_raw_first_10pct": self.window_mean("collapse/acr_raw", last=False),
            "acr_raw_last_10pct": self.window_mean("collapse/acr_raw", last=True),
            "frac_reward_zero_std_mean": self.mean("collapse/frac_reward_zero_std"),
            "ds_success_rate": self.mean("dynamic/success"),
            "valid_groups_per_step": self.mean("dynamic/valid_groups"),
            "trained_groups_per_step": self.mean("dynamic/trained_groups"),
            "gen_batches_per_step": self.mean("dynamic/gen_batches"),
            "first_round_groups_per_step": self.mean("dynamic/first_round_groups"),
            "generated_groups_per_step": self.mean("dynamic/generated_groups"),
            "rounds_per_step": self.mean("dynamic/rounds"),
            "collapsed_groups_trained_per_step": self.mean("dynamic/collapsed_groups_trained"),
            "valid_groups_discarded_per_step": self.mean("dynamic/valid_groups_discarded"),
            "valid_groups_carried_per_step": self.mean("dynamic/valid_groups_carried"),
            "valid_groups_per_gen_batch": (  # per batch_groups problems generated
                self.mean("dynamic/valid_groups")
                * self.config["batch_groups"]
                / max(self.mean("dynamic/generated_groups"), 1e-12)
            ),
            "level_hist_final": {
                k.rsplit("/", 1)[1]: v
                for k, v in (self.steps[-1].items() if self.steps else ())
                if k.startswith("curriculum/level_hist/")
            },
            "retired_final": self.steps[-1].get("curriculum/retired", 0.0) if self.steps else 0.0,
            "seconds": self.seconds,
        }


Population = tuple[list[Problem], dict[str, int], dict[str, float]]
"""``(problems, level by id, p by id)`` of a simulated problem set."""


@dataclass(frozen=True)
class PlanSetup:
    """What every planner run of one comparison shares: the problem set and the step shape."""

    hist: Mapping[int, int]
    """Level histogram of the whole problem set ``{level: count}``."""
    k: int
    """Samples per problem of the profile (levels L1..L{k+1})."""
    group_size: int
    """G: completions per problem."""
    batch_groups: int
    """B: groups per trained batch."""
    steps: int
    """Training steps to simulate."""
    curriculum: CurriculumConfig
    """Kept levels, weights and online levels of the real sampler."""
    drift: float = 0.0
    """Per trained valid group, ``p += drift * (1 - p)`` (0: problems never get easier)."""
    seed: int = 0
    """Seed of the synthetic population and of the simulated engine."""
    population: Population | None = None
    """``(problems, levels, p)``; None: :func:`synthetic_population` of ``hist``."""


@dataclass
class Simulation:
    """What every planner run starts from: the kept levels, the collapse prediction of the
    level histogram, the problems, the real sampler over them and the simulated engine."""

    keep: list[int]
    pred: CollapsePrediction
    problems: list[Problem]
    sampler: CurriculumSampler
    engine: BernoulliEngine

    @classmethod
    def start(cls, setup: PlanSetup) -> Simulation:
        """The set-up of ``setup.hist`` (``setup.population`` when given)."""
        hist, k, cur = setup.hist, setup.k, setup.curriculum
        keep = list(cur.keep_levels) if cur.keep_levels else sorted(hist)
        weights = dict(zip(cur.keep_levels, cur.level_weights)) or None
        pred = predict_acr(hist, k, setup.group_size, keep, weights)
        problems, levels, ps = setup.population or synthetic_population(
            hist, k, setup.seed, pred.prior
        )
        sampler = CurriculumSampler(problems, cur, levels, CORRECTNESS_KEY, level_k=k)
        return cls(keep, pred, problems, sampler, BernoulliEngine(ps, seed=setup.seed))


def run_plan(
    setup: PlanSetup, dynamic: DynamicSamplingConfig, on_step: Callable[[], Any] | None = None
) -> PlanResult:
    """Simulate ``setup.steps`` training steps under ``dynamic``; returns per-step metrics and
    the predictions. ``on_step`` is called after each simulated step (a progress bar)."""
    t0 = time.perf_counter()
    sim = Simulation.start(setup)
    keep, pred, problems, sampler, engine = (
        sim.keep,
        sim.pred,
        sim.problems,
        sim.sampler,
        sim.engine,
    )
    group_size, batch_groups, drift = setup.group_size, setup.batch_groups, setup.drift
    ds = DynamicSampler(dynamic, CORRECTNESS_KEY, acr_predicted=pred.acr)
    rounds = checked_rounds(dynamic)
    result = PlanResult(
        config={
            "group_size": group_size,
            "batch_groups": batch_groups,
            "steps": setup.steps,
            "max_resample": dynamic.max_resample,
            "policy": dynamic.policy,
            "keep_levels": list(keep),
            "num_problems": len(problems),
            "pool": int(len(sampler.pool)),
            "checked_rounds": rounds,
            "drift": drift,
        },
        acr_predicted=pred.acr,
        acr_by_level_predicted=pred.by_level,
        ds_fill_condition=(1.0 - pred.acr) * rounds >= 1.0,
        ds_success_prob=fill_success_prob(pred.acr, batch_groups, rounds),
    )

    for step in range(setup.steps):
        rounds = ds.start(sampler, batch_groups, step)
        assert isinstance(rounds, UniformRounds)  # no rollout budget: G answers per problem
        while (problems := rounds.next_problems()) is not None:
            rounds.add(engine.generate(problems, group_size))
        batch = rounds.finish()
        engine.learn(batch.groups, drift)
        row = dict(batch.stats)
        row.update(sampler.metrics())
        result.steps.append(row)
        if on_step is not None:
            on_step()
    result.seconds = time.perf_counter() - t0
    return result
