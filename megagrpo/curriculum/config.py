"""Curriculum and dynamic-sampling config (owner: megagrpo.curriculum)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CurriculumConfig:
    """Level-filtered sampling of problems (AlphaMed L1-L6)."""

    levels_file: str | None = None
    """JSONL written by `megagrpo profile` (problem id, k, correct, level). None: no filter."""
    keep_levels: list[int] = field(default_factory=lambda: [2, 3, 4, 5])
    """Levels to train on."""
    seed: int = 0


@dataclass
class DynamicSamplingConfig:
    """Bounded dynamic sampling (DAPO), see megagrpo.curriculum.dynamic."""

    enabled: bool = True
    max_resample: int = 3
    """R: at most this many extra generation rounds per step."""
    policy: str = "carry"
    """original | partial | carry: what to train on when the batch is still short."""
