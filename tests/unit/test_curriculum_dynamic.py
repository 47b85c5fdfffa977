"""DynamicSampler policies on constructed reward patterns, against a transcription of
ms-swift's `_dynamic_sampling` loop (GRPOTrainer, ms-swift 3.x/4.x), and the pre-flight."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megagrpo.curriculum.config import DynamicSamplingConfig
from megagrpo.curriculum.dynamic import DynamicSampler, checked_rounds, preflight_check
from megagrpo.errors import ConfigError
from megagrpo.types import Group, Problem

B = 4
SPLIT, ALL_RIGHT, ALL_WRONG = [1.0, 0.0, 1.0, 1.0], [1.0] * 4, [0.0] * 4


class ScriptedSource:
    """Problem source whose rounds are given up front: each round a list of reward rows.

    Round r's problems are named ``r{r}-{i}``; the generate_fn looks their rewards up.
    """

    def __init__(self, rounds):
        self.rounds = list(rounds)
        self.next_round = 0
        self.observed: list[str] = []
        self.streams: list[bool] = []

    def next_problems(self, n, resample=False):
        r = self.next_round
        self.next_round += 1
        self.streams.append(resample)
        assert len(self.rounds[r]) == n
        return [Problem(id=f"r{r}-{i}", messages=[], answer=["a"]) for i in range(n)]

    def observe(self, groups):
        self.observed.extend(g.problem.id for g in groups)

    def generate(self, problems):
        out = []
        for p in problems:
            r, i = (int(x) for x in p.id[1:].split("-"))
            rewards = list(self.rounds[r][i])
            out.append(
                Group(
                    problem=p,
                    completions=["x"] * 4,
                    token_ids=[],
                    logprobs=[],
                    rewards=rewards,
                    reward_parts={"acc": rewards},
                )
            )
        return out


def msswift_reference(rounds, batch, max_resample_times):
    """ms-swift's loop, transcribed: returns (trained ids, number of generated rounds).

    while resample_count < max_resample_times:
        valid_mask = std > 0; valid_samples.extend(...)
        if len(valid_samples) >= generation_batch_size: break
        inputs = next(resample_iterator); generate; score; resample_count += 1
    if len(valid_samples) >= generation_batch_size: use valid_samples[:batch]
    else: use origin_data
    """
    cur, generated = 0, 1
    valid = []
    count = 0
    while count < max_resample_times:
        valid.extend(f"r{cur}-{i}" for i, row in enumerate(rounds[cur]) if np.std(row, ddof=1) > 0)
        if len(valid) >= batch:
            break
        cur += 1
        generated += 1
        count += 1
    if len(valid) >= batch:
        return valid[:batch], generated
    return [f"r0-{i}" for i in range(len(rounds[0]))], generated


def _round(num_valid):
    return [SPLIT] * num_valid + [ALL_RIGHT if i % 2 else ALL_WRONG for i in range(B - num_valid)]


def run_rounds(ds, sampler, generate, batch_groups, step):
    """The trainer's round loop (megagrpo.placement.rollouts.collect_batch), minus the engine."""
    rounds = ds.start(sampler, batch_groups, step)
    while (problems := rounds.next_problems()) is not None:
        rounds.add(generate(problems))
    return rounds.finish()


def _fill(policy, rounds, R=3, step=0, ds=None, **kw):
    src = ScriptedSource(rounds)
    ds = ds or DynamicSampler(DynamicSamplingConfig(policy=policy, max_resample=R, **kw), "acc")
    return run_rounds(ds, src, src.generate, B, step), src, ds


