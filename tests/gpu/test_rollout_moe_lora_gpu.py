"""What only GPUs show of LoRA on a Qwen3-MoE's experts in vLLM 0.33 (the CPU side: the
upstream contract tier, tests/contract/, runs vLLM 0.33's loaders and managers on CPU):

* one GPU: the adapter megagrpo syncs (per-expert names, in memory) is served: the engine's
  log-probs equal those of the same engine holding the merged weights (the Triton MoE-LoRA
  kernels ran, on every expert);
* two GPUs, one lock-stepped engine of DP 2 x EP 2 (audit 3 W1): rank 0's log-probs are the
  same whether rank 1 is busy with the same request or idle (``generate([])``: vLLM's dummy
  batch). Upstream's dummy batch puts an all-zero warm-up adapter in rank 1's slot, so the
  tokens rank 0 routes to rank 1's experts would lose their LoRA; megagrpo keeps the served
  adapter there (``rollout.vllm_lora``).

Skipped without CUDA (and the second without 2 GPUs).
"""

from __future__ import annotations

import os

import pytest
import torch
from gpu_adapters import random_adapter

pytestmark = pytest.mark.gpu

IDS = list(range(100, 164))


@pytest.fixture(autouse=True)
def _engine_in_process(monkeypatch):
    """``colocate=False`` engines here run without the external launcher, where vLLM 0.33
    starts its engine core in a child process (``VLLM_ENABLE_V1_MULTIPROCESSING`` defaults
    to 1: v1/engine/llm_engine.py). megagrpo's in-memory adapter registry and its dummy-run
    wrapper live in this process, and ``apply_model`` would need
    ``VLLM_ALLOW_INSECURE_SERIALIZATION``: keep the engine core in process, as the external
    launcher does (found by the issue-31 review)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _need(gpus: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA device(s)")
    pytest.importorskip("vllm")


def _cfg(cache: str, **kw):
    from megagrpo.rollout import RolloutConfig

    base = dict(
        engine="vllm",
        max_tokens=8,
        max_model_len=256,
        dtype="bfloat16",
        gpu_memory_utilization=0.2,
        enable_lora=True,
        max_lora_rank=8,
        cache_dir=cache,
    )
    return RolloutConfig(**{**base, **kw})


def test_synced_moe_adapter_is_served_like_the_merged_weights(tiny_moe_dir, tmp_path):
    _need(1)
    from megagrpo.rollout import build_engine
    from megagrpo.rollout.lora import merged_stream
    from megagrpo.rollout.vllm_support import in_distributed_world

    assert not in_distributed_world()
    adapter = random_adapter(tiny_moe_dir)
    served = build_engine(_cfg(str(tmp_path), colocate=False), str(tiny_moe_dir), seed=0)
    try:
        base = torch.tensor(served.sequence_logprobs(IDS))
        served.update_adapter(adapter, in_memory=True)
        with_lora = torch.tensor(served.sequence_logprobs(IDS))
        base_tensors = list(_hf_tensors(tiny_moe_dir))
    finally:
        served.close()
    merged = build_engine(
        _cfg(str(tmp_path), colocate=False, enable_lora=False), str(tiny_moe_dir), seed=0
    )
    try:
        merged.update_weights(merged_stream(iter(base_tensors), adapter))
        want = torch.tensor(merged.sequence_logprobs(IDS))
    finally:
        merged.close()
    change = (want - base).abs().mean()
    assert change > 0.05  # the adapter moves the model
    # bf16 kernels on both sides: the served adapter reproduces the merged model's change
    assert (with_lora - want).abs().mean() < 0.2 * change


def _hf_tensors(model_dir):
    from megagrpo.commands.eval import base_tensors

    yield from base_tensors(model_dir)


def _idle_worker(rank: int, model_dir: str, cache: str) -> dict:
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl")
    from megagrpo.rollout import build_engine

    cfg = _cfg(
        cache,
        colocate=True,
        enable_expert_parallel=True,
        replicas="lockstep",
        tensor_parallel_size=1,
    )
    engine = build_engine(cfg, model_dir, seed=0)
    try:
        out: dict = {"block": engine.expert_block()}
        engine.update_adapter(random_adapter(model_dir, scale=0.5), in_memory=True)
        out["busy"] = engine.sequence_logprobs(IDS)  # both ranks: the same request
        if rank == 0:
            out["idle"] = engine.sequence_logprobs(IDS)
        else:
            engine.generate([], n=1)  # lock-stepped dummy batches while rank 0 works
        return out
    finally:
        engine.close()


def test_idle_lockstep_rank_keeps_the_expert_lora(tiny_moe_dir, tmp_path):
    _need(2)
    from megagrpo.parallel.launch import launch

    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM 0.33's default runner
    ranks = launch(_idle_worker, 2, str(tiny_moe_dir), str(tmp_path))
    assert [r["block"][0] for r in ranks] == [0, 1]  # expert parallel over the two GPUs
    busy, idle = torch.tensor(ranks[0]["busy"]), torch.tensor(ranks[0]["idle"])
    assert torch.tensor(ranks[1]["busy"]).sub(busy).abs().max() < 0.05  # same request
    # rank 1 idle must not change rank 0's log-probs (its experts keep their LoRA)
    assert (idle - busy).abs().max() < 0.05
