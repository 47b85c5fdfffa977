"""The dynamic sampler's Rounds driving a rollout budget (what the trainer runs), against the
planner's own round loop (``simulate_budget.BudgetLoop``, the reference of the wiring), on
the real CurriculumSampler with Bernoulli rollouts."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megagrpo.config import load_config
from megagrpo.curriculum.budget_rounds import BudgetPlanner, Request
from megagrpo.curriculum.calibrate import predicted_acr_metrics
from megagrpo.curriculum.config import BudgetConfig, CurriculumConfig, DynamicSamplingConfig
from megagrpo.curriculum.dynamic import DynamicSampler
from megagrpo.curriculum.levels import predict_acr
from megagrpo.curriculum.sampler import CurriculumSampler
from megagrpo.errors import ConfigError
from megagrpo.plan.simulate import CORRECTNESS_KEY, BernoulliEngine, synthetic_population
from megagrpo.plan.simulate_budget import BudgetLoop, generate_mixed
from megagrpo.trainer.config import RunConfig

HIST = {1: 300, 2: 40, 3: 30, 4: 25, 5: 30, 6: 90}
K, G, B = 5, 8, 12


def _world(seed: int = 3, levels: bool = True):
    prior = predict_acr(HIST, K, G, sorted(HIST)).prior
    problems, lv, ps = synthetic_population(HIST, K, seed, prior)
    cur = CurriculumConfig(keep_levels=sorted(HIST), retire_streak=2, seed=seed)
    sampler = CurriculumSampler(problems, cur, lv if levels else None, CORRECTNESS_KEY, level_k=K)
    return sampler, BernoulliEngine(ps, seed=seed)


def _planner(budget: str, **kw) -> BudgetPlanner:
    return BudgetPlanner(BudgetConfig(mode=budget, **kw), G, B, CORRECTNESS_KEY)


def _trainer_step(dynamic: DynamicSampler, sampler, engine, step: int):
    """What ``megagrpo.trainer.loop.collect_batch`` does, with Bernoulli rollouts."""
    rounds = dynamic.start(sampler, B, step)
    sizes = []
    while (requests := rounds.next_requests()) is not None:
        sizes.append([r.n for r in requests])
        rounds.add(generate_mixed(engine, requests))
    return rounds.finish(), sizes


@pytest.mark.parametrize(
    "budget,policy,kw",
    [
        ("knapsack", "carry", {}),
        ("knapsack", "partial", {"min_samples": 1}),
        ("sequential", "carry", {"round_samples": 4}),
        ("sequential", "partial", {"sequential_gate": False, "max_samples": 16}),
    ],
)
def test_rounds_drive_the_budget_like_the_planner_loop(budget, policy, kw):
    dyn = DynamicSamplingConfig(policy=policy, max_resample=2, preflight="off")
    s_ref, e_ref = _world()
    s_got, e_got = _world()
    loop = BudgetLoop(_planner(budget, **kw), dyn)
    dynamic = DynamicSampler(dyn, CORRECTNESS_KEY, group_size=G, budget=_planner(budget, **kw))
    mixed = False
    for step in range(1, 16):
        ref, ref_stats = loop.step(s_ref, e_ref, step)
        got, sizes = _trainer_step(dynamic, s_got, e_got, step)
        mixed |= any(len(set(s)) > 1 for s in sizes)
        assert [g.problem.id for g in got.groups] == [g.problem.id for g in ref], step
        assert [g.rewards for g in got.groups] == [g.rewards for g in ref], step
        assert all(g.size == G for g in got.groups)  # trained groups: exactly trained_size
        for key in ("budget/completions", "budget/topups", "budget/dropped_collapsed"):
            assert got.stats[key] == ref_stats[key], (step, key)
        assert (
            got.stats["dynamic/valid_groups_carried"] == ref_stats["dynamic/valid_groups_carried"]
        )
        assert got.stats["dynamic/rounds"] == ref_stats["dynamic/rounds"]
        assert got.stats["collapse/acr_raw"] == pytest.approx(ref_stats["collapse/acr_raw"])
        assert got.stats["dynamic/success"] == ref_stats["dynamic/success"]
        assert got.stats["dynamic/gen_batches"] == len(sizes)
        assert got.stats["collapse/frac_reward_zero_std"] == 0.0  # every finished group split
    assert s_got.state_dict() == s_ref.state_dict()  # the same observations, merged per problem
    if budget == "knapsack":
        assert mixed, "the knapsack never mixed counts in a round: the test cannot tell"


def test_first_round_prediction_is_logged_per_level_before_the_sampler_sees_it():
    dyn = DynamicSamplingConfig(policy="carry", max_resample=1, preflight="off")
    sampler, engine = _world()
    twin, _ = _world()
    dynamic = DynamicSampler(dyn, CORRECTNESS_KEY, group_size=G, budget=_planner("knapsack"))
    for step in range(1, 4):
        rounds = dynamic.start(sampler, B, step)
        first = rounds.next_requests()
        assert first is not None
        want = predicted_acr_metrics(twin, [r.problem for r in first], [r.n for r in first])
        rounds.add(generate_mixed(engine, first))
        while (requests := rounds.next_requests()) is not None:
            rounds.add(generate_mixed(engine, requests))
        stats = rounds.finish().stats
        for key, value in want.items():
            assert (math.isnan(value) and math.isnan(stats[key])) or stats[key] == value, key
        assert any(not math.isnan(v) for v in want.values())
        twin.load_state_dict(sampler.state_dict())
    # uniform G: the same metrics, at n = G; none without a levels file
    plain, eng = _world(levels=False)
    rounds = DynamicSampler(dyn, CORRECTNESS_KEY, group_size=G).start(plain, B, 1)
    requests = rounds.next_requests()
    assert requests is not None and {r.n for r in requests} == {G}
    rounds.add(generate_mixed(eng, requests))
    assert not [k for k in rounds.finish().stats if "acr_predicted_by_level" in k]


def test_pending_topups_survive_the_state_dict():
    dyn = DynamicSamplingConfig(policy="carry", max_resample=0, preflight="off")
    sampler, engine = _world(seed=5)
    dynamic = DynamicSampler(dyn, CORRECTNESS_KEY, group_size=G, budget=_planner("knapsack"))
    for step in range(1, 40):
        _trainer_step(dynamic, sampler, engine, step)
        if dynamic.budget is not None and dynamic.budget.pending:
            break
    assert dynamic.budget is not None and dynamic.budget.pending, "no pending top-up to save"
    state, sampler_state = dynamic.state_dict(), sampler.state_dict()
    rng_state = engine.rng.bit_generator.state
    a, _ = _trainer_step(dynamic, sampler, engine, step + 1)
    restored = DynamicSampler(dyn, CORRECTNESS_KEY, group_size=G, budget=_planner("knapsack"))
    restored.load_state_dict(state)
    sampler.load_state_dict(sampler_state)
    engine.rng.bit_generator.state = rng_state
    b, _ = _trainer_step(restored, sampler, engine, step + 1)
    assert [g.problem.id for g in a.groups] == [g.problem.id for g in b.groups]
    assert a.stats["budget/topups"] == b.stats["budget/topups"] > 0


def test_uniform_requests_are_the_problems_of_the_rounds():
    dyn = DynamicSamplingConfig(policy="partial", max_resample=1, preflight="off")
    s1, e1 = _world(seed=7)
    s2, e2 = _world(seed=7)
    a = DynamicSampler(dyn, CORRECTNESS_KEY, group_size=G)
    b = DynamicSampler(dyn, CORRECTNESS_KEY, group_size=G, budget=_planner("uniform"))
    assert b.budget is None  # uniform: no planner, exactly the rounds without one
    for step in range(1, 6):
        ra, rb = a.start(s1, B, step), b.start(s2, B, step)
        while (problems := ra.next_problems()) is not None:
            ra.add(e1.generate(problems, G))
            requests = rb.next_requests()
            assert requests == [Request(p, G) for p in problems]
            rb.add(e2.generate([r.problem for r in requests], G))
        assert rb.next_requests() is None
        sa, sb = ra.finish().stats, rb.finish().stats
        for key, value in sa.items():  # NaN: a level absent this step
            assert (math.isnan(value) and math.isnan(sb[key])) or sb[key] == value, key
        assert "collapse/acr_predicted_step" in sb  # next_requests predicts the first round


def test_budget_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="dynamic.policy"):
        DynamicSampler(DynamicSamplingConfig(policy="original"), budget=_planner("knapsack"))
    cases = [
        ({"budget": {"mode": "greedy"}}, "budget.mode"),
        ({"budget": {"mode": "knapsack"}, "dynamic": {"policy": "original"}}, "dynamic.policy"),
        ({"budget": {"mode": "knapsack", "max_samples": 4}}, "budget.max_samples"),
        ({"budget": {"mode": "sequential", "round_samples": 40}}, "budget.round_samples"),
        ({"budget": {"advantage_baseline": "mean"}}, "budget.advantage_baseline"),
    ]
    import yaml

    for i, (sections, key) in enumerate(cases):
        path = tmp_path / f"c{i}.yaml"
        path.write_text(yaml.safe_dump(sections))
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(RunConfig, [path])
    ok = tmp_path / "ok.yaml"
    ok.write_text(yaml.safe_dump({"budget": {"mode": "knapsack", "min_samples": 1}}))
    assert load_config(RunConfig, [ok]).budget == BudgetConfig(mode="knapsack", min_samples=1)


@pytest.mark.parametrize(
    ("old", "new", "value"),
    [
        ("rollout.budget", "budget.mode", "knapsack"),
        ("rollout.min_samples", "budget.min_samples", 1),
        ("rollout.budget_price", "budget.price", 0.0),
        ("rollout.budget_objective", "budget.objective", "groups"),
        ("rollout.advantage_baseline", "budget.advantage_baseline", "pool"),
    ],
)
def test_old_budget_keys_name_the_new_key(tmp_path, old, new, value):
    """The budget keys left rollout: for its own section: an old key, in a file or as an
    override, is a ConfigError naming the new one (not a bare 'unknown key')."""
    import yaml

    section, key = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({section: {key: value}}))
    with pytest.raises(ConfigError, match=f"'{old}' is now '{new}'"):
        load_config(RunConfig, [path])
    with pytest.raises(ConfigError, match=f"'{old}' is now '{new}'"):
        load_config(RunConfig, [], [f"{old}={value}"])
    assert set(RunConfig.RENAMED_KEYS.values()) == {
        f"budget.{f.name}" for f in dataclasses.fields(BudgetConfig)
    }


@pytest.mark.parametrize("budget", [None, "knapsack", "sequential"])
def test_each_mode_has_one_rounds_class_that_satisfies_the_protocol(budget):
    """One class per mode implements next_requests / add / finish with the protocol's
    signatures, and holds no reference back to the DynamicSampler (no callbacks)."""
    import inspect

    from megagrpo.curriculum.budget_rounds import BudgetRounds
    from megagrpo.curriculum.dynamic import UniformRounds
    from megagrpo.curriculum.rounds import Rounds

    dyn = DynamicSamplingConfig(policy="carry", max_resample=1, preflight="off")
    planner = _planner(budget) if budget else None
    dynamic = DynamicSampler(dyn, CORRECTNESS_KEY, group_size=G, budget=planner)
    sampler, engine = _world()
    rounds = dynamic.start(sampler, B, 1)
    assert type(rounds) is (UniformRounds if budget is None else BudgetRounds)
    assert isinstance(rounds, Rounds)
    for name in ("next_requests", "add", "finish"):
        want = inspect.signature(getattr(Rounds, name))
        got = inspect.signature(getattr(type(rounds), name))
        assert list(got.parameters) == list(want.parameters), name
    assert all(v is not dynamic for v in vars(rounds).values())
    while (requests := rounds.next_requests()) is not None:
        assert isinstance(rounds.add(generate_mixed(engine, requests)), list)
    batch = rounds.finish()
    assert batch.stats["dynamic/gen_batches"] >= 1 and len(batch.groups) <= B
