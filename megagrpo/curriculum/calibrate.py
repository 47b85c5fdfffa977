"""Calibrating the planner: predicted vs measured raw ACR per level, and refitting its prior.

The planner predicts a level's collapse probability from a population prior Beta(a, b)
fitted to the level histogram: a level-L problem (c of k profile samples correct) has
p ~ Beta(a + c, b + k - c) and P(collapse at G) = E[p^G] + E[(1-p)^G]
(:meth:`BetaPrior.level_collapse_prob`). Two things check that against a run:

- :func:`predicted_acr_metrics`, once per step on the first round's problems, *before* the
  sampler observes them: the mean predicted collapse of each profile level under the
  sampler's current posterior (levels prior + online evidence) at each problem's group size,
  logged as ``collapse/acr_predicted_by_level/L{k}`` next to the measured
  ``collapse/acr_by_level/L{k}``.
- :func:`refit_prior`: the (a, b) that make the static per-level prediction best explain a
  run's measured per-level raw ACR (``metrics.jsonl`` rows), by maximum binomial likelihood
  (counts from ``collapse/groups_by_level/L{k}`` when logged; else each step's fraction
  counts as one observation). ``megagrpo plan --calibrate RUN_DIR`` prints both and plans
  with the refitted prior.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from megagrpo.curriculum.budget import beta_moments
from megagrpo.curriculum.levels import BetaPrior, beta_collapse_prob, correct_from_level
from megagrpo.types import Problem

MEASURED = "collapse/acr_by_level/L{}"
COUNTS = "collapse/groups_by_level/L{}"
PREDICTED = "collapse/acr_predicted_by_level/L{}"


class LevelPosteriorSource(Protocol):
    """What :func:`predicted_acr_metrics` needs of a sampler (CurriculumSampler has it)."""

    k: int

    def posterior_of(self, problems: Sequence[Problem]) -> tuple[np.ndarray, np.ndarray]: ...

    def level_of(self, problem_id: str) -> int | None: ...


def predicted_acr_metrics(
    sampler: LevelPosteriorSource, problems: Sequence[Problem], sizes: Sequence[int] | int
) -> dict[str, float]:
    """Predicted raw collapse of a step's first-round problems, per profile level.

    Args:
        sampler: its posterior must not include these problems' groups yet (call before
            ``observe``).
        problems: the first round's problems ``[N]``.
        sizes: completions each problem gets ``[N]`` (or one G for all).

    Returns ``collapse/acr_predicted_by_level/L1..L{k+1}`` (NaN for a level with no problem
    this step; unprofiled problems are skipped) and ``collapse/acr_predicted_step`` (all
    problems, NaN when there are none).
    """
    num_levels = int(sampler.k) + 1
    out = {PREDICTED.format(lv): math.nan for lv in range(1, num_levels + 1)}
    out["collapse/acr_predicted_step"] = math.nan
    if not problems:
        return out
    n = np.broadcast_to(np.asarray(sizes, dtype=np.int64), (len(problems),))
    a, b = sampler.posterior_of(problems)
    top = int(n.max())
    rows = np.arange(len(problems))
    p = beta_moments(a, b, top)[rows, n] + beta_moments(b, a, top)[rows, n]
    levels = np.array([sampler.level_of(q.id) or 0 for q in problems], dtype=np.int64)
    for lv in np.unique(levels[levels > 0]).tolist():
        out[PREDICTED.format(lv)] = float(p[levels == lv].mean())
    out["collapse/acr_predicted_step"] = float(p.mean())
    return out


@dataclass
class Calibration:
    """Result of :func:`refit_prior`: priors, per-level measured/predicted ACR, likelihoods."""

    prior_before: BetaPrior
    prior_after: BetaPrior
    measured: dict[int, float]
    weight: dict[int, float]
    predicted_before: dict[int, float]
    predicted_after: dict[int, float]
    steps: int
    loglik_before: float = 0.0
    loglik_after: float = 0.0
    notes: list[str] = field(default_factory=list)

    def mean_abs_error(self, after: bool) -> float:
        """Mean over levels of |measured - predicted| (weighted by observations)."""
        pred = self.predicted_after if after else self.predicted_before
        w = sum(self.weight.values())
        return sum(self.weight[lv] * abs(self.measured[lv] - pred[lv]) for lv in self.measured) / (
            w or 1.0
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "prior_before": {"a": self.prior_before.a, "b": self.prior_before.b},
            "prior_after": {"a": self.prior_after.a, "b": self.prior_after.b},
            "steps": self.steps,
            "measured": {f"L{k}": v for k, v in self.measured.items()},
            "observations": {f"L{k}": v for k, v in self.weight.items()},
            "predicted_before": {f"L{k}": v for k, v in self.predicted_before.items()},
            "predicted_after": {f"L{k}": v for k, v in self.predicted_after.items()},
            "mean_abs_error_before": self.mean_abs_error(after=False),
            "mean_abs_error_after": self.mean_abs_error(after=True),
            "loglik_before": self.loglik_before,
            "loglik_after": self.loglik_after,
            "notes": self.notes,
        }


def measured_acr_by_level(
    rows: Sequence[Mapping[str, Any]], num_levels: int
) -> tuple[dict[int, float], dict[int, float]]:
    """``(collapsed fraction, observations)`` per level over ``rows`` (metrics.jsonl rows).

    Observations are the logged group counts when every used row has them, else the number
    of rows with a value for that level."""
    measured, weight = {}, {}
    for i, r in enumerate(rows):
        if not isinstance(r, Mapping):
            raise ValueError(f"row {i + 1} is not a JSON object: {str(r)[:40]!r}")
    for lv in range(1, num_levels + 1):
        vals = [_checked(r, MEASURED.format(lv), COUNTS.format(lv)) for r in rows]
        used = [(v, c) for v, c in vals if v is not None]
        if not used:
            continue
        counts = [c for _, c in used if c is not None]
        if len(counts) == len(used):
            total = sum(counts)
            if total <= 0:
                continue
            measured[lv] = sum(v * c for (v, _), c in zip(used, counts)) / total
            weight[lv] = total
        else:
            measured[lv] = float(np.mean([v for v, _ in used]))
            weight[lv] = float(len(used))
    return measured, weight


def _checked(row: Mapping[str, Any], value_key: str, count_key: str):
    """``(collapsed fraction, group count)`` of one row; ValueError naming the step and key
    for a fraction outside [0, 1], or a count that is negative, NaN or not a number while
    the fraction is measured."""
    step = row.get("step", "?")
    try:
        value, count = _num(row.get(value_key)), row.get(count_key)
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"{value_key}={value} outside [0, 1]")
        if value is None or count is None:
            return value, None
        count = float(count)
        if math.isnan(count) or count < 0:
            raise ValueError(f"{count_key}={count} is not a count")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"step {step}: {exc}") from None
    return value, count


def _num(x: Any) -> float | None:
    """A metrics value as float; None for missing, null or NaN."""
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) else x


def _level_probs(prior: BetaPrior, k: int, g: int, levels: Sequence[int]) -> dict[int, float]:
    return {lv: prior.level_collapse_prob(lv, k, g) for lv in levels}


def _loglik(
    la: float, lb: float, k: int, g: int, measured: Mapping[int, float], w: Mapping[int, float]
) -> float:
    a, b = math.exp(la), math.exp(lb)
    total = 0.0
    for lv, m in measured.items():
        c = correct_from_level(lv, k)
        p = min(max(beta_collapse_prob(a + c, b + k - c, g), 1e-12), 1.0 - 1e-12)
        total += w[lv] * (m * math.log(p) + (1.0 - m) * math.log(1.0 - p))
    return total


def refit_prior(
    rows: Sequence[Mapping[str, Any]],
    k: int,
    group_size: int,
    prior: BetaPrior,
    first_steps: int = 0,
    lo: float = 1e-3,
    hi: float = 1e3,
) -> Calibration:
    """Refit the population prior so the static per-level prediction explains a run.

    Args:
        rows: metrics.jsonl rows (``collapse/acr_by_level/L*``; ``collapse/groups_by_level/L*``
            used as weights when present).
        k: profile samples per problem (levels L1..L{k+1}).
        group_size: G of the run's first rounds.
        prior: the planner's prior (fitted to the level histogram) to compare against.
        first_steps: use only the first this many rows (0: all). The prior describes the
            model *before* training: the first steps are the fair test; later ones include
            learning and the online curriculum.

    Maximum likelihood over (log a, log b) in [lo, hi]^2: a grid, then a shrinking pattern
    search. Raises ValueError when no row has a per-level measurement.
    """
    used = list(rows[:first_steps] if first_steps > 0 else rows)
    measured, weight = measured_acr_by_level(used, k + 1)
    if not measured:
        raise ValueError(
            "no collapse/acr_by_level/L* values in the metrics (was the run given a levels file?)"
        )
    grid = np.linspace(math.log(lo), math.log(hi), 41)
    best = max(
        (_loglik(la, lb, k, group_size, measured, weight), la, lb) for la in grid for lb in grid
    )
    ll, la, lb = best
    step = float(grid[1] - grid[0])
    while step > 1e-6:
        moved = False
        for da, db in ((step, 0.0), (-step, 0.0), (0.0, step), (0.0, -step)):
            na = min(max(la + da, math.log(lo)), math.log(hi))
            nb = min(max(lb + db, math.log(lo)), math.log(hi))
            v = _loglik(na, nb, k, group_size, measured, weight)
            if v > ll + 1e-12:
                ll, la, lb, moved = v, na, nb, True
        if not moved:
            step /= 2
    after = BetaPrior(math.exp(la), math.exp(lb))
    levels = sorted(measured)
    out = Calibration(
        prior_before=prior,
        prior_after=after,
        measured=measured,
        weight=weight,
        predicted_before=_level_probs(prior, k, group_size, levels),
        predicted_after=_level_probs(after, k, group_size, levels),
        steps=len(used),
        loglik_before=_loglik(
            math.log(prior.a), math.log(prior.b), k, group_size, measured, weight
        ),
        loglik_after=ll,
    )
    if len(measured) < 2:
        out.notes.append("one level measured: (a, b) are not identified, only this level's ACR")
    return out
