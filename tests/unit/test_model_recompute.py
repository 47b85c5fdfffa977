"""Activation recompute (issue 11, item 10): ``model.recompute`` reaches megatron-core, runs
on CPU (the checkpoint's RNG save/restore under the CPU shims), gives the same loss and LoRA
gradients as no recompute, and really keeps fewer tensors for backward. World size 1."""

from __future__ import annotations

import pytest
import torch

from megagrpo.errors import ConfigError
from megagrpo.model.config import LoraConfig, ModelConfig
from megagrpo.parallel import ParallelConfig

ALL = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


@pytest.fixture(scope="module")
def groups():
    from megagrpo.parallel import destroy_parallel, init_parallel

    g = init_parallel(ParallelConfig())
    yield g
    destroy_parallel()


def _step(path, groups, recompute, dropout, **kw):
    """Loss, LoRA grads and bytes saved for backward of one forward/backward."""
    from megagrpo.model.policy import build_policy

    cfg = ModelConfig(
        hf_path=str(path), recompute=recompute, lora=LoraConfig(dropout=dropout, targets=ALL), **kw
    )
    policy = build_policy(cfg, groups)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # non-zero B: every adapter is on the gradient path
        for name in sorted(policy.adapters):
            b = policy.adapters[name].lora_B
            b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    w = torch.randn(2, 24, policy.arch.vocab_size, generator=torch.Generator().manual_seed(1))
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(5)  # the same dropout masks in both runs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = (policy.forward_logits(ids) * w).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    assert set(grads) == {n for n, _ in policy.model.named_parameters() if ".adapter.lora_" in n}
    return loss.item(), grads, sum(storages.values())


@pytest.mark.parametrize("kind, dropout", [("dense", 0.05), ("moe", 0.0)])
def test_full_recompute_same_loss_and_grads_less_saved(
    groups, tiny_dense_dir, tiny_moe_dir, kind, dropout
):
    """Fails before the fix: ``model.recompute`` did not exist (the old bool reached only the
    memory planner). Tolerance: recompute replays the same fp32 CPU kernels on the same
    inputs in the same order (measured: bitwise equal); 1e-6 of each gradient's scale leaves
    room for a BLAS that picks another kernel on the replay, nothing more."""
    path = tiny_dense_dir if kind == "dense" else tiny_moe_dir
    loss0, grads0, saved0 = _step(path, groups, "none", dropout)
    loss1, grads1, saved1 = _step(path, groups, "full", dropout)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    for name, g0 in grads0.items():
        scale = g0.abs().max().item()
        assert scale > 0, name  # every adapter gets a gradient (the embedding hook works)
        assert (grads1[name] - g0).abs().max().item() <= 1e-6 * scale, name
    # 2 layers, 48 tokens: only each layer's input (and the logits) is kept for backward
    assert saved1 < 0.3 * saved0, (saved1, saved0)


def test_selective_core_attention_recompute(groups, tiny_dense_dir):
    loss0, grads0, saved0 = _step(tiny_dense_dir, groups, "none", 0.0)
    loss1, grads1, saved1 = _step(
        tiny_dense_dir, groups, "selective", 0.0, recompute_modules=["core_attn"]
    )
    assert loss1 == pytest.approx(loss0, rel=1e-6) and saved1 < saved0
    for name, g0 in grads0.items():
        assert (grads1[name] - g0).abs().max().item() <= 1e-6 * g0.abs().max().item(), name


def test_recompute_config_errors_name_the_key(groups, tiny_dense_dir):
    from megagrpo.model.arch import arch_from_hf, load_hf_config
    from megagrpo.model.provider import recompute_kwargs

    for kw, key in [
        ({"recompute": "all"}, "model.recompute"),
        ({"recompute_method": "every"}, "model.recompute_method"),
        ({"recompute_num_layers": 0}, "model.recompute_num_layers"),
        ({"recompute_modules": ["attention"]}, "model.recompute_modules"),
        ({"recompute": "selective", "recompute_modules": []}, "model.recompute_modules"),
    ]:
        with pytest.raises(ConfigError, match=key):
            ModelConfig(**kw).validate("model")
    arch = arch_from_hf(load_hf_config(tiny_dense_dir))  # 2 layers
    for kw in [
        {"recompute": "full", "recompute_num_layers": 3},
        {"recompute": "full", "recompute_method": "block", "recompute_num_layers": 3},
        {"recompute": "selective", "recompute_modules": ["moe_act"]},
    ]:
        with pytest.raises(ConfigError, match="model.recompute"):
            recompute_kwargs(arch, ModelConfig(**kw), groups, "local")
    assert recompute_kwargs(
        arch, ModelConfig(recompute="full", recompute_num_layers=2), groups, "local"
    ) == {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 2,
        "distribute_saved_activations": False,
    }
    assert recompute_kwargs(arch, ModelConfig(), groups, "local") == {}
