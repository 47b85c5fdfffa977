"""What changed between a checkpoint and the run that resumes it, and what to do about it.

Every checkpoint's manifest holds the resolved run config it was written under and its
training problem set (:func:`megagrpo.trainer.train_state.save_checkpoint`). On ``--resume``
:func:`check_resume_config` compares that config with the new one, key by key, before any
model is built; :data:`RULES` (longest dotted prefix wins) says for each key whether a change

- is **refused**: the checkpoint cannot continue under it (model, LoRA shape, prompt
  rendering, level filter; the parallel layout and world size of a checkpoint of per-rank
  shards): one CheckpointError names every such key with its old and new value;
- is **adapted**: applied to the restored state, which would otherwise bring the old value
  back silently (``trainer.lr`` / ``weight_decay`` / ``adam_betas`` are stored in the
  optimiser state; carried groups of another ``rollout.group_size`` are dropped; a
  checkpoint of layout-free LoRA pieces is resharded to a new ``parallel`` layout or world
  size: :mod:`megagrpo.model.lora_state`);
- changes the experiment mid-run (**warn**: objective, sampling, rewards, seeds) or only the
  bookkeeping (**info**: step budget, logging, checkpoints): logged, then applied.

:func:`check_problem_set` refuses a changed training problem set (the curriculum state is
per problem) and says which keys and which prompt-length decisions changed it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from megagrpo.checkpoint.format import reshardable
from megagrpo.curriculum.dynamic import DynamicSampler
from megagrpo.errors import CheckpointError
from megagrpo.trainer.config import TrainerConfig

log = logging.getLogger(__name__)

REFUSE, ADAPT, WARN, INFO = "refuse", "adapt", "warn", "info"

_LAYOUT = "the LoRA shards and optimiser state are split for the saved layout"
_CURRICULUM = "the curriculum state belongs to the saved level filter"
_OBJECTIVE = "the objective changes mid-run"

RULES: dict[str, tuple[str, str]] = {
    "parallel": (REFUSE, _LAYOUT),
    "model": (WARN, "the policy is built differently from the checkpoint's"),
    "model.hf_path": (REFUSE, "the LoRA weights belong to the saved base model"),
    "model.lora": (REFUSE, "the LoRA weights have the saved shape"),
    "data": (WARN, "the training problem set is checked separately"),
    "data.prompt": (REFUSE, "the prompts of every problem would change"),
    "data.exclude_images": (WARN, "the training problem set is checked separately"),
    "curriculum": (WARN, "the curriculum behaves differently from the checkpoint on"),
    "curriculum.levels_file": (REFUSE, _CURRICULUM),
    "curriculum.keep_levels": (REFUSE, _CURRICULUM),
    "curriculum.level_weights": (REFUSE, _CURRICULUM),
    "curriculum.keep_unprofiled": (REFUSE, _CURRICULUM),
    "curriculum.level_k": (REFUSE, _CURRICULUM),
    "curriculum.seed": (WARN, "the restored sampler walks keep the saved order only in part"),
    "rollout": (WARN, "sampling changes mid-run"),
    "rollout.group_size": (ADAPT, "carried groups of the old size are dropped"),
    "rewards": (WARN, "the reward changes mid-run"),
    "loss": (WARN, _OBJECTIVE),
    "trainer": (INFO, "applies from the next step"),
    "trainer.lr": (ADAPT, "set on the restored optimiser"),
    "trainer.weight_decay": (ADAPT, "set on the restored optimiser"),
    "trainer.adam_betas": (ADAPT, "set on the restored optimiser"),
    "trainer.seed": (WARN, "later rollouts differ from the run's own continuation"),
    "trainer.ppo_epochs": (WARN, _OBJECTIVE),
    "trainer.old_logprobs": (WARN, _OBJECTIVE),
    "dynamic": (INFO, "applies from the next step"),
    "metrics": (INFO, "applies from the next step"),
    "cluster": (INFO, "launcher settings"),
}
"""Dotted key prefix -> (what a change does, why); keys no prefix covers: warn."""


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists are values)."""
    if not isinstance(obj, dict):
        return {prefix: obj}
    out: dict[str, Any] = {}
    for key, value in obj.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def rule_for(key: str) -> tuple[str, str]:
    """The :data:`RULES` entry of the longest dotted prefix of ``key``."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        rule = RULES.get(".".join(parts[:n]))
        if rule is not None:
            return rule
    return WARN, "not covered by a resume rule"


@dataclass(frozen=True)
class Change:
    """One setting that differs from the checkpoint's."""

    key: str
    old: Any
    new: Any
    kind: str
    why: str

    def __str__(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r} ({self.why})"


_RESHARD = "the layout-free LoRA and optimiser state is resharded on load"


