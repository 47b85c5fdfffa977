"""Whether a run's weight sync delivers the LoRA update to the engines exactly.

An adapter sync is exact (the engines serve the trained factors); a merged sync sends
``cast(W + dW)`` and keeps only part of the update in a bf16 / fp16 / FP8 engine
(:mod:`megagrpo.model.survival` predicts how much). A lossy sync is refused unless the
config says ``trainer.allow_lossy_sync: true`` (``weight_sync: merged`` alone is not
consent): at load here (:func:`refuse_lossy_at_load`, where the model's config.json is
readable), again at start with the engines' real dtype and the checkpoint's weight scales
(``megagrpo.trainer.sync.check_sync_exactness``). The planner labels layouts with the same
prediction (:mod:`megagrpo.plan.exactness`).

The functions take the run config (``megagrpo.trainer.config.RunConfig``) as ``cfg``; this
module does not import the trainer.
"""

from __future__ import annotations

import logging
from typing import Any

from megagrpo.errors import ConfigError
from megagrpo.model.survival import (
    SurvivalPrediction,
    TargetShape,
    known_shapes,
    merge_format,
    predict_survival,
)
from megagrpo.rollout.config import resolved_weight_sync, serves_adapters

log = logging.getLogger(__name__)


def engine_weight_dtype(cfg: Any, hf: dict | None) -> str:
    """The engines' weight dtype as they resolve it: ``rollout.dtype``, or with ``auto`` the
    checkpoint's (``hf``'s ``torch_dtype`` / ``dtype``), else float32."""
    if cfg.rollout.dtype != "auto":
        return cfg.rollout.dtype
    name = str((hf or {}).get("torch_dtype") or (hf or {}).get("dtype") or "float32")
    return name.removeprefix("torch.")


def merged_sync_survival(
    cfg: Any,
    shapes: list[TargetShape],
    hf: dict,
    engine_dtype: str | None = None,
    weight_std: dict[str, float] | None = None,
    weight_source: str = "",
) -> SurvivalPrediction:
    """The predicted survival of the LoRA update through ``cfg``'s merged sync
    (:func:`megagrpo.model.survival.predict_survival` on its lr, schedule, warm-up, LoRA shape
    and formats); ``engine_dtype`` None: :func:`engine_weight_dtype`."""
    tr, lora = cfg.trainer, cfg.model.lora
    fmt = merge_format(
        cfg.model.dtype,
        engine_dtype or engine_weight_dtype(cfg, hf),
        cfg.rollout.quantization,
    )
    return predict_survival(
        fmt=fmt,
        lr=tr.lr,
        rank=lora.rank,
        alpha=lora.alpha,
        shapes=shapes,
        warmup=tr.num_warmup_steps,
        schedule=tr.lr_schedule,
        total_steps=tr.max_steps,
        min_ratio=tr.min_lr / tr.lr if tr.lr > 0 else 0.0,
        weight_std=weight_std,
        weight_source=weight_source,
        base_fmt=cfg.model.dtype,
    )


def refuse_lossy_sync(cfg: Any, pred: SurvivalPrediction) -> None:
    """ConfigError naming ``trainer.allow_lossy_sync`` when ``pred`` is lossy and ``cfg`` did
    not allow it; a warning when it did."""
    if pred.exact:
        return
    what = f"trainer.weight_sync resolves to merged: the sync is lossy ({pred.summary()})"
    if cfg.trainer.allow_lossy_sync:
        log.warning("%s; allowed by trainer.allow_lossy_sync", what)
        return
    raise ConfigError(
        f"config key 'trainer.allow_lossy_sync': {what}; the engines would sample another "
        "policy than the one trained. Use the exact adapter sync (trainer.weight_sync="
        "adapter, rollout.enable_lora=true, rollout.max_lora_rank >= model.lora.rank), "
        "model.dtype=float32 with an fp32 engine, or set trainer.allow_lossy_sync=true to "
        "run it knowingly (`megagrpo plan-memory --gpus N` ranks the exact layouts)"
    )


def refuse_lossy_at_load(cfg: Any, hf: dict | None) -> None:
    """At load, where the model's config is here: refuse a lossy merged sync
    (:func:`refuse_lossy_sync`) as the trainer would resolve it on GPUs (the engines serving
    adapters where ``rollout.enable_lora``); the start of a run checks again with the engines'
    real dtype and the checkpoint's weight scales."""
    shapes = known_shapes(hf, cfg.model.lora.targets)
    if shapes is None or hf is None:
        return
    serves = serves_adapters(cfg.rollout.engine, cfg.rollout.enable_lora, True, False)
    if resolved_weight_sync(cfg.trainer.weight_sync, serves) != "merged":
        return
    refuse_lossy_sync(cfg, merged_sync_survival(cfg, shapes, hf))
