"""Collapse statistics of a batch of GRPO groups (ACR, ms-swift's frac_reward_zero_std, ...).

A group of G rewards is *collapsed* when all its rewards are equal: its group-normalised
advantages are all zero and it contributes no policy gradient. Definitions:

- ACR (ACR paper, def. 4.1): fraction of groups with ``std < tau`` (tau = 1e-6);
- ``frac_reward_zero_std`` (ms-swift): fraction with ``std <= 1e-8`` (torch's unbiased std);
- ``solve_all`` / ``solve_none``: every / no completion correct (a value >= 0.5 counts as
  correct) on the correctness reward when given, else on the total reward;
- ``acr_correctness``: ACR judged on the correctness reward alone. The total reward may add
  a length penalty that splits a group which is otherwise all-correct or all-wrong.

Statistics are computed twice per step (``../shared/DESIGN.md``): on the first generated
round (raw, pre-filter, ``*_raw``) and on the batch actually trained (post-filter);
:func:`collapse_metrics` names them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

ACR_TAU = 1e-6
MSSWIFT_ZERO_STD = 1e-8
SOLVED_THRESHOLD = 0.5


def collapse_prob(p: float | np.ndarray, group_size: int) -> float | np.ndarray:
    """P(a group of ``group_size`` Bernoulli(p) rewards is collapsed) = p^G + (1-p)^G."""
    p = np.asarray(p, dtype=np.float64)
    out = p**group_size + (1.0 - p) ** group_size
    return float(out) if out.ndim == 0 else out


Rows = np.ndarray | list[np.ndarray]


def _as_matrix(values: Any) -> Rows:
    """``[N, G]`` float array from array-like, or a list of ``[G_n]`` arrays when the groups
    have different sizes (rollout budgets)."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except ValueError:  # ragged: numpy refuses inhomogeneous rows
        return [np.asarray(r, dtype=np.float64).reshape(-1) for r in values]
    if arr.size == 0:
        return arr.reshape(0, 0)
    if arr.ndim != 2:
        raise ValueError(f"rewards must be [N, G], got shape {arr.shape}")
    return arr


def _sizes(rows: Rows) -> list[int]:
    return [len(r) for r in rows] if isinstance(rows, list) else [rows.shape[1]] * rows.shape[0]


def group_std(values: Any, ddof: int = 0) -> np.ndarray:
    """Per-group std ``[N]`` of ``values [N, G]`` or ragged rows (ddof=1: torch.std, as
    ms-swift; a group of at most ``ddof`` values has std 0)."""
    arr = _as_matrix(values)
    if isinstance(arr, list):
        return np.array([r.std(ddof=ddof) if len(r) > ddof else 0.0 for r in arr])
    if arr.shape[0] == 0:
        return np.zeros(0)
    if arr.shape[1] <= ddof:
        return np.zeros(arr.shape[0])
    return arr.std(axis=1, ddof=ddof)


def _all_any_solved(rows: Rows) -> tuple[np.ndarray, np.ndarray]:
    """``(every completion solved [N], none solved [N])``."""
    if isinstance(rows, list):
        solved = [r >= SOLVED_THRESHOLD for r in rows]
        return np.array([s.all() for s in solved]), np.array([not s.any() for s in solved])
    solved = rows >= SOLVED_THRESHOLD
    return np.asarray(solved.all(axis=1)), np.asarray((~solved).all(axis=1))


def collapse_stats(
    rewards: Any,
    correctness: Any | None = None,
    levels: Sequence[int | None] | None = None,
    tau: float = ACR_TAU,
) -> dict[str, float]:
    """Collapse statistics of one batch.

    Args:
        rewards: total rewards ``[N, G]``, or one row per group when sizes differ.
        correctness: the correctness reward alone, same shape (0/1), or None.
        levels: difficulty level per group ``[N]`` (None or 0 entries skipped), or None.
        tau: ACR threshold on the group std.

    Returns:
        ``num_groups``, ``acr``, ``frac_reward_zero_std``, ``solve_all``, ``solve_none``,
        ``acr_by_level/L{k}`` and ``groups_by_level/L{k}`` (levels given; the counts weigh
        the planner's calibration), and with correctness ``acr_correctness`` and
        ``frac_zero_std_correctness``. An empty batch gives 0.0 everywhere.
    """
    r = _as_matrix(rewards)
    n = len(r)
    out: dict[str, float] = {"num_groups": float(n)}
    if n == 0:
        out.update(acr=0.0, frac_reward_zero_std=0.0, solve_all=0.0, solve_none=0.0)
        if correctness is not None:
            out.update(acr_correctness=0.0, frac_zero_std_correctness=0.0)
        return out
    collapsed = group_std(r) < tau
    out["acr"] = float(collapsed.mean())
    out["frac_reward_zero_std"] = float((group_std(r, ddof=1) <= MSSWIFT_ZERO_STD).mean())
    judge = r
    if correctness is not None:
        c = _as_matrix(correctness)
        if _sizes(c) != _sizes(r):
            raise ValueError(f"correctness group sizes {_sizes(c)} != rewards sizes {_sizes(r)}")
        out["acr_correctness"] = float((group_std(c) < tau).mean())
        out["frac_zero_std_correctness"] = float((group_std(c, ddof=1) <= MSSWIFT_ZERO_STD).mean())
        judge = c
    solve_all, solve_none = _all_any_solved(judge)
    out["solve_all"] = float(solve_all.mean())
    out["solve_none"] = float(solve_none.mean())
    if levels is not None:
        if len(levels) != n:
            raise ValueError(f"levels has {len(levels)} entries for {n} groups")
        if isinstance(levels, np.ndarray):
            lv = levels.astype(np.int64)
        else:
            lv = np.array([0 if x is None else int(x) for x in levels], dtype=np.int64)
        for level in np.unique(lv[lv > 0]).tolist():
            out[f"acr_by_level/L{level}"] = float(collapsed[lv == level].mean())
            out[f"groups_by_level/L{level}"] = float((lv == level).sum())
    return out


