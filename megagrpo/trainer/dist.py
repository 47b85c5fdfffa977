"""Small torch.distributed helpers for the loop (1 process: every call is a no-op).

Rewards and the curriculum run on global rank 0; their results reach the other ranks
through :meth:`Comm.broadcast_object`. Generation runs on rank 0 too, or, with sharded
rollouts, on every rank, gathered with :meth:`Comm.all_gather_object`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _on() -> bool:
    return dist.is_available() and dist.is_initialized()


class Comm:
    """The world as the loop sees it."""

    @property
    def rank(self) -> int:
        return dist.get_rank() if _on() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if _on() else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if _on():
            dist.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` on every rank (pickled)."""
        if not _on() or self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (pickled)."""
        if not _on() or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def mean_over(self, values: dict[str, float], group=None) -> dict[str, float]:
        """Average scalar metrics over ``group`` (None: the world)."""
        if not _on() or not values:
            return values
        size = dist.get_world_size(group)
        if size == 1:
            return values
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(t, group=group)
        return {k: float(v) / size for k, v in zip(keys, t.tolist())}

    def sum_over(self, value: float, group=None) -> float:
        """Sum of a scalar over ``group`` (None: the world)."""
        if not _on():
            return value
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, group=group)
        return float(t.item())
