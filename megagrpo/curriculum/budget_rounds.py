"""One step of budgeted generation: what each round generates, and which problems are done.

:class:`BudgetPlanner` lives as long as the run (config, pending top-ups carried between
steps); a step's :class:`BudgetRounds` (the rollout budget's
:class:`~megagrpo.curriculum.rounds.Rounds`) plans each round, merges what it generated and
decides when the step stops::

    rounds = dynamic.start(sampler, B, step)          # a BudgetRounds
    while (requests := rounds.next_requests()) is not None:   # None: B finished, or 1 + R rounds
        rounds.add(engine.generate_mixed(requests))   # [Request(problem, n)], mixed n
    batch = rounds.finish()                           # the first B finished groups

Every round may spend ``batch_groups * G`` completions (one uniform round). Its requests are,
in order: top-ups of split problems that have fewer than ``trained_size`` completions;
continuations of problems still all-correct/all-wrong (knapsack: priced, 0 = stop;
sequential: ``round_samples``, gated); then newly drawn problems (the sampler's main stream
in the first round, the resample stream later, as dynamic sampling draws): uniform B x G,
sequential ``round_samples`` each, knapsack from :func:`~megagrpo.curriculum.budget.priced_choice`
until the budget is spent (price 0: B problems sharing the budget by the exact knapsack).

A problem's completions of every round are merged (:func:`merge_groups`); when its rewards
differ (std >= tau, as dynamic sampling judges) and it holds >= ``trained_size`` completions,
it is finished: subsampled to ``trained_size`` keeping both outcomes (outcome = reward above
the problem's mean, i.e. correct for 0/1 rewards) and returned, with the statistics of the
whole pool in ``meta`` (:data:`POOL_MEAN`, :data:`POOL_STD`, :data:`POOL_SIZE`) for
Reinforce-Ada's pool baseline. The sampler observes each problem once, merged, when it is
finished or dropped (so a 2-completion probe does not count as a collapsed group of its own
in the retirement streak); decisions inside the step use its posterior plus the step's own
counts.

A round spends at most its budget, top-ups excepted (they are served whatever the budget:
the problem already split). A drawn problem is always served (at least ``min_samples``).

Deliberately left out: ms-swift's ``original`` policy (train on the first round,
collapsed groups included) has no meaning for mixed sizes; the last round is not shrunk to
what the batch still needs (under ``partial`` its surplus is discarded).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from megagrpo.curriculum.budget import (
    balanced_subsample,
    beta_moments,
    effective_tables,
    efficiency_price,
    knapsack_allocate,
    merge_groups,
    priced_choice,
    select_completions,
)
from megagrpo.curriculum.config import BudgetConfig, DynamicSamplingConfig
from megagrpo.curriculum.rounds import (
    DynamicState,
    FilledBatch,
    FilterDecision,
    Request,
    RoundsBase,
    checked_rounds,
    ragged_matrices,
)
from megagrpo.curriculum.stats import SOLVED_THRESHOLD
from megagrpo.types import Group, Problem

log = logging.getLogger(__name__)

POOL_MEAN = "budget_pool_mean"
POOL_STD = "budget_pool_std"
POOL_SIZE = "budget_pool_size"


def pool_baselines(groups: Sequence[Group]) -> tuple[np.ndarray, np.ndarray]:
    """``(mean [N], std [N])`` of every completion generated for each trained group's problem
    (Reinforce-Ada's baseline; ``flat_group_advantages(baseline_mean=, baseline_std=)``).
    Groups that did not go through a budgeted step (uniform, carried from before) use their
    own rewards."""
    mean, std = np.empty(len(groups)), np.empty(len(groups))
    for i, g in enumerate(groups):
        if POOL_MEAN in g.meta:
            mean[i], std[i] = g.meta[POOL_MEAN], g.meta[POOL_STD]
        else:
            r = np.asarray(g.rewards, dtype=np.float64)
            mean[i] = r.mean() if len(r) else 0.0
            std[i] = r.std(ddof=1) if len(r) > 1 else 0.0
    return mean, std


class PosteriorSource(Protocol):
    """What budgeted rounds need of a sampler (:class:`CurriculumSampler` satisfies it)."""

    def next_problems(self, n: int, resample: bool = False) -> list[Problem]: ...

    def observe(self, groups: Sequence[Group]) -> None: ...

    def posterior_of(self, problems: Sequence[Problem]) -> tuple[np.ndarray, np.ndarray]: ...

    def pool_posterior(self) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(eq=False)
class _Pool:
    """One problem's completions within a step (a top-up may carry it into the next step)."""

    problem: Problem
    step: int
    parts: list[Group] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    num_correct: int = 0
    split: bool = False
    """Reward std >= tau (set by :func:`_append`)."""

    @property
    def n(self) -> int:
        return len(self.rewards)


class BudgetPlanner:
    """Budgeted generation across a run: config, price, split problems awaiting a top-up.

    Args:
        cfg: the budget config (the ``budget:`` section).
        group_size: G (uniform's completions per problem; the round budget is B * G).
        batch_groups: B, trained groups per step.
        correctness_key: ``Group.reward_parts`` key of the 0/1 correctness reward (None: the
            total reward, >= 0.5 counts as correct), for the in-step posterior counts.
        tau: a problem's completions are split when their reward std >= tau.
        max_staleness: a pending top-up older than this many steps is dropped.
    """

    def __init__(
        self,
        cfg: BudgetConfig,
        group_size: int,
        batch_groups: int,
        correctness_key: str | None = None,
        tau: float = 1e-6,
        max_staleness: int = 1,
    ) -> None:
        cfg.validate("rollout")
        self.cfg = cfg
        self.group_size, self.batch_groups = group_size, batch_groups
        self.trained_size, self.round_samples = cfg.resolved(group_size)
        self.correctness_key, self.tau, self.max_staleness = correctness_key, tau, max_staleness
        self.pending: list[_Pool] = []

    @property
    def round_budget(self) -> int:
        """Completions one round may spend: B * G."""
        return self.batch_groups * self.group_size

    def price(self, sampler: PosteriorSource) -> float:
        """Value per generated completion that allocations are charged (see BudgetConfig).

        Auto: computed on the pool's problems that are not retired, each counted once
        (``curriculum.level_weights`` do not reweigh it)."""
        cfg, t = self.cfg, self.trained_size
        if cfg.mode == "uniform" or (cfg.mode == "knapsack" and cfg.price >= 0):
            return max(cfg.price, 0.0)
        a, b = sampler.pool_posterior()
        eff, cost = effective_tables(a, b, cfg.max_samples, t, cfg.objective)
        if cfg.mode == "sequential":  # a fresh problem's first round, the alternative
            r = self.round_samples
            return float(eff[:, r].sum() / max(cost[:, r].sum(), 1e-12))
        return efficiency_price(eff, cost, cfg.min_samples, cfg.max_samples)

    def start(self, sampler: PosteriorSource, step: int, keep_pending: bool) -> BudgetRounds:
        """The rounds of step ``step`` on their own, for driving the planner's steps
        (:meth:`BudgetRounds.plan_round` / ``merge`` / ``close``) without a DynamicSampler;
        ``keep_pending``: split problems still short of trained_size at its end are topped up
        next step (carry) instead of dropped."""
        shared = DynamicState(DynamicSamplingConfig(policy="carry" if keep_pending else "partial"))
        return BudgetRounds(self, sampler, self.batch_groups, step, shared)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        """Pending top-ups (their merged groups as plain dicts)."""
        return {
            "version": 1,
            "pending": [
                {"step": p.step, "group": dataclasses.asdict(merge_groups(p.parts))}
                for p in self.pending
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.pending = []
        for item in state.get("pending", []):
            d = dict(item["group"])
            group = Group(problem=Problem(**d.pop("problem")), **d)
            pool = _Pool(group.problem, int(item["step"]))
            _append(pool, group, self.correctness_key, self.tau)
            self.pending.append(pool)


def _correct(group: Group, key: str | None) -> list[float]:
    return list(group.reward_parts.get(key, group.rewards)) if key else list(group.rewards)


def _append(pool: _Pool, group: Group, key: str | None, tau: float) -> None:
    pool.parts.append(group)
    pool.rewards.extend(float(r) for r in group.rewards)
    pool.num_correct += sum(1 for c in _correct(group, key) if c >= SOLVED_THRESHOLD)
    # std >= range / sqrt(2 n) >= ... : the std itself only near the threshold
    r, n = pool.rewards, pool.n
    span = max(r) - min(r) if n >= 2 else 0.0
    pool.split = span >= tau and (span >= tau * (2 * n) ** 0.5 or float(np.std(r)) >= tau)


class BudgetRounds(RoundsBase):
    """The rounds of one step under a rollout budget (build with
    :meth:`DynamicSampler.start <megagrpo.curriculum.dynamic.DynamicSampler.start>`).

    Where it decides to resample: :meth:`next_requests` (another round while fewer than B
    problems are finished and fewer than 1 + R rounds were generated, planned by
    :meth:`plan_round`: top-ups, priced continuations, new draws); :meth:`add` merges each
    problem's answers (:meth:`merge`); :meth:`finish` trains the first B finished groups and
    carries (``carry``) or discards the surplus. ``plan_round`` / ``merge`` / ``close`` are
    the planner's own steps, without the stop rule (:meth:`BudgetPlanner.start`).

    Args:
        planner: the run's planner (config, price, pending top-ups).
        sampler, batch_groups, step, shared, carried, dropped_stale: as
            :class:`~megagrpo.curriculum.rounds.RoundsBase`; split problems short of
            trained_size at the end wait for the next step under the ``carry`` policy.
    """

    def __init__(
        self,
        planner: BudgetPlanner,
        sampler: PosteriorSource,
        batch_groups: int,
        step: int,
        shared: DynamicState,
        carried: list[Group] | None = None,
        dropped_stale: int = 0,
    ) -> None:
        super().__init__(sampler, batch_groups, step, shared, list(carried or []), dropped_stale)
        self.planner, self.sampler, self.budget_cfg = planner, sampler, planner.cfg
        self.keep_pending = shared.cfg.policy == "carry"
        pending, planner.pending = planner.pending, []
        self.round = 0
        fresh = [p for p in pending if step - p.step <= planner.max_staleness]
        self.active: list[_Pool] = fresh
        self._last: list[_Pool] = []
        self._observe: list[Group] = []
        self.raw_groups: list[Group] = []
        """First-round groups of the problems newly drawn this step, as generated."""
        self.price = planner.price(sampler) if planner.cfg.mode != "uniform" else 0.0
        self.fixed_batch = self.budget_cfg.mode == "knapsack" and self.budget_cfg.price == 0
        """Knapsack RL's setting: B problems per round share the budget, no continuation."""
        self.counts = {
            "completions": 0.0,
            "problems": 0.0,
            "new_problem_completions": 0.0,
            "topups": 0.0,
            "continued": 0.0,
            "dropped_collapsed": 0.0,
            "dropped_split": float(sum(p.n for p in pending) - sum(p.n for p in fresh)),
            "finished": 0.0,
        }

    # ------------------------------------------------------------------ the Rounds protocol

    def next_requests(self) -> list[Request] | None:
        """The next round's requests (mixed n), or None when the step's batch is decided."""
        if self._done:
            return None
        requests = self.plan_round()
        if not requests:
            self._done = True
            return None
        self._predict_first(requests)
        return requests

    def add(self, groups: list[Group]) -> list[FilterDecision]:
        """Take a generated round (in request order); the problems it finishes are valid.
        Returns no decisions: a problem finishes across rounds."""
        self.num_generated += 1
        self.num_checked += 1
        for g in groups:
            g.meta["step"] = self.step
        finished = self.merge(groups)
        self.valid.extend(finished)
        if self.num_generated == 1:
            self.num_valid_first = len(finished)
        full = self.num_valid >= self.batch_groups
        if full or self.num_checked >= checked_rounds(self.cfg):
            self._done = True
        return []

    def finish(self) -> FilledBatch:
        """The first B finished groups train, the surplus is carried (``carry``) or
        discarded; ``budget/*`` metrics from :meth:`close`."""
        b = self.batch_groups
        stats = self.close()
        success = self.num_valid >= b
        trained = self.valid[:b]
        discarded = self.shared.keep_surplus(self.valid[b:], b)
        self.first = list(self.raw_groups)
        self.first_matrices = ragged_matrices(self.first, self.shared.correctness_key)  # type: ignore[assignment]
        post = ragged_matrices(trained, self.shared.correctness_key)
        return self._batch(trained, post, success, discarded, stats)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ requests

    def plan_round(self) -> list[Request]:
        """This round's requests (empty when nothing is left to generate)."""
        budget = self.planner.round_budget
        reqs: list[Request] = []
        pools: list[_Pool] = []
        t = self.planner.trained_size
        for pool in [p for p in self.active if p.split]:  # top-ups first
            reqs.append(Request(pool.problem, t - pool.n))
            pools.append(pool)
            self.counts["topups"] += t - pool.n
        budget -= sum(r.n for r in reqs)
        cont = self._continuations([p for p in self.active if not p.split])
        for pool, n in cont:
            if n > 0 and n <= budget:
                reqs.append(Request(pool.problem, n))
                pools.append(pool)
                budget -= n
                self.counts["continued"] += n
            else:
                self._drop(pool)
        self._flush()  # dropped problems are observed before new ones are drawn
        new_reqs = self._new_requests(budget)
        for r in new_reqs:
            pools.append(_Pool(r.problem, self.step))
        reqs += new_reqs
        self.counts["problems"] += len(new_reqs)
        self.counts["new_problem_completions"] += sum(r.n for r in new_reqs)
        self._new_count = len(new_reqs)
        self._last = pools
        self.round += 1
        self.counts["completions"] += sum(r.n for r in reqs)
        return reqs

    def _continuations(self, pools: list[_Pool]) -> list[tuple[_Pool, int]]:
        """(pool, completions to add; 0 = stop) for problems not split yet, best first."""
        cfg, t = self.budget_cfg, self.planner.trained_size
        room = [p for p in pools if p.n < cfg.max_samples]
        for p in pools:
            if p.n >= cfg.max_samples:
                self._drop(p)
        if not room or cfg.mode == "uniform" or self.fixed_batch:
            for p in room:
                self._drop(p)
            return []
        a, b = self.sampler.posterior_of([p.problem for p in room])
        nc = np.array([p.num_correct for p in room], dtype=np.float64)
        nn = np.array([p.n for p in room], dtype=np.float64)
        a, b = a + nc, b + nn - nc  # the step's own evidence on top of the posterior
        all_correct = nc == nn
        m = cfg.max_samples
        miss = np.where(  # P(the next k completions are all the outcome seen so far)
            all_correct[:, None], beta_moments(a, b, m), beta_moments(b, a, m)
        )
        s = 1.0 - miss
        k = np.arange(m + 1, dtype=np.float64)
        eff = t * s if cfg.objective == "completions" else s
        cost = k + np.maximum(t - nn[:, None] - k, 0.0) * s
        value = eff - self.price * cost
        out = []
        for i, pool in enumerate(room):
            top = m - pool.n
            if cfg.mode == "sequential":
                n = min(self.planner.round_samples, top)
                keep = not cfg.sequential_gate or value[i, n] > 0
                out.append((pool, n if keep else 0))
            else:
                n = 1 + int(np.argmax(value[i, 1 : top + 1]))
                out.append((pool, n if value[i, n] > 0 else 0))
        best = {id(p): value[i, n] if n else -np.inf for i, (p, n) in enumerate(out)}
        return sorted(out, key=lambda pn: -best[id(pn[0])])

    def _new_requests(self, budget: int) -> list[Request]:
        cfg, resample = self.budget_cfg, self.round > 0
        if cfg.mode == "uniform":
            problems = self.sampler.next_problems(self.planner.batch_groups, resample=resample)
            return [Request(p, self.planner.group_size) for p in problems]
        if cfg.mode == "sequential":
            k = budget // self.planner.round_samples
            problems = self.sampler.next_problems(k, resample=resample) if k > 0 else []
            return [Request(p, self.planner.round_samples) for p in problems]
        if self.fixed_batch:  # Knapsack RL: a fixed batch of B prompts shares the budget
            k = min(self.planner.batch_groups, budget // cfg.min_samples)
            if k <= 0:
                return []
            problems = self.sampler.next_problems(k, resample=resample)
            eff, cost = self._tables(problems)
            n = knapsack_allocate(eff, budget, cfg.min_samples, cfg.max_samples)
            return [Request(p, int(x)) for p, x in zip(problems, n)]
        return self._priced_fill(budget, resample)

    def _tables(self, problems: Sequence[Problem]) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.sampler.posterior_of(problems)
        cfg = self.budget_cfg
        return effective_tables(a, b, cfg.max_samples, self.planner.trained_size, cfg.objective)

    def _priced_fill(self, budget: int, resample: bool) -> list[Request]:
        """Draw problems in chunks and give each its priced count until the budget is spent."""
        cfg, out = self.budget_cfg, []
        chunk_div = max(self.planner.trained_size, cfg.min_samples)
        for _ in range(4 * self.planner.round_budget):  # bounded; ends far earlier
            if budget < cfg.min_samples:
                break
            problems = self.sampler.next_problems(max(1, budget // chunk_div), resample=resample)
            eff, cost = self._tables(problems)
            counts = priced_choice(eff, cost, self.price, cfg.min_samples, cfg.max_samples)
            for j, (p, n) in enumerate(zip(problems, counts.tolist())):
                # keep min_samples for each problem still to serve in this chunk: the chunk
                # holds at most budget // trained_size problems, so every one fits
                reserve = cfg.min_samples * (len(problems) - j - 1)
                n = min(int(n), budget - reserve)
                out.append(Request(p, n))
                budget -= n
        return out

    # ------------------------------------------------------------------ results

    def merge(self, groups: Sequence[Group]) -> list[Group]:
        """Take the groups of the last requests (same order); returns the problems finished
        now: split, subsampled to trained_size, pool statistics in ``meta``."""
        if len(groups) != len(self._last):
            raise ValueError(f"add: {len(groups)} groups for {len(self._last)} requests")
        key, tau, t = self.planner.correctness_key, self.planner.tau, self.planner.trained_size
        new_start = len(self._last) - self._new_count
        finished = []
        observed = self._observe
        for j, (pool, group) in enumerate(zip(self._last, groups)):
            if group.problem.id != pool.problem.id:
                raise ValueError(f"add: group {j} is for {group.problem.id}, not {pool.problem.id}")
            group.meta.setdefault("step", self.step)
            _append(pool, group, key, tau)
            if j >= new_start:
                self.active.append(pool)
                if self.round == 1:
                    self.raw_groups.append(group)
        for pool in list(self.active):
            if pool.split and pool.n >= t:
                merged = merge_groups(pool.parts)
                observed.append(merged)
                finished.append(self._trained(merged))
                self.active.remove(pool)
            elif not pool.split and not self._may_continue(pool):
                self.active.remove(pool)
                observed.append(merge_groups(pool.parts))
                self.counts["dropped_collapsed"] += pool.n
        self._last = []
        self._flush()
        self.counts["finished"] += len(finished)
        return finished

    def _may_continue(self, pool: _Pool) -> bool:
        cfg = self.budget_cfg
        if cfg.mode == "uniform" or self.fixed_batch:
            return False
        return pool.n < cfg.max_samples

    def _trained(self, merged: Group) -> Group:
        rewards = np.asarray(merged.rewards, dtype=np.float64)
        keep = balanced_subsample(rewards > rewards.mean(), self.planner.trained_size)
        out = select_completions(merged, keep)
        out.meta[POOL_MEAN] = float(rewards.mean())
        out.meta[POOL_STD] = float(rewards.std(ddof=1)) if len(rewards) > 1 else 0.0
        out.meta[POOL_SIZE] = len(rewards)
        return out

    def _drop(self, pool: _Pool) -> None:
        """Stop sampling a problem that is not split; the sampler observes it (batched)."""
        if pool in self.active:
            self.active.remove(pool)
            self._observe.append(merge_groups(pool.parts))
            self.counts["dropped_collapsed"] += pool.n

    def _flush(self) -> None:
        if self._observe:
            self.sampler.observe(self._observe)
            self._observe = []

    def close(self) -> dict[str, float]:
        """End the step: split problems short of trained_size wait for next step (carry) or
        are dropped; the rest are dropped. Returns ``budget/*`` metrics."""
        observed = self._observe
        for pool in self.active:
            if pool.split and self.keep_pending:
                self.planner.pending.append(pool)
                continue
            observed.append(merge_groups(pool.parts))
            key = "dropped_split" if pool.split else "dropped_collapsed"
            self.counts[key] += pool.n
        self.active = []
        self._flush()
        out = {f"budget/{k}": v for k, v in self.counts.items()}
        out["budget/rounds"] = float(self.round)
        out["budget/price"] = float(self.price)
        out["budget/pending"] = float(len(self.planner.pending))
        return out
