"""Metric loggers, the metric-name contract, and `megagrpo report`."""

from __future__ import annotations

import json
import re

import pytest

from megagrpo.metrics import (
    CORE_METRICS,
    JsonlLogger,
    NullLogger,
    build_logger,
    missing_metrics,
    read_metrics,
    required_metrics,
)
from megagrpo.metrics.config import MetricsConfig
from megagrpo.metrics.logger import ConsoleLogger
from megagrpo.metrics.report import make_report


def _design_metric_names(design_text: str) -> set[str]:
    """Names listed in DESIGN.md's "Metric names" section, `{1..6}` expanded."""
    section = design_text.split("## Metric names", 1)[1].split("\n## ", 1)[0]
    names = set()
    for tok in re.findall(r"`([^`]+)`", section):
        m = re.fullmatch(r"(.*)\{1\.\.6\}(.*)", tok)
        if m:
            names.update(f"{m.group(1)}{k}{m.group(2)}" for k in range(1, 7))
        else:
            names.add(tok)
    return names


def test_core_metrics_are_exactly_the_design_list(repo_root):
    design = repo_root.parent / "shared" / "DESIGN.md"
    if not design.is_file():
        pytest.skip("../shared/DESIGN.md not present")
    expected = _design_metric_names(design.read_text(encoding="utf-8"))
    assert "reward/<fn>/mean" in expected
    expected.discard("reward/<fn>/mean")
    assert set(CORE_METRICS) == expected
    assert set(required_metrics(["mcq_accuracy"])) == expected | {"reward/mcq_accuracy/mean"}


def test_jsonl_rows_truncate_and_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lg = JsonlLogger(path)
    for step in range(1, 5):
        lg.log(
            step,
            {
                "reward/mean": step / 10,
                "collapse/acr_raw": None,
                "loss/kl": float("nan"),
                "dynamic/success": True,
            },
        )
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[1]["reward/mean"] == pytest.approx(0.2)
    assert rows[0]["collapse/acr_raw"] is None and rows[0]["loss/kl"] is None  # NaN -> null
    assert rows[0]["dynamic/success"] == 1
    assert lg.truncate_after(2) == 2  # a resumed run rewrites steps 3, 4
    lg.log(3, {"reward/mean": 0.9})
    lg.close()
    with open(path, "a", encoding="utf-8") as fh:
        fh.write('{"step": 4, "rew')  # killed mid-write
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["reward/mean"] == 0.9
    assert missing_metrics(rows[0], ["mcq_accuracy"])  # a partial row is reported as such


def test_build_logger_rank0_writes_jsonl_and_offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = MetricsConfig(progress_bar=False)
    assert isinstance(build_logger(cfg, tmp_path, rank=1, name="x", total_steps=2), NullLogger)
    lg = build_logger(cfg, tmp_path, rank=0, name="x", total_steps=2, config={"a": 1})
    lg.log(1, {"reward/mean": 0.5})
    lg.close()
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["reward/mean"] == 0.5
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, "real wandb offline run directory expected"
    assert list(runs[0].glob("*.wandb")), "offline run holds its .wandb data file"


def test_console_summary_formats_key_figures():
    s = ConsoleLogger.summary(
        {"reward/mean": 0.4567, "collapse/acr_raw": 0.25, "perf/tokens_per_s": 123.4}
    )
    assert s == {"reward": "0.457", "acr_raw": "0.25", "tok/s": "123"}
    assert ConsoleLogger.summary({})["reward"] == "-"


def test_report_draws_every_plot(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("dynamic:\n  max_resample: 3\n  policy: original\n")
    with open(run / "metrics.jsonl", "w", encoding="utf-8") as fh:
        for step in range(1, 7):
            row = {name: 0.1 * step for name in CORE_METRICS}
            row.update(
                {
                    "step": step,
                    "collapse/frac_reward_zero_std": 0.0,
                    "reward/mcq_accuracy/mean": 0.2,
                }
            )
            fh.write(json.dumps(row) + "\n")
    paths = make_report(run)
    assert sorted(p.name for p in paths) == [
        "collapse.png",
        "kl_entropy.png",
        "length.png",
        "levels.png",
        "reward.png",
        "time.png",
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    summary = json.loads((run / "report" / "summary.json").read_text())
    assert summary["steps"] == 6


def test_report_missing_metrics_is_a_clear_error(tmp_path):
    from megagrpo.errors import DataError

    with pytest.raises(DataError, match="metrics.jsonl"):
        make_report(tmp_path)
