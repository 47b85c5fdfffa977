"""What only a GPU shows of ``rollout.quantization=fp8`` (vLLM's online FP8,
``model_executor/layers/quantization/online/fp8.py``): a merged sync into the real engine
passes coverage and checksums on the quantized layout (float8 weights transposed, derived
``weight_scale``), its probe within bf16's tolerance; and a skipped update after a level-2
sleep is restored by a full sync (the engine really dropped its weights). Skipped without
CUDA; the CPU tests of the same rules: tests/unit/test_rollout_fp8_layout.py,
test_trainer_skip_resync.py."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _engine_in_process(monkeypatch):
    """``colocate=False`` engines here run without the external launcher, where vLLM 0.33
    starts its engine core in a child process (``VLLM_ENABLE_V1_MULTIPROCESSING`` defaults
    to 1: v1/engine/llm_engine.py). megagrpo's in-memory adapter registry and its dummy-run
    wrapper live in this process, and ``apply_model`` would need
    ``VLLM_ALLOW_INSECURE_SERIALIZATION``: keep the engine core in process, as the external
    launcher does (found by the issue-31 review)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="module")
def fp8_engine(tiny_moe_dir, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    pytest.importorskip("vllm")
    for key, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29533"),
    ):
        os.environ.setdefault(key, value)
    from megagrpo.rollout import RolloutConfig, build_engine

    cfg = RolloutConfig(
        engine="vllm",
        max_tokens=8,
        max_model_len=256,
        dtype="bfloat16",
        quantization="fp8",
        gpu_memory_utilization=0.2,
        colocate=True,
        full_check_every=1,
        cache_dir=str(tmp_path_factory.mktemp("vcache")),
    )
    eng = build_engine(cfg, str(tiny_moe_dir), seed=0)
    yield eng
    eng.close()


def test_fp8_merged_sync_after_a_level2_sleep(fp8_engine, tiny_moe_dir):
    from transformers import AutoModelForCausalLM

    from megagrpo.rollout.hf_engine import sequence_logprobs

    assert fp8_engine.sleep_level == 2
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    fp8_engine.sleep()
    fp8_engine.wake_up()  # the weights are gone: a wake-up alone must not generate
    with pytest.raises(Exception, match="level 2"):
        fp8_engine.generate([], n=1)
    expected = sequence_logprobs(hf, fp8_engine.probe_token_ids)
    report = fp8_engine.update_weights(
        iter(hf.state_dict().items()), expected_probe=expected, full_check=True
    )
    assert report.verified


def test_fp8_expert_lora_logprobs_match_bf16(tiny_moe_dir, tmp_path):
    """The GPU check the gate's unverified rule ``vllm.fp8_moe_lora`` names: vLLM 0.33 with
    FP8 experts (``quantization=fp8``) serves LoRA on them (its FP8 MoE backend choice lands
    on Triton experts: tests/contract/test_vllm_gate.py), and the adapter moves the FP8
    engine's log-probs as it moves the bf16 engine's. When this passes on a GPU, clear the
    rule's ``unverified`` (megagrpo/gate/compat.py) and the planner's FP8 mark."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("FP8 needs CUDA with compute capability >= 8.9")
    pytest.importorskip("vllm")
    from gpu_adapters import random_adapter

    from megagrpo.rollout import RolloutConfig, build_engine

    ids = list(range(100, 164))
    adapter = random_adapter(tiny_moe_dir, scale=0.4)
    out = {}
    for quant in ("none", "fp8"):
        cfg = RolloutConfig(
            engine="vllm",
            max_tokens=8,
            max_model_len=256,
            dtype="bfloat16",
            quantization=quant,
            enable_lora=True,
            max_lora_rank=8,
            colocate=False,
            gpu_memory_utilization=0.2,
            cache_dir=str(tmp_path / quant),
        )
        engine = build_engine(cfg, str(tiny_moe_dir), seed=0)
        try:
            base = torch.tensor(engine.sequence_logprobs(ids))
            engine.update_adapter(adapter, in_memory=True)
            out[quant] = (base, torch.tensor(engine.sequence_logprobs(ids)))
        finally:
            engine.close()
    (b16, l16), (b8, l8) = out["none"], out["fp8"]
    change16, change8 = l16 - b16, l8 - b8
    assert change16.abs().mean() > 0.05  # the adapter (experts included) moves the model
    # FP8 per-tensor weights: ~1e-2 relative noise on the base; the LoRA path runs on
    # unquantized activations, so the adapter's effect agrees within a third of its size
    assert (change8 - change16).abs().mean() < change16.abs().mean() / 3
    assert (l8 - l16).abs().mean() < 0.3  # bf16 engines' tolerance (rollout.verify)
