"""The checkpoint format: layout, manifest, checksums, atomic write, verified and resharded
load, the list of complete checkpoints. What goes into it is
:mod:`megagrpo.trainer.train_state`'s business (save / restore of a ``TrainContext``); this
module knows no ``TrainContext`` (``megagrpo export`` reads checkpoints with it alone).

Layout of ``runs/<name>/checkpoints/step_000010/``::

    rank00000.pt   per rank: LoRA pieces + optimiser moments (layout-free), optimiser
                   hyper-parameters, scheduler and RNG states (tensors and plain Python
                   types only: read with ``torch.load(weights_only=True)``)
    trainer.json   rank 0: step, curriculum sampler state, dynamic-sampler carry buffer,
                   loop counters (JSON: it cannot carry code)
    meta.json      the manifest, written last (marks the checkpoint complete): format, step,
                   world size, parallel layout, the resolved run config, the training problem
                   set, and the size and SHA-256 of every other file

Writing (:func:`save`, collective): every rank writes its file into ``.step_000010.tmp/``,
hashing it in the same pass and fsyncing it; the ranks exchange the outcomes, so a failed
write (disk full) is raised on every rank naming the file, errno and free space, the
temporary directory is removed and older checkpoints stay untouched. Rank 0 then writes
``trainer.json`` and the manifest, fsyncs the directory, renames it into place, fsyncs the
parent and prunes old checkpoints; stale temporary directories of interrupted writes are
removed first. A kill at any moment leaves the previous checkpoint or the new one.

Reading (:func:`find_resume_checkpoint`, collective): newest first, each rank checks its own
file's size and SHA-256 against the manifest (rank 0 also ``trainer.json``); a checkpoint any
rank finds damaged is skipped with a warning naming the file, and the next older one is
tried. Nothing is unpickled: a planted pickle payload is refused naming the file. Checkpoints
of the previous format (``trainer.pt``, no checksums) are still read, also with
``weights_only=True`` (numpy's RNG array is the one extra type allowed).

:func:`~megagrpo.trainer.train_state.save_checkpoint` /
:func:`~megagrpo.trainer.train_state.restore_checkpoint` move a ``TrainContext`` in and out
of that format. Only the LoRA parameters are saved: the frozen base comes from
``model.hf_path`` again on resume. With the Megatron policy a rank file holds *layout-free*
LoRA pieces (adapters + optimiser moments in HF space, each element written by one rank:
:mod:`megagrpo.model.lora_state`; manifest ``"lora_layout": "hf-pieces"``), so a checkpoint
resumes under another TP / EP / PP layout or world size (:func:`reshardable`: every rank
memory-maps every rank file and copies what its own layout holds) and exports to a PEFT
adapter or merged model without a model (``megagrpo export``). Other policies save their own
state dicts, resumed under the same layout only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megagrpo import fileio
from megagrpo.checkpoint.checks import (
    check_content,
    check_pieces,
    check_tiling,
    check_trainer_state,
    problem_count,
)
from megagrpo.checkpoint.plain import json_bytes, rng_state, to_plain
from megagrpo.errors import CheckpointError
from megagrpo.parallel.comm import Comm

log = logging.getLogger(__name__)

FORMAT = "megagrpo-train-ckpt-v2"
MANIFEST = "meta.json"
"""Written last; its presence marks a complete checkpoint (the Slurm launcher looks for it)."""
TRAINER_FILE = "trainer.json"
LAYOUT_FREE = "hf-pieces"
"""``lora_layout`` of a manifest whose rank files hold layout-free LoRA pieces."""
LEGACY_TRAINER_FILE = "trainer.pt"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


# ----------------------------------------------------------------------------- directories


def step_dir(ckpt_root: Path, step: int) -> Path:
    return Path(ckpt_root) / f"step_{step:06d}"


def complete_checkpoints(ckpt_root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, dir)`` of every checkpoint with a manifest, oldest first (not verified)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    return sorted(
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()
    )


def latest(ckpt_root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory under ``ckpt_root`` (None if there is none);
    :func:`find_resume_checkpoint` also verifies it."""
    done = complete_checkpoints(ckpt_root)
    return done[-1][1] if done else None


def remove_stale_tmp(ckpt_root: str | os.PathLike) -> None:
    """Remove the temporary directories interrupted saves left (rank 0, no save running)."""
    removed = fileio.remove_stale_tmp(ckpt_root)
    if removed:
        log.warning(
            "removed %d unfinished checkpoint write(s) (%.1f MB): %s",
            len(removed),
            sum(size for _, size in removed) / 1e6,
            ", ".join(p.name for p, _ in removed),
        )


def _prune(root: Path, keep: int) -> None:
    for _, path in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- writing


