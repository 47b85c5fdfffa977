"""Build a :class:`TrainContext` from a resolved RunConfig, and release it: parallel state,
the run directory (:mod:`megagrpo.trainer.rundir`: refuse to start over a run, find and check
the checkpoint to resume), the data with its prompt lengths checked, Megatron policy with
LoRA, optimiser, the rollout placement and its engine(s), rewards, curriculum + dynamic
sampler (replicated on every rank), loggers; resume. What fails on the user's input fails
before the model is built, and ``config.yaml`` is written only once start-up succeeded.

The policy and engine factories default to the real ones (``megagrpo.model.build_policy``,
``megagrpo.rollout.build_engine``); the loop's unit test passes small fakes.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megagrpo.checkpoint.format import ResumePoint
from megagrpo.checkpoint.plain import rng_state, set_rng_state
from megagrpo.config import save_config
from megagrpo.config.loader import env_keys, written
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
from megagrpo.data.truncation import (
    CharBound,
    PromptPolicyResult,
    apply_prompt_policy,
    measure_prompt,
    prompt_length,
)
from megagrpo.data.variants import rotated_choices
from megagrpo.errors import ConfigError
from megagrpo.gate import compat
from megagrpo.metrics.completions import CompletionsLog, find_wandb_run
from megagrpo.metrics.logger import build_logger
from megagrpo.model import ModelConfig, Policy, build_policy
from megagrpo.model.fingerprint import base_fingerprint
from megagrpo.model.pretrained import resolve_model_path
from megagrpo.parallel import ParallelGroups, destroy_parallel, init_parallel
from megagrpo.parallel.comm import Comm
from megagrpo.placement.bridge import Channel
from megagrpo.placement.partial import PartialRollouts
from megagrpo.placement.rollouts import EngineFactory, build_rollouts
from megagrpo.placement.separate import EngineLink, SeparateRollouts
from megagrpo.rewards import build_composite
from megagrpo.rollout import build_engine
from megagrpo.rollout.base import chat_prompt_ids, default_probe_ids
from megagrpo.trainer.config import RunConfig, TrainerConfig
from megagrpo.trainer.context import TrainContext
from megagrpo.trainer.resume_check import check_problem_set
from megagrpo.trainer.rundir import check_base, confirm_resume_point, prepare_run_dir
from megagrpo.trainer.sync import check_sync_exactness, first_probes, start_engines
from megagrpo.trainer.train_state import problem_set, restore_checkpoint
from megagrpo.types import Problem

log = logging.getLogger(__name__)

PolicyFactory = Callable[[ModelConfig, ParallelGroups], Policy]


def seed_everything(seed: int) -> None:
    """python, numpy and torch RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


MIN_LEVEL_COVERAGE = 0.5
"""Share of the training problems a levels file must describe (below: a ConfigError)."""


def matching_levels(levels: dict[str, int], problems: list, source: str) -> dict[str, int]:
    """The levels of the training ``problems`` only; ConfigError naming ``source`` when it
    describes fewer than :data:`MIN_LEVEL_COVERAGE` of them (another data set: the level
    filter would do nothing and the predicted ACR would be another set's), a WARNING when
    some lack a level."""
    ids = [p.id for p in problems]
    mine = {i: levels[i] for i in ids if i in levels}
    if len(mine) < MIN_LEVEL_COVERAGE * len(ids):
        raise ConfigError(
            f"config key 'curriculum.levels_file': {source} has levels for {len(mine)} of the "
            f"{len(ids)} training problems (ids such as {ids[:2]} vs {list(levels)[:2]}): it "
            "describes other problems; make it for data.train (megagrpo profile)"
        )
    if len(mine) < len(ids):
        log.warning(
            "%s: %d of %d training problems have no level (kept, sampled as unlevelled); "
            "the predicted ACR uses the %d that have one",
            source,
            len(ids) - len(mine),
            len(ids),
            len(mine),
        )
    return mine


