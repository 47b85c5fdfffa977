"""Metrics/logging config (owner: megagrpo.metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MetricsConfig:
    """Where metrics go: metrics.jsonl always, W&B offline by default."""

    wandb_mode: str = "offline"
    """offline | online | disabled."""
    wandb_project: str = "megagrpo"
