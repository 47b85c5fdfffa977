"""tools/learning_efficiency.py: cumulative generated tokens, interpolation at the budget,
tokens to a target accuracy and the per-condition summary, on hand-made metrics rows."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest


@pytest.fixture(scope="module")
def tool(repo_root):
    spec = importlib.util.spec_from_file_location(
        "learning_efficiency", repo_root / "tools" / "learning_efficiency.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _rows():
    rows = [{"step": 0, "eval/accuracy": 0.1, "eval/correct": 10.0, "eval/num_problems": 100.0,
             "eval/best_constant": 0.25}]  # fmt: skip
    for step in range(1, 5):
        rows.append(
            {
                "step": step,
                "perf/gen_tokens": 100.0 * step,
                "collapse/acr_raw": 0.1 * step,
                "collapse/frac_reward_zero_std": 0.0 if step < 4 else 0.5,
            }  # fmt: skip
        )
    rows[2].update({"eval/accuracy": 0.3, "eval/correct": 30.0, "eval/num_problems": 100.0,
                    "eval/best_constant": 0.25})  # fmt: skip
    rows[4].update({"eval/accuracy": 0.5, "eval/correct": 50.0, "eval/num_problems": 100.0,
                    "eval/best_constant": 0.25})  # fmt: skip
    return rows


def _record(tool, rows):
    return {
        "tokens": tool.cumulative_tokens(rows),
        "series": {k: [r.get(k) for r in rows] for k in ("step", *tool.SERIES)},
    }


def test_tokens_interpolation_and_target(tool):
    rows = _rows()
    assert tool.cumulative_tokens(rows) == [0.0, 100.0, 300.0, 600.0, 1000.0]
    assert tool._done(rows, 1000.0) and not tool._done(rows[:4], 500.0)  # step 3: no eval
    assert tool._done([*rows, {"step": 5, "perf/gen_tokens": 1.0}], 1000.0)  # a step after
    pts = [(0.0, 0.1), (300.0, 0.3), (1000.0, 0.5)]
    assert tool.at_tokens(pts, 650.0) == pytest.approx(0.4)
    assert math.isnan(tool.at_tokens(pts, 2000.0))
    assert tool.tokens_to(pts, 0.4) == pytest.approx(650.0)
    assert math.isnan(tool.tokens_to(pts, 0.9))


def test_summary_over_seeds(tool):
    rec = _record(tool, _rows())
    other = _record(tool, _rows())
    other["series"]["eval/accuracy"][-1] = 0.7
    other["series"]["eval/correct"][-1] = 70.0
    s = tool.summarise({"0": rec, "1": other}, budget=1000.0, target=0.4)
    assert s["per_seed"]["0"]["accuracy_at_budget"] == pytest.approx(0.5)
    assert s["per_seed"]["0"]["margin_at_budget"] == pytest.approx(0.25)
    assert s["per_seed"]["0"]["last_eval_within_budget"]["wilson"][0] == pytest.approx(
        0.4038, abs=1e-4
    )  # Wilson 95% lower end of 50/100
    assert s["accuracy_at_budget"] == {"mean": 0.6, "min": 0.5, "max": 0.7, "n": 2}
    assert s["acr_raw_first_third"]["mean"] == pytest.approx(0.1)
    assert s["frac_reward_zero_std_last_third"]["mean"] == pytest.approx(0.5)
    table = tool.table({"conditions": {"carry": {"label": "carry", "summary": s}}})
    assert "| carry | 2 |" in table and "0.600 [0.500, 0.700]" in table


def test_finished_only_reports_the_runs_at_budget_and_lists_the_rest(tool, tmp_path):
    """--finished-only trains nothing (no profile, no subprocess): the runs in --out that
    reached the budget are summarised, the others named as missing."""
    import argparse
    import json

    def write(name, rows):
        (tmp_path / name).mkdir()
        text = "".join(json.dumps(r) + "\n" for r in rows)
        (tmp_path / name / "metrics.jsonl").write_text(text, encoding="utf-8")

    write("original_s0", _rows())  # 1000 tokens, evaluated at the end
    write("carry_s0", _rows()[:4])  # 600 tokens: short of the budget
    args = argparse.Namespace(
        out=str(tmp_path), train_problems=0, eval_problems=0, only=["original", "carry"],
        seeds=[0], tokens=1000.0, target=0.4, eval_every=2, max_steps=200, jobs=2,
        finished_only=True,
    )  # fmt: skip
    result = tool.run(args)
    assert list(result["conditions"]) == ["original"]
    assert result["setup"]["missing"] == ["carry_s0"]
    assert not (tmp_path / "levels.jsonl").exists()
    per_seed = result["conditions"]["original"]["summary"]["per_seed"]
    assert per_seed["0"]["accuracy_at_budget"] == pytest.approx(0.5)
    assert "not finished (1 runs): carry_s0" in tool.table(result)


def test_a_failed_run_stops_the_queue(tool, tmp_path, monkeypatch):
    """--jobs: when a run fails, the runs still queued are not started (the error surfaces
    now, not after hours of the other conditions)."""
    import argparse
    import threading

    started, lock = [], threading.Lock()

    def fake_train(cond, seed, args, levels, data):
        with lock:
            started.append(f"{cond.slug}_s{seed}")
        if cond.slug == "original":
            raise SystemExit(f"train {cond.slug}_s{seed} failed")
        threading.Event().wait(0.5)  # still running when the failure is seen
        return tmp_path / f"{cond.slug}_s{seed}"

    monkeypatch.setattr(tool, "train", fake_train)
    monkeypatch.setattr(tool, "profile", lambda out, data: out / "levels.jsonl")
    args = argparse.Namespace(
        out=str(tmp_path), train_problems=4, eval_problems=4, only=None, seeds=[0, 1, 2],
        tokens=1000.0, target=0.4, eval_every=2, max_steps=200, jobs=2, finished_only=False,
    )  # fmt: skip
    with pytest.raises(SystemExit, match="original_s0 failed"):
        tool.run(args)
    assert started[0] == "original_s0" and len(started) <= 3  # of 18 queued
