"""HF ``generate`` engine (same protocol as vLLM) and the engine-independent helpers."""

from __future__ import annotations

import pytest
import torch

from megagrpo.errors import ConfigError
from megagrpo.rollout import (
    EngineError,
    RolloutConfig,
    RolloutEngine,
    SamplingSpec,
    WeightSyncError,
    build_engine,
    to_checkpoint_format,
)
from megagrpo.rollout.hf_engine import sequence_logprobs
from megagrpo.rollout.stream import iter_buckets
from megagrpo.testing import TINY_PROBLEMS, logprob_errors

PROBLEMS = TINY_PROBLEMS


@pytest.fixture(scope="module")
def engine(tiny_moe_dir):
    cfg = RolloutConfig(
        engine="hf", max_tokens=10, max_model_len=256, sync_bucket_mb=0.05, verify_tol=1e-5
    )
    eng = build_engine(cfg, str(tiny_moe_dir), seed=3)
    yield eng
    eng.close()


def test_group_structure_and_logprobs(engine, hf_model, tiny_moe_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe_dir)
    assert isinstance(engine, RolloutEngine)
    groups = engine.generate(PROBLEMS, n=8, sampling=SamplingSpec(temperature=0.7, top_p=0.9))
    assert [g.problem.id for g in groups] == ["p1", "p2"]
    for g in groups:
        ref = tok.apply_chat_template(
            g.problem.messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert g.prompt_ids == list(ref)
        assert g.size == 8 and len({tuple(t) for t in g.token_ids}) == 8
        for toks, lps, n, fin in zip(g.token_ids, g.logprobs, g.lengths, g.finish_reasons):
            assert len(toks) == len(lps) == n >= 1
            assert fin == ("stop" if toks[-1] == tok.eos_token_id else "length")
            assert (fin == "length") == (n == 10 and toks[-1] != tok.eos_token_id)
            ref_lp = sequence_logprobs(hf_model, g.prompt_ids + toks)[len(g.prompt_ids) - 1 :]
            assert max(abs(a - b) for a, b in zip(lps, ref_lp)) < 1e-4  # left padding: fp32


def test_a_problems_own_cap_limits_its_completions(engine):
    """``meta['max_tokens']`` (a partial rollout's continued member: its remaining room) caps
    that problem's completions below the call's ``max_tokens``; the others are unaffected and
    the capped completions are the uncapped ones' prefixes (same seeds)."""
    import dataclasses

    spec = SamplingSpec(seed=4, max_tokens=8, temperature=1.5)
    capped = dataclasses.replace(PROBLEMS[0], meta=dict(PROBLEMS[0].meta, max_tokens=3))
    free, short = engine.generate([PROBLEMS[0], PROBLEMS[1]], n=4, sampling=spec), None
    short = engine.generate([capped, PROBLEMS[1]], n=4, sampling=spec)
    for full, cut, fin in zip(free[0].token_ids, short[0].token_ids, short[0].finish_reasons):
        assert len(cut) <= 3 and cut == full[: len(cut)]
        assert fin == "length" or len(cut) < 3
    assert short[1].token_ids == free[1].token_ids
    assert max(len(t) for t in free[0].token_ids) > 3  # the cap did cut something


def test_seeds_reproduce(engine):
    a = engine.generate(PROBLEMS[:1], n=3, sampling=SamplingSpec(seed=9))[0]
    b = engine.generate(PROBLEMS[:1], n=3, sampling=SamplingSpec(seed=9))[0]
    c = engine.generate(PROBLEMS[:1], n=3, sampling=SamplingSpec(seed=10))[0]
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_update_weights_verified_and_failures_raise(engine, hf_model):
    g = torch.Generator().manual_seed(0)
    new = {
        k: v + 0.05 * torch.randn(v.shape, generator=g) if v.dim() >= 2 else v
        for k, v in hf_model.state_dict().items()
    }
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_config(hf_model.config).eval()
    trainer.load_state_dict(new)
    expected = sequence_logprobs(trainer, engine.probe_token_ids)
    # per-expert checkpoint names must land in the fused expert tensors too
    report = engine.update_weights(to_checkpoint_format(new.items()), expected_probe=expected)
    assert report.verified and report.max_probe_diff < 1e-5 and report.num_buckets > 1
    with pytest.raises(WeightSyncError, match="map to no engine parameter"):
        engine.update_weights((f"decoy.{k}", v) for k, v in new.items())
    with pytest.raises(WeightSyncError, match="moved by"):  # same weights again: no change
        engine.update_weights(iter(new.items()))
    original = sequence_logprobs(hf_model, engine.probe_token_ids)
    with pytest.raises(WeightSyncError, match="exactly the tensors of the previous sync"):
        engine.update_weights(iter(new.items()), expected_probe=original)
    engine.verifier.last_streamed = None  # the probe alone sees it too
    with pytest.raises(WeightSyncError, match="did not move as the trainer predicts"):
        engine.update_weights(iter(new.items()), expected_probe=original)
    engine.update_weights(iter(hf_model.state_dict().items()), expected_probe=original)


def test_sleep_blocks_generation(engine):
    engine.sleep()
    with pytest.raises(EngineError, match="asleep"):
        engine.generate(PROBLEMS[:1], n=1)
    engine.wake_up()
    assert engine.generate(PROBLEMS[:1], n=1)[0].size == 1


def test_to_checkpoint_format_matches_saved_checkpoint(hf_model, tiny_moe_dir):
    from safetensors.torch import load_file

    saved = load_file(str(tiny_moe_dir / "model.safetensors"))
    ours = dict(to_checkpoint_format(hf_model.state_dict().items()))
    assert set(ours) == set(saved)
    assert all(torch.equal(ours[k], saved[k]) for k in saved)


def test_buckets_are_bounded_and_complete():
    tensors = [(f"t{i}", torch.ones(100 + i)) for i in range(20)] + [("big", torch.ones(5000))]
    buckets = list(iter_buckets(iter(tensors), bucket_bytes=2000, dtype=torch.bfloat16))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in tensors]
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= 2000 or len(b) == 1
        assert all(t.dtype == torch.bfloat16 for _, t in b)
    src = torch.ones(4)
    ((name, copy),) = next(iter_buckets([("x", src)], 10))
    assert copy.data_ptr() != src.data_ptr()


