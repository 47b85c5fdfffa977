"""Everything one training run holds, built once by :mod:`megagrpo.trainer.setup`.

Rank 0 holds the rollout engine, the curriculum sampler and the dynamic sampler; on the
other ranks those are ``None`` (their results arrive by broadcast). With sharded rollouts
(``sharded``) every rank holds an engine; the samplers stay on rank 0. The policy, optimiser
and process groups exist on every rank.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megagrpo.metrics.logger import MetricLogger
from megagrpo.trainer.config import RunConfig
from megagrpo.trainer.dist import Comm
from megagrpo.types import Problem


@dataclass
class TrainContext:
    """The run's components (see module docstring)."""

    cfg: RunConfig
    comm: Comm
    run_dir: Path
    policy: Any
    """MegatronPolicy: forward_logits, lora_parameters, finish_grad_sync, export_hf_weights."""
    optimizer: Any
    """torch.optim over policy.lora_parameters()."""
    scheduler: Any = None
    """Learning-rate scheduler stepped after each optimiser step (None: constant)."""
    groups: Any = None
    """ParallelGroups (tp/dp groups) from megagrpo.parallel.init_parallel."""
    engine: Any = None
    """RolloutEngine on rank 0 (every rank when ``sharded``); None elsewhere."""
    sharded: bool = False
    """Sharded colocated rollouts (megagrpo.trainer.sharding): an engine on every rank."""
    rollout_replica_size: int = 1
    """Consecutive ranks per engine replica (vLLM TP size; 1 for the HF engine)."""
    sampler: Any = None
    """CurriculumSampler on rank 0."""
    dynamic: Any = None
    """DynamicSampler on rank 0."""
    reward_fn: Any = None
    """CompositeReward (every rank builds it; rank 0 uses it)."""
    logger: MetricLogger | None = None
    eval_problems: list[Problem] = field(default_factory=list)
    pad_id: int = 0
    step: int = 0
    """Optimiser steps completed."""
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def tp_group(self):
        """Tensor-parallel group (the vocab is sharded over it); None: 1 process."""
        return self.groups.tp if self.groups is not None and self.groups.tp_size > 1 else None

    @property
    def dp_group(self):
        """Data-parallel group (non-expert parameters)."""
        return self.groups.dp if self.groups is not None else None

    @property
    def dp_rank_size(self) -> tuple[int, int]:
        g = self.groups
        if g is None:
            return 0, 1
        return int(getattr(g, "dp_rank", 0)), int(getattr(g, "dp_size", 1))

    @contextmanager
    def timed(self, key: str):
        """Add the wall time of the block to ``timings[key]`` (seconds)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t0
