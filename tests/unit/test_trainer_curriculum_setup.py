"""The trainer's curriculum set-up from a levels file: k read from the file, level filter
applied, pre-flight advice names a working level filter."""

from __future__ import annotations

import json
import logging

from megagrpo.config import load_config
from megagrpo.trainer.config import RunConfig
from megagrpo.trainer.setup import _curriculum
from megagrpo.types import Problem


def test_levels_file_with_k3_filters_and_preflight_advises(tmp_path, caplog):
    # k=3 profile: levels 1..4; 30 problems, most at the extremes (as in the article)
    correct = [3] * 12 + [2] * 3 + [1] * 3 + [0] * 12
    problems = [
        Problem(id=f"p{i}", messages=[{"role": "user", "content": "q"}], answer=["a"])
        for i in range(len(correct))
    ]
    path = tmp_path / "levels.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "k": 3, "correct": c}) + "\n" for i, c in enumerate(correct)
        ),
        encoding="utf-8",
    )
    cfg = load_config(
        RunConfig,
        [],
        [
            f"curriculum.levels_file={path}",
            "curriculum.keep_levels=[1,2,3,4]",
            "dynamic.max_resample=1",
            "trainer.batch_groups=8",
            "rollout.group_size=8",
        ],
    )
    with caplog.at_level(logging.WARNING):
        sampler, acr = _curriculum(cfg, problems, "mcq_accuracy")
    assert 0.5 < acr < 1.0  # 80% of problems at the extremes: most groups collapse
    assert sampler.k == 3
    assert "L2-L3" in caplog.text  # advice names the middle-levels filter

    cfg2 = load_config(
        RunConfig, [], [f"curriculum.levels_file={path}", "curriculum.keep_levels=[2,3]"]
    )
    sampler2, acr2 = _curriculum(cfg2, problems, "mcq_accuracy")
    drawn = {p.id for p in sampler2.next_problems(6)}
    assert drawn <= {f"p{i}" for i in range(12, 18)}  # only levels 2-3 are served
    assert acr2 < acr
