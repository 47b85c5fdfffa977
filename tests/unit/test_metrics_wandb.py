"""W&B start-up must never cost the training run: a bounded init, offline fallback (issue 14.10).

Real ``wandb`` (0.31) against a local TCP server that accepts connections and never answers,
i.e. a W&B host behind a dead network: before the fix ``wandb.init`` waited W&B's default 90 s,
retried with a new id for another 90 s, then raised ``CommError`` out of ``build_logger``.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import pytest

from megagrpo.errors import ConfigError
from megagrpo.metrics import build_logger, read_metrics
from megagrpo.metrics.config import MetricsConfig

FAKE_KEY = "abc123secret" + "0" * 28  # 40 characters, the length of a real W&B key


@pytest.fixture
def wandb_env(monkeypatch):
    """A fresh W&B service that reads the environment set by the test, torn down after."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    # W&B's own telemetry posts to the base URL at exit (10 s timeout on a dead server).
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    wandb.teardown()  # a service started by an earlier test keeps that test's settings
    yield wandb
    wandb.teardown()


def test_online_without_network_falls_back_to_offline_within_the_timeout(
    tmp_path, monkeypatch, caplog, wandb_env
):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)  # connections complete in the backlog; no byte is ever answered
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    cfg = MetricsConfig(wandb_mode="online", wandb_init_timeout_s=2.0, progress_bar=False)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="megagrpo.metrics.logger"):
        lg = build_logger(cfg, tmp_path, rank=0, name="x", total_steps=1)
    elapsed = time.monotonic() - t0
    lg.log(1, {"reward/mean": 0.25})
    lg.close()
    server.setblocking(False)
    conn, _ = server.accept()  # the online attempt really went to the dead server
    conn.close()
    server.close()
    # 2 s init timeout (+ W&B's 10 s grace at most) + ~1 s offline start, on a loaded machine;
    # far from the 2 x 90 s of W&B's default.
    assert elapsed < 30.0, elapsed
    assert "offline" in caplog.text and "wandb sync" in caplog.text
    assert FAKE_KEY not in caplog.text
    run_id = (tmp_path / "wandb_id").read_text().strip()  # same id: `wandb sync` resumes it
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert runs and list(runs[0].glob("*.wandb")), "offline run with its data file expected"
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["reward/mean"] == 0.25


def test_wandb_that_cannot_start_at_all_is_skipped_with_a_warning(tmp_path, caplog, wandb_env):
    # W&B rejects this project name in every mode: the run goes on with metrics.jsonl only.
    cfg = MetricsConfig(wandb_mode="offline", wandb_project="a/b", progress_bar=False)
    with caplog.at_level(logging.WARNING, logger="megagrpo.metrics.logger"):
        lg = build_logger(cfg, tmp_path, rank=0, name="x", total_steps=1)
    lg.log(1, {"reward/mean": 0.5})
    lg.close()
    assert "no W&B logging for this run" in caplog.text and "a/b" in caplog.text
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["reward/mean"] == 0.5


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_init_timeout_must_be_positive_and_finite(value):
    with pytest.raises(ConfigError, match=r"metrics\.wandb_init_timeout_s"):
        MetricsConfig(wandb_init_timeout_s=value).validate("metrics")


def test_train_turns_wandb_telemetry_off_unless_asked(monkeypatch):
    # W&B's telemetry posts to the W&B host at every exit, offline runs included: measured
    # 10.2 s per exit with the host unreachable (faulthandler: opentelemetry_proxy.py export).
    from megagrpo.commands.train import _env_defaults

    monkeypatch.delenv("WANDB_ERROR_REPORTING", raising=False)
    _env_defaults()
    assert os.environ["WANDB_ERROR_REPORTING"] == "false"
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "true")
    _env_defaults()
    assert os.environ["WANDB_ERROR_REPORTING"] == "true"
