"""Held-out problems that are also training problems are named with their count."""

from __future__ import annotations

import logging

from megagrpo.data import load_problems
from megagrpo.testing import DEMO_EVAL
from megagrpo.trainer.setup import warn_overlap

DEMO_TRAIN = DEMO_EVAL.with_name("demo_train.jsonl")


def test_the_same_file_as_train_and_eval_is_warned_with_the_count(caplog):
    train = list(load_problems([DEMO_TRAIN]))
    held_out = list(load_problems([DEMO_EVAL]))
    with caplog.at_level(logging.WARNING, logger="megagrpo.trainer.setup"):
        assert warn_overlap(train, held_out) == 0
        assert caplog.text == ""
        assert warn_overlap(train, train[:5]) == 5
    assert f"5 of 5 held-out problems are also in data.train (e.g. {train[0].id}" in caplog.text
    renamed = [type(p)(f"other-{p.id}", p.messages, p.answer, p.meta) for p in train[:3]]
    assert warn_overlap(train, renamed + held_out) == 3  # the same prompts under other ids
