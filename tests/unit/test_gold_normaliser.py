"""One gold normaliser for training (load_problems) and scoring (read_gold / `megagrpo
score`): string answers split on commas (ASCII or full-width), numbers kept whole, full-width
and upper-case letters made lower-case ASCII, letters outside the choices refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megagrpo.cli import main
from megagrpo.data import load_problems
from megagrpo.errors import DataError
from megagrpo.rewards import get
from megagrpo.rewards.igakuqa import read_gold

CHOICES = ["one", "two", "three", "four", "five"]
CASES = [  # (answer as written, choices, the gold)
    ("26", [], ["26"]),
    (["7.20"], [], ["7.20"]),
    ("b,c", CHOICES, ["b", "c"]),
    ("ｂ、ｃ", CHOICES, ["b", "c"]),
    ("Ｂ，Ｄ", CHOICES, ["b", "d"]),
    (["C"], CHOICES, ["c"]),
    (["ｃ"], CHOICES, ["c"]),
    (["a", "e"], CHOICES, ["a", "e"]),
    (["a or d"], CHOICES, ["a or d"]),
]


def _exam(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    return path


def _row(i: int, answer, choices) -> dict:
    return {
        "problem_id": f"112A{i + 1}",
        "problem_text": "問題" if choices else "数値を答えよ。",
        "choices": choices,
        "answer": answer,
        "points": "1",
    }


def test_training_and_scoring_read_the_same_gold(tmp_path):
    exam = _exam(tmp_path / "2018" / "112-A.jsonl", [_row(i, *c[:2]) for i, c in enumerate(CASES)])
    trained = {p.id: p.answer for p in load_problems([exam])}
    scored = {pid: item.answer for pid, item in read_gold([exam]).items()}
    expected = {f"112A{i + 1}": c[2] for i, c in enumerate(CASES)}
    assert trained == expected and scored == expected


def test_a_numeric_string_answer_is_one_number_and_scores(tmp_path):
    exam = _exam(tmp_path / "112-C.jsonl", [_row(65, "26", [])])
    (problem,) = load_problems([exam])
    reward = get("mcq_accuracy")
    assert reward(["答え: 26", "答え: 62"], problem) == [1.0, 0.0]


def test_score_accepts_upper_case_and_full_width_gold_letters(tmp_path, capsys):
    exam = _exam(
        tmp_path / "gold" / "2018" / "112-A.jsonl",
        [_row(0, ["C"], CHOICES), _row(1, ["ｃ", "Ｄ"], CHOICES)],
    )
    preds = tmp_path / "preds.jsonl"
    preds.write_text(
        json.dumps({"problem_id": "112A1", "prediction": "c"})
        + "\n"
        + json.dumps({"problem_id": "112A2", "prediction": "d,c"})
        + "\n"
    )
    assert (
        main(["score", "--gold", str(exam.parent.parent), "--predictions", str(preds), "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["correct"] == 2


@pytest.mark.parametrize(
    "answer,choices,match",
    [
        (["f"], CHOICES, "answer letter 'f' is not one of the 5 choices"),
        ("b,z", CHOICES, "answer letter 'z'"),
        (["b c"], CHOICES, "not option letters or a number"),
        (["、"], CHOICES, "empty answer"),
    ],
)
def test_an_answer_that_cannot_be_a_gold_is_refused_naming_file_and_line(
    tmp_path, answer, choices, match
):
    exam = _exam(tmp_path / "112-B.jsonl", [_row(0, ["a"], CHOICES), _row(1, answer, choices)])
    with pytest.raises(DataError, match=rf"112-B.jsonl:2: .*{match}"):
        load_problems([exam])
    with pytest.raises(DataError, match=rf"112-B.jsonl:2: .*{match}"):
        read_gold([exam])
