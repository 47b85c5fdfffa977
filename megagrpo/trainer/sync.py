"""Phase 6 of a step: what the engines receive after the update, and the probe that verifies it.

``trainer.weight_sync`` (``auto``: adapter where the engines serve LoRA, else merged):
``merged`` streams the policy's merged (base + LoRA) HF tensors in
bounded buckets (``export_hf_weights``, a collective over the model-parallel ranks, so every
rank iterates it); ``adapter`` writes the PEFT adapter (a few MB; collective, rank 0 writes)
and the engine serves it on its base weights. Where it goes (rank 0's engine, or every
replica's) is the placement's job (:meth:`megagrpo.placement.rollouts.Rollouts.push`).

Verification is exact: every rank computes the trainer's log-probs of the engines' fixed
probe sequence under the new weights, and each engine must reproduce them within
``rollout.verify_tol`` (``expected_probe``); a sync that silently changed nothing raises
WeightSyncError.

``trainer.sync_transport`` decides how merged tensors travel between the trainer's ranks
(:mod:`megagrpo.model.sync_transport`); ``trainer.offload_during_rollout`` puts the trainer's
frozen weights on the host before the push (:mod:`megagrpo.placement.offload`). At start-up
(:func:`first_probes`, then :func:`start_engines`) the probes are computed before the engines
start, and engines started from dummy weights get the real ones in one verified merged sync.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megagrpo.gate.sync_exactness import merged_sync_survival, refuse_lossy_sync
from megagrpo.kernels import token_stats
from megagrpo.model import Policy
from megagrpo.model.peft_export import ExpertBlocks
from megagrpo.model.survival import WARN_SURVIVAL, checkpoint_weight_stds, known_shapes
from megagrpo.model.sync_transport import RegionFn
from megagrpo.parallel.comm import Comm
from megagrpo.parallel.strict import check_on_device
from megagrpo.placement.rollouts import WeightUpdate
from megagrpo.rollout.config import resolved_weight_sync
from megagrpo.rollout.lora import PeftAdapter, read_peft_adapter
from megagrpo.trainer.context import TrainContext

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


def _merged_stream(
    policy: Policy, merge_lora: bool, transport: str, needs: RegionFn | None
) -> Iterator[tuple[str, torch.Tensor]]:
    kwargs: dict = {} if transport == "allreduce" else {"transport": transport, "needs": needs}
    for bucket in policy.export_hf_weights(merge_lora=merge_lora, **kwargs):
        yield from bucket


def weight_update(
    policy: Policy,
    mode: str,
    comm: Comm,
    *,
    transport: str = "allreduce",
    needs: RegionFn | None = None,
    merge_lora: bool = True,
    full_check: bool | None = None,
    adapter_transport: str = "peft_dir",
    adapter_dtype: torch.dtype | None = None,
    adapter_dst: int | None = 0,
    policy_lora: Any = None,
    adapter_experts: ExpertBlocks | None = None,
) -> WeightUpdate:
    """What this sync sends (collective): the merged-tensor stream (``transport`` /
    ``needs``: :mod:`megagrpo.model.sync_transport`; ``merge_lora=False``: the base weights
    alone), or the adapter: ``adapter_transport=peft_dir`` reads it back on rank 0 from the
    directory the policy exported it to; ``streamed`` builds it in ``adapter_dtype`` on global
    rank ``adapter_dst`` (None: every rank; ``adapter_experts``: per rank the experts its
    engine holds, the only ones it receives) from bucketed collectives
    (:meth:`megagrpo.model.Policy.stream_adapter`; ``policy_lora``: the LoRA config). Either
    way the experts carry vLLM's per-expert names (``mlp.experts.{e}.gate_proj`` ...)."""
    if mode == "merged":
        if transport == "sliced":
            full_check = False  # the engines' checksums need whole tensors
        stream = _merged_stream(policy, merge_lora, transport, needs)
        return WeightUpdate("merged", stream=stream, full_check=full_check)
    if adapter_transport == "streamed":
        assert adapter_dtype is not None
        state = policy.stream_adapter(adapter_dtype, adapter_dst, adapter_experts)
        adapter = None
        if state is not None:
            lora = policy_lora  # rank / alpha of the adapter
            adapter = PeftAdapter.from_peft_state_dict(state, lora.rank, lora.alpha)
        return WeightUpdate("adapter", adapter=adapter, in_memory=True)
    tmp = comm.broadcast_object(tempfile.mkdtemp(prefix="megagrpo-sync-") if comm.is_main else None)
    try:
        out = policy.export_peft_adapter(f"{tmp}/adapter", expert_format="per_expert")
        adapter = read_peft_adapter(out) if out is not None else None
    finally:
        if comm.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
    return WeightUpdate("adapter", adapter=adapter)


