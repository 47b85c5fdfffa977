"""Rollout budget allocation: how many completions each problem gets, from its pass rate.

A group of n completions of a problem with per-sample success probability p is *split*
(both outcomes, non-zero advantages) with probability s(n) = 1 - p^n - (1-p)^n. Under the
posterior p ~ Beta(a, b) that the curriculum sampler keeps per problem (levels prior +
online evidence), ``E[p^n] = prod_{i<n} (a+i)/(a+b+i)``, so s(n) is exact and cheap.

Budgets compare at a fixed trained group size T (``trained_size``, default G): a split
problem with more than T completions is subsampled to T keeping both outcomes
(:func:`balanced_subsample`, Reinforce-Ada's balanced variant); one with fewer is topped up
to T in the next round. The *effective completions* of a problem are then T if it splits,
else 0, and its *cost* is n plus the top-up (T - n) when it splits.

- **knapsack** (Knapsack RL, arXiv 2509.25849): choose n_i in [min, max] for the candidates
  of a round to maximise sum_i v_i(n_i) under the round budget sum_i n_i <= C, with
  ``v_i(n) = E[eff_i(n)] - price * E[cost_i(n)]`` and eff = T s(n) (objective
  ``completions``) or s(n) (``groups``: the expected number of non-collapsed groups, the
  paper's ProbNonZeroGradient). price 0 is the paper's setting (spend the budget on a fixed
  prompt batch); the auto price is the best effective ratio reachable by per-problem
  allocations on the pool (:func:`efficiency_price`, Dinkelbach), which makes the round's
  allocation maximise effective completions *per generated completion*.
  :func:`knapsack_allocate` solves the multiple-choice knapsack exactly (dynamic programme).
- **sequential** (Reinforce-Ada, arXiv 2510.04996): a problem gets r completions per round
  until both outcomes are seen (or ``max_samples``); :func:`expected_rounds` is the closed
  form at fixed p.

Deliberately left out: Knapsack RL's InfoGain factor (it weights the value towards p near
1/3 for learning speed; our objective is the effective-completion count) and Reinforce-Ada's
``positive_focused`` exit rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megagrpo.types import Group

OBJECTIVES = ("completions", "groups")


# ----------------------------------------------------------------------------- beta moments


def beta_moments(a: np.ndarray | float, b: np.ndarray | float, n_max: int) -> np.ndarray:
    """``E[p^n]`` for p ~ Beta(a, b), n = 0..n_max: ``[K, n_max + 1]`` (K = len(a))."""
    a = np.atleast_1d(np.asarray(a, dtype=np.float64))
    b = np.atleast_1d(np.asarray(b, dtype=np.float64))
    i = np.arange(n_max, dtype=np.float64)
    logs = np.cumsum(np.log(a[:, None] + i) - np.log(a[:, None] + b[:, None] + i), axis=1)
    out = np.ones((len(a), n_max + 1))
    # below e^-690 the moment is 0 for every purpose; flushing it keeps subnormal floats
    # (100x slower arithmetic) out of the tables
    out[:, 1:] = np.where(logs > -690.0, np.exp(np.maximum(logs, -690.0)), 0.0)
    return out


def split_prob_table(a: np.ndarray | float, b: np.ndarray | float, n_max: int) -> np.ndarray:
    """P(n completions show both outcomes) = 1 - E[p^n] - E[(1-p)^n], ``[K, n_max + 1]``.

    Zero for n < 2 (clipped at 0 against rounding)."""
    s = 1.0 - beta_moments(a, b, n_max) - beta_moments(b, a, n_max)
    s[:, :2] = 0.0
    return np.clip(s, 0.0, 1.0)


def effective_tables(
    a: np.ndarray | float,
    b: np.ndarray | float,
    n_max: int,
    trained_size: int,
    objective: str = "completions",
) -> tuple[np.ndarray, np.ndarray]:
    """``(eff, cost)`` ``[K, n_max + 1]`` of giving each problem n completions now.

    eff: expected effective completions T s(n) (``completions``) or s(n) (``groups``);
    cost: expected completions generated, n + (T - n)^+ s(n) (the top-up to T when split).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    s = split_prob_table(a, b, n_max)
    n = np.arange(n_max + 1, dtype=np.float64)
    eff = trained_size * s if objective == "completions" else s
    cost = n + np.maximum(trained_size - n, 0.0) * s
    return eff, cost


# ----------------------------------------------------------------------------- knapsack


