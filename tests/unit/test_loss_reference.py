"""Reference losses and advantages (megagrpo.algo) against closed forms and torch autograd."""

from __future__ import annotations

import math

import pytest
import torch

from megagrpo.algo.advantages import group_advantages
from megagrpo.algo.config import LossConfig
from megagrpo.algo.losses import (
    clipped_surrogate,
    k3_kl,
    policy_loss,
    reference_policy_loss,
    token_entropy,
    token_logprobs,
    token_weights,
)
from megagrpo.errors import ConfigError


def test_group_advantages_closed_form():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    std0 = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    a = group_advantages(r, "group", eps=0.0)
    assert torch.allclose(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std0)
    assert torch.equal(a[1], torch.zeros(4))  # collapsed: exactly zero
    std2 = math.sqrt(((3 * 0.25**2) + 0.75**2) / 3)
    assert torch.allclose(a[2], torch.tensor([-0.25, -0.25, -0.25, 0.75]) / std2)
    none = group_advantages(r, "none")
    assert torch.allclose(none[2], torch.tensor([-0.25, -0.25, -0.25, 0.75]))
    batch = group_advantages(r, "batch", eps=0.0)
    assert torch.allclose(batch[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / r.std())
    assert torch.equal(batch[1], torch.zeros(4))


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.zeros(3, 1)])
def test_group_advantages_rejects_bad_shapes(bad):
    with pytest.raises(ValueError):
        group_advantages(bad)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(2, 2), "std")


def test_loss_config_validate_and_defaults():
    cfg = LossConfig()
    cfg.validate("loss")
    assert LossConfig(variant="dapo").resolved_loss_agg() == "token_mean"
    assert LossConfig(variant="dr_grpo").resolved_loss_agg() == "seq_mean_token_sum_norm"
    assert LossConfig(variant="dr_grpo").resolved_advantage_scale() == "none"
    assert LossConfig(variant="grpo", loss_agg="token_mean").resolved_loss_agg() == "token_mean"
    with pytest.raises(ConfigError, match="loss.variant"):
        LossConfig(variant="ppo").validate("loss")
    with pytest.raises(ConfigError, match="loss.tis_cap"):
        LossConfig(tis_cap=0.5).validate("loss")


def test_logprobs_entropy_kl_closed_form():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # p = (1/4, 3/4)
    assert torch.allclose(token_logprobs(logits, torch.tensor([1])), torch.tensor([math.log(0.75)]))
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert torch.allclose(token_entropy(logits), torch.tensor([h]))
    # k3 = exp(r) - r - 1 with r = ref - logp
    assert torch.allclose(
        k3_kl(torch.tensor([-1.0]), torch.tensor([-0.5])), torch.tensor([math.exp(0.5) - 1.5])
    )


def test_asymmetric_clip_closed_form():
    logp = torch.log(torch.tensor([1.25, 1.25, 0.85, 0.85, 0.7]))
    old = torch.zeros(5)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    pg, clipped, ratio = clipped_surrogate(logp, old, adv, eps_low=0.1, eps_high=0.28)
    # A>0, r=1.25 <= 1.28: unclipped; A<0, r=1.25: -A r = 1.25 > -A*1.25; A<0, r=0.85 < 0.9:
    # clamp wins (0.9 > 0.85); A>0, r=0.85: min(r, clip) side takes the ratio itself.
    assert torch.allclose(pg, torch.tensor([-1.25, 1.25, 0.9, -0.85, -0.7]))
    assert clipped.tolist() == [False, False, True, False, False]
    pg2, clipped2, _ = clipped_surrogate(logp, old, adv, eps_low=0.1, eps_high=0.2)
    assert torch.allclose(pg2[0], torch.tensor(-1.2)) and bool(clipped2[0])