def test_sampling_logprobs_are_of_the_tempered_distribution(tiny_moe_dir, hf_model):
    """rollout.logprobs=sampling: the sampled tokens' log-probs are log_softmax(logits / T)
    of transformers' own forward (and not the raw model's)."""
    cfg = RolloutConfig(engine="hf", max_tokens=8, max_model_len=256, logprobs="sampling")
    eng = build_engine(cfg, str(tiny_moe_dir), seed=5)
    try:
        groups = eng.generate(PROBLEMS, n=4, sampling=SamplingSpec(temperature=0.6))
    finally:
        eng.close()
    tempered, raw = logprob_errors(groups, hf_model, 0.6)
    assert tempered < 1e-4, tempered  # fp32 model, left padding in the batch
    assert raw > 1e-2  # the two policies differ: the option is not a no-op


def test_config_validation():
    RolloutConfig().validate("rollout")
    with pytest.raises(ConfigError, match="rollout.logprobs"):
        RolloutConfig(logprobs="processed").validate("rollout")
    # sampling log-probs with a truncating sampler: ms-swift's setting (tests/unit/test_sampling.py)
    RolloutConfig(logprobs="sampling", top_p=0.9).validate("rollout")
    with pytest.raises(ConfigError, match="rollout.engine"):
        RolloutConfig(engine="sglang").validate("rollout")
    with pytest.raises(ConfigError, match="rollout.max_model_len"):
        RolloutConfig(max_tokens=512, max_model_len=512).validate("rollout")


