"""Learning, not guessing: what a policy that ignores the question would score, and whether
a measured accuracy beats it beyond noise.

- :func:`megagrpo.rewards.answers.guess_baselines`: on a set of multiple-choice questions,
  the accuracy of the best *constant answer* (always the same letter, chosen knowing the
  golds: the best any question-blind policy can do) and *chance* (one option uniformly at
  random); it reads answers as the rewards do, so it lives beside them.
- :func:`answer_shares`: how often each answer was given (``"none"``: no readable answer).
- :func:`wilson_interval` and :func:`learning_verdict`: ``learned`` only when the lower end
  of a 95% binomial interval on the held-out count lies above the best constant answer (and
  above the accuracy the run started from).
- :func:`megagrpo.rewards.answers.answer_bias`: the share of one answer across a step's
  completions next to the share of problems that answer is right for (``collapse/answer_bias``,
  ``collapse/answer_bias_gold``): when completions converge to one letter across problems
  although the golds do not, the groups collapse because the policy guesses, not because
  the problems are solved; :func:`answer_bias_warning` words it.

Why the Wilson score interval: it has a closed form (no SciPy at run time), its coverage
stays close to the nominal 95% for the small held-out sets and the accuracies near 0 or 1
seen here, where the normal (Wald) interval undercovers; Clopper-Pearson is exact but
conservative (wider than needed) and needs beta quantiles. Comparing its lower end to the
constant-answer accuracy is a one-sided test at about 2.5%: a policy whose true accuracy
equals the best constant answer passes about once in 40 evaluations, one that answers a
constant letter never does (its accuracy *is* the constant answer's, and the lower end lies
below it).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

Z95 = 1.959963984540054
"""Two-sided 95% normal quantile (scipy.stats.norm.ppf(0.975))."""
LETTERS = "abcdefgh"
BIAS_MIN_SHARE = 0.6
"""Answer-bias collapse: at least this share of the answers is one answer..."""
BIAS_MIN_EXCESS = 0.25
"""...and it is given this much more often than it is right (its gold share)."""


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for ``k`` successes in ``n`` trials (95% two-sided by default);
    (0, 1) when ``n`` is 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= k <= n:
        raise ValueError(f"wilson_interval: k={k} is not in 0..n={n}")
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def answer_shares(predictions: Sequence[str]) -> dict[str, float]:
    """Share of each answer (``"c"``, ``"c,d"``; ``"none"`` for an empty prediction), most
    common first."""
    if not predictions:
        return {}
    counts = Counter(p or "none" for p in predictions)
    n = len(predictions)
    return {a: c / n for a, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))}


def learning_verdict(
    correct: int, total: int, best_constant: float, start: float | None = None
) -> dict[str, Any]:
    """Does ``correct`` of ``total`` beat guessing beyond noise? ``interval``: the 95% Wilson
    interval; ``margin``: its lower end minus the bar, where the bar is the best constant
    answer's accuracy (or ``start``, the accuracy before training, when higher);
    ``learned``: margin > 0."""
    lo, hi = wilson_interval(correct, total)
    bar = max(best_constant, start if start is not None else 0.0)
    return {
        "accuracy": correct / total if total else 0.0,
        "interval": [lo, hi],
        "bar": bar,
        "margin": lo - bar,
        "learned": bool(total > 0 and lo > bar),
    }


def answer_bias_warning(row: dict[str, Any]) -> str | None:
    """The warning for an answer-bias collapse in a metrics row, else None: one answer makes
    up at least :data:`BIAS_MIN_SHARE` of the answers and exceeds its gold share by
    :data:`BIAS_MIN_EXCESS` (a solved batch answers like its golds, so it never warns)."""
    bias, gold = row.get("collapse/answer_bias"), row.get("collapse/answer_bias_gold")
    if bias is None or gold is None or math.isnan(bias) or math.isnan(gold):
        return None
    if bias < BIAS_MIN_SHARE or bias - gold < BIAS_MIN_EXCESS:
        return None
    index = row.get("collapse/answer_bias_letter")
    what = (
        f"'{LETTERS[int(index)]}'"
        if isinstance(index, float) and not math.isnan(index)
        else "the same answer"
    )
    return (
        f"answer-bias collapse: {bias:.0%} of the first round's answers are {what}, which is "
        f"right for only {gold:.0%} of them: groups collapse because the policy answers a "
        "constant, not because it solves the problems"
    )
