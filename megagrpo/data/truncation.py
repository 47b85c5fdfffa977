"""The over-long prompt policy (``data.truncation``), applied once when the data loads.

A prompt longer than ``max_prompt_tokens`` either stops the run before step 1 naming the
problems (``error``), is dropped and counted (``delete``), or keeps its last
``max_prompt_tokens`` tokens (``left``, ms-swift's GRPO default: the start of the prompt,
system prompt included, is cut). The default ``max_prompt_tokens`` leaves every prompt the full
completion budget: ``rollout.max_model_len - rollout.max_tokens``. Before this, a long
prompt was sampled mid-run and crashed the engine (and ``--resume`` crashed again).

Pure: token ids in, problems out; the caller tokenises with
:func:`megagrpo.data.prompts.prompt_ids`. A prompt so long that it cannot fit whatever its
tokens (:class:`CharBound`: more characters than ``max_prompt_tokens`` tokens of the
vocabulary's longest token could hold) is not tokenised whole: a 40 MB line cost 8.8 GB and
140 s to tokenise before it was dropped. It is passed as :class:`AtLeast` (its length a lower
bound, with the last tokens of its tail for ``left``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megagrpo.data import prompts
from megagrpo.data.config import TRUNCATION, DataConfig
from megagrpo.errors import ConfigError, DataError
from megagrpo.types import Problem

log = logging.getLogger(__name__)


class AtLeast(list):
    """Prompt ids of a prompt known to be longer than the limit without tokenising it whole:
    ``length`` is a lower bound of its length in tokens; the list holds the last tokens of its
    tail (``left`` keeps those; empty otherwise)."""

    def __init__(self, length: int, tail: Sequence[int] = ()) -> None:
        super().__init__(tail)
        self.length = int(length)


class CharBound:
    """Cheap lower bound of a text's length in tokens: no token of ``tokenizer``'s
    vocabulary spells more than ``max_chars`` characters, so a text of C characters has at
    least ``C / max_chars`` tokens; divided again by ``SAFETY`` for normalisers that merge
    characters (NFKC: a half-width kana and its voicing mark become one). Costs one pass over
    the vocabulary (~0.1 s at 150k tokens)."""

    SAFETY = 4

    def __init__(self, tokenizer: Any) -> None:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.max_chars = max((len(str(t)) for t in vocab), default=0) or 1_000_000
        self.per_token = self.max_chars * self.SAFETY

    def min_tokens(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """A lower bound of the prompt tokens of ``messages`` (their contents' characters)."""
        chars = sum(len(str(m.get("content", ""))) for m in messages)
        return chars // self.per_token

    def tail_chars(self, limit: int) -> int:
        """Characters of a text's end that hold at least ``limit`` tokens (and a margin)."""
        return 2 * limit * self.per_token + 4096


def prompt_length(ids: Sequence[int]) -> int:
    """Length in tokens of prompt ids (:class:`AtLeast`: its lower bound)."""
    return ids.length if isinstance(ids, AtLeast) else len(ids)


def measure_prompt(
    tokenizer: Any, problem: Problem, limit: int, bound: CharBound, tail: bool
) -> list[int]:
    """:func:`megagrpo.data.prompts.prompt_ids`, or :class:`AtLeast` without tokenising a
    prompt whose characters alone exceed ``limit`` tokens (``tail``: with the ids of its last
    characters, what ``left`` keeps)."""
    at_least = bound.min_tokens(problem.messages)
    if at_least <= limit or "prompt_ids" in problem.meta:
        return prompts.prompt_ids(tokenizer, problem)
    if not tail:
        return AtLeast(at_least)
    text = prompts.render_prompt_text(tokenizer, problem)[-bound.tail_chars(limit) :]
    return AtLeast(at_least, tokenizer(text, add_special_tokens=False)["input_ids"][-limit:])


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
    long: list[tuple[str, str]] = []
    for problem, ids in zip(problems, prompt_ids):
        n = ids.length if isinstance(ids, AtLeast) else len(ids)
        result.lengths[problem.id] = n
        if n <= max_prompt_tokens:
            result.problems.append(problem)
            continue
        long.append((problem.id, f"{'>= ' if isinstance(ids, AtLeast) else ''}{n}"))
        if policy == "delete":
            result.dropped.append(problem.id)
        elif policy == "left":
            meta = {
                **problem.meta,
                "prompt_ids": [int(t) for t in list(ids)[-max_prompt_tokens:]],
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
