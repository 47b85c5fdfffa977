"""Build a :class:`TrainContext` from a resolved RunConfig, and release it: parallel state,
Megatron policy with LoRA, optimiser, the rollout placement and its engine(s), rewards,
curriculum + dynamic sampler (replicated on every rank), loggers; resume.

The policy and engine factories default to the real ones (``megagrpo.model.build_policy``,
``megagrpo.rollout.build_engine``); the loop's unit test passes small fakes.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megagrpo.config import save_config
from megagrpo.curriculum.budget_rounds import BudgetPlanner
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
from megagrpo.errors import ConfigError
from megagrpo.metrics.completions import CompletionsLog, find_wandb_run
from megagrpo.metrics.logger import build_logger
from megagrpo.model import ModelConfig, Policy, build_policy
from megagrpo.model.pretrained import resolve_model_path
from megagrpo.parallel import ParallelGroups, destroy_parallel, init_parallel
from megagrpo.rewards import build_composite
from megagrpo.rollout import build_engine
from megagrpo.trainer.checkpoint import latest, restore_checkpoint
from megagrpo.trainer.config import RunConfig, TrainerConfig
from megagrpo.trainer.context import Comm, TrainContext
from megagrpo.trainer.rollouts import EngineFactory, build_rollouts
from megagrpo.trainer.sync import sync_weights, trainer_probe

log = logging.getLogger(__name__)

PolicyFactory = Callable[[ModelConfig, ParallelGroups], Policy]


def seed_everything(seed: int) -> None:
    """python, numpy and torch RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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


def _dynamic(cfg: RunConfig, correctness_key: str, acr: float | None) -> DynamicSampler:
    """The dynamic sampler, with the rollout budget's planner unless ``rollout.budget`` is
    uniform (G answers per problem)."""
    budget = cfg.budget_config()
    planner = None
    if budget.budget != "uniform":
        planner = BudgetPlanner(
            budget,
            cfg.rollout.group_size,
            cfg.trainer.batch_groups,
            correctness_key,
            tau=cfg.dynamic.tau,
            max_staleness=cfg.dynamic.carry_max_staleness,
        )
    return DynamicSampler(
        cfg.dynamic,
        correctness_key=correctness_key,
        acr_predicted=acr,
        group_size=cfg.rollout.group_size,
        budget=planner,
    )


def _optimizer(
    cfg: RunConfig, policy: Policy
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None]:
    params = [p for p in policy.lora_parameters() if p.requires_grad]
    if not params:
        raise ConfigError("config key 'model.lora.targets': no trainable LoRA parameters")
    betas = (
        (float(cfg.trainer.adam_betas[0]), float(cfg.trainer.adam_betas[1]))
        if cfg.trainer.adam_betas
        else (0.9, 0.999)
    )
    opt = torch.optim.AdamW(
        params, lr=cfg.trainer.lr, betas=betas, weight_decay=cfg.trainer.weight_decay
    )
    sched = lr_scheduler(opt, cfg.trainer)
    return opt, sched


def lr_scheduler(
    opt: torch.optim.Optimizer, tcfg: TrainerConfig
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """``trainer.lr_schedule`` after ``trainer.num_warmup_steps`` of linear warm-up, with
    transformers' schedulers (the ones ms-swift and TRL use); None: a constant rate."""
    from transformers import get_scheduler

    warmup, total = tcfg.num_warmup_steps, tcfg.max_steps * tcfg.ppo_epochs
    if tcfg.lr_schedule == "constant":
        return get_scheduler("constant_with_warmup", opt, warmup) if warmup else None
    if tcfg.lr_schedule == "cosine":
        return get_scheduler(
            "cosine_with_min_lr",
            opt,
            warmup,
            total,
            scheduler_specific_kwargs={"min_lr": tcfg.min_lr},
        )
    return get_scheduler(  # linear decay to min_lr (warmup-stable-decay without a plateau)
        "warmup_stable_decay",
        opt,
        warmup,
        total,
        scheduler_specific_kwargs={
            "num_decay_steps": total - warmup,
            "decay_type": "linear",
            "min_lr_ratio": tcfg.min_lr / tcfg.lr,
        },
    )


def _pad_id(model_path: Path) -> int:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0)
    except Exception:  # noqa: BLE001 - padding is masked out anyway
        return 0


def _problems(cfg: RunConfig) -> tuple[list, list]:
    """(training problems, held-out problems) of ``data.train`` / ``data.eval``."""
    data = cfg.data
    columns = data.column_map()
    train = load_problems(
        data.train, exclude_images=data.exclude_images, prompt=data.prompt, columns=columns
    )
    if not train:
        raise ConfigError("config key 'data.train': no training problems found")
    if cfg.rewards.functions[0].name == "mcq_accuracy" and len(train.free_text_gold) == len(train):
        raise ConfigError(
            "config key 'data.train': no problem has a letter or number gold answer, so "
            "mcq_accuracy scores every completion 0 (map the gold column with data.columns, "
            "or use a reward for free-text answers)"
        )
    held_out = []
    if data.eval:
        held_out = list(
            load_problems(
                data.eval, exclude_images=data.exclude_images, prompt=data.prompt, columns=columns
            )
        )
    if cfg.trainer.eval_max_problems:
        held_out = held_out[: cfg.trainer.eval_max_problems]
    return list(train), held_out


