"""One process per run directory (megagrpo.trainer.runlock): a second `megagrpo train` on a
run name in use stops with exit status 2 naming the holder; a dead holder's lock is taken
over; two fresh runs racing for one name leave exactly one run."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from forkrun import start_cli  # tests/forkrun.py

from megagrpo.errors import ConfigError
from megagrpo.metrics import read_metrics
from megagrpo.testing import tiny_run_config, write_run_config

HOLD = textwrap.dedent(
    """
    import sys, time
    from megagrpo.trainer import runlock
    lock = runlock.acquire(sys.argv[1])
    print("locked", flush=True)
    time.sleep(60)
    """
)


@pytest.fixture
def holder(tmp_path):
    """Another process holding ``tmp_path / "run"``'s lock."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    yield proc
    proc.kill()
    proc.wait()


def test_a_held_lock_is_refused_naming_pid_and_host(tmp_path, holder):
    from megagrpo.trainer import runlock

    with pytest.raises(ConfigError) as err:
        runlock.acquire(tmp_path / "run")
    assert f"pid {holder.pid} on host {socket.gethostname()}" in str(err.value)
    holder.kill()
    holder.wait()  # SIGKILL: the kernel drops the flock, the record stays
    record = json.loads((tmp_path / "run" / ".lock").read_text())
    assert record["pid"] == holder.pid
    lock = runlock.acquire(tmp_path / "run")
    lock.release()
    assert not (tmp_path / "run" / ".lock").exists()


def test_a_dead_pid_on_this_host_is_taken_over_with_a_warning(tmp_path, caplog, monkeypatch):
    from megagrpo.trainer import runlock

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "run"
    run.mkdir()
    record = {"pid": dead.pid, "host": socket.gethostname(), "started": "then"}
    (run / ".lock").write_text(json.dumps(record))
    monkeypatch.setattr(runlock, "_flock", lambda fd: None)  # a file system without flock
    with caplog.at_level(logging.WARNING, logger="megagrpo.trainer.runlock"):
        lock = runlock.acquire(run)
    assert f"taking over the lock of pid {dead.pid}" in caplog.text
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    # without flock, a live pid here or any record of another host is refused
    (run / ".lock").write_text(json.dumps(dict(record, pid=os.getppid())))
    with pytest.raises(ConfigError, match=f"pid {os.getppid()}"):
        runlock.acquire(run)
    (run / ".lock").write_text(json.dumps(dict(record, host="elsewhere")))
    with pytest.raises(ConfigError, match="on host elsewhere"):
        runlock.acquire(run)


def _train(config: Path):
    """`megagrpo train CONFIG` forked from the tests' preloaded server (tests/forkrun.py):
    two separate processes racing, as two fresh ones would."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONHASHSEED="0")
    return start_cli(["train", str(config)], env=env)


@pytest.mark.slow
def test_two_fresh_runs_racing_for_one_name_leave_exactly_one_run(tiny_dense_dir, tmp_path):
    configs = []
    for seed in (1, 2):
        cfg = tiny_run_config(
            tiny_dense_dir, tmp_path, "x", trainer={"seed": seed, "max_steps": 4, "save_every": 1}
        )
        configs.append(write_run_config(tmp_path / f"seed{seed}.yaml", cfg))
    procs = [_train(c) for c in configs]
    outs = [p.communicate(timeout=900) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], [o[1][-3000:] for o in outs]
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    err = outs[loser][1]
    assert "in use by another megagrpo run" in err or "already holds a run" in err, err[-3000:]
    if "in use" in err:
        assert f"pid {procs[winner].pid}" in err
    run = tmp_path / "x"
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
    saved = (run / "config.yaml").read_text()
    assert f"seed: {winner + 1}\n" in saved
    for ckpt in (run / "checkpoints").iterdir():
        manifest = json.loads((ckpt / "meta.json").read_text())
        assert manifest["config"]["trainer"]["seed"] == winner + 1, ckpt
    assert not (run / ".lock").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("x")) == ["x"]
