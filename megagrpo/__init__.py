"""megagrpo: GRPO for very large MoE LLMs on Megatron-core."""

__version__ = "0.1.0"
