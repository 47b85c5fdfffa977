"""`megagrpo report`: the learning criterion (raw reward first vs last fifth, held-out accuracy
at step 0 vs the end) and the calibration plot (predicted vs measured raw ACR per level)."""

from __future__ import annotations

import json

import pytest

from megagrpo.metrics.report import (
    calibration_levels,
    format_learning,
    learning_summary,
    make_report,
)


def _rows(raw, evals=None, levels=False):
    rows = []
    if evals and 0 in evals:
        rows.append({"step": 0, "eval/accuracy": evals[0], "eval/num_problems": 64.0})
    for step, r in enumerate(raw, start=1):
        row = {"step": step, "reward/mean_raw": r, "reward/mean": r}
        if evals and step in evals:
            row.update({"eval/accuracy": evals[step], "eval/num_problems": 64.0})
        if levels:
            for lv in (1, 3, 6):
                row[f"collapse/acr_predicted_by_level/L{lv}"] = 0.2 * lv / 6 + 0.5
                row[f"collapse/acr_by_level/L{lv}"] = 0.1 * lv / 6 + 0.5 if step % 3 else None
                row[f"collapse/groups_by_level/L{lv}"] = float(step % 3)
            row["collapse/acr_predicted_by_level/L2"] = None  # a level never drawn
        rows.append(row)
    return rows


def test_learning_summary_fifths_ratio_and_eval():
    raw = [0.1, 0.2, 0.1, 0.2, 0.2, 0.3, 0.3, 0.4, 0.3, 0.3, 0.4, 0.5]  # 12 steps: fifth = 2
    s = learning_summary(_rows(raw, {0: 0.125, 6: 0.2, 12: 0.3}))
    assert (
        s["fifth"] == 2 and s["first_fifth_steps"] == [1, 2] and s["last_fifth_steps"] == [11, 12]
    )
    assert s["raw_first_fifth"] == pytest.approx(0.15) and s["raw_last_fifth"] == pytest.approx(
        0.45
    )
    assert s["raw_ratio"] == pytest.approx(3.0)
    assert (s["eval_first_step"], s["eval_first"], s["eval_last_step"]) == (0, 0.125, 12)
    assert s["learned"] is True
    line = format_learning(s)
    assert "x3.00" in line and "step 0" in line and "on 64 questions" in line and "learned" in line
    flat = learning_summary(_rows([0.2] * 10, {0: 0.3, 10: 0.3}))
    assert flat["raw_ratio"] == pytest.approx(1.0) and flat["learned"] is False
    assert "did not learn" in format_learning(flat)
    noeval = learning_summary(_rows([0.0, 0.0, 0.0, 0.0, 0.0, 0.5]))
    assert noeval["learned"] is None and "raw_ratio" not in noeval  # no ratio of a 0 start
    assert noeval["raw_delta"] == pytest.approx(0.5) and "+0.500" in format_learning(noeval)
    assert format_learning(learning_summary([])) == ""


def test_negative_rewards_are_compared_by_difference_not_ratio(tmp_path):
    """Penalty-shaped rewards (soft_overlong, format penalties) are negative: a ratio of two
    negative means reads "x0.00" or "xinf"; the change is their signed difference."""
    s = learning_summary(_rows([-0.8, -0.7, -0.6, -0.5, -0.4, -0.3, -0.2, -0.2, -0.1, -0.1],
                               {0: 0.1, 10: 0.2}))  # fmt: skip
    assert "raw_ratio" not in s and s["raw_delta"] == pytest.approx(0.65)
    line = format_learning(s)
    assert "+0.650" in line and "x0.00" not in line and "xinf" not in line
    assert s["learned"] is True  # reward up, accuracy up
    run = tmp_path / "neg"
    run.mkdir()
    with open(run / "metrics.jsonl", "w", encoding="utf-8") as fh:
        for row in _rows([-1.0, -0.5, -0.2, -0.1, 0.0, 0.1], {0: 0.1, 6: 0.2}):
            fh.write(json.dumps(row) + "\n")
    assert any(p.name == "reward.png" for p in make_report(run, checked_rounds=2))


def test_report_draws_calibration_and_the_learning_summary(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = _rows([0.1 * (1 + i % 4) for i in range(10)], {0: 0.1, 10: 0.2}, levels=True)
    with open(run / "metrics.jsonl", "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    assert calibration_levels(rows) == [1, 3, 6]
    paths = make_report(run, checked_rounds=2)
    names = sorted(p.name for p in paths)
    assert "calibration.png" in names and "reward.png" in names
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run / "report" / "summary.json").read_text())
    assert summary["learning"]["eval_first"] == 0.1 and summary["learning"]["steps"] == 10
    # a run without levels has no calibration plot
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in _rows([0.1, 0.2, 0.3]))
    )
    assert "calibration.png" not in {p.name for p in make_report(plain)}
