"""``rewards.answer_balance`` (megagrpo.rewards.balance): an answer given more often than it is
right costs reward; checked against counts made by hand, on rounds where the answer is known."""

from __future__ import annotations

import random

import pytest

from megagrpo.config import load_config
from megagrpo.errors import ConfigError
from megagrpo.rewards.balance import answer_excess, balance_penalties
from megagrpo.trainer.config import RunConfig
from megagrpo.types import Group, Problem


def _problem(i: int, gold: str) -> Problem:
    return Problem(
        id=f"q{i}",
        messages=[{"role": "user", "content": "Which number is the largest?"}],
        answer=[gold],
        meta={"choices": ["1", "2", "3", "4"]},
    )


def _round(golds: str, answers: list[str]) -> list[Group]:
    """One group of len(answers[j]) per gold; member i answers answers[j][i] (' ': nothing
    readable); rewards: 1 if right, else 0 (the accuracy reward)."""
    groups = []
    for j, (gold, row) in enumerate(zip(golds, answers)):
        texts = [f"Answer: {a}" if a != " " else "I am not sure." for a in row]
        groups.append(
            Group(
                problem=_problem(j, gold),
                completions=texts,
                token_ids=[],
                logprobs=[],
                rewards=[float(a == gold) for a in row],
            )
        )
    return groups


def _hand_excess(golds: str, answers: list[str]) -> dict[str, float]:
    """share(x) - right(x) counted by hand over every member."""
    pairs = [(a, g) for g, row in zip(golds, answers) for a in row]
    n = len(pairs)
    out = {}
    for x in {a for a, _ in pairs}:
        share = sum(a == x for a, _ in pairs) / n
        right = 0.0 if x == " " else sum(g == x for _, g in pairs) / n
        if share > right:
            out["none" if x == " " else x] = share - right
    return out


def test_a_favoured_letter_has_the_excess_counted_by_hand():
    golds = "abcd" * 2
    answers = ["cccc", "cccb", "cccc", "ccdd", "a cc", "cbcc", "cc c", "dddd"]
    excess = answer_excess(_round(golds, answers))
    assert excess == pytest.approx(_hand_excess(golds, answers))
    assert set(excess) == {"c", "none"}  # a, b, d are given less often than they are right
    assert excess["c"] == pytest.approx(21 / 32 - 8 / 32)


def test_a_round_that_answers_like_its_golds_pays_nothing():
    golds = "abcd" * 2
    groups = _round(golds, [g * 4 for g in golds])
    assert answer_excess(groups) == {}
    assert balance_penalties(groups, {}, 1.0) == [[0.0] * 4] * 8


def _ctx(coef: float):
    from types import SimpleNamespace

    return SimpleNamespace(cfg=load_config(RunConfig, [], [f"rewards.answer_balance={coef}"]))


def test_the_over_used_letter_loses_credit_within_each_group():
    from megagrpo.trainer.loop import answer_balance, compute_advantages

    golds = "abcd" * 2
    answers = ["cccc", "cccb", "cccd", "ccdd", "cc a", "cbcc", "cc c", "dddd"]
    groups = _round(golds, answers)
    excess = answer_excess(groups)
    ctx = _ctx(0.5)
    plain = compute_advantages(ctx, groups)  # type: ignore[arg-type]
    adv, metrics = answer_balance(ctx, groups, plain, excess)  # type: ignore[arg-type]
    for j, (row, before, after) in enumerate(zip(answers, plain, adv)):
        pen = [0.5 * excess.get("none" if a == " " else a, 0.0) for a in row]
        mean = sum(pen) / 4
        expected = [float(x) - (p - mean) for x, p in zip(before, pen)]
        assert after.tolist() == pytest.approx(expected, abs=1e-6), j
    assert adv[5][0] < plain[5][0]  # gold b, answered c: pulled down harder
    assert adv[1][3] > plain[1][3]  # gold b, answered b: gains what the `c`s lose
    assert 0 < adv[2][0] < plain[2][0]  # gold c, answered c (over-used): reinforced less
    assert plain[2][3] < adv[2][3] < 0  # ... and the wrong `d` is pulled down less
    assert adv[0].tolist() == [0.0] * 4  # all `c`: nothing to shift between the members
    assert metrics["reward/answer_balance_penalty"] == pytest.approx(
        sum(sum(p) for p in balance_penalties(groups, excess, 0.5)) / 32
    )
    assert answer_balance(_ctx(0.0), groups, plain, excess) == (plain, {})  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(5))
def test_a_right_answer_keeps_a_positive_advantage(seed):
    from megagrpo.trainer.loop import answer_balance, compute_advantages

    rng = random.Random(seed)
    golds = "".join(rng.choice("abcd") for _ in range(8))
    answers = ["".join(rng.choice("cccab d") for _ in range(4)) for _ in golds]
    groups = _round(golds, answers)
    ctx = _ctx(1.0)
    plain = compute_advantages(ctx, groups)  # type: ignore[arg-type]
    adv, _ = answer_balance(ctx, groups, plain, answer_excess(groups))  # type: ignore[arg-type]
    for a, gold, row in zip(adv, golds, answers):
        right = [x for x, ans in zip(a.tolist(), row) if ans == gold]
        wrong = [x for x, ans in zip(a.tolist(), row) if ans != gold]
        if right and wrong:
            assert min(right) > 0 and min(right) > max(wrong)


def test_each_member_is_judged_against_its_own_rendering():
    base = _problem(0, "a")
    msgs = base.messages
    base.meta["variants"] = [{"messages": msgs, "answer": [s]} for s in "abcd"]
    group = Group(
        problem=base,
        completions=["Answer: a", "Answer: b", "Answer: c", "Answer: d"],
        token_ids=[],
        logprobs=[],
        rewards=[1.0] * 4,
        member_variants=[0, 1, 2, 3],
    )
    assert answer_excess([group]) == {}  # every member right for its rendering


def test_the_step_measures_the_first_round_only():
    from megagrpo.trainer.loop import GenStats

    golds = "abcd" * 2
    first = _round(golds, ["cccc"] * 8)
    later = _round("ab", ["cab ", "bbbb"])
    stats = GenStats()
    for groups in (first, later):
        stats.add(groups)
        stats.measure_excess(groups, 1.0)
    assert stats.raw_reward_mean == pytest.approx(0.25)
    assert stats.excess == pytest.approx({"c": 0.75})
    assert first[2].rewards == [1.0] * 4  # the rewards are left as they are
    off = GenStats()
    off.measure_excess(first, 0.0)
    assert off.excess is None


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_out_of_range_is_a_config_error_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"rewards\.answer_balance"):
        load_config(RunConfig, [], [f"rewards.answer_balance={value}"])
    assert load_config(RunConfig, [], ["rewards.answer_balance=0.5"]).rewards.answer_balance == 0.5