def test_msswift_comparison_it_discards_what_we_keep():
    # 1 valid group per round for 3 rounds, then a full round: ms-swift checks only 3 rounds,
    # generates the 4th and throws it away, and trains on round 0 (3 collapsed groups).
    rounds = [_round(1), _round(1), _round(1), _round(4)]
    ref_ids, ref_generated = msswift_reference(rounds, B, 3)
    orig, src, _ = _fill("original", rounds)
    assert [g.problem.id for g in orig.groups] == ref_ids == ["r0-0", "r0-1", "r0-2", "r0-3"]
    assert orig.stats["dynamic/gen_batches"] == ref_generated == 4
    assert orig.stats["dynamic/rounds"] == 3 and orig.stats["dynamic/success"] == 0
    assert orig.stats["dynamic/collapsed_groups_trained"] == 3
    assert orig.stats["dynamic/valid_groups_discarded"] == 2  # r1-0, r2-0 thrown away
    assert orig.stats["collapse/frac_reward_zero_std"] == 0.75  # = the raw ACR
    assert orig.stats["collapse/acr_raw"] == 0.75
    # Same generation cost, every round checked: the batch fills with signal only.
    part, src_p, _ = _fill("partial", rounds)
    assert part.stats["dynamic/gen_batches"] == 4 and part.stats["dynamic/success"] == 1
    assert [g.problem.id for g in part.groups] == ["r0-0", "r1-0", "r2-0", "r3-0"]
    assert part.stats["collapse/frac_reward_zero_std"] == 0.0
    assert part.stats["collapse/acr_raw"] == 0.75  # raw still logged
    assert part.stats["dynamic/valid_groups_discarded"] == 3
    # carry keeps the 3 surplus valid groups for the next step.
    carry, _, ds = _fill("carry", rounds)
    assert carry.stats["dynamic/carry_buffer"] == 3
    assert [g.problem.id for g in ds.carry] == ["r3-1", "r3-2", "r3-3"]
    # every generated round was observed by the sampler and drawn from the right stream
    assert len(src.observed) == len(src_p.observed) == 16
    assert src.streams == [False, True, True, True]


@pytest.mark.parametrize("seed", range(20))
def test_original_policy_equals_msswift_on_random_patterns(seed):
    rng = np.random.default_rng(seed)
    rounds = [
        [
            list(rng.integers(0, 2, size=4).astype(float))
            if rng.random() < 0.5
            else [float(rng.integers(0, 2))] * 4
            for _ in range(B)
        ]
        for _ in range(5)
    ]
    for R in (1, 2, 3):
        ref_ids, ref_generated = msswift_reference(rounds, B, R)
        batch, _, _ = _fill("original", rounds, R=R)
        assert [g.problem.id for g in batch.groups] == ref_ids
        assert batch.stats["dynamic/gen_batches"] == ref_generated


def test_partial_trains_on_the_valid_groups_when_short():
    rounds = [_round(1), _round(0), _round(1), _round(0)]
    batch, _, _ = _fill("partial", rounds)
    assert [g.problem.id for g in batch.groups] == ["r0-0", "r2-0"]
    assert batch.stats["dynamic/success"] == 0 and batch.stats["dynamic/rounds"] == 4
    assert batch.stats["dynamic/valid_groups"] == 2
    assert batch.stats["dynamic/collapsed_groups_trained"] == 0


def test_no_valid_group_gives_an_empty_batch():
    batch, _, _ = _fill("partial", [_round(0)] * 4)
    assert batch.groups == [] and batch.stats["dynamic/trained_groups"] == 0


def test_stops_at_the_first_round_that_fills():
    batch, src, _ = _fill("carry", [_round(3), _round(2), _round(4), _round(4)])
    assert src.next_round == 2 and batch.stats["dynamic/gen_batches"] == 2
    assert batch.stats["dynamic/rounds"] == 2


