"""Phase 5 of a step: Megatron forward/backward with the fused loss over micro-batches,
then one optimiser step on the LoRA parameters.

Memory is bounded by ``trainer.micro_batch_size`` x longest sample, never by the batch:
each micro-batch's loss is scaled (:func:`microbatch_weight`) so the accumulated gradient is
the gradient of the whole batch's loss. Behaviour ("old") log-probs come from the rollout
engine, from a no-grad trainer forward before the update (``recompute``; required for
``ppo_epochs > 1``; with one update per batch the training forward's own detached log-probs,
:func:`reuses_training_forward`) or not at all (ratio 1). Reference log-probs (k3 KL) come
from a no-grad forward with the adapters disabled (the frozen base is the reference policy).

A non-finite loss or gradient norm on any rank skips the optimiser step on every rank (the
weights, optimiser and scheduler state stay exactly as they were): ``train/skipped_nonfinite``
is 1 in the step's row, and :func:`stop_on_nonfinite` stops the run after
``trainer.max_nonfinite_steps`` such steps in a row.

MoE routing replay (``model.routing_replay``, :class:`megagrpo.model.routing.ReplayPlan`):
r3 replays the engine's expert choices in every forward (old, reference, training), r2 the
trainer's own first forward's; ``train/routing_agreement`` is measured in any mode when the
engine returned routing, and ``train/logprob_mismatch`` (trainer vs engine log-probs)
whenever old log-probs are recomputed (measured on the training forward when it is reused).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from megagrpo.algo.advantages import sequence_weights
from megagrpo.algo.config import LossConfig
from megagrpo.errors import MegagrpoError
from megagrpo.model import Policy
from megagrpo.model.routing import ReplayPlan, step_plan
from megagrpo.parallel.comm import Comm
from megagrpo.parallel.state import ParallelGroups
from megagrpo.trainer.batch import (
    BatchTotals,
    MicroBatch,
    build_samples,
    has_rollout_logprobs,
    micro_batches,
    microbatch_mass,
    microbatch_weight,
    pack_samples,
    padding_micro_batch,
)
from megagrpo.trainer.config import RunConfig
from megagrpo.trainer.context import TrainContext
from megagrpo.trainer.generated import Update
from megagrpo.trainer.loss_head import micro_batch_logprobs, micro_batch_loss, model_output
from megagrpo.trainer.prefix_batch import row_budget, shared_micro_batches
from megagrpo.types import Group

log = logging.getLogger(__name__)

LOSS_METRICS = ("loss/policy", "loss/kl", "loss/clip_frac", "loss/entropy")
"""Always in the row of a trained step (0.0 when a rank trained no micro-batch)."""


class NonFiniteError(MegagrpoError):
    """Too many consecutive steps had a non-finite loss or gradient (see module docstring)."""


def local_share(
    groups: list[Group], adv: Sequence[torch.Tensor], dp_rank: int, dp_size: int
) -> tuple[list[Group], list[torch.Tensor]]:
    """This data-parallel rank's groups (round-robin) and their advantage rows ([G_n] each)."""
    idx = list(range(dp_rank, len(groups), dp_size))
    return [groups[i] for i in idx], [adv[i] for i in idx]


def group_seq_weights(groups: list[Group], weighting: str) -> list[torch.Tensor] | None:
    """Per-group sequence weights ``[G_n]`` of the whole batch for ``loss.group_weighting``
    (:func:`megagrpo.algo.advantages.sequence_weights`: ``group`` makes every problem weigh
    the same whatever its number of answers); None for ``sequence`` (every sequence 1)."""
    if weighting == "sequence" or not groups:
        return None
    sizes = [g.size for g in groups]
    return list(torch.split(sequence_weights(sizes, weighting), sizes))


