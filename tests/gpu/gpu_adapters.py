"""A random LoRA adapter of a tiny Qwen3-MoE in the engines' layout (per-expert names), for
the CUDA-only adapter tests."""

from __future__ import annotations

import torch


def random_adapter(model_dir, rank: int = 8, scale: float = 0.3, seed: int = 0):
    """:class:`megagrpo.rollout.PeftAdapter` with LoRA on q/k/v/o and every expert's
    gate/up/down of the HF model in ``model_dir`` (random A and B: the adapter moves the
    model, experts included)."""
    from megagrpo.model.arch import arch_from_hf, load_hf_config
    from megagrpo.model.hf_mapping import hf_weight_shapes
    from megagrpo.model.peft_export import lora_target
    from megagrpo.rollout import PeftAdapter

    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    shapes = hf_weight_shapes(arch_from_hf(load_hf_config(model_dir)))
    gen = torch.Generator().manual_seed(seed)
    adapter = PeftAdapter(rank=rank, alpha=2.0 * rank)
    for name, shape in shapes.items():
        if lora_target(name, targets) is None:
            continue
        out, inp = shape
        module = name.removesuffix(".weight")
        adapter.a[module] = torch.randn(rank, inp, generator=gen) * scale
        adapter.b[module] = torch.randn(out, rank, generator=gen) * scale
    return adapter
