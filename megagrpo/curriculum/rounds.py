"""The rounds of one step of dynamic sampling: the protocol the trainer drives, the filter, and
what both modes share (counters, the carry buffer, the ``dynamic/*`` + ``collapse/*`` metrics).

One class per mode decides when a step resamples:
:class:`~megagrpo.curriculum.dynamic.UniformRounds` (G answers per problem, the shortfall
policies of :mod:`megagrpo.curriculum.dynamic`) and
:class:`~megagrpo.curriculum.budget_rounds.BudgetRounds` (a rollout budget's mixed counts).
:meth:`DynamicSampler.start <megagrpo.curriculum.dynamic.DynamicSampler.start>` picks one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from megagrpo.curriculum.calibrate import predicted_acr_metrics
from megagrpo.curriculum.config import DynamicSamplingConfig
from megagrpo.curriculum.oversample import updated_estimate
from megagrpo.curriculum.stats import collapse_metrics, collapse_stats
from megagrpo.types import Group, Problem

log = logging.getLogger(__name__)


@dataclass
class Request:
    """Generate ``n`` completions for ``problem`` (one entry of a mixed-n generate call)."""

    problem: Problem
    n: int


@dataclass
class FilledBatch:
    """The groups to train on this step, and the ``dynamic/*`` + ``collapse/*`` metrics."""

    groups: list[Group]
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class FilterDecision:
    """Whether a generated group is kept for training, and why (slime's
    ``DynamicFilterOutput``): ``valid`` (its rewards differ), or collapsed: ``solve_all`` /
    ``solve_none`` (every correctness reward 1 / 0) or ``zero_std`` (equal rewards otherwise)."""

    keep: bool
    reason: str


@runtime_checkable
class Rounds(Protocol):
    """One step of bounded dynamic sampling, driven by the trainer::

        rounds = dynamic.start(sampler, batch_groups, step)
        while (requests := rounds.next_requests()) is not None:
            rounds.add(generate_and_score(requests))   # Request(problem, n): n answers
        batch = rounds.finish()

    :meth:`next_requests` decides whether another round is generated and draws its problems;
    :meth:`add` takes the scored groups of that round (in request order), passes them to the
    sampler's ``observe`` and checks them; :meth:`finish` returns the batch to train on.
    Pure: no generation, no callbacks.
    """

    def next_requests(self) -> list[Request] | None: ...

    def add(self, groups: list[Group]) -> list[FilterDecision]: ...

    def finish(self) -> FilledBatch: ...


class ProblemSource(Protocol):
    """What rounds need of a sampler (CurriculumSampler satisfies it). Optional extras, used
    when present: ``levels_of(groups) -> [N]`` profile levels (0 = none) for
    ``collapse/acr_by_level/*`` and ``k`` (levels are L1..L{k+1})."""

    def next_problems(self, n: int, resample: bool = False) -> list[Problem]: ...

    def observe(self, groups: Sequence[Group]) -> None: ...


@dataclass
class DynamicState:
    """What every step's rounds share with the run's DynamicSampler: its settings, and the
    carry buffer that outlives a step (rounds take their carried groups at the start and leave
    the surplus in it at :meth:`Rounds.finish`)."""

    cfg: DynamicSamplingConfig
    correctness_key: str | None = None
    """``Group.reward_parts`` key of the correctness reward (correctness-only metrics)."""
    acr_predicted: float | None = None
    """Predicted ACR from the levels (``collapse/acr_predicted``)."""
    carry: list[Group] = field(default_factory=list)
    acr_estimate: float | None = None
    """Online estimate of the raw ACR (``dynamic.oversample: auto``): the levels' prediction
    at first, then an average of each step's first round (:mod:`~megagrpo.curriculum.
    oversample`)."""

    def __post_init__(self) -> None:
        if self.acr_estimate is None:
            self.acr_estimate = self.acr_predicted

    def observe_first_round(self, collapsed: int, total: int) -> None:
        """Fold a step's raw first-round ACR into :attr:`acr_estimate`."""
        if total > 0:
            self.acr_estimate = updated_estimate(self.acr_estimate, collapsed / total)

    def take_carry(self, step: int) -> tuple[list[Group], int]:
        """``(carried groups no staler than carry_max_staleness, how many were dropped)``;
        the buffer is emptied (``carry`` policy only: otherwise nothing is taken)."""
        if self.cfg.policy != "carry":
            return [], 0
        limit = self.cfg.carry_max_staleness
        fresh = [g for g in self.carry if step - int(g.meta.get("step", step)) <= limit]
        dropped = len(self.carry) - len(fresh)
        self.carry = []
        return fresh, dropped

    def keep_surplus(self, surplus: list[Group], batch_groups: int) -> int:
        """Under ``carry``, the surplus valid groups (at most carry_max_groups, default B)
        fill the next step first; returns how many are discarded."""
        if self.cfg.policy == "carry":
            self.carry = surplus[: self.cfg.carry_max_groups or batch_groups]
        return len(surplus) - len(self.carry)


def decide(rewards: np.ndarray, correct: np.ndarray | None, tau: float) -> list[FilterDecision]:
    """The filter: keep a group iff the std of its total rewards ``[N, G]`` is >= ``tau``;
    ``correct`` ``[N, G]`` (0/1, optional) names why a collapsed group was dropped."""
    out = []
    for i, row in enumerate(rewards):
        if row.std() >= tau:
            out.append(FilterDecision(True, "valid"))
        elif correct is not None and correct[i].min() >= 1.0:
            out.append(FilterDecision(False, "solve_all"))
        elif correct is not None and correct[i].max() <= 0.0:
            out.append(FilterDecision(False, "solve_none"))
        else:
            out.append(FilterDecision(False, "zero_std"))
    return out


def checked_rounds(cfg: DynamicSamplingConfig) -> int:
    """How many generated rounds a policy checks at most (ms-swift: R; ours: 1 + R)."""
    if not cfg.enabled:
        return 1
    if cfg.policy == "original":
        return max(cfg.max_resample, 1)
    return 1 + cfg.max_resample


def ragged_matrices(
    groups: Sequence[Group], key: str | None
) -> tuple[list[list[float]], list[list[float]] | None]:
    """Reward (and correctness) rows of groups that may differ in size."""
    rewards = [list(g.rewards) for g in groups]
    if key and all(key in g.reward_parts for g in groups):
        return rewards, [list(g.reward_parts[key]) for g in groups]
    return rewards, None


class RoundsBase:
    """The counters and metrics both modes share (a base, not a mode of its own).

    Args:
        sampler: problem source; every generated round is passed to ``sampler.observe``.
        batch_groups: B, groups per batch.
        step: the training step (stamped into ``Group.meta['step']``).
        shared: the DynamicSampler's settings and carry buffer.
        carried, dropped_stale: this step's groups from the carry buffer, and how many
            stale ones were dropped.
        group_size: G, answers per problem of a uniform round (a budget's rounds have their
            own counts).
    """

    def __init__(
        self,
        sampler: ProblemSource,
        batch_groups: int,
        step: int,
        shared: DynamicState,
        carried: list[Group],
        dropped_stale: int,
        group_size: int | None = None,
    ) -> None:
        self.group_size = group_size
        self.sampler, self.shared, self.cfg = sampler, shared, shared.cfg
        self.batch_groups, self.step = batch_groups, step
        self.carried, self.dropped_stale = carried, dropped_stale
        self.valid: list[Group] = list(carried)
        self.predicted: dict[str, float] = {}
        """``collapse/acr_predicted_by_level/*`` of the first round (levels file runs)."""
        self.num_generated = self.num_checked = self.num_valid_first = 0
        self.first: list[Group] = []
        self.first_matrices: tuple[np.ndarray, np.ndarray | None] = (np.zeros((0, 0)), None)
        self.decisions: list[FilterDecision] = []
        self._done = False
        self._begin()

    def _begin(self) -> None:
        """A mode's own state, set up last in ``__init__``."""

    @property
    def num_valid(self) -> int:
        return len(self.valid)

    def _predict_first(self, requests: Sequence[Request]) -> None:
        """Before the first round: the predicted raw collapse per profile level of its
        problems at their n (levels file runs only; the sampler has not seen them yet)."""
        if self.num_generated > 0:
            return
        sampler = self.sampler
        if not getattr(sampler, "has_levels", False) or not hasattr(sampler, "posterior_of"):
            return
        problems = [r.problem for r in requests]
        self.predicted = predicted_acr_metrics(sampler, problems, [r.n for r in requests])  # type: ignore[arg-type]

    def _batch(
        self,
        trained: list[Group],
        post: tuple[np.ndarray, np.ndarray | None],
        success: bool,
        discarded: int,
        stats: dict[str, float] | None = None,
    ) -> FilledBatch:
        """The batch with its ``dynamic/*`` + ``collapse/*`` metrics (added to ``stats``)."""
        stats = {} if stats is None else stats
        stats.update(self._stats(post, success))
        carried_ids = {id(g) for g in self.carried}
        stats["dynamic/valid_groups_carried"] = float(
            sum(1 for g in trained if id(g) in carried_ids)
        )
        stats["dynamic/valid_groups_discarded"] = float(discarded)
        stats["dynamic/carry_buffer"] = float(len(self.shared.carry))
        stats["dynamic/carry_dropped_stale"] = float(self.dropped_stale)
        if not trained:
            log.warning(
                "step %d trains nothing: all %d groups of %d round(s) collapsed (equal "
                "rewards); raise dynamic.max_resample, or filter too easy / too hard problems "
                "(curriculum.keep_levels)",
                self.step,
                len(self.decisions),
                self.num_checked,
            )
        return FilledBatch(trained, stats)

    def _stats(self, post: tuple[np.ndarray, np.ndarray | None], success: bool) -> dict[str, float]:
        levels_of = getattr(self.sampler, "levels_of", None)
        levels = levels_of(self.first) if levels_of is not None else None
        if levels is not None and not levels.any():
            levels = None
        tau = self.cfg.tau
        raw = collapse_stats(*self.first_matrices, levels, tau=tau)
        post_stats = collapse_stats(*post, tau=tau)
        num_levels = int(getattr(self.sampler, "k", 5)) + 1
        out = collapse_metrics(raw, post_stats, self.shared.acr_predicted, num_levels)
        out.update(self.predicted)
        num_trained = post_stats["num_groups"]
        num_valid = float(round(num_trained * (1.0 - post_stats["acr"])))
        out.update(
            {
                "dynamic/success": float(success),
                "dynamic/rounds": float(self.num_checked),
                "dynamic/gen_batches": float(self.num_generated),
                "dynamic/valid_groups": num_valid,
                "dynamic/trained_groups": num_trained,
                "dynamic/collapsed_groups_trained": num_trained - num_valid,
            }
        )
        return out
