"""Weight-sync verification logic (megagrpo.rollout.verify) on synthetic probes and tensors.

Closed-form cases: a sync that moves nothing scores change_error exactly 1; a sync that moves
as predicted up to noise sigma scores about sigma / rms(prediction); the engine/trainer
distance bounds are per dtype; additive checksums equal those of the concatenated tensors.
"""

from __future__ import annotations

import math

import pytest
import torch

from megagrpo.rollout import RolloutConfig, WeightSyncError
from megagrpo.rollout.verify import (
    DTYPE_DEFAULTS,
    SyncVerifier,
    Thresholds,
    WeightEvidence,
    add_stats,
    check_weights,
    judge_change,
    judge_probe,
    stats_close,
    tensor_stats,
    thresholds_for,
)

BF16 = DTYPE_DEFAULTS["bfloat16"]


def _probe(seed: int, n: int = 15, scale: float = 1.0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(n, generator=g, dtype=torch.float64)).tolist()


def _add(a: list[float], b: list[float], k: float = 1.0) -> list[float]:
    return [x + k * y for x, y in zip(a, b)]


def test_thresholds_are_dtype_aware_and_overridable():
    cfg = RolloutConfig()
    assert thresholds_for(cfg, torch.float32).max_tol == 1e-3
    assert thresholds_for(cfg, torch.bfloat16) == BF16
    # the loosest of engine and trainer dtypes
    assert thresholds_for(cfg, "float32", "bfloat16").change_floor == BF16.change_floor
    cfg = RolloutConfig(verify_tol=0.7, verify_change_floor=0.2)
    th = thresholds_for(cfg, torch.bfloat16)
    assert (th.max_tol, th.change_floor, th.mean_tol) == (0.7, 0.2, BF16.mean_tol)


def test_noop_scores_one_and_fails_in_bf16():
    """Nothing moved on the engine while the trainer predicts a change above the floor."""
    t0, e0 = _probe(0, scale=5), _probe(1, scale=5)
    delta = _probe(2, scale=1.0)  # rms ~1 > floor 0.5
    with pytest.raises(WeightSyncError, match="did not move as the trainer predicts"):
        judge_change(e0, t0, e0, _add(t0, delta), BF16, "t")


def test_real_change_with_bf16_noise_passes():
    """Observed = predicted + noise of rms 0.2 (the measured bf16 level): error ~0.2/rms."""
    t0, e0 = _probe(0, scale=5), _probe(1, scale=5)
    delta, noise = _probe(2, scale=1.0), _probe(3, scale=0.2)
    v = judge_change(e0, t0, _add(_add(e0, delta), noise), _add(t0, delta), BF16, "t")
    rms = math.sqrt(sum(x * x for x in delta) / len(delta))
    nrms = math.sqrt(sum(x * x for x in noise) / len(noise))
    assert v.conclusive and v.change_error == pytest.approx(nrms / rms, rel=1e-9)
    assert v.change_error < BF16.change_rtol


def test_small_prediction_is_inconclusive_then_cumulative():
    """Below the floor nothing is decided; the reference is kept, so repeated no-op syncs fail
    once the trainer's cumulative prediction crosses the floor."""
    th = Thresholds(max_tol=10.0, mean_tol=10.0, change_floor=0.5)
    engine0, trainer0 = _probe(0), _probe(1)
    ver = SyncVerifier(th, full_check_every=0, last_probe=engine0)
    step = _probe(2, scale=0.2)  # rms ~0.2 per sync
    trainer = trainer0
    v = ver.verify(engine0, _add(trainer, step), trainer0, "t")  # no-op, inconclusive
    assert not v.conclusive and v.predicted < 0.5 and ver.ref_trainer == trainer0
    trainer = _add(trainer, step)
    with pytest.raises(WeightSyncError, match="did not move"):
        for _ in range(5):  # cumulative prediction 0.4, 0.6 -> decided at the latest here
            trainer = _add(trainer, step)
            ver.verify(engine0, trainer, None, "t")


def test_real_small_syncs_accumulate_and_pass():
    th = Thresholds(max_tol=10.0, mean_tol=10.0, change_floor=0.5)
    engine, trainer = _probe(0), _probe(1)
    ver = SyncVerifier(th, full_check_every=0, last_probe=engine)
    before = trainer
    verdicts = []
    step = _probe(10, scale=0.15)  # a consistent drift, rms ~0.15 per sync
    for i in range(6):
        engine, trainer = _add(_add(engine, step), _probe(20 + i, scale=0.02)), _add(trainer, step)
        verdicts.append(ver.verify(engine, trainer, before if i == 0 else None, "t"))
    assert any(v.conclusive for v in verdicts) and not verdicts[0].conclusive


