"""The demo's problem set (megagrpo/assets/demo_mcq_*.jsonl) is what tools/make_demo_mcq.py
writes with its defaults, byte for byte, and stays small; no held-out question is a training one;
every gold follows from the question's rule (checked by an independent solver) and the gold
letters are balanced, overall and per template, so the best constant answer scores 1/4."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter


def test_make_demo_mcq_regenerates_the_shipped_files(tmp_path, repo_root):
    tool = repo_root / "tools" / "make_demo_mcq.py"
    proc = subprocess.run(
        [sys.executable, str(tool), "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("demo_mcq_train.jsonl", "demo_mcq_eval.jsonl"):
        shipped = (repo_root / "megagrpo" / "assets" / name).read_bytes()
        assert (tmp_path / name).read_bytes() == shipped, name
        assert len(shipped) < 300_000, (name, len(shipped))


def test_demo_mcq_sets_are_disjoint_and_answerable(repo_root):
    spec = importlib.util.spec_from_file_location("mcq", repo_root / "tools" / "make_demo_mcq.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assets = repo_root / "megagrpo" / "assets"
    train, evals = (
        [json.loads(x) for x in (assets / f"demo_mcq_{n}.jsonl").read_text().splitlines()]
        for n in ("train", "eval")
    )
    assert (len(train), len(evals)) == (400, 240)
    prompts = {r["messages"][-1]["content"] for r in train}
    assert not prompts & {r["messages"][-1]["content"] for r in evals}
    for rec in train + evals:  # the gold letter names one of the listed options
        letter = rec["solution"]
        idx = mod.LETTERS.index(letter)
        assert f"\n{letter}. {rec['choices'][idx]}" in rec["messages"][-1]["content"]
        assert len(rec["choices"]) == 4 == len(set(rec["choices"]))


def _right(rec: dict) -> bool:
    """Whether the gold follows from the question's rule (an independent solver)."""
    question, *options = rec["messages"][-1]["content"].split("\n")
    values = [o.split(". ", 1)[1] for o in options]
    gold = "abcd".index(rec["solution"])
    words = question.rstrip(".?").split()
    if question.startswith("Choose option"):
        return words[-1] == rec["solution"]
    if question.startswith("Choose the"):
        return words[2] == ["first", "second", "third", "fourth"][gold]
    if question.startswith("Which option is the number"):
        return values[gold] == words[-1]
    if question.startswith("What is"):
        return int(values[gold]) == int(words[2]) + int(words[4])
    assert question == "Which number is the largest?", question
    return int(values[gold]) == max(int(v) for v in values)


def test_demo_mcq_golds_follow_the_rule_and_are_balanced(repo_root):
    assets = repo_root / "megagrpo" / "assets"
    for split in ("train", "eval"):
        recs = [
            json.loads(x) for x in (assets / f"demo_mcq_{split}.jsonl").read_text().splitlines()
        ]
        assert all(_right(r) for r in recs)
        counts = Counter(r["solution"] for r in recs)
        assert counts == dict.fromkeys("abcd", len(recs) // 4), (split, counts)  # best constant 1/4
        per_template = Counter((r["id"].rstrip("0123456789"), r["solution"]) for r in recs)
        assert len(set(per_template.values())) == 1, per_template  # each template balanced


def test_demo_mcq_variants_put_each_gold_letter_once(repo_root):
    """data.variants: every training question lists four renderings, its gold at a, b, c, d in
    turn, each following the question's rule (the same independent solver), the original
    among them; the held-out questions have none (evaluation reads the question itself)."""
    assets = repo_root / "megagrpo" / "assets"
    train = [json.loads(x) for x in (assets / "demo_mcq_train.jsonl").read_text().splitlines()]
    for rec in train:
        variants = rec["variants"]
        assert [v["solution"] for v in variants] == list("abcd"), rec["id"]
        for v in variants:
            assert _right({"messages": [{"content": v["query"]}], "solution": v["solution"]})
        assert rec["messages"][-1]["content"] in {v["query"] for v in variants}
        assert len({v["query"] for v in variants}) == 4
    evals = (assets / "demo_mcq_eval.jsonl").read_text().splitlines()
    assert not any("variants" in json.loads(x) for x in evals)
