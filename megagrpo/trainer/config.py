"""Trainer config (owner: megagrpo.trainer)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainerConfig:
    """Optimisation and run bookkeeping."""

    name: str = "run"
    """Run name: outputs go to {output_dir}/{name}."""
    output_dir: str = "runs"
    max_steps: int = 10
    batch_groups: int = 8
    """Groups (problems) per training batch."""
    lr: float = 1e-4
    seed: int = 0
