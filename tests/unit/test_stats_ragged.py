"""Collapse statistics of groups of different sizes (rollout budgets) and per-level counts."""

from __future__ import annotations

import numpy as np
import pytest

from megagrpo.curriculum.stats import collapse_metrics, collapse_stats, group_std


def test_ragged_rows_equal_a_loop_over_groups():
    rows = [[1, 1], [1, 0, 0, 0, 0, 0, 0, 0], [0], [0.5, 0.5, 0.5 + 5e-7], [1, 1, 1, 0.8]]
    correct = [[1, 1], [1, 0, 0, 0, 0, 0, 0, 0], [0], [0, 0, 0], [1, 1, 1, 1]]
    s = collapse_stats(rows, correct, levels=[1, 4, 6, None, 1])
    std0 = [np.std(r) for r in rows]
    std1 = [np.std(r, ddof=1) if len(r) > 1 else 0.0 for r in rows]
    assert s["num_groups"] == 5
    assert s["acr"] == pytest.approx(np.mean([x < 1e-6 for x in std0]))  # 3 of 5
    assert s["acr"] == pytest.approx(3 / 5)
    assert s["frac_reward_zero_std"] == pytest.approx(np.mean([x <= 1e-8 for x in std1]))
    assert s["acr_correctness"] == pytest.approx(4 / 5)
    assert s["solve_all"] == pytest.approx(2 / 5) and s["solve_none"] == pytest.approx(2 / 5)
    assert s["acr_by_level/L1"] == pytest.approx(0.5) and s["groups_by_level/L1"] == 2.0
    assert s["groups_by_level/L4"] == 1.0 and s["acr_by_level/L6"] == 1.0
    assert group_std(rows, ddof=1).tolist() == pytest.approx(std1)
    with pytest.raises(ValueError, match="sizes"):
        collapse_stats(rows, [r[:-1] or [0] for r in correct])


def test_equal_sizes_unchanged_and_counts_in_metric_rows():
    r = np.array([[1, 1, 1], [0, 1, 0], [0, 0, 0], [1, 0, 1]], dtype=float)
    matrix = collapse_stats(r, levels=[1, 3, 6, 3])
    rows = collapse_stats([list(x) for x in r], levels=[1, 3, 6, 3])
    assert matrix == rows
    m = collapse_metrics(matrix, collapse_stats(r[[1, 3]]), acr_predicted=0.5, num_levels=6)
    assert m["collapse/groups_by_level/L3"] == 2.0 and m["collapse/groups_by_level/L2"] == 0.0
    assert m["collapse/acr_by_level/L3"] == 0.0 and np.isnan(m["collapse/acr_by_level/L2"])
