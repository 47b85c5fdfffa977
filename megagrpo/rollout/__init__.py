"""Rollout engines: generate groups of G answers and take verified weight updates.

``build_engine(cfg, model_path, seed)`` returns a :class:`RolloutEngine` (vLLM colocated,
or transformers ``generate``). The trainer imports only this package's protocol-level names;
vllm is imported lazily inside the vLLM engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from megagrpo.rollout.base import (
    EngineError,
    RolloutEngine,
    SamplingSpec,
    SyncReport,
    WeightSyncError,
)
from megagrpo.rollout.config import RolloutConfig, resolved_weight_sync
from megagrpo.rollout.lora import PeftAdapter, merged_stream
from megagrpo.rollout.stream import to_checkpoint_format

__all__ = [
    "EngineError",
    "PeftAdapter",
    "RolloutConfig",
    "RolloutEngine",
    "SamplingSpec",
    "SyncReport",
    "WeightSyncError",
    "build_engine",
    "sync_lora",
    "to_checkpoint_format",
]


def build_engine(rollout_cfg: RolloutConfig, model_path: str, seed: int = 0) -> RolloutEngine:
    """Start the engine ``rollout_cfg.engine`` ("vllm" | "hf") on the HF checkpoint
    ``model_path``. Raises EngineError (message names the config keys to change)."""
    rollout_cfg.validate("rollout")
    if rollout_cfg.engine == "vllm":
        from megagrpo.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(rollout_cfg, model_path, seed)
    from megagrpo.rollout.hf_engine import HFEngine

    return HFEngine(rollout_cfg, model_path, seed)


def sync_lora(
    engine: RolloutEngine,
    adapter: PeftAdapter,
    base_named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    expected_probe: Sequence[float] | None = None,
) -> SyncReport:
    """Sync a LoRA policy: adapter-only where the engine supports it, else merged.

    ``base_named_tensors`` (the frozen base weights, HF names) is needed for the merged path
    only; it is streamed once with the adapter folded in (``W + alpha/r * B @ A``).
    """
    if resolved_weight_sync("auto", engine.supports_adapter_sync()) == "adapter":
        return engine.update_adapter(adapter, expected_probe=expected_probe)
    if base_named_tensors is None:
        raise EngineError(
            f"engine {type(engine).__name__} cannot serve LoRA adapters "
            "alone (rollout.enable_lora=false or unsupported modules): pass the "
            "base weights so the adapter is merged"
        )
    return engine.update_weights(
        merged_stream(base_named_tensors, adapter), expected_probe=expected_probe
    )
