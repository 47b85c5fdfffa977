"""Advantages for groups of different sizes against the fixed-G function, group by group."""

from __future__ import annotations

import pytest
import torch

from megagrpo.algo.advantages import (
    flat_group_advantages,
    group_advantages,
    group_ids,
    ragged_group_advantages,
    sequence_weights,
)

SIZES = [8, 3, 1, 16, 2, 5, 4]


def _rewards(seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = [(torch.rand(n, generator=g) < 0.6).float() for n in SIZES]
    rows[4] = torch.ones(2)  # a collapsed group
    rows[5] = torch.rand(5, generator=g) * 2 - 0.5  # a real-valued (length-penalised) one
    return rows


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_sizes_equal_fixed_g(scale):
    r = (torch.rand(6, 8, generator=torch.Generator().manual_seed(1)) < 0.5).float()
    r[2] = 1.0
    ref = group_advantages(r, scale=scale)
    got = flat_group_advantages(r.reshape(-1), [8] * 6, scale=scale).reshape(6, 8)
    assert got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)  # fp32 rounding of values ~1
    assert torch.equal(got[2], torch.zeros(8))  # collapsed: exactly 0


@pytest.mark.parametrize("scale", ["group", "none"])
def test_ragged_equals_a_loop_over_groups(scale):
    rows = _rewards()
    got = ragged_group_advantages(rows, scale=scale)
    for row, adv in zip(rows, got):
        ref = torch.zeros(1) if len(row) == 1 else group_advantages(row[None], scale=scale)[0]
        assert torch.allclose(adv, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[2], torch.zeros(1)) and torch.equal(got[4], torch.zeros(2))


def test_ragged_batch_scale_uses_the_std_of_every_reward():
    rows = _rewards(2)
    got = ragged_group_advantages(rows, scale="batch", eps=1e-4)
    all_std = torch.cat(rows).std()
    for row, adv in zip(rows, got):
        if len(row) == 1:
            continue
        ref = group_advantages(row[None], scale="none")[0] / (all_std + 1e-4)
        assert torch.allclose(adv, ref, rtol=1e-6, atol=1e-6)


def test_pool_baseline_reinforce_ada():
    """Trained groups centred and scaled by the statistics of every generated completion."""
    trained = [torch.tensor([1.0, 1, 1, 0, 0, 0, 0, 0]), torch.tensor([1.0, 0, 1, 0])]
    pool_mean = torch.tensor([3 / 30, 0.5])
    pool_std = torch.tensor([0.3, 0.0])  # second pool: std 0 -> collapsed -> zeros
    got = ragged_group_advantages(
        trained, scale="group", baseline_mean=pool_mean, baseline_std=pool_std
    )
    assert torch.allclose(got[0], (trained[0] - 0.1) / (0.3 + 1e-4), rtol=1e-6)
    assert torch.equal(got[1], torch.zeros(4))
    none = ragged_group_advantages(
        trained, scale="none", baseline_mean=pool_mean, baseline_std=torch.tensor([0.3, 0.2])
    )
    assert torch.allclose(none[1], trained[1] - 0.5)
    with pytest.raises(ValueError, match="both"):
        ragged_group_advantages(trained, baseline_mean=pool_mean)


def test_errors_and_helpers():
    with pytest.raises(ValueError, match="sum to"):
        flat_group_advantages(torch.zeros(5), [2, 2])
    with pytest.raises(ValueError, match=">= 1"):
        flat_group_advantages(torch.zeros(2), [2, 0])
    with pytest.raises(ValueError, match="scale"):
        flat_group_advantages(torch.zeros(2), [2], scale="z")
    assert group_ids([2, 1, 3]).tolist() == [0, 0, 1, 2, 2, 2]
    assert ragged_group_advantages([]) == []
    w = sequence_weights([2, 1, 3], "group")
    assert torch.allclose(w, torch.tensor([1.0, 1.0, 2.0, 2 / 3, 2 / 3, 2 / 3]))
    assert w.sum().item() == pytest.approx(6.0)  # still sums to S
    assert torch.equal(sequence_weights([4, 4], "group"), torch.ones(8))
    assert torch.equal(sequence_weights([2, 5], "sequence"), torch.ones(7))
