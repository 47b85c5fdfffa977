"""(e) The `vllm serve --enable-lora` line of docs/evaluation.md serves the adapter
``megagrpo export --format vllm`` writes, through vLLM 0.33.0's own serving path: its
``vllm serve`` CLI parser, the engine config from the parsed args, the worker's LoRA managers
on a real ``Qwen3MoeForCausalLM``, and ``OpenAIServingModels.init_static_loras`` (the path a
``--lora-modules`` adapter takes at server start: ``load_lora_adapter`` -> ``add_lora``). The
served adapter's LoRA buffers must hold the exported factors.

Not run on CPU: the HTTP server and a forward pass (tests/gpu generates with the adapter)."""

from __future__ import annotations

from contract_checks import buffer_errors, ok
from serve_command import documented_command


def test_the_documented_vllm_serve_command_serves_the_exported_adapter(upstream, exported):
    import json

    from safetensors.torch import load_file

    words = documented_command()
    assert words[:2] == ["vllm", "serve"] and "--enable-lora" in words
    out = exported["vllm"]
    assert not isinstance(out, BaseException), f"export --format vllm failed: {out!r}"
    served = ok(upstream["serve"])
    name = words[words.index("--lora-modules") + 1].partition("=")[0]
    assert served["served"] == [name] and served["request"]["path"] == str(out)
    rank = int(words[words.index("--max-lora-rank") + 1])
    assert served["lora_config"]["max_lora_rank"] == rank
    tensors = load_file(str(out / "adapter_model.safetensors"))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] <= rank
    state = served["state"]
    assert state["slots"][0] == served["request"]["id"]
    # the documented line sets no dtype: vLLM serves in its model dtype (bf16 on this CPU
    # platform), folding alpha / r into B before the cast (fp32 adapter -> bf16 buffers)
    dtype = next(t for f in state["buffers"].values() for ts in f.values() for t in ts).dtype
    scale = config["lora_alpha"] / config["r"]
    reference = {}
    for key in tensors:
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[key.replace("lora_A", "lora_B")].float()
            a = tensors[key].to(dtype).float()
            reference[f"{module}.weight"] = (a, (scale * b).to(dtype).float())
    assert buffer_errors(state["buffers"], reference, 1.0) == []
