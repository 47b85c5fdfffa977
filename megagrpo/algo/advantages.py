"""Group-normalised advantages (GRPO and friends). Pure torch."""

from __future__ import annotations

import torch

COLLAPSE_STD = 1e-6
"""A group whose reward std is below this is collapsed (DESIGN.md: ACR uses the same bound)."""


ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus")


def group_advantages(
    rewards: torch.Tensor, scale: str = "group", eps: float = 1e-4, estimator: str = "grpo"
) -> torch.Tensor:
    """Advantages of G samples per problem, centred on their group's mean reward.

    Args:
        rewards: [N, G] reward of sample g of problem n.
        scale: ``group`` divides by the group's std (GRPO, DeepSeekMath), ``batch`` by the
            std of all N*G rewards (a batch-level scale, as REINFORCE++ does), ``none`` keeps
            the centred reward (Dr.GRPO: no std bias towards easy/hard questions).
        eps: added to the std before dividing (TRL and ms-swift use 1e-4).
        estimator: ``grpo``; ``rloo`` (leave-one-out baseline: the mean of the other G - 1
            rewards, i.e. the centred reward x G / (G - 1), scaled by the rewards' std);
            ``reinforce_plus_plus`` (the centred rewards scaled by their own std: with
            ``batch`` the std of all centred rewards) -- ms-swift's
            ``rl_core.advantage.compute_advantages``.

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
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    r = rewards.to(torch.float32)
    centred = r - r.mean(dim=1, keepdim=True)
    group_std = r.std(dim=1, keepdim=True)
    batch_std = (centred if estimator == "reinforce_plus_plus" else r).std()
    if estimator == "rloo":
        g = r.shape[1]
        centred = r * g / (g - 1) - r.mean(dim=1, keepdim=True) * g / (g - 1)
    if scale == "group":
        adv = centred / (group_std + eps)
    elif scale == "batch":
        adv = centred / (batch_std + eps) if r.numel() > 1 else centred
    else:
        adv = centred
    return torch.where(group_std < COLLAPSE_STD, torch.zeros_like(adv), adv)


def weight_positive(adv: torch.Tensor, weight: float) -> torch.Tensor:
    """``adv`` with every positive entry multiplied by ``weight`` (``loss.positive_weight``:
    W-REINFORCE's lambda; 1 returns ``adv`` itself, 0 keeps the negative samples only)."""
    if weight == 1.0:
        return adv
    return torch.where(adv > 0, adv * weight, adv)


# ----------------------------------------------------------------------------- variable G


def group_ids(sizes: torch.Tensor | list[int]) -> torch.Tensor:
    """Group index of each completion ``[S]`` for group sizes ``[N]`` (groups in order)."""
    sizes = torch.as_tensor(sizes, dtype=torch.long)
    return torch.repeat_interleave(torch.arange(len(sizes)), sizes)


def flat_group_advantages(
    rewards: torch.Tensor,
    sizes: torch.Tensor | list[int],
    scale: str = "group",
    eps: float = 1e-4,
    baseline_mean: torch.Tensor | None = None,
    baseline_std: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`group_advantages` for groups of different sizes, flattened.

    Args:
        rewards: [S] rewards, group by group (S = sum of sizes).
        sizes: [N] completions per group (>= 1).
        scale: as :func:`group_advantages` (``batch``: the std of all S rewards).
        eps: added to the std before dividing.
        baseline_mean, baseline_std: [N] optional per-group statistics to centre and scale
            with instead of the group's own (Reinforce-Ada: the mean and unbiased std of
            every completion generated for the problem, before the trained group was
            subsampled from them). Both or neither.

    Returns:
        [S] float32. Equal to :func:`group_advantages` row by row when all sizes are equal.
        A group whose (baseline) std is < 1e-6 gets exactly 0, so does a group of one
        completion without a baseline (it has no spread to learn from).
    """
    r = torch.as_tensor(rewards).to(torch.float64).reshape(-1)
    sizes = torch.as_tensor(sizes, dtype=torch.long).reshape(-1)
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    if (sizes < 1).any():
        raise ValueError(f"group sizes must be >= 1, got {sizes.tolist()}")
    if int(sizes.sum()) != r.numel():
        raise ValueError(f"sizes sum to {int(sizes.sum())} but there are {r.numel()} rewards")
    if (baseline_mean is None) != (baseline_std is None):
        raise ValueError("pass both baseline_mean and baseline_std, or neither")
    ids = group_ids(sizes)
    n = sizes.to(torch.float64)
    if baseline_mean is None:
        mean = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, ids, r) / n
        centred = r - mean[ids]
        sq = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, ids, centred**2)
        std = torch.where(sizes > 1, (sq / (n - 1).clamp_min(1.0)).sqrt(), torch.zeros_like(n))
    else:
        mean = torch.as_tensor(baseline_mean).to(torch.float64).reshape(-1)
        std = torch.as_tensor(baseline_std).to(torch.float64).reshape(-1)
        if mean.numel() != len(sizes) or std.numel() != len(sizes):
            raise ValueError(f"baselines need one value per group ({len(sizes)})")
        centred = r - mean[ids]
    if scale == "group":
        adv = centred / (std[ids] + eps)
    elif scale == "batch":
        adv = centred / (r.std() + eps) if r.numel() > 1 else centred
    else:
        adv = centred
    return torch.where(std[ids] < COLLAPSE_STD, torch.zeros_like(adv), adv).to(torch.float32)


def ragged_group_advantages(
    rewards: list[list[float]] | list[torch.Tensor],
    scale: str = "group",
    eps: float = 1e-4,
    baseline_mean: torch.Tensor | None = None,
    baseline_std: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """:func:`flat_group_advantages` of one reward row per group; returns one [G_n] tensor
    per group."""
    rows = [torch.as_tensor(x, dtype=torch.float64).reshape(-1) for x in rewards]
    if not rows:
        return []
    sizes = [len(x) for x in rows]
    flat = flat_group_advantages(torch.cat(rows), sizes, scale, eps, baseline_mean, baseline_std)
    return list(torch.split(flat, sizes))


def sequence_weights(sizes: torch.Tensor | list[int], mode: str = "sequence") -> torch.Tensor:
    """Per-completion loss weights [S] for groups of ``sizes`` [N].

    ``sequence``: every completion weighs 1 (a problem with more completions weighs more,
    as with a fixed G). ``group``: every problem weighs the same, w = (S / N) / G_n, so the
    weights still sum to S and equal 1 when all sizes are equal.
    """
    sizes = torch.as_tensor(sizes, dtype=torch.long).reshape(-1)
    total = float(sizes.sum())
    if mode == "sequence":
        return torch.ones(int(total))
    if mode != "group":
        raise ValueError(f"mode must be 'sequence' or 'group', got {mode!r}")
    per_group = (total / max(len(sizes), 1)) / sizes.to(torch.float64)
    return per_group[group_ids(sizes)].to(torch.float32)
