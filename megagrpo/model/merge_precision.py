"""How much of a LoRA update survives a merged export in the base dtype.

A merged sync sends ``cast(W + dW)`` with ``W`` in bf16: each element moves by a multiple
of its bf16 spacing (2^-8 relative), so an update far below that spacing mostly rounds back
to ``W``. The *surviving fraction* is the part of the intended update ``dW`` that the
engine actually receives, projected on ``dW``::

    survival = <cast(W + dW) - W, dW> / ||dW||^2

1.0 means the engine got the update exactly (fp32 bases, or large updates); 0.0 means it got
nothing in the update's direction. Small early LoRA updates on bf16 bases mostly do not reach
a merged-sync engine (figures: docs/architecture.md, "merged sync precision"; checked by
``tests/unit/test_model_scoring.py``). The plain norm ratio ``||cast(W + dW) - W|| / ||dW||``
is *not* used: rounding moves a few elements by a whole spacing in directions unrelated to
dW, which inflates it.

:class:`MergeStats` accumulates the sums on the tensors' device while the export runs (a few
element-wise ops per merged tensor, no host sync) and is read once per sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def merge_delta(base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``cast(base + delta)`` in ``base``'s dtype, the sum taken in fp32 (what a merged sync
    sends)."""
    return (base.float() + delta.float()).to(base.dtype)


@dataclass
class MergeStats:
    """Sums over merged tensors: ``dot`` = <moved, dW>, ``delta_sq`` = ||dW||^2, ``unchanged``
    = elements with dW != 0 that did not move, ``nonzero`` = elements with dW != 0."""

    sums: torch.Tensor | None = field(default=None, repr=False)
    """float64 [dot, delta_sq, unchanged, nonzero], on the device of the tensors added."""

    def add(self, base: torch.Tensor, delta: torch.Tensor, merged: torch.Tensor) -> None:
        """Account one merged tensor: ``merged == merge_delta(base, delta)``."""
        # fp32 work tensors (one transient copy of the tensor, not three fp64 ones: the sync
        # phase is short of memory); the difference of two bf16 values is exact in fp32
        d = delta.detach().float().reshape(-1)
        moved = merged.detach().float().reshape(-1) - base.detach().float().reshape(-1)
        nz = d != 0
        row = torch.stack(
            [
                torch.dot(moved, d).double(),
                torch.dot(d, d).double(),
                torch.count_nonzero(nz & (moved == 0)).double(),
                torch.count_nonzero(nz).double(),
            ]
        )
        self.sums = row if self.sums is None else self.sums + row.to(self.sums.device)

    def reduce(self, group=None, device: torch.device | None = None) -> MergeStats:
        """Sum over ``group`` (collective: every rank of it calls this). Ranks holding
        replicas of the same shard count it several times, which weights the figure but
        keeps it a ratio of like sums."""
        sums = self.sums if self.sums is not None else torch.zeros(4, dtype=torch.float64)
        sums = sums.to(device) if device is not None else sums
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            sums = sums.clone()
            dist.all_reduce(sums, group=group)
        return MergeStats(sums)

    def metrics(self) -> dict[str, float]:
        """``sync/lora_survival`` (1.0 when there was no update) and
        ``sync/lora_unchanged_frac`` (fraction of updated elements the cast left equal)."""
        if self.sums is None:
            return {"sync/lora_survival": 1.0, "sync/lora_unchanged_frac": 0.0}
        dot, dsq, unchanged, nonzero = (float(v) for v in self.sums.tolist())
        return {
            "sync/lora_survival": dot / dsq if dsq > 0 else 1.0,
            "sync/lora_unchanged_frac": unchanged / nonzero if nonzero > 0 else 0.0,
        }
