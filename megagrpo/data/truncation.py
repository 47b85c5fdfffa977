"""The over-long prompt policy (``data.truncation``), applied once when the data loads.

A prompt longer than ``max_prompt_tokens`` either stops the run before step 1 naming the
problems (``error``), is dropped and counted (``delete``), or keeps its last
``max_prompt_tokens`` tokens (``left``, ms-swift's GRPO default: the start of the prompt,
system prompt included, is cut). The default ``max_prompt_tokens`` leaves every prompt the full
completion budget: ``rollout.max_model_len - rollout.max_tokens``. Before this, a long
prompt was sampled mid-run and crashed the engine (and ``--resume`` crashed again).

Pure: token ids in, problems out; the caller tokenises with
:func:`megagrpo.data.prompts.prompt_ids`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from megagrpo.data.config import TRUNCATION, DataConfig
from megagrpo.errors import ConfigError, DataError
from megagrpo.types import Problem

log = logging.getLogger(__name__)


@dataclass
class PromptPolicyResult:
    """What :func:`apply_prompt_policy` kept and changed.

    Attributes:
        problems: the problems to use, in input order (``left``: over-long ones are copies
            whose ``meta['prompt_ids']`` holds the kept tail and ``meta['prompt_truncated_from']``
            the original length).
        dropped: ids of problems dropped (``delete``).
        truncated: ids of problems truncated (``left``).
        lengths: problem id -> prompt length in tokens before the policy.
    """

    problems: list[Problem]
    dropped: list[str] = field(default_factory=list)
    truncated: list[str] = field(default_factory=list)
    lengths: dict[str, int] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """``data/prompts_dropped`` and ``data/prompts_truncated`` counts."""
        return {
            "data/prompts_dropped": float(len(self.dropped)),
            "data/prompts_truncated": float(len(self.truncated)),
        }


def resolve_max_prompt_tokens(data: DataConfig, max_model_len: int, max_tokens: int) -> int:
    """``data.max_prompt_tokens``, or ``max_model_len - max_tokens`` when it is 0. ConfigError
    when a prompt of that length would leave no room to generate."""
    limit = data.max_prompt_tokens or (max_model_len - max_tokens)
    if limit < 1 or limit >= max_model_len:
        raise ConfigError(
            f"config key 'data.max_prompt_tokens': {limit} leaves no room to generate within "
            f"rollout.max_model_len={max_model_len} (rollout.max_tokens={max_tokens})"
        )
    return limit


def apply_prompt_policy(
    problems: Sequence[Problem],
    prompt_ids: Sequence[Sequence[int]],
    max_prompt_tokens: int,
    policy: str,
    *,
    where: str = "data.train",
) -> PromptPolicyResult:
    """Apply ``policy`` (``delete`` | ``left`` | ``error``) to prompts longer than
    ``max_prompt_tokens``; ``prompt_ids[i]`` are the ids ``[P_i]`` of ``problems[i]``.

    Raises DataError (``error``: naming up to 10 problems with their lengths) and ConfigError
    for an unknown policy. ``where`` names the data set in messages.
    """
    if policy not in TRUNCATION:
        raise ConfigError(f"config key 'data.truncation': must be one of {TRUNCATION}")
    if len(prompt_ids) != len(problems):
        raise ValueError(f"{len(problems)} problems but {len(prompt_ids)} prompts")
    result = PromptPolicyResult(problems=[])
    long: list[tuple[str, int]] = []
    for problem, ids in zip(problems, prompt_ids):
        n = len(ids)
        result.lengths[problem.id] = n
        if n <= max_prompt_tokens:
            result.problems.append(problem)
            continue
        long.append((problem.id, n))
        if policy == "delete":
            result.dropped.append(problem.id)
        elif policy == "left":
            meta = {
                **problem.meta,
                "prompt_ids": [int(t) for t in ids[n - max_prompt_tokens :]],
                "prompt_truncated_from": n,
            }
            result.problems.append(dataclasses.replace(problem, meta=meta))
            result.truncated.append(problem.id)
    if long and policy == "error":
        shown = ", ".join(f"{pid} ({n} tokens)" for pid, n in long[:10])
        raise DataError(
            f"{where}: {len(long)} prompts are longer than data.max_prompt_tokens="
            f"{max_prompt_tokens}: {shown}{' ...' if len(long) > 10 else ''}; set "
            "data.truncation=delete (drop them) or left (keep their end), or raise "
            "rollout.max_model_len"
        )
    if long:
        log.warning(
            "%s: %d of %d prompts are longer than %d tokens: %s (data.truncation=%s), e.g. %s",
            where,
            len(long),
            len(problems),
            max_prompt_tokens,
            "dropped" if policy == "delete" else "left-truncated",
            policy,
            [pid for pid, _ in long[:3]],
        )
    return result
