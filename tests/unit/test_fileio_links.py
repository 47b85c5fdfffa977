"""No megagrpo writer follows a symbolic link (red team 3, H1 and the audit of every writer).

A link planted in a shared runs directory (``RUN_DIR/.lock -> ~/victim``) must never make
megagrpo truncate or append to the link's target: the lock, the append-only logs (metrics,
completions, profile levels), checkpoint files and every atomic write either refuse the link
naming it or replace the link itself. The last test keeps every other way of writing a file
out of the package, so a new writer goes through :mod:`megagrpo.fileio` too.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from megagrpo import fileio
from megagrpo.errors import ConfigError, MegagrpoError

PACKAGE = Path(__file__).resolve().parents[2] / "megagrpo"


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim"
    path.write_text("precious\n")
    return path


def _plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def test_run_lock_refuses_a_symlink_and_leaves_it(tmp_path, victim):
    """H1: ``.lock -> victim``: refused naming the link; victim and link untouched."""
    from megagrpo.trainer import runlock

    link = _plant(tmp_path / "run" / ".lock", victim)
    with pytest.raises(MegagrpoError, match=r"\.lock is a symbolic link"):
        runlock.acquire(tmp_path / "run")
    assert victim.read_text() == "precious\n"
    assert link.is_symlink()  # nothing the user did not name is deleted


def test_train_with_a_planted_lock_link_exits_2_and_keeps_the_target(
    tmp_path, victim, bigram_dir, capsys
):
    """H1 end to end, before any model: ``megagrpo train ... --resume`` with the link."""
    from megagrpo.cli import main
    from megagrpo.testing import tiny_run_config, write_run_config

    cfg = tiny_run_config(bigram_dir, tmp_path / "runs", "x")
    path = write_run_config(tmp_path / "tiny.yaml", cfg)
    _plant(tmp_path / "runs" / "x" / ".lock", victim)
    rc = main(["train", str(path), "--resume"])
    assert rc == 2
    assert ".lock is a symbolic link" in capsys.readouterr().err
    assert victim.read_text() == "precious\n"


def test_a_fifo_lock_is_refused_by_name(tmp_path):
    from megagrpo.trainer import runlock

    (tmp_path / "run").mkdir()
    os.mkfifo(tmp_path / "run" / ".lock")
    with pytest.raises(MegagrpoError, match=r"\.lock is a FIFO"):
        runlock.acquire(tmp_path / "run")


def test_metrics_and_completions_logs_never_append_through_a_link(tmp_path, victim):
    from megagrpo.metrics.completions import CompletionsLog
    from megagrpo.metrics.logger import JsonlLogger

    _plant(tmp_path / "run" / "metrics.jsonl", victim)
    with pytest.raises(MegagrpoError, match=r"metrics\.jsonl is a symbolic link"):
        JsonlLogger(tmp_path / "run" / "metrics.jsonl")
    _plant(tmp_path / "run" / "completions.jsonl", victim)
    with pytest.raises(MegagrpoError, match=r"completions\.jsonl is a symbolic link"):
        CompletionsLog(tmp_path / "run" / "completions.jsonl")
    assert victim.read_text() == "precious\n"


def test_atomic_writes_replace_a_link_and_a_planted_tmp_link(tmp_path, victim):
    """An atomic write replaces a link at the target (rename) and never writes through a
    link planted under its predictable temporary name."""
    target = _plant(tmp_path / "config.yaml", victim)
    _plant(fileio.tmp_sibling(target, unique=True), victim)
    fileio.write_text(target, "a: 1\n")
    assert not target.is_symlink() and target.read_text() == "a: 1\n"
    assert victim.read_text() == "precious\n"


def test_hashed_and_appended_files_refuse_links(tmp_path, victim):
    link = _plant(tmp_path / "ckpt" / "rank0.pt", victim)
    with pytest.raises(ConfigError, match="symbolic link"):
        fileio.write_hashed(link, lambda fh: fh.write(b"x"))
    assert link.is_symlink() and victim.read_text() == "precious\n"
    with pytest.raises(ConfigError, match="symbolic link"):
        fileio.open_append(_plant(tmp_path / "levels.jsonl", victim))
    dangling = _plant(tmp_path / "new.jsonl", tmp_path / "nowhere" / "created")
    with pytest.raises(ConfigError, match="symbolic link"):
        fileio.open_append_text(dangling)
    assert not (tmp_path / "nowhere").exists()


def test_a_directory_where_a_file_goes_is_named(tmp_path):
    (tmp_path / "out.yaml").mkdir()
    with pytest.raises(ConfigError, match=r"out\.yaml is a directory"):
        fileio.write_text(tmp_path / "out.yaml", "x")


def test_checkpoint_save_never_writes_through_a_planted_link(tmp_path, victim, monkeypatch):
    """A link planted inside the checkpoint's temporary directory (a race) is refused: the
    save fails naming it, the victim is intact."""
    from megagrpo.checkpoint import format as checkpoint
    from megagrpo.errors import CheckpointError

    root = tmp_path / "checkpoints"
    real = fileio.fresh_tmp_dir

    def planted(out, unique=False):
        tmp = real(out, unique)
        (tmp / checkpoint.rank_file(0)).symlink_to(victim)
        return tmp

    monkeypatch.setattr(fileio, "fresh_tmp_dir", planted)
    with pytest.raises(CheckpointError, match="symbolic link"):
        checkpoint.save(root, 1, rank=0, world_size=1, rank_state={}, trainer_state={}, meta={})
    assert victim.read_text() == "precious\n"


def test_a_hard_linked_lock_is_refused_and_the_other_name_kept(tmp_path, victim):
    """Red team 4, N10: ``ln victim RUN_DIR/.lock`` (O_NOFOLLOW stops links, not hard links):
    the lock's JSON was written over the victim."""
    from megagrpo.trainer import runlock

    (tmp_path / "run").mkdir()
    os.link(victim, tmp_path / "run" / ".lock")
    with pytest.raises(MegagrpoError, match=r"\.lock is a file with 2 hard links"):
        runlock.acquire(tmp_path / "run")
    assert victim.read_text() == "precious\n"


