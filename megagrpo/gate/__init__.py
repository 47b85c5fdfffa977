"""The compatibility gate: what the pinned upstream stack (vLLM 0.33, megatron-core 0.16.1,
Transformer Engine 2.11) cannot run, decided from a run config before any model or engine
starts (:mod:`megagrpo.gate.compat`). The config loader, the trainer, ``preflight`` and the
planner (``plan-memory``) all ask it; it imports neither vllm nor megatron."""
