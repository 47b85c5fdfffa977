"""Core data types shared by every component: a problem, and a group of G rollouts for it.

These are the contract between the curriculum, rollout, reward and trainer code
(``../shared/DESIGN.md``, "Interfaces"). They are plain dataclasses: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: this module imports no torch
    import torch


@dataclass
class Problem:
    """One training or evaluation problem.

    Attributes:
        id: unique problem id (IgakuQA: ``"112A1"``).
        messages: chat messages ``[{"role": ..., "content": ...}]`` that make the prompt
            (already rendered; see :mod:`megagrpo.data.prompts`).
        answer: gold answer set, lower-case option letters (``["c", "d"]``) or digit strings.
        meta: everything else: ``choices``, ``points``, ``text_only``, ``year``,
            ``human_accuracy``, ``source`` (file path), ``num_choose`` ...
    """

    id: str
    messages: list[dict[str, str]]
    answer: list[str]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Group:
    """G sampled completions for one problem, with what the trainer needs of them.

    Attributes:
        problem: the problem the completions answer.
        completions: decoded completion texts, ``len == G``.
        token_ids: per completion, the sampled token ids ``[L_i]`` (completion only).
        logprobs: per completion, the sampling policy's log-prob of each sampled token
            ``[L_i]`` (empty lists when the engine does not return them).
        rewards: total (weighted) reward per completion, ``[G]``; filled by the reward step.
        lengths: completion lengths in tokens, ``[G]``.
        prompt_ids: the prompt token ids ``[P]`` the completions continue.
        finish_reasons: ``"stop"`` or ``"length"`` per completion.
        reward_parts: per reward function name, its unweighted values ``[G]``.
        meta: free-form (e.g. ``step`` generated at, for staleness of carried groups).
        routing: per completion, the engine's MoE expert choices for every position it fed
            through the model: an int16 tensor ``[P + L_i - 1, num_layers, top_k]`` (expert
            ids; row t routes input token t of ``prompt_ids + token_ids``; the last sampled
            token was never fed; rows of dense layers are 0). Empty when the engine returned
            none (dense model, ``rollout.return_routing`` off). See
            :mod:`megagrpo.rollout.routing`.
    """

    problem: Problem
    completions: list[str]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    rewards: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    reward_parts: dict[str, list[float]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    routing: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.lengths and self.token_ids:
            self.lengths = [len(t) for t in self.token_ids]

    @property
    def size(self) -> int:
        """G, the number of completions."""
        return len(self.completions)
