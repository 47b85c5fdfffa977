"""megagrpo.rewards: reward functions (registry), the weighted composite, MCQ answer
extraction, soft overlong punishment, ms-swift ORM plugins, and official IgakuQA scoring.

Pure: imports no megatron, vllm or torch.distributed.
"""

from megagrpo.rewards.composite import CompositeReward, build_composite
from megagrpo.rewards.length import soft_overlong
from megagrpo.rewards.mcq import answers_match, extract_answer, mcq_accuracy
from megagrpo.rewards.registry import get, names, register
from megagrpo.rewards.toy import toy_first_token

__all__ = [
    "CompositeReward",
    "answers_match",
    "build_composite",
    "extract_answer",
    "get",
    "mcq_accuracy",
    "names",
    "register",
    "soft_overlong",
    "toy_first_token",
]