def _curriculum(
    cfg: RunConfig, problems: list, correctness_key: str
) -> tuple[CurriculumSampler, float | None]:
    levels, acr, k = None, None, cfg.curriculum.level_k
    if cfg.curriculum.levels_file:
        records = read_levels_file(cfg.curriculum.levels_file)
        levels = matching_levels(levels_by_id(records), problems, cfg.curriculum.levels_file)
        k = int(records[0].get("k", cfg.curriculum.level_k)) if records else cfg.curriculum.level_k
        hist = histogram(levels.values(), k + 1)  # of the training problems only
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
    """The dynamic sampler, with the rollout budget's planner unless ``budget.mode`` is
    uniform (G answers per problem)."""
    budget = cfg.budget
    planner = None
    if budget.mode != "uniform":
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

    warmup, total = tcfg.num_warmup_steps, tcfg.max_steps  # optimiser steps
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


def load_tokenizer(model_path: str) -> Any:
    """The tokenizer the engines load (``AutoTokenizer`` of the model directory)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _pad_id(tokenizer: Any) -> int:
    """Padding id of the trainer's micro-batches (masked out: any valid id works)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad or 0)


@dataclass
class RunData:
    """The problems a run uses, after the prompt-length policy."""

    train: list[Problem]
    eval: list[Problem]
    problem_set: dict[str, Any]
    """The training set as checkpoints record it (:func:`train_state.problem_set`)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``data/prompts_dropped`` / ``data/prompts_truncated`` of the training set."""


def fit_prompts(
    problems: list[Problem], tokenizer: Any, cfg: RunConfig, where: str
) -> PromptPolicyResult:
    """Apply ``data.truncation`` to the prompts longer than ``data.max_prompt_tokens``,
    counted with the engines' own tokenisation (:func:`chat_prompt_ids`); DataError naming
    the problems under ``error``."""
    limit = cfg.data.max_prompt_tokens or cfg.rollout.max_model_len - cfg.rollout.max_tokens
    bound = CharBound(tokenizer)
    left = cfg.data.truncation == "left"
    ids = [measure_prompt(tokenizer, p, limit, bound, left) for p in problems]
    for i, p in enumerate(problems):  # data.variants: the longest rendering decides
        for k in range(len(p.meta.get("variants") or [])):
            longer = measure_prompt(tokenizer, p.variant(k), limit, bound, False)
            n = prompt_length(longer)
            if n > limit and left:
                raise ConfigError(
                    f"config key 'data.truncation': 'left' cannot cut the variants of problem "
                    f"{p.id} ({p.meta.get('source', where)}; variant {k} has {n} "
                    f"tokens > {limit}): use delete or error, or data.variants=ignore"
                )
            if n > prompt_length(ids[i]):
                ids[i] = longer
    result = apply_prompt_policy(problems, ids, limit, cfg.data.truncation, where=where)
    truncated = set(result.truncated)
    cut = [p for p in result.problems if p.id in truncated][:1]
    if cut and len(chat_prompt_ids(tokenizer, cut[0])) > limit:
        raise ConfigError(
            "config key 'data.truncation': 'left' needs engines that take the truncated "
            "prompt (meta['prompt_ids']); this build's rollout.base.chat_prompt_ids does "
            "not: use delete or error"
        )
    return result


def check_golds_scorable(cfg: RunConfig, problems: list) -> None:
    """mcq_accuracy scores option letters and numbers: a training problem whose solution is
    free text (``\\frac{3}{4}``, a sentence) is a ConfigError before step 1, naming where,
    not a reward error at every step."""
    names = [f.name for f in cfg.rewards.functions]
    if "mcq_accuracy" not in names:
        return
    free = [p for p in problems if not p.answer]
    if free:
        first = free[0]
        raise ConfigError(
            f"config key 'rewards.functions.{names.index('mcq_accuracy')}.name': mcq_accuracy "
            f"scores option letters or numbers, but {len(free)} training problem(s) have a "
            f"free-text solution, first {first.meta.get('source', first.id)}: "
            f"{str(first.meta.get('solution', ''))[:60]!r}; use 'orms:accuracy' (ms-swift's "
            "math_verify) for such golds, or fix the data"
        )


