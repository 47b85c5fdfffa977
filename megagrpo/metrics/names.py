"""The metric names of ../shared/DESIGN.md (every row of metrics.jsonl holds all of them), and
the ms-swift/TRL dashboard aliases (:func:`swift_aliases`)."""

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


# ms-swift / TRL dashboard names -> the megagrpo name each is read from.
# Differences in meaning, where there are any:
# - frac_reward_zero_std: post-filter (the trained batch), as ms-swift logs it after dynamic
#   sampling; the pre-filter value is collapse/frac_reward_zero_std_raw (no TRL name).
# - reward_std, rewards/<f>/std: TRL/ms-swift use the unbiased std (torch .std()); megagrpo
#   logs the population std, so the alias is rescaled by sqrt(n / (n - 1)) when the number of
#   completions n is given (else copied as is).
# - completions/clipped_ratio: TRL counts the trained completions; megagrpo's
#   length/clip_ratio counts every generated completion of the step (all rounds).
SWIFT_ALIASES: dict[str, str] = {
    "reward": "reward/mean",
    "reward_std": "reward/std",
    "frac_reward_zero_std": "collapse/frac_reward_zero_std",
    "completions/mean_length": "length/mean",
    "completions/min_length": "length/min",
    "completions/max_length": "length/max",
    "completions/clipped_ratio": "length/clip_ratio",
    "kl": "loss/kl",
    "entropy": "loss/entropy",
    "clip_ratio/low_mean": "loss/clip_frac_low",
    "clip_ratio/high_mean": "loss/clip_frac_high",
    "clip_ratio/region_mean": "loss/clip_frac",
    "learning_rate": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss": "loss/total",
}
"""Fixed aliases; ``rewards/<f>/mean|std`` are added per reward function."""


def swift_aliases(
    row: dict[str, float | None], reward_names: list[str], num_completions: int | None = None
) -> dict[str, float | None]:
    """The ms-swift/TRL names for ``row`` (a megagrpo metrics row), to log alongside it.

    Returns only aliases whose megagrpo source is in ``row`` (``None`` values stay ``None``),
    so a step that did not measure something does not invent it. ``num_completions``: the
    completions the reward statistics were taken over (trained groups x G); with it the std
    aliases are the unbiased std that TRL and ms-swift log.
    """
    pairs = dict(SWIFT_ALIASES)
    for name in reward_names:
        pairs[f"rewards/{name}/mean"] = f"reward/{name}/mean"
        pairs[f"rewards/{name}/std"] = f"reward/{name}/std"
    out: dict[str, float | None] = {}
    for alias, source in pairs.items():
        if source not in row:
            continue
        value = row[source]
        is_std = alias == "reward_std" or alias.endswith("/std")
        if is_std and value is not None and num_completions and num_completions > 1:
            value = float(value) * (num_completions / (num_completions - 1)) ** 0.5
        out[alias] = value
    return out
