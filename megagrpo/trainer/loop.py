"""The GRPO loop: one readable step function, every phase one call, the same code on every rank.

    1-2. draw problems -> generate G answers each + rewards, in rounds of bounded dynamic
         sampling (the trainer generates, the curriculum decides: :func:`collect_batch`)
    3.   group advantages                 4. engines sleep (before the first update)
    5.   Megatron fwd/bwd with the fused loss over micro-batches -> optimiser step on LoRA
    6.   verified weight sync (engines wake in stages)  7. evaluation
    8.   metrics row                                  9. checkpoint

One step is one optimiser step. Phases 1-3 run every ``trainer.mini_batches x ppo_epochs``
steps: each step trains one mini-batch of the generated batch
(:mod:`megagrpo.trainer.minibatch`), and phase 6 runs when the engines are needed next (the
next step generates, an evaluation, the end). With the defaults (1 x 1) every step does all.

Where generation runs (rank 0, or every rank's engine replica) is hidden by
``ctx.rollouts`` (:mod:`megagrpo.placement.rollouts`); the samplers are replicated, so every rank
takes the same decisions without waiting to be told.

MoE routing replay (``model.routing_replay``) happens inside phase 5; its
``train/routing_agreement`` (and ``train/logprob_mismatch`` when old log-probs are recomputed)
come with the loss metrics of the step's row.

What it deliberately drops: value baselines, generation more than one step ahead of training
(``rollout.placement: separate`` generates at most one: :mod:`megagrpo.placement.separate`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from megagrpo.algo.advantages import flat_group_advantages, group_advantages, weight_positive
from megagrpo.curriculum.budget_rounds import pool_baselines
from megagrpo.curriculum.dynamic import FilledBatch
from megagrpo.metrics.answers import answer_bias_warning
from megagrpo.metrics.names import (
    group_std_mean,
    required_metrics,
    swift_aliases,
    swift_reward_names,
)
from megagrpo.parallel.signals import StopSignals
from megagrpo.placement.rollouts import evaluate, round_seed
from megagrpo.rewards.answers import answer_bias
from megagrpo.rewards.balance import answer_excess, balance_penalties
from megagrpo.trainer.ahead import overlap_metrics, submit_ahead, take_ahead
from megagrpo.trainer.context import TrainContext
from megagrpo.trainer.generated import Generated
from megagrpo.trainer.kl_reward import sequence_kl, set_advantages
from megagrpo.trainer.minibatch import new_batch, prepare, train_next
from megagrpo.trainer.optimize import stop_on_nonfinite
from megagrpo.trainer.sync import sync_weights
from megagrpo.trainer.train_state import save_checkpoint
from megagrpo.types import Group

log = logging.getLogger(__name__)


@dataclass
class GenStats:
    """What one step generated, over all of its rounds."""

    rounds: int = 0
    gen_tokens: float = 0.0
    gen_seqs: float = 0.0
    clipped: float = 0.0
    raw_reward_mean: float = 0.0
    """Mean reward of the first (raw, pre-filter) round."""
    answer_bias: dict[str, float] = field(default_factory=dict)
    """``collapse/answer_bias*`` of the first round (:mod:`megagrpo.rewards.answers`)."""
    excess: dict[str, float] | None = None
    """``rewards.answer_balance``: the first round's answer excess (None: not measured)."""

    def add(self, groups: list[Group]) -> None:
        if self.rounds == 0:
            raw = [r for g in groups for r in g.rewards]
            self.raw_reward_mean = sum(raw) / max(len(raw), 1)
            self.answer_bias = answer_bias(groups)
        self.rounds += 1
        self.gen_tokens += sum(sum(g.lengths) for g in groups)
        self.gen_seqs += sum(g.size for g in groups)
        self.clipped += sum(1 for g in groups for r in g.finish_reasons if r == "length")

    def measure_excess(self, groups: list[Group], coef: float) -> None:
        """``rewards.answer_balance``: the answer excess of the first round."""
        if coef > 0 and self.excess is None:
            self.excess = answer_excess(groups)