def collapse_metrics(
    raw: dict[str, float],
    post: dict[str, float],
    acr_predicted: float | None = None,
    num_levels: int = 6,
) -> dict[str, float]:
    """DESIGN.md metric names from the raw (first round) and post-filter (trained) stats.

    ``collapse/acr_raw``, ``collapse/solve_all_raw``, ``collapse/solve_none_raw``,
    ``collapse/acr_by_level/L{k}`` (raw: per level only the pre-filter value means anything),
    ``collapse/frac_reward_zero_std`` (post-filter, as ms-swift logs it) and
    ``collapse/acr_predicted``, ``collapse/groups_by_level/L{k}`` (raw groups per level, 0 when
    none); extras: ``collapse/frac_reward_zero_std_raw``,
    ``collapse/acr_correctness_raw``, ``collapse/acr_post``, ``collapse/solve_all`` and
    ``collapse/solve_none`` (post). Every row holds ``acr_by_level/L1..L{num_levels}`` and
    ``acr_predicted``: NaN where there is no value (no group of that level this step, no
    levels file); the loggers write NaN as null. The post-filter ratios are NaN (null) too
    when nothing was trained (``post["num_groups"] == 0``): a 0.0 there would read as
    "dynamic sampling filled the batch" for a step that trained nothing.
    """
    trained = post.get("num_groups", 1.0) > 0

    def post_ratio(key: str) -> float:
        return post[key] if trained else math.nan

    out = {
        "collapse/acr_raw": raw["acr"],
        "collapse/solve_all_raw": raw["solve_all"],
        "collapse/solve_none_raw": raw["solve_none"],
        "collapse/frac_reward_zero_std_raw": raw["frac_reward_zero_std"],
        "collapse/frac_reward_zero_std": post_ratio("frac_reward_zero_std"),
        "collapse/acr_post": post_ratio("acr"),
        "collapse/solve_all": post_ratio("solve_all"),
        "collapse/solve_none": post_ratio("solve_none"),
    }
    if "acr_correctness" in raw:
        out["collapse/acr_correctness_raw"] = raw["acr_correctness"]
    for level in range(1, num_levels + 1):
        out[f"collapse/acr_by_level/L{level}"] = math.nan
        out[f"collapse/groups_by_level/L{level}"] = 0.0
    for key, value in raw.items():
        if key.startswith(("acr_by_level/", "groups_by_level/")):
            out[f"collapse/{key}"] = value
    out["collapse/acr_predicted"] = math.nan if acr_predicted is None else float(acr_predicted)
    return out


def group_matrices(
    groups: Sequence[Any], correctness_key: str | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(rewards [N, G], correctness [N, G] | None)`` of a list of Groups.

    Correctness is ``reward_parts[correctness_key]``; None unless every group has it.
    """
    if not groups:
        return np.zeros((0, 0)), None
    rewards = np.array([g.rewards for g in groups], dtype=np.float64)
    if correctness_key and all(correctness_key in g.reward_parts for g in groups):
        corr = np.array([g.reward_parts[correctness_key] for g in groups], dtype=np.float64)
        return rewards, corr
    return rewards, None


def ds_can_fill(acr: float, num_checked_rounds: int) -> bool:
    """The article's expected-value condition: (1 - ACR) * rounds >= 1 (ACR <= 1 - 1/R)."""
    return (1.0 - acr) * num_checked_rounds >= 1.0 - 1e-12
