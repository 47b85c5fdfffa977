"""ms-swift/TRL metric aliases, the completions log, TensorBoard, and the report's plots
(issues 12.3 and 12.7)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megagrpo.metrics import CompletionsLog, TensorBoardLogger, swift_aliases
from megagrpo.metrics.report import figure_collapse, figure_kl_entropy, figure_reward, make_report
from megagrpo.types import Group, Problem


def _groups(rng: np.random.Generator) -> list[Group]:
    groups = []
    for j in range(3):
        p = Problem(
            f"112A{j}",
            [{"role": "user", "content": f"問題{j}\na. x\nb. y"}],
            ["b"],
            {"level": j + 2},
        )
        rewards = rng.integers(0, 2, size=4).astype(float).tolist()
        groups.append(
            Group(
                problem=p,
                completions=[f"答え: {'ab'[int(r)]}" for r in rewards],
                token_ids=[[1] * (5 + i) for i in range(4)],
                logprobs=[[]] * 4,
                rewards=[r + 0.1 for r in rewards],
                finish_reasons=["stop", "stop", "length", "stop"],
                reward_parts={"mcq_accuracy": rewards, "soft_overlong": [0.1] * 4},
            )
        )
    return groups


def test_swift_aliases_match_trl_definitions():
    """TRL logs reward_std as torch's (unbiased) std of the batch's rewards; megagrpo logs
    numpy's population std: the alias rescales it exactly."""
    groups = _groups(np.random.default_rng(0))
    rewards = [r for g in groups for r in g.rewards]
    acc = [v for g in groups for v in g.reward_parts["mcq_accuracy"]]
    row = {
        "reward/mean": float(np.mean(rewards)),
        "reward/std": float(np.std(rewards)),
        "reward/mcq_accuracy/mean": float(np.mean(acc)),
        "reward/mcq_accuracy/std": float(np.std(acc)),
        "collapse/frac_reward_zero_std": 0.25,
        "length/mean": 7.5,
        "length/max": 9.0,
        "length/clip_ratio": 0.25,
        "loss/kl": 0.01,
        "loss/entropy": 1.5,
        "loss/clip_frac": 0.2,
        "loss/clip_frac_low": 0.05,
        "loss/clip_frac_high": 0.15,
        "train/lr": 1e-4,
        "collapse/acr_predicted": None,
    }
    out = swift_aliases(row, ["mcq_accuracy", "soft_overlong"], len(rewards), "batch")
    assert out["reward"] == row["reward/mean"]
    assert out["reward_std"] == pytest.approx(
        torch.tensor(rewards, dtype=torch.float64).std().item(), rel=1e-12
    )
    assert out["rewards/mcq_accuracy/std"] == pytest.approx(
        torch.tensor(acc, dtype=torch.float64).std().item()
    )
    assert out["rewards/mcq_accuracy/mean"] == row["reward/mcq_accuracy/mean"]
    assert out["frac_reward_zero_std"] == 0.25 and out["kl"] == 0.01 and out["entropy"] == 1.5
    assert out["clip_ratio/low_mean"] == 0.05 and out["clip_ratio/high_mean"] == 0.15
    assert out["clip_ratio/region_mean"] == 0.2 and out["learning_rate"] == 1e-4
    assert out["completions/mean_length"] == 7.5 and out["completions/max_length"] == 9.0
    assert "completions/min_length" not in out  # not measured: not invented
    assert "rewards/soft_overlong/mean" not in out
    assert swift_aliases(row, [], advantage_scale="batch")["reward_std"] == row["reward/std"]
    assert "reward_std" not in swift_aliases(row, [])  # group scale: needs group_std_mean


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_reward_std_is_ms_swifts(scale):
    """ms-swift's reward_std (rl_core/advantage.py compute_reward_metrics) is the mean of the
    groups' stds with scale_rewards group/none, not the batch std megagrpo logged under it
    (0.354 vs 0.25 on the review's batch; on an all-collapsed batch ms-swift logs 0)."""
    from swift_source import swift_advantage

    compute_reward_metrics = swift_advantage("compute_reward_metrics")

    from megagrpo.metrics.names import group_std_mean

    for groups in (
        [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]],
        [[1.0] * 4, [0.0] * 4, [1.0] * 4],  # every group collapsed
        _groups_rewards(np.random.default_rng(3)),
    ):
        flat = [r for g in groups for r in g]
        t = torch.tensor(flat, dtype=torch.float64)
        want = compute_reward_metrics(t, t[:, None], ["r"], len(groups[0]), scale)
        row = {
            "reward/std": float(np.std(flat)),
            "reward/group_std_mean": group_std_mean(groups),
        }
        got = swift_aliases(row, [], len(flat), scale)["reward_std"]
        assert got == pytest.approx(want.reward_std, rel=1e-9, abs=1e-12), (scale, groups)


