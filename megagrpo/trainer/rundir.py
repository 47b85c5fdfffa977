"""The run directory at start-up: refuse to start over a run, move one aside on request,
find the checkpoint to resume from, before any model or engine is built.

A directory *holds a run* when starting afresh would destroy or mix something of it:
``metrics.jsonl`` with rows (a fresh start rewrites it), ``checkpoints/`` with any step
(old and new checkpoints would mix, and ``--resume`` would later pick the old run's), or
``adapter/``. Other files (``config.yaml`` of a start that failed, the Slurm launcher's
``memory_plan.txt``) do not count. Then:

- neither flag: ConfigError naming ``trainer.name`` and what the directory holds;
- ``--overwrite``: the directory is renamed to ``<name>.old-<UTC time>`` (never deleted);
- ``--resume``: the newest checkpoint every rank verifies
  (:func:`megagrpo.trainer.checkpoint.find_resume_checkpoint`), compared with the new
  config (:func:`megagrpo.trainer.resume_check.check_resume_config`).

Rank 0 looks and decides; every rank gets the same outcome and raises the same error.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

from megagrpo import fileio
from megagrpo.errors import ConfigError
from megagrpo.trainer.checkpoint import (
    ResumePoint,
    find_resume_checkpoint,
    remove_stale_tmp,
)
from megagrpo.trainer.config import RunConfig
from megagrpo.trainer.context import Comm
from megagrpo.trainer.plain_state import to_plain
from megagrpo.trainer.resume_check import Change, check_resume_config

log = logging.getLogger(__name__)


def _rows(path: Path) -> int:
    try:
        with open(path, "rb") as fh:
            return sum(1 for line in fh if line.strip())
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


def _decide(run_dir: Path, resume: bool, overwrite: bool) -> str | None:
    """Rank 0: act on ``run_dir`` (move it aside, clean up); the error message, or None."""
    evidence = run_evidence(run_dir) if run_dir.is_dir() else []
    if resume:
        remove_stale_tmp(run_dir / "checkpoints")
        return None
    if not evidence:
        return None
    if not overwrite:
        return (
            f"config key 'trainer.name': {run_dir} already holds a run ({'; '.join(evidence)}); "
            "pass --resume to continue it, --overwrite to move it aside, or choose another "
            "trainer.name / trainer.output_dir"
        )
    dest = aside_name(run_dir)
    os.replace(run_dir, dest)
    fileio.fsync_dir(run_dir.parent)
    log.warning("--overwrite: moved the previous run %s to %s", run_dir, dest)
    return None


def prepare_run_dir(
    cfg: RunConfig, run_dir: Path, comm: Comm, *, resume: bool, overwrite: bool
) -> tuple[ResumePoint | None, list[Change]]:
    """Collective, before any model is built: the checkpoint to resume from (None: a fresh
    run) and the settings that changed since it was written. Raises ConfigError /
    CheckpointError on every rank (see module docstring)."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    error = None
    if comm.is_main:
        try:
            error = _decide(run_dir, resume, overwrite)
        except OSError as exc:
            error = f"{run_dir}: {exc}"
    error = comm.broadcast_object(error)
    if error:
        raise ConfigError(error)
    if not resume:
        return None, []
    point = find_resume_checkpoint(run_dir / "checkpoints", comm)
    new = json.loads(json.dumps(to_plain(dataclasses.asdict(cfg), "config")))
    changes = check_resume_config(point.manifest, new, comm.world_size)
    return point, changes
