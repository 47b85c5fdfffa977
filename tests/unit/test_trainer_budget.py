"""Groups of different sizes through the trainer: advantages, micro-batch weights (every
variant, aggregation and group weighting against a per-group reference), the placement's
split of mixed counts, and `grpo_step`s with ``budget.mode`` knapsack / sequential on the
bigram loop (verified syncs, resume)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megagrpo.algo.advantages import flat_group_advantages, group_advantages
from megagrpo.algo.config import LossConfig
from megagrpo.algo.losses import reference_policy_loss
from megagrpo.curriculum.budget_rounds import POOL_MEAN, POOL_SIZE, POOL_STD
from megagrpo.kernels import fused_policy_loss
from megagrpo.metrics import read_metrics
from megagrpo.placement.rollouts import round_counts, shard_bounds, shard_split
from megagrpo.trainer.batch import (
    BatchTotals,
    build_samples,
    micro_batches,
    microbatch_mass,
    microbatch_weight,
    padding_micro_batch,
)
from megagrpo.trainer.loop import compute_advantages
from megagrpo.trainer.optimize import group_seq_weights
from megagrpo.types import Group, Problem

SIZES = [3, 1, 5, 2]
VOCAB = 11


def _groups(sizes=SIZES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, size in enumerate(sizes):
        prompt = torch.randint(0, VOCAB, (2 + n % 3,), generator=gen).tolist()
        lens = torch.randint(1, 7, (size,), generator=gen).tolist()
        if n == 2:
            lens[1] = 0  # an empty completion (no loss token)
        toks = [torch.randint(0, VOCAB, (L,), generator=gen).tolist() for L in lens]
        lps = [(-torch.rand(L, generator=gen) - 0.5).tolist() for L in lens]
        rewards = (torch.rand(size, generator=gen) < 0.5).float().tolist()
        out.append(
            Group(
                problem=Problem(f"p{n}", [], ["a"]),
                completions=["x"] * size,
                token_ids=toks,
                logprobs=lps,
                prompt_ids=prompt,
                rewards=rewards,
            )
        )
    if sizes == SIZES:
        out[2].rewards = [1.0, 0.0, 1.0, 1.0, 0.0]  # the 5-group splits
    return out


def _loss(emb, mbs, cfg, totals):
    """Micro-batches weighted as the trainer weighs them; returns the accumulated loss."""
    total = torch.zeros((), dtype=torch.float64)
    agg = cfg.resolved_loss_agg()
    for mb in mbs:
        logits = emb[mb.input_ids.clamp(max=VOCAB)]
        loss, _ = fused_policy_loss(
            logits,
            mb.target_ids,
            mb.rollout_logprobs,
            mb.advantages,
            mb.mask,
            cfg,
            seq_weights=mb.seq_weights,
        )
        total = total + loss * microbatch_weight(mb, agg, totals)
    return total


def _per_group_reference(emb, groups, adv, cfg, weighting):
    """A loop over the groups calling the reference loss on each group alone, combined by
    the definitions: each group's loss times its aggregation mass (loss tokens, non-empty
    sequences or sequences), each sequence of group n counted (S / N) / G_n times under
    group weighting."""
    agg = cfg.resolved_loss_agg()
    s, n_groups = sum(g.size for g in groups), len(groups)
    losses, masses = [], []
    for group, a in zip(groups, adv):
        (mb,) = micro_batches(build_samples([group], [a]), 64, pad_id=VOCAB)
        logits = emb[mb.input_ids.clamp(max=VOCAB)]
        loss, _ = reference_policy_loss(
            logits, mb.target_ids, mb.rollout_logprobs, mb.advantages, mb.mask, cfg
        )
        if agg == "token_mean":
            k = float(mb.mask.sum())
        elif agg == "seq_mean_token_mean":
            k = float((mb.mask.sum(1) > 0).sum())
        else:
            k = float(group.size)
        w = (s / n_groups) / group.size if weighting == "group" else 1.0
        losses.append(loss)
        masses.append(k * w)
    mass = torch.tensor(masses, dtype=torch.float64)
    return (torch.stack(losses).double() * mass).sum() / mass.sum()


@pytest.mark.parametrize("weighting", ["sequence", "group"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("variant", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_micro_batches_of_ragged_groups_equal_the_per_group_reference(variant, agg, weighting):
    groups = _groups()
    adv = list(
        torch.split(flat_group_advantages([r for g in groups for r in g.rewards], SIZES), SIZES)
    )
    cfg = LossConfig(variant=variant, loss_agg=agg, backend="torch", max_tokens=6)
    if variant == "gspo":
        cfg.eps_low, cfg.eps_high = 0.01, 0.02
    weights = group_seq_weights(groups, weighting)
    assert (weights is None) == (weighting == "sequence")
    samples = build_samples(groups, adv, weights)
    torch.manual_seed(0)
    table = torch.randn(VOCAB + 1, VOCAB, dtype=torch.float64)
    # micro-batches of 2 cut through the groups; a padding micro-batch among them
    mbs = list(micro_batches(samples, 2, pad_id=VOCAB)) + [padding_micro_batch(3, VOCAB)]
    totals = BatchTotals(
        seqs=sum(mb.num_seqs for mb in mbs),
        nonempty=sum(mb.num_nonempty for mb in mbs),
        tokens=sum(mb.num_tokens for mb in mbs),
        mass=sum(microbatch_mass(mb, agg) for mb in mbs),
    )
    emb = table.clone().requires_grad_(True)
    got = _loss(emb, mbs, cfg, totals)
    got.backward()
    emb_ref = table.clone().requires_grad_(True)
    ref = _per_group_reference(emb_ref, groups, adv, cfg, weighting)
    ref.backward()
    assert emb.grad is not None and emb_ref.grad is not None
    scale = float(emb_ref.grad.abs().max())
    assert scale > 1e-3
    # fp32 inside the loss on O(1) values: a few float32 ulps per term
    assert got.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(emb.grad, emb_ref.grad, rtol=1e-5, atol=1e-6 * scale)
    if weighting == "group":  # the weighting changes this batch's loss: the test can tell
        plain = _per_group_reference(table, groups, adv, cfg, "sequence")
        assert abs(plain.item() - ref.item()) > 1e-4


def _ctx(baseline="group", scale="group", weight=1.0):
    cfg = SimpleNamespace(
        budget=SimpleNamespace(advantage_baseline=baseline),
        loss=SimpleNamespace(
            resolved_advantage_scale=lambda: scale,
            positive_weight=weight,
            advantage_estimator="grpo",
        ),
    )
    return SimpleNamespace(cfg=cfg)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_of_ragged_groups_and_the_pool_baseline(scale):
    groups = _groups()
    adv = compute_advantages(_ctx(scale=scale), groups)  # type: ignore[arg-type]
    assert [len(a) for a in adv] == SIZES
    every = torch.tensor([r for g in groups for r in g.rewards])
    for g, a in zip(groups, adv):  # group by group, the fixed-size reference
        if g.size < 2:
            assert (a == 0).all()
            continue
        want = group_advantages(torch.tensor([g.rewards]), scale=scale)[0]
        if scale == "batch":  # batch scale: this group's centred rewards / std of the batch
            r = torch.tensor(g.rewards)
            want = torch.where(r.std() < 1e-6, 0.0, (r - r.mean()) / (every.std() + 1e-4))
        torch.testing.assert_close(a, want, rtol=1e-6, atol=1e-6)
    # equal sizes: exactly group_advantages (the uniform path)
    same = _groups(sizes=[4, 4, 4])
    rows = compute_advantages(_ctx(scale=scale), same)  # type: ignore[arg-type]
    ref = group_advantages(torch.tensor([g.rewards for g in same]), scale=scale)
    assert torch.equal(torch.stack(rows), ref)
    # pool baseline (Reinforce-Ada): the pool's mean and std, where the step recorded them
    groups[0].meta.update({POOL_MEAN: 0.25, POOL_STD: 0.5, POOL_SIZE: 12})
    pooled = compute_advantages(_ctx("pool", scale), groups)  # type: ignore[arg-type]
    r0 = torch.tensor(groups[0].rewards)
    if scale == "group":
        torch.testing.assert_close(pooled[0], (r0 - 0.25) / (0.5 + 1e-4))
    elif scale == "none":
        torch.testing.assert_close(pooled[0], r0 - 0.25)
    torch.testing.assert_close(pooled[2], adv[2])  # no pool recorded: its own statistics
    assert compute_advantages(_ctx(), []) == []  # type: ignore[arg-type]


@pytest.mark.parametrize("sizes", [[4, 4, 4], SIZES])
@pytest.mark.parametrize("weight", [0.0, 0.1])
def test_positive_weight_scales_only_the_positive_advantages(sizes, weight):
    """loss.positive_weight (W-REINFORCE's lambda): right answers push weight times as hard,
    wrong ones pull as before; the same on the uniform and the ragged path."""
    groups = _groups(sizes=sizes)
    plain = compute_advantages(_ctx(), groups)  # type: ignore[arg-type]
    weighted = compute_advantages(_ctx(weight=weight), groups)  # type: ignore[arg-type]
    assert any((a > 0).any() for a in plain) and any((a < 0).any() for a in plain)
    for a, w in zip(plain, weighted):
        want = torch.tensor([x * weight if x > 0 else x for x in a.tolist()], dtype=a.dtype)
        torch.testing.assert_close(w, want, rtol=0, atol=0)


def test_mixed_counts_split_over_replicas_by_completions():
    assert round_counts([8, 8, 8], 3) == 8 and round_counts(4, 9) == 4
    assert round_counts([2, 8, 2], 3) == [2, 8, 2]
    with pytest.raises(ValueError, match="3 sample counts for 2"):
        round_counts([1, 2, 3], 2)
    for replicas in (1, 2, 3, 5):
        for num in (0, 1, 7, 12):
            assert [shard_split(4, num, replicas, r) for r in range(replicas)] == [
                shard_bounds(num, replicas, r) for r in range(replicas)
            ]
    gen = torch.Generator().manual_seed(1)
    for trial in range(200):
        num = int(torch.randint(1, 30, (1,), generator=gen))
        counts = torch.randint(1, 33, (num,), generator=gen).tolist()
        replicas = int(torch.randint(1, 5, (1,), generator=gen))
        bounds = [shard_split(counts, num, replicas, r) for r in range(replicas)]
        assert bounds[0][0] == 0 and bounds[-1][1] == num  # contiguous, in order, complete
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        shares = [sum(counts[lo:hi]) for lo, hi in bounds]
        assert max(shares) <= sum(counts) / replicas + max(counts), (trial, counts, bounds)


# ----------------------------------------------------------------------------- the bigram loop

from tests.unit.test_trainer_loop import _context, _train  # noqa: E402


@pytest.mark.parametrize(
    "budget",
    [
        {"mode": "knapsack", "min_samples": 2, "max_samples": 8},
        {
            "mode": "sequential",
            "round_samples": 2,
            "max_samples": 6,
            "advantage_baseline": "pool",
        },
    ],
)
def test_budgeted_steps_train_and_verify_every_sync(bigram_dir, tmp_path, budget):
    ctx = _context(
        bigram_dir,
        tmp_path,
        "b",
        rollout={"max_tokens": 3, "probe_len": 8},
        budget=budget,
        dynamic={"max_resample": 2, "policy": "carry"},
        loss={"backend": "torch", "group_weighting": "group"},
    )
    engine = ctx.rollouts.engine
    rows = _train(ctx)
    trained = [r for r in rows if r["train/skipped_empty_batch"] == 0.0]
    assert trained
    assert all(r["sync/verified_engines"] == 1.0 for r in trained)
    assert any(r["sync/change_verified"] == 1.0 for r in trained)
    torch.testing.assert_close(engine.weight, ctx.policy.weight().detach(), rtol=0, atol=0)
    for r in rows:
        assert r["budget/completions"] == r["budget/generated_completions"] > 0
        assert 0 < r["budget/effective_ratio"] <= 1.0
        assert r["budget/effective_completions"] <= 4 * r["dynamic/trained_groups"]
        assert r["dynamic/gen_batches"] <= 3
    saved = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in saved] == [1, 2, 3, 4]


def test_budgeted_run_resumes_like_the_uninterrupted_one(bigram_dir, tmp_path):
    sections = {
        "rollout": {"max_tokens": 3, "probe_len": 8},
        "budget": {"mode": "knapsack", "max_samples": 8},
        "dynamic": {"max_resample": 1, "policy": "carry"},
    }
    full = _train(_context(bigram_dir, tmp_path, "full", **sections))
    _train(_context(bigram_dir, tmp_path, "part", trainer={"max_steps": 2}, **sections))
    resumed = _context(bigram_dir, tmp_path, "part", resume=True, **sections)
    assert resumed.step == 2
    rest = _train(resumed)
    for a, b in zip(full[2:], rest, strict=True):
        for key, value in a.items():
            if key.startswith("perf/") or key == "sync/engine_s":
                continue
            assert b[key] == value or (value != value and b[key] != b[key]), key


def test_runs_with_a_levels_file_log_the_predicted_acr_per_level(bigram_dir, tmp_path):
    """The first round's predicted raw ACR per profile level sits next to the measured one:
    a level is predicted exactly when some of its problems were drawn."""
    import json

    from megagrpo.testing import tiny_run_config

    train = tiny_run_config(bigram_dir, tmp_path, "x")["data"]["train"][0]
    ids = [json.loads(line)["id"] for line in open(train, encoding="utf-8")]
    levels = tmp_path / "levels.jsonl"
    levels.write_text(
        "".join(
            json.dumps({"id": pid, "k": 5, "correct": i % 6}) + "\n" for i, pid in enumerate(ids)
        )
    )
    ctx = _context(
        bigram_dir,
        tmp_path,
        "lv",
        curriculum={"levels_file": str(levels), "keep_levels": [1, 2, 3, 4, 5, 6]},
        rollout={"max_tokens": 3, "probe_len": 8},
        budget={"mode": "knapsack", "max_samples": 8},
        dynamic={"max_resample": 1, "policy": "carry", "preflight": "off"},
    )
    rows = _train(ctx)
    for r in rows:
        for lv in range(1, 7):
            predicted = r[f"collapse/acr_predicted_by_level/L{lv}"]
            drawn = r[f"collapse/groups_by_level/L{lv}"] > 0
            assert drawn == (predicted == predicted), (r["step"], lv)  # NaN when not drawn
            if drawn:
                assert 0.0 < predicted < 1.0
        assert 0.0 < r["collapse/acr_predicted_step"] < 1.0