def _groups_rewards(rng: np.random.Generator) -> list[list[float]]:
    return [rng.normal(size=8).round(3).tolist() for _ in range(5)]


def test_entropy_mean_and_clip_extremes_are_ms_swifts():
    """entropy/mean: mean over completions of each completion's mean token entropy
    (ms-swift grpo_trainer.py: nanmean over tokens, then over completions);
    clip_ratio/low_min, high_max: extremes over micro-batches, combined by
    megagrpo.trainer.optimize.combine_metrics."""
    from megagrpo.algo.config import LossConfig
    from megagrpo.algo.losses import policy_loss
    from megagrpo.trainer.optimize import combine_metrics

    gen = torch.Generator().manual_seed(0)
    b, s = 5, 9
    mask = (torch.rand(b, s, generator=gen) > 0.4).float()
    mask[2] = 0.0  # an empty completion: no mean (NaN in ms-swift, skipped)
    ent = torch.rand(b, s, generator=gen) * 3
    old = -torch.rand(b, s, generator=gen)
    logp = old + 0.5 * torch.randn(b, s, generator=gen)
    adv = torch.randn(b, 1, generator=gen).expand(b, s)
    cfg = LossConfig(eps_low=0.1, eps_high=0.1)
    _, m = policy_loss(logp, old, adv, mask, cfg, entropy=ent)
    nan_ent = ent.masked_fill(mask == 0, float("nan"))
    want = torch.nanmean(torch.nanmean(nan_ent, dim=1))
    got = float(m["loss/entropy_seq_sum"]) / float(m["loss/nonempty_seqs_sum"])
    assert got == pytest.approx(float(want), rel=1e-6)
    acc: dict[str, float] = {}
    parts = []
    for rows in ([0, 1], [2, 3, 4]):
        _, mb = policy_loss(logp[rows], old[rows], adv[rows], mask[rows], cfg, entropy=ent[rows])
        parts.append(mb)
        combine_metrics(acc, {k: float(v) for k, v in mb.items()})
    lows = [float(p["loss/clip_frac_low"]) for p in parts]
    highs = [float(p["loss/clip_frac_high"]) for p in parts]
    assert acc["loss/clip_frac_low_min"] == min(lows) and acc["loss/clip_frac_high_max"] == max(
        highs
    )
    assert max(highs) > 0 and min(lows) < max(lows)
    combined = acc["loss/entropy_seq_sum"] / acc["loss/nonempty_seqs_sum"]
    assert combined == pytest.approx(float(want), rel=1e-6)


