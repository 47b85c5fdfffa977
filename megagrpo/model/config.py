"""Model + LoRA config (owner: megagrpo.model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megagrpo.errors import require, require_finite, require_fp32

SyncTransport = Literal["allreduce", "broadcast", "sliced"]
"""How merged tensors travel between the trainer's ranks (``trainer.sync_transport``;
:mod:`megagrpo.model.sync_transport`)."""
RECOMPUTE = ("none", "full", "selective")
ROUTING_REPLAY = ("off", "r2", "r3")
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "moe_act", "layernorm", "shared_experts")
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
        require_fp32(self.alpha, f"{path}.alpha")
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
    recompute: str = "none"
    """Activation recomputation, megatron-core's ``recompute_granularity``: none (keep every
    activation for backward) | full (keep only the input of each group of
    ``recompute_num_layers`` layers and recompute the rest, LoRA adapters included, in
    backward: ~1/3 more compute) | selective (recompute only ``recompute_modules``). The
    memory planner (`megagrpo plan-memory`) models full; it plans selective as none."""
    recompute_method: str = "uniform"
    """With full recompute: uniform (every layer, in groups of recompute_num_layers) | block
    (only the first recompute_num_layers layers of each pipeline stage)."""
    recompute_num_layers: int = 1
    """With full recompute: layers per recomputed group (uniform; must divide the layers of a
    pipeline stage) or layers recomputed per stage (block)."""
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])
    """With selective recompute: the Megatron submodules to recompute: core_attn, mlp, moe,
    moe_act (TE grouped experts only), layernorm, shared_experts."""
    routing_replay: str = "off"
    """MoE routing replay (:mod:`megagrpo.model.routing`): off (the trainer's router picks the
    experts) | r3 (every trainer forward of rollout tokens, the KL reference's too, uses the
    experts the rollout engine picked: needs routing from the engine,
    ``rollout.return_routing``) | r2 (the trainer's first forward of a step records its
    experts and the later ones replay them: needs recomputed old log-probs). Only the
    selection is replayed; gate weights come from the live router, so gradients flow."""

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
        require(
            self.recompute in RECOMPUTE,
            f"{path}.recompute",
            f"{self.recompute!r} is not {' | '.join(RECOMPUTE)}",
        )
        require(
            self.recompute_method in ("uniform", "block"),
            f"{path}.recompute_method",
            f"{self.recompute_method!r} is not uniform | block",
        )
        require(self.recompute_num_layers >= 1, f"{path}.recompute_num_layers", "must be >= 1")
        bad = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        require(
            not bad,
            f"{path}.recompute_modules",
            f"unknown {bad}; choose from {', '.join(RECOMPUTE_MODULES)}",
        )
        require(
            self.routing_replay in ROUTING_REPLAY,
            f"{path}.routing_replay",
            f"{self.routing_replay!r} is not {' | '.join(ROUTING_REPLAY)}",
        )
        require(
            self.recompute != "selective" or bool(self.recompute_modules),
            f"{path}.recompute_modules",
            "selective recompute needs at least one module",
        )
