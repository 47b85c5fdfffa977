"""Every command line of the README and docs/ runs from a fresh clone (reviews/ms-swift-users-4.md
§5: examples used `../shared/...` paths a clone does not have, and no page said where IgakuQA
comes from). Each ``megagrpo ...`` line of their code blocks is parsed by that command's own
argument parser (what ``--help`` documents; the data is not shipped, so the lines are not run),
the repository files it names exist, and IgakuQA paths are the layout docs/igakuqa.md
documents."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

from megagrpo.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDERS = {"CONFIG": "configs/demo_cpu.yaml", "RUN_DIR": "runs/demo_cpu", "DIR": "out",
                "BASE_DIR": "models/base", "FILE": "out.jsonl", "N": "2"}  # fmt: skip
REPO_DIRS = ("configs/", "tools/", "scripts/", "slurm/", "tests/fixtures/", "docs/")


def _lines() -> list[tuple[str, str]]:
    """``(page, command line)`` of every megagrpo command in a code block (continuations
    joined, a trailing comment and a ``$ `` prompt dropped)."""
    out = []
    for page in PAGES:
        for block in re.findall(r"```[a-z]*\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #", 1)[0].strip().removeprefix("$ ")
                if "megagrpo.cli " in line:
                    line = "megagrpo " + line.split("megagrpo.cli ", 1)[1]
                if line.startswith("megagrpo "):
                    out.append((page.name, line))
        if page.name == "README.md":  # its command table: one synopsis per command
            text = page.read_text(encoding="utf-8")
            for row in re.findall(r"^\| `(megagrpo [^`]*)` \|", text, re.M):
                out.append((page.name, row.replace("\\|", "|")))
    return out


LINES = _lines()


def _concrete(line: str) -> list[str]:
    """A synopsis made concrete: optional ``[...]`` groups dropped, the first of ``a|b``
    alternatives kept, ``...`` dropped, placeholders replaced."""
    line = re.sub(r"\[[^\[\]]*\]", "", line)
    line = re.sub(r"\(([^()|]*)\|[^()]*\)", r"\1", line)
    words = []
    for word in shlex.split(line)[1:]:
        if word == "...":
            continue
        word = word.split("|", 1)[0] if "|" in word and not word.startswith("'") else word
        words.append(PLACEHOLDERS.get(word, word))
    return words


def test_the_docs_have_command_lines():
    assert len(LINES) >= 20 and {p for p, _ in LINES} >= {"README.md", "evaluation.md"}
    readme = {line.split()[1] for page, line in LINES if page == "README.md"}
    assert readme >= set(COMMANDS), sorted(set(COMMANDS) - readme)  # the table has them all


@pytest.mark.parametrize("page,line", LINES, ids=[f"{p}:{i}" for i, (p, _) in enumerate(LINES)])
def test_each_documented_command_parses_and_names_files_that_exist(page, line):
    words = _concrete(line)
    name, rest = words[0], words[1:]
    assert name in COMMANDS, f"{page}: megagrpo {name}: no such command"
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"megagrpo {name}", exit_on_error=False)
    module.add_arguments(parser)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parser.parse_intermixed_args(rest)
        except TypeError:  # from-swift's remainder
            parser.parse_args(rest)
        except SystemExit:
            pytest.fail(f"{page}: {line}\n{err.getvalue()}")
    for word in rest:
        path = word.split("=", 1)[-1]
        assert not path.startswith("../"), f"{page}: {line}: {path} is outside a clone"
        if path.startswith(REPO_DIRS):
            assert (ROOT / path).exists(), f"{page}: {line}: {path} is not in the repository"
        if path.startswith("data/"):
            assert path.startswith("data/igakuqa"), f"{page}: {line}: {path}"


def test_igakuqa_is_documented_where_the_examples_point():
    page = (ROOT / "docs" / "igakuqa.md").read_text(encoding="utf-8")
    assert "https://github.com/jungokasai/IgakuQA" in page and "data/igakuqa" in page
    for doc in PAGES:
        for block in re.findall(r"```[a-z]*\n(.*?)```", doc.read_text(encoding="utf-8"), re.S):
            assert "../shared" not in block, doc.name
    assert "/data/" in (ROOT / ".gitignore").read_text().split()  # the exams never committed