def warn_overlap(train: list[Problem], held_out: list[Problem]) -> int:
    """WARNING with the count of held-out problems that are also training problems (same
    id, or the same prompt): their accuracy is not held-out. Returns that count."""

    def prompt(p: Problem) -> str:
        return "\0".join(str(m.get("content", "")) for m in p.messages)

    ids, prompts = {p.id for p in train}, {prompt(p) for p in train}
    shared = [p.id for p in held_out if p.id in ids or prompt(p) in prompts]
    if shared:
        log.warning(
            "data.eval: %d of %d held-out problems are also in data.train (e.g. %s): "
            "eval/* on them measures training problems, not held-out ones",
            len(shared),
            len(held_out),
            ", ".join(shared[:3]),
        )
    return len(shared)


def load_run_data(cfg: RunConfig, tokenizer: Any) -> RunData:
    """``data.train`` / ``data.eval`` loaded, prompt lengths checked (before step 1, before
    any model is built); ConfigError when no training problem is left."""
    data = cfg.data
    columns = data.column_map()
    train = load_problems(
        data.train, exclude_images=data.exclude_images, prompt=data.prompt, columns=columns
    )
    if not train:
        raise ConfigError("config key 'data.train': no training problems found")
    if data.variants == "rotate":
        for p in train:
            rotations = [] if p.meta.get("variants") else rotated_choices(p, data.prompt)
            if rotations:
                p.meta["variants"] = rotations
    with_variants = [p for p in train if p.meta.get("variants")]
    if with_variants and data.variants == "ignore":
        for p in with_variants:
            del p.meta["variants"]
    elif with_variants and cfg.rollout.partial.enabled:
        raise ConfigError(
            "config key 'data.variants': per_member is not supported with "
            f"rollout.partial.enabled ({len(with_variants)} training problems list variants, "
            f"first {with_variants[0].meta.get('source', with_variants[0].id)}): set "
            "data.variants=ignore or rollout.partial.enabled=false"
        )
    if cfg.rewards.functions[0].name == "mcq_accuracy" and len(train.free_text_gold) == len(train):
        raise ConfigError(
            "config key 'data.train': no problem has a letter or number gold answer, so "
            "mcq_accuracy scores every completion 0 (map the gold column with data.columns, "
            "or use a reward for free-text answers)"
        )
    fitted = fit_prompts(list(train), tokenizer, cfg, "data.train")
    if not fitted.problems:
        raise ConfigError(
            f"config key 'data.max_prompt_tokens': all {len(train)} training prompts are "
            f"longer than {data.max_prompt_tokens} tokens (data.truncation={data.truncation}); "
            "raise rollout.max_model_len"
        )
    held_out: list[Problem] = []
    if data.eval:
        held_out = list(
            load_problems(
                data.eval, exclude_images=data.exclude_images, prompt=data.prompt, columns=columns
            )
        )
        held_out = fit_prompts(held_out, tokenizer, cfg, "data.eval").problems
        warn_overlap(fitted.problems, held_out)
    if cfg.trainer.eval_max_problems:
        held_out = held_out[: cfg.trainer.eval_max_problems]
    record = problem_set([p.id for p in fitted.problems], fitted.dropped, fitted.truncated)
    return RunData(fitted.problems, held_out, record, fitted.metrics())


def build_context(
    cfg: RunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    policy_factory: PolicyFactory = build_policy,
    engine_factory: EngineFactory = build_engine,
    channel: EngineLink | Channel | None = None,
    allow_base_change: bool = False,
) -> TrainContext:
    """Everything a run needs, on every rank (see module docstring); ``cfg`` is resolved
    (:meth:`RunConfig.resolve`, done by the loader) and saved as the run's config.yaml once
    start-up has succeeded.

    Args:
        resume: continue from the newest checkpoint of the run directory that verifies
            (CheckpointError when there is none, or when a setting changed that the
            checkpoint cannot continue under); the engines are then synced to it.
        overwrite: move a run already in the directory aside instead of refusing to start.
        channel: ``rollout.placement: separate``: this trainer rank's links to the engine
            ranks (:class:`~megagrpo.placement.separate.EngineLink`; a bare channel: one engine
            rank; the engine ranks never build a context).
        allow_base_change: resume although the base weights under ``model.hf_path`` are not
            those the checkpoint was trained on (:func:`rundir.check_base`).
    """
    pgs = init_parallel(cfg.parallel)
    comm = Comm(pgs)
    run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.name
    point, changes, lock = prepare_run_dir(cfg, run_dir, comm, resume=resume, overwrite=overwrite)
    try:
        factories = (policy_factory, engine_factory)
        ctx = _build(cfg, pgs, run_dir, point, changes, factories, channel, allow_base_change)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    ctx.run_lock = lock
    return ctx


