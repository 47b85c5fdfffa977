"""megagrpo.model: Qwen3-MoE / Qwen3 / Llama on Megatron-core with LoRA, HF weights in/out.

from megagrpo.model import build_policy
policy = build_policy(model_cfg, groups)   # groups from megagrpo.parallel.init_parallel
"""

from megagrpo.model.config import LoraConfig, ModelConfig


def build_policy(model_cfg, groups):
    """See :func:`megagrpo.model.policy.build_policy` (imported lazily: megatron is heavy)."""
    from megagrpo.model.policy import build_policy as _build

    return _build(model_cfg, groups)


def __getattr__(name):
    if name == "MegatronPolicy":
        from megagrpo.model.policy import MegatronPolicy

        return MegatronPolicy
    raise AttributeError(name)


__all__ = ["LoraConfig", "ModelConfig", "MegatronPolicy", "build_policy"]