def test_a_truncating_open_refuses_a_hard_link_before_truncating(tmp_path, victim):
    """Every file megagrpo truncates (``O_TRUNC``, or a lock it rewrites): refused with more
    than one hard link, checked before anything is cut; appending and new files are not."""
    os.link(victim, tmp_path / "rank0.pt")
    with pytest.raises(ConfigError, match="2 hard links"):
        fileio.open_new(tmp_path / "rank0.pt")
    with pytest.raises(ConfigError, match="2 hard links"):
        fileio.lock_file(tmp_path / "rank0.pt")
    assert victim.read_text() == "precious\n"
    with fileio.open_new(tmp_path / "fresh.bin") as fh:  # a new file: one link
        fh.write(b"x")
    fd = fileio.lock_file(tmp_path / "levels.jsonl.lock", wait=False)
    assert fd is not None and fileio.lock_file(tmp_path / "levels.jsonl.lock", wait=False) is None
    fileio.unlock_file(tmp_path / "levels.jsonl.lock", fd)
    assert not (tmp_path / "levels.jsonl.lock").exists()


# Ways to write a file other than megagrpo.fileio, and the places allowed to use them (each
# writes only inside a directory it has just created, or outside any run directory).
_WRITERS = {
    "open for writing": re.compile(r"(?<![\w.])open\([^)\n]*['\"][rbt]*[wax+][rbt+]*['\"]"),
    "Path.open for writing": re.compile(r"\.open\(\s*['\"][rbt]*[wax+]"),
    "Path.write_text/bytes": re.compile(r"(?<!fileio)\.write_(?:text|bytes)\("),
    "os.open": re.compile(r"\bos\.open\("),
    "library writing to a path": re.compile(
        r"\bsave_file\(|\.save_pretrained\(|shutil\.copy|\.savefig\((?!buf\b)|"
        r"torch\.save\([^)]*,\s*(?:str\(|path|f\b|out\b|a\.out\b|args\.out\b)|\.extract(?:all)?\("
    ),
}
_OWN_TMP = "inside a directory it has just created (tempfile / fileio)"
_ALLOWED = {
    ("megagrpo/fileio.py", "os.open"): "the one mechanism",
    ("megagrpo/preflight/phases.py", "Path.write_text/bytes"): "/proc/self/clear_refs",
    ("megagrpo/testing.py", "Path.write_text/bytes"): "test fixtures in the test's tmp_path",
    ("megagrpo/testing.py", "library writing to a path"): "test fixtures in the test's tmp_path",
    ("megagrpo/rollout/lora.py", "library writing to a path"): "via fileio.library_write",
    ("megagrpo/model/pretrained.py", "library writing to a path"): "inside fileio.atomic_dir",
    ("megagrpo/model/peft_export.py", "library writing to a path"): "fileio.library_write",
    ("megagrpo/model/megatron_ckpt.py", "library writing to a path"): "inside fresh_tmp_dir",
    ("megagrpo/commands/export.py", "library writing to a path"): "fileio.library_write",
    ("megagrpo/commands/preflight.py", "library writing to a path"): "inside its own mkdtemp",
    # tools/: benchmarks build their inputs in a TemporaryDirectory of their own
    ("tools/bench_convert.py", "library writing to a path"): _OWN_TMP,
    ("tools/bench_fingerprint.py", "open for writing"): _OWN_TMP,
    ("tools/bench_train_memory.py", "library writing to a path"): _OWN_TMP,
    ("tools/upstream_wheels.py", "library writing to a path"): "zipfile into its own mkdtemp",
    ("tools/bench_recompute.py", "Path.write_text/bytes"): "/proc/self/clear_refs",
}
REPO = PACKAGE.parent
# Shell scripts: `>` only under `set -o noclobber` (an existing file, a link to one or a
# second hard link is never truncated: the script removes its own old file by name first);
# no `>|`, no appending `>>`, tee, cp, mv or touch (a Python line through fileio instead).
_SH_TRUNCATE = re.compile(r"(?<![<>&\d])>(?![>&|])\s*(?!/dev/null\b)\S")
_SH_OTHER = re.compile(
    r"(?<![<>&\d])>>(?!&)\s*(?!/dev/null\b)|>\||(?:^|[;&|(]|\bthen|\bdo)\s*(?:tee|cp|mv|touch)\s"
)
_NOCLOBBER = re.compile(r"^\s*set\s.*(?:\s-[a-zA-Z]*C\b|-o\s+noclobber)", re.MULTILINE)
_HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")


