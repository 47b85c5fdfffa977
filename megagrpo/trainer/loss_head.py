"""The loss and log-probs of one micro-batch from what the model returns: its logits, or
(``loss.fused_linear``, the default) its final hidden states and the output weight.

    with model_output(policy, loss_cfg) as weight:      # None: logits; else [V/TP, H]
        outs = policy.forward_backward(mbs, lambda out, i: micro_batch_loss(out, weight, ...))

With the output weight the loss multiplies the hidden states by it chunk by chunk
(:func:`megagrpo.kernels.fused_linear_policy_loss`), so training never holds the
``[T, V/TP]`` logits of a micro-batch nor their gradient: on the last pipeline stage of a
large-vocabulary model these are the biggest activation. Sampling temperature: the
tempered logits ``logits / T`` equal ``(hidden / T) @ W^T``, so the hidden states are divided.

A segment row (shared prefix, :mod:`megagrpo.trainer.prefix_batch`) lists its loss tokens
apart from the row: the rows ``mb.loss_index`` of the output are gathered first
(:func:`loss_rows`; each completion's first token is predicted from the prompt's last
position, so that row is taken once per completion and its gradient is their sum).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch
import torch.distributed as dist

from megagrpo.algo.config import LossConfig
from megagrpo.kernels import (
    fused_linear_policy_loss,
    fused_linear_token_stats,
    fused_policy_loss,
    token_stats,
)
from megagrpo.model import Policy
from megagrpo.parallel.strict import check_on_device
from megagrpo.trainer.batch import MicroBatch

Tensor = torch.Tensor


def tempered(logits: Tensor, temperature: float) -> Tensor:
    """``logits / temperature`` (``rollout.logprobs=sampling``; one more logits-sized tensor
    in the model's dtype), ``logits`` itself at 1. Also right for hidden states: the output
    projection is linear."""
    return logits if temperature == 1.0 else logits / temperature


@contextlib.contextmanager
def model_output(policy: Policy, loss_cfg: LossConfig) -> Iterator[Tensor | None]:
    """Inside the block the policy's forwards return hidden states when
    ``loss_cfg.fused_linear`` (yields the output weight), else logits (yields None)."""
    if not loss_cfg.fused_linear:
        yield None
        return
    with policy.hidden_output() as weight:
        yield weight


def loss_rows(output: Tensor, mb: MicroBatch) -> Tensor:
    """``output`` ``[B, T, *]`` at the positions predicting ``mb``'s loss tokens: itself, or
    for a segment row the gathered ``[1, N, *]`` (``mb.loss_index``)."""
    if mb.loss_index is None:
        return output
    return output.index_select(1, mb.loss_index.to(output.device))


def micro_batch_loss(
    output: Tensor,
    weight: Tensor | None,
    mb: MicroBatch,
    old: Tensor | None,
    ref: Tensor | None,
    cfg: LossConfig,
    tp_group: dist.ProcessGroup | None,
    temperature: float,
    probe: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The fused GRPO-family loss of micro-batch ``mb`` from ``output`` (logits
    ``[B, T, V/TP]`` when ``weight`` is None, else hidden states ``[B, T, H]``). ``probe``:
    also the unweighted ``loss/logprob_mismatch_*`` sums of this forward's log-probs
    against the engine's (``mb.rollout_logprobs``)."""
    check_on_device(
        "loss",
        output=output,
        target_ids=mb.target_ids,
        old_logprobs=old,
        advantages=mb.advantages,
        mask=mb.mask,
        ref_logprobs=ref,
        rollout_logprobs=mb.rollout_logprobs,
    )
    x = tempered(loss_rows(output, mb), temperature)
    rollout = mb.rollout_logprobs if cfg.tis_cap > 0 else None
    if weight is None:
        fused = partial(fused_policy_loss, x)
    else:
        fused = partial(fused_linear_policy_loss, x, weight)
    return fused(
        mb.target_ids,
        old,
        mb.advantages,
        mb.mask,
        cfg,
        ref_logprobs=ref,
        tp_group=tp_group,
        rollout_logprobs=rollout,
        seq_ids=mb.seq_ids,
        seq_weights=mb.seq_weights,
        probe_logprobs=mb.rollout_logprobs if probe else None,
    )


def micro_batch_logprobs(
    output: Tensor,
    weight: Tensor | None,
    mb: MicroBatch,
    cfg: LossConfig,
    tp_group: dist.ProcessGroup | None,
    temperature: float,
) -> Tensor:
    """Log-probs ``[B, T]`` fp32 of ``mb``'s targets (0 off the mask) from ``output`` (as in
    :func:`micro_batch_loss`), no gradient."""
    check_on_device("logprobs", output=output, target_ids=mb.target_ids, mask=mb.mask)
    x = tempered(loss_rows(output, mb), temperature)
    if weight is None:
        lp, *_ = token_stats(
            x, mb.target_ids, tp_group=tp_group, backend=cfg.backend, chunk_bytes=cfg.chunk_bytes
        )
    else:
        lp, _ = fused_linear_token_stats(
            x,
            weight,
            mb.target_ids,
            tp_group,
            cfg.backend,
            cfg.chunk_bytes,
            mask=mb.mask,
            min_rows=cfg.fused_chunk_rows,
        )
    return lp.reshape(mb.target_ids.shape).float() * mb.mask
