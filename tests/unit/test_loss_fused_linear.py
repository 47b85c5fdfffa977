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
        ("sapo", "torch", torch.float32),
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


@pytest.mark.parametrize("linear", [False, True], ids=["logits", "fused-linear"])
def test_probe_mismatch_sums_equal_torch(linear):
    """``probe_logprobs`` (old log-probs None: the training forward is the behaviour forward)
    gives |logp - probe| summed and maxed over the mask, equal to torch's log_softmax + gather
    (fp32: 1e-5 on sums of ~10 terms of magnitude ~1), and leaves the loss unchanged."""
    from megagrpo.kernels import fused_policy_loss

    hidden, weight, tgt, old, _, adv, mask = _inputs(3, 5, 16, 150, torch.float32, seed=3)
    cfg = LossConfig(variant="grpo", backend="torch", chunk_bytes=2048)
    logits = hidden @ weight.T
    logp = token_logprobs(logits, tgt)
    if linear:
        loss, m = fused_linear_policy_loss(
            hidden, weight, tgt, None, adv, mask, cfg, probe_logprobs=old, chunk_tokens=4
        )
        base, _ = fused_linear_policy_loss(hidden, weight, tgt, None, adv, mask, cfg)
    else:
        loss, m = fused_policy_loss(logits, tgt, None, adv, mask, cfg, probe_logprobs=old)
        base, _ = fused_policy_loss(logits, tgt, None, adv, mask, cfg)
    diff = (logp - old).abs() * mask
    assert float(m["loss/logprob_mismatch_sum"]) == pytest.approx(float(diff.sum()), abs=1e-5)
    assert float(m["loss/logprob_mismatch_max"]) == pytest.approx(float(diff.max()), abs=1e-5)
    assert float(m["loss/logprob_mismatch_tokens_sum"]) == float(mask.sum())
    assert torch.equal(loss, base)


def test_masked_tokens_never_reach_the_output_layer():
    """Prompt and padding tokens (mask 0) carry no loss, so their rows of hidden @ W^T are
    never computed: with those rows set to NaN the loss, both gradients and the no-grad
    log-probs equal the reference's on clean inputs (a path that computed them would give
    NaN), and the masked rows' hidden gradient is exactly 0."""
    from megagrpo.kernels import fused_linear_token_stats

    hidden, weight, tgt, old, _, adv, mask = _inputs(3, 7, 16, 150, torch.float32, seed=5)
    cfg = LossConfig(variant="grpo", backend="torch", chunk_bytes=2048)
    dirty = hidden.masked_fill((mask == 0).unsqueeze(-1), float("nan"))
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    l1, _ = reference_policy_loss(h1 @ w1.T, tgt, old, adv, mask, cfg)
    l1.backward()
    h2, w2 = dirty.clone().requires_grad_(), weight.clone().requires_grad_()
    l2, _ = fused_linear_policy_loss(h2, w2, tgt, old, adv, mask, cfg, chunk_tokens=4)
    l2.backward()
    assert torch.allclose(l2, l1, atol=1e-6)
    assert torch.allclose(w2.grad, w1.grad, atol=1e-5)
    assert torch.allclose(h2.grad, h1.grad, atol=1e-5)
    assert torch.equal(h2.grad[mask == 0], torch.zeros_like(h2.grad[mask == 0]))
    lp, _ = fused_linear_token_stats(dirty, weight, tgt, chunk_tokens=4, mask=mask)
    want = token_logprobs(hidden @ weight.T, tgt) * mask
    assert torch.allclose(lp.reshape(mask.shape) * mask, want, atol=1e-5)


def test_chunks_hold_a_thousand_rows_at_tp1(monkeypatch):
    """Audit 3 P2: at TP 1 Qwen3's 151,936-token vocabulary gave 110-row chunks (32 MiB of bf16
    logits); by default a chunk has at least loss.fused_chunk_rows = 1,024 rows (full-size
    GEMMs), and chunk_bytes still grows it where the vocabulary shard is small."""
    from megagrpo.kernels import fused_linear

    cfg = LossConfig()
    assert cfg.chunk_bytes // (151_936 * 2) == 110  # the audit's figure
    assert fused_linear.chunk_rows(cfg.chunk_bytes, 151_936, 2, cfg.fused_chunk_rows) == 1024
    assert fused_linear.chunk_rows(cfg.chunk_bytes, 1024, 2, cfg.fused_chunk_rows) == 16384  # V 1k
    steps = []
    real = fused_linear._chunks
    monkeypatch.setattr(
        fused_linear, "_chunks", lambda T, step: steps.append(step) or real(T, step)
    )
    hidden, weight, tgt, old, _, adv, mask = _inputs(1, 2500, 16, 600, torch.float32)
    thin = LossConfig(backend="torch", chunk_bytes=110 * 600 * 4)  # the audit's 110 rows
    fused_linear_policy_loss(hidden, weight, tgt, old, adv, mask, thin)
    assert steps and set(steps) == {1024}  # 3 chunks of 2,500 tokens, not 23 thin ones
