"""Rollout engine config (owner: megagrpo.rollout)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RolloutConfig:
    """How groups of G answers are generated."""

    engine: str = "vllm"
    """vllm | hf."""
    group_size: int = 8
    """G, answers per problem."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 512
    seed: int = 0
