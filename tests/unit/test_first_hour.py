"""First-hour trips outside from-swift (reviews/ms-swift-users-3.md F6): `megagrpo eval CONFIG
--data ... key=value` (the usage line prints overrides last), `plan` quiet before its table,
and eval's own count next to the official count of the files it wrote (116A71)."""

from __future__ import annotations

import logging
from pathlib import Path

from megagrpo.cli import main
from megagrpo.commands.eval import official_count
from megagrpo.rewards.igakuqa import GoldItem, score

REPO = Path(__file__).resolve().parents[2]


def test_overrides_may_follow_the_options(monkeypatch):
    """`megagrpo eval CONFIG --data D --limit 5 key=value` parses (cd819e6: "unrecognized
    arguments"); so does `train CONFIG --resume key=value`."""
    from megagrpo.commands import eval as eval_cmd
    from megagrpo.commands import train as train_cmd

    seen = {}
    monkeypatch.setattr(eval_cmd, "run", lambda args: seen.setdefault("eval", args) and 0)
    monkeypatch.setattr(train_cmd, "run", lambda args: seen.setdefault("train", args) and 0)
    argv = ["eval", "c.yaml", "--data", "d", "--limit", "5", "rollout.max_tokens=64"]
    assert main(argv) == 0
    args = seen["eval"]
    assert (args.config, args.data, args.limit) == ("c.yaml", ["d"], 5)
    assert args.overrides == ["rollout.max_tokens=64"]
    assert main(["train", "c.yaml", "--resume", "trainer.max_steps=3"]) == 0
    assert seen["train"].overrides == ["trainer.max_steps=3"] and seen["train"].resume


def test_plan_prints_no_line_per_simulated_step(caplog, capsys):
    """The field report's levels with L1-L6 kept and ms-swift's original policy: dynamic
    sampling falls short on most steps; the table says so (ds_success_rate), not one INFO
    line per step (cd819e6: 200 lines before the table)."""
    argv = ["plan", str(REPO / "configs" / "demo_cpu.yaml"), "dynamic.policy=original",
            "--levels", "L1=2164,L2=294,L3=223,L4=180,L5=216,L6=636",
            "--keep-levels", "L1-L6", "--steps", "40"]  # fmt: skip
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    per_step = [r for r in caplog.records if r.name == "megagrpo.curriculum.dynamic"]
    assert per_step == []
    assert "ds_success_rate" in capsys.readouterr().out


def _gold(pid: str, answer: str, points: int = 1) -> GoldItem:
    return GoldItem(pid, [answer], points, "2022", f"/d/2022/{pid[:4]}.jsonl:1")


def test_eval_prints_the_official_count_of_its_files():
    """--limit 2 of a 4-question file with 116A71 beyond the limit: eval scores the 2 it
    answered; IgakuQA's rule on the written file counts all 4, the unanswered wrong and
    116A71 correct for everyone: the line says which and why (cd819e6 printed nothing)."""
    full = {p.problem_id: p for p in (_gold("116A1", "a"), _gold("116A2", "b"),
                                      _gold("116A3", "c"), _gold("116A71", "d", 3))}  # fmt: skip
    asked = {k: full[k] for k in ("116A1", "116A2")}
    answers = {"116A1": "a", "116A2": "c"}
    tally, line = official_count(full, asked, answers)
    assert tally is not None
    assert (tally["correct"], tally["total"], tally["score"]) == (2, 4, 4)
    assert score(full, answers).overall.as_dict()["correct"] == 2  # = megagrpo score's
    assert "2/4 correct" in line and "116A71 counts correct for everyone" in line
    assert "2 beyond --limit" in line
    assert official_count(asked, asked, answers) == (None, "")
