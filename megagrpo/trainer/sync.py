"""Phase 6 of a step: what the engines receive after the update, and the probe that verifies it.

``trainer.weight_sync`` (``auto``: adapter where the engines serve LoRA, else merged):
``merged`` streams the policy's merged (base + LoRA) HF tensors in
bounded buckets (``export_hf_weights``, a collective over the model-parallel ranks, so every
rank iterates it); ``adapter`` writes the PEFT adapter (a few MB; collective, rank 0 writes)
and the engine serves it on its base weights. Where it goes (rank 0's engine, or every
replica's) is the placement's job (:meth:`megagrpo.trainer.rollouts.Rollouts.push`).

Verification is exact: every rank computes the trainer's log-probs of the engines' fixed
probe sequence under the new weights, and each engine must reproduce them within
``rollout.verify_tol`` (``expected_probe``); a sync that silently changed nothing raises
WeightSyncError.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megagrpo.kernels import token_stats
from megagrpo.model import Policy
from megagrpo.parallel.strict import check_on_device
from megagrpo.rollout.lora import read_peft_adapter
from megagrpo.trainer.context import Comm, TrainContext
from megagrpo.trainer.rollouts import WeightUpdate

log = logging.getLogger(__name__)


def trainer_probe(ctx: TrainContext, probe_ids: list[int]) -> list[float]:
    """The trainer's log-probs ``[L - 1]`` of ``probe_ids[1:]`` (collective over TP), in
    scoring mode (no LoRA dropout: the engine serves the dropout-free policy)."""
    ids = torch.tensor([probe_ids], dtype=torch.long, device=ctx.pgs.device)
    pos = torch.arange(ids.shape[1], device=ctx.pgs.device).unsqueeze(0)

    def logp(logits: torch.Tensor, i: int) -> tuple[None, torch.Tensor]:
        check_on_device("probe", logits=logits, ids=ids)
        lp, *_ = token_stats(
            logits[0, :-1].contiguous(),
            ids[0, 1:],
            tp_group=ctx.tp_group,
            backend=ctx.cfg.loss.backend,
        )
        return None, lp

    with ctx.policy.scoring():  # pipeline: computed on the last stage, broadcast to all
        (out,) = ctx.policy.forward_backward([_Probe(ids, pos)], logp, forward_only=True)
    return out.double().tolist()


@dataclass
class _Probe:
    """The probe sequence as a one-row micro-batch."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor


def _merged_stream(policy: Policy) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in policy.export_hf_weights(merge_lora=True):
        yield from bucket


def weight_update(policy: Policy, mode: str, comm: Comm) -> WeightUpdate:
    """What this sync sends (collective): the merged-tensor stream, or the PEFT adapter (read
    back on rank 0 from the directory the policy exported it to)."""
    if mode == "merged":
        return WeightUpdate("merged", stream=_merged_stream(policy))
    tmp = comm.broadcast_object(tempfile.mkdtemp(prefix="megagrpo-sync-") if comm.is_main else None)
    try:
        out = policy.export_peft_adapter(f"{tmp}/adapter")
        adapter = read_peft_adapter(out) if out is not None else None
    finally:
        if comm.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
    return WeightUpdate("adapter", adapter=adapter)


def sync_mode(ctx: TrainContext) -> str:
    """``trainer.weight_sync``, with auto: adapter where the engines serve LoRA, else merged."""
    mode = ctx.cfg.trainer.weight_sync
    if mode == "auto":
        return "adapter" if ctx.rollouts.supports_adapter_sync else "merged"
    return mode


def sync_weights(ctx: TrainContext) -> dict[str, float]:
    """Wake the engines and push the new weights into them, verified; returns
    ``perf/sync_bytes``, ``sync/*``."""
    expected = trainer_probe(ctx, ctx.rollouts.probe_token_ids)
    update = weight_update(ctx.policy, sync_mode(ctx), ctx.comm)
    metrics = ctx.rollouts.push(update, expected)
    if update.mode == "merged":  # how much of the LoRA update the base dtype kept (collective)
        metrics.update(ctx.policy.merge_survival(None))
    return metrics