def build_micro_batches(
    groups: list[Group],
    adv: Sequence[torch.Tensor],
    micro_batch_size: int,
    pad_id: int,
    device: torch.device,
    pad_to_multiple: int = 1,
    pack_tokens: int = 0,
    weights: Sequence[torch.Tensor] | None = None,
    overlong_filter: bool = False,
    shared_prefix: bool = False,
) -> list[MicroBatch]:
    """Micro-batches of ``groups`` (advantage rows ``adv``, one per group; optional sequence
    ``weights``, one row per group) on ``device``: padded, of ``micro_batch_size`` samples,
    or packed rows of at most ``pack_tokens`` tokens, or with ``shared_prefix`` segment rows
    (each group's prompt once: :mod:`megagrpo.trainer.prefix_batch`); ``pad_to_multiple``:
    sequence parallelism needs T % TP == 0; ``overlong_filter``: truncated completions carry
    no loss token (``loss.overlong_filter``)."""
    samples = build_samples(groups, adv, weights, overlong_filter)
    if shared_prefix:
        budget = row_budget(samples, micro_batch_size, pack_tokens)
        mbs = shared_micro_batches(samples, budget, pad_id, pad_to_multiple)
    elif pack_tokens:
        mbs = pack_samples(samples, pack_tokens, pad_id, pad_to_multiple)
    else:
        mbs = micro_batches(samples, micro_batch_size, pad_id, pad_to_multiple=pad_to_multiple)
    return [mb.to(device) for mb in mbs]


def equalize_micro_batches(
    mbs: list[MicroBatch], comm: Comm, pgs: ParallelGroups, pad_id: int
) -> list[MicroBatch]:
    """Every data-parallel rank runs the same number of micro-batches: expert-parallel
    all-to-alls span DP ranks, so a rank that stops early (a short dynamic-sampling batch
    split unevenly, or no share at all) would leave the others waiting forever. The missing
    ones are padding micro-batches: a forward/backward that contributes exactly zero."""
    target = int(comm.max_over(float(len(mbs)), pgs.dp))
    length = pgs.tp_size if pgs.sequence_parallel else 1
    pads = [padding_micro_batch(length, pad_id).to(pgs.device) for _ in range(target - len(mbs))]
    return mbs + pads