def sync_mode(ctx: TrainContext) -> str:
    """``trainer.weight_sync`` as it runs (:func:`~megagrpo.rollout.config.resolved_weight_sync`
    of what the engines serve)."""
    return resolved_weight_sync(ctx.cfg.trainer.weight_sync, ctx.rollouts.supports_adapter_sync)


def push_weights(
    ctx: TrainContext,
    mode: str,
    expected: list[float],
    *,
    merge_lora: bool = True,
    full_check: bool | None = None,
) -> dict[str, float]:
    """Collective: build the update (``mode``; ``trainer.sync_transport``), put the trainer's
    frozen weights and moments on the host (``trainer.offload_during_rollout``: the engines
    wake into that memory; a merged export streams the base from there), push it into every
    engine, verified against ``expected``. Returns ``perf/sync_bytes``, ``sync/*``."""
    transport = ctx.cfg.trainer.sync_transport
    needs = ctx.rollouts.regions() if transport == "sliced" else None
    streamed = mode == "adapter" and ctx.cfg.trainer.adapter_transport == "streamed"
    update = weight_update(
        ctx.policy,
        mode,
        ctx.comm,
        transport=transport,
        needs=needs,
        merge_lora=merge_lora,
        full_check=full_check,
        adapter_transport=ctx.cfg.trainer.adapter_transport,
        adapter_dtype=ctx.rollouts.engine_dtype() if streamed else None,
        adapter_dst=ctx.rollouts.adapter_dst,
        policy_lora=ctx.cfg.model.lora,
        adapter_experts=ctx.rollouts.adapter_experts() if streamed else None,
    )
    ctx.offload.for_sync()
    metrics = ctx.rollouts.push(update, expected)
    if update.mode == "merged":
        # what this rank received from the other trainer ranks
        metrics["sync/transport_recv_mb"] = ctx.policy.export_bytes_received() / 1e6
        if merge_lora:  # how much of the LoRA update the base dtype kept (collective)
            metrics.update(ctx.policy.merge_survival(None))
            warn_low_survival(ctx, metrics)
    return metrics


def warn_low_survival(ctx: TrainContext, metrics: dict[str, float]) -> None:
    """A warning (rank 0) for every sync whose ``sync/lora_survival`` is below
    :data:`~megagrpo.model.survival.WARN_SURVIVAL`: the engines sample another policy."""
    survival = metrics.get("sync/lora_survival", 1.0)
    if survival < WARN_SURVIVAL and ctx.comm.is_main:
        log.warning(
            "step %d: the merged sync delivered %.1f%% of the LoRA update "
            "(sync/lora_survival < %.1f): the engines sample another policy than the one "
            "trained; trainer.weight_sync=adapter is exact",
            ctx.step,
            100 * survival,
            WARN_SURVIVAL,
        )