def _build(
    cfg: RunConfig,
    pgs: ParallelGroups,
    run_dir: Path,
    point: ResumePoint | None,
    changes: list,
    factories: tuple[PolicyFactory, EngineFactory],
    channel: EngineLink | Channel | None = None,
    allow_base_change: bool = False,
) -> TrainContext:
    """:func:`build_context` once the run directory is locked and checked."""
    comm = Comm(pgs)
    policy_factory, engine_factory = factories
    model_path, base = comm.broadcast_object(
        _model_and_base(cfg.model.hf_path) if comm.is_main else None
    )
    # the pinned upstream rules for this world and model, before any model or engine starts
    hf = compat.read_hf_config(model_path)
    compat.enforce(cfg, hf, comm.world_size)
    tokenizer = load_tokenizer(model_path)
    data = load_run_data(cfg, tokenizer)
    if point is not None:  # the checkpoint's values, the base weights, the problem set
        vocab = (hf or {}).get("vocab_size")
        count = int(data.problem_set["count"])
        check_problem_set(point.manifest.get("problems"), data.problem_set, changes)
        point, again = confirm_resume_point(cfg, run_dir, point, comm, count, vocab)
        if again is not None:  # an earlier checkpoint: its settings and problems again
            check_problem_set(point.manifest.get("problems"), data.problem_set, again)
        check_base(point, base, cfg.model.hf_path, allow_base_change, model_path)
    seed_everything(cfg.trainer.seed + comm.rank)
    policy = policy_factory(dataclasses.replace(cfg.model, hf_path=model_path), pgs)
    shared, why = cfg.shared_prefix_decision(policy.spec)
    if comm.is_main:  # once per run: trainer.shared_prefix
        log.info(
            "shared prefix: %s", "on (each prompt once per group)" if shared else f"off: {why}"
        )
    optimizer, scheduler = _optimizer(cfg, policy)
    reward_fn = build_composite(
        cfg.rewards,
        run_args={  # what ms-swift ORM classes read from their `args`
            "max_completion_length": cfg.rollout.max_tokens,
            "num_generations": cfg.rollout.group_size,
            "temperature": cfg.rollout.temperature,
        },
    )
    check_golds_scorable(cfg, data.train)
    correctness = cfg.curriculum_signal() or reward_fn.names[0]
    sampler, acr = _curriculum(cfg, data.train, correctness)
    ctx = TrainContext(
        cfg=cfg,
        comm=comm,
        pgs=pgs,
        run_dir=run_dir,
        policy=policy,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        dynamic=_dynamic(cfg, correctness, acr),
        reward_fn=reward_fn,
        eval_problems=data.eval,
        pad_id=_pad_id(tokenizer),
        problem_set=data.problem_set,
        data_metrics=data.metrics,
        base_fingerprint=base,
    )
    if cfg.rollout.partial.enabled:
        ctx.partial = PartialRollouts(cfg.rollout.partial, cfg.rollout.max_tokens, cfg.trainer.seed)
    if point is not None:
        restore_checkpoint(ctx, point)
    start_rollouts(ctx, tokenizer, model_path, engine_factory, point is not None, channel)
    open_run(ctx)
    return ctx


def _model_and_base(hf_path: str) -> tuple[str, dict[str, Any]]:
    """The local model directory of ``model.hf_path`` and its base weights' fingerprint."""
    path = resolve_model_path(hf_path)
    return str(path), base_fingerprint(path)