def test_token_weights_aggregations():
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    ids = torch.tensor([0, 0, 0, 1, 1, 2])
    assert torch.allclose(token_weights(mask, ids, 3, "token_mean"), mask / 3)
    seq = token_weights(mask, ids, 3, "seq_mean_token_mean")  # 2 non-empty sequences
    assert torch.allclose(seq, torch.tensor([0.25, 0.25, 0.0, 0.5, 0.0, 0.0]))
    dr = token_weights(mask, ids, 3, "seq_mean_token_sum_norm", max_tokens=10)
    assert torch.allclose(dr, mask / 30)
    with pytest.raises(ValueError, match="seq_ids"):
        token_weights(mask, None, 0, "seq_mean_token_mean")


def test_policy_loss_values_by_variant():
    # Two sequences of 2 tokens, on-policy (ratio 1): pg_t = -A_t.
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.2, 0.4]]))
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    grpo, m = policy_loss(logp, None, adv, mask, LossConfig(variant="grpo"))
    assert torch.allclose(grpo, torch.tensor((-1.0 + 2.0) / 2))
    dapo, _ = policy_loss(logp, None, adv, mask, LossConfig(variant="dapo"))
    assert torch.allclose(dapo, torch.tensor((-1.0 - 1.0 + 2.0) / 3))
    dr, _ = policy_loss(logp, None, adv, mask, LossConfig(variant="dr_grpo", max_tokens=4))
    assert torch.allclose(dr, torch.tensor((-2.0 + 2.0) / (2 * 4)))
    assert float(m["loss/ratio_mean"]) == pytest.approx(1.0)
    assert float(m["loss/clip_frac"]) == 0.0


def test_gspo_uses_length_normalised_sequence_ratio():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.9, -3.3]])
    adv = torch.ones(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    cfg = LossConfig(variant="gspo", eps_low=0.5, eps_high=0.5)
    loss, m = policy_loss(logp, old, adv, mask, cfg)
    s = math.exp((0.2 - 0.1) / 2)
    assert float(loss.detach()) == pytest.approx(-s)
    loss.backward()  # d(-s)/dlogp_t = -s * m_t / n
    assert torch.allclose(logp.grad, torch.tensor([[-s / 2, -s / 2, 0.0]]))
    assert float(m["loss/ratio_mean"]) == pytest.approx(s)


def test_tis_weights_truncate_and_scale_loss():
    logp = torch.zeros(3)
    rollout = torch.tensor([-1.0, 0.0, 0.5])  # pi_old/pi_rollout = e, 1, e^-0.5
    cfg = LossConfig(variant="dapo", tis_cap=2.0)
    loss, m = policy_loss(
        logp, torch.zeros(3), torch.ones(3), torch.ones(3), cfg, rollout_logprobs=rollout
    )
    w = torch.tensor([2.0, 1.0, math.exp(-0.5)])
    assert float(loss) == pytest.approx(float(-w.mean()))
    assert float(m["loss/tis_clip_frac"]) == pytest.approx(1 / 3)


def test_missing_inputs_raise():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(x, None, x, x + 1, LossConfig(kl_coef=0.1, variant="dapo"))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(x, None, x, x + 1, LossConfig(tis_cap=2.0, variant="dapo"))
    with pytest.raises(ValueError, match="GSPO"):
        policy_loss(x, None, x, x + 1, LossConfig(variant="gspo"))


@pytest.mark.parametrize("variant", ["grpo", "dapo", "dr_grpo", "gspo", "sapo"])
def test_reference_gradcheck(variant):
    torch.manual_seed(0)
    B, S, V = 2, 3, 5
    logits = torch.randn(B, S, V, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, V, (B, S))
    old = torch.randn(B, S, dtype=torch.float64) * 0.3 - 1.5
    ref = torch.randn(B, S, dtype=torch.float64) * 0.3 - 1.5
    adv = torch.randn(B, S, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    cfg = LossConfig(variant=variant, eps_low=0.9, eps_high=5.0, kl_coef=0.1, entropy_coef=0.05)

    def f(x):
        return reference_policy_loss(x, tgt, old, adv, mask, cfg, ref_logprobs=ref)[0]

    assert torch.autograd.gradcheck(f, (logits,), eps=1e-6, atol=1e-6)
