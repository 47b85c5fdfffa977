"""`megagrpo eval` checks its inputs before it builds an engine: an exam file without
questions and a corrupt adapter_config.json are named (exit 2), not raw tracebacks."""

from __future__ import annotations

import json

import pytest

from megagrpo.cli import main
from megagrpo.testing import tiny_run_config, write_run_config


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the engine was built before the inputs were checked")

    monkeypatch.setattr("megagrpo.rollout.build_engine", refuse)


def _gold(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


ROW = {
    "problem_id": "112A1",
    "problem_text": "q",
    "choices": list("vwxyz"),
    "answer": ["a"],
    "points": "1",
}


def test_an_exam_without_questions_is_named(tmp_path, tiny_dense_dir, no_engine, capsys):
    cfg = write_run_config(tmp_path / "c.yaml", tiny_run_config(tiny_dense_dir, tmp_path, "e"))
    exam = _gold(tmp_path / "2018" / "112-A.jsonl", [])
    assert main(["eval", str(cfg), "--data", str(exam)]) == 2
    assert f"--data: no questions in {exam}" in capsys.readouterr().err


def test_a_bad_gold_or_adapter_config_is_named_before_the_engine(
    tmp_path, tiny_dense_dir, no_engine, capsys
):
    cfg = write_run_config(tmp_path / "c.yaml", tiny_run_config(tiny_dense_dir, tmp_path, "e"))
    bad = _gold(
        tmp_path / "2018" / "112-B.jsonl", [ROW, {**ROW, "problem_id": "112B2", "answer": ["q"]}]
    )
    assert main(["eval", str(cfg), "--data", str(bad)]) == 2
    assert "112-B.jsonl:2" in capsys.readouterr().err
    exam = _gold(tmp_path / "2018" / "112-A.jsonl", [ROW])
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{not json")
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    assert main(["eval", str(cfg), "--data", str(exam), "--adapter", str(adapter)]) == 2
    err = capsys.readouterr().err
    assert f"{adapter / 'adapter_config.json'}: unreadable" in err
