"""Fused output projection + GRPO-family loss: hidden -> logits chunked over tokens.

What training calls by default (``loss.fused_linear``): the policy hands over its final
hidden states and output weight (its vocab shard) rather than logits
(:mod:`megagrpo.model.lm_head`, :mod:`megagrpo.trainer.loss_head`); tested against the same
reference (``tests/unit/test_loss_fused_linear.py``) and against the logits path in training
(``tests/distributed/test_fused_linear_training.py``).

Neither the [T, V_local] logits nor their gradient ever exist in full: pass 1 computes each
chunk's logits hidden_c @ W^T, reduces them to per-token softmax stats and drops them; the
O(T) epilogue gives the loss and g = dL/dlogp, h = dL/dH; pass 2 recomputes each chunk's
logits, turns them in place into their gradient and contracts it at once into
grad_hidden [T, H] and grad_weight [V_local, H] (fp32 accumulation). Both gradients are
computed during forward and scaled by the upstream gradient in backward (as Liger does).

Vocab parallel: W is this rank's shard [V_local, H]; stats are combined over ``tp_group``.
grad_hidden is this rank's partial sum over its vocab shard, exactly what Megatron's
ColumnParallelLinear matmul produces: the caller's ``copy_to_tensor_model_parallel_region``
(or an explicit all-reduce) sums it over the group.
"""

from __future__ import annotations

import torch

from megagrpo.algo.config import LossConfig
from megagrpo.kernels.fused_loss import (
    LossPlan,
    grad_pass,
    loss_from_stats,
    make_plan,
    resolve_backend,
    stats_pass,
)
from megagrpo.kernels.vocab_parallel import combine_stats, vocab_start_of

Tensor = torch.Tensor


def _chunks(T: int, step: int):
    for r0 in range(0, T, step):
        yield r0, min(T, r0 + step)


INERT = (0.0, 1.0, 0.0, 0.0)
"""Stats (max, sum exp, E[x], target logit) of a row whose logits are never computed: finite
log-prob and entropy 0, so a masked-out token's terms stay 0 (not NaN) in the epilogue."""


def active_rows(mask: Tensor | None, T: int) -> Tensor | None:
    """Indices of the tokens the loss reads (``mask != 0``), None when that is all of them.
    Prompt and padding tokens carry no loss: their ``[., V]`` logits are never computed."""
    if mask is None:
        return None
    rows = mask.reshape(-1).nonzero().squeeze(1)
    return None if rows.numel() == T else rows


def _stats_of_rows(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    rows: Tensor | None,
    start: int,
    backend: str,
    chunk_bytes: int,
    chunk_tokens: int,
) -> Tensor:
    """Local stats [T, 4] of ``hidden @ weight^T`` on ``rows`` (all when None), chunk by
    chunk; :data:`INERT` elsewhere."""
    T = hidden.shape[0]
    hid = hidden if rows is None else hidden.index_select(0, rows)
    tgt = target if rows is None else target.index_select(0, rows)
    local = torch.empty(hid.shape[0], 4, device=hidden.device, dtype=torch.float32)
    for r0, r1 in _chunks(hid.shape[0], chunk_tokens):
        logits = hid[r0:r1] @ weight.T
        local[r0:r1] = stats_pass(logits, tgt[r0:r1], start, backend, chunk_bytes, None)[0]
    if rows is None:
        return local
    stats = torch.tensor(INERT, device=hidden.device).expand(T, 4).clone()
    stats[rows] = local
    return stats


class _FusedLinearPolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, plan: LossPlan, chunk_tokens: int) -> Tensor:
        T, V = hidden.shape[0], weight.shape[0]
        start = vocab_start_of(plan.tp_group, V)
        cb = plan.cfg.chunk_bytes
        rows = active_rows(plan.mask, T)  # pass 1: stats of the loss tokens only
        stats = _stats_of_rows(
            hidden, weight, plan.target, rows, start, plan.backend, cb, chunk_tokens
        )
        loss, lse, ex, g, h = loss_from_stats(combine_stats(stats, plan.tp_group), plan)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden, dtype=torch.float32) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        if need_h or need_w:
            if rows is not None:  # the other rows' g and h are 0: no gradient
                hidden, lse, ex, g = (x.index_select(0, rows) for x in (hidden, lse, ex, g))
                h = None if h is None else h.index_select(0, rows)
            target = plan.target if rows is None else plan.target.index_select(0, rows)
            for r0, r1 in _chunks(hidden.shape[0], chunk_tokens):  # pass 2: gradients
                logits = hidden[r0:r1] @ weight.T
                hc = None if h is None else h[r0:r1]
                grad_pass(
                    logits,
                    target[r0:r1],
                    lse[r0:r1],
                    ex[r0:r1],
                    g[r0:r1],
                    hc,
                    logits,
                    start,
                    plan.backend,
                    cb,
                )
                if grad_h is not None:
                    gh = (logits @ weight).float()
                    if rows is None:
                        grad_h[r0:r1] = gh
                    else:
                        grad_h.index_copy_(0, rows[r0:r1], gh)
                if grad_w is not None:
                    grad_w.addmm_(logits.T.float(), hidden[r0:r1].float())
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        out_h = None if grad_h is None else (grad_h * grad_loss).to(ctx.dtypes[0])
        out_w = None if grad_w is None else (grad_w * grad_loss).to(ctx.dtypes[1])
        return out_h, out_w, None, None


