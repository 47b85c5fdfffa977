"""Losses on groups of different sizes: every variant and aggregation against a loop over the
groups calling the fixed-size reference, then the fused (chunked torch, Triton interpreter,
fused-linear) losses and a micro-batch split against the whole-batch reference."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the import of the Triton kernel module
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from megagrpo.algo.advantages import flat_group_advantages, sequence_weights  # noqa: E402
from megagrpo.algo.config import LossConfig  # noqa: E402
from megagrpo.algo.losses import (  # noqa: E402
    aggregation_mass,
    reference_policy_loss,
    token_logprobs,
    token_weights,
)
from megagrpo.kernels import fused_policy_loss  # noqa: E402
from megagrpo.kernels.fused_linear import fused_linear_policy_loss  # noqa: E402

SIZES = [3, 1, 5, 2]
S, T, V, H = sum(SIZES), 9, 37, 16
AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
VARIANTS = ["grpo", "dapo", "dr_grpo", "gspo"]


def _batch(seed=0):
    """[S, T] rows (one per completion, groups consecutive), right-padded completions."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    logits = hidden @ weight.T
    tgt = torch.randint(0, V, (S, T), generator=g)
    lengths = torch.randint(2, T + 1, (S,), generator=g)
    lengths[4] = 1  # a one-token completion
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    rewards = (torch.rand(S, generator=g) < 0.5).float()
    rewards[3:8] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])  # the 5-group splits
    adv = flat_group_advantages(rewards, SIZES)[:, None].expand(S, T).contiguous()
    with torch.no_grad():
        lp = token_logprobs(logits, tgt)
    old = lp + 0.3 * torch.randn(S, T, generator=g)
    ref = lp + 0.2 * torch.randn(S, T, generator=g)
    roll = old - 0.2 * torch.randn(S, T, generator=g)
    return dict(
        hidden=hidden,
        weight=weight,
        logits=logits,
        tgt=tgt,
        mask=mask,
        adv=adv,
        old=old,
        ref=ref,
        roll=roll,
    )


def _cfg(variant, agg, backend="torch"):
    cfg = LossConfig(
        variant=variant,
        loss_agg=agg,
        kl_coef=0.1,
        entropy_coef=0.01,
        tis_cap=2.0,
        max_tokens=T,
        backend=backend,
        chunk_bytes=4096,
        grad_in_logits=False,
    )
    if variant == "gspo":
        cfg.eps_low, cfg.eps_high = 0.01, 0.02
    return cfg


def _loss(d, cfg, rows, x, seq_weights=None):
    return reference_policy_loss(
        x[rows],
        d["tgt"][rows],
        d["old"][rows],
        d["adv"][rows],
        d["mask"][rows],
        cfg,
        ref_logprobs=d["ref"][rows],
        rollout_logprobs=d["roll"][rows],
        seq_weights=seq_weights,
    )[0]


def _per_group(d, cfg, weighting, x):
    """Loop over groups with the fixed-size reference, combined by the definitions:
    sequence weighting = every completion alike (token counts / non-empty sequences /
    sequences), group weighting = every problem alike (each sequence of group n counts
    (S / N) / G_n times)."""
    agg = cfg.resolved_loss_agg()
    start, losses, mass = 0, [], []
    for n in SIZES:
        rows = slice(start, start + n)
        start += n
        m = d["mask"][rows]
        if agg == "token_mean":
            k = m.sum()
        elif agg == "seq_mean_token_mean":
            k = (m.sum(1) > 0).sum().float()
        else:
            k = torch.tensor(float(n))
        w = (S / len(SIZES)) / n if weighting == "group" else 1.0
        losses.append(_loss(d, cfg, rows, x))
        mass.append(k * w)
    mass = torch.stack(mass)
    return (torch.stack(losses) * mass).sum() / mass.sum()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("weighting", ["sequence", "group"])
def test_reference_equals_loop_over_groups(variant, agg, weighting):
    d = _batch()
    cfg = _cfg(variant, agg)
    w = sequence_weights(SIZES, weighting)
    x1 = d["logits"].clone().requires_grad_()
    batch = _loss(d, cfg, slice(None), x1, w if weighting == "group" else None)
    batch.backward()
    x2 = d["logits"].clone().requires_grad_()
    ref = _per_group(d, cfg, weighting, x2)
    ref.backward()
    scale = ref.abs().item() + 1e-3
    assert batch.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6 * scale)
    if weighting == "group":  # the weighting matters on this batch: the test can tell
        with torch.no_grad():
            plain = _loss(d, cfg, slice(None), d["logits"])
        assert abs(plain.item() - ref.item()) > 1e-3 * scale
    assert torch.allclose(x1.grad, x2.grad, rtol=1e-4, atol=1e-6 * float(x2.grad.abs().max()))