def build_context(
    cfg: RunConfig,
    *,
    resume: bool = False,
    policy_factory: PolicyFactory = build_policy,
    engine_factory: EngineFactory = build_engine,
) -> TrainContext:
    """Everything a run needs, on every rank (see module docstring); ``cfg`` is resolved
    (:meth:`RunConfig.resolve`, done by the loader) and saved as the run's config.yaml.

    Args:
        resume: continue from the newest complete checkpoint in the run directory
            (CheckpointError when there is none); the engines are then synced to it.
    """
    pgs = init_parallel(cfg.parallel)
    comm = Comm(pgs)
    run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.name
    model_path = comm.broadcast_object(
        str(resolve_model_path(cfg.model.hf_path)) if comm.is_main else None
    )
    if comm.is_main:
        save_config(cfg, run_dir)
    seed_everything(cfg.trainer.seed + comm.rank)
    policy = policy_factory(dataclasses.replace(cfg.model, hf_path=model_path), pgs)
    optimizer, scheduler = _optimizer(cfg, policy)
    reward_fn = build_composite(
        cfg.rewards,
        run_args={  # what ms-swift ORM classes read from their `args`
            "max_completion_length": cfg.rollout.max_tokens,
            "num_generations": cfg.rollout.group_size,
            "temperature": cfg.rollout.temperature,
        },
    )
    train_problems, eval_problems = _problems(cfg)
    correctness = reward_fn.names[0]
    sampler, acr = _curriculum(cfg, train_problems, correctness)
    rollouts = build_rollouts(
        cfg.rollout,
        comm,
        model_path,
        cfg.trainer.seed,
        reward_fn,
        engine_factory,
        torch.cuda.is_available(),
    )
    ctx = TrainContext(
        cfg=cfg,
        comm=comm,
        pgs=pgs,
        run_dir=run_dir,
        policy=policy,
        optimizer=optimizer,
        scheduler=scheduler,
        rollouts=rollouts,
        sampler=sampler,
        dynamic=_dynamic(cfg, correctness, acr),
        reward_fn=reward_fn,
        eval_problems=eval_problems,
        pad_id=_pad_id(Path(model_path)),
    )
    if resume:
        restore_checkpoint(ctx)
        sync_weights(ctx)  # the engines start from the base weights: give them the adapters
    else:  # zero LoRA B: the trainer's probe of the base weights the engines loaded
        ctx.rollouts.last_probe = trainer_probe(ctx, ctx.rollouts.probe_token_ids)
        if comm.is_main and latest(ctx.ckpt_root) is not None:
            log.warning(
                "%s already holds checkpoints: starting again from step 0 (its "
                "metrics.jsonl is rewritten); pass --resume to continue instead",
                run_dir,
            )
    ctx.logger = build_logger(
        cfg.metrics,
        run_dir,
        rank=comm.rank,
        name=cfg.trainer.name,
        total_steps=cfg.trainer.max_steps,
        start_step=ctx.step,
        config=json_safe(dataclasses.asdict(cfg)),
    )
    if cfg.metrics.log_completions and comm.is_main:
        ctx.completions = CompletionsLog(
            run_dir / "completions.jsonl",
            table_every=cfg.metrics.completions_table_every,
            wandb_run=find_wandb_run(ctx.logger),
            prompt_chars=cfg.metrics.completions_prompt_chars,
        )
        ctx.completions.truncate_after(ctx.step)
    log.info(
        "run dir %s, world %d, starting at step %d of %d",
        run_dir,
        comm.world_size,
        ctx.step,
        cfg.trainer.max_steps,
    )
    return ctx


def json_safe(obj: Any) -> Any:
    """Plain JSON types (for W&B config)."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def finish(ctx: TrainContext) -> None:
    """After the last step: export the PEFT adapter (rank 0 writes; collective)."""
    if not ctx.cfg.trainer.export_adapter:
        return
    out = ctx.policy.export_peft_adapter(ctx.run_dir / "adapter")
    if out is not None:
        log.info("PEFT adapter written to %s", out)


def shutdown(ctx: TrainContext) -> None:
    """Release the engines and the process groups."""
    ctx.rollouts.close()
    try:
        destroy_parallel()
    except Exception:  # noqa: BLE001 - best effort at exit
        log.debug("destroy_parallel failed", exc_info=True)
