"""Model + LoRA config (owner: megagrpo.model)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraConfig:
    """LoRA adapters on Megatron parallel linears; the only trained weights."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])


@dataclass
class ModelConfig:
    """Which model to train."""

    hf_path: str = ""
    """HF model directory (config.json + safetensors), or 'smollm2-135m' for the bundled one."""
    dtype: str = "float32"
    """float32 | bfloat16 for the frozen base weights."""
    lora: LoraConfig = field(default_factory=LoraConfig)