def fused_linear_policy_loss(
    hidden: Tensor,
    weight: Tensor,
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
    chunk_tokens: int | None = None,
    probe_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO-family loss of logits = hidden @ weight^T without materialising the logits.

    Args:
        hidden: [T, H] or [B, S, H] final hidden states (bf16/fp32).
        weight: [V_local, H] output projection (this rank's vocab shard with tp_group).
        chunk_tokens: tokens per chunk (default :func:`chunk_rows`: cfg.chunk_bytes of logits in
            hidden's dtype, at least cfg.fused_chunk_rows).
        seq_weights: [num_seqs] per-sequence aggregation weights (None: all 1).
        Others: as :func:`megagrpo.kernels.fused_policy_loss`.

    Returns:
        (loss, metrics); loss is differentiable w.r.t. hidden and weight.
    """
    lead = hidden.shape[:-1]
    plan = make_plan(
        lead,
        hidden.device,
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
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V_local, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    if chunk_tokens is None:
        chunk_tokens = chunk_rows(
            cfg.chunk_bytes, weight.shape[0], hidden.element_size(), cfg.fused_chunk_rows
        )
    loss = _FusedLinearPolicyLoss.apply(hidden2d, weight, plan, int(chunk_tokens))
    return loss, plan.metrics


def chunk_rows(chunk_bytes: int, vocab_local: int, itemsize: int, min_rows: int) -> int:
    """Tokens per chunk of the fused-linear head: as many rows of ``[rows, V_local]`` logits
    as fit in ``chunk_bytes``, but at least ``min_rows`` (full-size GEMMs at TP 1: audit 3 P2,
    110-row chunks at 32 MiB of Qwen3's vocabulary)."""
    return max(1, min_rows, chunk_bytes // (vocab_local * itemsize))


@torch.no_grad()
def fused_linear_token_stats(
    hidden: Tensor,
    weight: Tensor,
    target_ids: Tensor,
    tp_group=None,
    backend: str = "auto",
    chunk_bytes: int = 32 << 20,
    chunk_tokens: int | None = None,
    mask: Tensor | None = None,
    min_rows: int = 1024,
) -> tuple[Tensor, Tensor]:
    """Per-token (logp, entropy) [T] fp32 of logits = hidden @ weight^T, chunk by chunk.

    The no-grad twin of :func:`megagrpo.kernels.token_stats` for old / reference log-probs:
    hidden [T, H] or [B, S, H], weight [V_local, H] (this rank's vocab shard with
    ``tp_group``; results are global, identical on every rank). At most one
    ``[chunk_tokens, V_local]`` block of logits exists at a time. ``mask`` (shaped as
    ``target_ids``): only its nonzero tokens are computed, the others are 0. Chunks:
    ``chunk_tokens``, else :func:`chunk_rows` (``min_rows``: ``loss.fused_chunk_rows``).
    """
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    target = target_ids.reshape(-1)
    T, V = hidden2d.shape[0], weight.shape[0]
    if target.shape[0] != T:
        raise ValueError(f"target_ids has {target.shape[0]} tokens, hidden has {T}")
    backend = resolve_backend(backend, hidden.device)
    if chunk_tokens is None:
        chunk_tokens = chunk_rows(chunk_bytes, V, hidden.element_size(), min_rows)
    start = vocab_start_of(tp_group, V)
    rows = active_rows(mask, T)
    stats = _stats_of_rows(
        hidden2d, weight, target, rows, start, backend, chunk_bytes, chunk_tokens
    )
    stats = combine_stats(stats, tp_group)
    lse = stats[:, 0] + torch.log(stats[:, 1])
    return stats[:, 3] - lse, lse - stats[:, 2]
