"""fused_policy_loss on the chunked torch path (the CPU backend) against the reference."""

from __future__ import annotations

import pytest
import torch
from loss_cases import parity_loss_config  # tests/loss_cases.py
from torch.utils._python_dispatch import TorchDispatchMode

from megagrpo.algo.config import LossConfig
from megagrpo.algo.losses import reference_policy_loss, token_entropy, token_logprobs
from megagrpo.kernels import fused_policy_loss, token_stats


def _inputs(shape, V, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, V, generator=g) * 3).to(dtype)
    tgt = torch.randint(0, V, shape, generator=g)
    lp = token_logprobs(logits, tgt)
    old = lp + 0.4 * torch.randn(shape, generator=g)
    ref = lp + 0.3 * torch.randn(shape, generator=g)
    adv = torch.randn(shape, generator=g)
    mask = (torch.rand(shape, generator=g) > 0.25).float()
    return logits, tgt, old, ref, adv, mask


def _compare(cfg, logits, tgt, old, ref, adv, mask, seq_ids=None, scale=1.0, atol=1e-5):
    roll = None if cfg.tis_cap == 0 else old - torch.linspace(-1, 1, old.numel()).view(old.shape)
    x1 = logits.float().clone().requires_grad_()
    l1, m1 = reference_policy_loss(
        x1, tgt, old, adv, mask, cfg, ref_logprobs=ref, rollout_logprobs=roll, seq_ids=seq_ids
    )
    (scale * l1).backward()
    x2 = logits.clone().requires_grad_()
    l2, m2 = fused_policy_loss(
        x2 * 1, tgt, old, adv, mask, cfg, ref, rollout_logprobs=roll, seq_ids=seq_ids
    )
    (scale * l2).backward()
    assert torch.allclose(l2, l1, atol=atol)
    assert torch.allclose(
        x2.grad.float(), x1.grad, atol=atol if logits.dtype == torch.float32 else 2e-2
    )
    assert set(m1) == set(m2)
    for k in m1:
        assert torch.allclose(m2[k].float(), m1[k].float(), atol=1e-4), k
    return m2


@pytest.mark.parametrize("variant", ["grpo", "dapo", "dr_grpo", "gspo", "sapo"])
@pytest.mark.parametrize("grad_in_logits", [False, True])
def test_chunked_matches_reference(variant, grad_in_logits):
    data = _inputs((3, 9), 301)
    cfg = parity_loss_config(
        variant,
        eps_low=0.15,
        eps_high=0.35,
        kl_coef=0.1,
        entropy_coef=0.02,
        tis_cap=1.5,
        backend="torch",
        chunk_bytes=4096,
        grad_in_logits=grad_in_logits,
    )
    m = _compare(cfg, *data, scale=(2.5 if grad_in_logits else 1.0))
    assert (float(m["loss/clip_frac"]) > 0) == (variant != "sapo")  # SAPO clips nothing
    assert 0 < float(m["loss/tis_clip_frac"]) < 1


@pytest.mark.parametrize("variant", ["grpo", "dr_grpo", "gspo", "sapo"])
def test_packed_sequences(variant):
    logits, tgt, old, ref, adv, mask = _inputs((20,), 64, seed=3)
    ids = torch.tensor([0] * 6 + [1] * 9 + [2] * 5)
    cfg = LossConfig(variant=variant, backend="torch", chunk_bytes=2048, max_tokens=12)
    _compare(cfg, logits, tgt, old, ref, adv, mask, seq_ids=ids)


def test_bf16_on_policy_and_no_grad():
    logits, tgt, old, ref, adv, mask = _inputs((2, 5), 130, torch.bfloat16, seed=4)
    cfg = LossConfig(variant="dapo", backend="torch")
    x = logits.clone().requires_grad_()
    loss, m = fused_policy_loss(x, tgt, None, adv, mask, cfg)
    loss.backward()
    assert float(m["loss/ratio_mean"]) == pytest.approx(1.0)
    xr = logits.float().requires_grad_()
    lr, _ = reference_policy_loss(xr, tgt, None, adv, mask, cfg)
    lr.backward()
    assert torch.allclose(loss, lr, atol=1e-5)
    assert x.grad.dtype == torch.bfloat16
    assert torch.allclose(x.grad.float(), xr.grad, atol=1e-2)
    with torch.no_grad():
        l3, _ = fused_policy_loss(logits, tgt, None, adv, mask, cfg)
    assert torch.allclose(l3, loss)