def test_carry_feeds_the_next_step_and_respects_staleness_and_bound():
    # the carry buffer's own rules, with first rounds of B (dynamic.oversample off)
    cfg = DynamicSamplingConfig(
        policy="carry", max_resample=3, carry_max_staleness=1, oversample="off"
    )
    ds = DynamicSampler(cfg, "acc")
    _fill("carry", [_round(4), _round(4)], step=0, ds=ds)  # nothing surplus
    _fill("carry", [_round(2), _round(4)], step=1, ds=ds)  # 2 surplus from round 1
    assert len(ds.carry) == 2
    nxt, src, _ = _fill("carry", [_round(2), _round(4)], step=2, ds=ds)
    assert nxt.stats["dynamic/valid_groups_carried"] == 2
    assert nxt.stats["dynamic/gen_batches"] == 1  # carried 2 + fresh 2
    assert [g.problem.id for g in nxt.groups][:2] == ["r1-2", "r1-3"]  # carried first
    # staleness: groups from step 2 are dropped at step 4
    ds.carry = nxt.groups[:1]
    late, _, _ = _fill("carry", [_round(4)], step=4, ds=ds)
    assert late.stats["dynamic/carry_dropped_stale"] == 1
    assert late.stats["dynamic/valid_groups_carried"] == 0
    # bound: at most carry_max_groups kept
    small = DynamicSampler(DynamicSamplingConfig(policy="carry", carry_max_groups=1), "acc")
    _fill("carry", [_round(1), _round(4)], ds=small)
    assert len(small.carry) == 1


def test_carry_buffer_survives_json_state_roundtrip():
    _, _, ds = _fill("carry", [_round(1), _round(1), _round(1), _round(4)])
    state = json.loads(json.dumps(ds.state_dict()))
    fresh = DynamicSampler(DynamicSamplingConfig(policy="carry"), "acc")
    fresh.load_state_dict(state)
    assert [g.problem.id for g in fresh.carry] == [g.problem.id for g in ds.carry]
    assert fresh.carry[0].rewards == ds.carry[0].rewards and fresh.carry[0].meta["step"] == 0


def test_carry_routing_travels_beside_the_json_state():
    """MoE routing of carried groups is kept out of the JSON state (tensors go to the rank
    files) and restored beside it, tensor for tensor."""
    _, _, ds = _fill("carry", [_round(1), _round(1), _round(1), _round(4)])
    gen = torch.Generator().manual_seed(0)
    for g in ds.carry:
        g.routing = [torch.randint(0, 8, (3, 2, 2), generator=gen) for _ in g.token_ids]
    state = json.loads(json.dumps(ds.state_dict()))
    assert all(d["routing"] == [] for d in state["carry"])
    fresh = DynamicSampler(DynamicSamplingConfig(policy="carry"), "acc")
    fresh.load_state_dict(state, ds.carry_routing())
    for a, b in zip(fresh.carry, ds.carry, strict=True):
        assert len(a.routing) == len(b.routing) == len(b.token_ids)
        assert all(torch.equal(x, y) for x, y in zip(a.routing, b.routing))


def test_disabled_trains_on_the_first_round():
    batch, src, _ = _fill("carry", [_round(1)], enabled=False)
    assert len(batch.groups) == B and src.next_round == 1
    assert batch.stats["collapse/frac_reward_zero_std"] == 0.75


def test_length_penalty_split_is_reported_on_correctness():
    # all correct, one completion penalised: not collapsed on the total reward, collapsed on
    # correctness. Both views are logged.
    rows = [[1.0, 1.0, 1.0, 0.8]] + [ALL_WRONG] * 3
    src = ScriptedSource([rows])

    def gen(problems):
        groups = src.generate(problems)
        groups[0].reward_parts = {"acc": [1.0] * 4}
        return groups

    batch = run_rounds(DynamicSampler(DynamicSamplingConfig(enabled=False), "acc"), src, gen, B, 0)
    assert batch.stats["collapse/acr_raw"] == 0.75
    assert batch.stats["collapse/acr_correctness_raw"] == 1.0


def test_filter_decisions_name_why_a_group_is_dropped():
    src = ScriptedSource([[SPLIT, ALL_RIGHT, ALL_WRONG, [0.5] * 4]])

    def gen(problems):
        groups = src.generate(problems)
        groups[3].reward_parts = {"acc": [1.0, 0.0, 1.0, 0.0]}  # equal totals, split correctness
        return groups

    rounds = DynamicSampler(DynamicSamplingConfig(policy="carry"), "acc").start(src, B, 0)
    decisions = rounds.add(gen(rounds.next_problems()))
    assert [(d.keep, d.reason) for d in decisions] == [
        (True, "valid"),
        (False, "solve_all"),
        (False, "solve_none"),
        (False, "zero_std"),
    ]


