"""CurriculumSampler: level filter, weights, determinism, exact resume, online difficulty."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from megagrpo.curriculum.config import CurriculumConfig
from megagrpo.curriculum.sampler import CurriculumSampler
from megagrpo.errors import CheckpointError, ConfigError
from megagrpo.types import Group, Problem


def _problems(levels_per_problem):
    probs = [Problem(id=f"q{i}", messages=[], answer=["a"]) for i in range(len(levels_per_problem))]
    levels = {p.id: lv for p, lv in zip(probs, levels_per_problem)}
    return probs, levels


def _group(problem, rewards):
    return Group(
        problem=problem,
        completions=["x"] * len(rewards),
        token_ids=[],
        logprobs=[],
        rewards=list(map(float, rewards)),
    )


LEVELS = [1, 2, 3, 4, 5, 6] * 10 + [1] * 20


def test_filter_keeps_levels_and_each_epoch_visits_every_kept_problem_once():
    probs, levels = _problems(LEVELS)
    s = CurriculumSampler(probs, CurriculumConfig(retire_streak=0), levels)
    kept = {p.id for p in probs if levels[p.id] in (2, 3, 4, 5)}
    assert len(s.pool) == len(kept) == 40
    first = [p.id for p in s.next_problems(40)]
    second = [p.id for p in s.next_problems(40)]
    assert set(first) == kept and set(second) == kept
    assert len(set(first)) == 40 and first != second  # reshuffled per epoch


def test_no_levels_means_no_filter_and_unprofiled_handling():
    probs, levels = _problems(LEVELS)
    assert len(CurriculumSampler(probs, CurriculumConfig()).pool) == len(probs)
    partial = {k: v for k, v in levels.items() if k != "q1"}  # q1 (L2) unprofiled
    assert "q1" in {probs[i].id for i in CurriculumSampler(probs, CurriculumConfig(), partial).pool}
    s = CurriculumSampler(probs, CurriculumConfig(keep_unprofiled=False), partial)
    assert "q1" not in {probs[i].id for i in s.pool}
    with pytest.raises(ConfigError, match="keep_levels"):
        CurriculumSampler(probs, CurriculumConfig(keep_levels=[9]), levels)


def test_level_weights_set_the_mix():
    probs, levels = _problems([2] * 50 + [3] * 50)
    cfg = CurriculumConfig(keep_levels=[2, 3], level_weights=[3.0, 1.0], retire_streak=0)
    drawn = Counter(levels[p.id] for p in CurriculumSampler(probs, cfg, levels).next_problems(4000))
    assert drawn[2] / 4000 == pytest.approx(0.75, abs=0.03)


def test_deterministic_per_seed():
    probs, levels = _problems(LEVELS)
    a = CurriculumSampler(probs, CurriculumConfig(seed=3), levels)
    b = CurriculumSampler(probs, CurriculumConfig(seed=3), levels)
    c = CurriculumSampler(probs, CurriculumConfig(seed=4), levels)
    ids = [p.id for p in a.next_problems(100)]
    assert ids == [p.id for p in b.next_problems(100)]
    assert ids != [p.id for p in c.next_problems(100)]


def test_resample_stream_does_not_shift_the_main_stream():
    probs, levels = _problems(LEVELS)
    a = CurriculumSampler(probs, CurriculumConfig(retire_streak=0), levels)
    b = CurriculumSampler(probs, CurriculumConfig(retire_streak=0), levels)
    a.next_problems(7, resample=True)
    a.next_problems(13, resample=True)
    assert [p.id for p in a.next_problems(30)] == [p.id for p in b.next_problems(30)]


def _drive(sampler, steps, start=0):
    """Draw and observe as a training loop would; rewards depend on id and step only."""
    drawn = []
    for step in range(start, start + steps):
        problems = sampler.next_problems(6) + sampler.next_problems(3, resample=True)
        groups = []
        for p in problems:
            n = int(p.id[1:])
            rewards = [1] * 4 if n % 3 == 0 else ([0] * 4 if n % 3 == 1 else [1, 0, (step % 2), 0])
            groups.append(_group(p, rewards))
        sampler.observe(groups)
        drawn.append([p.id for p in problems])
    return drawn


def test_exact_resume_through_json_state():
    probs, levels = _problems(LEVELS)
    cfg = CurriculumConfig(seed=11, retire_streak=2, revisit_prob=0.3)
    full = CurriculumSampler(probs, cfg, levels)
    reference = _drive(full, 30)

    first = CurriculumSampler(probs, cfg, levels)
    head = _drive(first, 12)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints are JSON-able
    resumed = CurriculumSampler(probs, cfg, levels)
    resumed.load_state_dict(state)
    tail = _drive(resumed, 18, start=12)
    assert head + tail == reference
    assert resumed.retired.tolist() == full.retired.tolist()
    assert resumed.level_histogram() == full.level_histogram()


def test_state_of_another_problem_set_is_rejected():
    probs, levels = _problems(LEVELS)
    s = CurriculumSampler(probs, CurriculumConfig(), levels)
    other = CurriculumSampler(probs[:-1], CurriculumConfig(), levels)
    with pytest.raises(CheckpointError):
        other.load_state_dict(s.state_dict())


def test_online_difficulty_posterior_levels_and_retirement():
    probs, levels = _problems([3, 3, 3, 3])
    cfg = CurriculumConfig(keep_levels=[3], retire_streak=2, revisit_prob=0.0, online_decay=0.5)
    s = CurriculumSampler(probs, cfg, levels)
    p0 = s.pass_rate("q0")
    assert s.level_histogram()[3] == 4
    s.observe([_group(probs[0], [1] * 8)])
    assert s.pass_rate("q0") > p0 and not s.retired[0]
    # decayed counts: profile 3/5 -> 0.5*3 + 8 correct, 0.5*2 + 0 wrong
    assert s.succ[0] == pytest.approx(9.5) and s.fail[0] == pytest.approx(1.0)
    s.observe([_group(probs[0], [1] * 8)])
    assert s.retired[0]
    hist = s.level_histogram()
    assert hist[1] == 1 and hist[3] == 3  # q0 drifted from L3 to L1
    # a retired problem is never served with revisit_prob 0 ...
    assert "q0" not in {p.id for p in s.next_problems(30)}
    # ... and a split group un-retires it.
    s.observe([_group(probs[0], [1, 0, 1, 1, 1, 1, 1, 1])])
    assert not s.retired[0]
    m = s.metrics()
    assert m["curriculum/retired"] == 0 and "curriculum/level_hist/L1" in m


def test_revisit_probability_serves_retired_problems_sometimes():
    probs, levels = _problems([3] * 10)
    cfg = CurriculumConfig(keep_levels=[3], retire_streak=1, revisit_prob=0.2)
    s = CurriculumSampler(probs, cfg, levels)
    s.observe([_group(p, [0] * 4) for p in probs[:5]])  # q0..q4 retired
    drawn = Counter(p.id for p in s.next_problems(2000))
    retired_share = sum(drawn[f"q{i}"] for i in range(5)) / 2000
    # each pass over a retired problem serves it with prob 0.2: share = 5*0.2 / (5*0.2 + 5)
    assert retired_share == pytest.approx(1 / 6, abs=0.03)


def test_correctness_key_is_used_for_online_counts():
    probs, levels = _problems([3])
    s = CurriculumSampler(
        probs, CurriculumConfig(keep_levels=[3], online_decay=1.0), levels, correctness_key="acc"
    )
    g = _group(probs[0], [0.9, 0.9, 0.9, 0.1])  # total reward; correctness says 1 of 4
    g.reward_parts = {"acc": [1.0, 0.0, 0.0, 0.0]}
    s.observe([g])
    assert s.succ[0] == pytest.approx(3 + 1) and s.fail[0] == pytest.approx(2 + 3)


def test_all_retired_pool_is_still_served_and_duplicates_observe_sequentially():
    probs, levels = _problems([3] * 4)
    cfg = CurriculumConfig(keep_levels=[3], retire_streak=1, revisit_prob=0.0, online_decay=0.5)
    s = CurriculumSampler(probs, cfg, levels)
    s.observe([_group(p, [1] * 4) for p in probs])
    assert s.retired.all()
    assert len(s.next_problems(6)) == 6  # nothing else to serve: no hang
    t = CurriculumSampler(probs, cfg, levels)
    t.observe([_group(probs[0], [1, 1, 0, 0]), _group(probs[0], [1, 1, 1, 1])])
    u = CurriculumSampler(probs, cfg, levels)
    u.observe([_group(probs[0], [1, 1, 0, 0])])
    u.observe([_group(probs[0], [1, 1, 1, 1])])
    assert t.succ[0] == u.succ[0] and t.retired[0] == u.retired[0]
    assert t.level_histogram() == u.level_histogram()


def _lettered(golds):
    return [Problem(id=f"q{i}", messages=[], answer=list(g)) for i, g in enumerate(golds)]


def test_balance_answers_deals_one_gold_of_each_letter_per_round():
    """curriculum.balance_answers: every 4 draws of the main stream hold the four golds, each
    epoch still visits every problem once; the unbalanced tail follows the exhausted letters."""
    golds = ["a"] * 30 + ["b"] * 30 + ["c"] * 30 + ["d"] * 30  # sorted: a plain cut is one letter
    probs = _lettered(golds)
    s = CurriculumSampler(probs, CurriculumConfig(seed=5, balance_answers=True, retire_streak=0))
    for _epoch in range(2):
        drawn = s.next_problems(120)
        assert sorted(p.id for p in drawn) == sorted(p.id for p in probs)
        for i in range(0, 120, 4):
            assert sorted(p.answer[0] for p in drawn[i : i + 4]) == list("abcd"), i
    plain = CurriculumSampler(probs, CurriculumConfig(seed=5, retire_streak=0)).next_problems(120)
    rounds = [sorted(p.answer[0] for p in plain[i : i + 4]) for i in range(0, 120, 4)]
    assert rounds.count(list("abcd")) < 10  # a plain shuffle does not (P(one round) = 0.09)
    # uneven classes and multi-answer golds: one of each per round while all last
    uneven = _lettered(["a"] * 6 + ["b"] * 3 + ["ab"] * 3)
    order = CurriculumSampler(uneven, CurriculumConfig(balance_answers=True)).next_problems(12)
    keys = ["".join(p.answer) for p in order]
    assert [sorted(keys[i : i + 3]) for i in (0, 3, 6)] == [["a", "ab", "b"]] * 3
    assert keys[9:] == ["a", "a", "a"]


def test_balance_answers_warns_when_the_answers_are_free_form(caplog):
    probs = _lettered([[str(i)] for i in range(20)])  # every answer its own class
    with caplog.at_level("WARNING", logger="megagrpo.curriculum.sampler"):
        CurriculumSampler(probs, CurriculumConfig(balance_answers=True))
    assert "20 distinct gold answers among 20 problems" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="megagrpo.curriculum.sampler"):
        CurriculumSampler(_lettered("abcd" * 5), CurriculumConfig(balance_answers=True))
    assert "balance_answers" not in caplog.text


def test_balance_answers_resumes_exactly_and_refuses_a_switched_order():
    probs = _lettered("abcd" * 20)
    cfg = CurriculumConfig(seed=2, balance_answers=True, retire_streak=0)
    full = [p.id for p in CurriculumSampler(probs, cfg).next_problems(50)]
    first = CurriculumSampler(probs, cfg)
    head = [p.id for p in first.next_problems(20)]
    resumed = CurriculumSampler(probs, cfg)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + [p.id for p in resumed.next_problems(30)] == full
    plain = CurriculumSampler(probs, CurriculumConfig(seed=2, retire_streak=0))
    with pytest.raises(CheckpointError):
        plain.load_state_dict(first.state_dict())
