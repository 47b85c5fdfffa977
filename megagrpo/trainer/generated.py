"""What a generated batch is while its mini-batches train: the plain records of
:mod:`megagrpo.trainer.minibatch` (a generated batch, its mini-batch bounds) and of
:mod:`megagrpo.trainer.optimize` (one optimiser step's micro-batches and log-probs), apart
from the code that needs a ``TrainContext`` so that the training context's type and the
checkpoint format can name them without reaching the training loop."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megagrpo.model.routing import ReplayPlan
from megagrpo.trainer.batch import BatchTotals, MicroBatch
from megagrpo.types import Group


def mini_batch_bounds(num_groups: int, mini_batches: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` group ranges of each mini-batch: consecutive, sizes differing by at most
    one (a short dynamic-sampling batch leaves the last ones smaller, or empty)."""
    base, extra = divmod(num_groups, mini_batches)
    bounds, lo = [], 0
    for k in range(mini_batches):
        hi = lo + base + (1 if k < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


@dataclass
class Generated:
    """A generated batch being trained, one optimiser step per loop step."""

    step: int
    """The loop step that generated it."""
    groups: list[Group]
    adv: list[torch.Tensor]
    """Advantages over the whole generated batch, one ``[G_n]`` row per group."""
    mini_batches: int
    epochs: int
    done: int = 0
    """Optimiser steps already taken on it (every rank the same)."""
    updates: list[Update] | None = None
    """This rank's micro-batches and log-probs per mini-batch, prepared before the first
    update (:func:`prepare`)."""

    @property
    def total(self) -> int:
        """Optimiser steps on this batch: ``mini_batches x epochs``."""
        return self.mini_batches * self.epochs

    @property
    def index(self) -> int:
        """The mini-batch the next step trains."""
        return self.done % self.mini_batches

    @property
    def is_last(self) -> bool:
        """The next step is the last on this batch (the one after generates)."""
        return self.done == self.total - 1

    def bounds(self) -> list[tuple[int, int]]:
        return mini_batch_bounds(len(self.groups), self.mini_batches)

    def current_groups(self) -> list[Group]:
        """The groups the next step trains."""
        lo, hi = self.bounds()[self.index]
        return self.groups[lo:hi]

    def position(self) -> dict[str, float]:
        """``train/mini_batch`` and ``train/epoch`` (1-based) of the next step."""
        return {
            "train/mini_batch": float(self.index + 1),
            "train/epoch": float(self.done // self.mini_batches + 1),
        }


@dataclass
class Update:
    """This rank's share of one optimiser step: the micro-batches of one mini-batch of a
    generated batch, the batch totals their weights divide by, and the behaviour (``old``)
    and reference log-probs, one ``[B, T]`` per micro-batch, computed before the generated
    batch's first update (:func:`behaviour_logprobs`)."""

    mbs: list[MicroBatch]
    totals: BatchTotals
    source: str
    """The resolved ``trainer.old_logprobs``."""
    plan: ReplayPlan | None
    reused: bool
    """Old log-probs = the training forward's own (detached): :func:`reuses_training_forward`."""
    probe: bool
    old: list | None = None
    ref: list | None = None
    extra: dict[str, float] = field(default_factory=dict)
    """``train/logprob_mismatch*`` measured when the old log-probs were recomputed."""
    shared_fraction: float | None = None
    """``train/shared_prefix_fraction`` of its groups (None: shared prefix off)."""
