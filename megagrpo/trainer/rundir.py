"""The run directory at start-up: refuse to start over a run, move one aside on request,
find the checkpoint to resume from, before any model or engine is built.

A directory *holds a run* when starting afresh would destroy or mix something of it:
``metrics.jsonl`` with rows of trained steps (a fresh start rewrites it; a step-0 evaluation
alone is redone), ``checkpoints/`` with any step
(old and new checkpoints would mix, and ``--resume`` would later pick the old run's), or
``adapter/``. Other files (``config.yaml`` of a start that failed, the Slurm launcher's
``memory_plan.txt``) do not count. Then:

- neither flag: ConfigError naming ``trainer.name`` and what the directory holds;
- ``--overwrite``: the directory is renamed to ``<name>.old-<UTC time>`` (never deleted);
- ``--resume``: the newest checkpoint every rank verifies
  (:func:`megagrpo.trainer.checkpoint.find_resume_checkpoint`), compared with the new
  config (:func:`megagrpo.trainer.resume_check.check_resume_config`).

Rank 0 first takes the directory's lock (:mod:`megagrpo.trainer.runlock`: one process per run
directory, held for the run's life), then looks and decides; every rank gets the same outcome
and raises the same error.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from megagrpo import fileio
from megagrpo.config.loader import written
from megagrpo.errors import ConfigError
from megagrpo.trainer import runlock
from megagrpo.trainer.checkpoint import (
    ResumePoint,
    find_resume_checkpoint,
    remove_stale_tmp,
)
from megagrpo.trainer.ckpt_checks import TRAINER_KEYS
from megagrpo.trainer.config import RunConfig
from megagrpo.trainer.context import Comm
from megagrpo.trainer.plain_state import to_plain
from megagrpo.trainer.resume_check import Change, check_resume_config
from megagrpo.trainer.runlock import RunLock

log = logging.getLogger(__name__)


def _trained_row(line: bytes) -> bool:
    """False for a blank line or the row of step 0 (an evaluation of the base model, redone
    by a fresh start); True for anything else, a torn row included."""
    if not line.strip():
        return False
    try:
        return json.loads(line).get("step") != 0
    except (ValueError, AttributeError, RecursionError):
        return True


def _rows(path: Path) -> int:
    try:
        with open(path, "rb") as fh:
            return sum(1 for line in fh if _trained_row(line))
    except OSError:
        return 0


def run_evidence(run_dir: Path) -> list[str]:
    """What in ``run_dir`` a fresh start would destroy or mix (see module docstring)."""
    out = []
    rows = _rows(run_dir / "metrics.jsonl")
    if rows:
        out.append(f"metrics.jsonl with {rows} row(s)")
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir():
        names = sorted(p.name for p in ckpts.iterdir())
        if names:
            shown = ", ".join(names[-3:])
            out.append(f"checkpoints/ ({shown}{', ...' if len(names) > 3 else ''})")
    if (run_dir / "adapter").exists():
        out.append("adapter/")
    return out


def aside_name(run_dir: Path) -> Path:
    """``<name>.old-<UTC time>`` next to ``run_dir`` (``-2``, ``-3`` ... if taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 2
    while dest.exists():
        dest = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
        n += 1
    return dest


def _decide(run_dir: Path, resume: bool, overwrite: bool, lock: RunLock) -> RunLock:
    """Rank 0, holding ``lock``: act on ``run_dir`` (move it aside, clean up); the lock of
    the run directory to keep (a new one after ``--overwrite``). ConfigError to refuse."""
    evidence = run_evidence(run_dir)
    if resume:
        remove_stale_tmp(run_dir / "checkpoints")
        return lock
    if not evidence:
        return lock
    if not overwrite:
        raise ConfigError(
            f"config key 'trainer.name': {run_dir} already holds a run ({'; '.join(evidence)}); "
            "pass --resume to continue it, --overwrite to move it aside, or choose another "
            "trainer.name / trainer.output_dir"
        )
    dest = aside_name(run_dir)
    os.replace(run_dir, dest)
    fileio.fsync_dir(run_dir.parent)
    lock.path = dest / lock.path.name  # moved with the directory: released there
    lock.release()
    log.warning("--overwrite: moved the previous run %s to %s", run_dir, dest)
    return runlock.acquire(run_dir)


def _lock_and_decide(run_dir: Path, resume: bool, overwrite: bool) -> tuple[RunLock | None, str]:
    """Rank 0: lock ``run_dir`` (:mod:`megagrpo.trainer.runlock`) and :func:`_decide`;
    ``(lock, "")`` or ``(None, why not)`` (nothing is left locked)."""
    lock = None
    try:
        lock = runlock.acquire(run_dir)
        return _decide(run_dir, resume, overwrite, lock), ""
    except (ConfigError, OSError) as exc:
        if lock is not None:
            lock.release()
        return None, str(exc) if isinstance(exc, ConfigError) else f"{run_dir}: {exc}"


def prepare_run_dir(
    cfg: RunConfig, run_dir: Path, comm: Comm, *, resume: bool, overwrite: bool
) -> tuple[ResumePoint | None, list[Change], RunLock | None]:
    """Collective, before any model is built: the checkpoint to resume from (None: a fresh
    run), the settings that changed since it was written, and the run directory's lock
    (rank 0; None elsewhere: release it when the run ends). Raises ConfigError /
    CheckpointError on every rank (see module docstring)."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    lock, error = _lock_and_decide(run_dir, resume, overwrite) if comm.is_main else (None, "")
    error = comm.broadcast_object(error)
    if error:
        raise ConfigError(error)
    if not resume:
        return None, [], lock
    try:
        point = find_resume_checkpoint(run_dir / "checkpoints", comm, TRAINER_KEYS)
        new = json.loads(json.dumps(to_plain(written(cfg), "config")))
        changes = check_resume_config(point.manifest, new, comm.world_size)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return point, changes, lock
