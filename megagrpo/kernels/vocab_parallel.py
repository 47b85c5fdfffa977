"""Vocab-parallel combination of per-shard softmax stats (as Megatron's vocab-parallel CE).

Each TP rank holds logits [T, V/TP] for vocab ids [rank * V/TP, (rank + 1) * V/TP) and
computes local stats (max m_r, s_r = sum exp(x - m_r), E_r[x], target logit or 0). One MAX
all-reduce and one SUM all-reduce of [T, 3] give the global stats, so the logits are read once
per rank and only O(T) values cross the network. The process group is passed in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """World size of ``group`` (1 when None or when torch.distributed is not initialised)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def vocab_start_of(group, v_local: int) -> int:
    """First vocab id of this rank's shard: rank_in_group * V_local (Megatron's layout)."""
    return dist.get_rank(group) * v_local if group_size(group) > 1 else 0


def combine_stats(stats: torch.Tensor, group) -> torch.Tensor:
    """Global stats [T, 4] (max, sum exp, E[x], target logit) from each rank's local [T, 4]."""
    if group_size(group) == 1:
        return stats
    m_local = stats[:, 0]
    m = m_local.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    w = stats[:, 1] * torch.exp(m_local - m)
    buf = torch.stack([w, w * stats[:, 2], stats[:, 3]], dim=1)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    s = buf[:, 0]
    return torch.stack([m, s, buf[:, 1] / s, buf[:, 2]], dim=1)
