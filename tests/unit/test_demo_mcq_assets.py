"""The demo's problem set (megagrpo/assets/demo_mcq_*.jsonl) is what tools/make_demo_mcq.py
writes with its defaults, byte for byte, and stays small; no held-out question is a training one."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys


def test_make_demo_mcq_regenerates_the_shipped_files(tmp_path, repo_root):
    tool = repo_root / "tools" / "make_demo_mcq.py"
    proc = subprocess.run(
        [sys.executable, str(tool), "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("demo_mcq_train.jsonl", "demo_mcq_eval.jsonl"):
        shipped = (repo_root / "megagrpo" / "assets" / name).read_bytes()
        assert (tmp_path / name).read_bytes() == shipped, name
        assert len(shipped) < 200_000, (name, len(shipped))


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
    assert (len(train), len(evals)) == (400, 256)
    prompts = {r["messages"][-1]["content"] for r in train}
    assert not prompts & {r["messages"][-1]["content"] for r in evals}
    for rec in train + evals:  # the gold letter names one of the listed options
        letter = rec["solution"]
        idx = mod.LETTERS.index(letter)
        assert f"\n{letter}. {rec['choices'][idx]}" in rec["messages"][-1]["content"]
