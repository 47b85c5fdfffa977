"""Reward config: a weighted list of registered reward functions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from megagrpo.errors import require


@dataclass
class RewardSpec:
    """One reward function in the composite."""

    name: str = "mcq_accuracy"
    """Registry name (megagrpo.rewards.get) or 'module.path:ClassOrFunction' (ms-swift ORM)."""
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

    def validate(self, path: str) -> None:
        require(len(self.functions) > 0, f"{path}.functions", "needs at least one reward")
        for i, spec in enumerate(self.functions):  # the loader does not descend into lists
            spec.validate(f"{path}.functions.{i}")
        labels = [f.label or f.name for f in self.functions]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        require(not dup, f"{path}.functions", f"duplicate reward names {dup}; set 'label'")
