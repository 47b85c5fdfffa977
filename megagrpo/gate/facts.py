"""What the gate's rules read (:class:`Facts`): a run config, seen through the sections the
rules need (:class:`RunConfig`), plus the layout derived from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from megagrpo.model.config import ModelConfig
from megagrpo.parallel.config import ClusterConfig, ParallelConfig
from megagrpo.rollout.config import RolloutConfig


class TrainerKeys(Protocol):
    """The ``trainer`` keys the gate reads."""

    @property
    def pack_tokens(self) -> int: ...
    @property
    def shared_prefix(self) -> str: ...


class RunConfig(Protocol):
    """What the gate reads of a run config (:class:`megagrpo.trainer.config.RunConfig` is
    one): the model, the parallel layout, the engine and the cluster."""

    @property
    def model(self) -> ModelConfig: ...
    @property
    def parallel(self) -> ParallelConfig: ...
    @property
    def rollout(self) -> RolloutConfig: ...
    @property
    def cluster(self) -> ClusterConfig: ...
    @property
    def trainer(self) -> TrainerKeys: ...


@dataclass(frozen=True)
class Facts:
    """What the rules read: the config plus the derived layout of the GPU run."""

    cfg: RunConfig
    world: int
    """GPUs of the run (torch.distributed world size)."""
    engine_dp: int
    """vLLM ``data_parallel_size`` of one engine (lock-stepped sharded replicas), else 1."""
    hf: dict[str, Any] | None
    """The model's HF config (None: rules that need the model are skipped)."""

    @property
    def vllm(self) -> bool:
        return self.cfg.rollout.engine == "vllm"

    @property
    def num_experts(self) -> int | None:
        if self.hf is None:
            return None
        return int(self.hf.get("num_experts") or self.hf.get("num_local_experts") or 0)

    @property
    def moe(self) -> bool:
        """MoE model (unknown model: assumed MoE when expert parallelism is asked for)."""
        n = self.num_experts
        return self.cfg.rollout.enable_expert_parallel if n is None else n > 0

    @property
    def engine_tp(self) -> int:
        return self.cfg.rollout.tensor_parallel_size

    @property
    def vllm_use_ep(self) -> bool:
        """``fused_moe/config.py`` ``FusedMoEParallelConfig.make``: ``use_ep``."""
        ro = self.cfg.rollout
        return self.vllm and self.moe and ro.enable_expert_parallel and self.engine_ep_size > 1

    @property
    def engine_ep_size(self) -> int:
        """Devices one engine spreads each MoE layer over (EP size, or the TP size of the
        experts without EP): DP x TP (``flatten_tp_across_dp``)."""
        return self.engine_dp * self.engine_tp

    @property
    def moe_lora(self) -> bool:
        """Every MoE layer becomes ``FusedMoEWithLoRA`` (``lora/model_manager.py``)."""
        return self.vllm and self.moe and self.cfg.rollout.enable_lora