def _write_file(path: Path, write: Any) -> tuple[dict[str, Any] | None, str | None]:
    """``({"bytes", "sha256"}, None)`` or ``(None, why)`` for a failed write (every failure:
    the other ranks must hear of it, or they would wait for this one forever)."""
    try:
        digest = fileio.write_hashed(path, write)
    except OSError as exc:
        return None, fileio.describe_os_error(exc, path)
    except Exception as exc:  # noqa: BLE001 - reported on every rank by save()
        return None, f"writing {path}: {type(exc).__name__}: {exc}"
    return {"bytes": digest.size, "sha256": digest.sha256}, None


def _write_own_files(
    tmp: Path, rank: int, step: int, rank_state: dict[str, Any], trainer_state: dict | None
) -> tuple[dict[str, Any], str | None]:
    """This rank's file (rank 0: also ``trainer.json``) into ``tmp``: ``(digests, error)``."""
    state = {**rank_state, "rng": rng_state()}
    info, error = _write_file(tmp / rank_file(rank), lambda fh: torch.save(state, fh))
    files = {rank_file(rank): info}
    if rank == 0 and error is None:
        try:
            plain = to_plain({"step": step, **(trainer_state or {})}, "trainer_state")
        except TypeError as exc:
            return files, str(exc)
        info, error = _write_file(tmp / TRAINER_FILE, lambda fh: fh.write(json_bytes(plain)))
        files[TRAINER_FILE] = info
    return files, error


def _commit(
    tmp: Path, final: Path, manifest: dict[str, Any], before: fileio.DirState | None
) -> str | None:
    """Rank 0: the manifest last, then the fsynced rename over ``final`` as it was when the
    save started (``before``: an unusable checkpoint a resume went back past); why it
    failed, or None."""
    try:
        fileio.write_text(tmp / MANIFEST, json.dumps(to_plain(manifest, "manifest"), indent=1))
        fileio.replace_dir(tmp, final, before)
    except fileio.OutputChanged as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return str(exc).split(": nothing there")[0]
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return fileio.describe_os_error(exc, exc.filename or tmp / MANIFEST)
    return None


def save(
    ckpt_root: str | os.PathLike,
    step: int,
    *,
    rank: int,
    world_size: int,
    rank_state: dict[str, Any],
    trainer_state: dict[str, Any] | None,
    meta: dict[str, Any],
    extra: dict[str, Any] | None = None,
    keep: int = 2,
    comm: Comm | None = None,
) -> Path:
    """Write one checkpoint atomically (collective: every rank calls it).

    Args:
        rank_state: this rank's ``{"lora": ..., "optimizer": ..., ...}`` (RNGs added here).
        trainer_state: rank 0's sampler / dynamic-sampler / loop state, JSON-able after
            :func:`to_plain` (ignored elsewhere).
        meta: layout description checked on load (:func:`load`).
        extra: more manifest entries (the run config, the problem set), not checked by load.
        keep: newest checkpoints to keep. comm: the world (None: one process).
    Raises CheckpointError on every rank when any rank's write failed (disk full: file,
    errno, free space); the temporary directory is removed, older checkpoints are intact.
    """
    comm = comm or Comm()
    root = Path(ckpt_root)
    final = step_dir(root, step)
    tmp = fileio.tmp_sibling(final)
    error, before = None, None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            remove_stale_tmp(root)
            before = fileio.dir_state(final)
            fileio.fresh_tmp_dir(final)
        except OSError as exc:
            error = fileio.describe_os_error(exc, exc.filename or tmp)
    error = comm.broadcast_object(error)  # also the barrier before the writes
    if error:
        raise CheckpointError(f"checkpoint step {step} not written ({error})")
    outcomes = comm.all_gather_object(_write_own_files(tmp, rank, step, rank_state, trainer_state))
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(outcomes) if e]
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        comm.barrier()
        raise CheckpointError(
            f"checkpoint step {step} not written ({'; '.join(errors)}); the previous "
            "checkpoint is intact"
        )
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "step": step,
            "world_size": world_size,
            **meta,
            **(extra or {}),
            "files": {name: d for f, _ in outcomes for name, d in f.items()},
        }
        error = _commit(tmp, final, manifest, before)
        if error is None:
            _prune(root, keep)
            log.info("checkpoint step %d -> %s", step, final)
    error = comm.broadcast_object(error)
    if error:
        raise CheckpointError(f"checkpoint step {step} not written ({error})")
    return final


