"""The metric names of ../shared/DESIGN.md: every row of metrics.jsonl holds all of them."""

from __future__ import annotations

LEVELS = tuple(range(1, 7))

CORE_METRICS: tuple[str, ...] = (
    "collapse/acr_raw",
    "collapse/solve_all_raw",
    "collapse/solve_none_raw",
    "collapse/frac_reward_zero_std",
    "collapse/acr_predicted",
    *(f"collapse/acr_by_level/L{k}" for k in LEVELS),
    "dynamic/success",
    "dynamic/rounds",
    "dynamic/valid_groups",
    "dynamic/gen_batches",
    "dynamic/valid_groups_carried",
    "reward/mean",
    "length/mean",
    "length/clip_ratio",
    "loss/policy",
    "loss/kl",
    "loss/clip_frac",
    "loss/entropy",
    "perf/tokens_per_s",
    "perf/step_s",
    "perf/gen_s",
    "perf/train_s",
    "perf/sync_s",
    "perf/sync_bytes",
    *(f"curriculum/level_hist/L{k}" for k in LEVELS),
)
"""Fixed names. ``reward/<fn>/mean`` is added per configured reward function."""


def reward_metric_names(reward_names: list[str]) -> list[str]:
    """``reward/<fn>/mean`` for each configured reward function."""
    return [f"reward/{name}/mean" for name in reward_names]


def required_metrics(reward_names: list[str]) -> list[str]:
    """Every name a step row must hold for a run with these reward functions."""
    return [*CORE_METRICS, *reward_metric_names(reward_names)]


def missing_metrics(row: dict, reward_names: list[str]) -> list[str]:
    """Names from :func:`required_metrics` absent from ``row`` (empty when complete)."""
    return [n for n in required_metrics(reward_names) if n not in row]
