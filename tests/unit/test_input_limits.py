"""Inputs at their limits end in a named error, never a traceback (red team 3: M9, M10, L5,
L8, L9): JSON nested 100,000 deep or an integer of 5,001 digits in any JSONL reader, malformed
metrics rows and an existing ``--out`` file for ``report``, an exam of 0 questions for
``score``, a 2 MB prompt (measured by its characters, never tokenised whole), and an ms-swift
gold letter outside the row's ``choices``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megagrpo.cli import main
from megagrpo.data import load_problems
from megagrpo.errors import DataError

DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "9" * 5001


def _swift_row(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Which? a. x b. y"}], "solution": "a", **extra}


@pytest.mark.parametrize(
    "line, why",
    [
        (DEEP, "nested too deeply"),
        ('{"messages": ' + DEEP + "}", "nested too deeply"),
        (
            '{"messages": [{"role": "user", "content": "q"}], "solution": "a", "points": '
            + HUGE_INT
            + "}",
            "4300 digits",
        ),
    ],
)
def test_data_train_deep_nesting_and_huge_integers_name_file_and_line(tmp_path, line, why):
    """M9: ``data.train`` (every reader goes through data.loader.read_jsonl)."""
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(_swift_row()) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"train\.jsonl:2: .*{why}"):
        load_problems([path])


def test_score_predictions_deep_nesting_and_huge_integers_exit_2(tmp_path, capsys):
    """M9 through ``megagrpo score --predictions``."""
    gold = tmp_path / "116-A.jsonl"
    gold.write_text(
        json.dumps({"problem_id": "116A1", "answer": ["a"], "points": 1, "choices": ["x", "y"]})
        + "\n",
        encoding="utf-8",
    )
    for body in (DEEP, '{"problem_id": "116A1", "prediction": "a", "n": ' + HUGE_INT + "}"):
        preds = tmp_path / "p.jsonl"
        preds.write_text(body + "\n", encoding="utf-8")
        assert main(["score", "--gold", str(gold), "--predictions", str(preds)]) == 2
        assert "p.jsonl:1:" in capsys.readouterr().err


def test_score_on_an_exam_of_no_questions_exits_2(tmp_path, capsys):
    """L5: an empty gold file is not a score of 0 of 0."""
    gold = tmp_path / "116-A.jsonl"
    gold.write_text("", encoding="utf-8")
    preds = tmp_path / "p.jsonl"
    preds.write_text('{"problem_id": "116A1", "prediction": "a"}\n', encoding="utf-8")
    assert main(["score", "--gold", str(gold), "--predictions", str(preds)]) == 2
    assert "no questions in" in capsys.readouterr().err


def test_swift_rows_with_choices_refuse_a_gold_outside_them(tmp_path):
    """L9: as IgakuQA files (data/gold.py's check): ``z`` of choices a-c is unsolvable."""
    path = tmp_path / "train.jsonl"
    rows = [_swift_row(choices=["x", "y", "z"]), _swift_row(choices=["x", "y", "z"], solution="z")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(DataError, match=r"train\.jsonl:2: .*letter 'z' is not one of the 3"):
        load_problems([path])
    path.write_text(json.dumps(rows[0]) + "\n", encoding="utf-8")
    assert load_problems([path])[0].answer == ["a"]


# ------------------------------------------------------------------------------ report


def _run_dir(tmp_path: Path, rows: list[str]) -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    good = json.dumps({"step": 1, "reward/mean": 0.5, "collapse/acr_raw": 0.2})
    (run / "metrics.jsonl").write_text("\n".join([good, *rows]) + "\n", encoding="utf-8")
    return run


@pytest.mark.parametrize(
    "row, why",
    [
        ("[1, 2, 3]", "must be a JSON object"),
        ('{"step": "two", "reward/mean": 0.1}', "'step' must be an integer"),
        ('{"step": 2, "reward/mean": "high"}', "'reward/mean' must be a number"),
        ('{"step": 2, "x": ' + DEEP + "}", "nested too deeply"),
    ],
)
def test_report_names_the_line_of_a_malformed_row(tmp_path, capsys, row, why):
    """M10: exit 2 naming metrics.jsonl:LINE, not AttributeError / TypeError."""
    run = _run_dir(tmp_path, [row, '{"step": 3, "reward/mean": 0.7}'])
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl:2:" in err and why in err, err


def test_report_out_an_existing_file_exits_2_and_keeps_it(tmp_path, capsys):
    """M10: ``--out`` naming a file: refused, the file untouched."""
    run = _run_dir(tmp_path, [])
    out = tmp_path / "notes.txt"
    out.write_text("mine\n")
    assert main(["report", str(run), "--out", str(out)]) == 2
    assert "--out" in capsys.readouterr().err and out.read_text() == "mine\n"


# ------------------------------------------------------------------------------ prompt size


class CountingTokenizer:
    """A tokenizer that records the length of every text it tokenises."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self.longest = 0

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, text, *args, **kwargs):
        self.longest = max(self.longest, len(text))
        return self._tok(text, *args, **kwargs)


def _fit(tmp_path, bigram_dir, policy: str, text: str):
    from transformers import AutoTokenizer

    from megagrpo.config import load_config
    from megagrpo.testing import tiny_run_config, write_run_config
    from megagrpo.trainer.config import RunConfig
    from megagrpo.trainer.setup import fit_prompts

    data = tmp_path / "train.jsonl"
    rows = [
        {"id": "short", "messages": [{"role": "user", "content": "2+2?"}], "solution": "4"},
        {"id": "huge", "messages": [{"role": "user", "content": text}], "solution": "4"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cfg = tiny_run_config(bigram_dir, tmp_path, "x", data={"train": [str(data)]})
    cfg["data"]["truncation"] = policy
    run = load_config(RunConfig, [write_run_config(tmp_path / "c.yaml", cfg)])
    tok = CountingTokenizer(AutoTokenizer.from_pretrained(bigram_dir))
    return fit_prompts(load_problems([data]), tok, run, "data.train"), tok


def test_a_huge_prompt_is_dropped_without_tokenising_it(tmp_path, bigram_dir):
    """L8: a 2 MB prompt is measured by its characters; the tokenizer never sees it (it cost
    8.8 GB and 140 s at 40 MB)."""
    text = "the long river flows through the old city " * 50_000  # 2.1 MB
    result, tok = _fit(tmp_path, bigram_dir, "delete", text)
    assert result.dropped == ["huge"] and [p.id for p in result.problems] == ["short"]
    assert result.metrics()["data/prompts_dropped"] == 1.0
    assert tok.longest < 100_000, tok.longest


def test_left_truncation_of_a_huge_prompt_tokenises_only_its_tail(tmp_path, bigram_dir):
    text = " ".join(f"word{i}" for i in range(300_000))  # 2.3 MB
    result, tok = _fit(tmp_path, bigram_dir, "left", text)
    assert tok.longest < 200_000, tok.longest
    huge = next(p for p in result.problems if p.id == "huge")
    kept = huge.meta["prompt_ids"]
    assert len(kept) == 250  # rollout.max_model_len 256 - rollout.max_tokens 6
    rendered = tok.apply_chat_template(huge.messages, add_generation_prompt=True, tokenize=False)
    tail = tok(rendered[-20_000:], add_special_tokens=False)["input_ids"]
    assert kept == tail[-250:]  # the same tokens as tokenising the end on its own