def knapsack_allocate(
    values: np.ndarray, budget: int, min_n: int, max_n: int, allow_zero: np.ndarray | None = None
) -> np.ndarray:
    """Exact multiple-choice knapsack: ``n [K]`` maximising sum_i values[i, n_i].

    Args:
        values: ``[K, >= max_n + 1]`` value of giving item i n units (column n).
        budget: sum_i n_i <= budget.
        min_n, max_n: n_i in [min_n, max_n] (or 0 where ``allow_zero[i]``).
        allow_zero: ``[K]`` bool, items that may also get 0 (a problem already served may
            stop); None: none.

    Ties go to the smaller total and, per item, to the smaller n. O(K * choices * budget).
    Raises ValueError when the forced minimum does not fit the budget.
    """
    values = np.asarray(values, dtype=np.float64)
    k = values.shape[0]
    zero = np.zeros(k, dtype=bool) if allow_zero is None else np.asarray(allow_zero, dtype=bool)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    if not 0 <= min_n <= max_n or values.shape[1] <= max_n:
        raise ValueError(f"bad bounds [{min_n}, {max_n}] for values of shape {values.shape}")
    choices = [
        np.array(([0] if zero[i] and min_n > 0 else []) + list(range(min_n, max_n + 1)))
        for i in range(k)
    ]
    best = np.array([c[int(np.argmax(values[i, c]))] for i, c in enumerate(choices)])
    if best.sum() <= budget:  # the unconstrained optimum fits: nothing binds
        return best.astype(np.int64)
    floor = sum(int(c[0]) for c in choices)
    if floor > budget:
        raise ValueError(f"knapsack: the minimum allocation ({floor}) exceeds the budget {budget}")
    cap = budget - floor  # units above each item's smallest choice
    dp = np.full(cap + 1, -np.inf)
    dp[0] = 0.0
    pick = np.zeros((k, cap + 1), dtype=np.int64)
    for i, c in enumerate(choices):
        extra = c - c[0]
        width = int(extra[-1]) + 1
        gain = np.full(width, -np.inf)  # value of each extra (-inf where not a choice)
        gain[extra] = values[i, c]
        # cand[x, e] = dp[x - e] + gain[e]: a sliding window over dp padded with -inf
        padded = np.concatenate([np.full(width - 1, -np.inf), dp])
        window = np.lib.stride_tricks.sliding_window_view(padded, width)[:, ::-1]
        cand = window + gain
        pick[i] = np.argmax(cand, axis=1)  # first maximum: the smallest extra on ties
        dp = cand[np.arange(cap + 1), pick[i]]
    used = int(np.argmax(dp >= dp.max() - 1e-12))  # smallest total reaching the optimum
    out = np.zeros(k, dtype=np.int64)
    for i in range(k - 1, -1, -1):
        e = int(pick[i, used])
        out[i] = int(choices[i][0]) + e
        used -= e
    return out


def priced_choice(
    eff: np.ndarray, cost: np.ndarray, price: float, min_n: int, max_n: int
) -> np.ndarray:
    """Per item, the n in [min_n, max_n] maximising eff - price * cost ``[K]`` (smallest on
    ties): the Lagrangian solution of the knapsack when the budget's shadow price is ``price``."""
    v = eff[:, min_n : max_n + 1] - price * cost[:, min_n : max_n + 1]
    return min_n + np.argmax(v >= v.max(axis=1, keepdims=True) - 1e-12, axis=1)


def efficiency_price(
    eff: np.ndarray,
    cost: np.ndarray,
    min_n: int,
    max_n: int,
    weights: np.ndarray | None = None,
    tol: float = 1e-10,
    max_iter: int = 100,
) -> float:
    """The best ratio sum w_i eff_i(n_i) / sum w_i cost_i(n_i) over per-item n_i in
    [min_n, max_n] (Dinkelbach's iteration; exact at convergence).

    With ``eff``/``cost`` from :func:`effective_tables` (objective completions) this is the
    highest expected effective ratio any per-problem allocation reaches on the population
    (top-ups included, collapsed problems dropped).
    """
    w = np.ones(eff.shape[0]) if weights is None else np.asarray(weights, dtype=np.float64)
    lam = 0.0
    rows = np.arange(eff.shape[0])
    for _ in range(max_iter):
        n = priced_choice(eff, cost, lam, min_n, max_n)
        den = float(w @ cost[rows, n])
        new = float(w @ eff[rows, n]) / den if den > 0 else 0.0
        if abs(new - lam) <= tol:
            return new
        lam = new
    return lam


# ----------------------------------------------------------------------------- sequential


