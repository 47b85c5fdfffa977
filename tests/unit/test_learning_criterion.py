"""Learning, not guessing: the held-out criterion against the best constant answer (Wilson
interval checked against SciPy and closed-form values), the eval metrics of a policy that
always answers one letter, and the answer-bias collapse metric and warning."""

from __future__ import annotations

import json
import math
import random

import pytest

from megagrpo.commands.eval import format_guess, guess_report
from megagrpo.metrics.answers import (
    answer_bias_warning,
    answer_shares,
    learning_verdict,
    wilson_interval,
)
from megagrpo.metrics.report import format_learning, learning_summary, make_report
from megagrpo.placement.rollouts import evaluate
from megagrpo.rewards.answers import answer_bias, guess_baselines
from megagrpo.rewards.igakuqa import GoldItem
from megagrpo.types import Group, Problem


def _problems(golds: str) -> list[Problem]:
    return [
        Problem(
            id=f"q{i}",
            messages=[{"role": "user", "content": "Which number is the largest?"}],
            answer=[g],
            meta={"choices": ["1", "2", "3", "4"]},
        )
        for i, g in enumerate(golds)
    ]


class _Policy:
    """A stand-in for the rollout engine: ``answer(problem, i)`` -> completion text."""

    def __init__(self, answer):
        self.answer = answer

    def generate(self, problems, n, sampling=None):
        return [
            Group(
                problem=p,
                completions=[self.answer(p, i) for i in range(n)],
                token_ids=[[1]] * n,
                logprobs=[[0.0]] * n,
            )  # fmt: skip
            for p in problems
        ]


def _golds(n: int, skew: str = "", seed: int = 0) -> str:
    """``n`` gold letters: balanced over a-d, then ``skew`` letters appended."""
    rng = random.Random(seed)
    out = list(("abcd" * n)[: n - len(skew)]) + list(skew)
    rng.shuffle(out)
    return "".join(out)


@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (10, 10), (121, 256), (1, 1), (200, 256)])
def test_wilson_interval_matches_scipy(k, n):
    stats = pytest.importorskip("scipy.stats")
    ref = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(ref.low, abs=1e-12) and hi == pytest.approx(ref.high, abs=1e-12)


def test_wilson_interval_closed_form():
    # k = 0: lower end 0, upper end z^2 / (n + z^2)
    z = 1.959963984540054
    assert wilson_interval(0, 20) == (0.0, pytest.approx(z * z / (20 + z * z)))
    # k = n/2: symmetric about 1/2, half-width z sqrt(n/4 + z^2/4) / (n + z^2)
    lo, hi = wilson_interval(50, 100)
    half = z * math.sqrt(100 / 4 + z * z / 4) / (100 + z * z)
    assert (lo, hi) == (pytest.approx(0.5 - half), pytest.approx(0.5 + half))
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="k=5"):
        wilson_interval(5, 4)


def test_guess_baselines_and_shares():
    base = guess_baselines([["b"], ["b"], ["a"], ["c", "d"], ["a or d"]], ["ab"] * 3 + ["abcd"] * 2)
    # b right twice; a right for q2 and (alternatives) q4; d right for q4 only
    assert (base.best_constant, base.best_answer) == (0.4, "a")
    assert base.chance == pytest.approx((0.5 + 0.5 + 0.5 + 0.0 + 0.5) / 5)
    assert answer_shares(["b", "b", "", "a"]) == {"b": 0.5, "a": 0.25, "none": 0.25}
    with pytest.raises(ValueError, match="2 golds but 1"):
        guess_baselines([["a"], ["b"]], ["ab"])


def _eval_rows(policy, problems, raw=(0.2, 0.2, 0.3, 0.4, 0.5)):
    """Rows of a run: raw rewards rising x2.5 and held-out evaluations of ``policy`` at step
    0 (a base that never answers) and at the last step, through the trainer's evaluate."""
    silent = _Policy(lambda p, i: "I think")
    rows = [{"step": 0, **evaluate(silent, problems, seed=0, step=0)}]  # pyright: ignore[reportArgumentType]
    for step, r in enumerate(raw, start=1):
        rows.append({"step": step, "reward/mean_raw": r})
    rows[-1].update(evaluate(policy, problems, seed=0, step=len(raw)))  # pyright: ignore[reportArgumentType]
    return rows


