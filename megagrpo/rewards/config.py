"""Reward config: a weighted list of reward functions, plugin files, error and timeout policy."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from megagrpo.errors import ConfigError, require

ON_ERROR = ("count", "fail")


@dataclass
class RewardSpec:
    """One reward function in the composite."""

    name: str = "mcq_accuracy"
    """Registry name (megagrpo.rewards.get), 'module.path:ClassOrFunction' (a plugin: an
    ms-swift ORM or a function f(completions, **kwargs)), or 'orms:<name>' (ms-swift's orms
    registry, including names registered by rewards.external_plugins)."""
    weight: float = 1.0
    """Weight in the total reward (total = sum of weight * value)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the function's factory (e.g. soft_overlong's max_len)."""
    label: str = ""
    """Name of this term in metrics (``reward/<label>/mean``); defaults to ``name``."""

    def validate(self, path: str) -> None:
        require(
            bool(self.name.strip()),
            f"{path}.name",
            "must name a registered reward or 'module.path:ClassName'",
        )
        require(math.isfinite(self.weight), f"{path}.weight", f"must be finite, got {self.weight}")


@dataclass
class RewardsConfig:
    """The composite reward. The first function is the correctness reward for collapse stats."""

    functions: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    external_plugins: list[str] = field(default_factory=list)
    """Python files imported before the rewards are built (ms-swift's --external_plugins):
    their classes are then 'fileStem:ClassName', their orms['x'] registrations 'orms:x'."""
    on_error: str = "count"
    """count: a reward that raises, returns NaN/inf or times out scores 0 for that completion
    and is counted in reward/errors | fail: stop the run (ms-swift's behaviour)."""
    timeout_s: float = 120.0
    """Seconds one call of a reward function (one group) may take; longer counts as an error
    for each of its completions (and in reward/timeouts). 0: no limit (a hung reward then
    hangs the run)."""
    swift_calls: str = "batch"
    """batch | group: ms-swift ORMs (``orms:`` and ``module:Class`` plugins) are called once
    per generation round with every completion of it, as ms-swift calls them once per batch
    (batch-level plugins see the same batch; a failing call is retried group by group), or
    once per group (problem). megagrpo's own rewards are called per group."""
    answer_balance: float = 0.0
    """Multiple-choice answer balance, in [0, 1] (0: off): each completion answering ``x``
    loses ``answer_balance * max(0, share(x) - right(x))``, where over the step's first
    generation round ``share(x)`` is the share of completions answering ``x`` and
    ``right(x)`` the share whose problem ``x`` is right for (an unreadable answer is right
    for nothing). A letter the policy gives more often than it is right costs advantage, so
    it cannot settle on one letter for the questions it cannot read; a right answer still
    beats a wrong one (hence at most 1). Added to the advantages after the group
    normalisation: the rewards, dynamic sampling and the collapse metrics are unchanged
    (:mod:`megagrpo.rewards.balance`)."""

    def validate(self, path: str) -> None:
        require(len(self.functions) > 0, f"{path}.functions", "needs at least one reward")
        require(
            self.swift_calls in ("batch", "group"), f"{path}.swift_calls", "must be batch | group"
        )
        for i, spec in enumerate(self.functions):  # the loader does not descend into lists
            spec.validate(f"{path}.functions.{i}")
        labels = [f.label or f.name for f in self.functions]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        require(not dup, f"{path}.functions", f"duplicate reward names {dup}; set 'label'")
        require(
            math.isfinite(self.answer_balance) and 0.0 <= self.answer_balance <= 1.0,
            f"{path}.answer_balance",
            f"must be in [0, 1] (0: off), got {self.answer_balance}",
        )
        require(self.on_error in ON_ERROR, f"{path}.on_error", f"must be one of {ON_ERROR}")
        require(
            math.isfinite(self.timeout_s) and self.timeout_s >= 0,
            f"{path}.timeout_s",
            f"must be >= 0 (0: no limit), got {self.timeout_s}",
        )
        for i, plugin in enumerate(self.external_plugins):
            require(
                isinstance(plugin, str) and plugin.endswith(".py"),
                f"{path}.external_plugins.{i}",
                f"must be a path to a .py file, got {plugin!r}",
            )


def resolve_soft_overlong(
    rewards: RewardsConfig, max_tokens: int, path: str = "rewards"
) -> RewardsConfig:
    """The rewards config with every ``soft_overlong`` term's ``max_len`` defaulted to
    ``max_tokens`` (``rollout.max_tokens``, as ms-swift defaults ``soft_max_length`` to
    ``max_completion_length``), checked against it.

    A ``max_len`` greater than ``max_tokens`` is a ConfigError: no completion can reach it,
    so the ramp is cut short (and with ``max_len - cache_len >= max_tokens`` the term is
    identically 0). The same applies to ms-swift's SoftOverlong named by path
    (``kwargs.soft_max_length``). Returns a new config; ``rewards`` is not modified.
    """
    out = dataclasses.replace(
        rewards,
        functions=[dataclasses.replace(f, kwargs=dict(f.kwargs)) for f in rewards.functions],
    )
    for i, spec in enumerate(out.functions):
        key = _soft_overlong_key(spec.name)
        if key is None:
            continue
        spec.kwargs.setdefault(key, int(max_tokens))
        max_len = spec.kwargs[key]
        if not isinstance(max_len, int) or max_len > max_tokens:
            raise ConfigError(
                f"config key '{path}.functions.{i}.kwargs.{key}': {max_len!r} exceeds "
                f"rollout.max_tokens={max_tokens}: no completion can be that long, so the "
                "overlong penalty never reaches -1 (drop the key to use rollout.max_tokens)"
            )
    return out


def _soft_overlong_key(name: str) -> str | None:
    """The max-length kwarg of a soft overlong reward named ``name`` (None: not one)."""
    if name == "soft_overlong":
        return "max_len"
    if name in ("orms:soft_overlong",) or name.endswith(":SoftOverlong"):
        return "soft_max_length"
    return None
