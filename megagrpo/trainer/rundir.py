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
  (:func:`megagrpo.checkpoint.format.find_resume_checkpoint`), compared with the new
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
from megagrpo.checkpoint.checks import TRAINER_KEYS, check_trainer_state
from megagrpo.checkpoint.format import (
    TRAINER_FILE,
    ResumePoint,
    find_resume_checkpoint,
    remove_stale_tmp,
)
from megagrpo.checkpoint.plain import to_plain
from megagrpo.config.loader import written
from megagrpo.errors import CheckpointError, ConfigError
from megagrpo.model.fingerprint import changed as changed_base
from megagrpo.parallel.comm import Comm
from megagrpo.trainer import runlock
from megagrpo.trainer.config import RunConfig
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


def _value_errors(point: ResumePoint, num_problems: int, vocab: int | None) -> str | None:
    """Why the values of ``point``'s trainer.json cannot be resumed with this training set
    and vocabulary (rank 0; :mod:`megagrpo.checkpoint.values`)."""
    file = point.path / TRAINER_FILE
    if not file.is_file():  # the previous format: checked when it loads
        return None
    try:
        state = json.loads(file.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        return f"{file}: unreadable ({type(exc).__name__})"
    step = point.manifest.get("step")
    return check_trainer_state(state, step, str(file), TRAINER_KEYS, num_problems, vocab)


def check_base(
    point: ResumePoint,
    base: dict | None,
    hf_path: str,
    allow_change: bool,
    model_dir: str | os.PathLike | None = None,
) -> None:
    """The base weights under ``model.hf_path`` (``model_dir``: its local directory) must be
    those the checkpoint's LoRA was trained on (their fingerprint in its manifest; an older
    checkpoint's fingerprint version is recomputed as it was): CheckpointError naming both,
    unless ``--allow-base-change`` (then a warning); a checkpoint written before fingerprints
    were recorded resumes with a warning."""
    saved = point.manifest.get("base")
    if not isinstance(saved, dict):
        log.warning(
            "%s was written without a fingerprint of the base weights: whether %s still holds "
            "the weights its LoRA was trained on cannot be checked",
            point.path,
            hf_path,
        )
        return
    if base is None or saved.get("sha256") == base.get("sha256"):
        return
    diff = changed_base(saved, model_dir, base)
    if diff is None:
        return
    what = (
        f"the base weights under model.hf_path {hf_path} changed since {point.path.name} was "
        f"saved ({diff})"
    )
    if allow_change:
        log.warning("--allow-base-change: %s; the LoRA continues on the new base", what)
        return
    raise CheckpointError(
        f"--resume: {what}: the LoRA was trained on the old weights; put them back, or pass "
        "--allow-base-change to continue on the new ones"
    )


def confirm_resume_point(
    cfg: RunConfig,
    run_dir: Path,
    point: ResumePoint,
    comm: Comm,
    num_problems: int,
    vocab: int | None,
) -> tuple[ResumePoint, list[Change] | None]:
    """Collective, once the training set and the model's config are known and before the
    model is built: ``point``'s trainer state checked by value against them; a checkpoint
    that fails is skipped with a WARNING naming the field and the previous complete one is
    tried (its config compared again: the changes returned; None when ``point`` held)."""
    changes = None
    while True:
        why = _value_errors(point, num_problems, vocab) if comm.is_main else None
        why = comm.broadcast_object(why)
        if not why:
            return point, changes
        log.warning("checkpoint %s is unusable (%s); trying the one before", point.path, why)
        point = find_resume_checkpoint(
            run_dir / "checkpoints", comm, TRAINER_KEYS, before=point.step
        )
        new = json.loads(json.dumps(to_plain(written(cfg), "config")))
        changes = check_resume_config(point.manifest, new, comm.world_size)


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
