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
# - reward_std: ms-swift's (rl_core/advantage.py compute_reward_metrics) is the mean over
#   groups of each group's unbiased std (reward/group_std_mean) with scale_rewards group or
#   none, the unbiased std of the whole batch with batch.
# - rewards/<f>/std: the unbiased std over the batch (torch .std()); megagrpo logs the
#   population std, so the alias is rescaled by sqrt(n / (n - 1)) when the number of
#   completions n is given (else copied as is).
# - entropy/mean: mean over completions of each completion's mean token entropy
#   (loss/entropy_seq_mean); TRL's entropy is the token mean (loss/entropy).
# - clip_ratio/low_min, clip_ratio/high_max: the smallest / largest clipped fraction of a
#   micro-batch (ms-swift: of a data-parallel rank's batch).
# - completions/clipped_ratio: the trained completions that stopped at the length limit, as
#   ms-swift (swift/rlhf_trainers/grpo_trainer.py _prepare_batch_inputs: the trained batch);
#   the share over every completion of every dynamic-sampling round is megagrpo's
#   length/clip_ratio, logged as completions/clipped_ratio_all_rounds.
# - rewards/<f>/mean|std: under the reward's label (the ms-swift flag name from-swift writes)
#   and under ms-swift's own name for it (swift_reward_names: the class name, as
#   swift/rlhf_trainers/utils.py resolve_reward_funcs names them: rewards/SoftOverlong/mean;
#   mcq_accuracy standing in for ms-swift's accuracy is rewards/MCQAccuracy/mean, never
#   MathAccuracy's panel).
SWIFT_ALIASES: dict[str, str] = {
    "reward": "reward/mean",
    "reward_std": "reward/std",
    "frac_reward_zero_std": "collapse/frac_reward_zero_std",
    "completions/mean_length": "length/mean",
    "completions/min_length": "length/min",
    "completions/max_length": "length/max",
    "completions/clipped_ratio": "length/clip_ratio_trained",
    "completions/clipped_ratio_all_rounds": "length/clip_ratio",
    "kl": "loss/kl",
    "entropy": "loss/entropy",
    "entropy/mean": "loss/entropy_seq_mean",
    "clip_ratio/low_mean": "loss/clip_frac_low",
    "clip_ratio/high_mean": "loss/clip_frac_high",
    "clip_ratio/low_min": "loss/clip_frac_low_min",
    "clip_ratio/high_max": "loss/clip_frac_high_max",
    "clip_ratio/region_mean": "loss/clip_frac",
    "learning_rate": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss": "loss/total",
}
"""Fixed aliases; ``rewards/<f>/mean|std`` are added per reward function."""


SWIFT_ORM_CLASSES = {
    "accuracy": "MathAccuracy",
    "format": "Format",
    "react_format": "ReActFormat",
    "cosine": "CosineReward",
    "repetition": "RepetitionPenalty",
    "soft_overlong": "SoftOverlong",
    "math": "MathORM",
    "toolbench": "ReactORM",
}
"""ms-swift 4.6's built-in reward names (``swift.rewards.orms``) -> the class names its
dashboards key them by."""


SAME_AS_SWIFT = {"soft_overlong": "SoftOverlong"}
"""megagrpo rewards that compute ms-swift's built-in of that name (checked against its code
in tests/unit/test_from_swift_fidelity.py): dashboarded under its class name."""
STAND_INS = {"mcq_accuracy": "MCQAccuracy"}
"""megagrpo rewards from-swift puts in place of another ms-swift function (``accuracy`` ->
mcq_accuracy): dashboarded under their own class-like name, never the replaced function's
(reviews/ms-swift-users-4.md F3: rewards/MathAccuracy/mean held mcq_accuracy)."""


def swift_reward_names(terms: list, functions: list | None = None) -> dict[str, str]:
    """``{term name: ms-swift's dashboard name}`` for the composite reward's terms (objects
    with ``name`` and ``fn``; ``functions``: the ``rewards.functions`` entries they were built
    from, in order): an ms-swift ORM (``fn.orm``) by ms-swift's own rule (a function's
    ``__name__``, else its class name); a megagrpo reward that is ms-swift's built-in by the
    built-in's class name (``soft_overlong`` -> SoftOverlong); a megagrpo reward standing in
    for another function by its own (``mcq_accuracy`` labelled ``accuracy`` ->
    MCQAccuracy, not MathAccuracy); others by their own name."""
    import inspect

    out = {}
    for i, term in enumerate(terms):
        orm = getattr(term.fn, "orm", None)
        source = functions[i].name if functions and i < len(functions) else term.name
        if orm is not None:
            out[term.name] = orm.__name__ if inspect.isfunction(orm) else type(orm).__name__
        elif source in SAME_AS_SWIFT:
            out[term.name] = SAME_AS_SWIFT[source]
        elif source in STAND_INS and source != term.name:
            out[term.name] = STAND_INS[source]
        else:
            out[term.name] = term.name
    return out


def group_std_mean(rewards_by_group: list[list[float]]) -> float:
    """Mean over groups of each group's unbiased reward std (0 for a group of one): ms-swift's
    ``reward_std`` (``group_rewards.std(-1).mean()``), groups of any size."""
    stds = []
    for rewards in rewards_by_group:
        n = len(rewards)
        if n < 2:
            stds.append(0.0)
            continue
        mean = sum(rewards) / n
        stds.append((sum((r - mean) ** 2 for r in rewards) / (n - 1)) ** 0.5)
    return sum(stds) / len(stds) if stds else 0.0


def swift_aliases(
    row: dict[str, float | None],
    reward_names: list[str],
    num_completions: int | None = None,
    advantage_scale: str = "group",
    swift_names: dict[str, str] | None = None,
) -> dict[str, float | None]:
    """The ms-swift/TRL names for ``row`` (a megagrpo metrics row), to log alongside it.

    Returns only aliases whose megagrpo source is in ``row`` (``None`` values stay ``None``),
    so a step that did not measure something does not invent it. ``num_completions``: the
    completions the reward statistics were taken over (trained groups x G); with it the std
    aliases are the unbiased std that TRL and ms-swift log. ``advantage_scale``
    (ms-swift's scale_rewards): ``reward_std`` is the mean per-group std unless ``batch``.
    ``swift_names``: ms-swift's name of each reward function (:func:`swift_reward_names`),
    aliased too.
    """
    pairs = dict(SWIFT_ALIASES)
    if advantage_scale != "batch":
        pairs["reward_std"] = "reward/group_std_mean"
    for name in reward_names:
        for alias in dict.fromkeys([name, (swift_names or {}).get(name, name)]):
            pairs[f"rewards/{alias}/mean"] = f"reward/{name}/mean"
            pairs[f"rewards/{alias}/std"] = f"reward/{name}/std"
    out: dict[str, float | None] = {}
    for alias, source in pairs.items():
        if source not in row:
            continue
        value = row[source]
        is_std = source == "reward/std" or alias.endswith("/std")
        if is_std and value is not None and num_completions and num_completions > 1:
            value = float(value) * (num_completions / (num_completions - 1)) ** 0.5
        out[alias] = value
    return out