def test_rounds_ask_for_no_more_than_the_policy_checks():
    # nothing ever splits: carry checks 1 + R rounds, original R and generates one more
    for policy, generated in (("carry", 4), ("partial", 4), ("original", 4)):
        src = ScriptedSource([[ALL_WRONG] * B] * 5)
        ds = DynamicSampler(DynamicSamplingConfig(policy=policy, max_resample=3), "acc")
        batch = run_rounds(ds, src, src.generate, B, 0)
        assert src.next_round == generated, policy
        assert batch.stats["dynamic/gen_batches"] == generated
    src = ScriptedSource([[ALL_WRONG] * B] * 2)
    ds = DynamicSampler(DynamicSamplingConfig(policy="original", max_resample=1), "acc")
    run_rounds(ds, src, src.generate, B, 0)
    assert src.next_round == 2  # checks R=1 round, generates the second and stops


def test_checked_rounds_per_policy():
    assert checked_rounds(DynamicSamplingConfig(policy="original", max_resample=3)) == 3
    assert checked_rounds(DynamicSamplingConfig(policy="partial", max_resample=3)) == 4
    assert checked_rounds(DynamicSamplingConfig(enabled=False)) == 1


def test_preflight_article_numbers():
    # ms-swift at R=3 (3 checked rounds), ACR 0.73: cannot fill; R >= 4 would (1/(1-0.73)=3.7).
    cfg = DynamicSamplingConfig(policy="original", max_resample=3, preflight="warn")
    res = preflight_check(cfg, 0.73, 96, {"L2-L5": 0.21})
    assert not res.ok and res.success_prob < 0.02
    assert "max_resample >= 4" in res.message and "L2-L5" in res.message
    assert preflight_check(cfg, 0.5, 96).ok
    with pytest.raises(ConfigError, match="dynamic.preflight"):
        preflight_check(DynamicSamplingConfig(policy="original", preflight="fail"), 0.73, 96)
    # ours checks all 1 + R rounds: at R=3 the ceiling is 1 - 1/4 = 0.75
    assert preflight_check(DynamicSamplingConfig(policy="carry"), 0.73, 96).ok
    assert not preflight_check(DynamicSamplingConfig(policy="carry"), 0.8, 96).ok


def test_every_design_metric_is_in_every_row():
    from megagrpo.curriculum.config import CurriculumConfig
    from megagrpo.curriculum.sampler import CurriculumSampler
    from megagrpo.metrics.names import CORE_METRICS

    probs = [Problem(id=f"q{i}", messages=[], answer=["a"]) for i in range(8)]
    sampler = CurriculumSampler(probs, CurriculumConfig(), {p.id: 3 for p in probs})
    src = ScriptedSource([_round(2)] * 4)
    gen_ids = iter(range(10**6))

    def generate(problems):  # scripted rewards on the sampler's problems
        rows = src.rounds[0]
        return [
            Group(
                problem=p,
                completions=["x"] * 4,
                token_ids=[],
                logprobs=[],
                rewards=list(rows[next(gen_ids) % B]),
            )
            for p in problems
        ]

    for policy in ("original", "partial", "carry"):
        ds = DynamicSampler(DynamicSamplingConfig(policy=policy), "acc")  # no acr_predicted
        row = {**run_rounds(ds, sampler, generate, B, 0).stats, **sampler.metrics()}
        wanted = [
            n for n in CORE_METRICS if n.split("/")[0] in ("collapse", "dynamic", "curriculum")
        ]
        assert not [n for n in wanted if n not in row], policy
        assert np.isnan(row["collapse/acr_by_level/L1"]) and row["collapse/acr_by_level/L3"] == 0.5
        assert np.isnan(row["collapse/acr_predicted"])
