"""Bad bytes and wrong JSON types in data, levels and prediction files name file, line and key
(issue 14.9; red-team rows 26, 28, 66). Before the fix each case below raised a bare
``UnicodeDecodeError`` / ``TypeError`` / ``ValueError`` naming neither the file nor the line."""

from __future__ import annotations

import json

import pytest

from megagrpo.cli import main
from megagrpo.curriculum.levels import read_levels_file
from megagrpo.data import load_problems
from megagrpo.errors import DataError

GOOD = {"problem_id": "ok1", "problem_text": "q", "choices": ["x", "y"], "answer": ["a"]}
BAD_BYTES = b"\xff\xfe"


def _bad_line(prefix: bytes) -> tuple[bytes, int]:
    """A JSON line with invalid UTF-8 after ``prefix``, and the 1-based column Python's own
    decoder reports for it (the independent reference for the column in the message)."""
    line = prefix + BAD_BYTES + b'"}\n'
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return line, exc.start + 1
    raise AssertionError("line should not decode")


@pytest.mark.parametrize("num_good", [1, 3000])  # 3000 lines: the bad byte is past the first
def test_non_utf8_data_names_file_line_and_column(tmp_path, num_good):  # 8 KiB read chunk
    good = [dict(GOOD, problem_id=f"ok{i}") for i in range(num_good)]
    line, col = _bad_line('{"problem_id": "x1", "problem_text": "日本語 '.encode())
    f = tmp_path / "train.jsonl"
    f.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in good) + line)
    want = rf"train\.jsonl:{num_good + 1}: not UTF-8 \(byte 0xff at column {col}\)"
    with pytest.raises(DataError, match=want):
        load_problems([f])


def test_non_utf8_predictions_make_score_exit_2_naming_file_and_line(tmp_path, capsys):
    gold = tmp_path / "112-A.jsonl"
    gold.write_text('{"problem_id": "112A1", "answer": ["a"], "points": "1"}\n', encoding="utf-8")
    preds = tmp_path / "112-A_model.jsonl"
    line, col = _bad_line(b'{"problem_id": "112A1", "prediction": "a')
    preds.write_bytes(line)
    assert main(["score", "--gold", str(gold), "--predictions", str(preds)]) == 2
    err = capsys.readouterr().err
    assert f"112-A_model.jsonl:1: not UTF-8 (byte 0xff at column {col})" in err


def test_non_utf8_levels_file_names_file_and_line(tmp_path):
    f = tmp_path / "levels.jsonl"
    line, col = _bad_line(b'{"id": "a", "k": 5, "correct": 2, "note": "')
    f.write_bytes(b'{"id": "b", "k": 5, "correct": 1}\n' + line)
    with pytest.raises(DataError, match=rf"levels\.jsonl:2: not UTF-8 .*column {col}"):
        read_levels_file(f)


WRONG_TYPES = [
    # (record, message the DataError must contain)
    (dict(GOOD, problem_id="x1", answer=3), "'answer' must be a list of option letters, got int"),
    (dict(GOOD, problem_id="x1", choices=5), "'choices' must be a list of option texts, got int"),
    (dict(GOOD, problem_id="x1", points="two"), "'points' must be an integer, got 'two'"),
    ({"messages": 5, "solution": "a"}, "'messages' must be a list of {role, content} objects"),
    (
        {"messages": [{"role": "user", "content": "q"}], "solution": "a", "points": "two"},
        "'points' must be an integer, got 'two'",
    ),
    (
        {"messages": [{"role": "user", "content": "q"}], "solution": {"x": 1}},
        "'solution' must be a string",
    ),
    (
        {"messages": [{"role": "user", "content": "q"}], "solution": "a", "points": [1]},
        "'points' must be an integer, got [1]",
    ),
]


@pytest.mark.parametrize(("rec", "message"), WRONG_TYPES)
def test_wrong_json_type_names_file_line_and_key(tmp_path, rec, message):
    f = tmp_path / "data.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + json.dumps(rec) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        load_problems([f])
    assert str(err.value).startswith(f"{f}:2: ") and message in str(err.value)


def test_non_numeric_human_accuracy_names_the_metadata_file_and_line(tmp_path):
    f = tmp_path / "112-A.jsonl"
    f.write_text(json.dumps(dict(GOOD, problem_id="112A1")) + "\n", encoding="utf-8")
    meta = tmp_path / "112-A_metadata.jsonl"
    meta.write_text(
        '{"problem_id": "112A0", "human_accuracy": "50.5"}\n'
        '{"problem_id": "112A1", "human_accuracy": "n/a"}\n',
        encoding="utf-8",
    )
    with pytest.raises(DataError, match=r"112-A_metadata\.jsonl:2: 'human_accuracy' must be a"):
        load_problems([f])


def test_types_the_formats_accept_still_load(tmp_path):
    # What real files hold: IgakuQA points as strings ("3"), empty human_accuracy, numeric
    # answers as digit strings; ms-swift solutions as a string, a list or a bare number.
    f = tmp_path / "112-C.jsonl"
    rows = [
        dict(GOOD, problem_id="112C1", points="3"),
        dict(GOOD, problem_id="112C2", choices=[], answer=["26"], points=1),
        {"id": "s1", "messages": [{"role": "user", "content": "q"}], "solution": 3},
        {"id": "s2", "messages": [{"role": "user", "content": "q"}], "solution": ["B", "c"]},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tmp_path / "112-C_metadata.jsonl").write_text(
        '{"problem_id": "112C1", "human_accuracy": ""}\n', encoding="utf-8"
    )
    probs = {p.id: p for p in load_problems([f])}
    assert probs["112C1"].meta["points"] == 3 and probs["112C1"].meta["human_accuracy"] is None
    assert probs["112C2"].answer == ["26"] and probs["s1"].answer == ["3"]
    assert probs["s2"].answer == ["b", "c"]
