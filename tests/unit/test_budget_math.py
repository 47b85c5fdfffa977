"""Rollout-budget math (megagrpo.curriculum.budget) against closed forms and brute force."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from megagrpo.curriculum.budget import (
    balanced_subsample,
    beta_moments,
    effective_tables,
    efficiency_price,
    expected_rounds,
    knapsack_allocate,
    merge_groups,
    priced_choice,
    select_completions,
    split_prob_table,
    split_within,
)
from megagrpo.curriculum.config import BudgetConfig
from megagrpo.curriculum.levels import beta_collapse_prob
from megagrpo.errors import ConfigError
from megagrpo.types import Group, Problem


def _beta_moment(a: float, b: float, n: int) -> float:
    """E[p^n] = B(a + n, b) / B(a, b) through lgamma (independent of the product form)."""
    lbeta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    return math.exp(math.lgamma(a + n) + math.lgamma(b) - math.lgamma(a + b + n) - lbeta)


@pytest.mark.parametrize("a,b", [(0.294, 0.119), (5.294, 0.119), (2.0, 3.0), (0.5, 40.0)])
def test_beta_moments_and_split_prob_closed_form(a, b):
    m = beta_moments(a, b, 40)[0]
    for n in (0, 1, 2, 7, 8, 33, 40):
        assert m[n] == pytest.approx(_beta_moment(a, b, n), rel=1e-10, abs=1e-300)
    s = split_prob_table(a, b, 40)[0]
    assert s[0] == s[1] == 0.0
    for n in (2, 5, 8, 32):  # the levels module's independent E[p^G] + E[(1-p)^G]
        assert s[n] == pytest.approx(1.0 - beta_collapse_prob(a, b, n), abs=1e-12)
    assert np.all(np.diff(s) >= -1e-15)  # more completions never split less often


def test_beta_moments_flush_underflow_to_zero():
    m = beta_moments(0.01, 5000.0, 300)  # E[p^300] ~ e^-2500
    assert m[0, -1] == 0.0 and np.all(np.isfinite(m))
    assert not np.any((m > 0) & (m < np.finfo(np.float64).tiny))  # no subnormals


def test_effective_tables_topup_cost():
    eff, cost = effective_tables(2.0, 2.0, 12, trained_size=8)
    s = split_prob_table(2.0, 2.0, 12)[0]
    assert eff[0, 3] == pytest.approx(8 * s[3])
    assert cost[0, 3] == pytest.approx(3 + 5 * s[3])  # 3 now, 5 more if it split
    assert cost[0, 10] == pytest.approx(10)  # no top-up above the trained size
    eff_g, _ = effective_tables(2.0, 2.0, 12, trained_size=8, objective="groups")
    assert eff_g[0, 9] == pytest.approx(s[9])
    with pytest.raises(ValueError, match="objective"):
        effective_tables(1.0, 1.0, 4, 8, objective="tokens")


def _brute_force(values, budget, lo, hi, zero):
    choices = [
        ([0] if zero[i] and lo > 0 else []) + list(range(lo, hi + 1)) for i in range(len(values))
    ]
    best = None
    for combo in itertools.product(*choices):
        if sum(combo) <= budget:
            v = sum(values[i, n] for i, n in enumerate(combo))
            best = v if best is None else max(best, v)
    return best, choices


def test_knapsack_matches_brute_force_on_random_small_instances():
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(400):
        k, hi = int(rng.integers(1, 5)), int(rng.integers(1, 6))
        lo = int(rng.integers(0, hi + 1))
        values = rng.normal(size=(k, hi + 1))
        zero = rng.random(k) < 0.4
        budget = int(rng.integers(0, k * hi + 2))
        best, choices = _brute_force(values, budget, lo, hi, zero)
        if best is None:
            with pytest.raises(ValueError, match="exceeds the budget"):
                knapsack_allocate(values, budget, lo, hi, zero)
            continue
        n = knapsack_allocate(values, budget, lo, hi, zero)
        assert n.sum() <= budget
        assert all(x in choices[i] for i, x in enumerate(n.tolist()))
        assert sum(values[i, x] for i, x in enumerate(n.tolist())) == pytest.approx(best, abs=1e-9)
        checked += 1
    assert checked > 200


def test_knapsack_on_split_probabilities_moves_budget_to_uncertain_problems():
    # Knapsack RL's setting: maximise the expected number of split groups of 4 problems
    a = np.array([30.0, 1.0, 3.0, 0.2])
    b = np.array([0.3, 1.0, 3.0, 20.0])
    s = split_prob_table(a, b, 16)
    n = knapsack_allocate(s, 32, 2, 16)
    best, _ = _brute_force(s, 32, 2, 16, np.zeros(4, bool))
    assert sum(s[i, x] for i, x in enumerate(n)) == pytest.approx(best)
    assert n.sum() == 32  # values increase with n: the whole budget is spent


def test_priced_choice_and_efficiency_price_against_enumeration():
    rng = np.random.default_rng(3)
    a, b = rng.gamma(0.5, 2.0, size=4) + 0.05, rng.gamma(0.5, 2.0, size=4) + 0.05
    eff, cost = effective_tables(a, b, 6, trained_size=4)
    lam = efficiency_price(eff, cost, 1, 6)
    best = max(
        sum(eff[i, n] for i, n in enumerate(c)) / sum(cost[i, n] for i, n in enumerate(c))
        for c in itertools.product(range(1, 7), repeat=4)
    )
    assert lam == pytest.approx(best, rel=1e-9)
    n = priced_choice(eff, cost, lam, 1, 6)  # the Dinkelbach optimum reaches it
    rows = np.arange(4)
    assert eff[rows, n].sum() / cost[rows, n].sum() == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("p", [0.03, 0.2, 0.5, 0.97, 1.0])
@pytest.mark.parametrize("r,rounds", [(1, 6), (2, 4), (8, 3)])
def test_expected_rounds_geometric_closed_form(p, r, rounds):
    # direct sum of P(not split after k rounds), k = 0..R-1
    direct = 1.0 + sum(p ** (r * k) + (1 - p) ** (r * k) for k in range(1, rounds))
    if r == 1 and p in (0.0, 1.0):
        direct = float(rounds)
    assert expected_rounds(p, r, rounds) == pytest.approx(direct, rel=1e-12)
    assert split_within(p, r, rounds) == pytest.approx(
        0.0 if r * rounds < 2 else 1 - p ** (r * rounds) - (1 - p) ** (r * rounds)
    )


def test_expected_rounds_against_monte_carlo():
    rng = np.random.default_rng(0)
    p, r, rounds = 0.9, 2, 5
    draws = rng.random((40000, r * rounds)) < p
    got = []
    for row in draws:
        k = rounds
        for j in range(1, rounds + 1):
            seen = row[: r * j]
            if seen.any() and not seen.all():
                k = j
                break
        got.append(k)
    se = np.std(got) / math.sqrt(len(got))
    assert np.mean(got) == pytest.approx(expected_rounds(p, r, rounds), abs=4 * se)


def test_balanced_subsample():
    correct = [1, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1]  # 10 correct, 2 wrong
    keep = balanced_subsample(correct, 8)
    assert keep == sorted(keep) and len(keep) == 8
    assert sum(correct[i] for i in keep) == 6  # both wrong kept, 6 earliest correct
    assert [i for i in keep if not correct[i]] == [3, 8]
    assert balanced_subsample([1, 0, 1, 0, 1, 0, 1, 0, 1, 0], 4) == [0, 1, 2, 3]
    assert balanced_subsample([1, 1, 0], 8) == [0, 1, 2]  # fewer than size: all of them
    assert balanced_subsample([1] * 9 + [0], 2) == [0, 9]  # both outcomes survive
    for _ in range(200):  # both outcomes kept whenever there were both
        c = np.random.default_rng(_).random(int(np.random.default_rng(_).integers(3, 30))) < 0.8
        size = 2 + _ % 9
        keep = balanced_subsample(c, size)
        assert len(keep) == min(size, len(c))
        if c.any() and not c.all():
            assert c[keep].any() and not c[keep].all()
        n_pos = min(size // 2, int(c.sum()))
        n_neg = min(size - n_pos, int((~c).sum()))
        assert int(c[keep].sum()) == min(size - n_neg, int(c.sum()))


def _group(pid, rewards, offset=0):
    n = len(rewards)
    return Group(
        problem=Problem(pid, [], ["a"]),
        completions=[f"c{offset + i}" for i in range(n)],
        token_ids=[[offset + i] * (i + 1) for i in range(n)],
        logprobs=[[-0.1] * (i + 1) for i in range(n)],
        rewards=list(rewards),
        prompt_ids=[7, 8],
        finish_reasons=["stop"] * n,
        reward_parts={"correct": list(rewards)},
        meta={"step": 3},
    )


def test_merge_and_select_keep_every_per_completion_field_aligned():
    merged = merge_groups([_group("q", [1.0, 1.0]), _group("q", [0.0, 1.0, 0.0], offset=2)])
    assert merged.size == 5 and merged.rewards == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert merged.completions == [f"c{i}" for i in range(5)]
    assert merged.lengths == [1, 2, 1, 2, 3] and merged.meta == {"step": 3}
    sub = select_completions(merged, [1, 2])
    assert sub.completions == ["c1", "c2"] and sub.token_ids == [[1, 1], [2]]
    assert sub.reward_parts == {"correct": [1.0, 0.0]} and sub.logprobs == [[-0.1, -0.1], [-0.1]]
    with pytest.raises(ValueError, match="different problems"):
        merge_groups([_group("q", [1.0]), _group("r", [1.0])])


def test_budget_config_validation():
    BudgetConfig(mode="knapsack").validate("budget")
    for kw, key in (
        ({"mode": "greedy"}, "budget.mode"),
        ({"min_samples": 0}, "budget.min_samples"),
        ({"min_samples": 9, "max_samples": 8}, "budget.max_samples"),
        ({"trained_size": 1}, "budget.trained_size"),
        ({"objective": "tokens"}, "budget.objective"),
        ({"price": -0.5}, "budget.price"),
        ({"advantage_baseline": "batch"}, "budget.advantage_baseline"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            BudgetConfig(**kw).validate("budget")
    assert BudgetConfig(mode="sequential").resolved(8) == (8, 8)
    with pytest.raises(ConfigError, match="max_samples"):
        BudgetConfig(mode="knapsack", max_samples=4).resolved(8)
    with pytest.raises(ConfigError, match="trained_size"):
        BudgetConfig(trained_size=16).resolved(8)
