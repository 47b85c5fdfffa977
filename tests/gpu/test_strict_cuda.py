"""Strict device mode on real CUDA + NCCL (issue 11, items 1-2): NCCL itself rejects host
tensors, strict mode names them first, and the policy's own paths pass. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def groups():
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    g = init_parallel(ParallelConfig())  # NCCL, world 1
    assert dist.get_backend() == "nccl" and g.device.type == "cuda"
    yield g
    destroy_parallel()


def test_nccl_rejects_host_tensors_and_strict_mode_names_them(groups):
    from megagrpo.parallel.strict import DeviceError, check_on_device, strict_devices

    with pytest.raises(RuntimeError):  # what the CPU suite could not see (gloo accepts it)
        dist.all_reduce(torch.zeros((), dtype=torch.float64), group=groups.dp)
    with strict_devices(groups) as dev:
        assert dev == groups.device  # a real device: nothing emulated
        with pytest.raises(DeviceError, match="all_reduce"):
            dist.all_reduce(torch.zeros((), dtype=torch.float64), group=groups.dp)
        ok = torch.ones(2, device=dev)
        dist.all_reduce(ok, group=groups.dp)
        with pytest.raises(DeviceError, match="target_ids"):
            check_on_device("loss", logits=ok, target_ids=torch.zeros(2, dtype=torch.long))


def test_policy_step_sync_export_under_strict_mode(groups, tiny_dense_dir):
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel.strict import check_on_device, strict_devices

    cfg = ModelConfig(hf_path=str(tiny_dense_dir), spec="local", lora=LoraConfig(dropout=0.05))
    policy = build_policy(cfg, groups)
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    with strict_devices(groups) as dev:
        logits = policy.forward_logits(ids)  # host ids: forward_logits moves them
        check_on_device("loss", logits=logits)
        logits.float().sum().backward()
        policy.finish_grad_sync()
        with policy.scoring():
            a, b = policy.forward_logits(ids), policy.forward_logits(ids)
        assert torch.equal(a, b)
        n = sum(1 for bucket in policy.export_hf_weights() for _ in bucket)
        survival = policy.merge_survival(groups.mp)
    assert n > 0 and logits.device == dev
    assert 0.0 <= survival["sync/lora_survival"] <= 1.01
