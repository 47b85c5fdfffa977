"""Reliability decisions taken by every rank together (issue 14.3, 14.6, 14.7), with 2
gloo processes: a stop signal received by one rank only stops both after the same step; a
loss that is NaN on one rank makes both skip the optimiser step; a
checkpoint file damaged on one rank makes both fall back to the same older checkpoint; a
write that fails on one rank (disk full) fails the save on both, naming that rank's file.
The last test signals rank 1 of a real `torchrun` training run."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megagrpo.metrics import read_metrics
from megagrpo.parallel.launch import launch
from megagrpo.testing import tiny_run_config, write_run_config

pytestmark = pytest.mark.distributed


class _FullDisk:
    """A file that takes ``room`` bytes, then fails as a full disk does."""

    def __init__(self, fh, room: int = 100) -> None:
        self.fh, self.room = fh, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.fh.write(data)

    def flush(self):
        self.fh.flush()


def _worker(rank: int, root: str) -> dict:
    import torch
    import torch.distributed as dist

    from megagrpo import fileio
    from megagrpo.checkpoint import format as checkpoint
    from megagrpo.errors import CheckpointError
    from megagrpo.parallel.comm import Comm
    from megagrpo.parallel.signals import StopSignals

    dist.init_process_group("gloo")
    comm, out = Comm(), {}
    stop = StopSignals()
    out["quiet"] = stop.agreed(comm)
    if rank == 1:
        stop.signum = signal.SIGUSR1  # only rank 1 was signalled
    out["agreed"] = stop.agreed(comm)
    from megagrpo.trainer.optimize import finite_everywhere

    out["finite"] = finite_everywhere(comm, 1.0, 2.0)
    out["nan_on_1"] = finite_everywhere(comm, float("nan") if rank == 1 else 1.0, 2.0)

    def save(step: int) -> None:
        checkpoint.save(
            root,
            step,
            rank=rank,
            world_size=2,
            rank_state={"lora": {"w": torch.full((3,), 10.0 * rank + step)}},
            trainer_state={"counters": {"s": step}},
            meta={},
            comm=comm,
        )

    save(1)
    save(2)
    if rank == 1:
        shard = Path(root) / "step_000002" / "rank00001.pt"
        shard.write_bytes(shard.read_bytes()[:100])
    comm.barrier()
    point = checkpoint.find_resume_checkpoint(root, comm)
    out["resume_step"] = point.step
    out["w"] = checkpoint.load(point.path, rank=rank, world_size=2, meta={})[0]["lora"]["w"]
    if rank == 1:  # rank 1's disk is full
        real_init = fileio.HashingWriter.__init__
        fileio.HashingWriter.__init__ = lambda self, fh: real_init(self, _FullDisk(fh))
    try:
        save(3)
        out["error"] = None
    except CheckpointError as exc:
        out["error"] = str(exc)
    comm.barrier()
    out["dirs"] = sorted(os.listdir(root))
    dist.destroy_process_group()
    return out


def test_ranks_agree_on_stop_fallback_and_failed_writes(tmp_path):
    results = launch(_worker, 2, str(tmp_path))
    for rank, res in enumerate(results):
        assert res["quiet"] is None and res["agreed"] == "SIGUSR1", rank
        assert res["finite"] is True and res["nan_on_1"] is False, rank  # both skip the step
        assert res["resume_step"] == 1, rank  # rank 1's step-2 file is damaged
        assert res["w"].tolist() == [10.0 * rank + 1] * 3
        assert res["error"] is not None and "rank 1: writing" in res["error"], rank
        assert "rank00001.pt" in res["error"] and "ENOSPC" in res["error"]
        assert res["dirs"] == ["step_000001", "step_000002"]  # no step 3, no tmp left


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_pids(torchrun_pid: int) -> dict[int, int]:
    """RANK -> pid of the training processes under a torchrun (its agent's children)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid != torchrun_pid:
            continue
        for var in env:
            if var.startswith(b"RANK="):
                out[int(var[5:])] = int(entry.name)
    return out


@pytest.mark.slow
def test_usr1_to_one_torchrun_rank_checkpoints_both_and_exits_0(tiny_moe_dir, tmp_path):
    cfg = tiny_run_config(
        tiny_moe_dir,
        tmp_path,
        "usr1",
        parallel={"tp": 2, "sequence_parallel": True},
        rollout={"max_tokens": 5},
        trainer={"max_steps": 4, "micro_batch_size": 3, "save_every": 0},
    )
    config = write_run_config(tmp_path / "usr1.yaml", cfg)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={_free_port()}",
        "-m",
        "megagrpo.cli",
        "train",
        str(config),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONHASHSEED="0")
    proc = subprocess.Popen(
        cmd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    rows = tmp_path / "usr1" / "metrics.jsonl"
    try:
        deadline = time.time() + 400
        while proc.poll() is None and time.time() < deadline:
            if rows.exists() and read_metrics(rows):
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-5000:]
        pids = _rank_pids(proc.pid)
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGUSR1)  # rank 1 only, as a partial preemption would
        stdout, stderr = proc.communicate(timeout=400)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, stderr[-5000:]
    stopped = int(stdout.split("stopped by SIGUSR1 after step ")[1].split(":")[0])
    assert 1 <= stopped < 4
    ckpt = tmp_path / "usr1" / "checkpoints" / f"step_{stopped:06d}"
    assert (ckpt / "rank00000.pt").is_file() and (ckpt / "rank00001.pt").is_file()
    assert [r["step"] for r in read_metrics(rows)] == list(range(1, stopped + 1))
