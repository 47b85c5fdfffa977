"""How many sequences each decode step of a rollout round carries (`megagrpo plan-memory`).

A round's batch shrinks as completions finish: decode step ``t`` (0-based) runs the
completions longer than ``t`` tokens. With completion lengths ``L`` i.i.d. of survival
``S[t] = P(L > t)``, ``N`` completions in the round and a step cost ``c(n)`` for ``n``
running sequences, the expected decode time is

    sum_t  P_any[t] * c(N * S[t] / P_any[t]),   P_any[t] = 1 - (1 - S[t]) ** N

(a step happens while any completion runs; ``N S / P_any`` is the expected batch given that
one does). It is exact for a cost affine in ``n`` (``tests/unit/test_plan_decode.py``
enumerates every outcome of a small distribution); the planner's cost is affine but for the
experts a step touches, which saturate at a few dozen sequences.

Partial rollouts (``rollout.partial``, :mod:`megagrpo.placement.partial`): in steady state each
round runs ``T`` steps with ``N`` new completions and the carried cohorts ``k = 1..s``
(``s = max_staleness``) that began ``k`` rounds ago and have ``kT`` tokens; it stops at the first
chunk where ``finish_fraction`` of them finished, ``(1 - S[(s+1)T]) / sum_k S[kT] >= f``, and
cohort ``s`` (at the staleness limit) then runs to its end at a small batch. ``s = 0`` is the
synchronous round.

The length distribution is an assumption (no 235B completions exist to measure): log-normal
with mean ``Assumptions.mean_completion_tokens`` and shape ``Assumptions.completion_sigma``
(``tools/bench_packing.py``'s model: sigma 0.6, median ~900), clipped to [16, max_tokens].
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

MIN_COMPLETION_TOKENS = 16
"""Shortest completion of the length model (``tools/bench_packing.py`` clips there too)."""


@functools.lru_cache(maxsize=64)
def _lognormal_survival(mean: float, sigma: float, max_tokens: int) -> np.ndarray:
    t = np.arange(max_tokens, dtype=np.float64)
    if sigma <= 0:  # every completion of the mean length
        return (t < min(max(mean, MIN_COMPLETION_TOKENS), max_tokens)).astype(np.float64)
    mu = math.log(mean) - sigma * sigma / 2  # the mean of the unclipped log-normal is ``mean``
    z = (np.log(np.maximum(t, 1.0)) - mu) / (sigma * math.sqrt(2.0))
    s = 0.5 * np.vectorize(math.erfc)(z)
    s[t < MIN_COMPLETION_TOKENS] = 1.0
    s.setflags(write=False)
    return s


def lognormal_survival(mean: float, sigma: float, max_tokens: int) -> np.ndarray:
    """``S[t] = P(L > t)`` for ``t = 0 .. max_tokens - 1`` (``[max_tokens]``) of completion
    lengths log-normal with mean ``mean`` (unclipped) and shape ``sigma``, clipped to
    [16, ``max_tokens``]; ``sigma = 0``: every completion ``mean`` long. Read-only (cached)."""
    return _lognormal_survival(float(mean), float(sigma), int(max_tokens))


def _at(s: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``S[idx]`` with ``S = 0`` past the end (no completion is longer than max_tokens)."""
    out = np.zeros(idx.shape, dtype=np.float64)
    ok = idx < len(s)
    out[ok] = s[idx[ok]]
    return out


@dataclass
class RoundShape:
    """The steps of one round, as fractions of its ``N`` new completions (``[steps]`` each).

    ``running[t]``: expected completions running at step ``t`` / N (carried cohorts included);
    ``p_any[t]``: probability that step ``t`` happens; ``context[t]``: mean tokens of context
    (completion side) of the running ones; ``round_tokens``: the budget step ``T`` (the whole
    round for synchronous rounds); ``in_flight``: completions at the round's start / N;
    ``carried_context``: completion tokens of the carried ones at the start / N (re-prefilled:
    the prefix cache is keyed by the adapter version)."""

    running: np.ndarray
    p_any: np.ndarray
    context: np.ndarray
    round_tokens: int
    in_flight: float
    carried_context: float

    @property
    def expected_steps(self) -> float:
        return float(self.p_any.sum())


def synchronous_round(s: np.ndarray, n_total: float) -> RoundShape:
    """Every completion of the round runs to its end (``n_total`` completions of survival
    ``s``)."""
    t = np.arange(len(s), dtype=np.float64)
    p_any = 1.0 - (1.0 - s) ** n_total
    return RoundShape(s.copy(), p_any, t, len(s), 1.0, 0.0)


def budget_steps(s: np.ndarray, finish_fraction: float, max_staleness: int, chunk: int) -> int:
    """The steady-state round length ``T`` of partial rollouts: the first multiple of ``chunk``
    where ``(1 - S[(s+1)T]) / sum_{k=0..s} S[kT] >= finish_fraction`` (module doc)."""
    n = len(s)
    for steps in range(chunk, n + chunk, chunk):
        k = np.arange(max_staleness + 1) * steps
        done = 1.0 - _at(s, np.array([(max_staleness + 1) * steps]))[0]
        if done / _at(s, k).sum() >= finish_fraction - 1e-12:
            return min(steps, n)
    return n


def partial_round(
    s: np.ndarray, n_total: float, finish_fraction: float, max_staleness: int, chunk: int
) -> RoundShape:
    """The steady-state round of partial rollouts (module doc)."""
    steps = budget_steps(s, finish_fraction, max_staleness, chunk)
    n = len(s)
    k = np.arange(max_staleness + 1)[:, None] * steps
    t = np.arange(steps)[None, :]
    cohorts = _at(s, k + t)  # [s + 1, T]
    running_head = cohorts.sum(axis=0)
    ctx_head = (cohorts * (k + t)).sum(axis=0) / np.maximum(running_head, 1e-30)
    start = max_staleness * steps  # cohort s runs to its end after the budget
    tail_idx = np.arange(start + steps, n)
    tail = _at(s, tail_idx)
    running = np.concatenate([running_head, tail])
    head_any = 1.0 - np.prod((1.0 - cohorts) ** n_total, axis=0)
    p_any = np.concatenate([head_any, 1.0 - (1.0 - tail) ** n_total])
    context = np.concatenate([ctx_head, tail_idx.astype(np.float64)])
    ks = np.arange(1, max_staleness + 1) * steps
    carried = _at(s, ks)
    return RoundShape(
        running, p_any, context, steps, 1.0 + float(carried.sum()), float((carried * ks).sum())
    )


def expected_decode_s(shape: RoundShape, seqs: float, step_s) -> float:
    """Expected seconds of a round's decode steps: ``sum_t P_any c(seqs * running / P_any)``
    (module doc); ``step_s(n [steps], context [steps]) -> seconds [steps]``, ``seqs`` the
    round's new completions per replica."""
    keep = shape.p_any > 1e-12
    p = shape.p_any[keep]
    n = seqs * shape.running[keep] / p
    return float((p * step_s(n, shape.context[keep])).sum())
