"""Whether a planned layout trains the policy it samples (`megagrpo plan-memory`).

A merged sync rounds ``W + dW`` to the engine's format: below about 2^-8 of a bf16 weight
an update rounds back to the base, so a LoRA run with a low learning rate samples (nearly) the
base model for tens of steps while the trainer's policy moves (scale-audit-3 finding 1). The
planner predicts the survival of the update at steps 1, 10 and 50 for the run's lr, warm-up,
LoRA rank / alpha and the weights' scales (:mod:`megagrpo.model.survival`, the same model the
trainer refuses a lossy run with) and marks such a layout **lossy**: printed with those
figures, never a default (``--allow-lossy`` ranks it). An adapter sync serves the trained
factors as they are: exact. FP8 weights quantise the base itself: unverified
(:mod:`megagrpo.plan.gate`).
"""

from __future__ import annotations

import functools

from megagrpo.model.survival import (
    SurvivalPrediction,
    known_shapes,
    merge_format,
    predict_survival,
)
from megagrpo.plan.scenario import Scenario


def sync_survival(sc: Scenario) -> SurvivalPrediction | None:
    """The predicted survival of ``sc``'s merged sync; None for an adapter sync (exact) or a
    model without LoRA targets."""
    if sc.weight_sync != "merged" or not sc.lora_rank:
        return None
    shapes = known_shapes(sc.hf, sc.lora_targets)
    if shapes is None:
        return None
    fmt = merge_format(sc.dtype, sc.engine_dtype, sc.quantization)
    key = (
        fmt,
        sc.dtype,
        sc.lr,
        sc.lora_rank,
        sc.lora_alpha,
        tuple(shapes),
        sc.warmup_steps,
        sc.lr_schedule,
        sc.max_steps,
        sc.min_lr_ratio,
        sc.weight_std,
    )
    return _predict(key)


@functools.lru_cache(maxsize=64)
def _predict(key: tuple) -> SurvivalPrediction:
    fmt, base, lr, rank, alpha, shapes, warmup, schedule, total, min_ratio, stds = key
    return predict_survival(
        fmt=fmt,
        lr=lr,
        rank=rank,
        alpha=alpha,
        shapes=list(shapes),
        warmup=warmup,
        schedule=schedule,
        total_steps=total,
        min_ratio=min_ratio,
        weight_std=dict(stds) if stds else None,
        weight_source="the checkpoint" if stds else "",
        base_fmt=base,
    )


def lossy_notes(sc: Scenario) -> tuple[str, ...]:
    """Why ``sc`` is lossy (empty when its sync is exact): the merge format and the predicted
    survival at the reported steps."""
    pred = sync_survival(sc)
    if pred is None or pred.exact:
        return ()
    note = f"LoRA update surviving the {pred.fmt} merge: {pred.steps_text()}"
    noise = max((n for n, moved in zip(pred.noise, pred.moved) if moved), default=0.0)
    # FP8 re-quantisation delivers the update unbiased but buried in noise (finding 13)
    note += f"; rounding noise up to {noise:.2g}x the update"
    return (note,)
