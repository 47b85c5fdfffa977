"""A levels file is checked against itself (integer k and correct, one k) and against the
training problems it claims to describe."""

from __future__ import annotations

import json
import logging

import pytest

from megagrpo.curriculum.levels import read_levels_file
from megagrpo.data import load_problems
from megagrpo.errors import ConfigError, DataError
from megagrpo.testing import DEMO_EVAL
from megagrpo.trainer.setup import matching_levels

DEMO_TRAIN = DEMO_EVAL.with_name("demo_train.jsonl")


@pytest.mark.parametrize(
    "second,match",
    [
        ({"k": "abc"}, "'k' must be an integer"),
        ({"k": None}, "'k' must be an integer"),
        ({"k": 5.5}, "'k' must be an integer"),
        ({"k": 0, "correct": 0}, "k=0 must be >= 1"),
        ({"correct": True}, "'correct' must be an integer"),
        ({"k": 4}, "k=4, but line"),
    ],
)
def test_bad_levels_records_name_file_and_line(tmp_path, second, match):
    path = tmp_path / "levels.jsonl"
    rows = [{"id": "a", "k": 5, "correct": 2}, {"id": "b", "k": 5, "correct": 1, **second}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=rf"levels.jsonl:2: .*{match}"):
        read_levels_file(path)


def test_a_levels_file_of_other_problems_is_refused_and_a_partial_one_warned(caplog):
    problems = list(load_problems([DEMO_TRAIN]))
    n = len(problems)
    foreign = {f"other{i}": 1 + i % 6 for i in range(n)}
    with pytest.raises(ConfigError, match=f"levels for 0 of the {n} training problems"):
        matching_levels(foreign, problems, "lv.jsonl")
    few = {p.id: 2 for p in problems[:5]}
    with pytest.raises(ConfigError, match=f"levels for 5 of the {n}"):
        matching_levels({**foreign, **few}, problems, "lv.jsonl")
    most = {p.id: 3 for p in problems[: n - 2]}
    with caplog.at_level(logging.WARNING, logger="megagrpo.trainer.setup"):
        kept = matching_levels({**foreign, **most}, problems, "lv.jsonl")
    assert kept == most  # the predicted ACR comes from these only
    assert f"2 of {n} training problems have no level" in caplog.text
