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

    def variant(self, k: int) -> Problem:
        """Rendering ``k`` of ``meta['variants']`` (``data.variants``) as a problem of its own:
        same id, ``meta['variant'] = k``, no truncated ``prompt_ids``; ``k = -1``: this one."""
        if k < 0:
            return self
        v = self.meta["variants"][k]
        meta = {key: val for key, val in self.meta.items() if key not in ("variants", "prompt_ids")}
        meta["variant"] = k
        return Problem(id=self.id, messages=v["messages"], answer=list(v["answer"]), meta=meta)


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
        member_variants: per completion, which rendering of the problem it answered: ``k``
            is ``problem.meta['variants'][k]`` (an equivalent question whose gold letter
            differs, e.g. the options in another order), ``-1`` the problem itself. Empty:
            every completion answered the problem itself (see :mod:`megagrpo.data.variants`).
        member_prompt_ids: per completion, the prompt ids ``[P_i]`` it continues, when the
            members answered different renderings; empty: all continue ``prompt_ids``.
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
    member_variants: list[int] = field(default_factory=list)
    member_prompt_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.lengths and self.token_ids:
            self.lengths = [len(t) for t in self.token_ids]

    @property
    def size(self) -> int:
        """G, the number of completions."""
        return len(self.completions)

    def prompt_of(self, i: int) -> list[int]:
        """The prompt ids ``[P_i]`` completion ``i`` continues."""
        return self.member_prompt_ids[i] if self.member_prompt_ids else self.prompt_ids

    def variant_of(self, i: int) -> int:
        """The rendering completion ``i`` answered (``-1``: the problem itself)."""
        return self.member_variants[i] if self.member_variants else -1

    def member_slices(self) -> list[tuple[Problem, list[int]]]:
        """The completions by the problem they answered: ``[(problem, indices)]`` in order of
        first appearance (one item, every index, when the members share the problem)."""
        if not self.member_variants:
            return [(self.problem, list(range(self.size)))]
        order: dict[int, list[int]] = {}
        for i, k in enumerate(self.member_variants):
            order.setdefault(k, []).append(i)
        return [(self.problem.variant(k), idx) for k, idx in order.items()]

    def member_golds(self) -> list[list[str]]:
        """Per completion, the gold of the rendering it answered ``[G]``."""
        golds: list[list[str]] = [[] for _ in range(self.size)]
        for problem, idx in self.member_slices():
            for i in idx:
                golds[i] = list(problem.answer)
        return golds
