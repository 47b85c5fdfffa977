"""Budgeted rounds (megagrpo.curriculum.budget_rounds) with the real CurriculumSampler."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from megagrpo.curriculum.budget import expected_rounds
from megagrpo.curriculum.budget_rounds import (
    POOL_MEAN,
    POOL_SIZE,
    POOL_STD,
    BudgetPlanner,
    pool_baselines,
)
from megagrpo.curriculum.config import BudgetConfig, CurriculumConfig, DynamicSamplingConfig
from megagrpo.curriculum.sampler import CurriculumSampler
from megagrpo.plan.simulate import CORRECTNESS_KEY, BernoulliEngine, PlanSetup, run_plan
from megagrpo.plan.simulate_budget import BudgetLoop, generate_mixed, run_budget_plan
from megagrpo.types import Group, Problem

SPECIALIST = {1: 2164, 2: 294, 3: 223, 4: 180, 5: 216, 6: 636}
ALL = [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("policy", ["partial", "carry"])
@pytest.mark.parametrize("retire", [0, 2])
def test_uniform_budget_reproduces_dynamic_sampler(policy, retire):
    """The round loop + planner with budget=uniform is the real DynamicSampler, draw for draw."""
    cur = CurriculumConfig(keep_levels=ALL, retire_streak=retire)
    # a uniform budget is dynamic sampling with first rounds of B (no oversampling)
    dyn = DynamicSamplingConfig(policy=policy, max_resample=3, oversample="off")
    setup = PlanSetup(SPECIALIST, 5, 8, 96, 25, cur, seed=1)
    ref = run_plan(setup, dyn)
    got = run_budget_plan(setup, dyn, BudgetConfig())
    for a, b in zip(ref.steps, got.steps):
        assert b["budget/completions"] == a["dynamic/gen_batches"] * 96 * 8
        assert b["collapse/acr_raw"] == a["collapse/acr_raw"]
        assert b["dynamic/valid_groups"] == a["dynamic/valid_groups"]
        assert b["dynamic/valid_groups_carried"] == a["dynamic/valid_groups_carried"]
        for key in [k for k in a if k.startswith("curriculum/")]:
            assert b[key] == a[key], key  # same sampler state: same observations, same draws
    assert got.to_dict()["trained_group_size_mean"] == 8.0


class ScriptedSampler:
    """A PosteriorSource with fixed posteriors and a list of problems to hand out."""

    k = 5

    def __init__(self, problems, a=1.0, b=1.0):
        self.problems, self.pos = list(problems), 0
        self.a, self.b = a, b
        self.observed: list[Group] = []

    def next_problems(self, n, resample=False):
        out = [self.problems[(self.pos + i) % len(self.problems)] for i in range(n)]
        self.pos += n
        return out

    def observe(self, groups):
        self.observed.extend(groups)

    def posterior_of(self, problems):
        return np.full(len(problems), self.a), np.full(len(problems), self.b)

    def pool_posterior(self):
        return np.array([self.a]), np.array([self.b])

    def level_of(self, pid):
        return None


def _scripted(problem, rewards):
    n = len(rewards)
    return Group(
        problem=problem,
        completions=[str(r) for r in rewards],
        token_ids=[[i] for i in range(n)],
        logprobs=[[0.0] for _ in range(n)],
        rewards=list(rewards),
        reward_parts={CORRECTNESS_KEY: list(rewards)},
    )


def test_sequential_rounds_topup_subsample_and_pool_statistics():
    probs = [Problem(f"q{i}", [], ["a"]) for i in range(4)]
    sampler = ScriptedSampler(probs)
    cfg = BudgetConfig(mode="sequential", round_samples=4, sequential_gate=False)
    planner = BudgetPlanner(cfg, group_size=8, batch_groups=1, correctness_key=CORRECTNESS_KEY)
    step = planner.start(sampler, step=0, keep_pending=True)
    reqs = step.plan_round()  # budget 8: two new problems with 4 each
    assert [(r.problem.id, r.n) for r in reqs] == [("q0", 4), ("q1", 4)]
    assert step.merge([_scripted(probs[0], [1, 1, 1, 1]), _scripted(probs[1], [1, 0, 0, 0])]) == []
    reqs = step.plan_round()  # q1 split with 4 < 8: top-up first; q0 continues
    assert [(r.problem.id, r.n) for r in reqs] == [("q1", 4), ("q0", 4)]
    done = step.merge([_scripted(probs[1], [0, 0, 0, 0]), _scripted(probs[0], [1, 1, 1, 0])])
    assert sorted(g.problem.id for g in done) == ["q0", "q1"]
    q1 = next(g for g in done if g.problem.id == "q1")
    assert q1.size == 8 and q1.rewards == [1, 0, 0, 0, 0, 0, 0, 0]
    assert q1.meta[POOL_SIZE] == 8 and q1.meta[POOL_MEAN] == pytest.approx(1 / 8)
    assert q1.meta[POOL_STD] == pytest.approx(np.std([1] + [0] * 7, ddof=1))
    mean, std = pool_baselines([q1, _scripted(probs[2], [1, 0, 0])])
    assert mean.tolist() == pytest.approx([1 / 8, 1 / 3])  # pool stats, or the group's own
    assert std.tolist() == pytest.approx([np.std([1] + [0] * 7, ddof=1), np.std([1, 0, 0], ddof=1)])
    stats = step.close()
    assert stats["budget/completions"] == 16 and stats["budget/topups"] == 4
    assert stats["budget/continued"] == 4 and stats["budget/rounds"] == 2
    assert [g.size for g in sampler.observed] == [8, 8]  # each problem observed once, merged


def test_balanced_subsample_of_a_large_pool_and_pending_topups_across_steps():
    probs = [Problem(f"q{i}", [], ["a"]) for i in range(3)]
    sampler = ScriptedSampler(probs)
    cfg = BudgetConfig(mode="sequential", round_samples=12, max_samples=12)
    planner = BudgetPlanner(cfg, 8, batch_groups=2, correctness_key=CORRECTNESS_KEY)
    step = planner.start(sampler, step=0, keep_pending=True)
    reqs = step.plan_round()  # budget 16: one problem with 12
    assert [(r.problem.id, r.n) for r in reqs] == [("q0", 12)]
    rewards = [0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1, 0]  # 3 correct of 12
    (g,) = step.merge([_scripted(probs[0], rewards)])
    assert g.size == 8 and sum(g.rewards) == 3  # balanced: all 3 correct + 5 wrong
    assert g.token_ids == [[0], [1], [2], [3], [4], [5], [7], [10]]  # earliest of each side
    assert g.meta[POOL_MEAN] == pytest.approx(0.25) and g.meta[POOL_SIZE] == 12
    step.close()
    # a split problem short of the trained size waits for the next step (carry) ...
    cfg2 = BudgetConfig(mode="sequential", round_samples=2)
    planner2 = BudgetPlanner(cfg2, 8, batch_groups=1, correctness_key=CORRECTNESS_KEY)
    s0 = planner2.start(sampler, step=0, keep_pending=True)
    reqs = s0.plan_round()
    s0.merge([_scripted(r.problem, [1, 0]) for r in reqs])
    s0.close()
    assert len(planner2.pending) == 4
    state = planner2.state_dict()
    planner3 = BudgetPlanner(cfg2, 8, batch_groups=1, correctness_key=CORRECTNESS_KEY)
    planner3.load_state_dict(state)
    assert [(p.problem.id, p.rewards, p.split) for p in planner3.pending] == [
        (p.problem.id, p.rewards, p.split) for p in planner2.pending
    ]
    s1 = planner3.start(sampler, step=1, keep_pending=True)
    reqs = s1.plan_round()
    assert [r.n for r in reqs[:4]] == [6, 6, 6, 6]  # ... and is topped up first
    # ... unless it is staler than max_staleness
    planner3.load_state_dict(state)
    s3 = planner3.start(sampler, step=3, keep_pending=True)
    assert s3.counts["dropped_split"] == 8.0 and not s3.active


def test_sequential_expected_rounds_match_the_geometric_closed_form():
    """Ungated sequential sampling, r = 2, at most 4 rounds, p = 0.8 for every problem."""
    p, r, max_rounds, n_problems = 0.8, 2, 4, 30000
    problems = [Problem(f"p{i}", [], ["a"]) for i in range(n_problems)]
    cur = CurriculumConfig(keep_levels=[1], retire_streak=0, online=False)
    sampler = CurriculumSampler(problems, cur, None, CORRECTNESS_KEY)
    engine = BernoulliEngine({q.id: p for q in problems}, seed=3)
    cfg = BudgetConfig(
        mode="sequential",
        round_samples=r,
        max_samples=r * max_rounds,
        trained_size=2,
        sequential_gate=False,
    )
    planner = BudgetPlanner(cfg, 8, batch_groups=20, correctness_key=CORRECTNESS_KEY)
    step = planner.start(sampler, 0, keep_pending=False)
    rounds: Counter[str] = Counter()
    first: dict[str, int] = {}
    for j in range(60):
        reqs = step.plan_round()
        for q in reqs:
            rounds[q.problem.id] += 1
            first.setdefault(q.problem.id, j)
        step.merge(generate_mixed(engine, reqs))
    assert step.counts["dropped_collapsed"] > 0
    done = [rounds[q] for q, j in first.items() if j < 60 - max_rounds]  # complete histories
    assert len(done) > 1000
    se = np.std(done) / math.sqrt(len(done))
    assert np.mean(done) == pytest.approx(expected_rounds(p, r, max_rounds), abs=4 * se)


def test_knapsack_gives_extreme_levels_a_probe_and_every_problem_is_observed_once():
    cur = CurriculumConfig(keep_levels=ALL, retire_streak=0)
    dyn = DynamicSamplingConfig(policy="partial", max_resample=3)
    res = run_budget_plan(
        PlanSetup(SPECIALIST, 5, 8, 96, 6, cur), dyn, BudgetConfig(mode="knapsack")
    )
    summary = res.to_dict()
    assert summary["trained_group_size_mean"] == 8.0
    assert summary["first_request_mean_n"] < 5  # most draws are L1/L6 probes of 2
    from megagrpo.plan.simulate import synthetic_population

    problems, levels, ps = synthetic_population(SPECIALIST, 5, seed=0)
    sampler = CurriculumSampler(problems, cur, levels, CORRECTNESS_KEY, level_k=5)
    engine = BernoulliEngine(ps, seed=0)
    planner = BudgetPlanner(BudgetConfig(mode="knapsack"), 8, 96, CORRECTNESS_KEY)
    loop = BudgetLoop(planner, dyn)
    before = sampler.num_observed.copy()
    sizes_by_level: dict[int, list[int]] = {}
    step = planner.start(sampler, 0, keep_pending=False)
    reqs = step.plan_round()
    for q in reqs:
        sizes_by_level.setdefault(levels[q.problem.id], []).append(q.n)
    assert step.counts["completions"] <= planner.round_budget  # never above B * G
    assert max(sizes_by_level[1]) == 2 and max(sizes_by_level[6]) == 2  # probes
    assert min(sizes_by_level[3] + sizes_by_level[4]) >= 8  # likely splits get >= T at once
    step.merge(generate_mixed(engine, reqs))
    step.close()
    observed = int((sampler.num_observed - before).sum())
    assert observed == len(reqs)  # one observation per problem, whatever its rounds
    trained, stats = loop.step(sampler, engine, 1)
    assert all(g.size == 8 and 0 < sum(g.rewards) < 8 for g in trained)
