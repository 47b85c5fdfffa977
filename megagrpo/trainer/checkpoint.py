"""Checkpoints: LoRA adapters, optimiser, sampler/curriculum + dynamic-sampler state, RNGs.

Layout of ``runs/<name>/checkpoints/step_000010/``::

    rank00000.pt   per rank: LoRA shard, optimiser state, RNG states (torch, numpy, random)
    trainer.pt     rank 0: step, curriculum sampler state, dynamic-sampler carry buffer
    meta.json      written last: step, world size, parallel layout (marks it complete)

Writes are atomic: every rank writes into ``.step_000010.tmp/``; after a barrier rank 0 writes
``meta.json`` and renames the directory into place, so a kill at any moment leaves either
the previous checkpoint or the new one, never a half-written one. :func:`latest` ignores
directories without ``meta.json``. Only the LoRA parameters are saved: the frozen base
comes from ``model.hf_path`` again on resume.

:func:`save_checkpoint` / :func:`restore_checkpoint` move a :class:`TrainContext` in and
out of that format: every rank its LoRA shard, optimiser, scheduler and RNGs; the
curriculum and dynamic samplers (replicated on every rank) from rank 0's ``trainer.pt``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megagrpo import fileio
from megagrpo.errors import CheckpointError
from megagrpo.trainer.config import RunConfig
from megagrpo.trainer.context import TrainContext

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def rng_state() -> dict[str, Any]:
    """Every RNG this process draws from."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_dir(ckpt_root: Path, step: int) -> Path:
    return Path(ckpt_root) / f"step_{step:06d}"


def latest(ckpt_root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory under ``ckpt_root`` (None if there is none)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return None
    done = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / "meta.json").is_file()
    ]
    return max(done)[1] if done else None


def _barrier(comm) -> None:
    if comm is not None:
        comm.barrier()


def save(
    ckpt_root: str | os.PathLike,
    step: int,
    *,
    rank: int,
    world_size: int,
    rank_state: dict[str, Any],
    trainer_state: dict[str, Any] | None,
    meta: dict[str, Any],
    keep: int = 2,
    comm=None,
) -> Path:
    """Write one checkpoint atomically (collective: every rank calls it).

    Args:
        rank_state: this rank's ``{"lora": ..., "optimizer": ..., ...}`` (RNGs added here).
        trainer_state: rank 0's sampler / dynamic-sampler / loop state (ignored elsewhere).
        meta: JSON-able description (layout, model path) checked on load.
        keep: newest checkpoints to keep. comm: object with ``barrier()`` (None: 1 process).
    """
    final = step_dir(Path(ckpt_root), step)
    tmp = fileio.tmp_sibling(final)
    if rank == 0:
        fileio.fresh_tmp_dir(final)
    _barrier(comm)
    torch.save({**rank_state, "rng": rng_state()}, tmp / f"rank{rank:05d}.pt")
    if rank == 0:
        torch.save({"step": step, **(trainer_state or {})}, tmp / "trainer.pt")
    _barrier(comm)
    if rank == 0:
        info = {"step": step, "world_size": world_size, **meta}
        (tmp / "meta.json").write_text(json.dumps(info, indent=1, default=str), encoding="utf-8")
        fileio.replace_dir(tmp, final)
        _prune(Path(ckpt_root), keep)
        log.info("checkpoint step %d -> %s", step, final)
    _barrier(comm)
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted(
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / "meta.json").is_file()
    )
    for _, path in done[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def load(
    path: str | os.PathLike, *, rank: int, world_size: int, meta: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read ``(rank_state, trainer_state)`` of a checkpoint written by :func:`save`.

    Raises CheckpointError when it is incomplete or was written for another layout
    (world size, or any key of ``meta`` that differs, e.g. the parallel degrees).
    """
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no meta.json)")
    saved = json.loads(meta_file.read_text(encoding="utf-8"))
    if saved.get("world_size") != world_size:
        raise CheckpointError(
            f"{path}: written by {saved.get('world_size')} processes, "
            f"resumed with {world_size}; use the same launch layout"
        )
    for key, value in meta.items():
        if json.loads(json.dumps(value, default=str)) != saved.get(key):
            raise CheckpointError(
                f"{path}: '{key}' was {saved.get(key)!r} when saved, now {value!r}"
            )
    rank_file = path / f"rank{rank:05d}.pt"
    if not rank_file.is_file():
        raise CheckpointError(f"{path}: missing {rank_file.name}")
    rank_state = torch.load(rank_file, map_location="cpu", weights_only=False)
    trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    return rank_state, trainer_state


# ----------------------------------------------------------------------------- the run's state


def checkpoint_meta(cfg: RunConfig) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed (layout, model, LoRA shape)."""
    return {
        "parallel": dataclasses.asdict(cfg.parallel),
        "model": cfg.model.hf_path,
        "lora": dataclasses.asdict(cfg.model.lora),
    }


def save_checkpoint(ctx: TrainContext, step: int) -> Path:
    """Adapters, optimiser, scheduler and RNGs of every rank; samplers (collective)."""
    rank_state = {
        "lora": ctx.policy.lora_state_dict(),
        "optimizer": ctx.optimizer.state_dict(),
        "scheduler": ctx.scheduler.state_dict() if ctx.scheduler else None,
    }
    trainer_state = {"sampler": ctx.sampler.state_dict(), "dynamic": ctx.dynamic.state_dict()}
    return save(
        ctx.ckpt_root,
        step,
        rank=ctx.comm.rank,
        world_size=ctx.comm.world_size,
        rank_state=rank_state,
        trainer_state=trainer_state,
        meta=checkpoint_meta(ctx.cfg),
        keep=ctx.cfg.trainer.keep_checkpoints,
        comm=ctx.comm,
    )


def restore_checkpoint(ctx: TrainContext) -> int:
    """Load the newest complete checkpoint of the run into ``ctx``; returns its step
    (CheckpointError when there is none). The engines are re-synced by the caller."""
    path = latest(ctx.ckpt_root)
    if path is None:
        raise CheckpointError(f"--resume: no complete checkpoint under {ctx.ckpt_root}")
    rank_state, trainer_state = load(
        path, rank=ctx.comm.rank, world_size=ctx.comm.world_size, meta=checkpoint_meta(ctx.cfg)
    )
    ctx.policy.load_lora_state_dict(rank_state["lora"])
    ctx.optimizer.load_state_dict(rank_state["optimizer"])
    if ctx.scheduler is not None and rank_state.get("scheduler"):
        ctx.scheduler.load_state_dict(rank_state["scheduler"])
    ctx.sampler.load_state_dict(trainer_state["sampler"])
    ctx.dynamic.load_state_dict(trainer_state["dynamic"])
    set_rng_state(rank_state["rng"])
    ctx.step = int(trainer_state["step"])
    log.info("resumed from %s (step %d)", path, ctx.step)
    return ctx.step
