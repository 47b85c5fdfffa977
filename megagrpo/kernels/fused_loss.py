"""Fused log-prob + GRPO-family loss: the entry point the trainer calls.

forward: one pass over the logits (Triton on CUDA, chunked torch on CPU) gives per-token
max / sum-exp / E[x] / target logit (combined across the TP group when the vocab is sharded),
hence log-probs and entropies; the O(T) epilogue gives the loss, metrics and per-token
coefficients g = dL/dlogp, h = dL/dH. backward: one more pass writes
dL/dlogits = g (onehot - p) - h p (x - E[x]) chunk by chunk. No [T, V] fp32 tensor exists;
with ``cfg.grad_in_logits`` the gradient is written into the logits buffer during forward,
so no [T, V] tensor is allocated at all.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import increment_version

from megagrpo.algo.config import LossConfig
from megagrpo.algo.losses import make_seq_ids
from megagrpo.kernels import chunked, epilogue
from megagrpo.kernels.vocab_parallel import combine_stats, group_size, vocab_start_of

log = logging.getLogger(__name__)
Tensor = torch.Tensor


def resolve_backend(backend: str, device: torch.device) -> str:
    """'triton' or 'torch': auto picks Triton on CUDA, torch elsewhere."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, got {backend!r}")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("backend='triton' on CPU needs TRITON_INTERPRET=1 (set before import)")
    return backend


def stats_pass(
    logits: Tensor,
    target: Tensor,
    vocab_start: int,
    backend: str,
    chunk_bytes: int,
    fuse: dict | None,
) -> tuple[Tensor, Tensor | None]:
    """Local stats [T, 4] of logits [T, V_local] (+ fused surrogate terms [T, 8] or None)."""
    if backend == "triton":
        from megagrpo.kernels.triton_loss import triton_stats

        return triton_stats(logits, target, vocab_start, **(fuse or {}))
    return chunked.chunked_stats(logits, target, vocab_start, chunk_bytes), None


def grad_pass(
    logits: Tensor,
    target: Tensor,
    lse: Tensor,
    ex: Tensor,
    g: Tensor,
    h: Tensor | None,
    out: Tensor,
    vocab_start: int,
    backend: str,
    chunk_bytes: int,
) -> Tensor:
    """Write dL/dlogits [T, V_local] into out (may be logits) from per-token g, h [T]."""
    if backend == "triton":
        from megagrpo.kernels.triton_loss import triton_logits_grad

        return triton_logits_grad(logits, target, lse, ex, g, h, out, vocab_start)
    return chunked.chunked_logits_grad(logits, target, lse, ex, g, h, out, vocab_start, chunk_bytes)


