"""Bounded dynamic sampling (DAPO) with an explicit shortfall policy, and its pre-flight check.

One step: generate a batch of ``B`` groups from the sampler's main stream (the *raw*
round, whose collapse statistics are always logged); keep the non-collapsed groups; while
fewer than ``B`` are kept, draw ``B`` more problems from the resample stream and generate
again, at most ``R`` extra rounds. Policies when the batch is still short:

- ``original``: ms-swift's ``_dynamic_sampling`` reproduced for comparison. It checks only
  R rounds in total (its loop generates the R-th resample round and exits before checking
  it) and, when short, trains on the first round, collapsed groups included, throwing the
  valid groups it collected away. It fills only while (1 - ACR) * R >= 1.
- ``partial``: checks every generated round (1 + R) and trains on all the valid groups
  collected: a smaller batch, all of it signal.
- ``carry`` (default): ``partial``, plus the surplus valid groups of an over-full round are
  kept in a bounded buffer (staleness limit) and fill the next step first.

A group is valid when the std of its total rewards is >= ``tau`` (ms-swift: std > 0; the
same groups up to float noise). When the batch fills, it holds the first ``B`` valid groups;
post-filter ``frac_reward_zero_std`` is then 0 by construction ("dynamic sampling succeeded", not
"nothing collapsed") which is why the raw round's statistics are logged too. A step with
no valid group at all under ``partial``/``carry`` returns an empty batch: the trainer skips
its optimizer step.

The trainer drives the rounds and this module only decides: :meth:`DynamicSampler.start`
returns a :class:`Rounds`, which says which problems to generate next and how many answers
each gets (or that the batch is decided), takes each scored round, and finishes the batch.
Nothing here generates.

With a rollout budget (``budget.mode`` knapsack | sequential: a
:class:`~megagrpo.curriculum.budget_rounds.BudgetPlanner`), the planner decides what each round
generates (mixed n per problem) and which problems are finished (split, subsampled to the
trained size); the rules above decide when to stop (at most 1 + R rounds, or B groups) and
what is trained or carried. The planner observes each problem once per step, merged; the
raw statistics are those of the first round's newly drawn problems at their own n.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from megagrpo.curriculum.budget_rounds import BudgetPlanner, BudgetStep, Request
from megagrpo.curriculum.calibrate import predicted_acr_metrics
from megagrpo.curriculum.config import DynamicSamplingConfig
from megagrpo.curriculum.levels import fill_success_prob
from megagrpo.curriculum.stats import collapse_metrics, collapse_stats, group_matrices
from megagrpo.errors import ConfigError
from megagrpo.types import Group, Problem

log = logging.getLogger(__name__)


class ProblemSource(Protocol):
    """What a :class:`Rounds` needs of a sampler (CurriculumSampler satisfies it). Optional
    extras, used when present: ``levels_of(groups) -> [N]`` profile levels (0 = none) for
    ``collapse/acr_by_level/*`` and ``k`` (levels are L1..L{k+1})."""

    def next_problems(self, n: int, resample: bool = False) -> list[Problem]: ...

    def observe(self, groups: Sequence[Group]) -> None: ...


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


class Rounds:
    """One step of bounded dynamic sampling, driven by the trainer::

        rounds = dynamic.start(sampler, batch_groups, step)
        while (requests := rounds.next_requests()) is not None:
            rounds.add(generate_and_score(requests))   # Request(problem, n): n answers
        batch = rounds.finish()

    :meth:`next_requests` decides whether another round is generated (and draws its
    problems: the main stream first, then the resample stream; G answers each, or the
    rollout budget's mixed counts); :meth:`add` takes the scored groups of that round,
    passes them to ``sampler.observe`` and checks them; :meth:`finish` applies the
    shortfall policy and returns the batch. Pure: no generation, no callbacks.
    """

    def __init__(
        self,
        owner: DynamicSampler,
        sampler: ProblemSource,
        batch_groups: int,
        step: int,
        carried: list[Group],
        dropped_stale: int,
        budget_step: BudgetStep | None = None,
    ) -> None:
        self.owner, self.sampler = owner, sampler
        self.budget_step = budget_step
        """The rollout budget's round state (None: uniform G, every round checked here)."""
        self.predicted: dict[str, float] = {}
        """``collapse/acr_predicted_by_level/*`` of the first round (levels file runs)."""
        self.batch_groups, self.step = batch_groups, step
        self.carried, self.dropped_stale = carried, dropped_stale
        self.valid: list[Group] = list(carried)
        r, c = group_matrices(carried, owner.correctness_key)
        self._rows_r, self._rows_c = [r] if carried else [], [c] if carried else []
        self.num_generated = self.num_checked = self.num_valid_first = 0
        self.first: list[Group] = []
        self.first_matrices: tuple[np.ndarray, np.ndarray | None] = (np.zeros((0, 0)), None)
        self.decisions: list[FilterDecision] = []
        self._done = False
        self._unchecked_next = False  # ms-swift generates its last round without checking it

    @property
    def num_valid(self) -> int:
        return len(self.valid)

    def next_problems(self) -> list[Problem] | None:
        """The problems of the next round to generate (G answers each), or None when the
        step's batch is decided (full, or the round budget of the policy is spent). Uniform
        only: with a rollout budget use :meth:`next_requests`."""
        if self.budget_step is not None:
            raise RuntimeError("next_problems: a rollout budget needs next_requests")
        if self._done:
            return None
        resample = self.num_generated > 0
        return self.sampler.next_problems(self.batch_groups, resample=resample)

    def next_requests(self) -> list[Request] | None:
        """The next round's requests ``[Request(problem, n)]`` (G each without a rollout
        budget, mixed counts with one), or None when the step's batch is decided. Before
        the first round, the predicted collapse of its problems at their n is computed
        (:attr:`predicted`; the sampler has not seen them yet)."""
        if self.budget_step is None:
            problems = self.next_problems()
            if problems is None:
                return None
            requests = [Request(p, self.owner.round_size()) for p in problems]
        elif self._done:
            return None
        else:
            requests = self.budget_step.next_requests()
            if not requests:
                self._done = True
                return None
        if self.num_generated == 0:
            self.predicted = _predicted(self.sampler, requests)
        return requests

    def add(self, groups: list[Group]) -> list[FilterDecision]:
        """Take one generated round (groups with ``rewards`` and ``reward_parts`` set, in the
        order of the requests); returns the filter's decision per group (empty for a round
        that is not checked, and with a rollout budget, whose problems finish across
        rounds)."""
        if self.budget_step is not None:
            self._add_budgeted(groups)
            return []
        self.num_generated += 1
        for g in groups:
            g.meta["step"] = self.step
        self.sampler.observe(groups)
        matrices = group_matrices(groups, self.owner.correctness_key)
        if self.num_generated == 1:
            self.first, self.first_matrices = list(groups), matrices
        cfg = self.owner.cfg
        if not cfg.enabled or self._unchecked_next:
            self._done = True
            return []
        decisions = self._check(groups, *matrices)
        if self.num_valid >= self.batch_groups:
            self._done = True
        elif self.num_checked >= checked_rounds(cfg):
            # ms-swift generates one more round after its last check, then exits
            self._unchecked_next = cfg.policy == "original" and cfg.max_resample > 0
            self._done = not self._unchecked_next
        return decisions

    def _add_budgeted(self, groups: list[Group]) -> None:
        """A budgeted round: the planner merges each problem's answers and returns the
        problems finished (split, trained size); stop at B valid groups or 1 + R rounds."""
        assert self.budget_step is not None
        self.num_generated += 1
        self.num_checked += 1
        for g in groups:
            g.meta["step"] = self.step
        finished = self.budget_step.add(groups)
        self.valid.extend(finished)
        if self.num_generated == 1:
            self.num_valid_first = len(finished)
        full = self.num_valid >= self.batch_groups
        if full or self.num_checked >= checked_rounds(self.owner.cfg):
            self._done = True

    def _check(
        self, groups: list[Group], r: np.ndarray, c: np.ndarray | None
    ) -> list[FilterDecision]:
        """Keep the non-collapsed groups of a generated round (std >= tau)."""
        self.num_checked += 1
        if not groups:
            return []
        decisions = decide(r, c, self.owner.cfg.tau)
        keep = np.array([d.keep for d in decisions], dtype=bool)
        self.valid.extend(g for g, k in zip(groups, keep.tolist()) if k)
        self._rows_r.append(r[keep])
        self._rows_c.append(None if c is None else c[keep])
        if self.num_checked == 1:
            self.num_valid_first = int(keep.sum())
        self.decisions.extend(decisions)
        return decisions

    def valid_matrices(self, n: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Reward (and correctness) rows ``[n, G]`` of the first ``n`` valid groups."""
        if n == 0 or not self._rows_r:
            return np.zeros((0, 0)), None
        r = np.concatenate(self._rows_r)[:n]
        rows_c = [c for c in self._rows_c if c is not None]
        if len(rows_c) != len(self._rows_c):
            return r, None
        return r, np.concatenate(rows_c)[:n]

    def finish(self) -> FilledBatch:
        """Apply the shortfall policy: the batch to train on, with its metrics."""
        return self.owner.finish(self)


def _predicted(sampler: ProblemSource, requests: Sequence[Request]) -> dict[str, float]:
    """Predicted raw collapse per profile level of a first round (levels file runs only:
    a sampler without profile levels, or without posteriors, gives {})."""
    if not getattr(sampler, "has_levels", False) or not hasattr(sampler, "posterior_of"):
        return {}
    problems = [r.problem for r in requests]
    return predicted_acr_metrics(sampler, problems, [r.n for r in requests])  # type: ignore[arg-type]


def _ragged(
    groups: Sequence[Group], key: str | None
) -> tuple[list[list[float]], list[list[float]] | None]:
    """Reward (and correctness) rows of groups that may differ in size."""
    rewards = [list(g.rewards) for g in groups]
    if key and all(key in g.reward_parts for g in groups):
        return rewards, [list(g.reward_parts[key]) for g in groups]
    return rewards, None


def checked_rounds(cfg: DynamicSamplingConfig) -> int:
    """How many generated rounds a policy checks at most (ms-swift: R; ours: 1 + R)."""
    if not cfg.enabled:
        return 1
    if cfg.policy == "original":
        return max(cfg.max_resample, 1)
    return 1 + cfg.max_resample


class DynamicSampler:
    """Fills a training batch with non-collapsed groups, within a bounded generation budget.

    Args:
        cfg: dynamic sampling config.
        correctness_key: ``Group.reward_parts`` key of the correctness reward (the first
            function of the rewards config) for the correctness-only collapse metrics.
        acr_predicted: predicted ACR from the levels (logged as ``collapse/acr_predicted``).
        group_size: G, answers per problem of a uniform round (:meth:`Rounds.next_requests`).
        budget: the rollout budget's planner (knapsack | sequential); None or uniform: G
            answers per problem, exactly as without a planner.
    """

    def __init__(
        self,
        cfg: DynamicSamplingConfig,
        correctness_key: str | None = None,
        acr_predicted: float | None = None,
        group_size: int | None = None,
        budget: BudgetPlanner | None = None,
    ) -> None:
        self.cfg = cfg
        self.correctness_key = correctness_key
        self.acr_predicted = acr_predicted
        self.group_size = group_size
        if budget is not None and budget.cfg.mode == "uniform":
            budget = None
        if budget is not None and cfg.policy == "original":
            raise ConfigError(
                "config key 'dynamic.policy': 'original' applies to budget.mode uniform "
                "only; use partial or carry"
            )
        self.budget = budget
        self.carry: list[Group] = []

    def round_size(self) -> int:
        """G of a uniform round (ValueError when the sampler was built without it)."""
        if self.group_size is None:
            raise ValueError("DynamicSampler: next_requests needs group_size")
        return self.group_size

    def _take_carry(self, step: int) -> tuple[list[Group], int]:
        fresh = [
            g
            for g in self.carry
            if step - int(g.meta.get("step", step)) <= self.cfg.carry_max_staleness
        ]
        dropped = len(self.carry) - len(fresh)
        self.carry = []
        return fresh, dropped

    def start(self, sampler: ProblemSource, batch_groups: int, step: int) -> Rounds:
        """Begin one step's batch: the trainer then generates the rounds :class:`Rounds`
        asks for (see its docstring) and calls :meth:`Rounds.finish`.

        Args:
            sampler: problem source; every generated round is passed to ``sampler.observe``.
            batch_groups: B, groups per batch (one generation round = B problems x G).
            step: the training step (stamped into ``Group.meta['step']``).
        """
        carried, dropped = self._take_carry(step) if self.cfg.policy == "carry" else ([], 0)
        bstep = None
        if self.budget is not None:
            keep = self.cfg.policy == "carry"
            bstep = self.budget.start(sampler, step, keep_pending=keep)  # type: ignore[arg-type]
        return Rounds(self, sampler, batch_groups, step, carried, dropped, bstep)

    def finish(self, rounds: Rounds) -> FilledBatch:
        """The shortfall policy over a finished :class:`Rounds` (see module docstring)."""
        if rounds.budget_step is not None:
            return self._finish_budgeted(rounds)
        cfg, batch_groups = self.cfg, rounds.batch_groups
        success = cfg.enabled and rounds.num_valid >= batch_groups
        discarded = 0
        if not cfg.enabled or (not success and cfg.policy == "original"):
            trained, post = list(rounds.first), rounds.first_matrices
            discarded = rounds.num_valid - rounds.num_valid_first if cfg.enabled else 0
        else:
            take = min(batch_groups, rounds.num_valid)
            trained, post = rounds.valid[:take], rounds.valid_matrices(take)
            surplus = rounds.valid[take:]
            if cfg.policy == "carry":
                self.carry = surplus[: cfg.carry_max_groups or batch_groups]
            discarded = len(surplus) - len(self.carry)
        stats = self._stats(rounds, post, success)
        self._carry_stats(stats, rounds, trained, discarded)
        if not trained:
            _warn_trains_nothing(rounds)
        elif not success and cfg.enabled:
            log.info(
                "step %d: dynamic sampling short (%d/%d valid after %d rounds, policy %s)",
                rounds.step,
                rounds.num_valid,
                batch_groups,
                rounds.num_checked,
                cfg.policy,
            )
        return FilledBatch(trained, stats)

    def _finish_budgeted(self, rounds: Rounds) -> FilledBatch:
        """Budgeted rounds: the first B finished groups train, the surplus is carried
        (``carry``) or discarded; ``budget/*`` metrics from the planner's step."""
        assert rounds.budget_step is not None
        b = rounds.batch_groups
        stats = rounds.budget_step.close()
        success = rounds.num_valid >= b
        trained, surplus = rounds.valid[:b], rounds.valid[b:]
        if self.cfg.policy == "carry":
            self.carry = surplus[: self.cfg.carry_max_groups or b]
        rounds.first = list(rounds.budget_step.raw_groups)
        rounds.first_matrices = _ragged(rounds.first, self.correctness_key)  # type: ignore[assignment]
        post = _ragged(trained, self.correctness_key)
        stats.update(self._stats(rounds, post, success))  # type: ignore[arg-type]
        self._carry_stats(stats, rounds, trained, len(surplus) - len(self.carry))
        if not trained:
            _warn_trains_nothing(rounds)
        return FilledBatch(trained, stats)

    def _carry_stats(
        self, stats: dict[str, float], rounds: Rounds, trained: list[Group], discarded: int
    ) -> None:
        carried_ids = {id(g) for g in rounds.carried}
        stats["dynamic/valid_groups_carried"] = float(
            sum(1 for g in trained if id(g) in carried_ids)
        )
        stats["dynamic/valid_groups_discarded"] = float(discarded)
        stats["dynamic/carry_buffer"] = float(len(self.carry))
        stats["dynamic/carry_dropped_stale"] = float(rounds.dropped_stale)

    def _stats(
        self, rounds: Rounds, post: tuple[np.ndarray, np.ndarray | None], success: bool
    ) -> dict[str, float]:
        levels_of = getattr(rounds.sampler, "levels_of", None)
        levels = levels_of(rounds.first) if levels_of is not None else None
        if levels is not None and not levels.any():
            levels = None
        raw = collapse_stats(*rounds.first_matrices, levels, tau=self.cfg.tau)
        post_stats = collapse_stats(*post, tau=self.cfg.tau)
        num_levels = int(getattr(rounds.sampler, "k", 5)) + 1
        out = collapse_metrics(raw, post_stats, self.acr_predicted, num_levels)
        out.update(rounds.predicted)
        num_trained = post_stats["num_groups"]
        num_valid = float(round(num_trained * (1.0 - post_stats["acr"])))
        out.update(
            {
                "dynamic/success": float(success),
                "dynamic/rounds": float(rounds.num_checked),
                "dynamic/gen_batches": float(rounds.num_generated),
                "dynamic/valid_groups": num_valid,
                "dynamic/trained_groups": num_trained,
                "dynamic/collapsed_groups_trained": num_trained - num_valid,
            }
        )
        return out

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The carry buffer (groups as plain dicts; their MoE routing tensors, which plain
        data cannot hold compactly, are :meth:`carry_routing`) and the rollout budget's
        pending top-ups."""
        carry = [dataclasses.asdict(dataclasses.replace(g, routing=[])) for g in self.carry]
        state: dict[str, Any] = {"version": 1, "carry": carry}
        if self.budget is not None:
            state["budget"] = self.budget.state_dict()
        return state

    def carry_routing(self) -> dict[str, Any]:
        """The carried groups' routing tensors, ``{"<group>.<completion>": [L, layers, k]}``."""
        return {f"{i}.{j}": r for i, g in enumerate(self.carry) for j, r in enumerate(g.routing)}

    def load_state_dict(
        self, state: Mapping[str, Any], routing: Mapping[str, Any] | None = None
    ) -> None:
        """Restore :meth:`state_dict` (and :meth:`carry_routing`)."""
        if self.budget is not None:
            self.budget.load_state_dict(state.get("budget", {}))
        groups = []
        for i, d in enumerate(state.get("carry", [])):
            d = dict(d)
            problem = Problem(**d.pop("problem"))
            d["routing"] = [
                (routing or {})[f"{i}.{j}"]
                for j in range(len(d.get("token_ids", [])))
                if f"{i}.{j}" in (routing or {})
            ]
            groups.append(Group(problem=problem, **d))
        self.carry = groups


@dataclass
class PreflightResult:
    """Outcome of :func:`preflight_check`."""

    ok: bool
    acr_predicted: float
    checked_rounds: int
    success_prob: float
    message: str


def preflight_check(
    cfg: DynamicSamplingConfig,
    acr_predicted: float,
    batch_groups: int,
    level_alternatives: Mapping[str, float] | None = None,
) -> PreflightResult:
    """Will dynamic sampling fill batches? The article's condition (1 - ACR) * rounds >= 1.

    ``rounds`` is what the policy checks (ms-swift/original: R; ours: 1 + R). Says which R
    would work and, given ``level_alternatives`` (``{"L2-L5": predicted ACR, ...}``), which
    level filters would. Mode ``warn`` logs, ``fail`` raises ConfigError, ``off`` is silent.
    """
    rounds = checked_rounds(cfg)
    ok = (1.0 - acr_predicted) * rounds >= 1.0 - 1e-12
    p_fill = fill_success_prob(acr_predicted, batch_groups, rounds)
    msg = (
        f"predicted ACR {acr_predicted:.3f}, policy {cfg.policy} checks {rounds} round(s) "
        f"of {batch_groups} groups: expected valid {(1 - acr_predicted) * rounds:.2f} "
        f"batches, P(batch fills) = {p_fill:.2f}"
    )
    if not ok:
        need = math.inf if acr_predicted >= 1 else math.ceil(1.0 / (1.0 - acr_predicted) - 1e-9)
        need_r = need if cfg.policy == "original" else need - 1
        hints = [f"max_resample >= {need_r}" if math.isfinite(need) else "no R suffices"]
        good = [
            f"{name} (ACR {acr:.2f})"
            for name, acr in (level_alternatives or {}).items()
            if (1.0 - acr) * rounds >= 1.0
        ]
        if good:
            hints.append("or keep_levels " + " / ".join(good[:3]))
        if cfg.policy == "original":
            hints.append("or policy partial/carry (checks every generated round)")
        msg += "; dynamic sampling cannot fill: (1 - ACR) * rounds < 1. Use " + ", ".join(hints)
    if not ok and cfg.enabled and cfg.preflight == "fail":
        raise ConfigError(f"dynamic.preflight: {msg}")
    if cfg.preflight != "off" and cfg.enabled:
        (log.info if ok else log.warning)("dynamic sampling pre-flight: %s", msg)
    return PreflightResult(ok, acr_predicted, rounds, p_fill, msg)


def _warn_trains_nothing(rounds: Rounds) -> None:
    log.warning(
        "step %d trains nothing: all %d groups of %d round(s) collapsed (equal rewards); "
        "raise dynamic.max_resample, or filter too easy / too hard problems "
        "(curriculum.keep_levels)",
        rounds.step,
        len(rounds.decisions),
        rounds.num_checked,
    )
