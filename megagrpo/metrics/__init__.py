"""Metric loggers (metrics.jsonl, W&B offline by default, TensorBoard, console), the completions
log, ms-swift/TRL metric aliases, and the run report."""

from megagrpo.metrics.completions import CompletionsLog, find_wandb_run
from megagrpo.metrics.logger import (
    ConsoleLogger,
    JsonlLogger,
    MetricLogger,
    MultiLogger,
    NullLogger,
    TensorBoardLogger,
    WandbLogger,
    build_logger,
    read_metrics,
)
from megagrpo.metrics.names import (
    CORE_METRICS,
    SWIFT_ALIASES,
    missing_metrics,
    required_metrics,
    swift_aliases,
)

__all__ = [
    "CORE_METRICS",
    "CompletionsLog",
    "SWIFT_ALIASES",
    "TensorBoardLogger",
    "ConsoleLogger",
    "JsonlLogger",
    "MetricLogger",
    "MultiLogger",
    "NullLogger",
    "WandbLogger",
    "build_logger",
    "find_wandb_run",
    "missing_metrics",
    "read_metrics",
    "required_metrics",
    "swift_aliases",
]
