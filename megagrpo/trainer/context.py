"""Everything one training run holds (built once by :mod:`megagrpo.trainer.setup`).

Every rank holds every component: the policy and optimiser (its shard), the curriculum and
dynamic samplers (replicated: every rank takes the same decisions from the same scored
groups, so no rank waits for another to tell it what to train on), and ``rollouts``, the
placement object that hides where generation runs (:mod:`megagrpo.placement.rollouts`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megagrpo.curriculum.dynamic import DynamicSampler
from megagrpo.curriculum.sampler import CurriculumSampler
from megagrpo.metrics.completions import CompletionsLog
from megagrpo.metrics.logger import MetricLogger, NullLogger
from megagrpo.model import Policy
from megagrpo.parallel.comm import Comm
from megagrpo.parallel.state import ParallelGroups
from megagrpo.placement.offload import Offload
from megagrpo.rewards import CompositeReward
from megagrpo.trainer.config import RunConfig
from megagrpo.types import Problem

if TYPE_CHECKING:
    from megagrpo.curriculum.rounds import Rounds
    from megagrpo.placement.partial import PartialRollouts
    from megagrpo.placement.rollouts import Rollouts
    from megagrpo.trainer.generated import Generated


@dataclass
class Ahead:
    """Step ``step``'s rounds, started while the step before trained (placement separate, one
    step ahead: :func:`megagrpo.trainer.ahead.submit_ahead`); its first round in flight."""

    step: int
    rounds: Rounds
    samplers: dict[str, Any] = field(default_factory=dict)
    """The curriculum and dynamic samplers' state before the early start: what a checkpoint
    of the step before holds (a resumed run draws step ``step``'s first round again)."""


class _EnginesNotStarted:
    """``TrainContext.rollouts`` before the engines start: any use is an error naming why."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            f"ctx.rollouts.{name}: the rollout engines have not started yet "
            "(megagrpo.trainer.setup.start_rollouts starts them after a resume)"
        )


@dataclass
class TrainContext:
    """The run's components (see module docstring)."""

    cfg: RunConfig
    comm: Comm
    pgs: ParallelGroups
    """Process groups and this rank's coordinates (tp/dp/ep/... and the compute device)."""
    run_dir: Path
    policy: Policy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    """Learning-rate scheduler stepped after each optimiser step (None: constant)."""
    sampler: CurriculumSampler
    dynamic: DynamicSampler
    reward_fn: CompositeReward
    rollouts: Rollouts = field(default_factory=lambda: _EnginesNotStarted())  # type: ignore[assignment]
    """Where generation runs: rank 0 only, or sharded engine replicas. The engines start after
    the context is built (a resume restores it first); until then any use raises."""
    logger: MetricLogger = field(default_factory=NullLogger)
    """Metrics of the step rows (rank 0; a NullLogger elsewhere)."""
    completions: CompletionsLog | None = None
    """completions.jsonl (+ a W&B table) of the trained groups (rank 0, metrics.log_completions)."""
    eval_problems: list[Problem] = field(default_factory=list)
    pad_id: int = 0
    step: int = 0
    """Optimiser steps completed."""
    timings: dict[str, float] = field(default_factory=dict)
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    """The last ``(start, end)`` (``time.time()``) of each :meth:`timed` block of the step."""
    ahead: Ahead | None = None
    """Placement separate, one step ahead: the next step's rounds, started while this step
    trains (:mod:`megagrpo.placement.separate`); None otherwise."""
    problem_set: dict[str, Any] = field(default_factory=dict)
    """The training problems as a checkpoint records them (count, digest, ids the
    prompt-length policy dropped or truncated): compared on resume."""
    data_metrics: dict[str, float] = field(default_factory=dict)
    base_fingerprint: dict[str, Any] | None = None
    """The base weights' fingerprint (:func:`megagrpo.model.fingerprint.base_fingerprint`),
    recorded in every checkpoint's manifest."""
    """``data/*`` counts of the prompt-length policy, in every row."""
    saved_step: int | None = None
    """Step of the newest checkpoint this run wrote or resumed from."""
    nonfinite_streak: int = 0
    """Consecutive steps whose update was skipped for a non-finite loss or gradient."""
    resumed_verifiers: list | None = None
    """The engines' sync-verification states of the checkpoint a run resumed from, handed to
    the engines after their first sync (:meth:`Rollouts.resume_verifiers`)."""
    stopped_by: str | None = None
    """Name of the signal that stopped the run early (SIGTERM, ...); None otherwise."""
    partial: PartialRollouts | None = None
    """The carried completions of partial rollouts (``rollout.partial.enabled``); None: off."""
    generated: Generated | None = None
    """The generated batch whose mini-batches the next steps train (None: the next step
    generates; :mod:`megagrpo.trainer.minibatch`)."""
    engines_awake: bool = True
    """False from the engines' sleep before an update until they wake (phase 6)."""
    engines_stale: bool = False
    """An update changed the weights since the engines' last sync."""
    run_lock: Any = None
    """Rank 0: the run directory's lock (:mod:`megagrpo.trainer.runlock`), released at the
    end of the run; None elsewhere."""
    offload: Offload = field(init=False)
    """Where the frozen weights and optimiser moments live in each phase
    (``trainer.offload_during_rollout``; every call a no-op when off)."""

    def __post_init__(self) -> None:
        self.offload = Offload(
            self.policy,
            self.optimizer,
            lambda: self.pgs.device,
            bool(self.cfg.trainer.offload_during_rollout),
        )

    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """Tensor-parallel group (the vocab is sharded over it); None: no TP."""
        return self.pgs.tp if self.pgs.tp_size > 1 else None

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        """Add the wall time of the block to ``timings[key]`` (seconds)."""
        t0, wall = time.perf_counter(), time.time()
        try:
            yield
        finally:
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t0
            self.intervals[key] = (wall, time.time())
