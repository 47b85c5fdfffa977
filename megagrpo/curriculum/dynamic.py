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
returns the step's :class:`~megagrpo.curriculum.rounds.Rounds`, which says which problems to
generate next and how many answers each gets (or that the batch is decided), takes each
scored round, and finishes the batch. Nothing here generates. One class per mode:
:class:`UniformRounds` (G answers each: everything above) and, with a rollout budget
(``budget.mode`` knapsack | sequential),
:class:`~megagrpo.curriculum.budget_rounds.BudgetRounds` (mixed counts; ``partial`` / ``carry``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from megagrpo.curriculum.budget_rounds import BudgetPlanner, BudgetRounds
from megagrpo.curriculum.config import DynamicSamplingConfig
from megagrpo.curriculum.levels import fill_success_prob
from megagrpo.curriculum.oversample import first_round_size
from megagrpo.curriculum.rounds import (
    DynamicState,
    FilledBatch,
    FilterDecision,
    ProblemSource,
    Request,
    Rounds,
    RoundsBase,
    checked_rounds,
    decide,
)
from megagrpo.curriculum.stats import group_matrices
from megagrpo.errors import ConfigError
from megagrpo.types import Group, Problem

log = logging.getLogger(__name__)

__all__ = [
    "DynamicSampler",
    "FilledBatch",
    "FilterDecision",
    "PreflightResult",
    "Rounds",
    "UniformRounds",
    "checked_rounds",
    "decide",
    "preflight_check",
]


class UniformRounds(RoundsBase):
    """The rounds of one step with G answers per problem (the module docstring's rules).

    Where it decides to resample: :meth:`add` (the batch is full, or the policy has checked
    its rounds); :meth:`finish` applies the shortfall policy. Build with
    :meth:`DynamicSampler.start`.
    """

    def _begin(self) -> None:
        r, c = group_matrices(self.carried, self.shared.correctness_key)
        self._rows_r, self._rows_c = [r] if self.carried else [], [c] if self.carried else []
        self._unchecked_next = False  # ms-swift generates its last round without checking it
        self.first_round_groups = 0

    def next_problems(self) -> list[Problem] | None:
        """The problems of the next round to generate (G answers each), or None when the
        step's batch is decided (full, or the round budget of the policy is spent). The first
        round draws what ``dynamic.oversample`` asks (:func:`~megagrpo.curriculum.oversample.
        first_round_size`), a resampling round ``batch_groups``."""
        if self._done:
            return None
        if self.num_generated > 0:
            return self.sampler.next_problems(self.batch_groups, resample=True)
        n = first_round_size(
            self.batch_groups,
            len(self.carried),
            self.shared.acr_estimate,
            self.cfg.resolved_oversample(),
        )
        self.first_round_groups = n
        return self.sampler.next_problems(n, resample=False)

    def next_requests(self) -> list[Request] | None:
        """:meth:`next_problems` as requests of G answers each (ValueError without G)."""
        if self.group_size is None:
            raise ValueError("DynamicSampler: next_requests needs group_size")
        problems = self.next_problems()
        if problems is None:
            return None
        requests = [Request(p, self.group_size) for p in problems]
        self._predict_first(requests)
        return requests

    def add(self, groups: list[Group]) -> list[FilterDecision]:
        """Take one generated round (groups with ``rewards`` and ``reward_parts`` set, in the
        order of the requests); returns the filter's decision per group (empty for a round
        that is not checked)."""
        self.num_generated += 1
        for g in groups:
            g.meta["step"] = self.step
        self.sampler.observe(groups)
        matrices = group_matrices(groups, self.shared.correctness_key)
        if self.num_generated == 1:
            self.first, self.first_matrices = list(groups), matrices
            self._observe_first(matrices[0])
        cfg = self.cfg
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

    def _observe_first(self, rewards: np.ndarray) -> None:
        """The raw first round's collapse into the online ACR estimate (oversampling)."""
        if len(rewards):
            collapsed = int((rewards.std(axis=1) < self.cfg.tau).sum())
            self.shared.observe_first_round(collapsed, len(rewards))

    def _check(
        self, groups: list[Group], r: np.ndarray, c: np.ndarray | None
    ) -> list[FilterDecision]:
        """Keep the non-collapsed groups of a generated round (std >= tau)."""
        self.num_checked += 1
        if not groups:
            return []
        decisions = decide(r, c, self.cfg.tau)
        keep = np.array([d.keep for d in decisions], dtype=bool)
        self.valid.extend(g for g, k in zip(groups, keep.tolist()) if k)
        self._rows_r.append(r[keep])
        self._rows_c.append(None if c is None else c[keep])
        if self.num_checked == 1:
            self.num_valid_first = int(keep.sum())
        self.decisions.extend(decisions)
        return decisions

    def _oversample_stats(self) -> dict[str, float]:
        """``dynamic/first_round_groups`` (problems the first round drew),
        ``dynamic/generated_groups`` (all rounds) and ``dynamic/acr_estimate`` (the online
        estimate after this step; -1 while there is none)."""
        first = self.first_round_groups or (self.batch_groups if self.num_generated else 0)
        est = self.shared.acr_estimate
        return {
            "dynamic/first_round_groups": float(first),
            "dynamic/generated_groups": float(
                first + self.batch_groups * max(0, self.num_generated - 1)
            ),
            "dynamic/acr_estimate": -1.0 if est is None else float(est),
        }

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
        cfg, batch_groups = self.cfg, self.batch_groups
        success = cfg.enabled and self.num_valid >= batch_groups
        discarded = 0
        if not cfg.enabled or (not success and cfg.policy == "original"):
            trained, post = list(self.first), self.first_matrices
            discarded = self.num_valid - self.num_valid_first if cfg.enabled else 0
        else:
            take = min(batch_groups, self.num_valid)
            trained, post = self.valid[:take], self.valid_matrices(take)
            discarded = self.shared.keep_surplus(self.valid[take:], batch_groups)
        batch = self._batch(trained, post, success, discarded, self._oversample_stats())
        if trained and not success and cfg.enabled:
            log.info(
                "step %d: dynamic sampling short (%d/%d valid after %d rounds, policy %s)",
                self.step,
                self.num_valid,
                batch_groups,
                self.num_checked,
                cfg.policy,
            )
        return batch


class DynamicSampler:
    """Fills a training batch with non-collapsed groups, within a bounded generation budget:
    :meth:`start` returns each step's :class:`~megagrpo.curriculum.rounds.Rounds`; this
    object keeps what outlives a step (the carry buffer, the budget's pending top-ups).

    Args:
        cfg: dynamic sampling config.
        correctness_key: ``Group.reward_parts`` key of the correctness reward (the first
            function of the rewards config) for the correctness-only collapse metrics.
        acr_predicted: predicted ACR from the levels (logged as ``collapse/acr_predicted``).
        group_size: G, answers per problem of a uniform round (:meth:`UniformRounds.next_requests`).
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
        self.shared = DynamicState(cfg, correctness_key, acr_predicted)
        self.group_size = group_size
        if budget is not None and budget.cfg.mode == "uniform":
            budget = None
        if budget is not None and cfg.policy == "original":
            raise ConfigError(
                "config key 'dynamic.policy': 'original' applies to budget.mode uniform "
                "only; use partial or carry"
            )
        self.budget = budget

    @property
    def cfg(self) -> DynamicSamplingConfig:
        return self.shared.cfg

    @property
    def carry(self) -> list[Group]:
        """Valid groups carried into the next step (``carry`` policy)."""
        return self.shared.carry

    @carry.setter
    def carry(self, groups: list[Group]) -> None:
        self.shared.carry = groups

    def start(self, sampler: ProblemSource, batch_groups: int, step: int) -> Rounds:
        """Begin one step's batch: the trainer then generates the rounds the returned
        :class:`~megagrpo.curriculum.rounds.Rounds` asks for and calls its ``finish``.

        Args:
            sampler: problem source; every generated round is passed to ``sampler.observe``.
            batch_groups: B, groups per batch (one generation round = B problems x G).
            step: the training step (stamped into ``Group.meta['step']``).
        """
        carried, dropped = self.shared.take_carry(step)
        if self.budget is None:
            return UniformRounds(
                sampler, batch_groups, step, self.shared, carried, dropped, self.group_size
            )
        planner_sampler: Any = sampler  # a PosteriorSource: the planner prices on posteriors
        return BudgetRounds(
            self.budget, planner_sampler, batch_groups, step, self.shared, carried, dropped
        )

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The carry buffer (groups as plain dicts; their MoE routing tensors, which plain
        data cannot hold compactly, are :meth:`carry_routing`) and the rollout budget's
        pending top-ups."""
        carry = [dataclasses.asdict(dataclasses.replace(g, routing=[])) for g in self.carry]
        state: dict[str, Any] = {"version": 1, "carry": carry}
        if self.shared.acr_estimate is not None:
            state["acr_estimate"] = self.shared.acr_estimate
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
        if state.get("acr_estimate") is not None:
            self.shared.acr_estimate = float(state["acr_estimate"])
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
