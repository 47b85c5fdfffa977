"""Issue 40 item 3: first-round oversampling of dynamic sampling (``dynamic.oversample``): the
first round's size by hand and its margin by the exact binomial, fewer generation rounds per
step at the same trained batch, the surplus carried under the carry rules, no bias toward
short (fast) groups, the config key, and the planner's bill from the collapse simulation."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from test_plan_phases import _two_node

from megagrpo.config import load_config
from megagrpo.curriculum.config import DynamicSamplingConfig
from megagrpo.curriculum.dynamic import DynamicSampler, UniformRounds
from megagrpo.curriculum.oversample import AUTO_MAX, first_round_size
from megagrpo.errors import ConfigError
from megagrpo.trainer.config import RunConfig
from megagrpo.types import Group, Problem


def test_first_round_size_by_hand():
    # B 96, nothing carried, ACR 0.11: (96 + 2 sqrt(96 x 0.11)) / 0.89 = 115.2 -> 116
    assert first_round_size(96, 0, 0.11, "auto") == 116
    assert first_round_size(96, 10, 0.11, "off") == 96  # off: B whatever was carried
    assert first_round_size(96, 10, None, "auto") == 86  # no estimate yet: what is missing
    assert first_round_size(96, 10, 0.2, 1.25) == math.ceil(86 * 1.25)
    assert first_round_size(96, 0, 0.9, "auto") == AUTO_MAX * 96  # bounded
    assert first_round_size(96, 120, 0.2, "auto") == 1  # the carry fills it: one fresh problem


def _p_short(n: int, need: int, acr: float) -> float:
    q = 1 - acr
    return sum(math.comb(n, k) * q**k * acr ** (n - k) for k in range(need))


@pytest.mark.parametrize("need", [8, 32, 96])
@pytest.mark.parametrize("acr", [0.05, 0.11, 0.3])
def test_the_margin_fills_the_batch_in_about_98_percent_of_steps(need, acr):
    """The exact binomial: with the first round auto draws, a resampling round is needed in
    at most ~5 % of steps (z = 2: ~2.3 % in the normal approximation)."""
    n = first_round_size(need, 0, acr, "auto")
    assert need < n <= AUTO_MAX * need
    assert _p_short(n, need, acr) <= 0.05
    if need >= 32:  # without the margin about every fourth step or more would resample
        assert _p_short(math.ceil(need / (1 - acr)), need, acr) > 0.2


# ------------------------------------------------------------------ the sampler


class Source:
    """Problems with a fixed solve rate and a completion length each (independent)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n = 0

    def next_problems(self, n: int, resample: bool = False) -> list[Problem]:
        out = []
        for _ in range(n):
            p = float(self.rng.choice([0.0, 0.3, 0.5, 0.7, 1.0], p=[0.05, 0.3, 0.3, 0.3, 0.05]))
            length = int(self.rng.lognormal(6.5, 0.6))
            out.append(Problem(f"q{self.n}", [], ["a"], {"p": p, "length": length}))
            self.n += 1
        return out

    def observe(self, groups) -> None:
        pass

    def generate(self, problems: list[Problem], g: int) -> list[Group]:
        out = []
        for pr in problems:
            r = (self.rng.random(g) < pr.meta["p"]).astype(float).tolist()
            L = pr.meta["length"]
            out.append(
                Group(
                    pr,
                    ["x"] * g,
                    [[0] * L] * g,
                    [[0.0] * L] * g,
                    r,
                    [L] * g,
                    reward_parts={"acc": r},
                )
            )
        return out


def _run(setting: str, steps: int, batch: int = 16, seed: int = 0, pools: list | None = None):
    """``steps`` steps of the real sampler; ``pools``: each step's valid groups at the end of
    its rounds (carried first, then the rounds' in draw order)."""
    src = Source(seed)
    cfg = DynamicSamplingConfig(policy="carry", max_resample=3, oversample=setting)
    ds = DynamicSampler(cfg, "acc")
    rows, trained, valid = [], [], []
    for step in range(steps):
        rounds = ds.start(src, batch, step)
        assert isinstance(rounds, UniformRounds)
        while (problems := rounds.next_problems()) is not None:
            groups = src.generate(problems, 4)
            decisions = rounds.add(groups)
            valid += [g for g, d in zip(groups, decisions) if d.keep]
        if pools is not None:
            pools.append(list(rounds.valid))
        batch_ = rounds.finish()
        trained += batch_.groups
        rows.append(batch_.stats)
    return rows, trained, valid, ds