def _fused_vs_reference(d, cfg, w, fn):
    x1 = d["logits"].clone().requires_grad_()
    ref = _loss(d, cfg, slice(None), x1, w)
    ref.backward()
    loss, grad = fn(d, cfg, w)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(grad, x1.grad, rtol=1e-4, atol=2e-6)


def _chunked(d, cfg, w):
    x = d["logits"].clone().requires_grad_()
    loss, _ = fused_policy_loss(
        x,
        d["tgt"],
        d["old"],
        d["adv"],
        d["mask"],
        cfg,
        d["ref"],
        rollout_logprobs=d["roll"],
        seq_weights=w,
    )
    loss.backward()
    return loss, x.grad


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("agg", AGGS)
def test_chunked_fused_loss_with_group_weights(variant, agg):
    d = _batch(1)
    _fused_vs_reference(d, _cfg(variant, agg), sequence_weights(SIZES, "group"), _chunked)


@pytest.mark.parametrize("variant", VARIANTS)
def test_triton_fused_loss_with_group_weights(variant):
    d = _batch(2)
    cfg = _cfg(variant, "auto", backend="triton")
    _fused_vs_reference(d, cfg, sequence_weights(SIZES, "group"), _chunked)


@pytest.mark.parametrize("variant", ["dapo", "gspo"])
def test_fused_linear_loss_with_group_weights(variant):
    d = _batch(3)
    cfg = _cfg(variant, "auto")
    w = sequence_weights(SIZES, "group")
    x1 = d["logits"].clone().requires_grad_()
    ref = _loss(d, cfg, slice(None), x1, w)
    ref.backward()
    h = d["hidden"].clone().requires_grad_()
    loss, _ = fused_linear_policy_loss(
        h,
        d["weight"],
        d["tgt"],
        d["old"],
        d["adv"],
        d["mask"],
        cfg,
        d["ref"],
        rollout_logprobs=d["roll"],
        seq_weights=w,
        chunk_tokens=13,
    )
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(h.grad, x1.grad @ d["weight"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("weighting", ["sequence", "group"])
def test_micro_batches_scaled_by_aggregation_mass_equal_the_batch(agg, weighting):
    """What the trainer does: each micro-batch's own loss times mass_k / mass."""
    d = _batch(4)
    cfg = _cfg("grpo", agg)
    w = sequence_weights(SIZES, weighting)
    x1 = d["logits"].clone().requires_grad_()
    whole = _loss(d, cfg, slice(None), x1, w)
    whole.backward()
    x2 = d["logits"].clone().requires_grad_()
    ids = torch.arange(S).repeat_interleave(T)
    total = aggregation_mass(d["mask"], ids, S, agg, w)
    acc = torch.zeros(())
    for rows in (slice(0, 4), slice(4, 7), slice(7, S)):  # micro-batches cut through groups
        n = rows.stop - rows.start
        mids = torch.arange(n).repeat_interleave(T)
        mass = aggregation_mass(d["mask"][rows], mids, n, agg, w[rows])
        acc = acc + _loss(d, cfg, rows, x2, w[rows]) * (mass / total)
    acc.backward()
    assert acc.item() == pytest.approx(whole.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(x1.grad, x2.grad, rtol=1e-4, atol=1e-7)


def test_token_weights_reduce_to_unweighted_with_unit_weights():
    d = _batch(5)
    ids = torch.arange(S).repeat_interleave(T)
    for agg in AGGS:
        a = token_weights(d["mask"], ids, S, agg, max_tokens=T)
        b = token_weights(d["mask"], ids, S, agg, max_tokens=T, seq_weights=torch.ones(S))
        assert torch.allclose(a, b, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="entries"):
        token_weights(d["mask"], ids, S, "token_mean", seq_weights=torch.ones(3))
    with pytest.raises(ValueError, match="sequences"):
        token_weights(d["mask"].reshape(-1), None, 0, "token_mean", seq_weights=torch.ones(S))
