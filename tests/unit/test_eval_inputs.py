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


NAMES = ["../../victim", "a/b", "..", "", "x\\y", "\u202eevil", "-rf"]  # (more: name_problem)


@pytest.mark.parametrize("name", NAMES)
def test_a_name_that_leaves_out_is_refused_before_the_engine(
    tmp_path, tiny_dense_dir, no_engine, capsys, name
):
    """Red team 3, L4: ``--name ../../victim`` wrote OUT/2022/../../victim.jsonl. Red team
    4, N18: a bidi override (``ls`` shows another name), a newline (splits log lines) and a
    leading ``-`` (an option to ``rm OUT/*``) were accepted (the rule, ``name_problem``, is
    shared with ``trainer.name``: tests/unit/test_config_redteam4.py)."""
    cfg = write_run_config(tmp_path / "c.yaml", tiny_run_config(tiny_dense_dir, tmp_path, "e"))
    exam = _gold(tmp_path / "2018" / "112-A.jsonl", [ROW])
    out = tmp_path / "out"
    argv = ["eval", str(cfg), "--data", str(exam), "--out", str(out), f"--name={name}"]
    assert main(argv) == 2
    assert f"--name {name!r} " in capsys.readouterr().err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["2018", "c.yaml"]


def test_write_predictions_keeps_every_file_inside_out(tmp_path):
    """The writer itself refuses a climbing name (a caller other than ``run``)."""
    from megagrpo.commands.eval import write_predictions
    from megagrpo.errors import ConfigError
    from megagrpo.rewards.igakuqa import read_gold

    exam = _gold(tmp_path / "2018" / "112-A.jsonl", [ROW])
    gold = read_gold([exam])
    with pytest.raises(ConfigError, match="--name"):
        write_predictions(tmp_path / "out", gold, {"112A1": ("a", "")}, "../../v")
    assert not (tmp_path / "out").exists() and not (tmp_path / "v.jsonl").exists()
    (ok,) = write_predictions(tmp_path / "out", gold, {"112A1": ("a", "")}, "m")
    assert ok.resolve().is_relative_to((tmp_path / "out").resolve())
