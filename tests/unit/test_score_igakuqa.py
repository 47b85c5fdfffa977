"""`megagrpo score` against the official IgakuQA rule, re-implemented here independently
(the official script's way: zip the gold file and the model's prediction file line by line)."""

from __future__ import annotations

import json

import pytest

from megagrpo.cli import main
from megagrpo.errors import DataError
from megagrpo.rewards.igakuqa import find_files, official_correct, read_gold

MODELS = ["gpt4", "chatgpt", "gpt3", "student-majority", "translate_chatgpt-en"]
YEARS = ["2018", "2019", "2020"]


def official(gold_file, pred_file) -> tuple[int, int, int, int]:
    """(correct, count, score, total) exactly as jungokasai/IgakuQA scripts/evaluate_main.py."""
    golds = [json.loads(x) for x in gold_file.read_text(encoding="utf-8").splitlines()]
    preds = [json.loads(x) for x in pred_file.read_text(encoding="utf-8").splitlines()]
    assert len(golds) == len(preds)
    correct = count = score = total = 0
    for pred, ans in zip(preds, golds):
        assert pred["problem_id"] == ans["problem_id"]
        prediction = sorted(pred["prediction"].split(","))
        points = int(ans["points"])
        if (
            ans["problem_id"] == "116A71"
            or (ans["problem_id"] == "112B30" and prediction in (["a"], ["d"]))
            or (prediction == sorted(ans["answer"]))
        ):
            correct += 1
            score += points
        count += 1
        total += points
    return correct, count, score, total


def run_json(capsys, *argv) -> dict:
    assert main(["score", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model", MODELS)
def test_baselines_match_official_rule_per_year(igakuqa_dir, capsys, model):
    base = igakuqa_dir / "baseline_results"
    out = run_json(
        capsys,
        "--gold",
        str(igakuqa_dir),
        "--predictions",
        str(base),
        "--predictions-glob",
        f"*-?_{model}.jsonl",
    )
    sums = [0, 0, 0, 0]
    for year in YEARS:
        ref = [0, 0, 0, 0]
        for gold_file in sorted((igakuqa_dir / year).glob("*-?.jsonl")):
            pred_file = base / year / f"{gold_file.stem}_{model}.jsonl"
            ref = [a + b for a, b in zip(ref, official(gold_file, pred_file))]
        got = out["by_year"][year]
        assert (got["correct"], got["total"], got["score"], got["points_total"]) == tuple(ref)
        assert got["accuracy"] == pytest.approx(ref[0] / ref[1], abs=1e-12)
        sums = [a + b for a, b in zip(sums, ref)]
    assert (out["correct"], out["total"], out["score"], out["points_total"]) == tuple(sums)
    assert out["total"] == 1200 and out["missing"] == [] and out["extra"] == []


def test_text_output_and_single_files(igakuqa_dir, capsys):
    gold = igakuqa_dir / "2018" / "112-B.jsonl"
    pred = igakuqa_dir / "baseline_results" / "2018" / "112-B_gpt4.jsonl"
    ref = official(gold, pred)
    assert main(["score", "--gold", str(gold), "--predictions", str(pred)]) == 0
    text = capsys.readouterr().out
    row = next(line.split() for line in text.splitlines() if line.startswith("2018"))
    assert [int(row[1]), int(row[2]), int(row[4]), int(row[5])] == list(ref)
    assert "missing predictions: 0" in text


def test_missing_predictions_counted_wrong_and_reported(igakuqa_dir, tmp_path, capsys):
    gold = igakuqa_dir / "2019" / "113-A.jsonl"
    lines = (
        (igakuqa_dir / "baseline_results" / "2019" / "113-A_student-majority.jsonl")
        .read_text(encoding="utf-8")
        .splitlines()
    )
    dropped = [json.loads(x)["problem_id"] for x in lines[:5]]
    (tmp_path / "preds.jsonl").write_text("\n".join(lines[5:]) + "\n", encoding="utf-8")
    full = official(
        gold, igakuqa_dir / "baseline_results" / "2019" / "113-A_student-majority.jsonl"
    )
    out = run_json(capsys, "--gold", str(gold), "--predictions", str(tmp_path))
    assert out["missing"] == dropped and out["num_missing"] == 5
    assert out["total"] == full[1]  # still every gold question
    golds = {json.loads(x)["problem_id"]: json.loads(x) for x in gold.read_text().splitlines()}
    lost = sum(
        official_correct(p, json.loads(x)["prediction"], golds[p]["answer"])
        for p, x in zip(dropped, lines[:5])
    )
    assert out["correct"] == full[0] - lost


def test_special_cases_and_no_stripping(tmp_path, capsys):
    year = tmp_path / "2022"
    year.mkdir()
    gold = [
        {"problem_id": "116A71", "answer": ["b"], "points": "1"},
        {"problem_id": "112B30", "answer": ["a or d"], "points": "3"},
        {"problem_id": "116A2", "answer": ["c", "d"], "points": "1"},
        {"problem_id": "116A3", "answer": ["c", "d"], "points": "1"},
        {"problem_id": "116A4", "answer": ["e"], "points": "0"},
    ]
    (year / "116-A.jsonl").write_text("\n".join(json.dumps(g) for g in gold))
    (year / "116-A_metadata.jsonl").write_text('{"problem_id": "zzz"}\n')  # skipped sibling
    preds = [
        ("116A71", "e"),
        ("112B30", "d"),
        ("116A2", "d,c"),
        ("116A3", "c, d"),
        ("116A4", "e"),
        ("999X1", "a"),
    ]
    (tmp_path / "p.jsonl").write_text(
        "\n".join(json.dumps({"problem_id": p, "prediction": x}) for p, x in preds)
    )
    out = run_json(capsys, "--gold", str(tmp_path), "--predictions", str(tmp_path / "p.jsonl"))
    # 116A71 always, 112B30 'd', 'd,c' order-free; 'c, d' has a space: wrong; 0-point correct
    assert (out["correct"], out["total"], out["score"], out["points_total"]) == (
        4,
        5,
        5,
        6,
    )  # points 1+3+1+0
    assert out["extra"] == ["999X1"] and out["by_year"]["2022"]["correct"] == 4
    assert not official_correct("112B30", "a,d", ["a or d"])


def test_bad_input_names_file_and_line(tmp_path, capsys):
    (tmp_path / "112-A.jsonl").write_text(
        '{"problem_id": "1", "answer": ["a"], "points": "1"}\n{oops\n'
    )
    with pytest.raises(DataError, match=r"112-A.jsonl:2"):
        read_gold(find_files([tmp_path], gold=True))
    (tmp_path / "112-A.jsonl").write_text('{"problem_id": "1", "answer": ["a"], "points": "1"}\n')
    both = tmp_path / "preds"
    both.mkdir()
    for name in ("112-A_x.jsonl", "112-A_y.jsonl"):
        (both / name).write_text('{"problem_id": "1", "prediction": "a"}\n')
    assert main(["score", "--gold", str(tmp_path / "112-A.jsonl"), "--predictions", str(both)]) == 2
    assert "second prediction for 1" in capsys.readouterr().err
    assert (
        main(
            [
                "score",
                "--gold",
                str(tmp_path / "112-A.jsonl"),
                "--predictions",
                str(both),
                "--predictions-glob",
                "*_y.jsonl",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["correct"] == 1
    with pytest.raises(DataError, match="no such file"):
        find_files([tmp_path / "nope"], gold=True)
