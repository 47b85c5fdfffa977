"""Trainer pieces without a model: micro-batching, gradient accumulation, checkpoints,
config validation, seeds, the toy reward."""

from __future__ import annotations

import json

import pytest
import torch

from megagrpo.algo.config import LossConfig
from megagrpo.checkpoint import format as checkpoint
from megagrpo.checkpoint import plain as plain_state
from megagrpo.errors import CheckpointError, ConfigError
from megagrpo.kernels import fused_policy_loss
from megagrpo.placement.rollouts import round_seed
from megagrpo.trainer.batch import (
    BatchTotals,
    build_samples,
    micro_batches,
    microbatch_weight,
    padding_micro_batch,
)
from megagrpo.trainer.config import TrainerConfig
from megagrpo.types import Group, Problem


def _groups(lengths=((3, 5), (1, 4)), prompt_lens=(4, 2), vocab=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, (lens, p) in enumerate(zip(lengths, prompt_lens)):
        prompt = torch.randint(0, vocab, (p,), generator=gen).tolist()
        toks = [torch.randint(0, vocab, (L,), generator=gen).tolist() for L in lens]
        lps = [(-torch.rand(L, generator=gen) - 0.5).tolist() for L in lens]
        out.append(
            Group(
                problem=Problem(f"p{n}", [], ["a"]),
                completions=["x"] * len(lens),
                token_ids=toks,
                logprobs=lps,
                prompt_ids=prompt,
            )
        )
    return out


def test_samples_align_targets_mask_and_rollout_logprobs():
    groups = _groups()
    adv = torch.tensor([[1.0, -1.0], [0.5, -0.5]])
    mbs = list(micro_batches(build_samples(groups, adv), micro_batch_size=8, pad_id=99))
    assert len(mbs) == 1
    mb = mbs[0]
    assert mb.num_seqs == 4 and mb.num_tokens == 3 + 5 + 1 + 4
    for row, idx in enumerate(mb.indices):
        g, k = divmod(idx, 2)
        prompt, comp = groups[g].prompt_ids, groups[g].token_ids[k]
        full = prompt + comp
        p, L = len(prompt), len(full)
        assert mb.input_ids[row, :L].tolist() == full
        assert (mb.input_ids[row, L:] == 99).all()
        # position t predicts token t + 1; the loss covers exactly the completion tokens
        assert mb.target_ids[row, p - 1 : L - 1].tolist() == comp
        assert mb.mask[row].nonzero().flatten().tolist() == list(range(p - 1, L - 1))
        assert torch.allclose(
            mb.rollout_logprobs[row, p - 1 : L - 1], torch.tensor(groups[g].logprobs[k])
        )
        assert (mb.advantages[row, p - 1 : L - 1] == adv[g, k]).all()


def test_micro_batches_bound_size_and_pad_to_multiple():
    groups = _groups(lengths=((1, 2, 3, 4, 5),), prompt_lens=(3,))
    mbs = list(micro_batches(build_samples(groups, torch.zeros(1, 5)), 2, pad_to_multiple=4))
    assert [mb.num_seqs for mb in mbs] == [2, 2, 1]
    assert all(mb.input_ids.shape[1] % 4 == 0 for mb in mbs)
    assert sorted(i for mb in mbs for i in mb.indices) == list(range(5))


@pytest.mark.parametrize("variant", ["grpo", "dapo", "dr_grpo", "gspo"])
@pytest.mark.parametrize(
    "agg", ["auto", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
def test_micro_batched_loss_equals_whole_batch(variant, agg):
    """Micro-batches of 1 sequence (an empty completion and a padding micro-batch among them),
    weighted, give the whole-batch loss and its gradient, for every variant and aggregation
    (the Dr.GRPO normaliser is the fixed generation budget, as RunConfig.resolve sets it)."""
    vocab = 11
    groups = _groups(lengths=((3, 5, 0), (1, 4, 6)), prompt_lens=(4, 2), vocab=vocab)
    adv = torch.tensor([[1.0, -0.3, -0.7], [0.5, 0.2, -0.7]])
    cfg = LossConfig(variant=variant, loss_agg=agg, backend="torch")
    if cfg.resolved_loss_agg() == "seq_mean_token_sum_norm":
        cfg.max_tokens = 6
    samples = build_samples(groups, adv)
    torch.manual_seed(0)
    table = torch.randn(vocab + 1, vocab, dtype=torch.float64)

    def loss_and_grad(mbs):
        emb = table.clone().requires_grad_(True)
        totals = BatchTotals(
            seqs=sum(mb.num_seqs for mb in mbs),
            nonempty=sum(mb.num_nonempty for mb in mbs),
            tokens=sum(mb.num_tokens for mb in mbs),
        )
        total = 0.0
        for mb in mbs:
            logits = emb[mb.input_ids.clamp(max=vocab)]
            loss, _ = fused_policy_loss(
                logits, mb.target_ids, mb.rollout_logprobs, mb.advantages, mb.mask, cfg
            )
            weighted = loss * microbatch_weight(mb, cfg.resolved_loss_agg(), totals)
            weighted.backward()
            total += float(weighted.detach())
        assert emb.grad is not None
        return total, emb.grad

    whole_loss, whole = loss_and_grad(list(micro_batches(samples, 64, pad_id=vocab)))
    one_by_one = list(micro_batches(samples, 1, pad_id=vocab)) + [padding_micro_batch(3, vocab)]
    acc_loss, accumulated = loss_and_grad(one_by_one)
    assert whole.abs().max() > 1e-3
    # fp32 inside the loss on O(1) values: a few ulps of float32 per term
    assert acc_loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(accumulated, whole, rtol=1e-5, atol=1e-6)


def test_padding_micro_batch_contributes_exactly_zero():
    cfg = LossConfig(variant="gspo", backend="torch")
    mb = padding_micro_batch(4, pad_id=0)
    emb = torch.randn(3, 5).requires_grad_(True)
    loss, _ = fused_policy_loss(
        emb[mb.input_ids], mb.target_ids, mb.rollout_logprobs, mb.advantages, mb.mask, cfg
    )
    loss.backward()
    assert float(loss.detach()) == 0.0 and emb.grad is not None and not emb.grad.any()
    assert mb.num_seqs == mb.num_nonempty == mb.num_tokens == 0


def _save(root, step, rank=0, world=1, meta=None, keep=2):
    return checkpoint.save(
        root,
        step,
        rank=rank,
        world_size=world,
        rank_state={"lora": {"w": torch.full((2,), float(step))}},
        trainer_state={"counters": {"s": step}},
        meta=meta or {"tp": 1},
        keep=keep,
    )


def test_checkpoint_roundtrip_prune_and_rng(tmp_path):
    torch.manual_seed(123)
    _save(tmp_path, 1)
    expected = torch.rand(3)  # what the RNG gives right after the save
    for step in (2, 3):
        _save(tmp_path, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003"]
    assert checkpoint.latest(tmp_path).name == "step_000003"
    rank_state, trainer_state = checkpoint.load(
        tmp_path / "step_000003", rank=0, world_size=1, meta={"tp": 1}
    )
    assert rank_state["lora"]["w"].tolist() == [3.0, 3.0]
    assert trainer_state == {"step": 3, "counters": {"s": 3}}
    # RNG restore: reload step 1's state (re-saved here) and draw the same numbers
    torch.manual_seed(123)
    _save(tmp_path / "again", 1)
    rs, _ = checkpoint.load(
        tmp_path / "again" / "step_000001", rank=0, world_size=1, meta={"tp": 1}
    )
    torch.rand(10)
    plain_state.set_rng_state(rs["rng"])
    assert torch.equal(torch.rand(3), expected)


def test_incomplete_checkpoint_is_ignored_and_layout_mismatch_refused(tmp_path):
    _save(tmp_path, 4)
    tmp = tmp_path / "step_000006.tmp"  # a save killed half-way
    tmp.mkdir()
    (tmp / "rank00000.pt").write_bytes(b"partial")
    half = tmp_path / "step_000008"  # renamed but without meta.json cannot happen; still ignored
    half.mkdir()
    assert checkpoint.latest(tmp_path).name == "step_000004"
    with pytest.raises(CheckpointError, match="processes"):
        checkpoint.load(tmp_path / "step_000004", rank=0, world_size=2, meta={"tp": 1})
    with pytest.raises(CheckpointError, match="'tp'"):
        checkpoint.load(tmp_path / "step_000004", rank=0, world_size=1, meta={"tp": 2})
    with pytest.raises(CheckpointError, match="meta.json"):
        checkpoint.load(half, rank=0, world_size=1, meta={})
    assert json.loads((tmp_path / "step_000004" / "meta.json").read_text())["step"] == 4


def test_trainer_config_validation_names_the_key():
    TrainerConfig().validate()
    with pytest.raises(ConfigError, match="trainer.micro_batch_size"):
        TrainerConfig(micro_batch_size=0).validate()
    with pytest.raises(ConfigError, match="trainer.old_logprobs"):
        TrainerConfig(ppo_epochs=2, old_logprobs="rollout").validate()
    assert TrainerConfig(ppo_epochs=2).resolved_old_logprobs() == "recompute"
    assert TrainerConfig(old_logprobs="auto").resolved_old_logprobs(False) == "recompute"
    assert TrainerConfig(old_logprobs="auto").resolved_old_logprobs() == "rollout"
    assert TrainerConfig().resolved_old_logprobs() == "recompute"


def test_round_seed_is_deterministic_and_distinct():
    seeds = {round_seed(0, s, r) for s in range(1, 50) for r in range(4)}
    assert len(seeds) == 49 * 4
    assert round_seed(3, 7, 1) == round_seed(3, 7, 1) != round_seed(4, 7, 1)


def test_toy_reward_and_bundled_demo_problems(repo_root):
    from megagrpo.data import load_problems
    from megagrpo.rewards import get

    fn = get("toy_first_token", modulus=4, residue=0)
    assert fn(["a", "b", "c"], None, token_ids=[[8, 1], [5], []]) == [1.0, 0.0, 0.0]
    train = load_problems([repo_root / "megagrpo/assets/demo_train.jsonl"])
    evals = load_problems([repo_root / "megagrpo/assets/demo_eval.jsonl"])
    assert len(train) >= 48 and len(evals) >= 8
    assert not {p.id for p in train} & {p.id for p in evals}
    reward = get("mcq_accuracy")
    for p in train[:10]:
        assert len(p.meta["choices"]) == 4 and p.answer[0] in "abcd"
        assert reward([f"Answer: {p.answer[0]}", "Answer: z"], p) == [1.0, 0.0]


def test_unknown_model_path_is_a_config_error(tmp_path):
    from megagrpo.model.pretrained import resolve_model_path

    with pytest.raises(ConfigError, match="model.hf_path"):
        resolve_model_path(str(tmp_path / "nope"))


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_schedule_warms_up_then_decays_to_min_lr(schedule):
    from megagrpo.trainer.setup import lr_scheduler

    tcfg = TrainerConfig(lr=1.0, max_steps=10, warmup_ratio=0.2, lr_schedule=schedule, min_lr=0.1)
    assert tcfg.num_warmup_steps == 2
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = lr_scheduler(opt, tcfg)
    assert sched is not None
    lrs = []
    for _ in range(11):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[1] < lrs[2] == pytest.approx(1.0)  # linear warm-up over 2 steps
    tail = lrs[2:]
    if schedule == "constant":
        assert tail == pytest.approx([1.0] * 9)
    else:  # monotone decay that ends at min_lr after max_steps optimiser steps
        assert all(a >= b for a, b in zip(tail, tail[1:])) and lrs[10] == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("setting", "serves", "mode"),
    [("auto", True, "adapter"), ("auto", False, "merged"), ("merged", True, "merged")],
)
def test_weight_sync_auto_prefers_the_exact_adapter_sync(setting, serves, mode):
    from types import SimpleNamespace

    from megagrpo.trainer.sync import sync_mode

    ctx = SimpleNamespace(
        cfg=SimpleNamespace(trainer=TrainerConfig(weight_sync=setting)),
        rollouts=SimpleNamespace(supports_adapter_sync=serves),
    )
    assert sync_mode(ctx) == mode  # type: ignore[arg-type]


def test_low_precision_turns_on_truncated_importance_sampling():
    from megagrpo.config import load_config
    from megagrpo.trainer.config import RunConfig

    assert load_config(RunConfig).loss.tis_cap == 0.0
    bf16 = load_config(RunConfig, [], ["model.dtype=bfloat16"])
    assert bf16.loss.tis_cap == 2.0 and bf16.rollout.verify_tol == 1.5
    off = load_config(RunConfig, [], ["model.dtype=bfloat16", "loss.tis_auto=false"])
    assert off.loss.tis_cap == 0.0


def test_a_context_without_started_engines_says_so_on_use():
    """Until start_rollouts, ctx.rollouts is no stand-in placement that generates nothing:
    any use raises, naming what has not started."""
    from pathlib import Path
    from types import SimpleNamespace

    from megagrpo.config import load_config
    from megagrpo.parallel.comm import Comm
    from megagrpo.trainer.config import RunConfig
    from megagrpo.trainer.context import TrainContext

    ctx = TrainContext(
        cfg=load_config(RunConfig),
        comm=Comm(),
        pgs=SimpleNamespace(device=torch.device("cpu")),  # type: ignore[arg-type]
        run_dir=Path("."),
        policy=None,  # type: ignore[arg-type]
        optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0),
        scheduler=None,
        sampler=None,  # type: ignore[arg-type]
        dynamic=None,  # type: ignore[arg-type]
        reward_fn=None,  # type: ignore[arg-type]
    )
    with pytest.raises(RuntimeError, match="rollout engines have not started"):
        ctx.rollouts.generate_round([], [], 0)
