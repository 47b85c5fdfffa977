"""Renderings of one problem handed to the members of its group.

A multiple-choice policy can collapse onto one letter: when every answer of a group is ``d``
all G rewards are equal, the group carries no advantage, and nothing pulls the policy back
(``collapse/answer_bias`` in :mod:`megagrpo.rewards.answers` reports it). A problem may
therefore list *variants*: equivalent questions whose gold letter differs (the options in
another order, "choose option b" for "choose option c"). With ``data.variants: per_member``
the G members of a group answer different variants in turn, so a policy that always says
``d`` is right for some members and wrong for the others of the same group: its groups no
longer collapse, and the advantage rewards reading the question over the letter.

Data: an ms-swift row's ``variants`` is a list of ``{"query": <user text>, "solution": ...}``
(the query replaces the row's last user turn; system and earlier turns are kept) or
``{"messages": [...], "solution": ...}``. List every rendering the members should draw from
(the row's own too, if it should be drawn). Loaded as ``meta['variants']``: ``[{"messages",
"answer"}]``.

A round (:func:`expand_round`) turns each problem with variants into one engine request per
variant drawn, with the members of the group spread over the variants (member ``i`` answers
variant ``(o + i) mod V``, ``o`` drawn from the round's seed and the problem id, so a resumed
run draws the same), and :func:`fold_round` puts the completions back into one group per
problem with :attr:`~megagrpo.types.Group.member_variants` and
:attr:`~megagrpo.types.Group.member_prompt_ids`. Rewards, answer metrics and the training
batch read each completion against its own variant
(:meth:`~megagrpo.types.Group.member_slices`). Evaluation and the level profile always use
the problem itself.

``data.variants: rotate`` also gives every problem whose question megagrpo renders itself
(IgakuQA) the rotations of its options (:func:`rotated_choices`): C variants, the gold at
each letter in turn. A question whose text names an option by its letter must not be
rotated; IgakuQA's do not (they say "2つ選べ").
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from megagrpo.data.config import PromptConfig
from megagrpo.data.gold import parse_gold
from megagrpo.data.prompts import LETTERS, render_messages
from megagrpo.errors import DataError
from megagrpo.types import Group, Problem


def parse_variants(raw: object, base: list[dict], where: str) -> list[dict]:
    """``meta['variants']`` of a row: ``[{"messages": [...], "answer": [...]}]`` from the row's
    ``variants`` (see module docstring); ``base`` are the row's prompt turns. DataError naming
    ``where`` (file:line) and the variant for anything malformed."""
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{where}: 'variants' must be a non-empty list of objects")
    out = []
    for k, item in enumerate(raw):
        at = f"{where}: variants[{k}]"
        if not isinstance(item, dict):
            raise DataError(f"{at} must be an object with 'query' or 'messages' and 'solution'")
        if "messages" in item:
            messages = item["messages"]
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages
            ):
                raise DataError(f"{at}: 'messages' must be a list of {{role, content}}")
        elif isinstance(item.get("query"), str):
            users = [i for i, m in enumerate(base) if m.get("role") == "user"]
            if not users:
                raise DataError(f"{at}: the row has no user turn for 'query' to replace")
            messages = [dict(m) for m in base]
            messages[users[-1]] = {"role": "user", "content": item["query"]}
        else:
            raise DataError(f"{at} needs 'query' (a string) or 'messages'")
        gold = parse_gold(item.get("solution", item.get("answer")))
        if not gold:
            raise DataError(f"{at}: 'solution' must be option letters or a number")
        out.append({"messages": messages, "answer": sorted(set(gold), key=gold.index)})
    return out


def rotated_choices(problem: Problem, prompt: PromptConfig | None = None) -> list[dict]:
    """``data.variants: rotate``: the variants of a problem whose question and choices megagrpo
    renders itself (IgakuQA: ``meta['question']``, ``meta['choices']``): the options rotated by
    k = 0 .. C-1 (``k = 0``: as written), each gold letter moved with its option (``"a or d"``
    entries letter by letter). ``[]`` for a numeric question or one without those fields."""
    choices = list(problem.meta.get("choices") or [])
    question = problem.meta.get("question")
    if len(choices) < 2 or question is None or not problem.answer:
        return []
    if any(not re.fullmatch(r"[a-z](?: or [a-z])*", a) for a in problem.answer):
        return []  # a number: no option to move
    n = len(choices)
    out = []
    for k in range(n):
        options = [choices[(i - k) % n] for i in range(n)]

        def move(m: re.Match) -> str:
            return LETTERS[(LETTERS.index(m.group(0)) + k) % n]  # noqa: B023 - used at once

        answer = [re.sub(r"\b[a-z]\b", move, a) for a in problem.answer]
        out.append({"messages": render_messages(str(question), options, prompt), "answer": answer})
    return out


def has_variants(problem: Problem) -> bool:
    return bool(problem.meta.get("variants"))


@dataclass
class _Entry:
    problem: int
    """Index of the round's problem this request belongs to."""
    variant: int


