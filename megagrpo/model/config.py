"""Model + LoRA config (owner: megagrpo.model)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megagrpo.errors import require, require_finite

LORA_TARGETS = (
    "linear_qkv",
    "linear_proj",
    "linear_fc1",
    "linear_fc2",
    "expert_linear_fc1",
    "expert_linear_fc2",
)


@dataclass
class LoraConfig:
    """LoRA adapters on Megatron parallel linears; the only trained weights.

    ``targets`` names Megatron linears: ``linear_qkv``, ``linear_proj`` (attention),
    ``linear_fc1``/``linear_fc2`` (dense MLP *and* experts), or ``expert_linear_fc1``/
    ``expert_linear_fc2`` to adapt only the experts. B starts at zero, so step 0 equals the
    base model.
    """

    rank: int = 8
    """LoRA rank r (A: [r, in], B: [out, r])."""
    alpha: float = 16.0
    """Scale numerator: the update is (alpha / rank) * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapter input (0 keeps PEFT export exact for expert parameters)."""
    targets: list[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    )
    """Which Megatron linears get adapters (see class docstring)."""
    init_seed: int = 0
    """Seed for A's Kaiming-uniform init (same on every rank, so layouts agree)."""

    def validate(self, path: str = "model.lora") -> None:
        """Check values; raises ConfigError naming the key."""
        require(self.rank >= 1, f"{path}.rank", "must be >= 1")
        require_finite(self.alpha, f"{path}.alpha")
        require_finite(self.dropout, f"{path}.dropout")
        require(0.0 <= self.dropout < 1.0, f"{path}.dropout", "must be in [0, 1)")
        for t in self.targets:
            require(
                t in LORA_TARGETS,
                f"{path}.targets",
                f"unknown target {t!r}; choose from {', '.join(LORA_TARGETS)}",
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass
class ModelConfig:
    """Which model to train and how it is built."""

    hf_path: str = ""
    """HF model directory (config.json + safetensors), or 'smollm2-135m' for the bundled one."""
    dtype: str = "float32"
    """float32 | bfloat16 for the frozen base weights (LoRA weights stay float32)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    spec: str = "auto"
    """Megatron layer spec: auto (TE with CUDA + Transformer Engine, else local) | local | te."""
    moe_grouped_gemm: bool = True
    """With the TE spec, use TEGroupedMLP experts (else SequentialMLP). Ignored on local."""
    max_seq_len: int = 4096
    """Longest sequence the model is built for (RoPE cache)."""
    activation_recompute: bool = False
    """Full activation recomputation (only each layer's input is kept between forward and
    backward). Read by the memory planner (`megagrpo plan-memory`)."""

    def validate(self, path: str = "model") -> None:
        require(
            self.dtype in ("float32", "bfloat16", "float16"),
            f"{path}.dtype",
            f"{self.dtype!r} is not float32 | bfloat16 | float16",
        )
        require(
            self.spec in ("auto", "local", "te"),
            f"{path}.spec",
            f"{self.spec!r} is not auto | local | te",
        )
        require(self.max_seq_len >= 1, f"{path}.max_seq_len", "must be >= 1")