def collect_batch(ctx: TrainContext, step: int) -> tuple[FilledBatch, GenStats]:
    """Phases 1-2: generate and score rounds until the dynamic sampler has decided the batch
    (at most 1 + R rounds: :class:`megagrpo.curriculum.rounds.Rounds`)."""
    stats = GenStats()
    balance = ctx.cfg.rewards.answer_balance
    partial = ctx.partial
    if partial is not None:
        partial.begin_step()
    ahead = take_ahead(ctx, step)  # placement separate: started while the last step trained
    if ahead is None:
        rounds = ctx.dynamic.start(ctx.sampler, ctx.cfg.trainer.batch_groups, step)
    else:
        rounds, first = ahead
        if first is not None:
            stats.add(first)
            stats.measure_excess(first, balance)
            rounds.add(first)
    while (requests := rounds.next_requests()) is not None:  # G each, or the budget's n
        problems, counts = [r.problem for r in requests], [r.n for r in requests]
        if partial is not None:  # rollout.partial: finished groups, carried ones first
            groups = partial.generate_round(ctx.rollouts, problems, counts, step, stats.rounds)
        else:
            seed = round_seed(ctx.cfg.trainer.seed, step, stats.rounds)
            groups = ctx.rollouts.generate_round(problems, counts, seed)
        stats.add(groups)
        stats.measure_excess(groups, balance)
        rounds.add(groups)
    batch = rounds.finish()
    if partial is not None:
        batch.stats.update(partial.metrics())
    return batch, stats


