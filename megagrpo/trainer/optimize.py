"""Phase 5 of a step: Megatron forward/backward with the fused loss over micro-batches,
then one optimiser step on the LoRA parameters.

Memory is bounded by ``trainer.micro_batch_size`` x longest sample, never by the batch:
each micro-batch's loss is scaled (:func:`microbatch_weight`) so the accumulated gradient is
the gradient of the whole batch's loss. Behaviour ("old") log-probs come from the rollout
engine, from a no-grad trainer forward before the update (``recompute``; required for
``ppo_epochs > 1``) or not at all (ratio 1). Reference log-probs (k3 KL) come from a no-grad
forward with the adapters disabled (the frozen base is the reference policy).

Routing replay (reusing the rollout's expert choices in the trainer's forward) is NOT done:
no engine here exposes its per-token expert choices; MoE routing is recomputed by the
trainer, which the old-log-prob recompute / TIS correction (``loss.tis_cap``) absorbs.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from megagrpo.kernels import fused_policy_loss, token_stats
from megagrpo.trainer.batch import (
    MicroBatch,
    build_samples,
    has_rollout_logprobs,
    micro_batches,
    microbatch_weight,
)
from megagrpo.trainer.context import TrainContext
from megagrpo.types import Group

log = logging.getLogger(__name__)

LOSS_METRICS = ("loss/policy", "loss/kl", "loss/clip_frac", "loss/entropy")


def local_share(
    ctx: TrainContext, groups: list[Group], adv: torch.Tensor
) -> tuple[list[Group], torch.Tensor]:
    """This data-parallel rank's groups (round-robin) and their advantage rows [n, G]."""
    dp_rank, dp_size = ctx.dp_rank_size
    idx = list(range(dp_rank, len(groups), dp_size))
    return [groups[i] for i in idx], adv[idx] if idx else adv[:0]


def build_micro_batches(
    ctx: TrainContext, groups: list[Group], adv: torch.Tensor
) -> list[MicroBatch]:
    """Padded micro-batches of this rank's share of the batch."""
    tp = int(getattr(ctx.groups, "tp_size", 1)) if ctx.groups is not None else 1
    sp = bool(getattr(ctx.groups, "sequence_parallel", False))
    samples = build_samples(groups, adv)
    return list(
        micro_batches(
            samples, ctx.cfg.trainer.micro_batch_size, ctx.pad_id, pad_to_multiple=tp if sp else 1
        )
    )


@torch.no_grad()
def token_logprobs(
    ctx: TrainContext, mbs: list[MicroBatch], base_only: bool = False
) -> list[torch.Tensor]:
    """Per micro-batch [B, T] log-probs of the targets under the current policy (or the
    frozen base with ``base_only``: the reference policy)."""
    ctx_mgr = adapters_disabled(ctx.policy) if base_only else contextlib.nullcontext()
    out = []
    with ctx_mgr:
        for mb in mbs:
            logits = ctx.policy.forward_logits(mb.input_ids, mb.position_ids)
            logp, *_ = token_stats(
                logits,
                mb.target_ids,
                tp_group=ctx.tp_group,
                backend=ctx.cfg.loss.backend,
                chunk_bytes=ctx.cfg.loss.chunk_bytes,
            )
            out.append(logp.reshape(mb.target_ids.shape).float() * mb.mask)
    return out


@contextlib.contextmanager
def adapters_disabled(policy):
    """The frozen base model (the KL reference policy): every LoRA adapter's scaling set
    to 0 inside the block (MegatronPolicy exposes ``adapters``, each with ``scaling``)."""
    adapters = list(getattr(policy, "adapters", {}).values())
    if not adapters:
        raise NotImplementedError("loss.kl_coef > 0 needs a policy with LoRA adapters")
    saved = [a.scaling for a in adapters]
    try:
        for a in adapters:
            a.scaling = 0.0
        yield
    finally:
        for a, s in zip(adapters, saved):
            a.scaling = s


def _distinct_params(ctx: TrainContext) -> tuple[list, list]:
    """(dense, expert) LoRA parameters counted once per model replica for the grad norm:
    the TP-replicated factor (A of a column-parallel adapter, B of a row-parallel one)
    only on TP rank 0 (expert-TP rank 0 for experts)."""
    g = ctx.groups
    adapters = list(getattr(ctx.policy, "adapters", {}).values())
    if not adapters or g is None:
        return list(ctx.policy.lora_parameters()), []
    dense, expert = [], []
    for a in adapters:
        is_expert = bool(getattr(a.lora_A, "lora_expert", False))
        first = (g.etp_rank if is_expert else g.tp_rank) == 0
        replicated = a.lora_A if a.kind == "column" else a.lora_B
        sharded = a.lora_B if a.kind == "column" else a.lora_A
        picked = [sharded] + ([replicated] if first or a.tp_size == 1 else [])
        (expert if is_expert else dense).extend(picked)
    return dense, expert


