"""The planner bills the shared prefix (issue 43 item 4): training tokens with each group's
prompt once where the trainer shares it, from the prompt lengths of ``data.train`` when they
are readable (else the labelled assumption, ranged)."""

from __future__ import annotations

import dataclasses

import pytest

from megagrpo.commands.plan_memory import plan_run as plan
from megagrpo.config.loader import load_config
from megagrpo.plan.prefix import computed_train_tokens, prompt_copies, prompt_stats, saving
from megagrpo.plan.ranges import RANGES
from megagrpo.plan.scenario import Assumptions, scenario_from_config
from megagrpo.plan.time import length_moments, train_phase
from megagrpo.trainer.config import RunConfig

SHARE = ["trainer.shared_prefix=true", "trainer.pack_tokens=16384"]


def _cfg(repo_root, *overrides):
    return load_config(RunConfig, [repo_root / "configs/qwen3_235b_a22b.yaml"], list(overrides))


def test_saving_is_the_closed_form_when_every_group_fits(repo_root, hf235):
    """Completions of one length (sigma 0) and a budget that holds every group: the tokens
    computed drop by (G - 1) P / (G (P + C)) exactly (the scale audit's 20.3 % for P 330,
    C 1,094, G 8)."""
    sc = scenario_from_config(_cfg(repo_root, *SHARE), hf235)
    a = Assumptions(completion_sigma=0.0, mean_completion_tokens=1094.0)
    assert sc.shared_prefix and sc.group_size == 8
    mean, age = length_moments(sc, a)
    assert mean == pytest.approx(1094.0, abs=1.0)
    shared = computed_train_tokens(sc, 330.0, mean, 2 * mean * age)
    rows = computed_train_tokens(sc.with_(shared_prefix=False), 330.0, mean, 2 * mean * age)
    assert rows == pytest.approx(sc.trained_groups * 8 * (330 + mean))
    assert 1 - shared / rows == pytest.approx(saving(330, mean, 8), rel=1e-9)
    assert saving(330, 1094, 8) == pytest.approx(0.203, abs=5e-4)


def test_groups_that_do_not_fit_a_micro_batch_are_billed_as_rows(repo_root, hf235):
    """The trainer falls back to rows for a group longer than its micro-batch: a budget of
    one sample bills G prompt copies, one around the mean group about half shared."""
    sc = scenario_from_config(_cfg(repo_root, *SHARE), hf235)
    same = 1094.0**2  # E[C^2] of completions of one length
    assert prompt_copies(sc.with_(pack_tokens=8000), 330.0, 1094.0, same) == 8
    assert prompt_copies(sc, 330.0, 1094.0, same) == 1
    spread = 2.0 * 1094**2  # sd 1,094 per completion: a group's total is 9,082 +- 3,094
    half = prompt_copies(sc.with_(pack_tokens=330 + 8 * 1094), 330.0, 1094.0, spread)
    assert half == pytest.approx(4.5, abs=1e-9)  # 1 copy for half the groups, 8 for the rest
    assert prompt_copies(sc.with_(pack_tokens=2000), 330.0, 1094.0, spread) > 7.9
    renderings = sc.with_(prompts_per_group=3.0)
    assert prompt_copies(renderings, 330.0, 1094.0, same) == pytest.approx(3.0)


def test_plan_bills_what_the_trainer_runs(repo_root, hf235):
    """auto on the TE spec is off until the GPU check passes, and micro_batch_size 1 without
    pack_tokens cannot share: both bill every prompt copy; true with room shares."""
    assert not scenario_from_config(_cfg(repo_root), hf235).shared_prefix  # mbs 1, no packing
    auto = scenario_from_config(_cfg(repo_root, "trainer.pack_tokens=16384"), hf235)
    assert not auto.shared_prefix  # auto: the TE route has not run on a GPU
    a, base = Assumptions(), _cfg(repo_root, "trainer.pack_tokens=16384")
    on = train_phase(scenario_from_config(_cfg(repo_root, *SHARE), hf235), a, _hw())
    off = train_phase(scenario_from_config(base, hf235), a, _hw())
    assert on["tokens_trained"] == off["tokens_trained"] == off["tokens_computed"]
    assert on["tokens_computed"] < 0.82 * off["tokens_computed"]
    assert on["s"] < off["s"]
    full = plan(_cfg(repo_root, *SHARE), hf235)
    assert full["time"]["phases"]["train"]["tokens_computed"] == on["tokens_computed"]


def _hw():
    from megagrpo.plan.scenario import Hardware

    return Hardware()


def test_prompt_lengths_come_from_the_data_when_readable(tiny_moe_dir, repo_root):
    """The demo's MCQ questions rendered with the model's own chat template, counted as an
    independent tokenisation of the same text; a missing file leaves the ranged assumption."""
    from transformers import AutoTokenizer

    from megagrpo.data import load_problems

    data = str(repo_root / "megagrpo/assets/demo_mcq_train.jsonl")
    over = [f"model.hf_path={tiny_moe_dir}", f"data.train=[{data}]", "data.variants=ignore"]
    cfg = load_config(RunConfig, [], over)
    stats = prompt_stats(cfg, 330.0)
    tok = AutoTokenizer.from_pretrained(tiny_moe_dir)
    problems = list(load_problems([data]))[:512]
    want = []
    for p in problems:
        ids = tok.apply_chat_template(p.messages, tokenize=True, add_generation_prompt=True)
        want.append(len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    assert stats.measured and stats.prompts_per_group == 1.0
    assert stats.mean_tokens == pytest.approx(sum(want) / len(want), rel=1e-9)
    per_member = prompt_stats(load_config(RunConfig, [], over[:2]), 330.0)
    assert per_member.prompts_per_group == 4.0  # four renderings, G = 4: nothing shared
    missing = load_config(RunConfig, [], [over[0], "data.train=[/nonexistent/train.jsonl]"])
    gone = prompt_stats(missing, 330.0)
    assert not gone.measured and gone.mean_tokens == 330.0 and "assumption" in gone.source
    assert RANGES["mean_prompt_tokens"].low < 330.0 < RANGES["mean_prompt_tokens"].high


def test_plan_memory_prints_the_prompt_line(repo_root, capsys):
    from megagrpo.cli import main

    hf = str(repo_root / "configs/qwen3_235b_a22b.hf_config.json")
    cfg = str(repo_root / "configs/qwen3_235b_a22b.yaml")
    assert main(["plan-memory", cfg, *SHARE, "--hf-config", hf]) == 0
    out = capsys.readouterr().out
    assert "prompts: 330 tokens on average, assumption (data.train not read" in out
    assert "shared prefix: each group's prompt once" in out
    assert main(["plan-memory", cfg, "--hf-config", hf]) == 0
    assert "shared prefix: off (a micro-batch holds one sample" in capsys.readouterr().out


def test_scenario_fields_are_plain():
    names = {f.name for f in dataclasses.fields(Assumptions)}
    assert "mean_prompt_tokens" in names and "mean_prompt_tokens" in RANGES
