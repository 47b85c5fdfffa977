"""Metric loggers (metrics.jsonl, W&B offline by default, console) and the run report."""

from megagrpo.metrics.logger import (
    ConsoleLogger,
    JsonlLogger,
    MetricLogger,
    MultiLogger,
    NullLogger,
    WandbLogger,
    build_logger,
    read_metrics,
)
from megagrpo.metrics.names import CORE_METRICS, missing_metrics, required_metrics

__all__ = [
    "CORE_METRICS",
    "ConsoleLogger",
    "JsonlLogger",
    "MetricLogger",
    "MultiLogger",
    "NullLogger",
    "WandbLogger",
    "build_logger",
    "missing_metrics",
    "read_metrics",
    "required_metrics",
]
