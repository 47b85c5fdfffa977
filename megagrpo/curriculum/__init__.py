"""Curriculum and collapse: statistics, AlphaMed levels, level-filtered sampler with online
difficulty, bounded dynamic sampling, profiler and planner.

Pure: imports no megatron, vllm or torch.distributed (numpy only).
"""

from megagrpo.curriculum.dynamic import (
    DynamicSampler,
    FilledBatch,
    PreflightResult,
    checked_rounds,
    preflight_check,
)
from megagrpo.curriculum.levels import (
    BetaPrior,
    CollapsePrediction,
    fill_success_prob,
    level_alternatives,
    level_from_counts,
    levels_by_id,
    predict_acr,
    read_levels_file,
)
from megagrpo.curriculum.sampler import CurriculumSampler
from megagrpo.curriculum.stats import collapse_metrics, collapse_prob, collapse_stats

__all__ = [
    "BetaPrior",
    "CollapsePrediction",
    "CurriculumSampler",
    "DynamicSampler",
    "FilledBatch",
    "PreflightResult",
    "checked_rounds",
    "collapse_metrics",
    "collapse_prob",
    "collapse_stats",
    "fill_success_prob",
    "level_alternatives",
    "level_from_counts",
    "levels_by_id",
    "predict_acr",
    "preflight_check",
    "read_levels_file",
]
