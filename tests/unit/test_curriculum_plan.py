"""Planner reproduces the article (sections 5.1-5.3, 6); profiler writes resumable levels."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megagrpo.curriculum.config import CurriculumConfig, DynamicSamplingConfig
from megagrpo.curriculum.levels import read_levels_file
from megagrpo.curriculum.profile import format_level_table, run_profile
from megagrpo.plan.simulate import BernoulliEngine, PlanSetup, run_plan, synthetic_population
from megagrpo.types import Problem

SPECIALIST = {1: 2164, 2: 294, 3: 223, 4: 180, 5: 216, 6: 636}
ALL, MID = [1, 2, 3, 4, 5, 6], [2, 3, 4, 5]


def _plan(keep, policy, steps=150, retire=0, seed=0):
    # retire_streak=0: the article measured levels once, before training (no online retirement)
    cur = CurriculumConfig(keep_levels=keep, retire_streak=retire, seed=seed)
    dyn = DynamicSamplingConfig(policy=policy, max_resample=3)
    return run_plan(PlanSetup(SPECIALIST, 5, 8, 96, steps, cur, seed=seed), dyn).to_dict()


def test_article_all_levels_msswift_fails_almost_every_step():
    r = _plan(ALL, "original")
    assert 0.69 <= r["acr_predicted"] <= 0.76  # article: 0.72-0.75
    assert r["acr_raw_mean"] == pytest.approx(r["acr_predicted"], abs=0.02)
    assert r["ds_success_rate"] <= 0.25  # article: never filled
    # on a failed step ms-swift trains on the first batch: post-filter value = raw ACR
    assert r["collapsed_groups_trained_per_step"] > 40
    assert r["gen_batches_per_step"] > 3.5  # the 4th round is wasted


def test_article_mid_levels_fill_every_step():
    r = _plan(MID, "original")
    assert r["acr_predicted"] < 0.3
    assert r["ds_success_rate"] == 1.0 and r["frac_reward_zero_std_mean"] == 0.0
    assert r["acr_raw_mean"] == pytest.approx(r["acr_predicted"], abs=0.03)


def test_policies_at_equal_generation_budget():
    orig, part, carry = (_plan(ALL, p, steps=60) for p in ("original", "partial", "carry"))
    # same cap (1 + R rounds); ours never generates more than ms-swift
    for r in (part, carry):
        assert r["gen_batches_per_step"] <= orig["gen_batches_per_step"] + 1e-9
    assert part["valid_groups_per_step"] > 2 * orig["valid_groups_per_step"]
    assert part["collapsed_groups_trained_per_step"] == 0
    assert carry["valid_groups_per_gen_batch"] > part["valid_groups_per_gen_batch"]
    assert carry["valid_groups_discarded_per_step"] == 0


def test_online_retirement_lowers_raw_acr():
    static = _plan(ALL, "carry", steps=50, retire=0)
    online = _plan(ALL, "carry", steps=50, retire=2)
    assert online["acr_raw_mean"] < static["acr_raw_mean"] - 0.1


def test_planner_is_deterministic():
    a, b = _plan(MID, "carry", steps=20, seed=5), _plan(MID, "carry", steps=20, seed=5)
    a.pop("seconds"), b.pop("seconds")
    assert a == b


def test_plan_cli_json(capsys):
    from megagrpo.cli import main

    rc = main(
        [
            "plan",
            "--levels",
            "L1=2164,L2=294,L3=223,L4=180,L5=216,L6=636",
            "--keep-levels",
            "L1-L6",
            "--policy",
            "original",
            "--retire-streak",
            "0",
            "--steps",
            "30",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "acr_predicted",
        "ds_success_rate",
        "valid_groups_per_step",
        "gen_batches_per_step",
        "collapsed_groups_trained_per_step",
    ):
        assert key in out
    assert out["policy"] == "original" and out["pool"] == 3713


def test_plan_cli_table_and_levels_file(tmp_path, capsys):
    from megagrpo.cli import main

    path = tmp_path / "levels.jsonl"
    rng = np.random.default_rng(0)
    path.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "k": 5, "correct": int(c)}) + "\n"
            for i, c in enumerate(rng.integers(0, 6, size=300))
        )
    )
    assert main(["plan", "--levels-file", str(path), "--policy", "all", "--steps", "10"]) == 0
    out = capsys.readouterr().out
    assert "original" in out and "carry" in out and "valid_groups_per_step" in out


def _exact(completions, problem):
    gold = ",".join(problem.answer)
    return [1.0 if c == gold else 0.0 for c in completions]


class _Flaky(BernoulliEngine):
    """Fails after ``budget`` generate calls (an interrupted profile)."""

    def __init__(self, *a, budget, **kw):
        super().__init__(*a, **kw)
        self.budget, self.calls, self.problems_seen = budget, 0, []

    def generate(self, problems, n, sampling=None):
        if self.calls >= self.budget:
            raise KeyboardInterrupt
        self.calls += 1
        self.problems_seen.extend(p.id for p in problems)
        return super().generate(problems, n, sampling)


def test_profile_levels_match_engine_and_resume(tmp_path):
    problems, _, ps = synthetic_population({1: 20, 3: 20, 6: 20}, 5, seed=1)
    ps = {pid: (1.0 if i % 3 == 0 else 0.0 if i % 3 == 1 else 0.5) for i, pid in enumerate(ps)}
    out = tmp_path / "levels.jsonl"
    first = _Flaky(ps, seed=0, fill_rewards=False, budget=2)
    with pytest.raises(KeyboardInterrupt):
        run_profile(problems, first, _exact, 5, out, batch_size=16)
    assert len(read_levels_file(out)) == 32
    # a crash mid-write leaves a truncated line: dropped and redone
    with out.open("a") as fh:
        fh.write('{"id": "L6-00')
    second = _Flaky(ps, seed=1, fill_rewards=False, budget=100)
    records = run_profile(problems, second, _exact, 5, out, batch_size=16)
    assert len(second.problems_seen) == 60 - 32  # never re-sampled
    assert not set(second.problems_seen) & set(first.problems_seen)
    assert [r["id"] for r in records] == [p.id for p in problems]
    by_id = {r["id"]: r for r in read_levels_file(out)}
    assert len(by_id) == 60
    for i, pid in enumerate(ps):
        if i % 3 == 0:
            assert by_id[pid]["level"] == 1 and by_id[pid]["correct"] == 5
        elif i % 3 == 1:
            assert by_id[pid]["level"] == 6
    table = format_level_table(records, 5, 8, [2, 3, 4, 5])
    assert "L1" in table and "predicted ACR" in table


def test_profile_cli_with_injected_engine(tmp_path, monkeypatch, capsys):
    import megagrpo.rollout
    from megagrpo.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"q{i}",
                    "messages": [
                        {"role": "user", "content": f"問題 {i}\na. x\nb. y\nc. z\nd. w\ne. v"}
                    ],
                    "solution": "c",
                },
                ensure_ascii=False,
            )
            + "\n"
            for i in range(6)
        ),
        encoding="utf-8",
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"data:\n  train: ['{data}']\n", encoding="utf-8")

    def build_engine(rollout_cfg, model_path, seed):
        assert model_path == str(tmp_path) and rollout_cfg.group_size == 8
        return BernoulliEngine({f"q{i}": float(i % 2) for i in range(6)}, fill_rewards=False)

    monkeypatch.setattr(megagrpo.rollout, "build_engine", build_engine)
    import megagrpo.model.pretrained

    monkeypatch.setattr(megagrpo.model.pretrained, "resolve_model_path", lambda p: tmp_path)
    import megagrpo.rewards

    monkeypatch.setattr(megagrpo.rewards, "get", lambda name, **kw: _exact)
    out = tmp_path / "levels.jsonl"
    assert main(["profile", str(cfg), "--out", str(out), "--k", "5"]) == 0
    levels = {r["id"]: r["level"] for r in read_levels_file(out)}
    assert levels == {f"q{i}": (1 if i % 2 else 6) for i in range(6)}
    assert "levels written" in capsys.readouterr().out


def test_bernoulli_engine_rate():
    eng = BernoulliEngine({"a": 0.3})
    groups = eng.generate([Problem(id="a", messages=[], answer=["a"])] * 2000, 8)
    assert np.mean([g.rewards for g in groups]) == pytest.approx(0.3, abs=0.01)


def test_drift_makes_pre_training_levels_stale_and_online_levels_show_it():
    # Article section 7: levels measured before training go stale as the policy learns, and
    # while dynamic sampling keeps succeeding, frac_reward_zero_std (post-filter) hides it.
    cur = CurriculumConfig(keep_levels=MID, retire_streak=0)
    setup = PlanSetup(SPECIALIST, 5, 8, 96, 200, cur, drift=0.08)
    res = run_plan(setup, DynamicSamplingConfig(policy="carry")).to_dict()
    assert res["ds_success_rate"] == 1.0 and res["frac_reward_zero_std_mean"] == 0.0
    assert res["acr_raw_last_10pct"] > res["acr_raw_first_10pct"] + 0.2
    assert res["level_hist_final"]["L1"] > 0.5 * res["pool"]  # online levels moved to L1