def test_oversampling_cuts_rounds_at_the_same_batch():
    """Raw ACR ~0.2: off resamples a whole round in many steps; auto generates one round in
    almost every step, trains the same B groups, and carries only its margin."""
    off, _, _, _ = _run("off", 300)
    auto, _, _, ds = _run("auto", 300)

    def mean(rows, k):
        return float(np.mean([r[k] for r in rows[5:]]))

    assert mean(auto, "dynamic/trained_groups") == mean(off, "dynamic/trained_groups") == 16
    assert mean(off, "dynamic/gen_batches") > 1.15 and mean(auto, "dynamic/gen_batches") < 1.06
    # the carried share (one step stale) shrinks: off carries most of a round
    assert mean(auto, "dynamic/valid_groups_carried") < mean(off, "dynamic/valid_groups_carried")
    assert sum(r["dynamic/carry_dropped_stale"] for r in auto) == 0
    assert 0.1 < mean(auto, "collapse/acr_raw") < 0.3
    assert abs((ds.shared.acr_estimate or 0.0) - mean(auto, "collapse/acr_raw")) < 0.1
    # the problems generated per step are the same, B / (1 - ACR) on average (off carries its
    # surplus too): oversampling saves rounds (each waits for its longest completion), not work
    gen = mean(auto, "dynamic/generated_groups")
    assert gen == pytest.approx(mean(off, "dynamic/generated_groups"), rel=0.05)


def test_trained_groups_are_not_biased_toward_short_ones():
    """The batch keeps the first B valid groups in draw order (carried first), never in order
    of completion. Checked on the lengths (independent of the rewards here, as a real engine's
    finish order would not be): over 400 steps the trained groups' mean completion length is
    that of every valid group generated, within 3 standard errors; a fastest-first pick (the
    B shortest of each step's same pool) is more than 5 standard errors shorter, so the check
    would see such a bias. Per step the batch is exactly the pool's first B."""
    pools: list = []
    _, trained, valid, _ = _run("auto", 400, seed=3, pools=pools)
    t = np.array([g.lengths[0] for g in trained], dtype=float)
    v = np.array([g.lengths[0] for g in valid], dtype=float)
    se = v.std() * math.sqrt(1 / len(t) + 1 / len(v))
    assert abs(t.mean() - v.mean()) < 3 * se
    fastest = [
        g.lengths[0] for pool in pools for g in sorted(pool, key=lambda g: g.lengths[0])[:16]
    ]
    assert v.mean() - np.mean(fastest) > 5 * se
    first_b = [g for pool in pools for g in pool[:16]]
    assert [id(g) for g in first_b] == [id(g) for g in trained]
    ids = [g.problem.id for g in trained]
    assert len(ids) == len(set(ids))  # nothing trained twice


def test_the_estimate_survives_a_checkpoint():
    _, _, _, ds = _run("auto", 5)
    state = json.loads(json.dumps(ds.state_dict()))
    fresh = DynamicSampler(DynamicSamplingConfig(policy="carry"), "acc")
    fresh.load_state_dict(state)
    assert fresh.shared.acr_estimate == pytest.approx(ds.shared.acr_estimate)


def test_the_config_key(tmp_path):
    with pytest.raises(ConfigError, match="dynamic.oversample"):
        load_config(RunConfig, [], ["dynamic.oversample=lots"])
    with pytest.raises(ConfigError, match="dynamic.oversample.*policy carry"):
        load_config(RunConfig, [], ["dynamic.oversample=1.5", "dynamic.policy=partial"])
    y = tmp_path / "c.yaml"
    y.write_text("dynamic:\n  oversample: off\n")  # the YAML 1.1 word, not a boolean
    assert load_config(RunConfig, [y]).dynamic.oversample == "off"
    assert (
        load_config(RunConfig, [], ["dynamic.oversample=1.25"]).dynamic.resolved_oversample()
        == 1.25
    )
    partial = load_config(RunConfig, [], ["dynamic.policy=partial"])  # auto is off there
    assert partial.dynamic.resolved_oversample() == "off"


# ------------------------------------------------------------------ the planner's bill


def test_the_planner_bills_the_oversampled_first_round(repo_root, hf235):
    """16 GPUs: the collapse simulation's first round is larger and resampling rounds rarer
    than with oversample off; generate = first round + (rounds - 1) x a round of B, by hand;
    the step is faster."""
    from megagrpo.commands.plan_memory import plan_run
    from megagrpo.plan.collapse import collapse_bill

    auto_cfg = _two_node(repo_root)
    off_cfg = _two_node(repo_root, "dynamic.oversample=off")
    auto, off = collapse_bill(auto_cfg), collapse_bill(off_cfg)
    assert off.first_round_groups == 96 and 1.08 < off.rounds_per_step
    assert 100 < auto.first_round_groups < 120 and auto.rounds_per_step < 1.05
    p_auto, p_off = plan_run(auto_cfg, hf235), plan_run(off_cfg, hf235)
    g = p_auto["time"]["phases"]["generate"]
    want = g["first_round_s"] + (auto.rounds_per_step - 1) * g["round_s"]
    assert g["s"] == pytest.approx(want)
    assert g["first_round_s"] > g["round_s"]  # more problems in it
    saved = p_off["time"]["step_s"] - p_auto["time"]["step_s"]
    assert 3 < saved < 15, saved


def test_dataclass_default_is_auto():
    assert dataclasses.fields(DynamicSamplingConfig)  # the schema
    assert DynamicSamplingConfig().oversample == "auto"
