"""Vocab-parallel fused loss with 2 gloo processes equals the unsharded reference."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megagrpo.parallel.launch import launch

pytestmark = pytest.mark.distributed

WORLD = 2
CASES = [  # (variant, backend, dtype, grad_in_logits)
    ("grpo", "torch", torch.float32, False),
    ("dapo", "torch", torch.bfloat16, True),
    ("gspo", "torch", torch.float32, False),
    ("dr_grpo", "triton", torch.float32, False),
    ("dapo", "triton", torch.bfloat16, True),
]


def _check_case(rank, group, variant, backend, dtype, grad_in_logits):
    from loss_cases import parity_loss_config  # tests/loss_cases.py

    from megagrpo.algo.losses import reference_policy_loss, token_logprobs
    from megagrpo.kernels import fused_policy_loss, token_stats

    B, S, V = 2, 6, 250  # vocab 250 -> shards of 125 (not a power of two)
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(B, S, V, generator=g) * 3).to(dtype)
    tgt = torch.randint(0, V, (B, S), generator=g)
    lp = token_logprobs(logits, tgt)
    old = lp + 0.4 * torch.randn(B, S, generator=g)
    ref = lp + 0.3 * torch.randn(B, S, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, S).contiguous()
    mask = (torch.rand(B, S, generator=g) > 0.2).float()
    cfg = parity_loss_config(
        variant, backend=backend, grad_in_logits=grad_in_logits, chunk_bytes=4096
    )
    full = logits.float().clone().requires_grad_()
    l_ref, m_ref = reference_policy_loss(full, tgt, old, adv, mask, cfg, ref_logprobs=ref)
    l_ref.backward()
    v_local = V // WORLD
    shard = logits[..., rank * v_local : (rank + 1) * v_local].clone().requires_grad_()
    loss, metrics = fused_policy_loss(shard * 1, tgt, old, adv, mask, cfg, ref, tp_group=group)
    loss.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    case = f"rank {rank} {variant}/{backend}/{dtype}"
    assert torch.allclose(loss, l_ref, atol=1e-5), (case, float(loss), float(l_ref))
    want = full.grad[..., rank * v_local : (rank + 1) * v_local]
    assert torch.allclose(shard.grad.float(), want, atol=tol), case
    for k in ("loss/kl", "loss/entropy", "loss/clip_frac", "loss/policy"):
        assert torch.allclose(metrics[k], m_ref[k], atol=1e-4), (case, k)
    logp, *_ = token_stats(shard.detach(), tgt, tp_group=group, backend=backend)
    assert torch.allclose(logp, lp.reshape(-1), atol=1e-5), case


def _check_fused_linear(rank, group):
    """Projection sharded over the vocab: grad_hidden partials sum to the unsharded grad."""
    from megagrpo.algo.config import LossConfig
    from megagrpo.algo.losses import reference_policy_loss
    from megagrpo.kernels.fused_linear import fused_linear_policy_loss

    B, S, H, V = 2, 5, 8, 96
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(B, S, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    tgt = torch.randint(0, V, (B, S), generator=g)
    adv = torch.randn(B, S, generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.2).float()
    old = torch.full((B, S), -4.5)
    cfg = LossConfig(variant="grpo", entropy_coef=0.01, backend="torch", chunk_bytes=1024)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    l1, _ = reference_policy_loss(h1 @ w1.T, tgt, old, adv, mask, cfg)
    l1.backward()
    v_local = V // WORLD
    rows = slice(rank * v_local, (rank + 1) * v_local)
    h2, w2 = hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_()
    l2, _ = fused_linear_policy_loss(h2, w2, tgt, old, adv, mask, cfg, tp_group=group)
    l2.backward()
    grad_h = h2.grad.clone()
    dist.all_reduce(grad_h, group=group)
    assert torch.allclose(l2, l1, atol=1e-5), rank
    assert torch.allclose(grad_h, h1.grad, atol=1e-5), rank
    assert torch.allclose(w2.grad, w1.grad[rows], atol=1e-5), rank


def _worker(rank: int):
    dist.init_process_group("gloo")
    try:
        group = dist.new_group(list(range(WORLD)))
        for case in CASES:
            _check_case(rank, group, *case)
        _check_fused_linear(rank, group)
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_equals_unsharded():
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # inherited by the workers
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launch(_worker, WORLD)  # ranks forked from the preloaded server (megagrpo.parallel.launch)
