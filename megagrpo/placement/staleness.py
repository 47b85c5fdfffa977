"""How far rollouts lag the trainer's weights (one-step off-policy and partial rollouts
count alike: ``rollout.max_staleness``, ``rollout.partial.max_staleness``), and how long the
engines' and the trainer's busy intervals overlap (``perf/overlap_s``)."""

from __future__ import annotations

from megagrpo.placement.rounds import member_lags
from megagrpo.types import Group


class StalenessError(RuntimeError):
    """A batch lags the trainer's weights by more than its bound."""


def staleness(groups: list[Group], version: int) -> list[int]:
    """Versions each group lags ``version`` (the weights the trainer trains from)."""
    return [version - int(g.meta["policy_version"]) for g in groups]


def check_staleness(groups: list[Group], version: int, limit: int) -> list[int]:
    """:func:`staleness` of ``groups``; StalenessError when one exceeds ``limit`` or is from
    the future (the engine cannot hold weights the trainer has not pushed)."""
    lags = staleness(groups, version)
    bad = [lag for lag in lags if lag > limit or lag < 0]
    if bad:
        raise StalenessError(
            f"a batch {max(bad, key=abs)} versions behind the trainer's weights (version "
            f"{version}; rollout.max_staleness={limit}): not trained"
        )
    return lags


def check_token_staleness(groups: list[Group], step: int, bound: int) -> None:
    """Partial rollouts: StalenessError when any token of ``groups`` lags training step
    ``step`` by more than ``bound`` versions (carried and generated-ahead lags counted alike:
    ``rollout.partial.max_staleness``), or was sampled by weights newer than the step's."""
    lags = [lag for g in groups for lag in member_lags(g, step)]
    bad = [lag for lag in lags if lag > bound or lag < 0]
    if bad:
        raise StalenessError(
            f"a token {max(bad, key=abs)} versions behind training step {step} "
            f"(rollout.partial.max_staleness={bound}): not trained"
        )


def stamp_staleness(groups: list[Group], version: int) -> list[int]:
    """:func:`staleness` of ``groups``, also written to each group's ``meta['staleness']``."""
    lags = staleness(groups, version)
    for g, lag in zip(groups, lags):
        g.meta["staleness"] = lag
    return lags


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the time both ``a`` and ``b`` cover (each a list of ``(start, end)``
    intervals; overlapping intervals of one list, e.g. of several replicas, count once)."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in _union(a) for s2, e2 in _union(b))


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out