def test_verify_rollout_cli_json(tiny_moe_dir, capsys):
    import json

    from megagrpo.cli import main

    rc = main(
        [
            "verify-rollout",
            "--hf",
            str(tiny_moe_dir),
            "--engine",
            "hf",
            "--json",
            "--n",
            "3",
            "--max-tokens",
            "6",
        ]
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"] and out["engine"] == "hf"
    assert out["weight_update_effective"] is True and out["sync_bytes"] > 0
    assert out["sync_seconds"] > 0 and out["num_samples"] == 6
    assert 0 <= out["logprob_mean_abs_diff"] <= out["logprob_max_abs_diff"] < 1e-4
    assert main(["verify-rollout", "--hf", str(tiny_moe_dir / "nope")]) == 2


def test_engine_error_messages_name_config_keys():
    from megagrpo.rollout.vllm_support import explain_error as _explain

    oom = _explain(ValueError("No available memory for the cache blocks"), "start")
    assert "rollout.kv_cache_gib" in oom and "rollout.gpu_memory_utilization" in oom
    assert "No available memory" in oom
    gen = _explain(RuntimeError("boom"), "generation")
    assert "rollout.max_tokens" in gen and "boom" in gen


def test_seeded_sampler_matches_temperature_top_p_distribution():
    from megagrpo.rollout.hf_engine import _SeededSampler
    from megagrpo.rollout.sampling import SamplingParams

    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    rows = 6000
    params = SamplingParams(temperature=0.7, top_p=0.8)
    sampler = _SeededSampler(list(range(rows)), params, [[0]] * rows, device="cpu")
    chosen = sampler(None, logits.expand(rows, 4).clone()).argmax(-1)
    p = torch.softmax(logits / 0.7, -1)  # [0.745, 0.178, 0.087, 0.010]: top-p 0.8 keeps two
    keep = torch.tensor([1.0, 1.0, 0.0, 0.0])
    expected = p * keep / (p * keep).sum()
    freq = torch.bincount(chosen, minlength=4).float() / rows
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)


def test_mixed_counts_in_one_call(engine):
    """One call with n per problem (rollout budgets): problem j's completions are the first
    n_j of a call giving every problem max(n) (seeds per (problem, sample))."""
    spec = SamplingSpec(seed=21)
    mixed = engine.generate(PROBLEMS, [3, 1], sampling=spec)
    full = engine.generate(PROBLEMS, 3, sampling=spec)
    assert [g.size for g in mixed] == [3, 1]
    for m, f in zip(mixed, full):
        assert m.token_ids == f.token_ids[: m.size]
        assert m.finish_reasons == f.finish_reasons[: m.size]
        for a, b in zip(m.logprobs, f.logprobs):  # other rows in the batch: fp32 noise
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert engine.generate([], [], sampling=spec) == []
    with pytest.raises(EngineError, match="1 sample counts for 2 problems"):
        engine.generate(PROBLEMS, [3], sampling=spec)
    with pytest.raises(EngineError, match=">= 1"):
        engine.generate(PROBLEMS, [3, 0], sampling=spec)


def test_a_first_sync_of_unchanged_weights_is_not_a_stale_stream(tiny_moe_dir, hf_model):
    """A step whose update changed nothing (all advantages zero: AdamW moves nothing) syncs the
    weights the engine already holds. The trainer says so (its probe before == after), so the
    first sync must pass; it used to fail as "the trainer streamed its old weights" because
    the engine, with no previous sync, assumed a change (gpu_check.sh's train part on a random
    tiny model hit it). A stale stream while the trainer predicts a change still fails."""
    from megagrpo.rollout import WeightSyncError

    eng = build_engine(
        RolloutConfig(engine="hf", max_tokens=8, max_model_len=256), str(tiny_moe_dir), seed=0
    )
    try:
        probe = eng.probe_logprobs()
        same = [(k, v.detach().clone()) for k, v in hf_model.state_dict().items()]
        report = eng.update_weights(same, expected_probe=probe, expected_before=probe)
        assert report.verified
        moved = [p + 0.5 for p in probe]  # the trainer claims its weights moved
        with pytest.raises(WeightSyncError, match="stale weights|bit-identical|did not move"):
            eng.update_weights(same, expected_probe=moved, expected_before=probe)
    finally:
        eng.close()