def test_constant_answer_policy_does_not_learn():
    # 256 questions, 124 of them (48%) with gold b: about the old two-option demo's share
    problems = _problems(_golds(256, skew="b" * 80))
    rows = _eval_rows(_Policy(lambda p, i: "Answer: b"), problems)
    last = rows[-1]
    assert last["eval/answer_share/b"] == 1.0 and last["eval/answer_top_share"] == 1.0
    assert last["eval/accuracy"] == pytest.approx(last["eval/best_constant"])
    assert last["eval/chance"] == pytest.approx(0.25)
    s = learning_summary(rows)
    # what the old criterion accepted: raw reward x2.5, held-out accuracy 0 -> 0.48
    assert s["raw_ratio"] >= 1.5 and s["eval_last"] > s["eval_first"] + 0.3
    assert s["learned"] is False and s["margin"] < 0
    assert s["answers_last"] == {"b": 1.0} and s["answers_first"] == {"none": 1.0}
    line = format_learning(s)
    assert (
        f"best constant answer {124 / 256:.3f}" in line
        and "did not learn" in line
        and "b 1.00" in line
    )


def test_content_policy_beats_the_constant_answer():
    problems = _problems(_golds(256))  # balanced: best constant 0.25
    rng = random.Random(1)
    # right on 60% of the questions, a random other letter otherwise
    picks = {
        p.id: p.answer[0]
        if rng.random() < 0.6
        else rng.choice([c for c in "abcd" if c != p.answer[0]])  # fmt: skip
        for p in problems
    }
    s = learning_summary(_eval_rows(_Policy(lambda p, i: f"{picks[p.id]}. x"), problems))
    assert s["best_constant"] == pytest.approx(0.25)
    assert s["eval_interval"][0] > 0.25 and s["learned"] is True
    assert "; learned" in format_learning(s)
    # a small margin within noise does not pass: 32 questions, 12 right vs constant 0.25
    assert learning_verdict(12, 32, 0.25)["learned"] is False
    assert learning_verdict(12, 32, 0.25, start=0.5)["bar"] == 0.5


def test_summary_without_baselines_is_undecided():
    rows = [{"step": 0, "eval/accuracy": 0.1}, {"step": 1, "reward/mean_raw": 0.5}]
    rows.append({"step": 2, "reward/mean_raw": 0.9, "eval/accuracy": 0.9})
    assert learning_summary(rows)["learned"] is None  # an older run: no eval/best_constant


def _groups(golds: str, answer) -> list[Group]:
    return [
        Group(problem=p, completions=[answer(p, i) for i in range(4)], token_ids=[], logprobs=[])
        for p in _problems(golds)
    ]


def test_answer_bias_collapse_is_not_a_solved_batch():
    golds = _golds(32)
    guessing = answer_bias(_groups(golds, lambda p, i: "Answer: b"))
    assert guessing["collapse/answer_bias"] == 1.0
    assert guessing["collapse/answer_bias_gold"] == pytest.approx(golds.count("b") / 32)
    assert guessing["collapse/answer_bias_letter"] == 1.0
    assert "'b'" in (answer_bias_warning(guessing) or "")
    solved = answer_bias(_groups(golds, lambda p, i: f"Answer: {p.answer[0]}"))
    assert solved["collapse/answer_bias"] == pytest.approx(solved["collapse/answer_bias_gold"])
    assert answer_bias_warning(solved) is None
    # a batch whose golds are all 'b' and which is solved: biased, but not a guess
    assert answer_bias_warning(answer_bias(_groups("bbbb", lambda p, i: "b"))) is None
    assert math.isnan(answer_bias(_groups("ab", lambda p, i: "no idea"))["collapse/answer_bias"])


def test_report_and_eval_show_the_guessing_baselines(tmp_path):
    problems = _problems(_golds(64, skew="b" * 20))
    rows = _eval_rows(_Policy(lambda p, i: "b"), problems)
    rows[-2].update(answer_bias(_groups("abcd", lambda p, i: "Answer: b")))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "reward.png" in {p.name for p in make_report(run)}
    learning = json.loads((run / "report" / "summary.json").read_text())["learning"]
    assert learning["learned"] is False and learning["answer_bias_steps"] == [4]
    gold = {p.id: GoldItem(p.id, p.answer, 1, "2018", "x") for p in problems}
    preds = {p.id: ("b", "b") for p in problems}
    guess = guess_report(gold, problems, preds)
    assert guess["beats_constant"] is False and guess["best_answer"] == "b"
    assert guess["correct"] == sum(p.answer == ["b"] for p in problems)
    assert "does not beat the best constant answer ('b'" in format_guess(guess)


def test_step_logs_the_first_rounds_answer_bias():
    from megagrpo.trainer.loop import GenStats

    golds = _golds(16)
    stats = GenStats()
    stats.add(_groups(golds, lambda p, i: "Answer: c"))  # the raw round: a constant letter
    stats.add(_groups(golds, lambda p, i: f"Answer: {p.answer[0]}"))  # a resample round
    assert stats.answer_bias["collapse/answer_bias"] == 1.0
    assert stats.answer_bias["collapse/answer_bias_letter"] == 2.0
    assert "'c'" in (answer_bias_warning(stats.answer_bias) or "")
