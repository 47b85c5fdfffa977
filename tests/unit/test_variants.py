"""data.variants: the members of a group answer different renderings of its problem, so a
policy that always gives one letter keeps an advantage instead of collapsing its groups
(issue 24: seed 2 of the demo converged on `d`). The golds here come from the questions'
own rule (an independent solver), not from the code under test."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megagrpo.algo.advantages import group_advantages
from megagrpo.curriculum.budget import merge_groups, select_completions
from megagrpo.data import load_problems
from megagrpo.data.variants import expand_round, fold_round, member_assignment
from megagrpo.errors import DataError
from megagrpo.metrics.completions import CompletionsLog
from megagrpo.parallel.comm import Comm
from megagrpo.placement.rollouts import Rank0Rollouts
from megagrpo.rewards import build_composite
from megagrpo.rewards.answers import answer_bias
from megagrpo.rewards.config import RewardsConfig
from megagrpo.rollout.base import sample_counts
from megagrpo.trainer.batch import build_samples
from megagrpo.types import Group

SYSTEM = "Answer with a letter."


def _row(pid: str, number: int, options: list[int]) -> dict:
    """'Which option is the number X?' with the options rotated in each variant."""

    def text(opts):
        return f"Which option is the number {number}?\n" + "\n".join(
            f"{'abcd'[i]}. {o}" for i, o in enumerate(opts)
        )

    variants = []
    for k in range(4):
        opts = options[-k:] + options[:-k] if k else list(options)
        variants.append({"query": text(opts), "solution": "abcd"[opts.index(number)]})
    return {
        "id": pid,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": text(options)},
        ],
        "solution": "abcd"[options.index(number)],
        "choices": [str(o) for o in options],
        "variants": variants,
    }


def _solve(user_text: str) -> str:
    """The gold letter of a 'Which option is the number X?' question, read off its text."""
    question, *lines = user_text.split("\n")
    number = question.rstrip("?").split()[-1]
    return next(line[0] for line in lines if line.split(". ", 1)[1] == number)


def texts_of(g: Group) -> list[str]:
    """The user text each member of ``g`` answered."""
    return [g.problem.meta["variants"][k]["messages"][-1]["content"] for k in g.member_variants]


@pytest.fixture
def problems(tmp_path):
    rows = [_row(f"n{i}", 10 + i, [10 + i, 50 + i, 60 + i, 70 + i]) for i in range(3)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return list(load_problems([path]))


class ConstantLetter:
    """A question-blind policy: always answers `d`; its prompt ids encode the user text."""

    tokenizer = None
    probe_token_ids = [1, 2, 3]
    dtype = torch.float32
    weights_dropped = False

    def __init__(self) -> None:
        self.asked: list[tuple[str, int]] = []

    def prompt_ids(self, problem):
        return [ord(c) for c in problem.messages[-1]["content"]]

    def supports_adapter_sync(self):
        return False

    def generate(self, problems, n, sampling=None):
        out = []
        for problem, n_j in zip(problems, sample_counts(n, len(problems))):
            self.asked.append((problem.messages[-1]["content"], n_j))
            out.append(
                Group(
                    problem=problem,
                    completions=["Answer: d"] * n_j,
                    token_ids=[[7, 8]] * n_j,
                    logprobs=[[-0.5, -0.5]] * n_j,
                    prompt_ids=self.prompt_ids(problem),
                    finish_reasons=["stop"] * n_j,
                )
            )
        return out


def test_loader_reads_variants_and_names_bad_ones(tmp_path, problems):
    p = problems[0]
    assert [v["answer"] for v in p.meta["variants"]] == [["a"], ["b"], ["c"], ["d"]]
    for v in p.meta["variants"]:  # the query replaced the user turn, the system turn kept
        assert v["messages"][0] == {"role": "system", "content": SYSTEM}
        assert v["answer"] == [_solve(v["messages"][-1]["content"])]
    bad = _row("x", 1, [1, 2, 3, 4])
    bad["variants"][2] = {"text": "no query", "solution": "a"}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: variants\[2\] needs 'query'"):
        load_problems([path])


def test_members_spread_over_the_variants_deterministically(problems):
    p = problems[0]
    drawn = member_assignment(p, 4, seed=11)
    assert sorted(drawn) == [0, 1, 2, 3]  # G = V: every rendering once
    assert drawn == member_assignment(p, 4, seed=11)  # a resumed run draws the same
    two = member_assignment(p, 2, seed=11)
    assert len(set(two)) == 2 and two == drawn[:2]
    requests, sizes, plan = expand_round(problems, [4, 2, 5], seed=3)
    assert sum(sizes) == 11 and len(requests) == 4 + 2 + 4
    assert {r.meta["variant"] for r in requests[:4]} == {0, 1, 2, 3}


def test_a_constant_letter_keeps_an_advantage_with_variants(problems, tmp_path):
    """The mechanism: answering `d` to everything is right for one member in four, so no
    group collapses and the letter is rewarded only where the question says `d`; with the
    problem alone every group of the same policy collapses (all rewards equal)."""
    engine = ConstantLetter()
    reward = build_composite(RewardsConfig())
    rollouts = Rank0Rollouts(engine, Comm(), reward)
    groups = rollouts.generate_round(problems, 4, seed=5)
    assert [g.problem.id for g in groups] == [p.id for p in problems]
    for g in groups:
        assert g.size == 4 and sorted(g.member_variants) == [0, 1, 2, 3]
        texts = [
            g.problem.meta["variants"][k]["messages"][-1]["content"] for k in g.member_variants
        ]
        expected = [1.0 if _solve(t) == "d" else 0.0 for t in texts]
        assert g.rewards == expected and sum(expected) == 1.0
        adv = group_advantages(torch.tensor([g.rewards]))[0]
        assert adv.abs().min() > 0.4  # every member carries signal
        assert g.member_golds() == [[_solve(t)] for t in texts]
        for i, t in enumerate(texts):  # each member continues its own prompt
            assert g.prompt_of(i) == [ord(c) for c in t]
    samples = build_samples(groups, [torch.tensor(g.rewards) for g in groups])
    assert samples[1].input_ids[: samples[1].prompt_len] == groups[0].prompt_of(1)
    bias = answer_bias(groups)
    assert bias["collapse/answer_bias"] == 1.0 and bias["collapse/answer_bias_gold"] == 0.25
    rows = CompletionsLog(tmp_path / "c.jsonl").rows(1, groups[:1])
    for row, text in zip(rows, texts_of(groups[0])):  # what each member was asked
        assert row["prompt_tail"] == text and row["gold"] == [_solve(text)]
    assert [r["variant"] for r in rows] == groups[0].member_variants

    plain = [
        dataclasses.replace(p, meta={k: v for k, v in p.meta.items() if k != "variants"})
        for p in problems
    ]
    collapsed = rollouts.generate_round(plain, 4, seed=5)
    assert all(len(set(g.rewards)) == 1 and not g.member_variants for g in collapsed)


def test_merge_select_and_fold_keep_who_answered_what(problems):
    engine = ConstantLetter()
    requests, sizes, plan = expand_round(problems[:1], [4], seed=1)
    groups = fold_round(engine.generate(requests, sizes), problems[:1], plan)
    g = groups[0]
    g.rewards = [float(i) for i in range(4)]
    merged = merge_groups([g, select_completions(g, [3, 0])])
    assert merged.member_variants == g.member_variants + [
        g.member_variants[3],
        g.member_variants[0],
    ]
    assert merged.prompt_of(4) == g.prompt_of(3) and merged.prompt_of(5) == g.prompt_of(0)
    again = Group(
        problem=g.problem, **{k: v for k, v in dataclasses.asdict(g).items() if k != "problem"}
    )
    assert again.member_variants == g.member_variants  # a carried group's checkpoint round trip


def test_rotate_moves_each_gold_with_its_option_on_igakuqa(igakuqa_dir):
    """data.variants: rotate on the real exam: every rotation's gold letters name the same
    option texts as the question as written (read off the choices, not the code's letter
    arithmetic), the gold reaches every letter, and numeric questions get none."""
    from megagrpo.data.variants import rotated_choices

    problems = list(load_problems([igakuqa_dir / "2018" / "112-A.jsonl"]))
    assert len(problems) > 50
    rotated = 0
    for p in problems:
        variants = rotated_choices(p)
        if p.meta["numeric"]:
            assert variants == []
            continue
        choices = p.meta["choices"]
        assert len(variants) == len(choices)
        assert variants[0]["messages"] == p.messages  # k = 0: as written
        golds = {t for a in p.answer for t in a.split(" or ")}
        texts = {choices["abcde".index(x)] for x in golds}
        for v in variants:
            body = v["messages"][-1]["content"].rsplit("\n\n", 1)[-1].split("\n")
            shown = {line[0]: line[3:] for line in body}
            letters = {t for a in v["answer"] for t in a.split(" or ")}
            assert {shown[x] for x in letters} == texts, (p.id, v["answer"])
        reached = {x for v in variants for a in v["answer"] for x in a.split(" or ")}
        assert reached == set("abcde"[: len(choices)])
        rotated += 1
    assert rotated > 40


def _run_cfg(tmp_path, model_dir, partial: bool = False, **data):
    from megagrpo.config import load_config
    from megagrpo.testing import tiny_run_config, write_run_config
    from megagrpo.trainer.config import RunConfig

    row = _row("v0", 11, [11, 22, 33, 44])
    (tmp_path / "v.jsonl").write_text(json.dumps(row) + "\n")
    sections = {"data": {"train": [str(tmp_path / "v.jsonl")], "eval": [], **data}}
    sections["rewards"] = {"functions": [{"name": "mcq_accuracy", "weight": 1.0}]}
    sections["rollout"] = {"partial": {"enabled": partial}}
    cfg = tiny_run_config(model_dir, tmp_path / "out", "v", **sections)
    return load_config(RunConfig, [write_run_config(tmp_path / "v.yaml", cfg)])


def test_setup_refuses_what_variants_cannot_do(tmp_path, tiny_tokenizer_dir):
    """Fail fast, naming the key: partial rollouts continue one prompt per group; 'left'
    truncation cannot cut every rendering. 'ignore' drops them; the longest one decides."""
    from megagrpo.errors import ConfigError
    from megagrpo.trainer.setup import load_run_data, load_tokenizer

    tok = load_tokenizer(str(tiny_tokenizer_dir))
    with pytest.raises(ConfigError, match="data.variants.*rollout.partial.enabled"):
        load_run_data(_run_cfg(tmp_path, tiny_tokenizer_dir, partial=True), tok)
    ignored = load_run_data(_run_cfg(tmp_path, tiny_tokenizer_dir, variants="ignore"), tok)
    assert "variants" not in ignored.train[0].meta
    kept = load_run_data(_run_cfg(tmp_path, tiny_tokenizer_dir), tok)
    assert len(kept.train[0].meta["variants"]) == 4
    with pytest.raises(ConfigError, match="'left' cannot cut the variants of problem v0"):
        load_run_data(
            _run_cfg(tmp_path, tiny_tokenizer_dir, truncation="left", max_prompt_tokens=5), tok
        )
