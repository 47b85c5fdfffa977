"""The world as the loop sees it (:class:`Comm`): rank, world size, object and scalar
collectives over the process groups a run declares (1 process: every call is a no-op)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megagrpo.parallel.state import ParallelGroups


def _on() -> bool:
    return dist.is_available() and dist.is_initialized()


class Comm:
    """The world as the loop sees it (1 process: every call is a no-op).

    Scalar reductions are built on the compute device the process groups declare
    (``pgs.device``; NCCL reduces CUDA tensors only, gloo takes either).
    """

    def __init__(self, pgs: ParallelGroups | None = None) -> None:
        self.pgs = pgs

    @property
    def device(self) -> torch.device:
        return self.pgs.device if self.pgs is not None else torch.device("cpu")

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

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any]:
        """Every rank's ``obj`` in rank order on rank ``dst`` (an empty list elsewhere)."""
        if not _on() or self.world_size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out or []

    def mean_over(
        self, values: dict[str, float], group: dist.ProcessGroup | None = None
    ) -> dict[str, float]:
        """Average scalar metrics over ``group`` (None: the world)."""
        if not _on() or not values:
            return values
        size = dist.get_world_size(group)
        if size == 1:
            return values
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=group)
        return {k: float(v) / size for k, v in zip(keys, t.tolist())}

    def max_over(self, value: float, group: dist.ProcessGroup | None = None) -> float:
        """Max of a scalar over ``group`` (None: the world)."""
        if not _on():
            return value
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t.item())

    def sum_over(self, value: float, group: dist.ProcessGroup | None = None) -> float:
        """Sum of a scalar over ``group`` (None: the world)."""
        if not _on():
            return value
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=group)
        return float(t.item())