def compare_configs(
    saved: dict[str, Any],
    new: dict[str, Any],
    saved_world: Any,
    world: int,
    reshardable: bool = False,
) -> list[Change]:
    """Every key whose value differs (keys only one side has are skipped: another version
    of megagrpo), plus the world size; sorted by key. ``reshardable`` (a checkpoint of
    layout-free LoRA pieces): a changed parallel layout or world size is adapted, not
    refused."""
    old_flat, new_flat = flatten(saved), flatten(new)
    changes = [
        Change(key, old_flat[key], new_flat[key], *rule_for(key))
        for key in sorted(old_flat.keys() & new_flat.keys())
        if old_flat[key] != new_flat[key]
    ]
    if saved_world != world:
        changes.insert(0, Change("world size", saved_world, world, REFUSE, _LAYOUT))
    if reshardable:
        changes = [
            Change(c.key, c.old, c.new, ADAPT, _RESHARD)
            if c.key == "world size" or c.key.startswith("parallel.")
            else c
            for c in changes
        ]
    return changes


def check_resume_config(manifest: dict[str, Any], new: dict[str, Any], world: int) -> list[Change]:
    """Compare the checkpoint's config (``manifest["config"]``) with ``new`` (the resolved
    config as plain data); CheckpointError naming every refused key, else the changes are
    logged (WARNING for adapted and experiment changes, INFO for bookkeeping) and returned.
    A checkpoint without a saved config (previous format) is checked on its layout only."""
    saved = manifest.get("config")
    if not isinstance(saved, dict):
        log.warning("checkpoint has no saved config: only its layout and model are checked")
        saved = {}
    changes = compare_configs(saved, new, manifest.get("world_size"), world, reshardable(manifest))
    refused = [c for c in changes if c.kind == REFUSE]
    if refused:
        raise CheckpointError(
            f"--resume from step {manifest.get('step')}: "
            + "; ".join(map(str, refused))
            + ". Set them back, or start a new run (--overwrite, or another trainer.name)"
        )
    loud = [c for c in changes if c.kind in (ADAPT, WARN)]
    if loud:
        log.warning("resuming with changed settings: %s", "; ".join(map(str, loud)))
    quiet = [c for c in changes if c.kind == INFO]
    if quiet:
        log.info("resuming with changed settings: %s", "; ".join(map(str, quiet)))
    return changes


_PROBLEM_KEYS = ("data.", "rollout.max_model_len", "rollout.max_tokens", "curriculum.")


def check_problem_set(
    saved: dict[str, Any] | None, new: dict[str, Any], changes: list[Change]
) -> None:
    """CheckpointError when the training problems differ from the checkpoint's, saying how
    (counts, prompts the length policy now drops or no longer drops) and which changed keys
    decide the set; ``saved`` None (previous format): left to the sampler's own check."""
    if not saved or saved.get("sha256") == new.get("sha256"):
        return
    parts = [f"{saved.get('count')} -> {new.get('count')} problems"]
    was, now = set(saved.get("dropped") or []), set(new.get("dropped") or [])
    if now - was:
        more = sorted(now - was)
        parts.append(f"the prompt-length policy now drops {len(more)} more (e.g. {more[:5]})")
    if was - now:
        fit = sorted(was - now)
        parts.append(f"{len(fit)} dropped before are kept now (e.g. {fit[:5]})")
    keys = [f"{c.key}: {c.old!r} -> {c.new!r}" for c in changes if c.key.startswith(_PROBLEM_KEYS)]
    parts.append("changed settings: " + ("; ".join(keys) if keys else "none (the data files?)"))
    raise CheckpointError(
        "--resume: the training problem set differs from the checkpoint's ("
        + "; ".join(parts)
        + "); the curriculum state is per problem: resume with the checkpoint's data and "
        "settings, or start a new run (--overwrite, or another trainer.name)"
    )


def apply_optimizer_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    tcfg: TrainerConfig,
) -> None:
    """Put ``trainer.lr`` / ``weight_decay`` / ``adam_betas`` on a restored optimiser (its
    state dict carries the values it was saved with); the learning rate goes through the
    scheduler as it would have from the start (LambdaLR: ``lr * lambda(last_epoch)``).
    Unchanged settings leave every value bit for bit as restored."""
    betas = (
        (float(tcfg.adam_betas[0]), float(tcfg.adam_betas[1])) if tcfg.adam_betas else (0.9, 0.999)
    )
    for group in optimizer.param_groups:
        if group.get("weight_decay") != tcfg.weight_decay:
            group["weight_decay"] = tcfg.weight_decay
        if tuple(group.get("betas", betas)) != betas:
            group["betas"] = betas
        if "initial_lr" in group:
            group["initial_lr"] = tcfg.lr
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if scheduler is not None and lambdas is not None:
        scheduler.base_lrs = [tcfg.lr for _ in optimizer.param_groups]
        for group, fn in zip(optimizer.param_groups, lambdas):
            group["lr"] = tcfg.lr * fn(scheduler.last_epoch)
    else:
        for group in optimizer.param_groups:
            group["lr"] = tcfg.lr


def drop_foreign_carry(dynamic: DynamicSampler, group_size: int) -> int:
    """Drop carried groups whose size is not ``group_size`` (``rollout.group_size`` changed
    on resume: they cannot share a batch with the new ones); returns how many."""
    keep = [g for g in dynamic.carry if g.size == group_size]
    dropped = len(dynamic.carry) - len(keep)
    if dropped:
        log.warning(
            "rollout.group_size is now %d: dropped %d carried group(s) of another size",
            group_size,
            dropped,
        )
    dynamic.carry = keep
    return dropped
