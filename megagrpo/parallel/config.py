"""Parallel layout and cluster configs (owner: megagrpo.parallel)."""

from __future__ import annotations

from dataclasses import dataclass

from megagrpo.errors import require, require_finite


@dataclass
class ParallelConfig:
    """Megatron parallel degrees; DP is what remains of the world size.

    Non-expert layers are laid out TP x DP x PP; expert layers EP x ETP x expert-DP x PP over
    the same ranks (Megatron's MoE "parallel folding"). :func:`megagrpo.parallel.validate_layout`
    checks a layout against a model config and a world size.
    """

    tp: int = 1
    """Tensor parallel size (attention heads, dense MLP, vocab are split over it)."""
    ep: int = 1
    """Expert parallel size (experts are distributed over it; must divide num_experts)."""
    etp: int = 1
    """Expert tensor parallel size (each expert's FFN split over it)."""
    pp: int = 1
    """Pipeline parallel size (layers split into pp stages)."""
    num_layers_in_first_pipeline_stage: int = 0
    """Layers of the first pipeline stage (0: an even split); the stages between the first
    and the last share the rest evenly (megatron-core's uneven pipeline)."""
    num_layers_in_last_pipeline_stage: int = 0
    """Layers of the last pipeline stage (0: an even split)."""
    sequence_parallel: bool = False
    """Sequence parallelism inside TP groups. Required for MoE models when tp > 1."""
    seed: int = 1234
    """Seed for Megatron's RNG tracker (dropout streams per TP/EP rank)."""
    timeout_minutes: int = 30
    """torch.distributed collective timeout."""

    def validate(self, path: str = "parallel") -> None:
        for key in ("tp", "ep", "etp", "pp"):
            require(getattr(self, key) >= 1, f"{path}.{key}", "must be >= 1")
        for key in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            require(getattr(self, key) >= 0, f"{path}.{key}", "must be >= 0 (0: even split)")
        require(self.timeout_minutes >= 1, f"{path}.timeout_minutes", "must be >= 1")


@dataclass
class ClusterConfig:
    """The machines a run is launched on: read by the Slurm launcher (slurm/grpo_235b.sh) and
    the memory planner (`megagrpo plan-memory`); world size = num_nodes x gpus_per_node."""

    num_nodes: int = 1
    """Nodes of the launch."""
    gpus_per_node: int = 8
    """GPUs per node (H100 nodes: 8)."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU (H100 SXM: 80 GiB)."""
    host_memory_gib: float = 2048.0
    """Host memory of one node the job may use, GiB (DGX H100: 2 TB; `free -g` on a node).
    `megagrpo plan-memory` checks the pinned buffers of a node's GPUs (offloaded trainer
    state, vLLM's sleep backups) against it, and slurm/grpo_235b.sh asks for all of it
    (``#SBATCH --mem=0``: a site's default memory limit would kill the job at its first
    offload)."""

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def validate(self, path: str = "cluster") -> None:
        require(self.num_nodes >= 1, f"{path}.num_nodes", "must be >= 1")
        require(self.gpus_per_node >= 1, f"{path}.gpus_per_node", "must be >= 1")
        require_finite(self.gpu_memory_gib, f"{path}.gpu_memory_gib")
        require(self.gpu_memory_gib > 0, f"{path}.gpu_memory_gib", "must be > 0")
        require_finite(self.host_memory_gib, f"{path}.host_memory_gib")
        require(self.host_memory_gib > 0, f"{path}.host_memory_gib", "must be > 0")


def stage_layers(num_layers: int, pp: int, first: int = 0, last: int = 0) -> list[int]:
    """Layers of each pipeline stage as megatron-core 0.16.1 splits them
    (``transformer/transformer_config.py`` uneven PP; ``first``/``last`` 0 = even split).
    Raises ValueError with megatron's reason when the split is impossible."""
    if pp == 1:
        return [num_layers]
    middle_layers, middle = num_layers, pp
    for n in (first, last):
        if n:
            if n < 0:
                raise ValueError("a first/last stage needs more than 0 layers")
            middle_layers -= n
            middle -= 1
    if bool(middle_layers) != bool(middle) or middle_layers < 0:
        raise ValueError(
            f"{middle_layers} middle layers remain for {middle} middle pipeline stages"
        )
    if middle and middle_layers % middle:
        raise ValueError(
            f"the {middle_layers} middle layers do not divide over {middle} middle stages"
        )
    each = middle_layers // middle if middle else 0
    out = [each] * pp
    if first:
        out[0] = first
    if last:
        out[-1] = last
    return out


def uneven_split(num_layers: int, pp: int) -> int:
    """``num_layers_in_first_pipeline_stage`` for ``pp`` stages that do not divide
    ``num_layers`` (0 when they do): the other stages get ``num_layers // pp`` each, the
    first the rest (megatron-core's middle stages must be equal)."""
    if pp <= 1 or num_layers % pp == 0:
        return 0
    return num_layers - (pp - 1) * (num_layers // pp)
