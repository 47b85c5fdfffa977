"""Strict device mode (issue 11, items 1-2 CPU guard): host tensors handed to collectives or
to the loss raise on CPU, as NCCL / Triton would on a GPU; the policy's own paths pass."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megagrpo.parallel import ParallelConfig
from megagrpo.parallel.strict import (
    DeviceError,
    check_on_device,
    on_host,
    strict_active,
    strict_devices,
    strict_from_env,
)


@pytest.fixture(scope="module")
def groups():
    from megagrpo.parallel import destroy_parallel, init_parallel

    g = init_parallel(ParallelConfig())  # world 1, gloo: it accepts CPU tensors
    yield g
    destroy_parallel()


def test_host_tensor_to_all_reduce_raises_when_the_device_is_not_cpu(groups):
    """The reproduction of item 1 on CPU: trainer/dist.py and clip_grad_norm build float64
    scalars without a device and all-reduce them; gloo takes them, NCCL does not."""
    host = torch.zeros(2, dtype=torch.float64)
    dist.all_reduce(host, group=groups.dp)  # gloo alone: accepted (why CI never saw it)
    with strict_devices(groups) as dev:
        assert dev == torch.device("cuda", 0) and groups.device == dev
        scalar = torch.zeros((), dtype=torch.float64)  # as _param_sq builds it
        with pytest.raises(DeviceError, match="all_reduce.*on cpu"):
            dist.all_reduce(scalar, group=groups.dp)
        with pytest.raises(DeviceError, match="all_gather_into_tensor"):
            out = torch.zeros(2, device=dev)
            dist.all_gather_into_tensor(out, torch.zeros(2), group=groups.dp)
        ok = torch.zeros(2, dtype=torch.float64, device=groups.device) + 1
        dist.all_reduce(ok, group=groups.dp)  # on the compute device: fine
        moved = host.to(groups.device)
        dist.all_reduce(moved)
        assert torch.equal(moved, torch.zeros(2, dtype=torch.float64, device=dev))
        # object collectives (pickled host buffers, as torch does for NCCL too) pass
        assert dist.get_world_size() == 1
    assert groups.device == torch.device("cpu") and not strict_active()
    dist.all_reduce(torch.zeros(2))  # patches removed


def test_declared_non_cpu_device_without_emulation(groups):
    """A declared meta device (no emulation): any real CPU tensor is rejected."""
    with strict_devices(device="meta"):
        with pytest.raises(DeviceError):
            dist.all_reduce(torch.zeros(1))


def test_emulated_device_semantics(groups):
    lin = torch.nn.Linear(4, 3)  # parameters made before: on the device
    with strict_devices(groups) as dev:
        x = torch.randn(2, 4)  # a factory without device: host, as on a GPU machine
        assert on_host(x) and x.device == torch.device("cpu")
        assert lin.weight.device == dev and lin.weight.is_cuda
        with pytest.raises(DeviceError, match="same device"):
            lin(x)
        y = lin(x.to(dev))
        assert y.device == dev and not on_host(y)
        assert (y * torch.tensor(2.0)).device == dev  # 0-dim host tensors are scalars
        assert torch.empty(3, device=torch.cuda.current_device()).device == dev
        assert torch.zeros_like(y).device == dev and y.new_zeros(2).device == dev
        assert torch.tensor([1, 2]).device.type == "cpu"
        back = y.detach().cpu()
        assert on_host(back) and not on_host(y)  # .cpu() is a copy to the host
        idx = torch.tensor([0])
        assert y[idx].device == dev  # host indices may index a device tensor
        y.sum().backward()
        assert lin.weight.grad is not None and lin.weight.grad.device == dev
        assert isinstance(y.sum().item(), float)
    assert lin.weight.device == torch.device("cpu")


def test_check_on_device_names_the_tensors(groups):
    check_on_device("loss", target_ids=torch.zeros(3))  # outside strict mode: a no-op
    with strict_devices(groups) as dev:
        logits = torch.zeros(2, 3, device=dev)
        with pytest.raises(DeviceError, match="loss: .*target_ids.*mask"):
            check_on_device(
                "loss",
                logits=logits,
                target_ids=torch.zeros(2, dtype=torch.long),
                mask=torch.ones(2),
                ref_logprobs=None,
            )
        check_on_device("loss", logits=logits, mask=torch.ones(2).to(dev))


def test_strict_from_env(groups, monkeypatch):
    monkeypatch.delenv("MEGAGRPO_STRICT_DEVICES", raising=False)
    with strict_from_env(groups):
        assert not strict_active()
    monkeypatch.setenv("MEGAGRPO_STRICT_DEVICES", "1")
    with strict_from_env(groups):
        assert strict_active()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_policy_train_step_and_export_pass_strict_mode(groups, tiny_dense_dir, tiny_moe_dir, kind):
    """The model side is clean: forward (host token ids moved by forward_logits), backward,
    LoRA grad sync, scoring, merged export and the survival all-reduce, with every collective
    checked. Same numbers as outside strict mode."""
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy

    path = tiny_dense_dir if kind == "dense" else tiny_moe_dir
    cfg = ModelConfig(
        hf_path=str(path), lora=LoraConfig(dropout=0.0, targets=["linear_qkv", "linear_proj"])
    )
    policy = build_policy(cfg, groups)
    with torch.no_grad():
        for a in policy.adapters.values():
            a.lora_B.fill_(0.01)
    ids = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = policy.forward_logits(ids).double().sum().item()
    with strict_devices(groups) as dev:
        logits = policy.forward_logits(ids)  # ids are a host tensor, as the collate makes them
        assert logits.device == dev
        loss = logits.double().sum()
        check_on_device("loss", logits=logits, loss=loss)
        loss.backward()
        policy.finish_grad_sync()
        assert all(p.grad is not None and p.grad.device == dev for p in policy.lora_parameters())
        with policy.scoring():
            policy.forward_logits(ids)
        tensors = [t for bucket in policy.export_hf_weights() for _, t in bucket]
        assert tensors and all(t.device == dev for t in tensors)
        survival = policy.merge_survival(groups.mp)
    assert loss.item() == pytest.approx(ref, rel=1e-9)
    assert 0.99 < survival["sync/lora_survival"] < 1.01


def test_host_modules_stay_on_the_host(groups):
    """An in-process HF engine's model can be kept on the host (its generate() asks for CUDA
    generators by device type, which an emulated device cannot give)."""
    engine, lin = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with strict_devices(groups, host_modules=(engine,)) as dev:
        assert engine.weight.device.type == "cpu" and lin.weight.device == dev
        out = engine(torch.randn(1, 2))  # host in, host out: no mixing
        assert out.device.type == "cpu"
        with torch.no_grad():
            engine.weight.copy_(lin.weight)  # a weight sync into it may cross
    assert not on_host(engine.weight)
