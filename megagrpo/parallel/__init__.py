"""megagrpo.parallel: torch.distributed + Megatron parallel state (the only module using
``megatron.core.parallel_state``), layout validation and the CPU/gloo shims.

    groups = init_parallel(ParallelConfig(tp=2, sequence_parallel=True))  # under torchrun
    ...
    destroy_parallel()
"""

from megagrpo.parallel.config import ClusterConfig, ParallelConfig
from megagrpo.parallel.state import (
    ParallelGroups,
    destroy_parallel,
    init_fake_parallel,
    init_parallel,
    validate_layout,
)

__all__ = [
    "ClusterConfig",
    "ParallelConfig",
    "ParallelGroups",
    "destroy_parallel",
    "init_fake_parallel",
    "init_parallel",
    "validate_layout",
]