def start_rollouts(
    ctx: TrainContext,
    tokenizer: Any,
    model_path: str,
    engine_factory: EngineFactory,
    resumed: bool,
    channel: EngineLink | Channel | None = None,
) -> None:
    """Start the engines and give them the policy's weights (collective). With
    ``offload_during_rollout`` the trainer's probes are computed first (on the probe sequence
    the engines derive from the same tokenizer) and its frozen weights leave the device before
    the engines allocate theirs; otherwise the probes follow the start. Engines started from
    dummy weights then load the real ones through one verified sync
    (:func:`megagrpo.trainer.sync.start_engines`). The RNG states are kept across the
    engines' start-up (a resumed run continues identically)."""
    cfg = ctx.cfg
    dummy = cfg.rollout.load_format == "dummy"
    probe_ids = default_probe_ids(tokenizer, cfg.rollout.probe_len)
    early = cfg.trainer.offload_during_rollout
    probes = first_probes(ctx, probe_ids, dummy or resumed) if early else None
    ctx.offload.for_generation()
    rng = rng_state()
    if cfg.rollout.placement == "separate":  # the engine runs on its own rank
        ctx.rollouts = SeparateRollouts(
            channel,
            ctx.comm,
            ctx.reward_fn,
            cfg.rollout.resolved_max_staleness(),
            cfg.rollout.sync_bucket_mb,
        )
        ctx.rollouts.attach(ctx.policy, ctx.step)  # its owner ranks feed the adapter
    else:
        ctx.rollouts = build_rollouts(
            cfg.rollout,
            ctx.comm,
            model_path,
            cfg.trainer.seed,
            ctx.reward_fn,
            engine_factory,
            torch.cuda.is_available(),
        )
    set_rng_state(rng)
    if probes is None or ctx.rollouts.probe_token_ids != probe_ids:
        ctx.offload.for_training()  # (an engine with its own probe sequence: test fakes)
        probes = first_probes(ctx, ctx.rollouts.probe_token_ids, dummy or resumed)
    check_sync_exactness(ctx, model_path, compat.read_hf_config(model_path))
    start_engines(ctx, probes, resumed)
    ctx.rollouts.resume_verifiers(ctx.resumed_verifiers)  # the checks continue as saved


def open_run(ctx: TrainContext) -> None:
    """The last of start-up: the metric loggers (rows after the resumed step dropped), the
    completions log, then config.yaml (a start that failed earlier leaves the previous one
    in place)."""
    cfg = ctx.cfg
    names = {"metrics.wandb_project", "metrics.wandb_entity", "trainer.name"}
    for key in sorted(env_keys(cfg) & names if cfg.metrics.wandb_mode != "disabled" else ()):
        log.warning("%s comes from the environment: W&B records its value as it is", key)
    ctx.logger = build_logger(
        cfg.metrics,
        ctx.run_dir,
        rank=ctx.comm.rank,
        name=cfg.trainer.name,
        total_steps=cfg.trainer.max_steps,
        start_step=ctx.step,
        config=json_safe(written(cfg)),
    )
    if cfg.metrics.log_completions and ctx.comm.is_main:
        ctx.completions = CompletionsLog(
            ctx.run_dir / "completions.jsonl",
            table_every=cfg.metrics.completions_table_every,
            wandb_run=find_wandb_run(ctx.logger),
            prompt_chars=cfg.metrics.completions_prompt_chars,
        )
        ctx.completions.truncate_after(ctx.step)
    if ctx.comm.is_main:
        save_config(cfg, ctx.run_dir)
    log.info(
        "run dir %s, world %d, starting at step %d of %d",
        ctx.run_dir,
        ctx.comm.world_size,
        ctx.step,
        cfg.trainer.max_steps,
    )


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
    """Release the engines, the process groups and the run directory's lock."""
    try:
        ctx.rollouts.close()
        try:
            destroy_parallel()
        except Exception:  # noqa: BLE001 - best effort at exit
            log.debug("destroy_parallel failed", exc_info=True)
    finally:
        if ctx.run_lock is not None:
            ctx.run_lock.release()
