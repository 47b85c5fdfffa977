"""Fused projection + loss (hidden -> logits chunked over tokens) against the reference."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the Triton kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from loss_cases import parity_loss_config  # noqa: E402  (tests/loss_cases.py)

from megagrpo.algo.config import LossConfig  # noqa: E402
from megagrpo.algo.losses import reference_policy_loss, token_logprobs  # noqa: E402
from megagrpo.kernels.fused_linear import fused_linear_policy_loss  # noqa: E402


def _inputs(B, S, H, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2 / H**0.5).to(dtype)
    tgt = torch.randint(0, V, (B, S), generator=g)
    lp = token_logprobs(hidden.float() @ weight.float().T, tgt)
    old = lp + 0.3 * torch.randn(B, S, generator=g)
    ref = lp + 0.3 * torch.randn(B, S, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, S).contiguous()
    mask = (torch.rand(B, S, generator=g) > 0.2).float()
    return hidden, weight, tgt, old, ref, adv, mask


@pytest.mark.parametrize(
    "variant,backend,dtype",
    [
        ("grpo", "torch", torch.float32),
        ("gspo", "torch", torch.float32),
        ("dapo", "torch", torch.bfloat16),
        ("dr_grpo", "triton", torch.float32),
    ],
)
def test_fused_linear_matches_reference(variant, backend, dtype):
    hidden, weight, tgt, old, ref, adv, mask = _inputs(3, 5, 16, 150, dtype)
    cfg = parity_loss_config(variant, backend=backend, chunk_bytes=2048)
    h1 = hidden.float().clone().requires_grad_()
    w1 = weight.float().clone().requires_grad_()
    logits = (h1 @ w1.T).to(dtype)  # the projection's output is in the model's dtype
    l1, m1 = reference_policy_loss(logits, tgt, old, adv, mask, cfg, ref_logprobs=ref)
    (3.0 * l1).backward()
    h2 = hidden.clone().requires_grad_()
    w2 = weight.clone().requires_grad_()
    l2, m2 = fused_linear_policy_loss(h2, w2, tgt, old, adv, mask, cfg, ref, chunk_tokens=4)
    (3.0 * l2).backward()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(l2, l1, atol=1e-5 if dtype == torch.float32 else 1e-3)
    assert h2.grad.dtype == dtype and w2.grad.dtype == dtype
    assert torch.allclose(h2.grad.float(), h1.grad, atol=tol)
    assert torch.allclose(w2.grad.float(), w1.grad, atol=tol)
    assert torch.allclose(m2["loss/clip_frac"], m1["loss/clip_frac"])


def test_fused_linear_frozen_weight_and_shape_errors():
    hidden, weight, tgt, old, ref, adv, mask = _inputs(2, 4, 8, 40, torch.float32, seed=1)
    cfg = LossConfig(variant="dapo", backend="torch")
    h = hidden.clone().requires_grad_()
    loss, _ = fused_linear_policy_loss(h, weight, tgt, old, adv, mask, cfg)  # LoRA: W frozen
    loss.backward()
    assert h.grad is not None and weight.grad is None
    with pytest.raises(ValueError, match="weight"):
        fused_linear_policy_loss(hidden, weight.T, tgt, old, adv, mask, cfg)
    with pytest.raises(ValueError, match="mask"):
        fused_linear_policy_loss(hidden, weight, tgt, old, adv, mask[:, :2], cfg)