def token_stats(
    logits: Tensor,
    target_ids: Tensor,
    tp_group=None,
    backend: str = "auto",
    chunk_bytes: int = 32 << 20,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token (logp, entropy, lse, E[x]) [T] fp32 of logits [T, V_local], no [T, V] fp32.

    Use it for old/reference log-probs (no grad). With tp_group the vocab is sharded and the
    results are global (identical on every rank).
    """
    backend = resolve_backend(backend, logits.device)
    v_local = logits.shape[-1]
    logits2d = logits.reshape(-1, v_local)
    start = vocab_start_of(tp_group, v_local)
    stats, _ = stats_pass(logits2d, target_ids.reshape(-1), start, backend, chunk_bytes, None)
    stats = combine_stats(stats, tp_group)
    lse = stats[:, 0] + torch.log(stats[:, 1])
    return stats[:, 3] - lse, lse - stats[:, 2], lse, stats[:, 2]


@dataclass
class LossPlan:
    """Everything the autograd Function needs besides the logits (flattened to [T])."""

    target: Tensor
    old: Tensor | None
    adv: Tensor
    mask: Tensor
    cfg: LossConfig
    ref: Tensor | None
    rollout: Tensor | None
    ids: Tensor | None
    num_seqs: int
    tp_group: object
    backend: str
    seq_weights: Tensor | None = None
    probe: Tensor | None = None
    metrics: dict = field(default_factory=dict)


def _forward(logits2d: Tensor, p: LossPlan) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Loss and the backward's inputs (lse, E[x], g, h) for logits [T, V_local]."""
    v_local = logits2d.shape[1]
    start = vocab_start_of(p.tp_group, v_local)
    tp = group_size(p.tp_group)
    fuse = None
    clip = p.cfg.variant not in ("gspo", "sapo")  # the Triton kernel fuses the clip only
    if p.backend == "triton" and tp == 1 and clip and p.old is not None:
        fuse = dict(
            old_logprobs=p.old,
            advantages=p.adv,
            ref_logprobs=p.ref,
            eps_low=p.cfg.eps_low,
            eps_high=p.cfg.eps_high,
        )
    stats, kterms = stats_pass(logits2d, p.target, start, p.backend, p.cfg.chunk_bytes, fuse)
    return loss_from_stats(combine_stats(stats, p.tp_group), p, kterms)


def loss_from_stats(
    stats: Tensor, p: LossPlan, kterms: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """The O(T) epilogue: loss and the backward's inputs (lse, E[x], g = dL/dlogp,
    h = dL/dH) from the per-token softmax ``stats`` [T, 4] combined over the vocab shards
    (``kterms``: the loss terms the Triton stats kernel fused, when it did)."""
    lse = stats[:, 0] + torch.log(stats[:, 1])
    ex = stats[:, 2]
    logp = stats[:, 3] - lse
    ent = lse - ex
    old = logp if p.old is None else p.old
    if kterms is not None:
        terms = epilogue.from_kernel(kterms, p.ref is not None)
    elif p.cfg.variant == "gspo":
        if p.ids is None:
            raise ValueError("GSPO needs sequences: pass [B, S] inputs or seq_ids [T]")
        terms, _ = epilogue.gspo_terms(logp, old, p.adv, p.mask, p.ids, p.num_seqs, p.cfg, p.ref)
    else:
        terms = epilogue.token_terms(logp, old, p.adv, p.cfg, p.ref)
    loss, p.metrics, g, h = epilogue.assemble(
        logp, ent, old, p.adv, p.mask, p.cfg, p.ids, p.num_seqs, terms, p.rollout, p.seq_weights
    )
    if p.probe is not None:
        p.metrics |= epilogue.mismatch_sums(logp, p.probe, p.mask)
    return loss, lse, ex, g, h


class _FusedPolicyLoss(torch.autograd.Function):
    """loss = f(logits); backward recomputes softmax chunk by chunk (or reuses grad-in-logits)."""

    @staticmethod
    def forward(ctx, logits2d: Tensor, plan: LossPlan) -> Tensor:
        loss, lse, ex, g, h = _forward(logits2d, plan)
        ctx.plan = plan
        ctx.in_logits = False
        if ctx.needs_input_grad[0]:
            start = vocab_start_of(plan.tp_group, logits2d.shape[1])
            if plan.cfg.grad_in_logits:
                grad_pass(
                    logits2d,
                    plan.target,
                    lse,
                    ex,
                    g,
                    h,
                    logits2d,
                    start,
                    plan.backend,
                    plan.cfg.chunk_bytes,
                )
                # Triton writes through raw pointers: bump the version counter so that any
                # other autograd node that saved these logits raises instead of using grads.
                increment_version(logits2d)
                ctx.in_logits = True
                ctx.save_for_backward(logits2d)
            else:
                ctx.save_for_backward(logits2d, lse, ex, g, h if h is not None else g)
                ctx.has_h = h is not None
                ctx.start = start
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        p = ctx.plan
        if ctx.in_logits:
            grad = ctx.saved_tensors[0].detach()
            if float(grad_loss) != 1.0:
                grad.mul_(grad_loss.to(grad.dtype))
            return grad, None
        logits2d, lse, ex, g, h = ctx.saved_tensors
        g = g * grad_loss
        h = h * grad_loss if ctx.has_h else None
        out = torch.empty_like(logits2d)
        grad_pass(logits2d, p.target, lse, ex, g, h, out, ctx.start, p.backend, p.cfg.chunk_bytes)
        return out, None


def fused_policy_loss(
    logits: Tensor,
    target_ids: Tensor,
    old_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    ref_logprobs: Tensor | None = None,
    tp_group=None,
    *,
    rollout_logprobs: Tensor | None = None,
    seq_ids: Tensor | None = None,
    seq_weights: Tensor | None = None,
    probe_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO/DAPO/Dr.GRPO/GSPO loss straight from logits, without a [T, V] fp32 log-softmax.

    Args:
        logits: [T, V_local] or [B, S, V_local], bf16/fp16/fp32. With ``tp_group`` the vocab is
            sharded: this rank holds ids [rank * V_local, (rank + 1) * V_local).
        target_ids: [T] / [B, S] int token ids (global vocab ids; any value where mask is 0).
        old_logprobs: [T] / [B, S] behaviour log-probs; None = on-policy (ratio 1).
        advantages, mask: [T] / [B, S]; mask 1 marks response tokens.
        cfg: LossConfig (variant, clip, KL, entropy, aggregation, TIS, backend).
        ref_logprobs: reference-policy log-probs (k3 KL; needed when cfg.kl_coef > 0).
        tp_group: torch.distributed group over which the vocab is sharded (None: unsharded).
        rollout_logprobs: rollout-engine log-probs for truncated IS (cfg.tis_cap > 0).
        seq_ids: [T] sequence index per token for packed flat input (GRPO/Dr.GRPO/GSPO).
        seq_weights: [num_seqs] per-sequence aggregation weights (groups of different sizes:
            :func:`megagrpo.algo.advantages.sequence_weights`); None: all 1.
        probe_logprobs: [T] / [B, S] log-probs to compare this forward's with (the engine's,
            when the training forward is also the behaviour forward): adds the unweighted
            ``loss/logprob_mismatch_sum`` / ``_tokens_sum`` / ``_max`` metrics.

    Returns:
        (loss 0-d fp32 tensor, differentiable w.r.t. logits; metrics: detached 0-d tensors
        ``loss/policy``, ``loss/kl``, ``loss/entropy``, ``loss/clip_frac``, ratio stats, ...).
    """
    v_local = logits.shape[-1]
    lead = logits.shape[:-1]
    plan = make_plan(
        lead,
        logits.device,
        target_ids,
        old_logprobs,
        advantages,
        mask,
        cfg,
        ref_logprobs,
        tp_group,
        rollout_logprobs,
        seq_ids,
        seq_weights,
        probe_logprobs,
    )
    logits2d = logits.reshape(-1, v_local)
    if logits2d.stride(1) != 1:
        logits2d = logits2d.contiguous()
    if logits2d.data_ptr() != logits.data_ptr() or logits2d.stride(1) != 1:
        log.warning(
            "fused_policy_loss: logits %s with strides %s are copied; pass a [T, V] "
            "view to avoid an extra [T, V] tensor",
            tuple(logits.shape),
            logits.stride(),
        )
    loss = _FusedPolicyLoss.apply(logits2d, plan)
    return loss, plan.metrics


def make_plan(
    lead: torch.Size,
    device: torch.device,
    target_ids: Tensor,
    old_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    ref_logprobs: Tensor | None,
    tp_group,
    rollout_logprobs: Tensor | None,
    seq_ids: Tensor | None,
    seq_weights: Tensor | None,
    probe_logprobs: Tensor | None = None,
) -> LossPlan:
    """The per-token inputs checked against the leading shape ``lead`` ([T] or [B, S]) and
    flattened to [T] (ValueError naming the input whose shape differs)."""
    for name, t in (
        ("target_ids", target_ids),
        ("advantages", advantages),
        ("mask", mask),
        ("old_logprobs", old_logprobs),
        ("ref_logprobs", ref_logprobs),
        ("rollout_logprobs", rollout_logprobs),
        ("probe_logprobs", probe_logprobs),
    ):
        if t is not None and tuple(t.shape) != tuple(lead):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(lead)}")
    ids, num_seqs = make_seq_ids(lead, seq_ids, device)

    def flat(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.reshape(-1).float()

    return LossPlan(
        target_ids.reshape(-1),
        flat(old_logprobs),
        advantages.reshape(-1).float(),
        mask.reshape(-1).float(),
        cfg,
        flat(ref_logprobs),
        flat(rollout_logprobs),
        ids,
        num_seqs,
        tp_group,
        resolve_backend(cfg.backend, device),
        flat(seq_weights),
        flat(probe_logprobs),
    )
