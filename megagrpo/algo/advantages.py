"""Group-normalised advantages (GRPO and friends). Pure torch."""

from __future__ import annotations

import torch

COLLAPSE_STD = 1e-6
"""A group whose reward std is below this is collapsed (DESIGN.md: ACR uses the same bound)."""


def group_advantages(
    rewards: torch.Tensor, scale: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """Advantages of G samples per problem, centred on their group's mean reward.

    Args:
        rewards: [N, G] reward of sample g of problem n.
        scale: ``group`` divides by the group's std (GRPO, DeepSeekMath), ``batch`` by the
            std of all N*G rewards (a batch-level scale, as REINFORCE++ does), ``none`` keeps
            the centred reward (Dr.GRPO: no std bias towards easy/hard questions).
        eps: added to the std before dividing (TRL and ms-swift use 1e-4).

    Returns:
        [N, G] float32 advantages. Collapsed groups (std < 1e-6) get exactly 0, so they carry
        no policy gradient whatever the scale. Stds are unbiased (Bessel), as TRL computes them.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N, G], got shape {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError(f"need G >= 2 samples per group, got G={rewards.shape[1]}")
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    r = rewards.to(torch.float32)
    centred = r - r.mean(dim=1, keepdim=True)
    group_std = r.std(dim=1, keepdim=True)
    if scale == "group":
        adv = centred / (group_std + eps)
    elif scale == "batch":
        adv = centred / (r.std() + eps) if r.numel() > 1 else centred
    else:
        adv = centred
    return torch.where(group_std < COLLAPSE_STD, torch.zeros_like(adv), adv)