def check_sync_exactness(ctx: TrainContext, model_path: str, hf: dict | None) -> dict[str, Any]:
    """At start (collective): whether the run's weight sync delivers the LoRA update exactly.
    Adapter sync is exact; a merged one is predicted with the engines' real dtype and the
    checkpoint's weight scales (read on rank 0: :func:`megagrpo.model.survival.
    checkpoint_weight_stds`), logged, and refused when lossy unless
    ``trainer.allow_lossy_sync`` (:mod:`megagrpo.gate.sync_exactness`). Returns the prediction
    (``{}`` for an adapter sync) for the run's log."""
    mode = sync_mode(ctx)
    if mode != "merged" or not ctx.cfg.model.lora.targets:
        if ctx.comm.is_main:
            log.info("weight sync: %s: exact (the engines serve the adapter as trained)", mode)
        return {}
    shapes = known_shapes(hf, ctx.cfg.model.lora.targets)
    if shapes is None or hf is None:  # test stand-ins without a model: measured per sync only
        if ctx.comm.is_main:
            log.info("weight sync: merged; no model config to predict its survival from")
        return {}
    engine = str(ctx.rollouts.engine_dtype()).removeprefix("torch.")  # collective (first call)
    stds = checkpoint_weight_stds(model_path, shapes) if ctx.comm.is_main else None
    stds = ctx.comm.broadcast_object(stds)
    source = f"checkpoint {model_path}" if stds else ""
    pred = merged_sync_survival(ctx.cfg, shapes, hf, engine, stds, source)
    if ctx.comm.is_main:
        status = "exact" if pred.exact else "LOSSY"
        log.info("weight sync: merged into a %s engine: %s; %s", engine, status, pred.summary())
    refuse_lossy_sync(ctx.cfg, pred)
    return pred.as_dict()


def sync_weights(ctx: TrainContext) -> dict[str, float]:
    """The trainer's probe of the new weights, then :func:`push_weights` (the engines wake in
    stages); returns ``perf/sync_bytes``, ``sync/*``."""
    with ctx.timed("sync/probe"):
        expected = trainer_probe(ctx, ctx.rollouts.probe_token_ids)
    with ctx.timed("sync/push"):
        return push_weights(ctx, sync_mode(ctx), expected)


@dataclass
class FirstProbes:
    """The trainer's probe log-probs computed before the engines start (the trainer's weights
    may have to leave the device for them): of the policy, and of its frozen base."""

    policy: list[float]
    base: list[float] | None = None


def first_probes(ctx: TrainContext, probe_ids: list[int], need_base: bool) -> FirstProbes:
    """Collective, before the engines start: the probe of the (restored) policy and, with
    ``need_base`` (engines from dummy weights, or a resumed run), of the base alone: the base
    push is verified on it, and it is what engines started from the model directory hold."""
    probes = FirstProbes(trainer_probe(ctx, probe_ids))
    if need_base:
        with ctx.policy.adapters_disabled():
            probes.base = trainer_probe(ctx, probe_ids)
    return probes


def start_engines(ctx: TrainContext, probes: FirstProbes, resumed: bool) -> dict[str, float]:
    """The engines' first weights (collective; they started after :func:`first_probes`):

    * ``rollout.load_format=dummy``: one verified merged sync before step 1, checksums
      included (except sliced) — the merged policy for merged sync; for adapter sync the base
      alone (the engine serves the adapter on top of it), then the adapter of a resumed run;
    * real weights: a resumed run's adapters / merged weights, judged against the base's
      probe (what the engines hold: a checkpoint whose LoRA is still untrained changes
      nothing, and that is right); a fresh run sends nothing (its LoRA B is zero: the
      engines hold the policy already).

    Afterwards :attr:`Rollouts.last_probe` is the policy's probe. Returns the last sync's
    metrics ({} when nothing was sent)."""
    metrics: dict[str, float] = {}
    mode = sync_mode(ctx)
    if ctx.cfg.rollout.load_format == "dummy":
        if mode == "merged":
            metrics = push_weights(ctx, "merged", probes.policy, full_check=True)
            ctx.rollouts.last_probe = probes.policy
            return metrics
        assert probes.base is not None
        metrics = push_weights(ctx, "merged", probes.base, merge_lora=False, full_check=True)
        ctx.rollouts.last_probe = probes.base
        log.info("engines loaded the base weights from the trainer (load_format=dummy)")
    if resumed:
        if ctx.rollouts.last_probe is None:
            ctx.rollouts.last_probe = probes.base  # the engines hold the base model
        metrics = push_weights(ctx, mode, probes.policy)
    ctx.rollouts.last_probe = probes.policy
    return metrics
