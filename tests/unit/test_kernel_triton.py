"""Triton kernels (interpreter on CPU, native on CUDA) against the pure-torch reference."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the import of the kernel module
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from loss_cases import parity_loss_config  # noqa: E402  (tests/loss_cases.py)

from megagrpo.algo.config import LossConfig  # noqa: E402
from megagrpo.algo.losses import reference_policy_loss, token_entropy, token_logprobs  # noqa: E402
from megagrpo.kernels import epilogue, fused_policy_loss  # noqa: E402
from megagrpo.kernels.triton_loss import triton_logits_grad, triton_stats  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _inputs(T, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g) * 4).to(dtype)
    tgt = torch.randint(0, V, (T,), generator=g)
    with torch.no_grad():
        lp = token_logprobs(logits, tgt)
    old = lp + 0.4 * torch.randn(T, generator=g)
    ref = lp + 0.3 * torch.randn(T, generator=g)
    adv = torch.randn(T, generator=g)
    mask = (torch.rand(T, generator=g) > 0.25).float()
    return [t.to(DEV) for t in (logits, tgt, old, ref, adv, mask)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V,block_v", [(333, 64), (1000, 1024)])
def test_stats_and_fused_terms_match_torch(dtype, V, block_v):
    logits, tgt, old, ref, adv, _ = _inputs(24, V, dtype)
    stats, terms = triton_stats(
        logits,
        tgt,
        0,
        old_logprobs=old,
        advantages=adv,
        ref_logprobs=ref,
        eps_low=0.1,
        eps_high=0.3,
        block_v=block_v,
    )
    x = logits.float()
    lse = torch.logsumexp(x, -1)
    assert torch.allclose(stats[:, 0], x.amax(-1))
    assert torch.allclose(stats[:, 0] + stats[:, 1].log(), lse, atol=1e-5)
    logp = token_logprobs(logits, tgt)
    assert torch.allclose(terms[:, 0], logp, atol=1e-5)
    assert torch.allclose(terms[:, 1], token_entropy(logits), atol=1e-4)
    # the in-kernel surrogate: values and d/dlogp against autograd of the reference
    cfg = LossConfig(eps_low=0.1, eps_high=0.3)
    lp = logp.clone().requires_grad_()
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.9, 1.3))
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    (dpg,) = torch.autograd.grad(pg.sum(), lp, retain_graph=True)
    (dkl,) = torch.autograd.grad(kl.sum(), lp)
    assert torch.allclose(terms[:, 2], pg.detach(), atol=1e-5)
    assert torch.allclose(terms[:, 3], dpg, atol=1e-5)
    assert torch.allclose(terms[:, 6], kl.detach(), atol=1e-5)
    assert torch.allclose(terms[:, 7], dkl, atol=1e-5)
    want = epilogue.token_terms(logp, old, adv, cfg, ref)
    assert torch.equal(terms[:, 4] > 0, want.clipped > 0)
    assert bool((terms[:, 4] > 0).any()), "test data should exercise the clip"


def test_stats_shard_with_target_outside():
    logits, tgt, *_ = _inputs(16, 200, torch.float32)
    stats, terms = triton_stats(logits[:, 100:], tgt, 100, block_v=64)
    owned = tgt >= 100
    want = torch.where(owned, logits.gather(1, tgt[:, None])[:, 0], 0.0)
    assert terms is None
    assert torch.allclose(stats[:, 3], want)
    assert torch.allclose(
        stats[:, 2], (logits[:, 100:].softmax(-1) * logits[:, 100:]).sum(-1), atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_h", [False, True])
def test_logits_grad_matches_autograd(dtype, with_h):
    logits, tgt, *_ = _inputs(20, 500, dtype, seed=1)
    g = torch.randn(20, device=DEV)
    h = torch.randn(20, device=DEV) if with_h else None
    x = logits.float().requires_grad_()
    obj = (g * token_logprobs(x, tgt)).sum()
    if with_h:
        obj = obj + (h * token_entropy(x)).sum()
    obj.backward()
    xf = logits.float()
    lse = torch.logsumexp(xf, -1)
    ex = (xf.softmax(-1) * xf).sum(-1)
    out = torch.empty_like(logits)
    triton_logits_grad(logits, tgt, lse, ex, g, h, out, block_v=128)
    assert out.dtype == dtype
    assert torch.allclose(out.float(), x.grad.to(dtype).float(), **TOL[dtype])


@pytest.mark.parametrize("variant", ["grpo", "dapo", "dr_grpo", "gspo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_policy_loss_triton_matches_reference(variant, dtype):
    B, S, V = 4, 8, 257  # non-power-of-two vocab; padding via masks
    logits, tgt, old, ref, adv, mask = _inputs(B * S, V, dtype, seed=2)
    shp = (B, S)
    roll = old + 0.3
    cfg = parity_loss_config(
        variant,
        gspo_eps=(0.02, 0.03),
        tis_cap=2.0,
        backend="triton",
        grad_in_logits=(dtype == torch.bfloat16),
    )
    x1 = logits.float().view(B, S, V).requires_grad_()
    args = (tgt.view(shp), old.view(shp), adv.view(shp), mask.view(shp), cfg)
    l1, m1 = reference_policy_loss(
        x1, *args, ref_logprobs=ref.view(shp), rollout_logprobs=roll.view(shp)
    )
    l1.backward()
    x2 = logits.clone().view(B, S, V).requires_grad_()
    l2, m2 = fused_policy_loss(
        x2 * 1, *args, ref_logprobs=ref.view(shp), rollout_logprobs=roll.view(shp)
    )
    l2.backward()
    assert torch.allclose(l2, l1, atol=1e-5)
    assert torch.allclose(x2.grad.float(), x1.grad, **TOL[dtype])
    for k in ("loss/policy", "loss/kl", "loss/entropy", "loss/clip_frac", "loss/ratio_max"):
        assert torch.allclose(m2[k], m1[k], atol=1e-4), k
    assert float(m1["loss/clip_frac"]) > 0


def test_triton_grad_in_logits_bumps_version_counter():
    logits, tgt, old, _, adv, mask = _inputs(8, 100, torch.float32, seed=3)
    a = logits.clone().requires_grad_()
    x = a * 2
    other = x.sin()  # saves x; the Triton kernel overwrites x through a raw pointer
    loss, _ = fused_policy_loss(
        x, tgt, old, adv, mask, LossConfig(variant="dapo", backend="triton", grad_in_logits=True)
    )
    with pytest.raises(RuntimeError, match="inplace"):
        (loss + other.sum()).backward()
