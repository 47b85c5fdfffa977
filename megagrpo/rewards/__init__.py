"""megagrpo.rewards: reward functions (registry), the weighted composite, MCQ answer
extraction, soft overlong punishment, ms-swift ORM plugins, and official IgakuQA scoring.

Pure: imports no megatron, vllm or torch.distributed.
"""

from megagrpo.rewards.composite import CompositeReward, RewardError, build_composite
from megagrpo.rewards.length import soft_overlong
from megagrpo.rewards.mcq import answers_match, extract_answer, mcq_accuracy
from megagrpo.rewards.plugins import reward_plugin
from megagrpo.rewards.registry import get, names, register
from megagrpo.rewards.toy import toy_first_token

__all__ = [
    "CompositeReward",
    "RewardError",
    "answers_match",
    "build_composite",
    "extract_answer",
    "get",
    "mcq_accuracy",
    "names",
    "register",
    "reward_plugin",
    "soft_overlong",
    "toy_first_token",
]
