"""Parallel layout config (owner: megagrpo.parallel)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    """Megatron parallel degrees; DP is what remains of the world size."""

    tp: int = 1
    """Tensor parallel size."""
    ep: int = 1
    """Expert parallel size."""
    etp: int = 1
    """Expert tensor parallel size."""
    pp: int = 1
    """Pipeline parallel size."""
    sequence_parallel: bool = False
    """Required (and enabled automatically) for MoE with tp > 1."""