def compute_advantages(
    ctx: TrainContext, groups: list[Group], penalty: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Group-normalised advantages of the batch, one ``[G_n]`` row per group ([] for an
    empty batch). Groups of different sizes (rollout budgets) are normalised each by its
    own statistics, or by those of every answer generated for its problem in the step
    (``budget.advantage_baseline: pool``, Reinforce-Ada). ``penalty``: one ``[G_n]`` row per
    group taken off the rewards first (``loss.kl_in_reward``)."""
    if not groups:
        return []
    if penalty is not None:
        groups = [
            dataclasses.replace(g, rewards=[r - float(p) for r, p in zip(g.rewards, pen)])
            for g, pen in zip(groups, penalty)
        ]
    scale = ctx.cfg.loss.resolved_advantage_scale()
    weight = ctx.cfg.loss.positive_weight
    sizes = [g.size for g in groups]
    estimator = ctx.cfg.loss.advantage_estimator
    if ctx.cfg.budget.advantage_baseline != "pool" and len(set(sizes)) == 1:
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        adv = group_advantages(rewards, scale=scale, estimator=estimator)
        return list(weight_positive(adv, weight).unbind(0))
    if estimator != "grpo":
        raise ValueError(f"loss.advantage_estimator={estimator}: groups of one size only")
    flat_rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64)
    mean = std = None
    if ctx.cfg.budget.advantage_baseline == "pool":
        mean, std = (torch.from_numpy(x) for x in pool_baselines(groups))
    flat = flat_group_advantages(flat_rewards, sizes, scale, baseline_mean=mean, baseline_std=std)
    return list(torch.split(weight_positive(flat, weight), sizes))


def answer_balance(
    ctx: TrainContext,
    groups: list[Group],
    adv: list[torch.Tensor],
    excess: dict[str, float] | None,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """``rewards.answer_balance``: each completion's penalty for an over-used answer, centred
    on its group, taken off its advantage (:mod:`megagrpo.rewards.balance`); with
    ``reward/answer_balance_penalty``, the trained completions' mean penalty."""
    coef = ctx.cfg.rewards.answer_balance
    if coef <= 0 or excess is None or not groups:
        return adv, {}
    pens = balance_penalties(groups, excess, coef)
    out = []
    for a, pen in zip(adv, pens):
        p = torch.tensor(pen, dtype=a.dtype)
        out.append(a - (p - p.mean()))
    mean = sum(sum(p) for p in pens) / max(sum(len(p) for p in pens), 1)
    return out, {"reward/answer_balance_penalty": mean}


def effective_metrics(gen: GenStats, adv: list[torch.Tensor]) -> dict[str, float]:
    """``budget/generated_completions`` (every round of the step),
    ``budget/effective_completions`` (trained completions with a non-zero advantage: the
    ones that carry a policy gradient) and ``budget/effective_ratio`` (their quotient: the
    figure of merit of rollout budgets, ``megagrpo plan --budget``)."""
    effective = float(sum(int((a != 0).sum()) for a in adv))
    return {
        "budget/generated_completions": gen.gen_seqs,
        "budget/effective_completions": effective,
        "budget/effective_ratio": effective / gen.gen_seqs if gen.gen_seqs else 0.0,
    }


def batch_metrics(ctx: TrainContext, groups: list[Group], gen: GenStats) -> dict[str, float]:
    """``reward/*`` and ``length/*`` of the trained batch."""
    out: dict[str, float] = {}
    if groups:
        out["reward/mean"] = float(np.mean([r for g in groups for r in g.rewards]))
        out["reward/std"] = float(np.std([r for g in groups for r in g.rewards]))
        out["reward/group_std_mean"] = group_std_mean([list(g.rewards) for g in groups])
        for name in ctx.reward_fn.names:
            values = [v for g in groups for v in g.reward_parts.get(name, [])]
            out[f"reward/{name}/mean"] = float(np.mean(values or [0.0]))
            out[f"reward/{name}/std"] = float(np.std(values or [0.0]))
        out["length/mean"] = float(np.mean([n for g in groups for n in g.lengths]))
        out["length/min"] = float(min(n for g in groups for n in g.lengths))
        out["length/max"] = float(max(n for g in groups for n in g.lengths))
    out["reward/mean_raw"] = gen.raw_reward_mean  # first generation, before filtering
    out.update(gen.answer_bias)  # one answer across problems: guessing, not solving
    out["length/clip_ratio"] = gen.clipped / max(gen.gen_seqs, 1.0)  # every round
    reasons = [r for g in groups for r in g.finish_reasons]  # the trained batch (ms-swift's)
    out["length/clip_ratio_trained"] = reasons.count("length") / max(len(reasons), 1)
    out["length/gen_mean"] = gen.gen_tokens / max(gen.gen_seqs, 1.0)
    return out


def generate_batch(ctx: TrainContext, step: int) -> tuple[dict[str, float], GenStats]:
    """Phases 1-3 (every ``mini_batches x ppo_epochs`` steps): generate and score the batch,
    its group advantages, the completions log; ``ctx.generated`` holds it for the optimiser
    steps on it (:mod:`megagrpo.trainer.minibatch`). Returns its metrics and generation."""
    with ctx.timed("gen"):  # 1-2: problems -> rollouts -> rewards, dynamic sampling
        ctx.offload.for_generation()  # frozen weights + moments on the host (if configured)
        batch, gen = collect_batch(ctx, step)
    adv = compute_advantages(ctx, batch.groups)  # 3
    adv, balance = answer_balance(ctx, batch.groups, adv, gen.excess)
    if ctx.completions is not None and not _kl_in_reward(ctx):  # rank 0: what is trained on
        ctx.completions.log(step, batch.groups, levels=ctx.sampler.level_of, advantages=adv)
    ctx.generated = new_batch(ctx, step, batch.groups, adv)
    metrics = {**batch.stats, **batch_metrics(ctx, batch.groups, gen)}
    metrics.update(effective_metrics(gen, adv))
    metrics.update(balance)
    metrics.update(overlong_metrics(ctx, batch.groups))
    return metrics, gen


def grpo_step(ctx: TrainContext, step: int) -> dict[str, float | None]:
    """Run optimiser step ``step`` (1-based) and return its metrics row. A batch is generated
    at the first step on it; each step trains one of its mini-batches."""
    ctx.timings, ctx.intervals = {}, {}
    t0 = time.perf_counter()
    ctx.reward_fn.begin_step(step, ctx.cfg.trainer.max_steps)  # trainer_state for ORM plugins
    metrics, gen = generate_batch(ctx, step) if ctx.generated is None else ({}, GenStats())
    gb = ctx.generated
    assert gb is not None
    # separate ranks, one step ahead: after a batch's last step the engines generate the next
    submit_ahead(ctx, step, gb.is_last)
    groups = gb.current_groups()
    trained = len(groups) > 0
    if trained and ctx.engines_awake:  # 4: free the engines' memory for training
        ctx.rollouts.sleep()
        ctx.offload.for_training()
        ctx.engines_awake = False
    with ctx.timed("train"):  # 5: fwd/bwd over micro-batches + one LoRA optimiser step
        kl = kl_into_rewards(ctx, gb) if trained else {}
        losses = {**train_next(ctx, gb), **kl} if trained else gb.position()
    ctx.engines_stale |= losses.get("train/optimizer_steps", 0.0) > 0  # none: non-finite
    gb.done += 1
    ctx.generated = gb if gb.done < gb.total else None  # the next step generates when None
    eval_due = _due(step, ctx.cfg.trainer.eval_every, ctx.cfg.trainer.max_steps)
    due = ctx.generated is None or eval_due or step == ctx.cfg.trainer.max_steps
    with ctx.timed("sync"):  # 6: verified weight sync before the engines generate again
        sync = wake_engines(ctx) if due else {"perf/sync_bytes": 0.0}
    ctx.step = step
    step_s = time.perf_counter() - t0
    metrics.update({**losses, **sync, **_perf(ctx, gen, step_s)})
    metrics.update(overlap_metrics(ctx, step_s))  # placement separate: perf/overlap_frac
    metrics.update(ctx.offload.pop_metrics())
    metrics.update(ctx.sampler.metrics())
    metrics.update(ctx.reward_fn.pop_metrics())
    metrics["train/skipped_empty_batch"] = float(not trained)
    metrics["train/skipped_nonfinite"] = losses.get("train/skipped_nonfinite", 0.0)
    metrics.update(ctx.data_metrics)
    if eval_due:  # 7: evaluation
        metrics.update(evaluate(ctx.rollouts, ctx.eval_problems, ctx.cfg.trainer.seed, step))
    row = complete_row(ctx, metrics)
    if ctx.comm.is_main and (bias := answer_bias_warning(row)):
        log.warning("step %d: %s", step, bias)
    if ctx.cfg.metrics.swift_names:  # the ms-swift / TRL dashboard names too
        num = sum(g.size for g in gb.groups)  # the reward statistics' population
        scale = ctx.cfg.loss.resolved_advantage_scale()
        names = swift_reward_names(ctx.reward_fn.terms, ctx.cfg.rewards.functions)
        row.update(swift_aliases(row, ctx.reward_fn.names, num, scale, names))
    ctx.logger.log(step, row)  # 8: metrics (rank 0; others log nothing)
    every_save = ctx.cfg.trainer.save_every or ctx.cfg.trainer.max_steps
    if _due(step, every_save, ctx.cfg.trainer.max_steps):  # 9: checkpoint (always at the end)
        save_checkpoint(ctx, step)
    return row


def _kl_in_reward(ctx: TrainContext) -> bool:
    return ctx.cfg.loss.kl_in_reward and ctx.cfg.loss.kl_coef > 0


def kl_into_rewards(ctx: TrainContext, gb: Generated) -> dict[str, float]:
    """``loss.kl_in_reward``, at the generated batch's first step: prepare it (old and
    reference log-probs), take ``kl_coef`` x each completion's KL off its reward and redo the
    advantages (:mod:`megagrpo.trainer.kl_reward`); what ``rewards.answer_balance`` added to
    them is kept; the completions log is written then. ``reward/kl_penalty_mean``: the mean
    penalty. {} otherwise."""
    if not _kl_in_reward(ctx) or gb.updates is not None:
        return {}
    prepare(ctx, gb)
    penalty = [ctx.cfg.loss.kl_coef * k for k in sequence_kl(ctx, gb)]
    before = compute_advantages(ctx, gb.groups)
    after = compute_advantages(ctx, gb.groups, penalty)
    set_advantages(ctx, gb, [a - b + c for a, b, c in zip(gb.adv, before, after)])
    if ctx.completions is not None:  # logged once the advantages are final
        ctx.completions.log(gb.step, gb.groups, levels=ctx.sampler.level_of, advantages=gb.adv)
    flat = torch.cat(penalty) if penalty else torch.zeros(1)
    return {"reward/kl_penalty_mean": float(flat.mean())}


def overlong_metrics(ctx: TrainContext, groups: list[Group]) -> dict[str, float]:
    """``train/overlong_filtered``: the share of the batch's completions that stopped at the
    length limit and carry no loss (``loss.overlong_filter``); {} when the filter is off."""
    if not ctx.cfg.loss.overlong_filter:
        return {}
    reasons = [r for g in groups for r in g.finish_reasons]
    return {"train/overlong_filtered": reasons.count("length") / max(len(reasons), 1)}


def wake_engines(ctx: TrainContext) -> dict[str, float]:
    """Phase 6, when the engines are needed next (a generation or an evaluation follows, or
    the run ends): a verified weight sync when an update changed the weights since the last
    one (the engines wake in stages), else the engines wake as they were (:func:`_no_sync`).
    Between two mini-batches of one generated batch nothing is synced."""
    if ctx.engines_awake:
        return {"perf/sync_bytes": 0.0}
    ctx.engines_awake = True
    if ctx.engines_stale:
        ctx.engines_stale = False
        return sync_weights(ctx)
    return _no_sync(ctx, slept=True)


def _no_sync(ctx: TrainContext, slept: bool) -> dict[str, float]:
    """The weights did not change (nothing trained, or a non-finite update was skipped).
    Engines put to sleep for the update wake up as they were, after the trainer's weights
    left the device again (``trainer.offload_during_rollout``: the engines wake into that
    memory); engines whose level-2 sleep dropped their weights get the unchanged weights
    back through a full, verified sync instead (waking alone leaves them without any)."""
    if not slept:
        return {"perf/sync_bytes": 0.0}
    if ctx.rollouts.weights_dropped():
        return sync_weights(ctx)
    ctx.offload.for_generation()
    ctx.rollouts.wake_up()
    return {"perf/sync_bytes": 0.0}


def _perf(ctx: TrainContext, gen: GenStats, step_s: float) -> dict[str, float]:
    t = ctx.timings
    return {
        "perf/step_s": step_s,
        "perf/gen_s": t.get("gen", 0.0),
        "perf/train_s": t.get("train", 0.0),
        "perf/sync_s": t.get("sync", 0.0),
        "perf/tokens_per_s": gen.gen_tokens / max(step_s, 1e-9),
        "perf/gen_tokens_per_s": gen.gen_tokens / max(t.get("gen", 0.0), 1e-9),
        "perf/gen_tokens": gen.gen_tokens,
        "perf/gen_seqs": gen.gen_seqs,
    } | phase_times(t)


PHASES = {
    "train": ("old_logprobs", "ref_logprobs", "fwd_bwd", "optim", "checks"),
    "sync": ("probe", "push"),
}
"""Parts of ``perf/train_s`` and ``perf/sync_s``, logged as ``perf/<phase>/<part>_s`` in every
row (0.0 when a part did not run, e.g. no reference forward without KL)."""


def phase_times(timings: dict[str, float]) -> dict[str, float]:
    """``perf/train/old_logprobs_s`` ... from the step's ``ctx.timings`` (keys
    ``train/old_logprobs`` ...); ``perf/train/other_s``: the rest of ``perf/train_s`` (batch
    building, totals, metric reductions)."""
    out = {}
    for phase, parts in PHASES.items():
        for part in parts:
            out[f"perf/{phase}/{part}_s"] = timings.get(f"{phase}/{part}", 0.0)
    parts_s = sum(timings.get(f"train/{p}", 0.0) for p in PHASES["train"])
    out["perf/train/other_s"] = max(0.0, timings.get("train", 0.0) - parts_s)
    return out


def _due(step: int, every: int, last: int) -> bool:
    """Every ``every`` steps and at the last step; never when ``every`` is 0."""
    return every > 0 and (step % every == 0 or step == last)


def complete_row(ctx: TrainContext, metrics: dict[str, float]) -> dict[str, float | None]:
    """The step's row holding every DESIGN.md metric name (None where not measured)."""
    row: dict[str, float | None] = dict.fromkeys(required_metrics(ctx.reward_fn.names))
    row.update(metrics)
    return row


def evaluate_at_start(ctx: TrainContext) -> dict[str, float | None] | None:
    """Step 0 (``trainer.eval_at_start``, a run from scratch that evaluates): the held-out
    figures of the base model, logged as the row of step 0; None when not due."""
    tcfg = ctx.cfg.trainer
    if not tcfg.eval_at_start or tcfg.eval_every <= 0 or ctx.step != 0 or not ctx.eval_problems:
        return None
    row = complete_row(ctx, evaluate(ctx.rollouts, ctx.eval_problems, tcfg.seed, 0))
    ctx.logger.log(0, row)
    return row


def train(ctx: TrainContext, stop: StopSignals | None = None) -> list[dict[str, float | None]]:
    """Run steps ``ctx.step + 1 .. max_steps``; returns the rows logged by this process.

    With ``stop`` (:mod:`megagrpo.parallel.signals`), every step boundary asks whether a rank
    received SIGTERM / SIGINT / SIGUSR1; if so the last completed step is checkpointed
    (unless it just was; a stop before step 1 writes none: a plain restart redoes it),
    ``ctx.stopped_by`` names the signal and the loop returns. Stops
    with NonFiniteError after ``trainer.max_nonfinite_steps`` skipped updates in a row.
    """
    rows = []
    try:
        if stop is not None:
            stop.install()  # again: an engine may have replaced the handlers while it started
        evaluate_at_start(ctx)
        for step in range(ctx.step + 1, ctx.cfg.trainer.max_steps + 1):
            if stop is not None:  # an engine rank's own signal (placement separate) too
                stop.adopt(ctx.rollouts.engine_signal)
            if stop is not None and (signal_name := stop.agreed(ctx.comm)):
                ctx.stopped_by = signal_name
                break
            rows.append(grpo_step(ctx, step))
            stop_on_nonfinite(ctx, step, rows[-1].get("train/skipped_nonfinite"))
        if ctx.stopped_by and ctx.step > 0 and ctx.saved_step != ctx.step:
            save_checkpoint(ctx, ctx.step)  # (stopped before step 1: nothing to save)
    finally:
        ctx.logger.close()
        if ctx.completions is not None:
            ctx.completions.close()
    return rows
