"""Loss config (owner: megagrpo.algo / megagrpo.kernels)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossConfig:
    """Policy loss: GRPO/DAPO clipped surrogate and variants."""

    variant: str = "grpo"
    """grpo | dapo | dr_grpo | gspo."""
    eps_low: float = 0.2
    eps_high: float = 0.28
    kl_coef: float = 0.0
    """k3 KL to the reference policy; 0 disables it (no reference forward)."""
