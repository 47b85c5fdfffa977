"""Fixtures of the CUDA-only tests (skipped without a GPU)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def groups():
    """megatron-core's parallel state for one process (NCCL on the GPU), torn down after the
    module (a module may override it with its own)."""
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    g = init_parallel(ParallelConfig())
    yield g
    destroy_parallel()
