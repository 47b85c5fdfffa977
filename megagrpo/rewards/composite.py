"""Composite reward: a weighted sum of reward functions, per-function values kept for metrics.

``total[i] = sum_k weight_k * value_k[i]``. Scoring never crashes a step: when a function
raises (or returns a wrong number of values, or a non-finite value), it is re-run one
completion at a time; every completion whose scoring still fails is logged with the problem id,
counted (``reward/errors`` in :meth:`CompositeReward.pop_metrics`), and scores 0 for that
function. Only wiring mistakes (a length-based reward called without ``lengths``) raise.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from megagrpo.rewards.config import RewardsConfig
from megagrpo.rewards.registry import RewardFn, get
from megagrpo.types import Problem

logger = logging.getLogger(__name__)


def _accepts(fn: RewardFn, arg: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return arg in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@dataclass
class _Term:
    name: str
    weight: float
    fn: RewardFn
    takes_lengths: bool
    takes_token_ids: bool


class CompositeReward:
    """``(completions [G], problem, lengths [G]=None, token_ids=None) -> (total [G],
    parts {name: [G]})``. The first term is the correctness reward (used for collapse stats)."""

    def __init__(self, terms: list[tuple[str, float, RewardFn]]) -> None:
        if not terms:
            raise ValueError("a composite reward needs at least one function")
        self.terms = [
            _Term(n, float(w), f, _accepts(f, "lengths"), _accepts(f, "token_ids"))
            for n, w, f in terms
        ]
        self.num_errors = 0
        self._errors_since_pop = 0

    @property
    def names(self) -> list[str]:
        """Term names, in config order (the keys of ``parts``)."""
        return [t.name for t in self.terms]

    def __call__(
        self,
        completions: list[str],
        problem: Problem,
        lengths: Sequence[int] | None = None,
        token_ids: Sequence[Sequence[int]] | None = None,
    ) -> tuple[list[float], dict[str, list[float]]]:
        n = len(completions)
        total = [0.0] * n
        parts: dict[str, list[float]] = {}
        for term in self.terms:
            if term.takes_lengths and lengths is None and not term.takes_token_ids:
                raise TypeError(f"reward '{term.name}' needs completion lengths; pass lengths=")
            values = self._score(term, completions, problem, lengths, token_ids)
            parts[term.name] = values
            total = [t + term.weight * v for t, v in zip(total, values)]
        return total, parts

    def _call(self, term: _Term, completions, problem, lengths, token_ids) -> list[float]:
        kwargs = {}
        if term.takes_lengths and lengths is not None:
            kwargs["lengths"] = list(lengths)
        if term.takes_token_ids and token_ids is not None:
            kwargs["token_ids"] = list(token_ids)
        values = [float(v) for v in term.fn(list(completions), problem, **kwargs)]
        if len(values) != len(completions):
            raise ValueError(f"returned {len(values)} values for {len(completions)} completions")
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"returned a non-finite value: {values}")
        return values

    def _score(self, term: _Term, completions, problem, lengths, token_ids) -> list[float]:
        try:
            return self._call(term, completions, problem, lengths, token_ids)
        except Exception:  # noqa: BLE001 - isolate per completion below
            pass
        values = []
        for i, text in enumerate(completions):
            one_len = None if lengths is None else [lengths[i]]
            one_ids = None if token_ids is None else [token_ids[i]]
            try:
                values.append(self._call(term, [text], problem, one_len, one_ids)[0])
            except Exception as exc:  # noqa: BLE001 - a reward must never crash a step
                self.num_errors += 1
                self._errors_since_pop += 1
                logger.warning(
                    "reward '%s' failed on problem %s, completion %d: %s: %s",
                    term.name,
                    problem.id,
                    i,
                    type(exc).__name__,
                    exc,
                )
                values.append(0.0)
        return values

    def pop_metrics(self) -> dict[str, float]:
        """``{"reward/errors": completions whose scoring failed since the last pop}``."""
        out = {"reward/errors": float(self._errors_since_pop)}
        self._errors_since_pop = 0
        return out


def build_composite(cfg: RewardsConfig) -> CompositeReward:
    """Build the weighted composite from ``cfg.functions`` (ConfigError on bad entries)."""
    terms = [
        (spec.label or spec.name, spec.weight, get(spec.name, **dict(spec.kwargs)))
        for spec in cfg.functions
    ]
    return CompositeReward(terms)