def test_token_stats_and_errors():
    logits, tgt, old, ref, adv, mask = _inputs((4, 6), 99, seed=5)
    logp, ent, lse, _ = token_stats(logits, tgt, backend="torch", chunk_bytes=1024)
    assert torch.allclose(logp, token_logprobs(logits, tgt).reshape(-1), atol=1e-5)
    assert torch.allclose(ent, token_entropy(logits).reshape(-1), atol=1e-5)
    assert torch.allclose(lse, torch.logsumexp(logits, -1).reshape(-1), atol=1e-5)
    with pytest.raises(ValueError, match="advantages"):
        fused_policy_loss(logits, tgt, old, adv[:, :3], mask, LossConfig(backend="torch"))
    with pytest.raises(ValueError, match="ref_logprobs"):
        fused_policy_loss(logits, tgt, old, adv, mask, LossConfig(backend="torch", kl_coef=0.1))
    with pytest.raises(ValueError, match="sequences"):
        fused_policy_loss(
            logits.view(24, 99),
            tgt.view(24),
            old.view(24),
            adv.view(24),
            mask.view(24),
            LossConfig(variant="gspo", backend="torch"),
        )


class _Allocs(TorchDispatchMode):
    """Records the bytes of every newly allocated op output (not views or in-place results)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for o in torch.utils._pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in ins:
                self.sizes.append((o.untyped_storage().nbytes(), o.dtype))
        return out


@pytest.mark.parametrize("grad_in_logits", [False, True])
def test_memory_no_full_fp32_tensor(grad_in_logits):
    T, V = 64, 2048
    logits, tgt, old, ref, adv, mask = _inputs((T,), V, torch.bfloat16, seed=6)
    cfg = LossConfig(
        variant="dapo",
        backend="torch",
        chunk_bytes=64 * 1024,
        kl_coef=0.1,
        entropy_coef=0.01,
        grad_in_logits=grad_in_logits,
    )
    x = logits.clone().requires_grad_()
    with _Allocs() as fused:
        loss, _ = fused_policy_loss(x, tgt, old, adv, mask, cfg, ref)
        loss.backward()
    with _Allocs() as naive:
        y = logits.clone().requires_grad_()
        reference_policy_loss(y, tgt, old, adv, mask, cfg, ref_logprobs=ref)[0].backward()
    full = T * V * 4
    assert max(b for b, _ in naive.sizes) >= full  # the check can see a [T, V] fp32 tensor
    fp32 = [b for b, d in fused.sizes if d == torch.float32]
    assert max(fp32) <= cfg.chunk_bytes // 2  # one fp32 [rows, V] chunk buffer at most
    big = [b for b, _ in fused.sizes if b >= T * V]
    # the only [T, V] allocation is the bf16 gradient itself, and none with grad_in_logits
    assert big == ([] if grad_in_logits else [T * V * 2])


@pytest.mark.parametrize("grad_in_logits", [False, True])
def test_grad_in_logits_is_caught_when_logits_are_saved_elsewhere(grad_in_logits):
    logits, tgt, old, ref, adv, mask = _inputs((8,), 50, seed=7)
    cfg = LossConfig(variant="dapo", backend="torch", grad_in_logits=grad_in_logits)
    a = logits.clone().requires_grad_()
    x = a * 2
    other = x.sin()  # saves x: overwriting x with its gradient must not go unnoticed
    loss, _ = fused_policy_loss(x, tgt, old, adv, mask, cfg)
    if grad_in_logits:
        with pytest.raises(RuntimeError, match="inplace"):
            (loss + other.sum()).backward()
    else:
        (loss + other.sum()).backward()
        assert a.grad is not None