def _param_sq(params) -> torch.Tensor:
    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            sq += p.grad.detach().double().pow(2).sum().cpu()
    return sq


def clip_grad_norm(ctx: TrainContext, max_norm: float) -> float:
    """Global L2 norm of the LoRA gradients (after grad sync) over all ranks, each distinct
    parameter counted once; clips every gradient by it when ``max_norm`` > 0."""
    dense, expert = _distinct_params(ctx)
    sq = torch.stack([_param_sq(dense), _param_sq(expert)])
    if ctx.comm.world_size > 1:
        torch.distributed.all_reduce(sq)
        g = ctx.groups
        sq = sq / torch.tensor(
            [float(g.dp_size), float(max(g.expert_dp_size, 1))], dtype=torch.float64
        )
    norm = float(sq.sum().sqrt())
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in ctx.policy.lora_parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def _backward_pass(
    ctx: TrainContext,
    mbs: list[MicroBatch],
    old: list | None,
    ref: list | None,
    totals: tuple[int, int],
) -> dict[str, float]:
    """Forward/backward every micro-batch, accumulating gradients; weighted loss metrics."""
    cfg = ctx.cfg.loss
    agg = cfg.resolved_loss_agg()
    sums: dict[str, float] = {}
    for i, mb in enumerate(mbs):
        logits = ctx.policy.forward_logits(mb.input_ids, mb.position_ids)
        loss, metrics = fused_policy_loss(
            logits,
            mb.target_ids,
            None if old is None else old[i],
            mb.advantages,
            mb.mask,
            cfg,
            ref_logprobs=None if ref is None else ref[i],
            tp_group=ctx.tp_group,
            rollout_logprobs=mb.rollout_logprobs if cfg.tis_cap > 0 else None,
        )
        weight = microbatch_weight(mb, agg, *totals)
        (loss * weight).backward()
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + weight * float(v)
        del logits, loss
    return sums


def train_on_batch(ctx: TrainContext, groups: list[Group], adv: torch.Tensor) -> dict[str, float]:
    """Forward/backward over micro-batches, then ``ppo_epochs`` optimiser steps on LoRA.

    Args:
        groups: the batch (every rank holds all of it); adv: [N, G] advantages.
    Returns:
        ``loss/*`` metrics (averaged over data-parallel ranks), ``train/grad_norm``, ``train/lr``.
    """
    tcfg = ctx.cfg.trainer
    mine, my_adv = local_share(ctx, groups, adv)
    mbs = build_micro_batches(ctx, mine, my_adv) if mine else []
    # Totals over the whole batch (all DP ranks): DP grad sync averages, so scale by dp_size.
    _, dp = ctx.dp_rank_size
    seqs = ctx.comm.sum_over(sum(mb.num_seqs for mb in mbs), ctx.dp_group) / dp
    toks = ctx.comm.sum_over(sum(mb.num_tokens for mb in mbs), ctx.dp_group) / dp
    source = tcfg.resolved_old_logprobs(has_rollout_logprobs(groups))
    old = None
    if source == "recompute":
        old = token_logprobs(ctx, mbs)
    elif source == "rollout":
        old = [mb.rollout_logprobs for mb in mbs]
    ref = token_logprobs(ctx, mbs, base_only=True) if ctx.cfg.loss.kl_coef > 0 else None
    sums: dict[str, float] = {}
    grad_norm = 0.0
    for _ in range(tcfg.ppo_epochs):
        ctx.optimizer.zero_grad(set_to_none=True)
        sums = _backward_pass(
            ctx, mbs, old, ref, (max(int(round(seqs)), 1), max(int(round(toks)), 1))
        )
        ctx.policy.finish_grad_sync()
        grad_norm = clip_grad_norm(ctx, tcfg.grad_clip)
        ctx.optimizer.step()
        if ctx.scheduler is not None:
            ctx.scheduler.step()
    metrics = {k: sums.get(k, 0.0) for k in LOSS_METRICS} | {
        k: v for k, v in sums.items() if k not in LOSS_METRICS
    }
    metrics = ctx.comm.mean_over(metrics, ctx.dp_group)
    metrics["train/grad_norm"] = grad_norm
    metrics["train/lr"] = float(ctx.optimizer.param_groups[0]["lr"])
    metrics["train/micro_batches"] = float(len(mbs))
    metrics["train/old_logprobs_" + source] = 1.0
    return metrics