def _python_line(rel: str, num: int, line: str) -> list[str]:
    code = line.split("#", 1)[0]
    if code.lstrip().startswith(('"', "'")) or "``" in code:
        return []  # docstrings
    return [
        f"{rel}:{num}: {what}: {line.strip()}"
        for what, rx in _WRITERS.items()
        if rx.search(code) and (rel, what) not in _ALLOWED
    ]


def _python_writers(path: Path, rel: str) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [hit for num, line in enumerate(lines, start=1) for hit in _python_line(rel, num, line)]


def _shell_writers(path: Path, rel: str) -> list[str]:
    text = path.read_text(encoding="utf-8")
    found, heredoc = [], None
    for num, line in enumerate(text.splitlines(), start=1):
        if heredoc is not None:  # Python fed on stdin: its own lines are checked as Python
            heredoc = None if line.strip() == heredoc else heredoc
            found += _python_line(rel, num, line)
            continue
        code = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
        m = _HEREDOC.search(code)
        heredoc = m.group(1) if m else None
        if _SH_OTHER.search(code):
            found.append(f"{rel}:{num}: appends, copies or moves: {line.strip()}")
        elif _SH_TRUNCATE.search(code) and not _NOCLOBBER.search(text):
            found.append(f"{rel}:{num}: `>` without set -o noclobber: {line.strip()}")
    return found


def _sources() -> list[Path]:
    return [
        *sorted(PACKAGE.rglob("*.py")),
        *sorted((REPO / "tools").rglob("*.py")),
        *sorted((REPO / "scripts").rglob("*.py")),
        *sorted((REPO / "tools").rglob("*.sh")),
        *sorted((REPO / "scripts").rglob("*.sh")),
    ]


def test_every_writer_goes_through_fileio():
    """The package, tools/ and scripts/ (red team 4, N1: tools/upstream_wheels.py opened its
    cache lock following links, outside this audit)."""
    found = []
    for path in _sources():
        rel = path.relative_to(REPO).as_posix()
        check = _shell_writers if path.suffix == ".sh" else _python_writers
        found += check(path, rel)
    assert not found, "write through megagrpo.fileio (open_fd / write_text / ...):\n" + "\n".join(
        found
    )
