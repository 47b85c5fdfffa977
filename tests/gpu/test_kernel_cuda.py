"""Native Triton kernels on CUDA against the torch reference, and their memory footprint.

Run alone on a GPU machine: ``pytest tests/gpu/test_kernel_cuda.py`` (TRITON_INTERPRET must
be unset; the conftest only sets it when CUDA is absent).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1",
        reason="TRITON_INTERPRET=1 is set: native kernels would not run",
    ),
]


def _inputs(T, V, dtype, seed=0):
    from megagrpo.algo.losses import token_logprobs

    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(T, V, generator=g, device="cuda") * 4).to(dtype)
    tgt = torch.randint(0, V, (T,), generator=g, device="cuda")
    with torch.no_grad():
        lp = token_logprobs(logits, tgt)
    old = lp + 0.3 * torch.randn(T, generator=g, device="cuda")
    ref = lp + 0.3 * torch.randn(T, generator=g, device="cuda")
    adv = torch.randn(T, generator=g, device="cuda")
    mask = (torch.rand(T, generator=g, device="cuda") > 0.2).float()
    return logits, tgt, old, ref, adv, mask


@pytest.mark.parametrize("variant", ["grpo", "dapo", "gspo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_in_logits", [False, True])
def test_cuda_fused_matches_reference(variant, dtype, grad_in_logits):
    from loss_cases import parity_loss_config  # tests/loss_cases.py

    from megagrpo.algo.losses import reference_policy_loss
    from megagrpo.kernels import fused_policy_loss

    B, S, V = 8, 64, 32003
    logits, tgt, old, ref, adv, mask = _inputs(B * S, V, dtype)
    shp = (B, S)
    cfg = parity_loss_config(variant, grad_in_logits=grad_in_logits)
    assert cfg.backend == "auto"  # -> triton on CUDA
    args = (tgt.view(shp), old.view(shp), adv.view(shp), mask.view(shp), cfg)
    x1 = logits.float().clone().view(B, S, V).requires_grad_()
    l1, m1 = reference_policy_loss(x1, *args, ref_logprobs=ref.view(shp))
    l1.backward()
    x2 = logits.clone().view(B, S, V).requires_grad_()
    l2, m2 = fused_policy_loss(x2 * 1, *args, ref_logprobs=ref.view(shp))
    l2.backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(l2, l1, atol=1e-4, rtol=1e-4)
    assert torch.allclose(x2.grad.float(), x1.grad, atol=tol)
    assert torch.allclose(m2["loss/entropy"], m1["loss/entropy"], atol=1e-3)


def _peak_extra(logits, run) -> int:
    """Peak CUDA bytes allocated by run(x) above the baseline; x: a fresh leaf copy of logits."""
    x = logits.detach().clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grad = run(x)
    torch.cuda.synchronize()
    assert grad.shape == x.shape
    return torch.cuda.max_memory_allocated() - base


def test_cuda_peak_memory_vs_naive():
    from megagrpo.algo.config import LossConfig
    from megagrpo.algo.losses import reference_policy_loss
    from megagrpo.kernels import fused_policy_loss

    T, V = 2048, 151936
    logits, tgt, old, ref, adv, mask = _inputs(T, V, torch.bfloat16)

    def naive(x):
        loss = reference_policy_loss(x, tgt, old, adv, mask, LossConfig(variant="dapo"))[0]
        return torch.autograd.grad(loss, x)[0]

    def fused(in_logits):
        def run(x):
            cfg = LossConfig(variant="dapo", grad_in_logits=in_logits)
            return torch.autograd.grad(fused_policy_loss(x, tgt, old, adv, mask, cfg)[0], x)[0]

        return run

    grad_bytes = logits.numel() * logits.element_size()
    p_naive = _peak_extra(logits, naive)
    p_fused = _peak_extra(logits, fused(False))
    p_inplace = _peak_extra(logits, fused(True))
    assert p_fused <= grad_bytes * 1.05  # the bf16 gradient and O(T) vectors only
    assert p_inplace * 10 <= p_naive
    assert p_naive >= 3 * grad_bytes  # the naive path does hold fp32 [T, V] tensors
