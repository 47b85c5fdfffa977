"""Atomic writes (megagrpo.fileio): the target holds the old or the new content, never a mix."""

from __future__ import annotations

import os

import pytest

from megagrpo import fileio


def test_write_text_replaces_and_leaves_no_tmp(tmp_path):
    target = tmp_path / "sub" / "config.yaml"
    fileio.write_text(target, "a: 1\n")
    fileio.write_text(target, "a: 2\n")
    assert target.read_text() == "a: 2\n"
    assert [p.name for p in target.parent.iterdir()] == ["config.yaml"]


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "metrics.jsonl"
    fileio.write_text(target, "old\n")

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="No space"):
        fileio.write_text(target, "new\n")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_atomic_dir_commits_on_success_and_keeps_old_on_error(tmp_path):
    out = tmp_path / "adapter"
    with fileio.atomic_dir(out) as tmp:
        (tmp / "w.bin").write_bytes(b"1")
        assert not out.exists() and fileio.is_tmp(tmp)
    assert (out / "w.bin").read_bytes() == b"1"
    with pytest.raises(RuntimeError), fileio.atomic_dir(out) as tmp:
        (tmp / "w.bin").write_bytes(b"2")
        raise RuntimeError("export failed")
    assert (out / "w.bin").read_bytes() == b"1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_tmp_names_are_recognised():
    assert fileio.is_tmp(fileio.tmp_sibling("/x/step_000010"))
    assert fileio.is_tmp(fileio.tmp_sibling("/x/step_000010", unique=True))
    assert not fileio.is_tmp("/x/step_000010") and not fileio.is_tmp("/x/.hidden")
