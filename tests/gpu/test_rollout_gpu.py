"""Colocated vLLM on a GPU (external_launcher, sleep mode): generation, verified sync, sleep.

Skipped without CUDA. One process (world size 1); under torchrun every rank does the same.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engine(tiny_moe_dir, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm")
    for key, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29531"),
    ):
        os.environ.setdefault(key, value)
    from megagrpo.rollout import RolloutConfig, build_engine

    cfg = RolloutConfig(
        engine="vllm",
        max_tokens=32,
        max_model_len=512,
        dtype="float32",
        gpu_memory_utilization=0.2,
        colocate=True,
        verify_tol=1e-3,
        cache_dir=str(tmp_path_factory.mktemp("vcache")),
    )
    eng = build_engine(cfg, str(tiny_moe_dir), seed=0)
    yield eng
    eng.close()


def test_gpu_generate_sync_sleep(engine, tiny_moe_dir):
    from transformers import AutoModelForCausalLM

    from megagrpo.rollout.hf_engine import sequence_logprobs
    from megagrpo.types import Problem

    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    problem = Problem("g", [{"role": "user", "content": "答え: c"}], ["c"])
    group = engine.generate([problem], n=8)[0]
    assert group.size == 8 and len({tuple(t) for t in group.token_ids}) == 8
    for toks, lps in zip(group.token_ids, group.logprobs):
        ref = sequence_logprobs(hf, group.prompt_ids + toks)[len(group.prompt_ids) - 1 :]
        assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-3  # TF32/cuBLAS on GPU
    t0 = time.perf_counter()
    engine.sleep()
    sleep_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.wake_up()
    print(f"sleep {sleep_s:.3f} s, wake {time.perf_counter() - t0:.3f} s")
    g = torch.Generator().manual_seed(1)
    new = {
        k: v + 0.05 * torch.randn(v.shape, generator=g) if v.dim() >= 2 else v
        for k, v in hf.state_dict().items()
    }
    hf.load_state_dict(new)
    report = engine.update_weights(
        iter(new.items()), expected_probe=sequence_logprobs(hf, engine.probe_token_ids)
    )
    assert report.verified and report.max_probe_diff < 1e-3