def split_within(p: np.ndarray | float, round_samples: int, rounds: int) -> np.ndarray | float:
    """P(both outcomes within ``rounds`` rounds of r samples) at fixed p: 1 - x^R - y^R with
    x = p^r, y = (1-p)^r (0 for fewer than 2 samples)."""
    p = np.asarray(p, dtype=np.float64)
    n = round_samples * rounds
    out = np.where(n >= 2, 1.0 - p**n - (1.0 - p) ** n, 0.0)
    return float(out) if out.ndim == 0 else out


def expected_rounds(p: np.ndarray | float, round_samples: int, max_rounds: int) -> np.ndarray:
    """E[rounds sampled] when a problem gets r samples per round until both outcomes are seen,
    at most ``max_rounds`` rounds, at fixed p.

    Rounds are i.i.d., so P(not split after k rounds) = x^k + y^k (k >= 1; x = p^r,
    y = (1-p)^r) and E = 1 + sum_{k=1}^{R-1} (x^k + y^k) = 1 + g(x) + g(y) with the geometric
    sum g(z) = z (1 - z^(R-1)) / (1 - z) (= R - 1 at z = 1).
    """
    p = np.asarray(p, dtype=np.float64)
    x, y = p**round_samples, (1.0 - p) ** round_samples
    k = max_rounds - 1

    def geo(z: np.ndarray) -> np.ndarray:
        one = np.isclose(z, 1.0)
        safe = np.where(one, 0.5, z)
        return np.where(one, float(k), safe * (1.0 - safe**k) / (1.0 - safe))

    return 1.0 + geo(x) + geo(y)


# ----------------------------------------------------------------------------- groups


def balanced_subsample(correct: Sequence[bool] | np.ndarray, size: int) -> list[int]:
    """Indices (ascending) of ``size`` completions keeping both outcomes, balanced.

    Reinforce-Ada's balanced rule: ``size // 2`` correct and the rest wrong, the short side
    filled from the other; within a side the earliest completions are kept (they are i.i.d.
    draws, so the earliest are as good as a random choice and deterministic). All indices when
    there are at most ``size``.
    """
    c = np.asarray(correct, dtype=bool)
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if len(c) <= size:
        return list(range(len(c)))
    pos, neg = np.flatnonzero(c), np.flatnonzero(~c)
    take_pos = min(size // 2, len(pos))
    take_neg = min(size - take_pos, len(neg))
    take_pos = min(size - take_neg, len(pos))  # (size >= 2 and both sides present: both >= 1)
    return sorted(pos[:take_pos].tolist() + neg[:take_neg].tolist())


_PER_COMPLETION = ("completions", "token_ids", "logprobs", "rewards", "lengths", "finish_reasons")


def merge_groups(parts: Sequence[Group]) -> Group:
    """One group holding the completions of ``parts`` (same problem, generation order kept);
    ``reward_parts`` are concatenated name by name, ``meta`` of the first part is kept."""
    if not parts:
        raise ValueError("merge_groups: nothing to merge")
    first = parts[0]
    if len({p.problem.id for p in parts}) != 1:
        raise ValueError("merge_groups: parts of different problems")
    fields = {name: [x for p in parts for x in getattr(p, name)] for name in _PER_COMPLETION}
    names = set().union(*(p.reward_parts for p in parts))
    reward_parts = {k: [x for p in parts for x in p.reward_parts.get(k, [])] for k in names}
    if any(p.member_variants for p in parts):  # data.variants: who answered what, kept
        fields["member_variants"] = [p.variant_of(i) for p in parts for i in range(p.size)]
        fields["member_prompt_ids"] = [p.prompt_of(i) for p in parts for i in range(p.size)]
    return Group(
        problem=first.problem,
        prompt_ids=list(first.prompt_ids),
        reward_parts=reward_parts,
        meta=dict(first.meta),
        **fields,
    )


def select_completions(group: Group, indices: Sequence[int]) -> Group:
    """A copy of ``group`` with only the completions ``indices`` (every per-completion list,
    ``reward_parts`` included; lists shorter than the group, e.g. no log-probs, stay empty)."""
    n = group.size

    def pick(xs: list) -> list:
        return [xs[i] for i in indices] if len(xs) == n else list(xs)

    return Group(
        problem=group.problem,
        prompt_ids=list(group.prompt_ids),
        reward_parts={k: pick(v) for k, v in group.reward_parts.items()},
        meta=dict(group.meta),
        member_variants=pick(group.member_variants),
        member_prompt_ids=pick(group.member_prompt_ids),
        **{name: pick(getattr(group, name)) for name in _PER_COMPLETION},
    )
