"""rollout.quantization (issue 15, 1-node plan): fp8 is vLLM's online quantisation on GPU only.
Without a GPU both engines refuse it at start-up with the key and the fix, before any model
is loaded, and the schema refuses values it does not know."""

from __future__ import annotations

import pytest
import torch

from megagrpo.errors import ConfigError
from megagrpo.rollout.base import EngineError
from megagrpo.rollout.config import RolloutConfig

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU refusal only")


def test_hf_engine_refuses_fp8(tiny_dense_dir):
    from megagrpo.rollout.hf_engine import HFEngine

    cfg = RolloutConfig(engine="hf", quantization="fp8")
    with pytest.raises(
        EngineError, match=r"(?s)rollout.quantization=fp8.*set rollout.quantization"
    ):
        HFEngine(cfg, str(tiny_dense_dir))


def test_vllm_engine_refuses_fp8_without_a_gpu(tiny_dense_dir, monkeypatch):
    """Refused before the engine makes anything (it used to leave its LoRA temp dir behind)."""
    import tempfile

    from megagrpo.rollout import vllm_engine
    from megagrpo.rollout.vllm_engine import VLLMEngine

    made = []
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(a) or "/nonexistent")
    cfg = RolloutConfig(engine="vllm", quantization="fp8", max_model_len=256)
    with pytest.raises(EngineError, match=r"(?s)fp8 needs a GPU.*rollout.quantization=none on CPU"):
        VLLMEngine(cfg, str(tiny_dense_dir))
    assert made == [] and vllm_engine.tempfile is tempfile


def test_unknown_quantization_names_the_key():
    with pytest.raises(ConfigError, match=r"rollout.quantization"):
        RolloutConfig(quantization="int4").validate()