def test_distance_bounds_and_shape():
    assert judge_probe([0.0, -1.0], [-0.1, -1.0], BF16, "t") == pytest.approx((0.1, 0.05))
    with pytest.raises(WeightSyncError, match="verify_mean_tol"):
        judge_probe([0.0] * 4, [-0.5] * 4, BF16, "t")
    with pytest.raises(WeightSyncError, match="verify_tol"):
        judge_probe([0.0, float("nan")], [0.0, 0.0], BF16, "t")
    with pytest.raises(WeightSyncError, match="expected_probe has 1"):
        judge_probe([0.0, 1.0], [0.0], BF16, "t")


def test_probe_failure_advises_tolerances_only_when_the_weights_loaded():
    """Fails on cabf39c (its message told every failing probe to "raise the bounds
    knowingly"): without a full check the message says to find the tensors that stayed
    unchanged first and not to raise rollout.verify_tol; with one that found every tensor
    equal to the stream, it names that and the mismatch of implementations."""
    with pytest.raises(WeightSyncError) as unchecked:
        judge_probe([0.0] * 4, [-2.0] * 4, BF16, "t")
    msg = str(unchecked.value)
    assert "Do not raise rollout.verify_tol" in msg and "stayed unchanged" in msg
    assert "raise the bounds" not in msg
    # the sliced transport (the 2-node config's) never runs a full check, preflight's
    # start-up sync included: the message says how to get one there (76ad576 claimed
    # preflight's would, which it skips under sliced: trainer/sync.weight_update)
    assert "trainer.sync_transport=allreduce" in msg
    with pytest.raises(WeightSyncError) as checked:
        judge_probe([0.0] * 4, [-2.0] * 4, BF16, "t", loaded=49)
    msg = str(checked.value)
    assert "all 49 compared engine tensors equal to the stream" in msg
    assert "Do not raise" not in msg


def test_stats_are_additive_over_concatenation():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 8, generator=g).bfloat16() for n in (16, 4, 4))
    stats: dict = {}
    for t in (q, k, v):
        add_stats(stats, ("qkv", -1), tensor_stats(t))
    fused = tensor_stats(torch.cat([v, q, k])[torch.randperm(24, generator=g)])
    assert stats_close(stats[("qkv", -1)], fused, 1e-12)
    flipped = torch.cat([q, k, v]).clone()
    flipped[3, 2] = -flipped[3, 2] if flipped[3, 2] != 0 else 1.0
    assert not stats_close(stats[("qkv", -1)], tensor_stats(flipped), 1e-6)


def test_check_weights_coverage_values_and_noop():
    a = tensor_stats(torch.ones(4))
    b = tensor_stats(torch.full((4,), 2.0))
    keys = {("w", -1), ("e", 0), ("e", 1)}
    ok = WeightEvidence(keys, {("w", -1): a, ("e", 0): a, ("e", 1): b}, [])
    assert check_weights(ok, True, "t") == 0
    with pytest.raises(WeightSyncError, match=r"not streamed .*expert 1"):
        check_weights(WeightEvidence(keys, {("w", -1): a, ("e", 0): a}, []), True, "t")
    with pytest.raises(WeightSyncError, match="map to no engine parameter"):
        check_weights(WeightEvidence(keys, ok.streamed, ["decoy.w"]), True, "t")
    landed = dict(ok.streamed)
    ok.engine_values = dict(landed)
    ok.engine_before = {k: b for k in keys}
    assert check_weights(ok, True, "t") == 3
    ok.engine_values[("e", 1)] = a  # expert 1 kept its old values
    with pytest.raises(WeightSyncError, match=r"full check: 1 .*expert 1"):
        check_weights(ok, True, "t")
    same = WeightEvidence(keys, dict(landed), [], dict(landed), dict(landed))
    with pytest.raises(WeightSyncError, match="bit-identical"):
        check_weights(same, True, "t")
    assert check_weights(same, False, "t") == 3  # no change predicted: fine
    opaque = WeightEvidence(keys, dict(landed), [], {("w", -1): a}, {("w", -1): a})
    assert check_weights(opaque, True, "t") == 1  # unseen parameters may have moved
    with pytest.raises(WeightSyncError, match="exactly the tensors of the previous sync"):
        check_weights(opaque, True, "t", previous=dict(landed))
    assert check_weights(opaque, False, "t", previous=dict(landed)) == 1


def test_full_check_schedule():
    ver = SyncVerifier(BF16, full_check_every=3, last_probe=[0.0])
    due = []
    for _ in range(7):
        due.append(ver.full_check_due())
        ver.syncs += 1
    assert due == [True, False, True, False, False, True, False]
