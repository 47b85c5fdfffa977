"""GPU path: Transformer Engine spec (fused layernorm linears, TEGroupedMLP experts) with the
same HF mapping and LoRA code as the CPU tests. Skipped without CUDA (and without TE)."""

from __future__ import annotations

import glob
import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine"
    ),
]


def _ref(path, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        return model(ids.cuda()).logits


@pytest.mark.parametrize("grouped", [True, False])
def test_te_spec_logits_roundtrip_and_peft(groups, tiny_moe_dir, tmp_path, grouped):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megagrpo.model import ModelConfig, build_policy

    cfg = ModelConfig(hf_path=str(tiny_moe_dir), spec="te", moe_grouped_gemm=grouped)
    policy = build_policy(cfg, groups)
    assert policy.spec == "te" and policy.grouped_experts == grouped
    names = [n for n, _ in policy.model.named_parameters()]
    assert any("linear_qkv.layer_norm_weight" in n for n in names)
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = policy.forward_logits(ids)
    assert (logits.float() - _ref(tiny_moe_dir, ids)).abs().max().item() < 1e-3
    orig = {}
    for f in glob.glob(f"{tiny_moe_dir}/*.safetensors"):
        orig.update(load_file(f))
    out = {k: t for b in policy.export_hf_weights(merge_lora=False) for k, t in b}
    assert all(torch.equal(out[k].cpu(), orig[k]) for k in orig)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.lora_parameters():
            p.copy_(torch.randn(p.shape, generator=gen).to(p.device) * 0.05)
        trained = policy.forward_logits(ids).float()
    policy.export_peft_adapter(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).cuda()
    model = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert (model(ids.cuda()).logits - trained).abs().max().item() < 1e-3


def test_bf16_base_lora_grads_flow(groups, tiny_moe_dir):
    from megagrpo.model import ModelConfig, build_policy

    policy = build_policy(ModelConfig(hf_path=str(tiny_moe_dir), dtype="bfloat16"), groups)
    assert all(p.dtype == torch.float32 for p in policy.lora_parameters())
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    policy.forward_logits(ids).float().sum().backward()
    policy.finish_grad_sync()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.lora_parameters())
