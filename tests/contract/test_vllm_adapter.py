"""(a) The adapter megagrpo sends to its engines, loaded by vLLM 0.33.0's own code.

The adapter is built by megagrpo's sync path (``trainer.sync.weight_update``, streamed, on a
Megatron policy of a tiny Qwen3-MoE with LoRA on attention and all experts; then the engine's
``peft_state``) and handed to a real vLLM 0.33 ``Qwen3MoeForCausalLM``'s
``LRUCacheWorkerLoRAManager`` through megagrpo's in-memory request
(``rollout.vllm_lora.serve_from_memory``): upstream's ``_load_adapter`` (PEFT config
validation, ``LoRAModel.from_local_checkpoint`` -> ``from_lora_tensors``, Qwen3-MoE's
packed-modules mapping with ``is_3d_moe_weight = False``, ``_validate_moe_lora_format``),
``_create_merged_loras_inplace`` (``pack_moe``) and ``activate_adapter`` (``set_lora`` into
the 2D ``FusedMoEWithLoRA`` buffers). The buffers must then hold the trainer's factors
(``gather_lora``). The directory ``megagrpo export --adapter --format vllm`` writes goes
through the same code from disk (``from_local_checkpoint`` reading safetensors, with its
``check_unexpected_modules``): what ``vllm serve --enable-lora`` does for this model.

Not run on CPU: a forward pass with the adapter (Triton MoE-LoRA kernels); tests/gpu
(``test_rollout_moe_lora_gpu.py``) generates with it on a GPU.
"""

from __future__ import annotations

import re

from contract_checks import buffer_errors, ok

EXPERT_KEY = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.lora_[AB]\.weight$")


def test_the_synced_moe_adapter_loads_into_vllm_033(upstream):
    """Fails on cd819e6 (defect B1): the sync sent peft's fused 3D expert layout
    (``mlp.experts.base_layer.lora_A`` [E r, H] ...) and vLLM 0.33's
    ``_validate_moe_lora_format`` raised ValueError for Qwen3-MoE's 2D wrapper."""
    sent = ok(upstream["sent"])
    engine = ok(upstream["engine"])
    state = ok(engine["memory"])  # vLLM 0.33's _load_adapter, from megagrpo's request
    expert_keys = [k for k in sent["tensors"] if ".experts." in k]
    assert expert_keys and all(EXPERT_KEY.search(k) for k in expert_keys), expert_keys[:4]
    assert state["slots"] == [engine["request_id"]]
    scale = sent["config"]["lora_alpha"] / sent["config"]["r"]
    assert buffer_errors(state["buffers"], sent["reference"], scale) == []


def test_exported_vllm_adapter_loads_like_vllm_serve(upstream, exported):
    """``megagrpo export RUN --adapter --format vllm`` writes the adapter exactly as the
    engines receive it; vLLM 0.33 reads it from disk (``from_local_checkpoint``) into the
    buffers the checkpoint's factors predict."""
    import json

    from safetensors.torch import load_file

    out = exported["vllm"]
    assert not isinstance(out, BaseException), f"export --format vllm failed: {out!r}"
    tensors = load_file(str(out / "adapter_model.safetensors"))
    config = json.loads((out / "adapter_config.json").read_text())
    assert "target_parameters" not in config
    assert all(EXPERT_KEY.search(k) for k in tensors if ".experts." in k)
    reference = {}
    for key in tensors:
        if key.endswith(".lora_A.weight"):
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            reference[f"{name}.weight"] = (tensors[key], tensors[key.replace("lora_A", "lora_B")])
    engine = ok(upstream["engine"])
    state = ok(engine["exported"])
    scale = config["lora_alpha"] / config["r"]
    assert buffer_errors(state["buffers"], reference, scale) == []
