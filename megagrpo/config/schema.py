"""The whole run config: one nested dataclass per component, mirrored by configs/*.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field

from megagrpo.algo.config import LossConfig
from megagrpo.curriculum.config import CurriculumConfig, DynamicSamplingConfig
from megagrpo.data.config import DataConfig
from megagrpo.metrics.config import MetricsConfig
from megagrpo.model.config import ModelConfig
from megagrpo.parallel.config import ParallelConfig
from megagrpo.rewards.config import RewardsConfig
from megagrpo.rollout.config import RolloutConfig
from megagrpo.trainer.config import TrainerConfig


@dataclass
class RunConfig:
    """Everything a `megagrpo train` run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    dynamic: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