def member_assignment(problem: Problem, n: int, seed: int) -> list[int]:
    """The variant of each of ``n`` members ``[n]``: ``(o + i) mod V``, ``o`` from the round's
    seed and the problem id (``[-1] * n`` for a problem without variants)."""
    variants = problem.meta.get("variants") or []
    if not variants:
        return [-1] * n
    o = zlib.crc32(f"{seed}:{problem.id}".encode()) % len(variants)
    return [(o + i) % len(variants) for i in range(n)]


def expand_round(
    problems: Sequence[Problem], counts: int | Sequence[int], seed: int
) -> tuple[list[Problem], list[int], list[_Entry]]:
    """One engine request per (problem, variant drawn): the requests, their completion counts
    and the plan :func:`fold_round` needs; ``counts``: one for every problem, or one each. A
    problem without variants is one request as is."""
    if isinstance(counts, int):
        counts = [counts] * len(problems)
    requests: list[Problem] = []
    sizes: list[int] = []
    plan: list[_Entry] = []
    for j, (problem, n) in enumerate(zip(problems, counts)):
        drawn: dict[int, int] = {}
        for k in member_assignment(problem, int(n), seed):
            drawn[k] = drawn.get(k, 0) + 1
        for k, c in drawn.items():
            requests.append(problem.variant(k))
            sizes.append(c)
            plan.append(_Entry(j, k))
    return requests, sizes, plan


_PER_COMPLETION = ("completions", "token_ids", "logprobs", "lengths", "finish_reasons", "routing")


def fold_round(
    groups: Sequence[Group], problems: Sequence[Problem], plan: Sequence[_Entry]
) -> list[Group]:
    """One group per problem from the requests' groups of :func:`expand_round` (in its
    order); a problem with variants gets ``member_variants`` and ``member_prompt_ids``."""
    if len(groups) != len(plan):
        raise RuntimeError(f"{len(groups)} groups for {len(plan)} requests")
    parts: list[list[tuple[_Entry, Group]]] = [[] for _ in problems]
    for entry, group in zip(plan, groups):
        parts[entry.problem].append((entry, group))
    out = []
    for problem, mine in zip(problems, parts):
        first = mine[0][1]
        if not has_variants(problem):
            first.problem = problem
            out.append(first)
            continue
        merged = Group(
            problem=problem,
            completions=[],
            token_ids=[],
            logprobs=[],
            prompt_ids=list(first.prompt_ids),
            meta=dict(first.meta),
            member_variants=[e.variant for e, g in mine for _ in range(g.size)],
            member_prompt_ids=[list(g.prompt_ids) for _, g in mine for _ in range(g.size)],
        )
        for name in _PER_COMPLETION:
            setattr(merged, name, [x for _, g in mine for x in getattr(g, name)])
        out.append(merged)
    return out
