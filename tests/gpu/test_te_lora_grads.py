"""LoRA gradients under the Transformer Engine spec equal those under the local spec, with
B != 0 (issue 11, items 8-9). Skipped without CUDA and TE.

Before the fix, TE's fused-layernorm ``linear_qkv`` returned its *gathered* layernorm output
to the adapter, whose gradient TE >= 2.4 drops: the LoRA grads of every layer below the last
``linear_qkv`` adapter differed (the residual stream missed ``s B A`` in dL/dx).
"""

from __future__ import annotations

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


def _grads(policy, ids, weights) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from megagrpo.model.peft_export import gather_lora

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the same non-zero adapters on both specs (A and B by HF name)
        for p in policy.lora_parameters():
            p.zero_()
    for p in policy.lora_parameters():
        p.grad = None
    lora = gather_lora(policy)
    # deterministic values by HF name (q/k/v and gate/up share one A: the last name wins
    # on both specs alike), written back into each shard
    for name in sorted(lora):
        a, b = lora[name]
        lora[name] = (
            torch.randn(a.shape, generator=gen) * 0.1,
            torch.randn(b.shape, generator=gen) * 0.1,
        )
    _load_lora(policy, lora)
    logits = policy.forward_logits(ids).float()
    (logits * weights).sum().backward()
    policy.finish_grad_sync()
    return gather_lora(policy, use_grad=True)


def _load_lora(policy, lora) -> None:
    """Write full HF-named factors into this rank's adapter shards (world 1: whole)."""
    from megagrpo.model.peft_export import _adapter_for, lora_target

    with torch.no_grad():
        for name, (a, b) in lora.items():
            hit = lora_target(name, policy.cfg.lora.targets)
            assert hit is not None
            for piece in policy.plan.get(name, []):
                la, lb, _, _ = _adapter_for(policy, piece.param)
                if hit[0] == "column":
                    lb[piece.dst[0]] = b[piece.src[0]].to(lb.device)
                    la.copy_(a.to(la.device))
                else:
                    la[:, piece.dst[1]] = a[:, piece.src[1]].to(la.device)
                    lb.copy_(b.to(lb.device))


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_te_and_local_spec_lora_grads_agree(groups, tiny_moe_dir, tiny_dense_dir, kind):
    from megagrpo.model import ModelConfig, build_policy

    path = str(tiny_moe_dir if kind == "moe" else tiny_dense_dir)
    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    weights = None
    out = {}
    for spec in ("local", "te"):
        cfg = ModelConfig(hf_path=path, spec=spec)
        cfg.lora.targets = targets
        policy = build_policy(cfg, groups)
        if weights is None:
            v = policy.arch.vocab_size
            weights = torch.randn(2, 16, v, generator=torch.Generator().manual_seed(2)).cuda()
        out[spec] = _grads(policy, ids, weights)
        del policy
        torch.cuda.empty_cache()
    assert out["te"].keys() == out["local"].keys()
    for name in out["local"]:
        for i, which in enumerate("AB"):
            ref, got = out["local"][name][i], out["te"][name][i]
            scale = ref.abs().max().item() + 1e-12
            # fp32 on both sides; TE and cuBLAS may use TF32 in fused GEMMs: 1e-2 of the scale
            assert (got - ref).abs().max().item() <= 1e-2 * scale, (name, which)