def policy_logprobs(
    policy: Policy,
    mbs: list[MicroBatch],
    loss_cfg: LossConfig,
    tp_group: dist.ProcessGroup | None,
    base_only: bool = False,
    plan: ReplayPlan | None = None,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """Per micro-batch [B, T] log-probs of the targets under the current policy (or the
    frozen base with ``base_only``: the reference policy), in scoring mode (no dropout);
    ``plan`` gives each forward its MoE routing; of logits / ``temperature``
    (:meth:`RolloutConfig.logprob_temperature`)."""
    base = policy.adapters_disabled() if base_only else contextlib.nullcontext()
    routing = None if plan is None else plan.reference if base_only else plan.policy
    with policy.scoring(), base, model_output(policy, loss_cfg) as weight:

        def logp(output: torch.Tensor, i: int) -> tuple[None, torch.Tensor]:
            return None, micro_batch_logprobs(
                output, weight, mbs[i], loss_cfg, tp_group, temperature
            )

        # pipeline: on the last stage only (None elsewhere, unread)
        return policy.forward_backward(
            mbs, logp, forward_only=True, broadcast=False, routing=routing
        )


def logprob_mismatch(
    ctx: TrainContext, old: Sequence[torch.Tensor | None], mbs: list[MicroBatch]
) -> dict[str, float]:
    """Mean and max |recomputed - engine| log-prob over the loss tokens of every rank
    (collective): the train/inference mismatch routing replay reduces. Under pipeline
    parallelism only the last stage has recomputed log-probs (``None`` elsewhere): the other
    stages add nothing but still take part in the reductions."""
    diff_sum = tokens = diff_max = 0.0
    for lp, mb in zip(old, mbs):
        if lp is None:  # not the last pipeline stage
            continue
        diff = (lp - mb.rollout_logprobs).abs() * mb.mask
        diff_sum += float(diff.sum())
        tokens += float(mb.mask.sum())
        diff_max = max(diff_max, float(diff.max())) if diff.numel() else diff_max
    return _mismatch_metrics(ctx, diff_sum, tokens, diff_max)


def _mismatch_metrics(
    ctx: TrainContext, diff_sum: float, tokens: float, diff_max: float
) -> dict[str, float]:
    """``train/logprob_mismatch`` (mean) and ``_max`` from this rank's sums (collective)."""
    sums = ctx.comm.mean_over({"diff": diff_sum, "tokens": tokens})
    return {
        "train/logprob_mismatch": sums["diff"] / max(sums["tokens"], 1.0),
        "train/logprob_mismatch_max": ctx.comm.max_over(diff_max),
    }


def _param_sq(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is not None:
            sq += p.grad.detach().double().pow(2).sum().to(device)
    return sq


def clip_grad_norm(
    norm_params: tuple[list[nn.Parameter], list[nn.Parameter]],
    params: list[nn.Parameter],
    pgs: ParallelGroups,
    max_norm: float,
) -> float:
    """Global L2 norm of the LoRA gradients (after grad sync) over all ranks, from
    ``norm_params`` = ``(dense, expert)`` with each distinct element counted once per model
    replica (:meth:`megagrpo.model.Policy.grad_norm_params`); every gradient of ``params`` is
    clipped by it when ``max_norm`` > 0."""
    dense, expert = norm_params
    sq = torch.stack([_param_sq(dense, pgs.device), _param_sq(expert, pgs.device)])
    if pgs.world_size > 1:  # on the compute device: NCCL reduces no host tensor
        dist.all_reduce(sq)
        sq = sq / torch.tensor(
            [float(pgs.dp_size), float(max(pgs.expert_dp_size, 1))],
            dtype=torch.float64,
            device=pgs.device,
        )
    norm = float(sq.sum().sqrt())
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def _backward_pass(
    ctx: TrainContext,
    mbs: list[MicroBatch],
    old: list | None,
    ref: list | None,
    totals: BatchTotals,
    plan: ReplayPlan | None = None,
    probe: bool = False,
) -> dict[str, float]:
    """Forward/backward every micro-batch (through the pipeline when pp > 1, the loss on the
    last stage), accumulating gradients; the weighted loss metrics, on every stage
    (``probe``: plus the unweighted ``loss/logprob_mismatch_*`` sums against the engine)."""
    cfg = ctx.cfg.loss
    if cfg.kl_in_reward:  # the KL is in the rewards (trainer/kl_reward.py), not the loss
        cfg, ref = dataclasses.replace(cfg, kl_coef=0.0), None
    agg = cfg.resolved_loss_agg()
    temperature = ctx.cfg.rollout.logprob_temperature()

    sums: dict[str, float] = {}
    routing = None if plan is None else plan.policy
    with model_output(ctx.policy, cfg) as weight:

        def loss_fn(output: torch.Tensor, i: int) -> tuple[torch.Tensor, dict[str, float]]:
            mb = mbs[i]
            loss, metrics = micro_batch_loss(
                output,
                weight,
                mb,
                None if old is None else old[i],
                None if ref is None else ref[i],
                cfg,
                ctx.tp_group,
                temperature,
                probe,
            )
            w = microbatch_weight(mb, agg, totals)
            return loss * w, {
                k: float(v) if k.endswith(UNWEIGHTED) else w * float(v) for k, v in metrics.items()
            }

        for metrics in ctx.policy.forward_backward(mbs, loss_fn, routing=routing):
            combine_metrics(sums, metrics)
    return sums


UNWEIGHTED = ("_sum", "_min", "_max")
"""Loss-metric key suffixes combined over micro-batches by sum / min / max, unweighted."""


def combine_metrics(acc: dict[str, float], metrics: dict[str, float]) -> None:
    """Fold one micro-batch's (weighted) metrics into ``acc``: ``*_min`` by min, ``*_max``
    by max, every other key by sum."""
    for k, v in metrics.items():
        if k not in acc:
            acc[k] = v
        elif k.endswith("_min"):
            acc[k] = min(acc[k], v)
        elif k.endswith("_max"):
            acc[k] = max(acc[k], v)
        else:
            acc[k] += v


def swift_loss_metrics(
    comm: Comm, sums: dict[str, float], group: dist.ProcessGroup | None
) -> dict[str, float]:
    """The step's min / max / per-sequence metrics over every data-parallel rank (collective):
    ``loss/clip_frac_low_min``, ``loss/clip_frac_high_max`` (0 when no token was trained)
    and ``loss/entropy_seq_mean`` (mean over completions of their mean token entropy)."""
    out: dict[str, float] = {}
    if "loss/clip_frac_low_min" in sums:
        low = -comm.max_over(-sums.pop("loss/clip_frac_low_min"), group)
        high = comm.max_over(sums.pop("loss/clip_frac_high_max"), group)
        out["loss/clip_frac_low_min"] = low if math.isfinite(low) else 0.0
        out["loss/clip_frac_high_max"] = high if math.isfinite(high) else 0.0
    if "loss/entropy_seq_sum" in sums:
        tot = comm.mean_over(
            {"e": sums.pop("loss/entropy_seq_sum"), "n": sums.pop("loss/nonempty_seqs_sum")},
            group,
        )
        out["loss/entropy_seq_mean"] = tot["e"] / tot["n"] if tot["n"] > 0 else 0.0
    return out


def _weighted_mass(ctx: TrainContext, mbs: list[MicroBatch], agg: str) -> float:
    """The batch's aggregation mass with sequence weights, over every DP rank (/ dp_size,
    as the other totals: DP grad sync averages)."""
    pgs = ctx.pgs
    local = sum(microbatch_mass(mb, agg) for mb in mbs)
    return ctx.comm.sum_over(local, pgs.dp) / pgs.dp_size


def reuses_training_forward(cfg: RunConfig) -> bool:
    """True when recomputed old log-probs need no forward of their own
    (:meth:`RunConfig.reuses_training_forward`, the rule the planner bills by too): the
    training forward's detached log-probs are then the behaviour log-probs; the weights are
    those a separate forward would have used, so the ratio is 1 as with ``recompute``, the
    importance weights against the engine are the same, and a forward is saved. Megatron's
    other training-mode differences do not apply to the models we build: the provider sets
    no sinkhorn routing and no router input jitter, and full recompute leaves values
    unchanged."""
    return cfg.reuses_training_forward()


def prepare_update(
    ctx: TrainContext, groups: list[Group], adv: Sequence[torch.Tensor], reuse: bool
) -> Update:
    """Micro-batches and totals of one optimiser step on ``groups`` (every rank holds all of
    them; this rank trains its round-robin share). Collective over data-parallel ranks.
    ``reuse``: one update per generated batch (:func:`reuses_training_forward`)."""
    tcfg, pgs = ctx.cfg.trainer, ctx.pgs
    mine, my_adv = local_share(groups, adv, pgs.dp_rank, pgs.dp_size)
    weights = group_seq_weights(groups, ctx.cfg.loss.group_weighting)
    my_w = None if weights is None else local_share(groups, weights, pgs.dp_rank, pgs.dp_size)[1]
    pad_to = pgs.tp_size if pgs.sequence_parallel else 1
    shared = ctx.cfg.shared_prefix_decision(ctx.policy.spec)[0]
    mbs = build_micro_batches(
        mine,
        my_adv,
        tcfg.micro_batch_size,
        ctx.pad_id,
        pgs.device,
        pad_to,
        tcfg.pack_tokens,
        my_w,
        overlong_filter=ctx.cfg.loss.overlong_filter,
        shared_prefix=shared,
    )
    mbs = equalize_micro_batches(mbs, ctx.comm, pgs, ctx.pad_id)
    # Totals over the whole batch (all DP ranks): DP grad sync averages, so scale by dp_size.
    # Completions the overlong filter left out of the loss still count (ms-swift's masks).
    agg = ctx.cfg.loss.resolved_loss_agg()
    totals = BatchTotals(
        seqs=ctx.comm.sum_over(sum(mb.num_seqs for mb in mbs), pgs.dp) / pgs.dp_size,
        nonempty=ctx.comm.sum_over(
            sum(mb.num_nonempty + mb.filtered_nonempty for mb in mbs), pgs.dp
        )
        / pgs.dp_size,
        tokens=ctx.comm.sum_over(sum(mb.num_tokens + mb.filtered_tokens for mb in mbs), pgs.dp)
        / pgs.dp_size,
        mass=_weighted_mass(ctx, mbs, agg) if weights is not None else 0.0,
    )
    source = tcfg.resolved_old_logprobs(has_rollout_logprobs(groups))
    plan = step_plan(
        ctx.cfg.model.routing_replay,
        [(mb.routing, mb.routing_valid) for mb in mbs],
        routed=all(g.routing for g in groups),
        old_source=source,
        # replay refused at load time; segment rows carry routing
        measurable=pgs.pp_size == 1 and (shared or not tcfg.pack_tokens),
    )
    reused = source == "recompute" and reuse
    probe = reused and has_rollout_logprobs(groups)  # old = logp.detach() in the loss
    u = Update(mbs, totals, source, plan, reused, probe)
    if shared:
        u.shared_fraction = shared_fraction(ctx, mbs)
    return u


def shared_fraction(ctx: TrainContext, mbs: list[MicroBatch]) -> float:
    """``train/shared_prefix_fraction``: groups (of two or more completions) trained with
    their prompt shared, over every data-parallel rank (collective; 1.0 when none could)."""
    shared = ctx.comm.sum_over(float(sum(mb.shared_groups[0] for mb in mbs)), ctx.pgs.dp)
    total = ctx.comm.sum_over(float(sum(mb.shared_groups[1] for mb in mbs)), ctx.pgs.dp)
    return shared / total if total else 1.0


def behaviour_logprobs(ctx: TrainContext, u: Update, engine_logprobs: bool) -> None:
    """Fill ``u.old`` (recomputed, or the engine's) and ``u.ref`` (the frozen base, when
    ``loss.kl_coef`` > 0) under the current weights: before the generated batch's first
    update. ``engine_logprobs``: every completion carries the engine's log-probs (then the
    recomputed ones are compared with them: ``train/logprob_mismatch``)."""
    temperature = ctx.cfg.rollout.logprob_temperature()  # the engines' log-probs are of it too
    if u.source == "recompute" and not u.reused:
        with ctx.timed("train/old_logprobs"):
            u.old = policy_logprobs(
                ctx.policy, u.mbs, ctx.cfg.loss, ctx.tp_group, plan=u.plan, temperature=temperature
            )
        if engine_logprobs:
            with ctx.timed("train/checks"):
                u.extra = logprob_mismatch(ctx, u.old, u.mbs)
    elif u.source == "rollout":
        u.old = [mb.rollout_logprobs for mb in u.mbs]
    if ctx.cfg.loss.kl_coef > 0:
        with ctx.timed("train/ref_logprobs"):
            u.ref = policy_logprobs(
                ctx.policy,
                u.mbs,
                ctx.cfg.loss,
                ctx.tp_group,
                base_only=True,
                plan=u.plan,
                temperature=temperature,
            )


def optimizer_step(ctx: TrainContext, u: Update) -> dict[str, float]:
    """One forward/backward over ``u``'s micro-batches and one optimiser (and scheduler) step
    on LoRA, skipped on every rank when the loss or gradient norm is non-finite anywhere.
    Returns ``loss/*`` (averaged over data-parallel ranks), ``train/grad_norm``,
    ``train/lr``, ``train/optimizer_steps`` (1, or 0 when skipped) ..."""
    tcfg, pgs = ctx.cfg.trainer, ctx.pgs
    ctx.optimizer.zero_grad(set_to_none=True)
    with ctx.timed("train/fwd_bwd"):
        sums = _backward_pass(ctx, u.mbs, u.old, u.ref, u.totals, u.plan, u.probe)
    with ctx.timed("train/optim"):
        ctx.policy.finish_grad_sync()
        grad_norm = clip_grad_norm(
            ctx.policy.grad_norm_params(), ctx.policy.lora_parameters(), pgs, tcfg.grad_clip
        )
    with ctx.timed("train/checks"):
        skipped = not finite_everywhere(ctx.comm, sums.get("loss/total", 0.0), grad_norm)
    if skipped:  # nothing of this update may reach the weights or the Adam moments
        ctx.optimizer.zero_grad(set_to_none=True)
    else:
        with ctx.timed("train/optim"):
            ctx.optimizer.step()
            if ctx.scheduler is not None:
                ctx.scheduler.step()
    extra = dict(u.extra)
    if u.probe:
        with ctx.timed("train/checks"):
            extra = _mismatch_metrics(
                ctx,
                sums.pop("loss/logprob_mismatch_sum", 0.0),
                sums.pop("loss/logprob_mismatch_tokens_sum", 0.0),
                sums.pop("loss/logprob_mismatch_max", 0.0),
            )
    extra |= swift_loss_metrics(ctx.comm, sums, pgs.dp)
    metrics = {k: sums.get(k, 0.0) for k in LOSS_METRICS} | sums
    metrics = ctx.comm.mean_over(metrics, pgs.dp)
    metrics["train/grad_norm"] = grad_norm
    metrics["train/optimizer_steps"] = float(not skipped)
    metrics["train/skipped_nonfinite"] = float(skipped)
    metrics["train/lr"] = float(ctx.optimizer.param_groups[0]["lr"])
    metrics["train/micro_batches"] = float(sum(1 for mb in u.mbs if mb.indices))
    metrics["train/old_logprobs_" + u.source] = 1.0
    metrics["train/old_logprobs_reused"] = float(u.reused)
    if u.shared_fraction is not None:
        metrics["train/shared_prefix_fraction"] = u.shared_fraction
    if u.plan is not None:
        extra |= u.plan.metrics(ctx.comm.mean_over)
        u.plan.measured.clear()  # the next update of this mini-batch reports its own
    return metrics | extra


def train_on_batch(
    ctx: TrainContext, groups: list[Group], adv: Sequence[torch.Tensor]
) -> dict[str, float]:
    """Forward/backward over micro-batches, then ``ppo_epochs`` optimiser steps on LoRA, all
    on the whole of ``groups`` (one mini-batch; the loop splits a generated batch into
    ``trainer.mini_batches`` of them: :mod:`megagrpo.trainer.minibatch`).

    Args:
        groups: the batch (every rank holds all of it); adv: advantages, one row ``[G_n]``
            per group (an ``[N, G]`` tensor works too).
    Returns:
        the last update's metrics (:func:`optimizer_step`) with ``train/optimizer_steps``
        counting the updates taken (a non-finite one stops the epochs).
    """
    u = prepare_update(ctx, groups, adv, reuse=ctx.cfg.trainer.ppo_epochs == 1)
    behaviour_logprobs(ctx, u, has_rollout_logprobs(groups))
    metrics: dict[str, float] = {}
    steps = 0
    for _ in range(ctx.cfg.trainer.ppo_epochs):
        metrics = optimizer_step(ctx, u)
        if metrics["train/skipped_nonfinite"]:
            break
        steps += 1
    return metrics | {"train/optimizer_steps": float(steps)}


def finite_everywhere(comm: Comm, loss: float, grad_norm: float) -> bool:
    """Collective: True when the loss and the gradient norm are finite on every rank (one
    MAX all-reduce, so every rank takes the same decision)."""
    bad = not (math.isfinite(loss) and math.isfinite(grad_norm))
    return comm.max_over(float(bad)) == 0.0


def stop_on_nonfinite(ctx: TrainContext, step: int, skipped: float | None) -> None:
    """Count consecutive steps whose update was skipped for a non-finite loss or gradient
    (``skipped``: the row's ``train/skipped_nonfinite``); NonFiniteError after
    ``trainer.max_nonfinite_steps`` in a row. The same on every rank (the skip is agreed)."""
    if not skipped:
        ctx.nonfinite_streak = 0
        return
    ctx.nonfinite_streak += 1
    limit = ctx.cfg.trainer.max_nonfinite_steps
    log.warning(
        "step %d: non-finite loss or gradient norm, optimiser step skipped (%d in a row, "
        "the run stops at %d)",
        step,
        ctx.nonfinite_streak,
        limit,
    )
    if ctx.nonfinite_streak >= limit:
        raise NonFiniteError(
            f"non-finite loss or gradient at step {step}: {ctx.nonfinite_streak} optimiser "
            f"steps in a row skipped (trainer.max_nonfinite_steps={limit}); the weights are "
            f"those of the last finite step. Lower trainer.lr, check the rewards and "
            f"loss.* settings, then --resume from the last checkpoint"
        )