def test_completions_log_rows_resume_and_wandb_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from megagrpo.metrics import MultiLogger, NullLogger, WandbLogger, find_wandb_run
    from megagrpo.metrics.config import MetricsConfig

    wb = WandbLogger(MetricsConfig(), tmp_path, "t")
    run = find_wandb_run(MultiLogger([NullLogger(), wb]))
    assert run is wb.run and find_wandb_run(NullLogger()) is None
    log = CompletionsLog(
        tmp_path / "completions.jsonl", table_every=2, wandb_run=run, prompt_chars=4
    )
    groups = _groups(np.random.default_rng(1))
    for step in (1, 2, 3):
        assert log.log(step, groups, levels={"112A0": 5}.get) == 12
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 36 and {r["step"] for r in rows} == {1, 2, 3}
    first = rows[0]
    assert first["problem_id"] == "112A0" and first["level"] == 5 and rows[4]["level"] == 3
    assert first["prompt_tail"] == "b. y" and first["gold"] == ["b"]
    assert first["completion"] == groups[0].completions[0]
    assert first["reward"] == groups[0].rewards[0] and first["length"] == 5
    assert first["reward_parts"] == {
        "mcq_accuracy": groups[0].reward_parts["mcq_accuracy"][0],
        "soft_overlong": 0.1,
    }
    assert rows[2]["finish_reason"] == "length"
    run.finish()
    tables = list((tmp_path).rglob("completions_*.table.json"))
    assert len(tables) == 1  # step 2 only (every 2 steps)
    table = json.loads(tables[0].read_text())
    assert len(table["data"]) == 12
    # ms-swift's _build_log_table: gen_step, prompt, completion, each reward, advantages
    assert table["columns"][:6] == [
        "step", "prompt", "completion", "mcq_accuracy", "soft_overlong", "advantages"
    ]  # fmt: skip
    assert table["data"][0][1] == "問題0\na. x\nb. y" and table["data"][0][5] is None
    again = CompletionsLog(tmp_path / "completions.jsonl")
    assert again.truncate_after(2) == 24
    again.close()


def test_tensorboard_backend_writes_readable_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="install tensorboard (ms-swift brings it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardLogger(tmp_path / "tb")
    for step in (1, 2, 3):
        tb.log(
            step, {"reward/mean": 0.5 * step, "reward": 0.5 * step, "collapse/acr_predicted": None}
        )
    tb.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"reward/mean", "reward"}
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.5), (2, 1.0), (3, 1.5)]


def _rows(n: int = 5) -> list[dict]:
    rows = []
    for step in range(1, n + 1):
        rows.append(
            {
                "step": step,
                "collapse/acr_raw": 0.8,
                "collapse/frac_reward_zero_std": 0.0,  # carry: 0 by construction
                "dynamic/trained_groups": [8, 5, 8, 3, 8][step - 1],
                "dynamic/valid_groups": 8,
                "dynamic/success": float(step % 2),
                "reward/mean": 0.3,
                "reward/mcq_accuracy/mean": 0.3,
                "reward/errors": float(step == 2),
                "loss/kl": 0.01 * step,
                "loss/entropy": 2.0 - 0.1 * step,
            }
        )
    return rows


def _outside(fig) -> bool:
    """The figure legend does not overlap any axes' plotting area."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.legends[0].get_window_extent(renderer)
    return all(not box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)


def test_report_plots_integer_steps_legends_outside_and_dynamic_panel():
    import matplotlib

    matplotlib.use("Agg")
    rows = _rows(3)  # a short run: ticks were 1.0, 1.2, 1.4 ...
    for fig in (figure_collapse(rows, 3), figure_reward(rows), figure_kl_entropy(rows)):
        bottom = [ax for ax in fig.axes if ax.get_xlabel() == "step"][0]
        ticks = bottom.get_xticks()
        assert all(float(t).is_integer() for t in ticks), ticks
        assert _outside(fig)
    collapse = figure_collapse(_rows(), 3)
    labels = [t.get_text() for t in collapse.legends[0].get_texts()]
    assert any("trained_groups" in t for t in labels) and any("success" in t for t in labels)
    bars = [p.get_height() for p in collapse.axes[1].patches]
    assert bars == [8, 5, 8, 3, 8]  # the short batches (5, 3) are visible
    reward = figure_reward(_rows())
    assert [p.get_height() for p in reward.axes[1].patches] == [0, 1, 0, 0, 0]
    kl = figure_kl_entropy(_rows())
    assert list(kl.axes[0].lines[0].get_ydata()) == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05])


def test_make_report_writes_kl_entropy(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    names = sorted(p.name for p in make_report(run))
    assert "kl_entropy.png" in names and len(names) == 6