# ----------------------------------------------------------------------------- reading


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``; CheckpointError naming the file when it is
    missing, unreadable or not a JSON object."""
    file = Path(path) / MANIFEST
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a complete checkpoint (no {MANIFEST})") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{file}: unreadable ({type(exc).__name__}: {exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _check_file(path: Path, name: str, manifest: dict[str, Any]) -> str | None:
    """Why ``path/name`` does not match the manifest (None when it does)."""
    file = path / name
    if not file.is_file():
        return f"{name} is missing"
    expected = (manifest.get("files") or {}).get(name)
    if manifest.get("format") != FORMAT:  # previous format: no checksums to compare
        return None if file.stat().st_size > 0 else f"{name} is empty"
    if not isinstance(expected, dict):
        return f"{name} is not listed in {MANIFEST}"
    size = file.stat().st_size
    if size != expected.get("bytes"):
        return f"{name}: {size} bytes, {MANIFEST} says {expected.get('bytes')}"
    if fileio.file_digest(file).sha256 != expected.get("sha256"):
        return f"{name}: SHA-256 differs from {MANIFEST} (corrupt)"
    return None


def check_files(path: str | os.PathLike, manifest: dict[str, Any]) -> list[str]:
    """Why the files of checkpoint ``path`` do not match ``manifest`` (size, SHA-256,
    missing), one reason per file; empty when they all match (one process reads them all)."""
    names = sorted(manifest.get("files") or {})
    return [r for r in (_check_file(Path(path), n, manifest) for n in names) if r]


def _verify(
    path: Path, comm: Comm, required: tuple[str, ...] = ()
) -> tuple[dict[str, Any] | None, str | None]:
    """Collective: ``(manifest, None)`` when every rank's files of ``path`` match the
    manifest, else ``(None, reasons)``. A reshardable checkpoint of another world size has
    all its files checked, shared out over the ranks; any other checkpoint of another world
    size is returned unverified: the resume check refuses it naming the world size."""
    manifest, error = None, None
    if comm.is_main:
        try:
            manifest = read_manifest(path)
        except CheckpointError as exc:
            error = str(exc)
    manifest, error = comm.broadcast_object((manifest, error))
    if error or manifest is None:
        return None, error
    if manifest.get("world_size") == comm.world_size:
        names = [rank_file(comm.rank)]
        if comm.is_main:
            legacy = manifest.get("format") != FORMAT
            names.append(LEGACY_TRAINER_FILE if legacy else TRAINER_FILE)
    elif reshardable(manifest):  # every file is read: each rank checks its share of them
        names = sorted(manifest.get("files") or {})[comm.rank :: comm.world_size]
    else:
        return manifest, None
    mine = [r for r in (_check_file(path, n, manifest) for n in names) if r]
    boxes: list = []
    if not mine and manifest.get("format") == FORMAT:  # the content too (ckpt_checks)
        load = lambda f: _torch_load(f, legacy=False, mmap=True)  # noqa: E731
        mine, boxes = check_content(path, names, manifest, load, reshardable(manifest), required)
    gathered = comm.all_gather_object((mine, boxes))
    reasons = [r for rs, _ in gathered for r in rs]
    if not reasons and reshardable(manifest) and manifest.get("world_size") == comm.world_size:
        reasons = check_tiling(b for _, bs in gathered for b in bs)
    return (None, "; ".join(reasons)) if reasons else (manifest, None)


@dataclass
class ResumePoint:
    """The checkpoint a run resumes from, verified, with its manifest."""

    path: Path
    step: int
    manifest: dict[str, Any]


def find_resume_checkpoint(
    ckpt_root: str | os.PathLike,
    comm: Comm | None = None,
    required: tuple[str, ...] = (),
    before: int | None = None,
) -> ResumePoint:
    """The newest checkpoint under ``ckpt_root`` that every rank verifies (collective), its
    content included (:mod:`megagrpo.checkpoint.checks`; ``required``: trainer.json keys);
    ``before``: only checkpoints of earlier steps (the fall-back past a rejected one).

    A damaged one (truncated or corrupt file, missing file, unreadable manifest) is skipped
    with a WARNING naming the file; CheckpointError when none is usable (listing why each
    was rejected) or there is none.
    """
    comm = comm or Comm()
    found = comm.broadcast_object(
        [(s, str(p)) for s, p in complete_checkpoints(ckpt_root)] if comm.is_main else None
    )
    rejected = []
    for step, path in reversed(found):
        if before is not None and step >= before:
            continue
        manifest, why = _verify(Path(path), comm, required)
        if manifest is not None and manifest.get("step") != step:
            manifest, why = None, f"{MANIFEST} says step {manifest.get('step')!r}"
        if manifest is not None:
            if rejected:
                log.warning("resuming from %s, the newest usable checkpoint", path)
            elif manifest.get("format") != FORMAT:
                log.warning("%s: written by an older megagrpo, without checksums", path)
            return ResumePoint(Path(path), step, manifest)
        log.warning("checkpoint %s is unusable (%s); trying the one before", path, why)
        rejected.append(f"{Path(path).name}: {why}")
    if rejected:
        raise CheckpointError(
            f"--resume: no usable checkpoint under {ckpt_root}: " + "; ".join(rejected)
        )
    older = f" before step {before}" if before is not None else ""
    raise CheckpointError(f"--resume: no complete checkpoint{older} under {ckpt_root}")


def _legacy_numpy_types() -> list[Any]:
    """What the previous format pickled of numpy: the MT19937 key array, scalars in the
    carry buffer. Only these constructors are allowed, nothing that runs code."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray  # type: ignore[no-redef]
    dtypes = {type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.float32, np.bool_)}
    return [multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype, *dtypes]


