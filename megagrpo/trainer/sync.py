"""Phase 6 of a step: wake the engine and push the new weights into it, verified.

``trainer.weight_sync``: ``merged`` (default, below) or ``adapter`` (the PEFT adapter only,
served by the engine on its base weights; :func:`_sync_adapter`).

The policy streams merged (base + LoRA) HF-named tensors in bounded buckets
(``export_hf_weights``: a collective over the model-parallel ranks, so every rank iterates
it); rank 0 feeds them to ``engine.update_weights``. Verification is exact: every rank
computes the trainer's log-probs of the engine's fixed probe sequence under the new
weights and the engine must reproduce them within ``rollout.verify_tol``
(``expected_probe``); a sync that silently changed nothing raises WeightSyncError.

With sharded rollouts (an engine on every rank) every rank feeds the full tensors of the
same export to its own engine and verifies its own probe; the outcomes are all-gathered and
a failure on any rank raises WeightSyncError on every rank (:func:`_on_every_rank`).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from megagrpo.kernels import token_stats
from megagrpo.rollout.lora import LoraAdapter
from megagrpo.trainer.context import TrainContext

log = logging.getLogger(__name__)


def _stream(ctx: TrainContext):
    for bucket in ctx.policy.export_hf_weights(merge_lora=True):
        yield from bucket


@torch.no_grad()
def trainer_probe(ctx: TrainContext, probe_ids: list[int]) -> list[float]:
    """The trainer's log-probs ``[L - 1]`` of ``probe_ids[1:]`` (collective over TP)."""
    ids = torch.tensor([probe_ids], dtype=torch.long)
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    logits = ctx.policy.forward_logits(ids, pos)
    logp, *_ = token_stats(
        logits[0, :-1].contiguous(), ids[0, 1:], tp_group=ctx.tp_group, backend=ctx.cfg.loss.backend
    )
    return logp.double().tolist()


def sync_weights(ctx: TrainContext) -> dict[str, float]:
    """Wake the engine (rank 0) and sync the merged weights; returns ``perf/sync_bytes`` etc."""
    probe_ids = getattr(ctx.engine, "probe_token_ids", None) if ctx.comm.is_main else None
    probe_ids = ctx.comm.broadcast_object(probe_ids)
    expected = trainer_probe(ctx, probe_ids) if probe_ids else None
    if ctx.cfg.trainer.weight_sync == "adapter":
        return _sync_adapter(ctx, expected)
    if ctx.sharded:
        stream = _stream(ctx)

        def merged():
            try:
                ctx.engine.wake_up()
                return ctx.engine.update_weights(stream, expected_probe=expected)
            finally:
                for _ in stream:  # a failed load: still finish the export's collectives
                    pass

        return _on_every_rank(ctx, merged)
    if not ctx.comm.is_main:
        for _ in _stream(ctx):  # take part in the export's collectives
            pass
        ctx.comm.barrier()
        return {"perf/sync_bytes": 0.0}
    ctx.engine.wake_up()
    report = ctx.engine.update_weights(_stream(ctx), expected_probe=expected)
    ctx.comm.barrier()
    return _report_metrics(report)


def _report_metrics(report) -> dict[str, float]:
    # update_weights raises WeightSyncError when the probe disagrees; never trust silence.
    if not getattr(report, "verified", False):
        from megagrpo.rollout.base import WeightSyncError

        raise WeightSyncError(f"weight sync not verified: {report}")
    return {
        "perf/sync_bytes": float(report.bytes),
        "sync/probe_max_diff": float(getattr(report, "max_probe_diff", 0.0)),
        "sync/engine_s": float(report.seconds),
    }


def _on_every_rank(ctx: TrainContext, sync) -> dict[str, float]:
    """Run ``sync() -> SyncReport`` on every rank's engine; all ranks fail if any fails.

    Returns rank 0's metrics with ``sync/probe_max_diff`` the max over ranks and
    ``sync/verified_ranks`` the number of engines that verified the new weights.
    """
    error, metrics = None, {}
    try:
        metrics = _report_metrics(sync())
    except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
        error = f"rank {ctx.comm.rank}: {type(exc).__name__}: {exc}"
    outcomes = ctx.comm.all_gather_object((error, metrics))
    errors = [e for e, _ in outcomes if e]
    if errors:
        from megagrpo.rollout.base import WeightSyncError

        raise WeightSyncError("weight sync failed on " + "; ".join(errors))
    out = dict(metrics)
    out["sync/probe_max_diff"] = max(m["sync/probe_max_diff"] for _, m in outcomes)
    out["sync/verified_ranks"] = float(len(outcomes))
    return out


def _sync_adapter(ctx: TrainContext, expected: list[float] | None) -> dict[str, float]:
    """Adapter-only sync: the policy writes its PEFT adapter (collective, rank 0 writes) and
    the engine serves it on top of its base weights; verified like a merged sync."""
    tmp = tempfile.mkdtemp(prefix="megagrpo-sync-") if ctx.comm.is_main else None
    tmp = ctx.comm.broadcast_object(tmp)
    out = ctx.policy.export_peft_adapter(tmp + "/adapter")
    if ctx.sharded:
        return _sync_adapter_sharded(ctx, out, tmp, expected)
    if not ctx.comm.is_main:
        ctx.comm.barrier()
        return {"perf/sync_bytes": 0.0}
    try:
        adapter = _read_adapter(out)
        ctx.engine.wake_up()
        report = ctx.engine.update_adapter(adapter, expected_probe=expected)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ctx.comm.barrier()
    return _report_metrics(report)


def _read_adapter(out) -> LoraAdapter:
    conf = json.loads((Path(out) / "adapter_config.json").read_text(encoding="utf-8"))
    state = load_file(str(Path(out) / "adapter_model.safetensors"))
    return LoraAdapter.from_peft_state_dict(state, int(conf["r"]), float(conf["lora_alpha"]))


def _sync_adapter_sharded(
    ctx: TrainContext, out, tmp: str, expected: list[float] | None
) -> dict[str, float]:
    """Rank 0 reads the adapter it wrote and broadcasts it (ranks may not share a disk);
    every rank's engine serves it, verified (:func:`_on_every_rank`)."""
    adapter = None
    if ctx.comm.is_main:
        try:
            adapter = _read_adapter(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    adapter = ctx.comm.broadcast_object(adapter)

    def serve():
        ctx.engine.wake_up()
        return ctx.engine.update_adapter(adapter, expected_probe=expected)

    return _on_every_rank(ctx, serve)