def _torch_load(file: Path, legacy: bool, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)``; CheckpointError naming ``file`` for anything else
    (a pickle that would run code is refused before anything runs)."""
    try:
        if not legacy:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
        with torch.serialization.safe_globals(_legacy_numpy_types()):
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every reader error names the file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(
            f"{file}: refused or unreadable checkpoint file ({type(exc).__name__}: {first}); "
            "checkpoints hold tensors and plain data only"
        ) from exc


def load(
    path: str | os.PathLike, *, rank: int, world_size: int, meta: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read ``(rank_state, trainer_state)`` of a checkpoint written by :func:`save`.

    Raises CheckpointError when it is incomplete, unreadable, holds anything but tensors and
    plain data, or was written for another layout (world size, or any key of ``meta``).
    """
    path = Path(path)
    saved = read_manifest(path)
    if saved.get("world_size") != world_size:
        raise CheckpointError(
            f"{path}: written by {saved.get('world_size')} processes, "
            f"resumed with {world_size}; use the same launch layout"
        )
    for key, value in meta.items():
        if to_plain(value) != saved.get(key):
            raise CheckpointError(
                f"{path}: '{key}' was {saved.get(key)!r} when saved, now {value!r}"
            )
    legacy = saved.get("format") != FORMAT
    file = path / rank_file(rank)
    if not file.is_file():
        raise CheckpointError(f"{path}: missing {file.name}")
    rank_state = _torch_load(file, legacy)
    if legacy:
        trainer_state = _torch_load(path / LEGACY_TRAINER_FILE, legacy=True)
    else:
        trainer_state = _read_trainer_state(path, saved)
    if not isinstance(rank_state, dict) or not isinstance(trainer_state, dict):
        raise CheckpointError(f"{path}: checkpoint files hold no state dict")
    return rank_state, trainer_state


def reshardable(manifest: dict[str, Any]) -> bool:
    """True for a checkpoint whose LoRA state is layout-free (:mod:`megagrpo.model.lora_state`):
    it resumes under another parallel layout or world size."""
    return manifest.get("lora_layout") == LAYOUT_FREE


def load_resharded(
    path: str | os.PathLike, *, rank: int, meta: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(every saved rank's state, trainer_state)`` of a reshardable checkpoint, for any
    world size and layout (the rank files are memory-mapped: a rank reads the pieces it
    copies). CheckpointError as :func:`load` for another model / LoRA shape."""
    path = Path(path)
    saved = read_manifest(path)
    for key, value in meta.items():
        if key != "parallel" and to_plain(value) != saved.get(key):
            raise CheckpointError(
                f"{path}: '{key}' was {saved.get(key)!r} when saved, now {value!r}"
            )
    world = int(saved.get("world_size") or 0)
    states, boxes = [], []
    for r in range(world):
        file = path / rank_file(r)
        if not file.is_file():
            raise CheckpointError(f"{path}: missing {file.name}")
        state = _torch_load(file, legacy=False, mmap=True)
        if not isinstance(state, dict) or not isinstance(state.get("pieces"), list):
            raise CheckpointError(f"{file}: holds no layout-free LoRA pieces")
        reasons, mine = check_pieces(state["pieces"], str(file))
        if reasons:
            raise CheckpointError("; ".join(reasons))
        boxes += mine
        states.append(state)
    reasons = check_tiling(boxes)
    if reasons:
        raise CheckpointError(f"{path}: " + "; ".join(reasons))
    return states, _read_trainer_state(path, saved)


def _read_trainer_state(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """``trainer.json`` of checkpoint ``path``, checked (ckpt_checks); CheckpointError."""
    try:
        trainer_state = json.loads((path / TRAINER_FILE).read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path / TRAINER_FILE}: unreadable ({exc})") from exc
    why = check_trainer_state(
        trainer_state,
        manifest.get("step"),
        str(path / TRAINER_FILE),
        num_problems=problem_count(manifest),
    )
    if why:
        raise CheckpointError(why)
    return trainer_state
